"""Multi-turn rollouts (`workers/rollout/workflow.py`): the conversation's bookkeeping, the Python tool's calls,
and the rollout loop answering them, with a scripted engine so that every turn is known (the tool in the sandbox:
tests/integration)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import msgspec
import pytest

from pipeline.demo_model import build_model, build_tokenizer
from schemas.messages import Segment
from tests.unit.workers.test_worker_loops import GROUP, announce, config_for, wait_for
from topics.memory import MemoryTransport
from topics.names import TopicLayout
from workers.rollout import worker as rollout_worker
from workers.rollout.protocol import EngineStats, SamplingParams, Sequence
from workers.rollout.workflow import Conversation, PythonTool, Workflow, load_workflow
from workers.weights import WeightsFile


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    build_model(path, build_tokenizer(path), seed=0)
    return path


def test_a_conversation_keeps_whose_each_token_is_and_the_completion_budget():
    params = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=(1, 9))
    conversation = Conversation([4, 5])
    turn = Sequence("p/0", [4, 5], params, token_ids=[6, 9], logprobs=[-0.5, -0.25], versions=[0, 1])
    assert conversation.with_turn(turn) == ([6, 9], [-0.5, -0.25], [0, 1], [1, 1])
    conversation.add(turn, reply=[7, 7], version=1)
    assert (conversation.token_ids, conversation.loss_mask, conversation.versions) == (
        [6, 9, 7, 7],
        [1, 1, 0, 0],
        [0, 1, 1, 1],
    )
    assert conversation.logprobs == [-0.5, -0.25, 0.0, 0.0] and conversation.calls == 1
    prompt, next_params = conversation.next_turn(params)
    assert prompt == [4, 5, 6, 9, 7, 7] and next_params.max_new_tokens == 4 and next_params.stop_token_ids == (1, 9)
    conversation.add(
        Sequence("p/0", prompt, next_params, token_ids=[3, 3, 9], logprobs=[0.0] * 3, versions=[2] * 3), [8], 2
    )
    assert conversation.next_turn(params) is None  # 8 tokens written: no room for another turn


def test_the_python_tool_writes_a_sum_as_a_call_and_its_reply():
    tool = PythonTool()
    assert tool.demonstrate("3:17+6=23,2:23+6=29;\\boxed{29}") == "3:[17+6]23,2:[23+6]29;\\boxed{29}"


@pytest.mark.parametrize(
    ("spec", "says"),
    [("nosuch", "use python"), ("json:JSONDecoder", "not a subclass"), ("missing.py:Tool", "cannot be loaded")],
)
def test_a_bad_workflow_is_a_one_line_error(spec, says):
    with pytest.raises(ValueError, match=says):
        load_workflow(spec)
    assert load_workflow("") is None and isinstance(load_workflow("python"), PythonTool)


class Doubler(Workflow):
    """Replies `77` to every call ending with `=`."""

    call_end = "="
    max_calls = 1

    def respond(self, transcript: str) -> str:
        assert transcript.endswith("=")
        return "77"


class ScriptedEngine:
    """Writes `script[turn]` for each sequence's turn, a token per step, and can hold at one step until the gate
    opens, saying it is idle meanwhile (a weight update lands there). Stands in for the engine so that turns and
    versions are known exactly."""

    def __init__(self, script: list[list[int]], vocab: int, hold_at: int):
        self.script, self.vocab, self.version, self.hold_at, self.steps = script, vocab, 0, hold_at, 0
        self.reached, self.gate = threading.Event(), threading.Event()
        self.sequences: list[Sequence] = []
        self.turns: dict[str, int] = {}
        self.prompts: list[list[int]] = []

    def submit(self, key: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        seq = Sequence(key, list(prompt_ids), params)
        self.sequences.append(seq)
        self.prompts.append(list(prompt_ids))
        return seq

    def held(self) -> bool:
        return self.steps >= self.hold_at and not self.gate.is_set()

    def step(self) -> list[Sequence]:
        self.steps += 1
        if self.held():
            self.reached.set()
            return []
        for seq in self.sequences:
            script = self.script[self.turns.get(seq.key, 0)]
            seq.token_ids.append(script[len(seq.token_ids)])
            seq.logprobs.append(-0.5)
            seq.versions.append(self.version)
            if len(seq.token_ids) == len(script):
                seq.finish_reason = "stop"
                self.turns[seq.key] = self.turns.get(seq.key, 0) + 1
        done = [s for s in self.sequences if s.finish_reason]
        self.sequences = [s for s in self.sequences if not s.finish_reason]
        return done

    def running(self) -> list[Sequence]:
        return list(self.sequences)

    def idle(self) -> bool:
        return self.held() or not self.sequences

    def interrupt(self) -> list[Sequence]:
        return list(self.sequences)

    def update_weights(self, weights: WeightsFile) -> None:
        self.version = weights.version

    def abort(self, key: str) -> Sequence | None:
        return None

    def stats(self) -> EngineStats:
        return EngineStats(self.version, len(self.sequences), 0, 8, 0, 0, 0)

    def close(self) -> None:
        pass


async def test_rollout_loop_answers_calls_masks_replies_and_a_turn_crossing_an_update_holds_two_versions(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    tokenizer = build_tokenizer(model_dir)
    ids = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    script = [ids("12+3="), [*ids("5"), tokenizer.eos_token_id]]  # turn 1 ends with a call, turn 2 with EOS
    engine = ScriptedEngine(script, vocab=len(tokenizer), hold_at=2)
    monkeypatch.setattr(rollout_worker, "make_engine", lambda config: engine)
    spec = f"{Path(__file__).resolve()}:Doubler"
    config = config_for(
        tmp_path, model_dir, "data.n_samples=2", "rollout.max_new_tokens=20", f"rollout.workflow={spec}"
    )
    group = msgspec.structs.replace(GROUP, released_at_version=0, prompt_tokens=ids("1+2="))
    transport, stop = MemoryTransport(TopicLayout()), asyncio.Event()
    segments = lambda: transport.broker.messages("segments", Segment)  # noqa: E731
    async with transport.outbox() as outbox:
        await outbox.send_now("prompts", group, key=group.prompt_id)
        task = asyncio.create_task(rollout_worker.main(config, stop, transport))
        try:
            await wait_for(engine.reached.is_set)
            await outbox.send_now("weights", announce(config, 1, seed=1))
            await asyncio.sleep(0.3)  # the update lands while the engine holds
            engine.gate.set()
            await wait_for(lambda: sum(s.finish_reason == "stop" for s in segments()) == 2)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
    reply = ids("77")
    for sample in ("e0-r1/0", "e0-r1/1"):
        parts = [s for s in segments() if s.trajectory_id == sample]
        assert [s.finish_reason for s in parts] == ["interrupted", "tool", "stop"]
        assert [s.version for s in parts] == [0, 1, 1]  # the first turn crossed the update: v0 then v1
        assert [s.token_ids for s in parts] == [script[0][:1], script[0][1:] + reply, script[1]]
        assert parts[0].loss_mask == [] and parts[2].loss_mask == []  # model tokens only
        assert parts[1].loss_mask == [1] * 4 + [0] * len(reply)  # the reply is not trained on
        assert parts[1].logprobs == [-0.5] * 4 + [0.0] * len(reply)
    assert engine.prompts[-1] == group.prompt_tokens + script[0] + reply  # the next turn sees the reply
