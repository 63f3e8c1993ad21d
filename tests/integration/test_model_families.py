"""Three model families end to end, on tiny models built here (nothing downloaded): Qwen2 and Llama (the
engine's direct forward, Llama with a chat template) and GPT-2 (the generic Hugging Face forward).

For each: prompts from the prompt source in the run's template, generation by the rollout worker's engine,
a few trainer steps through the real `Trainer` (train, publish), then `asyncrl export` of the last version,
which `AutoModelForCausalLM.from_pretrained` loads and whose greedy `generate` equals the engine's tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from pipeline.cli import main as cli
from pipeline.config import ConfigError, load_config, resolve, save_config
from pipeline.demo_model import build_tokenizer
from pipeline.export_model import export_final, export_model
from schemas.messages import PromptGroup, Scored
from tests.factories import tiny_qwen2
from workers import runtime
from workers.lora import VersionLoader, adapter_metadata
from workers.models import encode_prompt
from workers.prompt_source import INITIAL, Source
from workers.rollout.forward import DirectForward, HFForward
from workers.rollout.protocol import SamplingParams, generate_all
from workers.rollout.worker import make_engine
from workers.rows import load_rows
from workers.trainer.buffer import Group
from workers.trainer.model import Trainer
from workers.weights import WeightsFile, read_version

torch.set_num_threads(1)

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789+=<>| \n"
CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
STEPS, GROUPS, SAMPLES, NEW_TOKENS = 3, 2, 4, 6
INIT_STD = 0.5  # sharper than the default 0.02: greedy outputs vary, so equal outputs say something


def build_family(family: str, path: Path) -> None:
    """A tiny random model of `family` with a character tokenizer, saved as a Hugging Face directory."""
    tokenizer = build_tokenizer(path, ALPHABET)
    if family == "llama":
        tokenizer.chat_template = CHAT
        tokenizer.save_pretrained(path)
    ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    ids |= dict(initializer_range=INIT_STD)  # every family's config takes these
    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=1, **ids))
    else:
        sizes = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64, max_position_embeddings=64, **ids)
        if family == "qwen2":
            model = tiny_qwen2(**sizes)
        else:
            model = LlamaForCausalLM(
                LlamaConfig(num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, **sizes)
            )
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)


def run_config(tmp_path: Path, family: str, *overrides: str):
    """The resolved config of a run of `family`, written to its run directory as `asyncrl prepare` does."""
    model_dir = tmp_path / f"{family}-model"
    build_family(family, model_dir)
    config = resolve(
        load_config(
            None,
            [
                f"runs_dir={tmp_path}",
                f"name={family}",
                f"model.path={model_dir}",
                f"data.template={'chat' if family == 'llama' else 'raw'}",
                f"data.n_samples={SAMPLES}",
                f"trainer.batch_groups={GROUPS}",
                f"rollout.max_new_tokens={NEW_TOKENS}",
                "trainer.optim.lr=1e-2",
                "trainer.checkpoint.keep_versions=8",
                *overrides,
            ],
        )
    )
    runtime.run_dir(config).mkdir(parents=True)
    save_config(config, runtime.run_dir(config) / "config.yaml")
    return config


def scored_group(group: PromptGroup, engine, params: SamplingParams, position: int) -> Group:
    """The group's samples from the engine, scored as the reward worker would hand them to the trainer."""
    seqs = generate_all(engine, [group.prompt_tokens] * group.n_samples, params)
    members = {}
    for i, seq in enumerate(seqs):
        assert seq.token_ids and set(seq.versions) == {engine.version}
        scored = Scored(
            trajectory_id=f"{group.prompt_id}/{i}", prompt_id=group.prompt_id, sample_index=i,
            n_samples=group.n_samples, release_index=group.release_index,
            released_at_version=group.released_at_version, attempt="rollout-0:1", prompt_tokens=group.prompt_tokens,
            completion_tokens=seq.token_ids, logprobs=seq.logprobs, versions=seq.versions,
            finish_reason=seq.finish_reason or "length", num_segments=1, reward=float(sum(seq.token_ids) % 5),
        )  # fmt: skip
        members[i] = (scored, (0, position + i))
    return Group(group.prompt_id, group.n_samples, group.release_index, group.released_at_version, members)


