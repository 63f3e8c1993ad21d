"""Code judged by running it against tests in the sandbox, with the verdict taken outside it.

Two shapes of tests, the ones public code-RL datasets carry:

- asserts (`assert f(3) == 14`): one sandbox execution runs the program, then evaluates each probe of the
  asserts on its own and prints its value. A probe is a largest part of an assert that needs the program
  (`area(2)` in `assert abs(area(2) - 12.566) < 1e-3`); the literals, operators, comparisons, subscripts and
  the few pure built-ins around it (abs, round, len, sorted, math.isclose ...: `CALLS`) are computed here, so the
  expected value never enters the sandbox. A value crosses only as plain data (exact built-in types throughout,
  as a Python literal), and the assert is judged here from those values: no exit, printed line, patched builtin
  or object of the program's (whose `__repr__`, `__eq__` or `__abs__` could say anything) fakes a pass, since a
  value it sends must itself pass the assert here: it would have to compute it. What can be faked: an assert
  whose expected value sits inside a probe, that is inside a comprehension or lambda (`assert all(f(x) == y for
  ...)`), a name of the tests' setup (`assert f(2) == EXPECTED`) or a call other than those built-ins; one that
  compares two values of the program (`assert f(x) == g(x)`); and one judged by its truth alone (`assert
  is_prime(7)`): a program that reads the harness's job can send the harness's lines itself, with the values
  that pass. The `code` task's tests (`assert f(-7)==-8`) have none of these shapes. Statements among the tests
  other than asserts (imports, helpers) run once after the program.
- HumanEval's `check(candidate)`: tests that define `check`, whose asserts judge the function `entry_point`.
  One execution runs the program, the tests and `check(<entry_point>)`, which passes when it returns. Its asserts
  run inside the sandbox, so a candidate that returns an object equal to anything passes them (as with
  HumanEval's own harness), and so does a program that reads the harness's job and sends its line.
- stdin/stdout pairs: one execution per input; the stripped output, compared here line by line (trailing
  spaces ignored), must be the expected one, which never enters the sandbox.

`code_reward` is `data.reward=code`: a row's `tests` field (a string of asserts, or a JSON list of them; or the
`check(candidate)` form with an `entry_point` field) or its `inputs`/`outputs` fields (JSON lists of strings);
`partial_code_reward` gives the share of tests passed. The program is the completion's code (`extract_code`),
put together with the row's `code_prompt` where it has one (`assemble`: HumanEval's prompts).
"""

from __future__ import annotations

import ast
import builtins
import copy
import json
import math
import operator
import re
import secrets
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from workers.sandbox.bwrap import Execution, Limits, run_python

LIMITS = Limits(cpu_s=2.0, wall_s=4.0, memory_mb=256, processes=8, file_mb=8, output_bytes=65536)
BUDGET_S = 8.0  # wall clock for all stdin/stdout executions of one completion (below reward.timeout_s' default)
MAX_VALUE_CHARS = 16384  # a tested value's repr longer than this fails its test
# A fence's opening line: blanks, maybe a language and blanks, one newline; each run of blanks tried once (in
# linear time: two runs side by side would make a line of blanks without a newline cost its length squared).
FENCE = re.compile(r"```[ \t]*(?:(?:python3?|py)[ \t]*)?\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
CHECK = re.compile(r"^def[ \t]+check[ \t]*\(", re.MULTILINE)  # HumanEval's form of tests
LEADING_BLANK_LINES = re.compile(r"\A(?:[ \t]*\n)+")
HOSTED = (ast.Constant, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.UnaryOp, ast.BinOp, ast.BoolOp, ast.Compare)
HOSTED += (ast.IfExp, ast.Subscript, ast.Slice)  # what this process computes of a test (and calls: CALLS)
PROBE = "probe "  # a placeholder's name: not an identifier, so no test's name is one
MAX_BITS = 1 << 20  # the largest int the host computes while judging (a program's values meet the tests' literals)
MAX_ITEMS = 1 << 20  # the longest sequence it builds
SINGLETONS = (None, True, False)  # what `is` compares with in tests (`assert f(x) is None`): the same objects here
MATH_CALLS = {"isclose", "sqrt", "floor", "ceil", "fabs", "isnan", "isinf", "pi", "e", "inf"}
CALLS: dict[str, Callable[..., object]] = {
    name: getattr(builtins, name)
    for name in ("abs", "len", "min", "max", "sum", "sorted", "set", "list", "tuple", "dict", "bool", "all", "any")
} | {"str": str, "int": int, "float": float, "round": lambda number, digits=None: round(number, bounded(digits))}
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
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_, ast.Invert: operator.invert}
BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.LShift: operator.lshift,
    ast.RShift: operator.rshift,
    ast.BitAnd: operator.and_,
    ast.BitOr: operator.or_,
    ast.BitXor: operator.xor,
}

