"""The vLLM backend's own cases: a clear error where vLLM is missing; where it is installed (CUDA), the
torch engine's tokens and logprobs, before and after a weight update.

What every engine promises (interruption, abort, stats, refused prompts) is tests/contract.
These load the demo-sized Qwen2 saved locally, in float32, so that greedy choices and
logprobs can be compared with the torch engine on the same weights: that vLLM samples
and loads a weights file (tied embeddings stored once) as the torch engine does.
"""

import importlib.util

import pytest
import torch

from schemas.config import ModelConfig, RolloutConfig, RunConfig
from workers.rollout.engine import Engine
from workers.rollout.protocol import RolloutEngine, SamplingParams, generate_all
from workers.rollout.worker import make_engine
from workers.weights import WeightsFile, unique_state_dict, write_version

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


def assert_generates_like_torch(engine: RolloutEngine, model) -> None:
    """Greedy tokens and their logprobs equal those of the torch engine on `model`."""
    reference = generate_all(Engine(model), PROMPTS, GREEDY)
    for seq, ref in zip(generate_all(engine, PROMPTS, GREEDY), reference, strict=True):
        assert seq.token_ids == ref.token_ids and seq.finish_reason == "length"
        assert seq.versions == [engine.version] * GREEDY.max_new_tokens
        torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(ref.logprobs), atol=1e-3, rtol=0)


def test_vllm_greedy_and_logprobs_match_the_torch_engine(demo, engine):
    assert_generates_like_torch(engine, demo[1])


def test_vllm_loads_a_weights_file_as_the_torch_engine_does(demo, engine, tmp_path):
    torch.manual_seed(1)
    new_model = type(demo[1])(demo[1].config).eval()  # other random weights
    path, _ = write_version(unique_state_dict(new_model), tmp_path, version=1, keep=1)
    engine.update_weights(WeightsFile(path, 1))
    assert engine.version == 1
    assert_generates_like_torch(engine, new_model)