def train(config, steps: int = STEPS) -> tuple[Trainer, object, list[PromptGroup], list[dict], str]:
    """`steps` RL steps: release, generate (the rollout worker's engine), train and publish (the trainer's own
    code), load the new version into the engine. Returns the trainer, engine, prompts, stats, last sha256."""
    source, engine, trainer = Source(config, load_rows(config)[0], []), make_engine(config), Trainer(config, None)
    eos = AutoTokenizer.from_pretrained(config.model.path).eos_token_id
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, stop_token_ids=(eos,))
    prompts, stats, digest = [], [], ""
    for _ in range(steps):
        version = msgspec.structs.replace(INITIAL, version=trainer.state.step)
        released = [source.next_group(version) for _ in range(GROUPS)]
        prompts += released
        groups = [scored_group(g, engine, params, 100 * len(prompts) + k) for k, g in enumerate(released)]
        stats.append(trainer.train(groups))
        published = trainer.publish()
        digest = published.sha256
        engine.update_weights(WeightsFile(published.path, trainer.state.step, digest, published.base_version))
    return trainer, engine, prompts, stats, digest


@pytest.mark.parametrize("family", ["qwen2", "llama", "gpt2"])
def test_train_generate_export_round_trip(tmp_path, family):
    config = run_config(tmp_path, family)
    trainer, engine, prompts, stats, digest = train(config)
    assert isinstance(engine.forward, HFForward if family == "gpt2" else DirectForward)
    assert not trainer.local.model.training  # GPT-2 has dropout: the trainer's forwards must not apply it
    assert all(torch.isfinite(torch.tensor(s["loss"])) and s["grad_norm"] > 0 for s in stats)
    assert {p.dtype for p in trainer.local.model.parameters()} == {torch.float32}
    # the forwards' and backwards' model GFLOP/s (a GPT-2's FLOPs are not counted); no ceiling probe for a tiny model
    assert all(s.get("fb_gflops", 0) > 0 or family == "gpt2" for s in stats)
    assert all(s["packed_positions"] > s["head_positions"] > 0 and "fb_mfu" not in s for s in stats)
    base = AutoModelForCausalLM.from_pretrained(config.model.path).state_dict()
    last = read_version(runtime.weights_dir(config) / f"v{STEPS:06d}.safetensors")
    assert any(not torch.equal(tensor, base[name]) for name, tensor in last.items())  # training moved them

    out = export_model(runtime.run_dir(config), None, tmp_path / "export")  # the newest version: STEPS
    note = json.loads((out / "asyncrl.json").read_text())
    assert note["version"] == STEPS and note["sha256"] == digest and note["template"] == config.data.template
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    model, tokenizer = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    exported = model.state_dict()
    assert all(torch.equal(exported[name], tensor) for name, tensor in last.items())  # bit for bit the version
    assert (tokenizer.chat_template is not None) == (family == "llama")
    texts = [g.prompt_text for g in prompts[:4]]
    ids = [encode_prompt(tokenizer, t, config.data.template, config.data.system_prompt) for t in texts]
    assert ids == [g.prompt_tokens for g in prompts[:4]]  # the exported tokenizer encodes as the run did
    opening = "<|assistant|>" if family == "llama" else "="  # chat: the template's reply opening; raw: the text
    assert all(tokenizer.decode(prompt).endswith(opening) for prompt in ids)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(tokenizer.eos_token_id,))
    expected = [seq.token_ids for seq in generate_all(engine, ids, greedy)]  # the run's engine at version STEPS
    for prompt, want in zip(ids, expected, strict=True):
        got = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)), do_sample=False,
                             max_new_tokens=8)  # fmt: skip
        assert got[0, len(prompt) :].tolist() == want


