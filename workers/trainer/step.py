"""One optimizer step of decoupled PPO on a batch of trajectories, in plain torch.

Read top to bottom: collate -> pi_prox -> minibatch updates, each minibatch split
into packed micro-batches whose gradients accumulate. The loss itself is a pure
function in `losses.py`, the micro-batch allocators in `microbatch.py`, packing in
`packing.py`; the advantages come in already computed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch

from workers.trainer.losses import batch_totals, decoupled_ppo_loss
from workers.trainer.microbatch import Allocator, allocate_fixed
from workers.trainer.packing import pack, use_packed_attention

WHOLE_BATCH: Allocator = partial(allocate_fixed, count=1)


@dataclass
class TrainBatch:
    """Right-padded tensors; position t of the [N, T-1] tensors predicts token t+1."""

    input_ids: torch.Tensor  # [N, T] prompt + completion, padded
    attention_mask: torch.Tensor  # [N, T]
    loss_mask: torch.Tensor  # [N, T-1] 1.0 where the predicted token is a completion token
    behav_logp: torch.Tensor  # [N, T-1] recorded behaviour logprobs (0 elsewhere)
    advantages: torch.Tensor  # [N, T-1] the sequence advantage on its completion tokens

    def select(self, rows: torch.Tensor) -> "TrainBatch":
        return TrainBatch(*(t[rows] for t in vars(self).values()))

    def to(self, device: torch.device | str) -> "TrainBatch":
        return TrainBatch(*(t.to(device) for t in vars(self).values()))

    def microbatches(self, split: Allocator) -> list[torch.Tensor]:
        """The row indices of each micro-batch `split` makes from the sequence lengths (prompt + completion)."""
        lengths = self.attention_mask.sum(-1).tolist()
        return [torch.tensor(rows, device=self.input_ids.device) for rows in split(lengths)]


def collate(
    sequences: list[tuple[list[int], list[int], list[float]]],  # (prompt, completion, behaviour logprobs)
    advantages: list[float],
    pad_id: int,
    device: torch.device | str = "cpu",
) -> TrainBatch:
    n, width = len(sequences), max(len(p) + len(c) for p, c, _ in sequences)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(n, width, dtype=torch.long)
    loss_mask = torch.zeros(n, width - 1)
    behav = torch.zeros(n, width - 1)
    adv = torch.zeros(n, width - 1)
    for row, ((prompt, completion, logprobs), advantage) in enumerate(zip(sequences, advantages)):
        length, start = len(prompt) + len(completion), len(prompt) - 1  # logits at start predict completion[0]
        input_ids[row, :length] = torch.tensor(prompt + completion)
        attention_mask[row, :length] = 1
        loss_mask[row, start : length - 1] = 1.0
        behav[row, start : length - 1] = torch.tensor(logprobs)
        adv[row, start : length - 1] = advantage
    return TrainBatch(input_ids, attention_mask, loss_mask, behav, adv).to(device)


def packed_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(token t+1 | tokens <= t) at the sampling temperature and the entropy of that
    next-token distribution (no grad), [N, T-1] each, from one forward pass over the rows packed into one."""
    use_packed_attention(model)
    packed = pack(batch.input_ids, batch.attention_mask)
    logits = model(**packed.model_inputs()).logits[0, :-1]  # [L-1, V]
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits.float(), dim=-1)  # [L-1, V]
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)  # [L-1]
    chosen = logp.gather(-1, packed.input_ids[0, 1:, None]).squeeze(-1)  # [L-1]
    return packed.unpack(chosen), packed.unpack(entropy)


def token_logprobs(
    model: torch.nn.Module, batch: TrainBatch, temperature: float, split: Allocator = WHOLE_BATCH
) -> torch.Tensor:
    """log pi(token t+1 | tokens <= t) at the sampling temperature, [N, T-1], one packed pass per micro-batch."""
    logp = torch.zeros_like(batch.behav_logp)  # [N, T-1]
    for rows in batch.microbatches(split):
        logp[rows] = packed_logprobs(model, batch.select(rows), temperature)[0]
    return logp


