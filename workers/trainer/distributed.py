"""The trainer over several ranks: FSDP2 shards, each rank trains on a token-balanced share.

Every rank holds the same whole batch; `distributed_train_step` is `train_step`
with each minibatch's rows divided among the ranks (`balance_rows`). The losses
are divided by the totals of the whole minibatch and FSDP2 sums the gradients
over the ranks instead of averaging them (`shard_model`), so the reduced
gradients, the clipping and the update are those of single-process training.

Launch with torchrun: one process per rank, gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import heapq
import math
import os
import statistics

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from workers.trainer.losses import batch_totals
from workers.trainer.microbatch import Allocator
from workers.trainer.step import WHOLE_BATCH, TrainBatch, accumulate_gradients, combine, token_logprobs


def init_distributed() -> torch.device:
    """Join the process group torchrun describes in the environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    NCCL and this rank's GPU (LOCAL_RANK) where CUDA is available, gloo and the CPU
    otherwise. Returns the device this rank trains on.
    """
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def close_distributed() -> None:
    """Leave the process group (a no-op if none was joined), so the process exits without warnings or hangs."""
    if dist.is_initialized():
        dist.destroy_process_group()


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 over all ranks: each decoder layer, then the root (embeddings, final norm, LM head).

    Parameters stay in their own dtype (float32: no mixed precision). Gradients are
    summed over the ranks, not averaged (FSDP2's default in torch 2.13 is a
    reduce-scatter with ReduceOp.AVG for float32/bfloat16): with each rank's loss
    divided by the whole minibatch's totals, the sum is the single-process gradient
    for any world size, with no division that rounds. Build the optimizer after this
    call: the parameters become DTensors sharded on dim 0.
    """
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM, which gloo and NCCL both have
    return model


def balance_rows(lengths: list[int], world_size: int) -> list[list[int]]:
    """Rows (indices into `lengths`, prompt + completion tokens each) for each rank, tokens balanced.

    Longest row first (ties: lower index), each to the rank with the fewest tokens so
    far (ties: fewer rows, then lower rank), so every rank gets a row while there
    are enough and the result is the same on every rank. Each rank's rows ascend.
    """
    ranks = [(0, 0, rank) for rank in range(world_size)]  # (tokens, rows, rank), a heap
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, rows, rank = heapq.heappop(ranks)
        shares[rank].append(row)
        heapq.heappush(ranks, (tokens + lengths[row], rows + 1, rank))
    return [sorted(share) for share in shares]


def clip_gradients(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the sharded gradients by their global norm; returns the norm before clipping.

    `clip_grad_norm_` works on FSDP2's DTensor gradients as it is: the per-shard
    norms combine into the norm of the whole gradient (an all-reduce inside DTensor)
    and every shard is scaled by the same factor.
    """
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()


def full_state_dict(model: torch.nn.Module, all_ranks: bool = False) -> dict[str, torch.Tensor]:
    """The whole, unsharded weights on CPU, each shared tensor (tied embeddings) under its first name only.

    A collective: every rank must call it. Rank 0 gets the tensors (every rank with
    `all_ranks`), the others an empty dict, so only one copy is kept for writing.
    """
    keep = all_ranks or dist.get_rank() == 0
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name in aliases:  # decided by name, the same on every rank (a shard's storage may be empty)
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if keep:
            tensors[name] = full.detach().to("cpu").contiguous()
    return tensors


def _rank_share(
    batch: TrainBatch, rows: list[int], split: Allocator, filler: int
) -> tuple[torch.Tensor, TrainBatch, Allocator]:
    """This rank's rows, padded with `filler` rows that carry no loss, and their micro-batches.

    Every FSDP2 forward and backward is a collective, so all ranks must run as many
    micro-batches: a rank with fewer (or no rows at all) adds micro-batches of one
    filler row each, whose loss mask is zero, so they add exactly nothing.
    Returns the padded row indices into `batch`, those rows, and an allocator giving their micro-batches.
    """
    lengths = batch.attention_mask.sum(-1).tolist()
    plan = split([lengths[i] for i in rows]) if rows else []
    count = torch.tensor(len(plan), device=batch.input_ids.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    padding = int(count) - len(plan)
    plan = plan + [[len(rows) + k] for k in range(padding)]
    indices = torch.tensor(rows + [filler] * padding, dtype=torch.long, device=batch.input_ids.device)
    share = batch.select(indices)
    share.loss_mask[len(rows):] = 0.0
    return indices, share, lambda _lengths: plan


def distributed_train_step(
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
    """`train_step` on a model from `shard_model`, called by every rank with the same whole batch.

    Same minibatches and pi_prox as `train_step` (the arrival weights; the first
    minibatch's own pass when decoupled); each rank takes its `balance_rows` share
    of every minibatch and cuts it into micro-batches with `split`. Each loss is
    divided by the totals of the whole minibatch, so the summed gradients, the
    clipping and the AdamW step equal single-process training. The stats are those
    of the whole batch on every rank ('microbatches': passes summed over the ranks,
    fillers included).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    lengths = batch.attention_mask.sum(-1).tolist()
    filler = min(range(len(lengths)), key=lambda i: (lengths[i], i))  # the cheapest row to pad with
    chunks = [chunk.tolist() for chunk in torch.arange(len(lengths)).chunk(minibatches)]
    mine = [[chunk[i] for i in balance_rows([lengths[r] for r in chunk], world)[rank]] for chunk in chunks]
    prox = batch.behav_logp.clone()  # [N, T-1]; stays pi_behav for naive PPO; valid on this rank's rows
    if decoupled and minibatches > 1:
        with torch.no_grad():
            indices, share, plan = _rank_share(batch, [r for rows in mine[1:] for r in rows], split, filler)
            prox[indices] = token_logprobs(model, share, temperature, plan)
    parts = []
    for index, (chunk, rows) in enumerate(zip(chunks, mine)):
        own_prox = decoupled and index == 0
        indices, share, plan = _rank_share(batch, rows, split, filler)
        optimizer.zero_grad(set_to_none=True)
        stats, logp = accumulate_gradients(
            model, share, None if own_prox else prox[indices], plan, temperature,
            totals=batch_totals(batch.loss_mask[chunk]), **loss_options,
        )
        if own_prox:
            prox[indices[: len(rows)]] = logp[: len(rows)]
        gathered: list[dict[str, float]] = [{} for _ in range(world)]
        dist.all_gather_object(gathered, stats)
        grad_norm = clip_gradients(model, grad_clip)
        optimizer.step()
        parts.append({**combine(gathered, math.fsum), "grad_norm": grad_norm})
    own = torch.tensor([r for rows in mine for r in rows], dtype=torch.long, device=batch.input_ids.device)
    mask = batch.loss_mask[own].bool()  # [n, T-1]
    diff = torch.stack([(prox[own] - batch.behav_logp[own])[mask].abs().sum(), mask.sum().float()])  # [2]
    dist.all_reduce(diff)
    return {**combine(parts, statistics.fmean), "prox_behav_abs_diff": (diff[0] / diff[1]).item()}
