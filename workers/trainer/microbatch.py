"""Splitting a minibatch into micro-batches: pure functions of the sequence lengths.

An allocator maps the token counts of a minibatch's sequences to micro-batches,
each a list of indices into those lengths; every index appears exactly once.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

Allocator = Callable[[list[int]], list[list[int]]]


def allocate_dynamic(lengths: list[int], max_tokens: int, min_count: int = 1) -> list[list[int]]:
    """Micro-batches under a token budget, longest sequences first.

    Sequences are taken by length, longest first (ties by index). A new micro-batch
    is opened while fewer than `min_count` exist or when no micro-batch can
    take the sequence within `max_tokens`; otherwise the sequence joins the fitting
    micro-batch with the fewest sequences (ties: the one opened first). A sequence
    longer than `max_tokens` gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    microbatches: list[list[int]] = []
    tokens: list[int] = []
    for i in order:
        fitting = [m for m in range(len(microbatches)) if tokens[m] + lengths[i] <= max_tokens]
        if len(microbatches) < min_count or not fitting:
            microbatches.append([i])
            tokens.append(lengths[i])
        else:
            emptiest = min(fitting, key=lambda m: len(microbatches[m]))  # min keeps the first of equals
            microbatches[emptiest].append(i)
            tokens[emptiest] += lengths[i]
    return microbatches


def allocate_fixed(lengths: list[int], count: int) -> list[list[int]]:
    """`count` contiguous micro-batches of (almost) equal sequence counts, lengths ignored (the baseline)."""
    n = len(lengths)
    parts = min(count, n)
    return [list(range(n * k // parts, n * (k + 1) // parts)) for k in range(parts)]


def allocator(mode: str, max_tokens: int, min_count: int, fixed_count: int) -> Allocator:
    """The allocator `trainer.microbatch` names: mode 'dynamic' (token budget) or 'fixed' (sequence count)."""
    if mode == "dynamic":
        return partial(allocate_dynamic, max_tokens=max_tokens, min_count=min_count)
    if mode == "fixed":
        return partial(allocate_fixed, count=fixed_count)
    raise ValueError(f"unknown micro-batch mode {mode!r}: use 'dynamic' or 'fixed'")