# What runs in the sandbox for asserts: the job comes on stdin, read before the program runs. Each probe (a part
# of an assert that needs the program: `area(2)` of `assert abs(area(2) - 12.566) < 1e-3`) is evaluated on its
# own; its value goes out as a Python literal, and only when it is plain data (exact built-in types all the way
# down: no object of the program's, whose __repr__, __eq__ or __abs__ could say anything), on a line of its own
# with the job's marker (which sets the harness's lines apart from the program's prints), written to a copy of
# stdout that the program's redirections do not touch.
HARNESS = f"""
import json, os, sys
job = json.loads(sys.stdin.read())
out = os.dup(1)
SCALARS = (int, float, complex, str, bytes, bool, type(None))
def plain(value):
    kind = type(value)
    if kind in (list, tuple, set):
        return all(plain(item) for item in value)
    if kind is dict:
        return all(plain(key) and plain(item) for key, item in value.items())
    return kind in SCALARS
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
        value = eval(compile(source, "<test>", "eval"), scope)
        if plain(value):
            report(index, "ok", repr(value))
        else:
            report(index, "error", "not plain data: an object of type " + type(value).__name__)
    except BaseException as exc:
        report(index, "error", type(exc).__name__ + ": " + str(exc))
"""


@dataclass(frozen=True)
class Check:
    """One assert: its expression (`source`), and the same with each part that needs the program replaced by a
    placeholder for a probe's value (`template`), which this process evaluates once the values come back."""

    source: str
    template: ast.expr
    probes: tuple[tuple[int, str], ...]  # (index in the job's probes, source)


@dataclass(frozen=True)
class Raised:
    """A probe that raised in the sandbox, or whose value was no plain data."""

    text: str


class Unjudged(Exception):
    """An assert that cannot pass: a probe raised, or this process would not compute what the test asks."""


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


def extract_code(completion: str, entry_point: str = "") -> str:
    """The code of a completion: of its ```python (or bare ```) fences (an unclosed one runs to the end), the first
    that defines `entry_point`, else the first that is not empty; without such a fence, the text less its empty
    fences. Leading blank lines and trailing blanks go; the first line's indentation stays (a bare function body
    continues its signature)."""
    fenced = [found[1] for found in FENCE.finditer(completion) if found[1].strip()]
    defining = [code for code in fenced if entry_point and defines(code, entry_point)]
    code = (defining or fenced or [FENCE.sub("", completion)])[0]
    return LEADING_BLANK_LINES.sub("", code).rstrip()


def definitions(code: str, entry_point: str) -> list[int]:
    """Where `code` defines the function `entry_point` at its top level (offsets of each `def` line)."""
    if not entry_point:
        return []
    pattern = rf"^(?:async[ \t]+)?def[ \t]+{re.escape(entry_point)}[ \t]*\("
    return [found.start() for found in re.finditer(pattern, code, re.MULTILINE)]


def defines(code: str, entry_point: str) -> bool:
    return bool(definitions(code, entry_point))


def function_body(code: str) -> str:
    """A bare function body: its lines up to the first that starts at column 0 after the first (a stop string such
    as "\ndef " ends a raw completion with it; comments at column 0 stay)."""
    lines = code.split("\n")
    end = next((i for i, line in enumerate(lines[1:], 1) if line[:1] not in ("", " ", "\t", "#")), len(lines))
    return "\n".join(lines[:end]).rstrip()


