"""Multi-turn rollouts: what the environment says between the model's turns.

A model turn that ends with the workflow's `call_end` is a call: the workflow answers it with text (a tool's
output), which is appended to the trajectory and conditioned on but never trained (loss mask 0), and the model
goes on from there on whatever weights are current then. A workflow is one file of yours, a subclass of
`Workflow` named as `rollout.workflow=path/to/file.py:Class`; built in: `python` (`PythonTool`).

`Conversation` is one trajectory across its turns; the rollout worker drives it, and so does `generate_turns`
for evaluation.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from workers.plugins import load_class
from workers.rollout.protocol import RolloutEngine, SamplingParams, Sequence
from workers.sandbox.bwrap import Limits, require_bwrap, run_python


class Workflow:
    """The environment of a multi-turn rollout. Subclass it and override `respond` (and `demonstrate`)."""

    call_end: str = "]"  # ends a model turn with a call; must be one token of the model's vocabulary
    max_calls: int = 8  # calls answered per trajectory; a turn ending with a call past them ends it
    max_reply_chars: int = 64  # a reply is cut to this many characters
    alphabet: str = ""  # characters of its calls a demo model's tokenizer must also spell

    def check(self) -> None:
        """Raise, with one line saying what to do, when this machine cannot run the workflow (pre-flight)."""

    def respond(self, transcript: str) -> str:
        """The reply to the call at the end of `transcript` (the prompt and everything written since, model
        turns and replies, ending with `call_end`). Runs in a thread of its own; may block."""
        raise NotImplementedError

    def demonstrate(self, solution: str) -> str:
        """A task's worked solution as a model using this workflow would write it, replies included (warm-up
        demonstrations). The identity by default."""
        return solution


# The program the Python tool runs: the call's code from stdin; the value of a last expression is printed.
REPL = """
import ast, sys
tree = ast.parse(sys.stdin.read())
last = tree.body.pop().value if tree.body and isinstance(tree.body[-1], ast.Expr) else None
scope = {}
exec(compile(tree, "<call>", "exec"), scope)
if last is not None:
    print(eval(compile(ast.Expression(last), "<call>", "eval"), scope))
"""
SUM = re.compile(r"(\d+[-+*]\d+)=(-?\d+)")  # "17+6=23" in a worked solution


class PythonTool(Workflow):
    """The model writes `[code]`; the code runs in the sandbox (`workers/sandbox/bwrap.py`) and what it prints,
    or the value of its last expression, follows the call: `[17+6]23`. A failure replies `error`."""

    call_start = "["
    alphabet = "[]"
    max_calls = 32  # one per written-out step: `chain` has up to 25 (at 8, the 17.5 % of its problems with more failed)
    limits = Limits(cpu_s=1.0, wall_s=3.0, memory_mb=128, processes=4, output_bytes=4096)

    def check(self) -> None:
        require_bwrap()

    def respond(self, transcript: str) -> str:
        code = transcript[transcript.rfind(self.call_start) + len(self.call_start) : -len(self.call_end)]
        execution = run_python(REPL, stdin=code, limits=self.limits)
        return execution.stdout.strip() if execution.status == "ok" else "error"

    def demonstrate(self, solution: str) -> str:
        """Every written-out sum becomes a call and its reply: `3:17+6=23,` -> `3:[17+6]23,`."""
        return SUM.sub(lambda m: f"{self.call_start}{m[1]}{self.call_end}{m[2]}", solution)


BUILTIN: dict[str, type[Workflow]] = {"python": PythonTool}


def load_workflow(spec: str) -> Workflow | None:
    """The workflow `rollout.workflow` names ("" = single turn), or ValueError saying why it cannot be used."""
    return load_class(spec, Workflow, "rollout.workflow", BUILTIN)() if spec else None


@dataclass
class Conversation:
    """One trajectory across its turns: every token after the prompt, whose it is and under which version."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # finished turns and the replies to them
    logprobs: list[float] = field(default_factory=list)  # behaviour logprobs; 0.0 on replies
    versions: list[int] = field(default_factory=list)  # the version of each model token; a reply takes its turn's
    loss_mask: list[int] = field(default_factory=list)  # 1 on model tokens, 0 on replies
    calls: int = 0

    def with_turn(self, seq: Sequence | None) -> tuple[list[int], list[float], list[int], list[int]]:
        """Tokens, logprobs, versions and loss mask of the whole trajectory with `seq` (the turn under way, if any)."""
        if seq is None:
            return self.token_ids, self.logprobs, self.versions, self.loss_mask
        return (
            self.token_ids + seq.token_ids,
            self.logprobs + seq.logprobs,
            self.versions + seq.versions,
            self.loss_mask + [1] * len(seq.token_ids),
        )

    def transcript(self, seq: Sequence, tokenizer) -> str:
        """The text a workflow answers: the prompt, and every turn and reply up to the call ending `seq`."""
        return tokenizer.decode(self.prompt_ids + self.with_turn(seq)[0])

    def add_reply(self, seq: Sequence, text: str, tokenizer, params: SamplingParams, max_chars: int) -> None:
        """The call's turn `seq` and the reply `text`, cut to `max_chars` and to leave the model room for one
        more token (the completion budget is the model's turns and the replies together)."""
        room = params.max_new_tokens - len(self.token_ids) - len(seq.token_ids) - 1
        self.add(seq, tokenizer.encode(text[:max_chars], add_special_tokens=False)[: max(room, 0)], seq.versions[-1])

    def add(self, seq: Sequence, reply: list[int], version: int) -> None:
        """A finished turn and the tokens of the reply to its call."""
        self.token_ids, self.logprobs, self.versions, self.loss_mask = self.with_turn(seq)
        self.token_ids += reply
        self.logprobs += [0.0] * len(reply)
        self.versions += [version] * len(reply)
        self.loss_mask += [0] * len(reply)
        self.calls += 1

    def next_turn(self, params: SamplingParams) -> tuple[list[int], SamplingParams] | None:
        """The prompt and sampling params of the next turn, within the completion budget; None when none is left."""
        room = params.max_new_tokens - len(self.token_ids)
        if room < 1:
            return None
        return self.prompt_ids + self.token_ids, replace(params, max_new_tokens=room)


