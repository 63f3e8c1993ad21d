"""What a rollout engine promises: the one interface the worker, evaluation and benchmarks use.

Two engines implement `RolloutEngine`: `workers.rollout.engine.Engine` (torch, slot KV
cache, CPU or CUDA) and `workers.rollout.vllm_engine.VLLMEngine` (vLLM's AsyncLLM);
tests/contract runs every installed one through the same cases.

An engine owns a Sequence from `submit` until `step` returns it finished or `abort`
drops it. Its tokens, logprobs and versions change only inside `step`, so a caller
reads it between calls, never writes it.

A weight update takes two calls, so that the caller can hand on what was generated
under the old policy before the policy changes: `interrupt()` returns every
unfinished sequence as it stands, and `update_weights(WeightsFile)` loads the new
version and continues them all under it, recomputing their KV caches from prompt +
tokens so far (the torch engine keeps a cache up to `rollout.cache_lag` versions old
instead). If the file is gone it raises FileNotFoundError and they continue on
the old weights; a `step()` before any update does the same. `update_weights` alone
also works: it interrupts on its own.

A sequence stops at any of its `stop_token_ids` and, where the engine was given a
tokenizer, at any of its `stop` strings: the completion keeps every generated token up
to and including the one that completed the string (so its text holds the stop string,
and every token keeps its behaviour logprob), and ends with finish reason "stop".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from workers.weights import WeightsFile


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0  # 0 = off
    stop: tuple[str, ...] = ()  # stop strings (`stop_cut`); the engine needs a tokenizer to see them


@dataclass
class Sequence:
    """One request's state, owned by the engine while it runs; read it between steps."""

    key: str
    prompt_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # policy version that produced each token
    finish_reason: str | None = None  # "stop" (a stop token or string) | "length" (max_new_tokens, the model's length)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics and tests; the counters run from the engine's creation."""

    version: int  # the weights version generating new tokens
    running: int  # unfinished sequences the engine owns: len(running())
    queued: int  # of those, not admitted to the batch yet (vLLM, whose queue is its own: the excess over capacity)
    capacity: int  # sequences decoded together at most (max_batch)
    generated_tokens: int  # tokens appended to sequences (not those an interruption dropped unseen)
    weight_updates: int  # versions loaded by update_weights
    interrupted: int  # sequences handed back by interrupt(), summed over its calls
    prefilling: int = 0  # admitted sequences whose cache the next step computes (after an update: those it recomputes)


@runtime_checkable
class RolloutEngine(Protocol):
    """A continuous-batching generator whose weights change under running sequences. One caller thread."""

    version: int  # the weights version generating new tokens
    vocab: int  # token ids the model embeds: [0, vocab)
    tokenizer: object | None  # decodes completions for stop strings; None: requests with `stop` are refused

    def submit(self, key: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request; ValueError, the engine unchanged, for one it cannot run (see `check_request`)."""

    def step(self) -> list[Sequence]:
        """Advance every running sequence by one token (vLLM: by what arrived); return those that finished."""

    def running(self) -> list[Sequence]:
        """Every unfinished sequence the engine owns, admitted or not."""

    def idle(self) -> bool:
        """True when the engine owns no sequence."""

    def interrupt(self) -> list[Sequence]:
        """Stop generating on the current weights; every unfinished sequence, still owned, tokens so far."""

    def update_weights(self, weights: WeightsFile) -> None:
        """Load `weights`, go on with every sequence; FileNotFoundError if gone, WeightsError (nothing loaded) if
        `weights.sha256` is set and the file's bytes hash otherwise."""

    def abort(self, key: str) -> Sequence | None:
        """Drop one unfinished sequence, freeing its slot; it as it was, or None for an unknown key."""

    def stats(self) -> EngineStats:
        """Current counts (see EngineStats)."""

    def close(self) -> None:
        """Release what the engine holds outside this process's memory (vLLM's engine core)."""


def check_request(
    prompt_ids: list[int], params: SamplingParams, max_len: int | None, vocab: int, tokenizer: object | None
) -> None:
    """Refuse what the engine cannot run (ValueError), before anything is queued.

    Out-of-vocabulary ids are refused here because on CUDA an embedding lookup past the
    table is a device-side assert that takes the whole process down, not an exception.
    """
    if not prompt_ids:
        raise ValueError("empty prompt")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab}), got {min(prompt_ids)}..{max(prompt_ids)}")
    if params.temperature < 0 or not 0 < params.top_p <= 1 or params.max_new_tokens < 1 or params.top_k < 0:
        raise ValueError(f"bad sampling params {params}")
    if max_len is not None and len(prompt_ids) >= max_len:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room under {max_len} positions")
    if params.stop and (tokenizer is None or not all(params.stop)):
        raise ValueError(f"stop strings {params.stop} need non-empty strings and an engine given a tokenizer")


def stop_cut(previous: list[int], new: list[int], stop: tuple[str, ...], tokenizer) -> int | None:
    """How many of the `new` tokens of a completion (after `previous`) it keeps when one of them completes a stop
    string: up to and including that token; None when none does.

    Only a tail is decoded, as many tokens as the longest stop string has bytes, plus one (every token is at
    least one byte of text): the check is applied after every token, so a string first seen is one the newest
    token completed.
    """
    if not stop:
        return None
    window = max(len(s.encode()) for s in stop) + 1
    tail = previous[-window:]
    for n, token in enumerate(new, 1):
        tail = [*tail[-window + 1 :], token]
        text = tokenizer.decode(tail)
        if any(s in text for s in stop):
            return n
    return None


def generate_all(
    engine: RolloutEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    on_finished: Callable[[list[Sequence]], None] | None = None,
) -> list[Sequence]:
    """Run a whole batch to completion on an idle engine (evaluation, tests); results in prompt order.
    `on_finished` sees each step's finished sequences (a progress bar). The longest prompts are submitted first:
    the torch engine's first admission then sizes its cache for the whole batch."""
    if not engine.idle():
        raise RuntimeError("generate_all() needs an idle engine")
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # stable: equal lengths keep their order
    submitted = {i: engine.submit(f"generate/{i}", prompts[i], params) for i in order}
    seqs = [submitted[i] for i in range(len(prompts))]
    while not engine.idle():
        finished = engine.step()
        if on_finished is not None:
            on_finished(finished)
    return seqs