def assemble(code: str, code_prompt: str, entry_point: str) -> str:
    """The program a completion's `code` stands for, beside the `code_prompt` it answers (imports, helpers, then
    the signature with its docstring, as HumanEval's prompts are): a program that defines `entry_point` after the
    prompt's code before its signature (the imports and helpers), a bare function body after the whole prompt;
    without a prompt, the code alone (dedented)."""
    if not code_prompt:
        return textwrap.dedent(code)
    if defines(code, entry_point):
        starts = definitions(code_prompt, entry_point)
        head = code_prompt[: starts[-1]].strip() if starts else ""
        return f"{head}\n\n\n{code}\n" if head else f"{code}\n"
    return f"{code_prompt.rstrip()}\n{function_body(code)}\n"


def judged_here(node: ast.expr) -> bool:
    """Whether this process computes `node` from its parts' values: literals, displays, operators, comparisons,
    subscripts and a few pure built-in calls; names, attributes, other calls, comprehensions and lambdas are the
    program's to evaluate. `is` only against None, True or False (identity means nothing across processes)."""
    if isinstance(node, ast.Call):
        return not any(isinstance(a, (ast.Starred, ast.GeneratorExp)) for a in node.args) and (
            (isinstance(node.func, ast.Name) and node.func.id in CALLS)
            or (is_math(node.func) and node.func.attr in MATH_CALLS)
        )
    if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
        sides = (node.left, *node.comparators)
        return len(node.ops) == 1 and any(
            isinstance(side, ast.Constant) and any(side.value is s for s in SINGLETONS) for side in sides
        )
    if is_math(node):
        return node.attr in MATH_CALLS
    return isinstance(node, HOSTED) and not (isinstance(node, ast.Dict) and None in node.keys)


def is_math(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "math"


def split(node: ast.expr, probes: list[str]) -> ast.expr:
    """`node` with each largest part that needs the program replaced by a placeholder, its source in `probes`."""
    if not judged_here(node):
        probes.append(ast.unparse(node))
        return ast.Name(f"{PROBE}{len(probes) - 1}", ast.Load())
    node = copy.copy(node)
    for field, value in ast.iter_fields(node):
        if field == "func" or (isinstance(node, ast.Attribute) and field == "value"):
            continue  # a call's name, or math's: checked by judged_here
        if isinstance(value, ast.expr):
            setattr(node, field, split(value, probes))
        elif isinstance(value, list):
            setattr(node, field, [split_item(item, probes) for item in value])
    return node


def split_item(item: object, probes: list[str]) -> object:
    if isinstance(item, ast.expr):
        return split(item, probes)
    if isinstance(item, ast.keyword):
        return ast.keyword(item.arg, split(item.value, probes))
    return item  # an operator


def evaluate(node: ast.expr, values: dict[int, object]) -> object:
    """A template's value, from plain data only: Unjudged when a probe it needs raised or an operation would
    outgrow MAX_BITS or MAX_ITEMS (a program's value should not make this process compute for ever)."""
    match node:
        case ast.Constant(value=value):
            return value
        case ast.Name(id=name):
            value = values[int(name.removeprefix(PROBE))]
            if isinstance(value, Raised):
                raise Unjudged(value.text)
            return value
        case ast.Tuple(elts=items) | ast.List(elts=items) | ast.Set(elts=items):
            kind = {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)]
            return kind(evaluate(item, values) for item in items)
        case ast.Dict(keys=keys, values=items):
            return {evaluate(key, values): evaluate(item, values) for key, item in zip(keys, items, strict=True)}
        case ast.UnaryOp(op=op, operand=operand):
            return UNARY[type(op)](evaluate(operand, values))
        case ast.BinOp(left=left, op=op, right=right):
            return binary(op, evaluate(left, values), evaluate(right, values))
        case ast.BoolOp(op=op, values=operands):
            for operand in operands:
                result = evaluate(operand, values)
                if bool(result) is isinstance(op, ast.Or):
                    return result
            return result
        case ast.Compare(left=left, ops=ops, comparators=comparators):
            before = evaluate(left, values)
            for op, comparator in zip(ops, comparators, strict=True):
                after = evaluate(comparator, values)
                if not COMPARE[type(op)](before, after):
                    return False
                before = after
            return True
        case ast.IfExp(test=test, body=body, orelse=orelse):
            return evaluate(body if evaluate(test, values) else orelse, values)
        case ast.Subscript(value=value, slice=index):
            return evaluate(value, values)[evaluate(index, values)]
        case ast.Slice(lower=lower, upper=upper, step=step):
            return slice(*(None if part is None else evaluate(part, values) for part in (lower, upper, step)))
        case ast.Attribute(attr=name):
            return getattr(math, name)
        case ast.Call(func=func, args=args, keywords=keywords):
            call = getattr(math, func.attr) if isinstance(func, ast.Attribute) else CALLS[func.id]
            return call(*(evaluate(a, values) for a in args), **{k.arg: evaluate(k.value, values) for k in keywords})
    raise Unjudged(f"cannot judge {ast.unparse(node)}")


