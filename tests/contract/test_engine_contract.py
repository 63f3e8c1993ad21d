"""The RolloutEngine contract (workers/rollout/protocol.py): every installed engine through the same cases.

The torch engine always runs (on CPU here); vLLM where it is installed and CUDA is
present. The model is the demo-sized Qwen2, built locally with random weights in
float32; version 1 is another random draw, far enough from version 0 to change
greedy choices. A continuation is checked against a fresh sequence on the same
engine from the same prefix, so that each engine is held to itself (the torch
engine against Hugging Face and vLLM against the torch engine are unit tests).
"""

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from pipeline.demo_model import build_model, build_tokenizer
from workers.rollout.engine import Engine
from workers.rollout.protocol import RolloutEngine, SamplingParams, Sequence, generate_all
from workers.weights import WeightsError, WeightsFile, unique_state_dict, write_version

torch.set_num_threads(1)

MAX_BATCH = 4
PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [13], [5, 3, 6, 3, 7]]  # lengths 3, 7, 1, 5
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
INIT_STD = 0.3  # 15x the default: peaked logits that depend on the whole context, greedy choices far from ties


@dataclass(frozen=True)
class Model:
    path: Path  # a Hugging Face model directory (version 0)
    v0: WeightsFile
    v1: WeightsFile


def random_qwen2(config, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("model")
    config = build_model(path, build_tokenizer(path)).config  # the demo's architecture and files
    config.initializer_range = INIT_STD
    v0, v1 = (random_qwen2(config, seed) for seed in (0, 1))
    v0.save_pretrained(path)
    weights = tmp_path_factory.mktemp("weights")
    return Model(path, *(published(m, weights, v) for v, m in enumerate((v0, v1))))


def published(model, weights_dir: Path, version: int) -> WeightsFile:
    """`model` as the trainer publishes a version, with the sha256 it announces."""
    path, digest = write_version(unique_state_dict(model), weights_dir, version, keep=2)
    return WeightsFile(path, version, digest)


@pytest.fixture(scope="module")
def vllm_engine(model: Model) -> Iterator[RolloutEngine]:
    """One vLLM engine for the module: it takes long to start and holds most of the GPU's memory."""
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("vLLM runs on CUDA")
    from workers.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(str(model.path), max_batch=MAX_BATCH, seed=0, dtype="float32")
    yield engine
    engine.close()


@pytest.fixture(params=["torch", "vllm"])
def engine(request, model: Model) -> Iterator[RolloutEngine]:
    """A fresh engine at version 0; the shared vLLM one is emptied and set back to version 0 after each case,
    so the cases compare its stats() before and after, never with zero."""
    if request.param == "torch":
        policy = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32)
        yield Engine(policy, max_batch=MAX_BATCH, seed=0, tokenizer=AutoTokenizer.from_pretrained(model.path))
        return
    shared = request.getfixturevalue("vllm_engine")
    yield shared
    for seq in shared.running():
        shared.abort(seq.key)
    shared.update_weights(model.v0)


def run_out(engine: RolloutEngine) -> list[Sequence]:
    """Step until idle; every sequence that finished, in order."""
    done = []
    while not engine.idle():
        done += engine.step()
    return done


def continuation(engine: RolloutEngine, seq: Sequence, cut: int) -> list[int]:
    """What a fresh sequence from `seq`'s prompt + first `cut` tokens generates now, up to `seq`'s budget."""
    rest = replace(seq.params, max_new_tokens=seq.params.max_new_tokens - cut)
    return generate_all(engine, [seq.prompt_ids + seq.token_ids[:cut]], rest)[0].token_ids


def test_engine_implements_the_protocol(engine):
    assert isinstance(engine, RolloutEngine)
    stats = engine.stats()
    assert (stats.version, stats.running, stats.queued, stats.capacity) == (0, 0, 0, MAX_BATCH)
    assert engine.idle() and engine.running() == []


def test_greedy_is_deterministic_and_stops_at_its_limits(engine):
    first, again = generate_all(engine, PROMPTS, GREEDY), generate_all(engine, PROMPTS, GREEDY)
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    for seq in first:
        assert seq.finish_reason == "length" and len(seq.token_ids) == len(seq.logprobs) == GREEDY.max_new_tokens
        assert seq.versions == [0] * GREEDY.max_new_tokens and all(lp <= 0 for lp in seq.logprobs)
    free = first[1].token_ids
    stopped = generate_all(engine, [PROMPTS[1]], replace(GREEDY, stop_token_ids=(free[5],)))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free[: free.index(free[5]) + 1]


def test_a_stop_string_ends_a_sequence_with_the_token_completing_it(engine, model):
    """The completion keeps every token up to the one whose text completes the string, with its logprob."""
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    free = generate_all(engine, [PROMPTS[1]], GREEDY)[0]
    text = tokenizer.decode(free.token_ids)
    stop = text[len(tokenizer.decode(free.token_ids[:6])) - 1 :][:2]  # the 6th token's last character and the next
    keep = next(n for n in range(1, len(free.token_ids) + 1) if stop in tokenizer.decode(free.token_ids[:n]))
    stopped = generate_all(engine, [PROMPTS[1]], replace(GREEDY, stop=("never said", stop)))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:keep]
    assert stopped.logprobs == pytest.approx(free.logprobs[:keep], abs=1e-5) and stopped.versions == [0] * keep
    assert engine.idle() and engine.stats().running == 0


def test_sampled_tokens_each_carry_a_logprob_and_a_version(engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16)
    for seq in generate_all(engine, PROMPTS, params):
        assert len(seq.token_ids) == len(seq.logprobs) == len(seq.versions) == 16
        assert all(-torch.inf < lp <= 0 for lp in seq.logprobs) and set(seq.versions) == {0}


