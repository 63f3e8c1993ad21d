"""LoRA versions: the names a version holds, the merge W0 + scale·B·A (exact), and the engine running a merged
adapter with PEFT's logits."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model_state_dict

from schemas.config import LoraConfig
from tests.factories import tiny_qwen2
from workers.lora import VersionLoader, adapter_metadata, adapter_pairs, merged, published_names, scale_of, wrap
from workers.rollout.engine import Engine
from workers.rollout.forward import DirectForward
from workers.rollout.protocol import SamplingParams

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "gate_proj", "down_proj"))


def trained_adapter(seed: int = 1) -> dict[str, torch.Tensor]:
    """A fresh adapter on tiny_qwen2 with B drawn at random (a fresh one's B is zero), under PEFT's saved names."""
    model = wrap(tiny_qwen2(), LORA)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    return published_names({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})


def test_published_names_are_peft_saved_names_and_the_base_is_frozen():
    model = wrap(tiny_qwen2(), LORA)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert published_names(trainable).keys() == get_peft_model_state_dict(model).keys()
    assert len(trainable) == 2 * len(LORA.target_modules) * 2  # A and B, four modules, two layers
    assert published_names({"a.lora_A.weight": torch.ones(1)}).keys() == {"a.lora_A.weight"}  # saved names stay


def test_metadata_names_the_scale_alpha_over_rank():
    metadata = adapter_metadata(LORA)
    assert metadata["adapter"] == "lora" and scale_of(metadata) == 2.0


def test_merged_is_w0_plus_scale_b_a_exactly_and_rounded_once():
    w0, a, b = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1.0, -1.0]]), torch.tensor([[0.5], [2.0]])
    assert torch.equal(merged(w0, a, b, 2.0), torch.tensor([[2.0, 1.0], [7.0, 0.0]]))
    w16 = torch.tensor([[1.0]], dtype=torch.bfloat16)
    tiny = merged(w16, torch.tensor([[1.0]]), torch.tensor([[1e-3]]), 3.0)  # 1.003 in float32, then bfloat16
    assert tiny.dtype == torch.bfloat16 and torch.equal(tiny, torch.tensor([[1.003]]).to(torch.bfloat16))


def test_loader_merges_from_the_base_at_each_version_and_equals_peft_merge():
    from peft import PeftModel

    model, base = tiny_qwen2(), tiny_qwen2().state_dict()
    loader = VersionLoader(model)
    metadata = adapter_metadata(LORA)
    loader.load(trained_adapter(seed=2), metadata)  # an earlier version: the next merges from W0, not from this
    adapter = trained_adapter(seed=1)
    loader.load(adapter, metadata)
    pairs = adapter_pairs(adapter)
    for name, tensor in model.state_dict().items():
        module = name.removesuffix(".weight")
        want = base[name] + 2.0 * (pairs[module][1] @ pairs[module][0]) if module in pairs else base[name]
        assert torch.equal(tensor, want), name
    peft_model = wrap(tiny_qwen2(), LORA)
    peft_model.load_state_dict({n.replace(".weight", ".default.weight"): t for n, t in adapter.items()}, strict=False)
    assert isinstance(peft_model, PeftModel)
    reference = peft_model.merge_and_unload().state_dict()
    assert all(torch.equal(tensor, reference[name]) for name, tensor in model.state_dict().items())


def test_a_bad_adapter_leaves_the_model_unchanged():
    model = tiny_qwen2()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    adapter = trained_adapter()
    adapter["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"] = torch.zeros(3, 4)  # the wrong shape
    with pytest.raises(ValueError, match="down_proj has A"):
        VersionLoader(model).load(adapter, adapter_metadata(LORA))
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())


def test_the_engine_with_a_merged_adapter_gives_peft_logits():
    """The engine's direct forward (its fused layout) over a merged adapter, against PEFT's unmerged model."""
    adapter = trained_adapter()
    engine = Engine(tiny_qwen2(), max_batch=2)
    assert isinstance(engine.forward, DirectForward)
    engine.loader.load(adapter, adapter_metadata(LORA))
    peft_model = wrap(tiny_qwen2(), LORA)
    peft_model.load_state_dict({n.replace(".weight", ".default.weight"): t for n, t in adapter.items()}, strict=False)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    engine.submit("p", prompt, SamplingParams(temperature=0.0, max_new_tokens=4))
    engine._admit()
    with torch.inference_mode():
        got = engine._forward()[0]  # [V], the prefill's next-token logits
        want = peft_model(torch.tensor([prompt])).logits[0, -1]  # [V]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