def call_token_of(tokenizer, call_end: str) -> int:
    """The one token that ends a call; ValueError in one line when `call_end` is not one token of the model."""
    ids = tokenizer.encode(call_end, add_special_tokens=False)
    if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
        raise ValueError(f"rollout.workflow: call_end {call_end!r} is not one token of this model's tokenizer ({ids})")
    return ids[0]


def is_call(seq: Sequence, call_token: int | None) -> bool:
    """Whether the turn `seq` ended with a call (its last token is the workflow's call token)."""
    return call_token is not None and seq.finish_reason == "stop" and seq.token_ids[-1:] == [call_token]


def generate_turns(
    engine: RolloutEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    workflow: Workflow,
    tokenizer,
    on_finished: Callable[[list[Sequence]], None] | None = None,
) -> list[Sequence]:
    """`generate_all` with calls answered (evaluation): each result holds the whole completion, replies
    included, and the finish reason of its last turn. Calls are answered in threads while the engine goes on."""
    call_token = call_token_of(tokenizer, workflow.call_end)
    conversations = {f"generate/{i}": Conversation(list(p)) for i, p in enumerate(prompts)}
    results: dict[str, Sequence] = {}
    for key, conversation in conversations.items():
        engine.submit(key, conversation.prompt_ids, params)
    with ThreadPoolExecutor(max_workers=4) as pool:
        calls: dict[str, tuple[Sequence, Future]] = {}
        while not engine.idle() or calls:
            ended = []
            for seq in engine.step() if not engine.idle() else []:
                conversation = conversations[seq.key]
                if is_call(seq, call_token) and conversation.calls < workflow.max_calls:
                    calls[seq.key] = seq, pool.submit(workflow.respond, conversation.transcript(seq, tokenizer))
                else:
                    ended.append(whole(conversation, seq))
            for key, (seq, reply) in list(calls.items()):
                if reply.done() or engine.idle():
                    conversation = conversations[key]
                    conversation.add_reply(seq, reply.result(), tokenizer, params, workflow.max_reply_chars)
                    if (turn := conversation.next_turn(params)) is None:
                        ended.append(whole(conversation, Sequence(key, [], params, finish_reason="length")))
                    else:
                        engine.submit(key, *turn)
                    del calls[key]
            results.update((seq.key, seq) for seq in ended)
            if on_finished is not None:
                on_finished(ended)
    return [results[key] for key in conversations]


def whole(conversation: Conversation, last: Sequence) -> Sequence:
    """The trajectory as one sequence: every turn and reply, and the last turn's finish reason."""
    tokens, logprobs, versions, _ = conversation.with_turn(last)
    return Sequence(last.key, conversation.prompt_ids, last.params, tokens, logprobs, versions, last.finish_reason)