def binary(op: ast.operator, left: object, right: object) -> object:
    """`left op right`, refused when it would build an int or a sequence past the bounds."""
    ints = isinstance(left, int) and isinstance(right, int)
    if isinstance(op, ast.Pow) and ints and right > 0 and abs(left) > 1:
        bounded(left.bit_length() * right)
    elif isinstance(op, ast.LShift) and ints:
        bounded(left.bit_length() + right)
    elif isinstance(op, ast.Mult) and isinstance(left, (str, bytes, list, tuple)) and isinstance(right, int):
        bounded(len(left) * right)
    elif isinstance(op, ast.Mult) and isinstance(right, (str, bytes, list, tuple)) and isinstance(left, int):
        bounded(len(right) * left)
    elif isinstance(op, ast.Mod) and isinstance(left, (str, bytes)):
        raise Unjudged("string formatting in a test")
    return BINARY[type(op)](left, right)


def bounded(size: int | None) -> int | None:
    if size is not None and abs(size) > MAX_BITS:
        raise Unjudged(f"a value of {size} bits or items: too large to judge")
    return size


def parse_tests(tests: str | list[str]) -> tuple[str, list[Check], list[str]]:
    """(setup statements, one check per top-level assert, the probes of all) of tests; ValueError when they are
    no tests."""
    source = "\n".join(tests) if isinstance(tests, list) else tests
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ValueError(f"the tests are not Python: {exc}") from None
    checks, probes = [], []
    for node in tree.body:
        if isinstance(node, ast.Assert):
            first = len(probes)
            template = split(node.test, probes)
            checks.append(Check(ast.unparse(node.test), template, tuple(enumerate(probes[first:], start=first))))
    if not checks:
        raise ValueError("the tests hold no assert statement")
    setup = [node for node in tree.body if not isinstance(node, ast.Assert)]
    return ast.unparse(ast.Module(setup, type_ignores=[])), checks, probes


