"""Code judged by running it against tests in the sandbox, with the verdict taken outside it.

Two shapes of tests, the ones public code-RL datasets carry:

- asserts (`assert f(3) == 14`): one sandbox execution runs the program, then evaluates each assert's tested
  expression on its own and prints its value. The value crosses as a Python literal (data, not an object of
  the program's whose `__eq__` could say anything) and is judged here: for a comparison with a literal
  (`==`, `!=`, `<`, `in`, `is None` ...) only the other side enters the sandbox, so the expected value never
  does, and no exit, printed line or patched builtin of the program fakes a pass: it would have to print the
  right values, that is, to compute them. What is left: an assert judged by its truth alone
  (`assert is_prime(7)`, `assert f(x) == g(x)`) could be faked by a program that reads the harness's job and
  prints the harness's lines itself, since a truth is all it must guess. Statements among the tests other
  than asserts (imports, helpers) run once after the program.
- stdin/stdout pairs: one execution per input; the stripped output, compared here line by line (trailing
  spaces ignored), must be the expected one, which never enters the sandbox.

`code_reward` is `data.reward=code`: a row's `tests` field (a string of asserts, or a JSON list of them) or its
`inputs`/`outputs` fields (JSON lists of strings); `partial_code_reward` gives the share of tests passed.
"""

from __future__ import annotations

import ast
import json
import operator
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from workers.reward.sandbox import Execution, Limits, run_python

