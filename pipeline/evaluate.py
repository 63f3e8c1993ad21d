"""Held-out evaluation: greedy accuracy with the rollout engine itself."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from schemas.config import RunConfig
from workers.rollout.engine import Engine
from workers.rollout.protocol import SamplingParams, generate_all
from workers.tasks import load_task
from workers.weights import load_into, read_version


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, str]],
    score_fn: Callable[[str, str], float],
    max_new_tokens: int = 8,
    max_batch: int = 256,
) -> float:
    """Mean score of greedy completions over rows {"prompt", "answer"}."""
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,))
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    seqs = generate_all(Engine(model, max_batch=max_batch), prompts, params)
    texts = tokenizer.batch_decode([s.token_ids for s in seqs], skip_special_tokens=True)
    return sum(score_fn(text, row["answer"]) for text, row in zip(texts, rows, strict=True)) / len(rows)


class Evaluator:
    """The built-in task's held-out problems, scored for any weight version of the run."""

    def __init__(self, model_path: str, rows: list[dict[str, str]], max_new_tokens: int, task: str):
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.rows, self.max_new_tokens, self.score = rows, max_new_tokens, load_task(task).score

    @classmethod
    def for_config(cls, config: RunConfig) -> Evaluator | None:
        """None when the dataset has no held-out split (only the built-in task has one)."""
        if config.data.source != "builtin":
            return None
        _, held_out = load_task(config.data.task).split(config.seed, config.data.held_out)
        rows = [{"prompt": p.prompt, "answer": p.answer} for p in held_out]
        return cls(config.model.path, rows, config.rollout.max_new_tokens, config.data.task)

    def accuracy(self, weights: Path | None = None) -> float | None:
        """Accuracy of `weights` (a version file), or of the model as loaded; None if the file is gone."""
        if weights is not None:
            try:
                load_into(self.model, read_version(weights))
            except FileNotFoundError:
                return None
        return greedy_accuracy(self.model, self.tokenizer, self.rows, self.score, self.max_new_tokens)