def judge(check: Check, lines: dict[int, list[tuple[str, str]]], execution: Execution) -> str:
    """'' when the assert holds, computed here from its probes' values as data; else why not, in one line."""
    values, seen = {}, []
    for index, source in check.probes:
        mine = lines.get(index, [])
        if not mine:
            return f"assert {source}: no result ({execution.reason or 'the program ended before it'})"[:300]
        if len(mine) > 1:
            return f"assert {source}: {len(mine)} results (the program printed the harness's lines)"[:300]
        status, text = mine[0]
        seen.append(f"assert {source}: {'raised ' if status == 'error' else 'got '}{text}")
        try:
            values[index] = ast.literal_eval(text) if status == "ok" else Raised(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            values[index] = Raised(f"not a literal: {text}")
    try:
        holds = bool(evaluate(check.template, values))
    except Exception as exc:  # Unjudged, or what the values' operations raise: a failed test
        holds, seen = False, seen or [f"assert {check.source}: {exc}"]
    return "" if holds else (", ".join(seen) or f"assert {check.source}: false")[:300]


def reported(execution: Execution, marker: str) -> dict[int, list[tuple[str, str]]]:
    """The harness's lines of an execution by test index (-1: the program or setup failed)."""
    lines: dict[int, list[tuple[str, str]]] = {}
    for line in execution.stdout.split("\n"):
        fields = line.split(" ", 3)
        if len(fields) == 4 and fields[0] == marker and fields[1].lstrip("-").isdigit():
            lines.setdefault(int(fields[1]), []).append((fields[2], fields[3]))
    return lines


def check_asserts(code: str, tests: str | list[str], limits: Limits = LIMITS) -> Verdict:
    """Run `code`, then each probe of `tests` separately, in one sandbox execution, and judge each assert here
    from its probes' values. A probe counts only on one line of the harness's; a second line for it (printed
    by the program) fails its assert."""
    setup, checks, probes = parse_tests(tests)
    marker = secrets.token_hex(16)
    job = {"marker": marker, "code": code, "setup": setup, "probes": probes}
    execution = run_python(HARNESS, stdin=json.dumps(job), limits=limits)
    lines = reported(execution, marker)
    if -1 in lines:
        return Verdict(0, len(checks), f"the program failed: {lines[-1][0][1]}"[:300])
    reasons = [judge(check, lines, execution) for check in checks]
    return Verdict(reasons.count(""), len(checks), next((reason for reason in reasons if reason), ""))


def check_function(code: str, tests: str, entry_point: str, limits: Limits = LIMITS) -> Verdict:
    """HumanEval's form of tests: `tests` define `check(candidate)`, whose own asserts judge the program's function
    `entry_point`; it passes when `check(<entry_point>)` returns. One sandbox execution: the program, the tests,
    then the call; the reason of a failure is the exception's type and message ("AssertionError", "NameError:
    name 'x' is not defined"), the sandbox's reason (a timeout), or "no code found"."""
    if not entry_point.isidentifier():
        raise ValueError(f"entry_point {entry_point!r} is not a function name")
    if not code.strip():
        return Verdict(0, 1, "no code found")
    marker = secrets.token_hex(16)
    job = {"marker": marker, "code": code, "setup": tests, "probes": [f"check({entry_point})"]}
    execution = run_python(HARNESS, stdin=json.dumps(job), limits=limits)
    lines = reported(execution, marker)
    if -1 in lines:
        return Verdict(0, 1, raised(lines[-1][0][1]))
    mine = lines.get(0, [])
    if len(mine) != 1:
        reason = f"{len(mine)} results (the program printed the harness's lines)" if mine else None
        ended = f"{execution.status}: {execution.reason}" if execution.reason else "the program ended before the check"
        return Verdict(0, 1, reason or ended)
    status, text = mine[0]
    return Verdict(1, 1) if status == "ok" else Verdict(0, 1, raised(text))


def raised(text: str) -> str:
    """An exception as the harness reports it ("AssertionError: "), its empty message dropped."""
    return text.removesuffix(": ")[:300]


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
    entry_point = metadata.get("entry_point", "")
    found = extract_code(completion, entry_point)
    code = assemble(found, metadata.get("code_prompt", ""), entry_point) if found else ""
    if "tests" in metadata and entry_point and CHECK.search(metadata["tests"]):
        verdict = check_function(code, metadata["tests"], entry_point)
    elif "tests" in metadata:
        verdict = check_asserts(code, tests_field(metadata["tests"]))
    elif "inputs" in metadata and "outputs" in metadata:
        inputs, outputs = string_list(metadata, "inputs"), string_list(metadata, "outputs")
        verdict = check_io(code, inputs, outputs, partial)
    else:
        raise ValueError("the row has no tests: give it 'tests' (asserts) or 'inputs' and 'outputs'")
    return verdict.reward(partial), verdict.details()


def partial_code_reward(prompt: str, completion: str, metadata: dict[str, str]) -> tuple[float, dict[str, str]]:
    """`data.reward=workers.sandbox.code:partial_code_reward`: the share of the row's tests passed."""
    return code_reward(prompt, completion, metadata, partial=True)