LIMITS = Limits(cpu_s=2.0, wall_s=4.0, memory_mb=256, processes=8, file_mb=8, output_bytes=65536)
BUDGET_S = 8.0  # wall clock for all stdin/stdout executions of one completion (below reward.timeout_s' default)
MAX_VALUE_CHARS = 16384  # a tested value's repr longer than this fails its test
# A fence's opening line: blanks, maybe a language and blanks, one newline; each run of blanks tried once (in
# linear time: two runs side by side would make a line of blanks without a newline cost its length squared).
FENCE = re.compile(r"```[ \t]*(?:(?:python3?|py)[ \t]*)?\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
NOT_LITERAL = object()
SINGLETONS = (None, True, False)  # what `is` compares with in tests (`assert f(x) is None`): the same objects here
COMPARE: dict[type[ast.cmpop], Callable[[object, object], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda item, container: item in container,
    ast.NotIn: lambda item, container: item not in container,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}

# What runs in the sandbox for asserts: the job comes on stdin, read before the program runs. Each tested
# expression's repr goes out on a line of its own with the job's marker (which sets the harness's lines apart
# from the program's prints), written to a copy of stdout that the program's redirections do not touch.
HARNESS = f"""
import json, os, sys
job = json.loads(sys.stdin.read())
out = os.dup(1)
def report(index, status, text):
    text = text.replace("\\n", " ")
    if len(text) > {MAX_VALUE_CHARS}:
        status, text = "error", "value too long"
    os.write(out, ("\\n" + job["marker"] + " " + str(index) + " " + status + " " + text + "\\n").encode())
scope = {{"__name__": "solution"}}
try:
    exec(compile(job["code"], "<solution>", "exec"), scope)
    exec(compile(job["setup"], "<tests>", "exec"), scope)
except BaseException as exc:
    report(-1, "error", type(exc).__name__ + ": " + str(exc))
    os._exit(0)
for index, source in enumerate(job["probes"]):
    try:
        report(index, "ok", repr(eval(compile(source, "<test>", "eval"), scope)))
    except BaseException as exc:
        report(index, "error", type(exc).__name__ + ": " + str(exc))
"""


@dataclass(frozen=True)
class Probe:
    """One assert as the sandbox evaluates it (`source`, an expression) and as this process judges its value."""

    source: str
    check: Callable[[object], bool] = bool  # of the value, as data; the whole assert's truth by default


@dataclass(frozen=True)
class Verdict:
    passed: int
    total: int
    reason: str = ""  # why the first failed test failed; '' when all passed

    def reward(self, partial: bool = False) -> float:
        if partial:
            return self.passed / self.total
        return 1.0 if self.passed == self.total else 0.0

    def details(self) -> dict[str, str]:
        return {"passed": f"{self.passed}/{self.total}", **({"reason": self.reason} if self.reason else {})}


def extract_code(completion: str) -> str:
    """The code of a completion: its first ```python (or bare ```) fence when there is one (an unclosed fence runs
    to the end), else the whole text."""
    found = FENCE.search(completion)
    return (found[1] if found else completion).strip()


def literal(node: ast.expr) -> object:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return NOT_LITERAL


def probe_of(test: ast.Assert) -> Probe:
    """What the sandbox evaluates and how this process judges it: `not x` and a comparison with a literal on
    one side are judged here (the literal never enters the sandbox); anything else by the truth of its value."""
    check = test.test
    if isinstance(check, ast.UnaryOp) and isinstance(check.op, ast.Not):
        return Probe(ast.unparse(check.operand), operator.not_)
    if isinstance(check, ast.Compare) and len(check.ops) == 1 and type(check.ops[0]) in COMPARE:
        compare, left, right = COMPARE[type(check.ops[0])], check.left, check.comparators[0]
        identity = isinstance(check.ops[0], (ast.Is, ast.IsNot))
        if (value := literal(right)) is not NOT_LITERAL and (not identity or any(value is s for s in SINGLETONS)):
            return Probe(ast.unparse(left), lambda got: compare(got, value))
        if (value := literal(left)) is not NOT_LITERAL and not identity:
            return Probe(ast.unparse(right), lambda got: compare(value, got))
    return Probe(ast.unparse(check))


def parse_tests(tests: str | list[str]) -> tuple[str, list[Probe]]:
    """(setup statements, one probe per top-level assert) of tests; ValueError when they are no tests."""
    source = "\n".join(tests) if isinstance(tests, list) else tests
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ValueError(f"the tests are not Python: {exc}") from None
    probes = [probe_of(node) for node in tree.body if isinstance(node, ast.Assert)]
    if not probes:
        raise ValueError("the tests hold no assert statement")
    setup = [node for node in tree.body if not isinstance(node, ast.Assert)]
    return ast.unparse(ast.Module(setup, type_ignores=[])), probes


def passes(probe: Probe, status: str, text: str) -> bool:
    """The value printed crosses as a Python literal (data: no object of the program's, whose `__eq__` or
    `__bool__` could say anything) and is judged here."""
    if status != "ok":
        return False
    try:
        return bool(probe.check(ast.literal_eval(text)))
    except Exception:  # not a literal (an object of the program's), or values that cannot be compared
        return False


def reported(execution: Execution, marker: str) -> dict[int, list[tuple[str, str]]]:
    """The harness's lines of an execution by test index (-1: the program or setup failed)."""
    lines: dict[int, list[tuple[str, str]]] = {}
    for line in execution.stdout.split("\n"):
        fields = line.split(" ", 3)
        if len(fields) == 4 and fields[0] == marker and fields[1].lstrip("-").isdigit():
            lines.setdefault(int(fields[1]), []).append((fields[2], fields[3]))
    return lines


def check_asserts(code: str, tests: str | list[str], limits: Limits = LIMITS) -> Verdict:
    """Run `code`, then each assert of `tests` separately, in one sandbox execution. A test passes only on one
    line of the harness's, with a value that passes here; a second line for a test (printed by the program)
    fails it."""
    setup, probes = parse_tests(tests)
    marker = secrets.token_hex(16)
    job = {"marker": marker, "code": code, "setup": setup, "probes": [p.source for p in probes]}
    execution = run_python(HARNESS, stdin=json.dumps(job), limits=limits)
    lines = reported(execution, marker)
    if -1 in lines:
        return Verdict(0, len(probes), f"the program failed: {lines[-1][0][1]}"[:300])
    passed, reason = 0, ""
    for index, probe in enumerate(probes):
        mine = lines.get(index, [])
        if len(mine) == 1 and passes(probe, *mine[0]):
            passed += 1
        elif not reason:
            reason = failure(probe, mine, execution)
    return Verdict(passed, len(probes), reason)


def failure(probe: Probe, lines: list[tuple[str, str]], execution: Execution) -> str:
    """Why a test failed, in one line."""
    if not lines:
        return f"assert {probe.source}: no result ({execution.reason or 'the program ended before it'})"[:300]
    if len(lines) > 1:
        return f"assert {probe.source}: {len(lines)} results (the program printed the harness's lines)"[:300]
    status, text = lines[0]
    return f"assert {probe.source}: {'raised ' if status == 'error' else 'got '}{text}"[:300]


def same_output(got: str, expected: str) -> bool:
    return [line.rstrip() for line in got.strip().splitlines()] == [
        line.rstrip() for line in expected.strip().splitlines()
    ]


def check_io(
    code: str, inputs: list[str], outputs: list[str], partial: bool = False, limits: Limits = LIMITS
) -> Verdict:
    """Run `code` once per input on stdin, within BUDGET_S in all; stop at the first failure unless `partial`,
    and after a timeout in any case (the next input would most likely time out too)."""
    if len(inputs) != len(outputs) or not inputs:
        raise ValueError(f"{len(inputs)} inputs and {len(outputs)} outputs: need as many of each, at least one")
    deadline, passed, reason = time.monotonic() + BUDGET_S, 0, ""
    for number, (stdin, expected) in enumerate(zip(inputs, outputs, strict=True), start=1):
        left = deadline - time.monotonic()
        if left <= 0:
            reason = reason or f"input {number}: not run, the {BUDGET_S:g} s budget was spent"
            break
        execution = run_python(code, stdin=stdin, limits=replace(limits, wall_s=min(limits.wall_s, left)))
        if execution.status == "ok" and same_output(execution.stdout, expected):
            passed += 1
            continue
        reason = reason or f"input {number}: {execution.reason or 'wrong output'}"[:300]
        if not partial or execution.status == "timeout":
            break
    return Verdict(passed, len(inputs), reason)


def string_list(metadata: dict[str, str], field: str) -> list[str]:
    try:
        value = json.loads(metadata[field])
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"field {field!r} must be a JSON list of strings")
    return value


def tests_field(text: str) -> str | list[str]:
    """A row's `tests`: a JSON list of asserts (as the row gave it, kept as JSON text) or a string of them."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, list) and all(isinstance(item, str) for item in value) else text


def code_reward(
    prompt: str, completion: str, metadata: dict[str, str], partial: bool = False
) -> tuple[float, dict[str, str]]:
    """`data.reward=code`: 1.0 when the completion's code passes every test of its row (else 0.0, or with
    `partial` the share passed). A row without tests is the row's fault: ValueError, a failure reward."""
    code = extract_code(completion)
    if "tests" in metadata:
        verdict = check_asserts(code, tests_field(metadata["tests"]))
    elif "inputs" in metadata and "outputs" in metadata:
        inputs, outputs = string_list(metadata, "inputs"), string_list(metadata, "outputs")
        verdict = check_io(code, inputs, outputs, partial)
    else:
        raise ValueError("the row has no tests: give it 'tests' (asserts) or 'inputs' and 'outputs'")
    return verdict.reward(partial), verdict.details()


def partial_code_reward(prompt: str, completion: str, metadata: dict[str, str]) -> tuple[float, dict[str, str]]:
    """`data.reward=workers.reward.code:partial_code_reward`: the share of the row's tests passed."""
    return code_reward(prompt, completion, metadata, partial=True)
