"""Prompt templates, dtype selection and the trainer's mixed precision (workers/models.py and its users)."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoTokenizer

from pipeline.config import ConfigError, load_config, resolve
from pipeline.demo_model import build_tokenizer
from pipeline.launch.run_dir import check_dataset, check_template
from tests.factories import tiny_qwen2
from workers.models import (
    avoid_cudnn_attention,
    cast_floating,
    check_chat_template,
    compute_dtype,
    encode_prompt,
    end_token_ids,
    generation_config_of,
    load_causal_lm,
)
from workers.prompt_source import INITIAL, Source
from workers.rollout.engine import Engine
from workers.rollout.protocol import SamplingParams, generate_all
from workers.rows import load_rows
from workers.trainer.losses import LossSettings
from workers.trainer.step import StepSettings, collate, train_step

torch.set_num_threads(1)
BF16 = torch.bfloat16

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789+=<>| \n"
CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture
def raw_dir(tmp_path):
    """A character tokenizer without a chat template."""
    build_tokenizer(tmp_path / "raw", ALPHABET)
    return tmp_path / "raw"


@pytest.fixture
def chat_dir(tmp_path):
    """The same tokenizer with a chat template, saved and loaded back as a run would."""
    tokenizer = build_tokenizer(tmp_path / "chat", ALPHABET)
    tokenizer.chat_template = CHAT
    tokenizer.save_pretrained(tmp_path / "chat")
    return tmp_path / "chat"


def config_for(tmp_path, *overrides):
    return resolve(load_config(None, [f"runs_dir={tmp_path}", "name=t", *overrides]))


def test_raw_prompt_is_the_text_tokenised(raw_dir):
    tokenizer = AutoTokenizer.from_pretrained(raw_dir)
    assert encode_prompt(tokenizer, "12+3=", "raw") == tokenizer("12+3=")["input_ids"]
    with pytest.raises(ValueError, match=r"data\.template 'jinja'"):
        encode_prompt(tokenizer, "12+3=", "jinja")


@pytest.mark.parametrize("system", ["", "be brief"])
def test_chat_prompt_is_the_chat_template_with_the_assistant_opening(chat_dir, system):
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "12+3="}]
    ids = encode_prompt(tokenizer, "12+3=", "chat", system)
    assert ids == tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = (f"<|system|>{system}\n" if system else "") + "<|user|>12+3=\n<|assistant|>"
    assert tokenizer.decode(ids) == expected
    assert ids != encode_prompt(tokenizer, "12+3=", "raw")


def test_chat_without_a_template_fails_with_one_line(raw_dir, chat_dir):
    tokenizer = AutoTokenizer.from_pretrained(raw_dir)
    for call in (lambda: check_chat_template(tokenizer), lambda: encode_prompt(tokenizer, "1+2=", "chat")):
        with pytest.raises(ValueError, match="has no chat template") as error:
            call()
        assert "\n" not in str(error.value)
    closed = AutoTokenizer.from_pretrained(chat_dir)
    closed.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # never opens a reply
    with pytest.raises(ValueError, match="ignores add_generation_prompt"):
        check_chat_template(closed)


def test_launch_refuses_chat_without_a_template_before_anything_starts(tmp_path, raw_dir, chat_dir):
    with pytest.raises(ConfigError, match=r"needs model\.path: the demo model's tokenizer has no chat template"):
        check_dataset(config_for(tmp_path, "data.template=chat"))
    with pytest.raises(ConfigError, match=rf"model\.path {re.escape(str(raw_dir))}: .*has no chat template") as error:
        check_dataset(config_for(tmp_path, "data.template=chat", f"model.path={raw_dir}"))
    assert "\n" not in str(error.value)
    check_template(config_for(tmp_path, "data.template=chat", f"model.path={chat_dir}"))
    check_template(config_for(tmp_path, f"model.path={raw_dir}"))  # raw needs no template


def test_prompt_source_encodes_with_the_configured_template(tmp_path, chat_dir):
    config = config_for(tmp_path, "data.template=chat", "data.system_prompt=be brief", f"model.path={chat_dir}")
    group = Source(config, load_rows(config)[0], []).next_group(INITIAL)
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    assert group.prompt_tokens == encode_prompt(tokenizer, group.prompt_text, "chat", "be brief")
    assert tokenizer.decode(group.prompt_tokens).startswith("<|system|>be brief\n<|user|>")


def test_auto_dtype_is_bfloat16_on_cuda_float32_on_cpu(tmp_path):
    assert config_for(tmp_path).model.dtype == "float32"
    assert config_for(tmp_path, "model.device=cuda").model.dtype == "bfloat16"
    assert config_for(tmp_path, "model.device=cuda:1").model.dtype == "bfloat16"
    assert config_for(tmp_path, "model.device=cuda", "model.dtype=float16").model.dtype == "float16"
    assert config_for(tmp_path, "model.dtype=bfloat16").model.dtype == "bfloat16"


def test_trainer_compute_dtype():
    assert compute_dtype("float32", "cuda") == torch.float32
    assert compute_dtype("bfloat16", "cpu") == compute_dtype("bfloat16", "cuda:0") == torch.bfloat16
    assert compute_dtype("float16", "cuda") == torch.float16
    assert compute_dtype("float16", "cpu") == torch.float32  # no fast half matmuls, no loss scaler: see its doc
    with pytest.raises(ValueError, match="resolve"):
        compute_dtype("auto", "cpu")


@pytest.fixture
def model_dir(tmp_path):
    tiny_qwen2().save_pretrained(tmp_path / "model")
    return tmp_path / "model"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_load_causal_lm_gives_the_requested_dtype_and_the_engine_runs_in_it(model_dir, dtype):
    model = load_causal_lm(str(model_dir), dtype, "cpu")
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    engine = Engine(model, max_batch=4)
    (seq,) = generate_all(engine, [[3, 4, 5]], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert len(seq.token_ids) == 4 and engine.kv.dtype == getattr(torch, dtype)
    with pytest.raises(ValueError, match=r"model\.dtype 'auto'"):
        load_causal_lm(str(model_dir), "auto")


def test_published_weights_are_cast_float32_ones_untouched():
    tensors = {"w": torch.randn(3), "steps": torch.arange(3)}
    same = cast_floating(tensors, "float32")
    assert same["w"] is tensors["w"]  # the default run writes exactly what it wrote before
    half = cast_floating(tensors, "bfloat16")
    assert half["w"].dtype == torch.bfloat16 and half["steps"].dtype == torch.long


def test_a_bfloat16_step_runs_on_cpu_under_autocast_and_keeps_float32_masters():
    model = tiny_qwen2()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = []
    model.model.layers[0].mlp.up_proj.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    batch = collate([([3, 4, 5], [6, 7], [-1.0, -2.0]), ([3, 4], [8, 9, 1], [-0.5, -0.2, -3.0])], [1.0, -1.0], 0)
    settings = StepSettings(
        decoupled=True, minibatches=2, grad_clip=1.0, temperature=1.0, loss=LossSettings(clip_eps=0.2), dtype=BF16
    )
    stats = train_step(model, optimizer, batch, settings)
    assert seen and set(seen) == {torch.bfloat16}  # the forwards (pi_prox and both minibatches) ran in bf16
    assert torch.isfinite(torch.tensor(stats["loss"])) and stats["grad_norm"] > 0
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    moments = [s for state in optimizer.state.values() for s in (state["exp_avg"], state["exp_avg_sq"])]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    assert any(not torch.equal(p, before[name]) for name, p in model.named_parameters())


@pytest.mark.parametrize("device, enabled_after", [("cpu", True), ("cuda", False), ("cuda:1", False)])
def test_cudnn_attention_is_turned_off_for_cuda_only(device, enabled_after):
    """cuDNN plans every new attention shape (89 vs 10 ms a decode step on an H100): CUDA processes skip it.
    The switch is a process-wide flag, settable without a GPU."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        avoid_cudnn_attention(device)
        assert torch.backends.cuda.cudnn_sdp_enabled() is enabled_after
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