def combine(parts: list[dict[str, float]], reduce: Callable[[Iterable[float]], float]) -> dict[str, float]:
    """Stats of several parts: `reduce` (sum or mean) of each, except max of `_max` and min of `_min` stats."""
    def one(key: str) -> float:
        values = [part[key] for part in parts]
        return max(values) if key.endswith("_max") else min(values) if key.endswith("_min") else reduce(values)
    return {key: one(key) for key in parts[0]}


def accumulate_gradients(
    model: torch.nn.Module,
    batch: TrainBatch,
    prox: torch.Tensor | None,  # [N, T-1] log pi_prox; None = this pass's own logprobs
    split: Allocator,
    temperature: float,
    totals: tuple[float, float] | None = None,
    reference: torch.nn.Module | None = None,
    **loss_options,
) -> tuple[dict[str, float], torch.Tensor]:
    """Backward of one minibatch's loss, one packed micro-batch at a time.

    Every micro-batch loss is divided by the totals of the whole minibatch, so the
    accumulated gradients (and the summed loss) are those of the minibatch in one
    piece. `totals`: those of the whole minibatch when `batch` is only one rank's
    share of it (default: `batch`'s own). `reference`: a frozen model whose logprobs
    the KL penalty needs (with `kl_coef` > 0). `loss_options` are the keyword
    arguments of `decoupled_ppo_loss`.
    Returns the stats and this pass's logprobs, [N, T-1], detached.
    """
    totals = totals if totals is not None else batch_totals(batch.loss_mask)
    own_logp = torch.zeros_like(batch.behav_logp)  # [N, T-1]
    parts = []
    for rows in batch.microbatches(split):
        mb = batch.select(rows)
        logp, entropy = packed_logprobs(model, mb, temperature)  # [n, T-1] each
        mb_prox = logp.detach() if prox is None else prox[rows]  # [n, T-1]
        if reference is not None:
            with torch.no_grad():
                loss_options["ref_logp"] = packed_logprobs(reference, mb, temperature)[0]  # [n, T-1]
        loss, loss_stats = decoupled_ppo_loss(
            logp, mb_prox, mb.behav_logp, mb.advantages, mb.loss_mask, totals=totals, **loss_options
        )
        loss.backward()
        own_logp[rows] = logp.detach()
        parts.append({"loss": loss.item(), "entropy": (entropy * mb.loss_mask).sum().item() / totals[0], **loss_stats})
    return {**combine(parts, math.fsum), "microbatches": len(parts)}, own_logp


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    *,
    decoupled: bool,
    minibatches: int,
    grad_clip: float,
    temperature: float,
    split: Allocator = WHOLE_BATCH,
    **loss_options,
) -> dict[str, float]:
    """pi_prox with the weights as they are when the batch arrives, then `minibatches` PPO updates.

    Each minibatch is cut into micro-batches by `split` (see `microbatch.py`);
    `loss_options` are the keyword arguments of `decoupled_ppo_loss` (clip_eps,
    behaviour_weight_cap, kl_coef, ...) and `reference` (the frozen model of the KL penalty).
    The first minibatch's own forward pass runs on the arrival weights, so its
    pi_prox is that pass detached: with one minibatch pi_prox costs nothing extra.
    """
    chunks = torch.arange(batch.input_ids.shape[0]).chunk(minibatches)
    prox = batch.behav_logp.clone()  # [N, T-1]; stays pi_behav for naive PPO
    if decoupled and minibatches > 1:
        with torch.no_grad():
            rest = torch.cat(chunks[1:])
            prox[rest] = token_logprobs(model, batch.select(rest), temperature, split)
    parts = []
    for index, rows in enumerate(chunks):
        own_prox = decoupled and index == 0
        optimizer.zero_grad(set_to_none=True)
        stats, logp = accumulate_gradients(
            model, batch.select(rows), None if own_prox else prox[rows], split, temperature, **loss_options
        )
        if own_prox:
            prox[rows] = logp
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        parts.append({**stats, "grad_norm": grad_norm.item()})
    prox_behav_abs_diff = (prox - batch.behav_logp)[batch.loss_mask.bool()].abs().mean().item()
    return {**combine(parts, statistics.fmean), "prox_behav_abs_diff": prox_behav_abs_diff}
