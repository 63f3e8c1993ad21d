"""The trainer over several ranks: FSDP2 shards, each rank trains on a token-balanced share.

Every rank holds the same whole batch; `step.train_step` divides each minibatch's
rows among the ranks (`balance_rows`) and exchanges what it must through a
`Collective`: `Collective` itself for one process (nothing to exchange),
`ProcessGroupCollective` under torchrun. The losses are divided by the totals of
the whole minibatch and FSDP2 sums the gradients over the ranks instead of
averaging them (`shard_model`), so the reduced gradients, the clipping and the
update are those of single-process training.

Launch with torchrun: one process per rank, gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import atexit
import heapq
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

GLOO_EXIT_GRACE_S = 0.05  # at exit, what gloo's worker threads get to finish with the GIL (let_gloo_workers_finish)


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
        atexit.unregister(let_gloo_workers_finish)  # once however often the process joins a group
        atexit.register(let_gloo_workers_finish)
    return device


def let_gloo_workers_finish() -> None:
    """At exit, before the interpreter starts finalizing, let gloo's worker threads finish what they still hold.

    A gloo worker thread drops a collective's work after the rank has stopped waiting for it; when it drops the
    last reference to a tensor whose Python object Python no longer holds, it takes the GIL to release that too.
    Caught in a core dump of `tests/integration/test_fsdp.py`'s ranks (about 1 run in 20): the final barrier's work
    still held an all-gather's output, the thread asked for the GIL while the interpreter was finalizing, Python
    3.11 ended the thread there (`pthread_exit`), and the unwind through the work's destructor (noexcept) called
    std::terminate: "terminate called without an active exception", SIGABRT. Destroying the process group does
    not join those threads while FSDP2's DTensor caches still reference it. Sleeping here releases the GIL
    while Python is whole, so a thread that waits for it gets it now.
    """
    time.sleep(GLOO_EXIT_GRACE_S)


class Collective:
    """What the ranks of a training step exchange, for one process: nothing, so every call is the identity.
    The step is written once against this interface; `ProcessGroupCollective` is the torchrun one."""

    world, rank = 1, 0

    def max(self, count: int, device: torch.device) -> int:
        """The largest `count` of any rank (`device`: where the process group's tensors live)."""
        return count

    def gather(self, stats: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's `stats`, in rank order."""
        return [stats]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the ranks (in place)."""
        return tensor

    def broadcast(self, value: object) -> object:
        """Rank 0's `value` on every rank (what the others pass is ignored)."""
        return value


ONE_PROCESS = Collective()


class ProcessGroupCollective(Collective):
    """Every rank of the default process group (`init_distributed`); each call is a collective."""

    def __init__(self) -> None:
        self.world, self.rank = dist.get_world_size(), dist.get_rank()

    def max(self, count: int, device: torch.device) -> int:
        value = torch.tensor(count, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value)

    def gather(self, stats: dict[str, Any]) -> list[dict[str, Any]]:
        gathered: list[dict[str, Any]] = [{} for _ in range(self.world)]
        dist.all_gather_object(gathered, stats)
        return gathered

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    def broadcast(self, value: object) -> object:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def join_ranks(device: str) -> tuple[Collective, torch.device]:
    """Under torchrun (WORLD_SIZE > 1): join the process group, on this rank's device; else one process on `device`."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        rank_device = init_distributed()
        return ProcessGroupCollective(), rank_device
    return ONE_PROCESS, torch.device(device)


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
    """Clip the gradients (FSDP2's sharded ones, or one process's) by their global norm; the norm before clipping.

    `clip_grad_norm_` works on FSDP2's DTensor gradients as it is: the per-shard
    norms combine into the norm of the whole gradient (an all-reduce inside DTensor)
    and every shard is scaled by the same factor.
    """
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()


def full_state_dict(
    model: torch.nn.Module, all_ranks: bool = False, trainable_only: bool = False
) -> dict[str, torch.Tensor]:
    """The whole, unsharded weights on CPU, each shared tensor (tied embeddings) under its first name only.

    A collective under FSDP2: every rank must call it. Rank 0 (or a process without
    ranks) gets the tensors (every rank with `all_ranks`), the others an empty dict,
    so only one copy is kept for writing; `trainable_only`: the parameters that train (a LoRA adapter). The tensors are copies, never the model's own: a step may change
    the model while they are being written.
    """
    keep = all_ranks or not dist.is_initialized() or dist.get_rank() == 0
    every_name = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    aliases = every_name - dict(model.named_parameters()).keys()
    if trainable_only:  # by name as well; buffers and frozen parameters count as aliases
        trains = {name for name, p in model.named_parameters() if p.requires_grad}
        aliases = {name for name in model.state_dict() if name not in trains}
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name in aliases:  # decided by name, the same on every rank (a shard's storage may be empty)
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if keep:
            tensors[name] = full.detach().to("cpu", copy=full is tensor).contiguous()  # gathered: a copy already
    return tensors
