"""One optimizer step of decoupled PPO on a batch of trajectories, in plain torch.

Read top to bottom: collate -> pi_prox -> minibatch updates, each minibatch split
into packed micro-batches whose gradients accumulate. One step for one process or
many FSDP2 ranks: what the ranks exchange goes through a `Collective`, which for
one process exchanges nothing. The loss itself is a pure function in `losses.py`,
the micro-batch allocators in `microbatch.py`, packing in `packing.py`, the ranks
in `distributed.py`; the advantages come in already computed.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from workers.trainer.distributed import ONE_PROCESS, Collective, balance_rows, clip_gradients
from workers.trainer.losses import LossSettings, batch_totals, decoupled_ppo_loss, m2po_cutoff, second_moments
from workers.trainer.microbatch import Allocator, allocate_fixed
from workers.trainer.packing import pack, use_packed_attention

WHOLE_BATCH: Allocator = partial(allocate_fixed, count=1)


class Row(NamedTuple):
    """One trajectory to train (a plain (prompt, completion, logprobs) tuple is one with an empty mask)."""

    prompt: list[int]
    completion: list[int]
    logprobs: list[float]  # behaviour logprob per completion token
    loss_mask: Sequence[int] = ()  # per completion token 1 = trained, 0 = a tool token; empty = all trained


Sequences = list[Row]


@dataclass
class TrainBatch:
    """Right-padded tensors; position t of the [N, T-1] tensors predicts token t+1."""

    input_ids: torch.Tensor  # [N, T] prompt + completion, padded
    attention_mask: torch.Tensor  # [N, T]
    loss_mask: torch.Tensor  # [N, T-1] 1.0 where the predicted token is a model token of the completion
    behav_logp: torch.Tensor  # [N, T-1] recorded behaviour logprobs (0 elsewhere)
    advantages: torch.Tensor  # [N, T-1] the sequence advantage on its completion tokens
    prompt_lengths: torch.Tensor  # [N] tokens of each row's prompt (rows with the same prompt share it when packed)

    def select(self, rows: torch.Tensor) -> TrainBatch:
        return TrainBatch(*(t[rows] for t in vars(self).values()))

    def to(self, device: torch.device | str) -> TrainBatch:
        return TrainBatch(*(t.to(device) for t in vars(self).values()))

    def microbatches(self, split: Allocator) -> list[torch.Tensor]:
        """The row indices of each micro-batch `split` makes from the sequence lengths (prompt + completion)."""
        lengths = self.attention_mask.sum(-1).tolist()
        return [torch.tensor(rows, device=self.input_ids.device) for rows in split(lengths)]

    def completion_positions(self) -> torch.Tensor:
        """[N, T-1] True where the predicted token t+1 is one of the row's completion tokens."""
        offsets = torch.arange(self.loss_mask.shape[1], device=self.input_ids.device)  # [T-1]
        starts = self.prompt_lengths - 1  # [N] the logits at len(prompt) - 1 predict completion[0]
        return (offsets[None, :] >= starts[:, None]) & self.attention_mask[:, 1:].bool()  # [N, T-1]