def test_every_end_of_sequence_id_of_the_generation_config_stops(raw_dir, tmp_path):
    """The tokenizer's EOS and each id generation_config.eos_token_id names (an int, or a list as chat models'
    often are); without generation_config.json, config.json's."""
    tokenizer = AutoTokenizer.from_pretrained(raw_dir)
    eos = tokenizer.eos_token_id
    model = tiny_qwen2(vocab_size=len(tokenizer), eos_token_id=eos)
    model.generation_config.eos_token_id = [5, eos, 7]
    model.save_pretrained(tmp_path / "listed")
    assert end_token_ids(tokenizer, generation_config_of(str(tmp_path / "listed"))) == (eos, 5, 7)
    (tmp_path / "listed" / "generation_config.json").unlink()
    assert end_token_ids(tokenizer, generation_config_of(str(tmp_path / "listed"))) == (eos,)
    model.generation_config.eos_token_id = 9
    assert end_token_ids(tokenizer, model.generation_config) == (eos, 9)
    assert end_token_ids(tokenizer, None) == (eos,)


def test_the_evaluator_stops_at_the_generation_configs_end_ids(raw_dir):
    from workers.evaluator.scoring import EvalSettings, Evaluator

    tokenizer = AutoTokenizer.from_pretrained(raw_dir)
    model = tiny_qwen2(vocab_size=len(tokenizer))
    model.generation_config.eos_token_id = [3, 4]
    evaluator = Evaluator(model, tokenizer, [], lambda row, text: (0.0, "", ""), EvalSettings())
    assert set(evaluator._stop()) == {tokenizer.eos_token_id, 3, 4}