def test_bfloat16_run_publishes_and_exports_bfloat16_from_float32_masters(tmp_path):
    config = run_config(tmp_path, "qwen2", "model.dtype=bfloat16")
    trainer, engine, _, stats, _ = train(config, steps=2)
    assert engine.model.dtype == torch.bfloat16 and torch.isfinite(torch.tensor(stats[-1]["loss"]))
    assert {p.dtype for p in trainer.local.model.parameters()} == {torch.float32}
    assert all(s["fb_gflops"] > 0 and "fb_mfu" not in s for s in stats)  # a tiny model: no ceiling probe
    published = read_version(runtime.weights_dir(config) / "v000002.safetensors")
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    masters = trainer.local.model.state_dict()
    assert all(torch.equal(t, masters[name].to(torch.bfloat16)) for name, t in published.items())
    out = export_model(runtime.run_dir(config), 2, tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    saved = load_file(out / "model.safetensors")
    assert all(torch.equal(saved[name], tensor) for name, tensor in published.items())


def test_export_refuses_what_is_missing_with_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match="does not exist"):
        export_model(tmp_path / "nothing", None, tmp_path / "out")
    with pytest.raises(ConfigError, match=r"no config\.yaml"):
        export_model(tmp_path, None, tmp_path / "out")
    config = run_config(tmp_path, "qwen2")
    run_dir = runtime.run_dir(config)
    with pytest.raises(ConfigError, match="holds no weight versions"):
        export_model(run_dir, None, tmp_path / "out")
    summary = export_final(run_dir, {"run": "x"})  # a run that published nothing: a stderr line, a summary
    assert summary["exported_model"] is None
    assert json.loads((run_dir / "summary.json").read_text())["exported_model"] is None
    assert "final model not exported" in capsys.readouterr().err
    train(config, steps=1)
    with pytest.raises(ConfigError, match=r"version 7 is not on disk .*\(kept: 1\)"):
        export_model(run_dir, 7, tmp_path / "out")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        export_model(run_dir, 1, tmp_path / "busy")

    capsys.readouterr()
    assert cli(["export", "--run", str(run_dir), "--version", "7", "--out", str(tmp_path / "out")]) == 2
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("asyncrl:")] == [
        f"asyncrl: version 7 is not on disk in {run_dir}/weights (kept: 1); trainer.checkpoint.keep_versions keeps more"
    ]
    assert cli(["export", "--run", str(run_dir), "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "asyncrl.json").read_text())["version"] == 1
    summary = export_final(run_dir, {"run": "x"})
    assert summary["exported_model"] == str(run_dir / "final-model")
    assert (run_dir / "final-model" / "model.safetensors").is_file()


def test_lora_run_trains_the_adapter_alone_and_exports_it_merged_or_as_peft_loads_it(tmp_path):
    """A LoRA run (bfloat16, as a real one): the base stays frozen, a version is the adapter (PEFT's names, its config
    in the metadata), the engine merges it, and the merged export greedy-decodes as the engine does; `--adapter`
    writes a directory PEFT loads onto the base with the same logits."""
    from peft import PeftModel

    config = run_config(tmp_path, "qwen2", "model.dtype=bfloat16", "model.lora.rank=4", "model.lora.alpha=8")
    base = AutoModelForCausalLM.from_pretrained(config.model.path).state_dict()
    trainer, engine, prompts, _, digest = train(config)
    frozen = {n: p for n, p in trainer.local.model.named_parameters() if not p.requires_grad}
    assert all(torch.equal(p, base[n.removeprefix("base_model.model.").replace(".base_layer", "")]) for n, p in
               frozen.items())  # fmt: skip
    path = runtime.weights_dir(config) / f"v{STEPS:06d}.safetensors"
    adapter = read_version(path)
    assert len(adapter) == 2 * 7 * 2 and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in adapter)
    assert any(t.abs().max() > 0 for n, t in adapter.items() if "lora_B" in n)  # training moved B off zero
    assert path.stat().st_size < 0.5 * sum(t.numel() * 2 for t in base.values())

    out = export_model(runtime.run_dir(config), None, tmp_path / "merged")
    assert json.loads((out / "asyncrl.json").read_text())["sha256"] == digest
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert all(torch.equal(t, engine.model.state_dict()[n]) for n, t in model.state_dict().items())
    ids = [g.prompt_tokens for g in prompts[:4]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    for prompt, seq in zip(ids, generate_all(engine, ids, greedy), strict=True):
        got = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)), do_sample=False,
                             max_new_tokens=8, eos_token_id=None, min_new_tokens=8)  # fmt: skip
        assert got[0, len(prompt) :].tolist() == seq.token_ids

    assert cli(["export", "--run", str(runtime.run_dir(config)), "--adapter", "--out", str(tmp_path / "lora")]) == 0
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(config.model.path), tmp_path / "lora")
    plain = AutoModelForCausalLM.from_pretrained(config.model.path)
    loaded = {n: t.float() for n, t in adapter.items()}
    VersionLoader(plain).load(loaded, adapter_metadata(config.model.lora))
    x = torch.tensor([ids[0]])
    # PEFT adds B·(A·x) to W0·x, the merge multiplies by W0 + scale·B·A: float32 sums in another order
    torch.testing.assert_close(peft_model(x).logits, plain(x).logits, rtol=1e-4, atol=1e-4)
    full = run_config(tmp_path / "full", "qwen2")
    train(full, steps=1)
    with pytest.raises(ConfigError, match="not a LoRA adapter"):
        export_model(runtime.run_dir(full), None, tmp_path / "x", adapter=True)
