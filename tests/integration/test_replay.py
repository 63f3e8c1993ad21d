"""`asyncrl replay` against a real broker: messages the workers would write, read back and shown."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import pytest
import yaml

from pipeline.cli import main
from pipeline.demo_model import build_tokenizer
from pipeline.replay import BrokerTopics, TrajectoryReplay, load_trajectory, render_trajectory, tail, version_runs
from schemas.messages import BatchManifest, DroppedGroup, Message, PromptGroup, Scored, Segment
from tests import factories
from topics.assembly import Attempt
from topics.broker import EmbeddedBroker
from topics.clients import make_producer, send
from topics.names import BATCHES, PROMPTS, SCORED, SEGMENTS, TopicLayout

# The demo tokenizer: one token per character.
CHAR_IDS = {"<eos>": 1, "1": 4, "2": 5, "3": 6, "+": 13, "=": 14}
ONE, TWO, THREE, EOS = CHAR_IDS["1"], CHAR_IDS["2"], CHAR_IDS["3"], CHAR_IDS["<eos>"]


def group(prompt_id: str) -> PromptGroup:
    return PromptGroup(
        prompt_id=prompt_id, row_index=0, epoch=0, release_index=0, released_at_version=2,
        prompt_text="1+2=", prompt_tokens=[ONE, 13, TWO, 14], answer="3", n_samples=2,
    )  # fmt: skip


def segment(attempt: str, index: int, version: int, tokens: list[int], finish: str) -> Segment:
    return factories.segment(
        attempt=attempt, segment_index=index, version=version, token_ids=tokens, logprobs=[-0.1] * len(tokens),
        finish_reason=finish, group=group("p/0") if index == 0 else None,
    )  # fmt: skip


def scored(trajectory_id: str, versions: list[int], reward: float) -> Scored:
    return factories.scored(
        group=group("p/0"), sample=int(trajectory_id[-1]), trajectory_id=trajectory_id, attempt="rollout-a:1",
        completion_tokens=[THREE, EOS][: len(versions)], logprobs=[-0.1] * len(versions), versions=versions,
        num_segments=2, reward=reward, completion_text="3",
    )  # fmt: skip


async def produce(bootstrap: str, layout: TopicLayout, role: str, messages: list[tuple[str, Message]]) -> None:
    """All in one go, so the producer puts them in multi-record batches."""
    async with make_producer(bootstrap, linger_ms=50) as producer:
        queued = [await send(producer, layout.name(role), message, key=key) for key, message in messages]
        for delivery in queued:
            await delivery


@pytest.fixture
async def run_topics(broker: EmbeddedBroker, topic_layout: TopicLayout) -> TopicLayout:
    """One prompt group of two trajectories; p/0/0 interrupted at v3 -> v4 and retried by a second worker."""
    await produce(broker.bootstrap, topic_layout, PROMPTS, [("p/0", group("p/0"))])
    await produce(broker.bootstrap, topic_layout, SEGMENTS, [
        ("p/0/0", segment("rollout-a:1", 0, 3, [THREE], "interrupted")),
        ("p/0/0", segment("rollout-b:1", 0, 3, [ONE, TWO], "interrupted")),
        ("p/0/0", segment("rollout-a:1", 1, 4, [EOS], "stop")),
        ("p/0/0", segment("rollout-a:1", 1, 4, [EOS], "stop")),  # delivered twice
    ])  # fmt: skip
    await produce(broker.bootstrap, topic_layout, SCORED, [
        ("p/0", scored("p/0/0", [3, 4], 1.0)),
        ("p/0", scored("p/0/1", [4], 0.0)),
    ])  # fmt: skip
    manifest = BatchManifest(
        step=2, trainer_version=5, trajectory_ids=["p/0/0", "p/0/1"], scored_offsets=[(0, 0), (0, 1)],
        consumed_offsets=[(0, 2)],
        dropped=[DroppedGroup(prompt_id="p/9", reason="stale: released at v0, trainer at v5 > eta=4")],
    )  # fmt: skip
    await produce(
        broker.bootstrap, topic_layout, BATCHES, [("1", msgspec.structs.replace(manifest, step=1)), ("2", manifest)]
    )
    return topic_layout


@pytest.fixture
def run_config(broker: EmbeddedBroker, run_topics: TopicLayout, tmp_path: Path) -> Path:
    """A resolved run config naming the broker, the prefix and a directory with the demo tokenizer."""
    build_tokenizer(tmp_path / "model")
    config = {
        "broker": {"bootstrap": broker.bootstrap, "topic_prefix": run_topics.prefix},
        "model": {"path": str(tmp_path / "model")},
        "reward": {"failure_reward": -1.0},  # what rescore gives a failed call
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def fake_decode(token_ids: list[int]) -> str:
    names = {number: text for text, number in CHAR_IDS.items()}
    return "".join(names[token] for token in token_ids)


async def test_trajectory_shows_every_attempt_with_the_versions_of_its_segments(
    broker: EmbeddedBroker, run_topics: TopicLayout
) -> None:
    replay = await load_trajectory(BrokerTopics(broker.bootstrap, run_topics), "p/0/0")
    assert [a.attempt for a in replay.attempts] == ["rollout-a:1", "rollout-b:1"]
    assert replay.attempts[0].versions == [3, 4]  # the duplicate delivery is not counted twice

    text = render_trajectory(replay, fake_decode)
    kept, other = text.split("\n\nattempt ")[1:]
    assert kept.startswith("rollout-a:1  (kept in scored: reward 1, stop)")
    assert "tokens: 3@v3 <eos>@v4" in kept and "versions: v3×1 v4×1" in kept
    assert "segment 0  @v3  interrupted" in kept and "segment 1  @v4  stop" in kept
    assert other.startswith("rollout-b:1  (not kept)") and "tokens: 1@v3 2@v3" in other
    assert 'prompt: "1+2="' in text


def test_trajectory_marks_tool_tokens() -> None:
    """A tool segment's output tokens (loss mask 0) show as @tool: they carry no version that trained."""
    attempt = Attempt("p/0/0", "rollout-a:1")
    calls = msgspec.structs.replace(segment("rollout-a:1", 0, 3, [ONE, TWO, THREE], "tool"), loss_mask=[1, 0, 0])
    for part in (calls, segment("rollout-a:1", 1, 4, [EOS], "stop")):
        attempt.add(part, None)
    text = render_trajectory(TrajectoryReplay("p/0/0", [attempt], None), fake_decode)
    assert "tokens: 1@v3 2@tool 3@tool <eos>@v4" in text and "segment 0  @v3  tool  3 tokens" in text


