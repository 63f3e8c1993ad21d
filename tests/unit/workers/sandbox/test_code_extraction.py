"""The code a completion stands for (`extract_code`, `assemble`): pure text, no sandbox."""

from __future__ import annotations

from workers.sandbox.code import assemble, extract_code, function_body

PROMPT = 'from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    """ The sum of xs. """\n'
FULL = "def total(xs):\n    return sum(xs)"


def test_an_empty_first_fence_is_skipped():
    assert extract_code("```python\n```\nThere:\n```python\ndef f():\n    return 1\n```") == "def f():\n    return 1"
    assert extract_code("```\n\n```\n```py\nx = 1\n```") == "x = 1"


def test_the_fence_that_defines_the_entry_point_is_taken():
    completion = f"Usage:\n```python\nprint(total([1]))\n```\nThe function:\n```python\n{FULL}\n```"
    assert extract_code(completion, "total") == FULL
    assert extract_code(completion) == "print(total([1]))"  # no entry point: the first fence
    assert extract_code(completion, "totals") == "print(total([1]))"


def test_a_bare_body_keeps_its_indentation():
    assert extract_code("\n\n    return sum(xs)\n\n") == "    return sum(xs)"
    assert extract_code("```python\n    return sum(xs)\n```") == "    return sum(xs)"


def test_without_code_there_is_nothing():
    assert extract_code("") == ""
    assert extract_code("```python\n```\n") == ""
    assert extract_code("I cannot write that.") == "I cannot write that."  # prose is the text: it fails to run


def test_text_around_empty_fences_is_kept():
    assert extract_code("```\n```\ndef f():\n    return 1") == "def f():\n    return 1"


def test_a_bare_body_follows_the_whole_prompt():
    assert assemble("    return sum(xs)", PROMPT, "total") == PROMPT + "    return sum(xs)\n"


def test_a_bare_body_ends_at_the_first_line_at_column_0():
    body = "    s = 0\n# a note\n    for x in xs:\n        s += x\n\n    return s\n\ndef"
    assert function_body(body) == "    s = 0\n# a note\n    for x in xs:\n        s += x\n\n    return s"
    assert assemble("    return 0\nprint(total([]))", PROMPT, "total") == PROMPT + "    return 0\n"


def test_a_full_function_replaces_the_signature_and_keeps_the_imports_and_helpers():
    assert assemble(FULL, PROMPT, "total") == f"from typing import List\n\n\n{FULL}\n"
    helper = "def double(x):\n    return 2 * x\n\n\ndef total(xs):\n"
    assert assemble("def total(xs):\n    return double(sum(xs))", helper, "total") == (
        "def double(x):\n    return 2 * x\n\n\ndef total(xs):\n    return double(sum(xs))\n"
    )
    assert assemble(FULL, 'def total(xs):\n    """Sum."""\n', "total") == FULL + "\n"


def test_without_a_prompt_the_code_stands_alone_dedented():
    assert assemble("    x = 1\n    print(x)", "", "") == "x = 1\nprint(x)"
    assert assemble(FULL, "", "total") == FULL
