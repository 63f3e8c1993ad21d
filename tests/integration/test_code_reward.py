"""`data.reward=code` and the `code` task's verifier, in the real sandbox: right and wrong programs for both shapes
of tests, limits, and programs that try to pass without computing the answer.

bwrap comes from the `bubblewrap` fixture (tests/conftest.py); `make system-deps` installs Debian's package.
"""

from __future__ import annotations

import json

import pytest

from workers.reward import functions
from workers.rows import parse_row
from workers.sandbox.code import check_asserts, partial_code_reward
from workers.tasks import EOS_TEXT, load_task
from workers.tasks.code import parse, solution

pytestmark = pytest.mark.usefixtures("bubblewrap")
ASSERTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(40, 2) == 42\nassert add(0, 0) is not None"
RIGHT = "def add(a, b):\n    return a + b\n"
ATTACKED = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(40, 2) == 42"
SECRET = 987654321  # an expected value no program could guess


def row(**fields) -> dict[str, str]:
    """The metadata a JSONL row gives the reward function (non-string fields arrive as JSON text)."""
    parsed = parse_row(0, json.dumps({"prompt": "write it", "answer": "", **fields}))
    return {**parsed.metadata, "answer": parsed.answer}


def code(completion: str, metadata: dict[str, str]) -> tuple[float, dict[str, str]]:
    return functions.load("code")("write it", completion, metadata)


def test_asserts_as_a_string_or_a_json_list():
    for metadata in (row(tests=ASSERTS), row(tests=ASSERTS.split("\n"))):
        assert code(RIGHT, metadata) == (1.0, {"passed": "4/4"})
        reward, details = code("def add(a, b):\n    return a * b + 1\n", metadata)
        assert reward == 0.0 and details["passed"] == "2/4" and details["reason"] == "assert add(2, 3): got 7"
    fenced = f"Here it is:\n```python\n{RIGHT}```\nand a usage example:\n```python\nprint(add(1, 2))\n```"
    assert code(fenced, row(tests=ASSERTS))[0] == 1.0  # the first fence is the program
    assert functions.answer_key("code")(fenced) == RIGHT.strip()


def test_setup_statements_run_after_the_program():
    tests = "import math\nEXPECTED = [1, 2]\nassert sorted_pair(2, 1) == EXPECTED\nassert math.isclose(half(3), 1.5)"
    program = "def sorted_pair(a, b):\n    return sorted([a, b])\ndef half(x):\n    return x / 2\n"
    assert code(program, row(tests=tests)) == (1.0, {"passed": "2/2"})


def test_stdin_stdout_pairs():
    metadata = row(inputs=["3 4\n", "10 -2\n", "0 0\n"], outputs=["7\n", "8", "0 \n"])
    assert code("a, b = map(int, input().split())\nprint(a + b)", metadata) == (1.0, {"passed": "3/3"})
    reward, details = code("a, b = map(int, input().split())\nprint(a * b)", metadata)
    assert reward == 0.0 and details == {"passed": "0/3", "reason": "input 1: wrong output"}  # stops at the first
    crash = "a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)"
    assert code(crash, metadata)[0] == 0.0  # the right output and then an error is an error
    assert partial_code_reward("", "print(7)", metadata) == (
        1 / 3,
        {"passed": "1/3", "reason": "input 2: wrong output"},
    )


def test_partial_credit_is_the_share_passed():
    assert partial_code_reward("", "def add(a, b):\n    return 5\n", row(tests=ASSERTS))[0] == 0.5


def test_an_infinite_loop_times_out_with_its_reason():
    reward, details = code("def add(a, b):\n    while True:\n        pass\n", row(tests=ASSERTS))
    assert reward == 0.0 and "limit of" in details["reason"]  # CPU or wall clock, as the machine goes
    reward, details = code("while True:\n    pass\n", row(inputs=["1", "2"], outputs=["1", "2"]))
    assert reward == 0.0 and details["reason"].startswith("input 1: ") and "limit of" in details["reason"]
    reward, details = code("import time\ntime.sleep(60)\n", row(inputs=["1"], outputs=["1"]))
    assert reward == 0.0 and "wall-clock limit" in details["reason"]


def test_a_row_without_tests_is_the_rows_fault():
    for metadata, says in [
        (row(), "no tests"),
        (row(tests="this is not python ("), "not Python"),
        (row(tests="print('no assert')"), "no assert"),
        (row(inputs=["1"], outputs=["1", "2"]), "1 inputs and 2 outputs"),
        (row(inputs="1", outputs="1"), "JSON list of strings"),
    ]:
        with pytest.raises(ValueError, match=says):
            code(RIGHT, metadata)


