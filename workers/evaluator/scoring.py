"""Evaluation on any dataset: greedy accuracy, pass@k, maj@k and completion lengths, with the rollout engine.

One evaluator for `asyncrl eval` (a model directory or a run's weight version) and for a run's
evaluation during training (the monitor scores every `eval.every`-th version while the trainer
goes on). Per row: one greedy completion and `k` samples at `temperature`, each scored by the
reward as the reward worker calls it (`RewardCalls`: its scoring processes, `reward.timeout_s` a
call, its failure budget; a call that fails scores 0, its error kept in the row's output) and
reduced to an answer key for majority voting (`workers.reward.functions.answer_key`). A reward
that hangs or kills its process costs the call, never the evaluator; once more than
`reward.max_failure_rate` of a window of calls failed, the evaluation is given up (`failed`).

A completion is correct when its score reaches full credit (CORRECT_AT): pass@1, pass@k, maj@k
and greedy accuracy all count correct completions, so pass@k >= pass@1 holds for any reward.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from schemas.config import RewardConfig, RunConfig
from schemas.errors import ConfigError
from workers.evaluator import humaneval
from workers.evaluator.rows import rows_for_config
from workers.lora import VersionLoader
from workers.models import encode_prompt, end_token_ids, load_causal_lm
from workers.reward import functions
from workers.reward.budget import RewardFailures
from workers.reward.pool import InlineScoring, ScoringPool, scoring
from workers.rollout.engine import Engine
from workers.rollout.protocol import SamplingParams, check_request, generate_all
from workers.rollout.workflow import call_token_of, generate_turns, load_workflow
from workers.rows import Row
from workers.stats import percentile

CORRECT_AT = 1.0  # full credit: the built-in verifiers give 1.0 for a right answer, 0.0 otherwise
EVAL_KEYS = ("n", "k", "pass_at_1", "pass_at_k", "maj_at_k", "length_p50", "length_p90")  # beside the accuracy
NOT_SCORED = "not scored, the evaluation's failure budget is spent"  # a call left unmade once `failed`


# ---- metrics: pure functions ----


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of n samples of which c are correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority(keys: Sequence[str]) -> int:
    """Index of the sample whose answer is the most common one; a tie goes to the answer seen first."""
    counts = Counter(keys)  # insertion order = first occurrence, and max() keeps the first of equal counts
    return list(keys).index(max(counts, key=counts.__getitem__))


def correct(score: float) -> bool:
    return score >= CORRECT_AT


def summarise(rows: list[dict], k: int, temperature: float) -> dict:
    """The run-level numbers from per-row results (`Evaluator.evaluate`'s rows)."""
    n = len(rows)
    lengths = [length for r in rows for length in (r["greedy_length"], *r["sample_lengths"]) if length]
    summary = {
        "n": n,
        "k": k,
        "temperature": temperature if k else None,
        "greedy_accuracy": sum(correct(r["greedy_score"]) for r in rows) / n,
        "greedy_mean_score": sum(r["greedy_score"] for r in rows) / n,
        "pass_at_1": None,
        "pass_at_k": None,
        "maj_at_k": None,
        "length_p50": percentile(lengths, 50),
        "length_p90": percentile(lengths, 90),
        "truncated": sum(r["truncated"] for r in rows),  # completions cut at max_new_tokens (or the model's length)
        "errors": sum(len(r["errors"]) for r in rows),  # verifier failures and refused prompts (scored 0)
    }
    if k:
        summary["pass_at_1"] = sum(pass_at_k(k, r["correct"], 1) for r in rows) / n
        summary["pass_at_k"] = sum(pass_at_k(k, r["correct"], k) for r in rows) / n
        summary["maj_at_k"] = sum(correct(r["majority_score"]) for r in rows) / n
    return summary


# ---- the evaluator ----


@dataclass(frozen=True)
class EvalSettings:
    k: int = 0  # samples per prompt beside the greedy completion
    temperature: float = 1.0  # of the k samples
    max_new_tokens: int = 16
    template: str = "raw"  # data.template: 'raw' or 'chat'
    system_prompt: str = ""
    seed: int = 0  # sampling
    max_batch: int = 64  # sequences the engine decodes together
    cache_mb: int = 0  # rollout.cache_mb: the most the engine's KV cache may take (0: no limit but max_batch)
    workflow: str = ""  # rollout.workflow: calls are answered as in the run's rollouts ('' = one turn)
    threads: int = 0  # torch threads of the thread that evaluates (OpenMP's count is per thread); 0: as it is
    stop: tuple[str, ...] = ()  # rollout.stop: strings that end a completion, as in the run's rollouts


@dataclass
class EvalResult:
    summary: dict  # `summarise`: n, k, greedy_accuracy, ...; reward_calls, reward_failures (by kind), failed
    rows: list[dict] = field(default_factory=list)  # one per row: completions, scores, answers, lengths, errors


Score = tuple[float, str, str, str]  # (score, answer key, error or "", the reward's reason or "")
Scorer = Callable[[Row, str], tuple[float, str, str]]  # (score, answer key, error or "")


def loaded(reward: str, task: str) -> tuple[functions.RewardFn, functions.AnswerKey]:
    """The verifier and its answer key; a ConfigError when the reward cannot be loaded."""
    try:
        return functions.load(reward, task), functions.answer_key(reward, task)
    except Exception as exc:  # a user's module that fails to import is as unusable as a missing one
        raise ConfigError(f"reward {reward!r}: {exc if isinstance(exc, ValueError) else repr(exc)}") from None


def answer_of(key: functions.AnswerKey, completion: str) -> str:
    """The completion's answer for the vote; '' when the key cannot find one (the verifier still scores it)."""
    try:
        return key(completion)
    except Exception:
        return ""


def make_scorer(reward: str, task: str) -> Scorer:
    """The verifier and answer key as one call in this process that never raises (a failure scores 0 with its
    error), for a caller that cannot wait on scoring processes (`asyncrl bench peer`'s TRL rewards)."""
    verifier, key = loaded(reward, task)

    def score(row: Row, completion: str) -> tuple[float, str, str]:
        answer = answer_of(key, completion)
        try:
            value, _ = functions.normalise(verifier(row.prompt, completion, {**row.metadata, "answer": row.answer}))
        except Exception as exc:
            return 0.0, answer, f"{type(exc).__name__}: {exc}"
        return value, answer, ""

    return score


def eval_reward(config: RunConfig) -> str:
    """The reward of a run's evaluation: 'code' for HumanEval (its rows carry their tests), else the run's."""
    return "code" if config.data.eval_source_or_default() == humaneval.SOURCE else config.data.reward


class RewardCalls:
    """The run's reward called as the reward worker calls it (`workers.reward.pool.scoring`: scoring processes of
    its own, `reward.timeout_s` a call, spares for hung calls) under its failure budget, one per evaluation."""

    def __init__(self, reward: str, task: str, config: RewardConfig):
        _, self.key = loaded(reward, task)  # a ConfigError now rather than a failure in every call
        self.reward, self.task, self.config = reward, task, config
        self.pool: ScoringPool | InlineScoring | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the pool's: its processes are waited for on it

    async def score_all(self, calls: list[tuple[Row, str]]) -> tuple[list[Score], RewardFailures]:
        """Each (row, completion)'s score, answer key, error and reason (`Score`), and the calls' failures. Once more than
        reward.max_failure_rate of a window of calls failed (`exceeded`), the calls left are not made: they
        score 0 with NOT_SCORED."""
        pool, config = self._pool(), self.config
        failures = RewardFailures(config.max_failure_rate, config.failure_window)

        def count(call: asyncio.Future) -> None:  # every call that ran, as it ends (before `wait` returns)
            if not call.cancelled() and call.exception() is None:
                reward, details = call.result()
                failures.record(details if reward is None else None)

        calls_made = [
            asyncio.ensure_future(pool.score(row.prompt, text, {**row.metadata, "answer": row.answer}))
            for row, text in calls
        ]
        for call in calls_made:
            call.add_done_callback(count)
        waiting = set(calls_made)
        try:
            while waiting and not failures.exceeded:
                _, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:  # the budget spent, or the evaluator stopping: no call goes on
            for call in waiting:
                call.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
        return [self._score(text, call) for (_, text), call in zip(calls, calls_made, strict=True)], failures

    def _score(self, text: str, call: asyncio.Future) -> Score:
        answer = answer_of(self.key, text)
        if call.cancelled():
            return 0.0, answer, NOT_SCORED, ""
        reward, details = call.result()
        return (
            (0.0, answer, details["error"], "") if reward is None else (reward, answer, "", details.get("reason", ""))
        )

    def _pool(self) -> ScoringPool | InlineScoring:
        """The scoring processes, made on the running loop (a pool waits on one loop only)."""
        loop = asyncio.get_running_loop()
        if self.loop is not loop:
            self.close()
            config = self.config
            self.pool = scoring(self.reward, config.processes, config.timeout_s, self.task, config.max_processes)
            self.loop = loop
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self.pool = self.loop = None


class Evaluator:
    """Rows scored for a model as loaded or for any weight version: greedy, plus k samples when k > 0."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        rows: list[Row],
        scorer: RewardCalls,
        settings: EvalSettings,
    ):
        self.model, self.tokenizer, self.rows, self.score, self.settings = model, tokenizer, rows, scorer, settings
        self.workflow = load_workflow(settings.workflow)
        self.loader = VersionLoader(model)  # a LoRA run's versions are adapters, merged into the model as built

    @classmethod
    def for_config(cls, config: RunConfig, rows: list[Row] | None = None) -> Evaluator | None:
        """The run's evaluator (`rows`, else `rows_for_config`; eval.*, the run's reward and template);
        None without an evaluation set."""
        rows = rows_for_config(config) if rows is None else rows
        if rows is None:
            return None
        settings = EvalSettings(
            k=config.eval.k,
            temperature=config.eval.temperature,
            max_new_tokens=config.rollout.max_new_tokens,
            template=config.data.template,
            system_prompt=config.data.system_prompt,
            seed=config.seed,
            max_batch=config.rollout.max_batch,
            cache_mb=config.rollout.cache_mb,
            workflow=config.rollout.workflow,
            stop=tuple(config.rollout.stop),
            # the launcher's own process shares the cores with the workers: as few threads as a rollout worker
            # (tiny matmuls on more threads than free cores spin: 15x slower measured on 2 busy cores)
            threads=config.rollout.threads,
        )
        torch.set_num_threads(config.rollout.threads)
        model = load_causal_lm(config.model.path, config.model.dtype, config.model.device)
        tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        scorer = RewardCalls(eval_reward(config), config.data.task, config.reward)
        return cls(model, tokenizer, rows, scorer, settings)

    def accuracy(self, weights: Path | None = None) -> float | None:
        """Greedy accuracy of `weights` (a version file), or of the model as loaded; None if the file is gone or
        the evaluation failed."""
        result = asyncio.run(self.evaluate(weights))
        return None if result is None or result.summary["failed"] else result.summary["greedy_accuracy"]

    async def evaluate(self, weights: Path | None = None, progress: bool = False) -> EvalResult | None:
        """Every row scored under `weights` (a version file), or the model as loaded; None if the file is gone.
        The summary's `failed` says why the evaluation was given up (its accuracies then stand for nothing)."""
        if weights is not None:
            try:
                self.loader.load_file(weights)
            except FileNotFoundError:  # the run keeps only its newest versions
                return None
        s = self.settings
        if s.threads:
            torch.set_num_threads(s.threads)
        sample_params = SamplingParams(
            s.temperature, max_new_tokens=s.max_new_tokens, stop_token_ids=self._stop(), stop=s.stop
        )
        greedy_params = replace(sample_params, temperature=0.0)
        engine = Engine(self.model, max_batch=s.max_batch, seed=s.seed, tokenizer=self.tokenizer, cache_mb=s.cache_mb)
        prompts, refused = self._prompts(engine, greedy_params)
        valid = [i for i, ids in enumerate(prompts) if ids is not None]
        workflow = self.workflow
        generate = partial(generate_turns, workflow=workflow, tokenizer=self.tokenizer) if workflow else generate_all
        with tqdm(total=len(valid) * (s.k + 1), desc="eval", unit="seq", disable=not progress) as bar:
            tick = lambda done: bar.update(len(done))  # noqa: E731
            greedy = generate(engine, [prompts[i] for i in valid], greedy_params, on_finished=tick)
            sampled = generate(engine, [prompts[i] for i in valid for _ in range(s.k)], sample_params, on_finished=tick)
        finished = [(i, seq) for j, i in enumerate(valid) for seq in (greedy[j], *sampled[j * s.k : (j + 1) * s.k])]
        texts = [self.tokenizer.decode(seq.token_ids, skip_special_tokens=True) for _, seq in finished]
        scores, failures = await self.score.score_all(
            [(self.rows[i], text) for (i, _), text in zip(finished, texts, strict=True)]
        )
        completions = iter(zip(finished, texts, scores, strict=True))
        results: list[dict] = [{} for _ in self.rows]
        for i, error in refused.items():
            results[i] = self._refused(self.rows[i], error)
        for i in valid:
            results[i] = self._row(self.rows[i], [self._completion(*next(completions)) for _ in range(s.k + 1)])
        summary = summarise(results, s.k, s.temperature) | {
            "reward_calls": failures.calls,
            "reward_failures": dict(failures.by_kind),
            "failed": failures.verdict() if failures.exceeded else None,
        }
        return EvalResult(summary, results)

    def _stop(self) -> tuple[int, ...]:
        """The model's end-of-sequence ids, and the workflow's call token: a call ends a turn, answered before the
        next."""
        workflow = self.workflow
        stops = [
            *end_token_ids(self.tokenizer, self.model.generation_config),
            workflow and call_token_of(self.tokenizer, workflow.call_end),
        ]
        return tuple(t for t in stops if t is not None)

    def _prompts(self, engine: Engine, params: SamplingParams) -> tuple[list[list[int] | None], dict[int, str]]:
        """Each row's prompt ids, None where the engine cannot take it (too long for the model, empty)."""
        s, prompts, refused = self.settings, [], {}
        for i, row in enumerate(self.rows):
            ids = encode_prompt(self.tokenizer, row.prompt, s.template, s.system_prompt)
            try:
                check_request(ids, params, engine.max_len, engine.vocab, engine.tokenizer)
            except ValueError as exc:
                ids, refused[i] = None, f"prompt refused: {exc}"
            prompts.append(ids)
        return prompts, refused

    @staticmethod
    def _completion(finished: tuple[int, object], text: str, score: Score) -> tuple:
        """(text, score, answer key, length in tokens, truncated, error, reason) of one finished sequence."""
        (_, seq), (value, answer, error, reason) = finished, score
        return text, value, answer, len(seq.token_ids), seq.finish_reason == "length", error, reason

    def _row(self, row: Row, completions: list[tuple]) -> dict:
        """One row's output: the greedy completion, the k samples, their scores and answers, the vote."""
        first, *rest = completions
        errors = [f"{'greedy' if j == 0 else f'sample {j - 1}'}: {c[5]}" for j, c in enumerate([first, *rest]) if c[5]]
        result = {
            "index": row.index,
            "prompt": row.prompt,
            "answer": row.answer,
            "greedy_completion": first[0],
            "greedy_score": first[1],
            "greedy_answer": first[2],
            "greedy_length": first[3],
            "greedy_reason": first[6],
            "sample_completions": [c[0] for c in rest],
            "sample_scores": [c[1] for c in rest],
            "sample_answers": [c[2] for c in rest],
            "sample_lengths": [c[3] for c in rest],
            "sample_reasons": [c[6] for c in rest],
            "correct": sum(correct(c[1]) for c in rest),
            "majority_answer": None,
            "majority_score": None,
            "truncated": sum(c[4] for c in (first, *rest)),
            "errors": errors,
        }
        if rest:
            vote = majority([c[2] for c in rest])
            result["majority_answer"], result["majority_score"] = rest[vote][2], rest[vote][1]
        return result

    def _refused(self, row: Row, error: str) -> dict:
        """A row the engine could not take: every completion empty and wrong, with the reason."""
        k = self.settings.k
        return {
            "index": row.index,
            "prompt": row.prompt,
            "answer": row.answer,
            "greedy_completion": "",
            "greedy_score": 0.0,
            "greedy_answer": "",
            "greedy_length": 0,
            "greedy_reason": "",
            "sample_completions": [""] * k,
            "sample_scores": [0.0] * k,
            "sample_answers": [""] * k,
            "sample_lengths": [0] * k,
            "sample_reasons": [""] * k,
            "correct": 0,
            "majority_answer": "" if k else None,
            "majority_score": 0.0 if k else None,
            "truncated": 0,
            "errors": [error],
        }


def write_rows(path: Path, rows: list[dict]) -> None:
    """Per-row results as JSONL (written aside, then renamed: a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    partial.replace(path)