def test_replay_trajectory_command_decodes_with_the_run_tokenizer(
    run_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", "trajectory", "p/0/0", "--config", str(run_config)]) == 0
    out = capsys.readouterr().out
    assert 'text: "3<eos>"' in out and "tokens: 3@v3 <eos>@v4" in out
    assert "tokens: 1@v3 2@v3" in out and "(not kept)" in out


def test_replay_step_names_trajectories_staleness_and_dropped_reasons(
    run_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", "step", "2", "--config", str(run_config)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 2  trainer version 5  2 trajectories  1 dropped groups")
    assert "p/0/0  scored 0:0  reward 1  released at v2  staleness 3  v3×1 v4×1  stop" in out
    assert "p/0/1  scored 0:1  reward 0  released at v2  staleness 3  v4×1" in out
    assert "p/9: stale: released at v0, trainer at v5 > eta=4" in out
    assert main(["replay", "step", "7", "--config", str(run_config)]) == 1
    assert "no manifest of step 7" in capsys.readouterr().err


async def test_tail_filters_by_id_prefix_and_limits(broker: EmbeddedBroker, run_topics: TopicLayout) -> None:
    source = BrokerTopics(broker.bootstrap, run_topics)
    assert len(await tail(source, SEGMENTS, message_id="p/0")) == 4  # every trajectory of the prompt
    assert len(await tail(source, run_topics.name(SCORED), message_id="p/0/1")) == 1
    assert [r.message.step for r in await tail(source, BATCHES, limit=1)] == [2]
    assert [r.record.offset for r in await tail(source, SEGMENTS, from_offset=1, limit=2)] == [1, 2]
    assert await tail(source, SEGMENTS, message_id="p/0/0/") == []


def test_tail_command_prints_json_lines(run_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "tail", "scored", "--id", "p/0/1", "--json", "--config", str(run_config)]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert (record["offset"], record["key"], record["schema"]) == (1, "p/0", "Scored")
    assert record["message"]["versions"] == [4]
    assert main(["replay", "tail", "segments", "--limit", "1", "--config", str(run_config)]) == 0
    assert "key='p/0/0'  Segment\n  schema_version: 4\n  trajectory_id" in capsys.readouterr().out


def test_replay_reads_an_export_file(run_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.topics"
    assert main(["topics", "export", "--config", str(run_config), "--out", str(path)]) == 0
    assert main(["replay", "step", "2", "--export", str(path)]) == 0
    assert "p/0/0  scored 0:0  reward 1" in capsys.readouterr().out
    assert main(["replay", "rescore", "--reward", "builtin", "--json", "--export", str(path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["same"], summary["changed"], summary["failed"]) == (1, 1, 0)  # "3" is right: p/0/1 0 -> 1


@pytest.fixture
async def rescore_config(broker: EmbeddedBroker, run_config: Path, run_topics: TopicLayout) -> Path:
    """The recorded run plus: p/0/0 delivered twice, a completion the plugin fails on, a failed
    generation, and p/1/0 whose group (answer "5") is only on `segments`."""
    on_segments_only = msgspec.structs.replace(group("p/1"), answer="5")
    await produce(broker.bootstrap, run_topics, SEGMENTS, [
        ("p/1/0", msgspec.structs.replace(segment("rollout-a:2", 0, 4, [EOS], "stop"),
                                          trajectory_id="p/1/0", group=on_segments_only)),
    ])  # fmt: skip
    await produce(broker.bootstrap, run_topics, SCORED, [
        ("p/0", scored("p/0/0", [3, 4], 1.0)),
        ("p/0", msgspec.structs.replace(scored("p/0/2", [4], 0.5), completion_text="raise", n_samples=4)),
        ("p/0", msgspec.structs.replace(scored("p/0/3", [4], 0.0), finish_reason="error", n_samples=4,
                                        reward_details={"error": "engine died"})),
        ("p/1", msgspec.structs.replace(scored("p/1/0", [4], 0.0), prompt_id="p/1", completion_text="5")),
    ])  # fmt: skip
    return run_config


def test_rescore_shows_each_changed_reward_the_counts_and_the_means(
    rescore_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", "rescore", "--reward", "reward_plugins:judge", "--config", str(rescore_config)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "rescored 5 trajectories with reward_plugins:judge"  # p/0/0 once
    assert out[1:5] == [
        "  p/0/1  0 -> 1",
        "  p/0/2  0.5 -> -1  failed: RuntimeError: the user's verifier broke",
        "  p/0/3  0 -> -1  failed: generation failed: engine died",
        "  p/1/0  0 -> 1",  # the answer came from segment 0
    ]
    assert out[5:] == ["same 1  changed 2  failed 2", "mean reward 0.3 -> 0.2"]

    assert (
        main(["replay", "rescore", "--reward", "reward_plugins:judge", "--json", "--config", str(rescore_config)]) == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert (summary["trajectories"], summary["same"], summary["changed"], summary["failed"]) == (5, 1, 2, 2)
    assert (summary["mean_reward_old"], summary["mean_reward_new"]) == pytest.approx((0.3, 0.2))
    changed = {d["trajectory_id"]: d for d in summary["differences"]}
    assert changed["p/1/0"]["details"] == {"prompt_seen": "1+2="}
    assert "Traceback" in changed["p/0/2"]["details"]["error"]  # --json keeps the whole error


def test_rescore_with_a_bad_reward_is_one_clear_line(
    run_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # rescore puts the working directory on it
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken_reward.py").write_text("def judge(:\n")  # beside the user, as for the run's workers
    for reward, error in [
        (
            "no_such_module:fn",
            "--reward: reward function 'no_such_module:fn' cannot be loaded: No module named 'no_such_module'",
        ),
        (
            "reward_plugins",
            "--reward: data.reward 'reward_plugins': use builtin, math, math-strict, code, path/to/file.py:function or "
            "module:function",
        ),
        ("broken_reward:judge", "--reward: reward function 'broken_reward:judge' cannot be loaded: invalid syntax"),
    ]:
        assert main(["replay", "rescore", "--reward", reward, "--config", str(run_config)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"asyncrl: {error}") and err.count("\n") == 1 and "Traceback" not in err


def test_version_runs() -> None:
    assert version_runs([3, 3, 4, 3]) == "v3×2 v4×1 v3×1"
    assert version_runs([]) == "no tokens"
