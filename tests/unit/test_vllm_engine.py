"""The vLLM backend: a clear error where vLLM is missing; where it is installed (CUDA), the torch engine's contract.

The contract tests load the demo-sized Qwen2 saved locally, in float32, so that greedy
choices and logprobs can be compared with the torch engine on the same weights.
"""

import importlib.util

import pytest
import torch

from schemas.config import ModelConfig, RolloutConfig, RunConfig
from workers.rollout.engine import Engine, SamplingParams
from workers.rollout.worker import make_engine
from workers.weights import write_version

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [13], [5, 3, 6, 3, 7]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_backend_vllm_without_vllm_says_how_to_get_it(tmp_path):
    config = RunConfig(model=ModelConfig(path=str(tmp_path)), rollout=RolloutConfig(backend="vllm"))
    with pytest.raises(ImportError, match=r"pip install 'asyncrl\[vllm\]'.*rollout.backend 'torch'"):
        make_engine(config)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """(path, HF model) of the demo model, for the tests that run vLLM."""
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("vLLM runs on CUDA")
    from pipeline.demo_model import build_model, build_tokenizer

    path = tmp_path_factory.mktemp("demo")
    model = build_model(path, build_tokenizer(path), seed=0).eval()
    return path, model


@pytest.fixture(scope="module")
def engine(demo):
    from workers.rollout.vllm_engine import VLLMEngine

    vllm_engine = VLLMEngine(str(demo[0]), max_batch=8, seed=0, dtype="float32")
    yield vllm_engine
    vllm_engine.close()


def test_vllm_greedy_and_logprobs_match_the_torch_engine(demo, engine):
    reference = Engine(demo[1]).generate(PROMPTS, GREEDY)
    for seq, ref in zip(engine.generate(PROMPTS, GREEDY), reference):
        assert seq.token_ids == ref.token_ids and seq.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(ref.logprobs), atol=1e-3, rtol=0)


def test_vllm_interruption_continues_under_the_new_weights(demo, engine, tmp_path):
    seqs = [engine.submit(f"s{i}", p, SamplingParams(temperature=0.0, max_new_tokens=40)) for i, p in enumerate(PROMPTS)]
    while min(len(s.token_ids) for s in seqs) < 3:
        engine.step()
    new_model = type(demo[1])(demo[1].config).eval()  # other random weights
    path, _ = write_version(new_model, tmp_path, version=1, keep=2)
    engine.update_weights(engine.fetch_weights(str(path)), version=1)
    while not engine.idle():
        engine.step()
    fresh = Engine(new_model, version=1)
    for seq in seqs:
        cut = seq.versions.index(1)
        assert set(seq.versions[:cut]) == {0} and set(seq.versions[cut:]) == {1}
        rest = SamplingParams(temperature=0.0, max_new_tokens=40 - cut)
        assert seq.token_ids[cut:] == fresh.generate([seq.prompt_ids + seq.token_ids[:cut]], rest)[0].token_ids


def test_a_deleted_version_is_a_file_not_found_before_anything_is_aborted(tmp_path):
    from workers.rollout.vllm_engine import VLLMEngine  # the module imports without vLLM; vLLM loads in __init__

    with pytest.raises(FileNotFoundError):  # the worker skips such a version and keeps generating
        VLLMEngine.fetch_weights(str(tmp_path / "v000009.safetensors"))