def collate(
    sequences: Sequences,
    advantages: list[float],
    pad_id: int,
    device: torch.device | str = "cpu",
) -> TrainBatch:
    """Right-padded tensors of the rows; only model tokens of the completions enter the loss (`loss_mask`),
    tool tokens are context like the prompt."""
    rows = [Row(*sequence) for sequence in sequences]
    lengths = torch.tensor([len(row.prompt) + len(row.completion) for row in rows])  # [N]
    completions = torch.tensor([len(row.completion) for row in rows])  # [N]
    starts = lengths - completions - 1  # [N] the logits at len(prompt) - 1 predict completion[0]
    width = int(lengths.max())
    tokens = torch.arange(width)[None, :] < lengths[:, None]  # [N, T] row-major, as the flat lists below
    predicted = torch.arange(width - 1)[None, :] - starts[:, None]  # [N, T-1] index into the completion
    predicting = (predicted >= 0) & (predicted < completions[:, None])  # [N, T-1]

    def filled(where: torch.Tensor, values: list, dtype: torch.dtype, fill: float = 0) -> torch.Tensor:
        """A tensor of `where`'s shape holding `values` (one flat list, row after row) where it is True."""
        out = torch.full(where.shape, fill, dtype=dtype)
        out[where] = torch.tensor(values, dtype=dtype)
        return out

    return TrainBatch(
        filled(tokens, [t for row in rows for t in row.prompt + row.completion], torch.long, pad_id),
        tokens.long(),
        filled(predicting, [m for row in rows for m in row.loss_mask or [1] * len(row.completion)], torch.float),
        filled(predicting, [lp for row in rows for lp in row.logprobs], torch.float),
        filled(predicting, [a for row, a in zip(rows, advantages, strict=True) for _ in row.completion], torch.float),
        lengths - completions,  # prompt lengths
    ).to(device)


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Mixed precision for a forward pass: torch.autocast at `dtype`; float32 enters nothing at all,
    so the default step stays bit for bit what it was. Only forwards are wrapped (PyTorch's advice):
    backward runs each op in the dtype its forward chose, and the gradients land on float32 parameters."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def packed_logprobs(
    model: torch.nn.Module, batch: TrainBatch, temperature: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """log pi(token t+1 | tokens <= t) at the sampling temperature and the entropy of that
    next-token distribution (no grad), [N, T-1] each, where token t+1 is a completion token (0 elsewhere: only
    those enter the loss), from one forward pass over the rows packed into one (rows with the same prompt share
    it), computed in `dtype` (autocast) up to the logits; the softmax is float32. The LM head runs only on the
    packed positions that predict a completion token (`completion_head`). Third: the pass's work for its model
    FLOPs (`workers.flops`): its packed positions, the sum of their context lengths (a shared prompt's
    positions once, a completion's going on from its prompt) and the positions the head ran at."""
    use_packed_attention(model)
    packed = pack(batch.input_ids, batch.attention_mask, batch.prompt_lengths)
    predicting = batch.completion_positions()  # [N, T-1]
    rows, pairs = packed.index[predicting].unique(return_inverse=True)  # [P] packed positions, [K] their row
    head = model.get_output_embeddings()
    replaced = completion_head(head.forward, rows, pairs, packed.targets[predicting], temperature)
    with autocast(batch.input_ids.device, dtype), swapped_forward(head, replaced):
        logp, entropy = model(**packed.model_inputs()).logits  # [K] each
    positions = packed.position_ids.shape[1]
    work = (positions, int(packed.position_ids.sum()) + positions, len(rows))
    return scattered(predicting, logp), scattered(predicting, entropy), work


def scattered(where: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` ([K], row-major order of `where`) at the True places of `where`, 0 elsewhere; with their grad."""
    return torch.zeros(where.shape, dtype=values.dtype, device=values.device).masked_scatter(where, values)


@contextlib.contextmanager
def swapped_forward(module: torch.nn.Module, forward: Callable) -> Iterator[None]:
    """`module` runs `forward` for a while. The model's own forward still calls it, so wrappers around the
    model (FSDP2 gathering the root's weights, PEFT) do what they always do. A forward set on the instance
    itself (a hook library's) comes back after."""
    own, previous = "forward" in vars(module), module.forward
    module.forward = forward
    try:
        yield
    finally:
        if own:
            module.forward = previous
        else:
            del module.forward


HEAD_ROWS = 256  # packed positions per checkpointed LM-head chunk: its [rows, V] float32 logits exist only inside


def completion_head(
    head: Callable, rows: torch.Tensor, pairs: torch.Tensor, targets: torch.Tensor, temperature: float
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """An LM head's forward for `packed_logprobs`: from the final hidden states [1, L, H], the log pi of each
    target [K] (`targets`, predicted at `rows[pairs]`) and the entropy there [K]. Only the `rows` go through
    `head`, HEAD_ROWS at a time under activation checkpointing, so no [L, V] or [HEAD_ROWS, V] tensor is kept
    for backward: each chunk's logits are computed again in the backward pass."""
    order = pairs.argsort(stable=True)  # [K] the targets by row
    edges = torch.arange(max(1, -(-len(rows) // HEAD_ROWS)) + 1, device=rows.device) * HEAD_ROWS  # [C+1]
    bounds = torch.searchsorted(pairs[order], edges).tolist()  # chunk c's targets: sorted bounds[c]..bounds[c+1]-1

    def forward(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        selected, grad = hidden[0, rows], torch.is_grad_enabled()  # [P, H]
        parts = []
        for chunk, (start, end) in enumerate(itertools.pairwise(bounds)):  # at least one: the outputs stay on the graph
            first, mine = chunk * HEAD_ROWS, order[start:end]  # [k]
            args = (head, selected[first : first + HEAD_ROWS], pairs[mine] - first, targets[mine], temperature)
            parts.append(checkpoint(chunk_logprobs, *args, use_reentrant=False) if grad else chunk_logprobs(*args))
        logp, entropy = (torch.cat(values) for values in zip(*parts, strict=True))  # [K] each, by row
        restore = order.argsort()  # [K]
        return logp[restore], entropy[restore]

    return forward


def chunk_logprobs(
    head: Callable, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi of `targets` [k] predicted at `rows` of the hidden states [c, H] at the sampling temperature, and
    the entropy there (no grad) [k]: the head under the caller's autocast, the softmax in float32. The entropy
    comes last: the backward pass's recomputation stops at the last tensor it needs (checkpoint's early stop)."""
    logits = head(hidden).float()  # [c, V]; the temperature divides in float32
    with torch.autocast(hidden.device.type, enabled=False):
        if temperature > 0:
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1)  # [c, V]
        chosen = logp[rows, targets]  # [k]
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1)  # [c]
    return chosen, entropy[rows]


def token_logprobs(
    model: torch.nn.Module,
    batch: TrainBatch,
    temperature: float,
    split: Allocator = WHOLE_BATCH,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """log pi(token t+1 | tokens <= t) at the sampling temperature, [N, T-1], one packed pass per micro-batch."""
    logp = torch.zeros_like(batch.behav_logp)  # [N, T-1]
    for rows in batch.microbatches(split):
        logp[rows] = packed_logprobs(model, batch.select(rows), temperature, dtype)[0]
    return logp


# a pass's work, for its model FLOPs: its packed positions, their contexts' sum and the positions through the head
WORK = ("packed_positions", "packed_context", "head_positions")


def combine(parts: list[dict[str, float]], reduce: Callable[[Iterable[float]], float]) -> dict[str, float]:
    """Stats of several parts: `reduce` (sum or mean) of each, except max of `_max` and min of `_min` stats, and
    the sum of the work done (`WORK`: a step's is that of all its passes on every rank)."""

    def one(key: str) -> float:
        values = [part[key] for part in parts]
        if key in WORK:
            return sum(values)
        return max(values) if key.endswith("_max") else min(values) if key.endswith("_min") else reduce(values)

    return {key: one(key) for key in parts[0]}


def accumulate_gradients(
    model: torch.nn.Module,
    batch: TrainBatch,
    prox: torch.Tensor | None,  # [N, T-1] log pi_prox; None = this pass's own logprobs
    split: Allocator,
    temperature: float,
    loss: LossSettings,
    totals: tuple[float, float] | None = None,
    reference: torch.nn.Module | None = None,
    dtype: torch.dtype = torch.float32,
    m2_cutoff: float | None = None,
) -> tuple[dict[str, float], torch.Tensor]:
    """Backward of one minibatch's loss, one packed micro-batch at a time.

    Every micro-batch loss is divided by the totals of the whole minibatch, so the
    accumulated gradients (and the summed loss) are those of the minibatch in one
    piece. `totals`: those of the whole minibatch when `batch` is only one rank's
    share of it (default: `batch`'s own). `reference`: a frozen model whose logprobs
    the KL penalty needs (with `loss.kl_coef` > 0). `dtype`: the forwards' autocast dtype. `m2_cutoff`: M2PO's
    mask of the whole minibatch (`m2po_mask`). Returns the stats and this pass's logprobs, [N, T-1], detached.
    """
    totals = totals if totals is not None else batch_totals(batch.loss_mask)
    own_logp = torch.zeros_like(batch.behav_logp)  # [N, T-1]
    parts = []
    for rows in batch.microbatches(split):
        mb = batch.select(rows)
        logp, entropy, work = packed_logprobs(model, mb, temperature, dtype)  # [n, T-1] each
        mb_prox = logp.detach() if prox is None else prox[rows]  # [n, T-1]
        ref_logp = None
        if reference is not None:
            with torch.no_grad():
                ref_logp = packed_logprobs(reference, mb, temperature, dtype)[0]  # [n, T-1]
        value, loss_stats = decoupled_ppo_loss(
            logp, mb_prox, mb.behav_logp, mb.advantages, mb.loss_mask, loss, totals, ref_logp, m2_cutoff
        )
        value.backward()
        own_logp[rows] = logp.detach()
        entropy_mean = (entropy * mb.loss_mask).sum().item() / totals[0]
        work_done = dict(zip(WORK, work, strict=True))
        parts.append({"loss": value.item(), "entropy": entropy_mean, **loss_stats, **work_done})
    return {**combine(parts, math.fsum), "microbatches": len(parts)}, own_logp


@dataclass(frozen=True)
class StepSettings:
    """Everything a step needs besides model, optimizer and batch: one value, built once from the run config
    (`workers.trainer.model.step_settings`)."""

    decoupled: bool  # pi_prox recomputed with the arrival weights; False: naive PPO, pi_prox := pi_behav
    minibatches: int  # PPO updates per step, on contiguous chunks of the batch
    grad_clip: float  # max global gradient norm
    temperature: float  # the sampling temperature the logprobs are taken at
    loss: LossSettings
    split: Allocator = WHOLE_BATCH  # cuts each minibatch (each rank's share) into packed micro-batches
    dtype: torch.dtype = torch.float32  # forwards under autocast at this dtype; float32 = no autocast


class RankShare:
    """This rank's rows of a minibatch, padded with filler rows so every rank runs as many micro-batches.

    Every FSDP2 forward and backward is a collective, so all ranks must run as many
    micro-batches: a rank with fewer (or no rows at all) adds micro-batches of one
    filler row each (the batch's cheapest), whose loss mask is zero, so they add
    exactly nothing. One process has no fillers: its share is the rows themselves.
    """

    def __init__(self, batch: TrainBatch, split: Allocator, ranks: Collective):
        self.batch, self.split, self.ranks = batch, split, ranks
        self.lengths = batch.attention_mask.sum(-1).tolist()
        self.filler = min(range(len(self.lengths)), key=lambda i: (self.lengths[i], i))

    def of(self, rows: list[int]) -> tuple[torch.Tensor, TrainBatch, Allocator]:
        """The padded row indices into the batch, those rows, and an allocator giving their micro-batches."""
        device = self.batch.input_ids.device
        plan = self.split([self.lengths[i] for i in rows]) if rows else []
        padding = self.ranks.max(len(plan), device) - len(plan)
        plan = plan + [[len(rows) + k] for k in range(padding)]
        indices = torch.tensor(rows + [self.filler] * padding, dtype=torch.long, device=device)  # [n]
        share = self.batch.select(indices)
        share.loss_mask[len(rows) :] = 0.0
        return indices, share, lambda _lengths: plan


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    settings: StepSettings,
    ranks: Collective = ONE_PROCESS,
    reference: torch.nn.Module | None = None,
    clock: PhaseClock | None = None,
) -> dict[str, float]:
    """pi_prox with the weights as they are when the batch arrives, then `minibatches` PPO updates.

    Every rank calls it with the same whole batch and takes its `balance_rows` share of
    each minibatch (one process: all of it), cut into micro-batches by `settings.split`.
    Each loss is divided by the totals of the whole minibatch, so the summed gradients,
    the clipping and the AdamW step equal single-process training. The first minibatch's
    own forward pass runs on the arrival weights, so its pi_prox is that pass detached:
    with one minibatch pi_prox costs nothing extra. `reference`: the frozen model of the
    KL penalty. The stats are those of the whole batch on every rank ('microbatches':
    passes summed over the ranks, fillers included). An update whose loss or gradient norm is
    NaN or inf is not applied (gradients zeroed, AdamW state untouched): 'skipped_updates' counts
    them and 'skip_reason' says why. `clock` gets the seconds of pi_prox, forwards/backwards and updates.
    """
    shares = RankShare(batch, settings.split, ranks)
    lengths = shares.lengths
    chunks = [chunk.tolist() for chunk in torch.arange(len(lengths)).chunk(settings.minibatches)]
    trained = [rows_that_train(batch, chunk, lengths, settings.loss) for chunk in chunks]
    mine = [rank_rows(rows, lengths, ranks) for rows in trained]
    clock = clock or PhaseClock()
    prox = arrival_logprobs(model, batch, shares, mine, settings)  # [N, T-1]
    clock.lap("time_prox")
    parts, skipped = [], []
    for index, (chunk, rows) in enumerate(zip(chunks, mine, strict=True)):
        own_prox = settings.decoupled and index == 0 and settings.loss.objective != "m2po"
        indices, share, plan = shares.of(rows)
        m2_cutoff, m2_stats = m2po_mask(share, prox[indices], settings.loss, ranks)
        optimizer.zero_grad(set_to_none=True)
        stats, logp = accumulate_gradients(
            model,
            share,
            None if own_prox else prox[indices],
            plan,
            settings.temperature,
            settings.loss,
            totals=batch_totals(batch.loss_mask[chunk]),
            reference=reference,
            dtype=settings.dtype,
            m2_cutoff=m2_cutoff,
        )
        if own_prox:
            prox[indices[: len(rows)]] = logp[: len(rows)]
        gathered = per_trained_token(combine(ranks.gather(stats), math.fsum), batch, chunk, trained[index])
        clock.lap("time_forward_backward")
        grad_norm, reason = apply_update(model, optimizer, gathered["loss"], settings.grad_clip)
        clock.lap("time_optimizer")
        skipped += [f"minibatch {index}: {reason}"] if reason else []
        parts.append({**gathered, **m2_stats, "grad_norm": grad_norm})
    own = [r for rows in mine for r in rows]
    stats = {**combine(parts, statistics.fmean), "prox_behav_abs_diff": prox_behav_abs_diff(batch, prox, own, ranks)}
    stats["zero_advantage_rows"] = len(lengths) - sum(map(len, trained))  # rows whose pass was skipped (or kept)
    return {**stats, "skipped_updates": len(skipped), **({"skip_reason": "; ".join(skipped)} if skipped else {})}


def rank_rows(rows: list[int], lengths: list[int], ranks: Collective) -> list[int]:
    """This rank's `balance_rows` share of a minibatch's `rows`."""
    return [rows[i] for i in balance_rows([lengths[r] for r in rows], ranks.world)[ranks.rank]]


TOKEN_MEANS = (
    "entropy",
    "clip_fraction",
    "ratio_mean",
    "behaviour_weight_mean",
    "behaviour_weight_over_cap",
    "icepop_masked",
    "m2po_masked",
    "kl_ref",
)


def m2po_mask(
    share: TrainBatch, prox: torch.Tensor, loss: LossSettings, ranks: Collective
) -> tuple[float | None, dict[str, float]]:
    """M2PO's cutoff over every trained token of the minibatch (`m2po_cutoff`), whichever rank holds it: the
    second moments of this rank's `share` (pi_prox `prox`, [n, T-1]) gathered with the other ranks' (fillers
    have no trained token), so every rank and every micro-batch cuts at the same moment. (None, {}) unless M2PO."""
    if loss.objective != "m2po":
        return None, {}
    m2 = second_moments(prox, share.behav_logp, share.loss_mask)[share.loss_mask > 0]  # [k]
    every = [v for part in ranks.gather({"m2": m2.tolist()}) for v in part["m2"]]
    return m2po_cutoff(torch.tensor(every, dtype=torch.float64), loss.m2_threshold)


def rows_that_train(batch: TrainBatch, chunk: list[int], lengths: list[int], loss: LossSettings) -> list[int]:
    """The rows of a minibatch whose gradient is not exactly zero, the only ones worth a forward and backward:
    those with a non-zero advantage on a trained token (a group whose rewards are all equal has none), or all
    of them when a KL penalty pulls on every row. The minibatch's totals still count every row, so the loss and
    the gradient are those of the whole minibatch. When no row trains, its shortest one runs all the same: the
    update then steps AdamW on a zero gradient (decay, moments) exactly as the whole minibatch would."""
    if loss.kl_coef > 0:
        return chunk
    index = torch.tensor(chunk, device=batch.advantages.device)  # [n]
    trains = ((batch.advantages[index] != 0) & (batch.loss_mask[index] > 0)).any(-1).tolist()  # [n]
    rows = [r for r, train in zip(chunk, trains, strict=True) if train]
    return rows or [min(chunk, key=lambda r: (lengths[r], r))]


def per_trained_token(stats: dict[str, float], batch: TrainBatch, chunk: list[int], rows: list[int]) -> dict:
    """A minibatch's token-mean stats over the tokens of the rows that ran (they come divided by the tokens of
    all its rows, the loss's denominator); the loss itself stays that of the whole minibatch."""
    scale = batch_totals(batch.loss_mask[chunk])[0] / batch_totals(batch.loss_mask[rows])[0]
    return {key: value * scale if key in TOKEN_MEANS else value for key, value in stats.items()}


class PhaseClock:
    """Seconds spent in each phase of a step, summed over its repeats (`lap` closes the phase under way)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now


@torch.no_grad()
def arrival_logprobs(
    model: torch.nn.Module, batch: TrainBatch, shares: RankShare, mine: list[list[int]], settings: StepSettings
) -> torch.Tensor:
    """pi_prox of this rank's rows of the minibatches (`mine`) after the first, on the weights the batch arrived
    at (the first minibatch's comes from its own pass; M2PO's mask needs it before, so for M2PO of all of them);
    pi_behav elsewhere, and everywhere for naive PPO. [N, T-1]"""
    later = mine if settings.loss.objective == "m2po" else mine[1:]
    prox = batch.behav_logp.clone()  # [N, T-1]
    if settings.decoupled and later:
        indices, share, plan = shares.of([r for rows in later for r in rows])
        prox[indices] = token_logprobs(model, share, settings.temperature, plan, settings.dtype)
    return prox


def apply_update(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: float, grad_clip: float
) -> tuple[float, str | None]:
    """Clip and step, unless the loss or the gradient norm is NaN or inf: one such step would make every
    later weight NaN, so its gradients are zeroed and nothing (weights, AdamW moments) changes. Every rank
    sees the same global loss and norm, so all ranks decide alike. (norm before clipping, why skipped)."""
    grad_norm = clip_gradients(model, grad_clip)
    values = {"loss": loss, "gradient norm": grad_norm}
    reason = next((f"{name} is {value}" for name, value in values.items() if not math.isfinite(value)), None)
    if reason:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    return grad_norm, reason


def prox_behav_abs_diff(batch: TrainBatch, prox: torch.Tensor, own: list[int], ranks: Collective) -> float:
    """Mean |log pi_prox - log pi_behav| over the completion tokens of the whole batch (each rank knows
    pi_prox on its own rows only): how far behind the rollout weights were."""
    rows = torch.tensor(own, dtype=torch.long, device=batch.input_ids.device)  # [n]
    mask = batch.loss_mask[rows].bool()  # [n, T-1]
    diff = torch.stack([(prox[rows] - batch.behav_logp[rows])[mask].abs().sum(), mask.sum().float()])  # [2]
    total = ranks.sum(diff)
    return (total[0] / total[1]).item()