def test_a_refused_prompt_leaves_the_engine_usable(engine):
    ok = engine.submit("ok", PROMPTS[0], GREEDY)
    refused = [
        ("empty", [], GREEDY),
        ("long", [3] * 128, GREEDY),
        ("vocab", [3, 10**6], GREEDY),
        ("negative", [-1], GREEDY),
        ("params", [3], SamplingParams(top_p=0.0)),
        ("ok", PROMPTS[1], GREEDY),
    ]
    for key, prompt, params in refused:
        with pytest.raises(ValueError):
            engine.submit(key, prompt, params)
    assert engine.running() == [ok]
    assert run_out(engine) == [ok] and ok.finish_reason == "length"
    assert ok.token_ids == generate_all(engine, [PROMPTS[0]], GREEDY)[0].token_ids


def test_interrupt_then_update_continues_every_sequence_under_the_new_weights(engine, model):
    params = replace(GREEDY, max_new_tokens=40)
    old = generate_all(engine, PROMPTS, params)
    short = engine.submit("short", PROMPTS[0], replace(params, max_new_tokens=2))  # done before the interruption
    seqs = [engine.submit(f"s{i}", p, params) for i, p in enumerate(PROMPTS)]  # one more than MAX_BATCH
    done = []
    while not done or min(len(s.token_ids) for s in seqs) < 3:
        done += engine.step()
    assert done == [short]
    interrupted = engine.interrupt()
    assert sorted(map(id, interrupted)) == sorted(map(id, seqs))
    cuts = [len(s.token_ids) for s in seqs]
    engine.update_weights(model.v1)
    assert engine.version == 1
    run_out(engine)
    for seq, cut, before in zip(seqs, cuts, old, strict=True):
        assert seq.token_ids[:cut] == before.token_ids[:cut]
        assert seq.versions == [0] * cut + [1] * (params.max_new_tokens - cut)
        assert seq.token_ids[cut:] == continuation(engine, seq, cut)
    assert any(s.token_ids != o.token_ids for s, o in zip(seqs, old, strict=True))  # the update did change the policy


def test_abort_drops_one_sequence_and_leaves_the_others_untouched(engine, model):
    """Aborts while decoding, then between a weight update and the next step (when the torch engine's
    slots all wait for a re-prefill): the others go on as if the aborted ones had never run."""
    reference = dict(zip("abcd", generate_all(engine, PROMPTS, GREEDY), strict=True))
    seqs = {key: engine.submit(key, prompt, GREEDY) for key, prompt in zip("abcd", PROMPTS, strict=True)}
    engine.step()
    snapshot = list(seqs["a"].token_ids)
    assert engine.abort("a") is seqs["a"] and seqs["a"].finish_reason is None
    assert engine.abort("a") is None and engine.abort("nobody") is None
    assert sorted(s.key for s in engine.running()) == ["b", "c", "d"]
    for _ in range(3):
        engine.step()
    cuts = {key: len(seqs[key].token_ids) for key in "bd"}
    assert all(seqs[key].token_ids == reference[key].token_ids[:cut] for key, cut in cuts.items())
    engine.update_weights(model.v1)
    assert engine.abort("c") is seqs["c"] and sorted(s.key for s in engine.running()) == ["b", "d"]
    assert sorted(s.key for s in run_out(engine)) == ["b", "d"]
    assert seqs["a"].token_ids == snapshot  # an aborted sequence is no longer written
    for key, cut in cuts.items():
        assert seqs[key].token_ids[cut:] == continuation(engine, seqs[key], cut)


def test_stats_follow_the_engine(engine, model):
    before = engine.stats()
    seqs = [engine.submit(f"s{i}", p, GREEDY) for i, p in enumerate(PROMPTS + PROMPTS[:1])]
    engine.step()
    now = engine.stats()
    assert (now.running, now.queued, now.capacity) == (len(seqs), len(seqs) - MAX_BATCH, MAX_BATCH)
    assert len(engine.interrupt()) == len(seqs)
    engine.update_weights(model.v1)
    done = run_out(engine)
    after = engine.stats()
    assert sorted(map(id, done)) == sorted(map(id, seqs)) and all(s.finish_reason for s in done)
    assert (after.version, after.running, after.queued) == (1, 0, 0)
    assert after.interrupted - before.interrupted == len(seqs)
    assert after.weight_updates - before.weight_updates == 1
    assert after.generated_tokens - before.generated_tokens == sum(len(s.token_ids) for s in seqs)


def test_a_missing_weights_file_keeps_the_old_version(engine, tmp_path):
    reference = generate_all(engine, PROMPTS, GREEDY)
    seqs = [engine.submit(f"s{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    engine.step()
    before = engine.stats()
    assert len(engine.interrupt()) == len(PROMPTS)
    with pytest.raises(FileNotFoundError):
        engine.update_weights(WeightsFile(tmp_path / "v000009.safetensors", 9))
    assert engine.version == 0 and engine.stats().weight_updates == before.weight_updates
    run_out(engine)
    assert [s.token_ids for s in seqs] == [s.token_ids for s in reference]
    assert all(s.versions == [0] * GREEDY.max_new_tokens for s in seqs)


def test_weights_whose_bytes_are_not_the_announced_ones_are_refused_and_change_nothing(engine, model: Model):
    reference = generate_all(engine, PROMPTS, GREEDY)
    seqs = [engine.submit(f"s{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    engine.step()
    before = engine.stats()
    engine.interrupt()
    with pytest.raises(WeightsError, match="sha256"):
        engine.update_weights(replace(model.v1, sha256="0" * 64))
    assert engine.version == 0 and engine.stats().weight_updates == before.weight_updates
    run_out(engine)
    assert [s.token_ids for s in seqs] == [s.token_ids for s in reference]