@pytest.mark.parametrize(
    "attack",
    [
        "import sys\nsys.exit(0)",  # ends before the tests
        "import os\nos._exit(0)",
        "raise SystemExit",
        # prints what the harness prints, with the marker read from the harness's own job, then leaves
        "import os, sys\njob = sys.modules['__main__'].job\n"
        "for i, _ in enumerate(job['probes']):\n    print(job['marker'], i, 'ok', -1)\nsys.stdout.flush()\nos._exit(0)",
        # the same, and lets the harness run too: a test reported twice fails
        "import sys\njob = sys.modules['__main__'].job\n"
        "for i, _ in enumerate(job['probes']):\n    print(job['marker'], i, 'ok', 5)\n"
        "def add(a, b):\n    return a + b + 1\n",
        # replaces the harness's reporting so that every value is a pass: it would have to know the values
        "import sys\nmain = sys.modules['__main__']\nreal = main.report\n"
        "main.report = lambda index, status, text: real(index, 'ok', 'True')\ndef add(a, b):\n    return 0\n",
        # objects that equal anything, or an int that says it does
        "class Any:\n    __eq__ = lambda self, other: True\n    __ne__ = lambda self, other: False\n"
        "def add(a, b):\n    return Any()\n",
        "class Int(int):\n    __eq__ = lambda self, other: True\ndef add(a, b):\n    return Int(1)\n",
        # overwrites the program the sandbox runs (read-only) and the tests (never a file)
        "try:\n    open('/sandbox/main.py', 'w').write('print(1)')\nexcept OSError:\n    pass\n"
        "def add(a, b):\n    return 1\n",
    ],
)
def test_programs_that_do_not_compute_the_answer_get_nothing(attack):
    reward, details = code(attack, row(tests=ATTACKED))
    assert reward == 0.0 and details["passed"] == "0/3", details


def test_the_expected_values_never_enter_the_sandbox():
    """Whatever the program can read (the harness's file and globals, its stdin, its process) holds no expected
    value: a program that returns one it finds there would pass (its own source spells it otherwise)."""
    look = (
        "import os, sys\nmain = sys.modules['__main__']\n"
        "seen = open('/sandbox/main.py').read() + repr(vars(main)) + sys.stdin.read()\n"
        "seen += open('/proc/self/cmdline').read() + repr(os.environ)\n"
        f"target = {SECRET - 1} + 1\n"
        "def add(a, b):\n    return target if str(target) in seen else -1\n"
    )
    reward, details = code(look, row(tests=f"assert add(1, 2) == {SECRET}"))
    assert reward == 0.0 and details["reason"] == "assert add(1, 2): got -1"
    assert code(look.replace("in seen", "not in seen"), row(tests=f"assert add(1, 2) == {SECRET}"))[0] == 1.0


def test_a_truth_crosses_as_data_too():
    truthy = "def is_even(n):\n    return object()\n"  # real Python's assert would pass it
    assert check_asserts(truthy, "assert is_even(4)").passed == 0
    assert (
        check_asserts("def is_even(n):\n    return n % 2 == 0\n", "assert is_even(4)\nassert not is_even(3)").passed
        == 2
    )


def test_the_code_task_runs_its_hidden_tests():
    task, partial = load_task("code"), load_task("code-partial")
    train, _ = task.split(0, 200)
    problem = next(p for p in train if p.prompt == "add 3, times 2\n")
    assert problem.solution == "def f(x):\n x=x+3\n x=x*2\n return x" == problem.answer
    assert task.score(problem.solution + EOS_TEXT + "garbage", problem.answer) == 1.0
    assert task.score("def f(x):\n    return 2 * x + 6", problem.answer) == 1.0  # any program computing it
    backwards = solution(parse(problem.answer)[::-1])  # the warm-up teacher's mistake
    assert backwards == "def f(x):\n x=x*2\n x=x+3\n return x" and task.score(backwards, problem.answer) == 0.0
    assert partial.score("def f(x):\n return 2*x+6 if x else 7", problem.answer) == 0.8  # f(0) is wrong
    assert task.score("def f(x):\n while 1: pass", problem.answer) == 0.0
    assert task.score("garbage(((", problem.answer) == 0.0
    assert (
        code(problem.solution, row(tests=problem.metadata["tests"]))[0] == 1.0
    )  # the rows' tests, as data.reward=code
