"""Model FLOPs and the machine's matmul ceiling: what a benchmark's or a trainer's tokens/s is worth in
compute, and what fraction of the cores it reaches (model FLOPs utilisation, MFU).

Model FLOPs of one token's forward pass at context length c (the token itself and those it attends to):

    2·N + 2·2·layers·c·width

N: the parameters of the matrix products, the LM head included (tied to the embedding or not, it is a
matmul) and the embedding lookup left out (a gather), norms and biases too (no matmul); each weight is one
multiply and one add per token. width: the attention's query width (heads × head dim); per layer QK^T and
AV each take c·width multiply-adds. Training a token costs three forwards (the backward: two, gradients of
the activations and of the weights): 6·N + 12·layers·c·width. The FLOPs are the model's, not the
kernels': padding, recomputation and masked work a kernel does count for nothing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

PROBE_SHAPES = {"prefill": 512, "decode": 32}  # rows of a [rows, 1024] x [1024, 1024] product
PROBE_WIDTH = 1024


def attention_width(config: Mapping) -> int:
    heads = config["num_attention_heads"]
    return heads * (config.get("head_dim") or config["hidden_size"] // heads)


def matmul_parameters(config: Mapping) -> int:
    """N of a decoder-only transformer with a gated MLP (Llama, Qwen2, Mistral; `hidden_act` silu or gelu, three
    projections), from its config.json: per layer q, k, v, o and gate, up, down; then the LM head."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    attention = hidden * head_dim * (2 * heads + 2 * kv)  # q and o: heads; k and v: kv heads
    mlp = 3 * hidden * config["intermediate_size"]
    return config["num_hidden_layers"] * (attention + mlp) + hidden * config["vocab_size"]


def forward_flops(config: Mapping, positions: int, context_sum: int) -> float:
    """Model FLOPs of a forward over `positions` tokens whose context lengths sum to `context_sum`."""
    attention = 4 * config["num_hidden_layers"] * attention_width(config) * context_sum
    return 2 * matmul_parameters(config) * positions + attention


def train_flops(config: Mapping, positions: int, context_sum: int) -> float:
    """Forward and backward: three forwards' worth."""
    return 3 * forward_flops(config, positions, context_sum)


def generate_flops(config: Mapping, prompt: int, new_tokens: int) -> float:
    """One request: the prompt prefilled and `new_tokens` sampled, each from the forward of the position before
    it; the last one sampled is never fed back, so prompt + new_tokens - 1 positions, at contexts 1, 2, ..."""
    positions = prompt + new_tokens - 1
    return forward_flops(config, positions, positions * (positions + 1) // 2)


def gflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e9 if seconds > 0 else 0.0


def mfu(achieved_gflops: float, ceiling_per_core: float, cores: int) -> float:
    """The fraction of `cores` × the one-core ceiling that `achieved_gflops` reaches; 0 with no ceiling."""
    return achieved_gflops / (ceiling_per_core * cores) if ceiling_per_core > 0 and cores > 0 else 0.0


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's 'model name' from /proc/cpuinfo ('' where there is none)."""
    try:
        with open(cpuinfo) as lines:
            return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    except OSError:
        return ""


def probe_ceiling(dtype: torch.dtype, seconds: float = 0.5, device: str = "cpu") -> dict[str, float]:
    """GFLOP/s of one thread on a [rows, 1024] x [1024, 1024] product in `dtype`, best of the repeats that fit in
    `seconds` (split between the shapes): 'prefill' at 512 rows (the machine's ceiling), 'decode' at 32. Runs
    on one thread and restores the process's thread count after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {
            name: best_gflops(rows, dtype, seconds / len(PROBE_SHAPES), device) for name, rows in PROBE_SHAPES.items()
        }
    finally:
        torch.set_num_threads(threads)


def best_gflops(rows: int, dtype: torch.dtype, seconds: float, device: str) -> float:
    a = torch.randn(rows, PROBE_WIDTH, device=device).to(dtype)  # [rows, 1024]
    b = torch.randn(PROBE_WIDTH, PROBE_WIDTH, device=device).to(dtype)  # [1024, 1024]
    torch.mm(a, b)  # first call: allocation, kernel choice
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        torch.mm(a, b)  # [rows, 1024]
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return round(gflops(2 * rows * PROBE_WIDTH * PROBE_WIDTH, best), 1) if best < float("inf") else 0.0


REQUIRED = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers", "vocab_size")


def counts(config: Mapping) -> bool:
    """Whether `config` names what `matmul_parameters` needs (a Llama-like decoder's; a GPT-2's does not)."""
    return all(isinstance(config.get(key), int) for key in REQUIRED)


def step_utilisation(
    config: Mapping, work: tuple[int, int], seconds: float, ceiling: float, cores: int, reference: bool = False
) -> dict[str, float]:
    """A training step's `fb_gflops` (model FLOPs of its forwards and backwards, `work` = (packed positions, sum
    of their contexts), over their `seconds`; a KL reference model's forwards add one forward's worth) and
    `fb_mfu` (over `ceiling` GFLOP/s per core × `cores`; left out with no ceiling measured)."""
    done = train_flops(config, *work) + (forward_flops(config, *work) if reference else 0.0)
    achieved = gflops(done, seconds)
    return {"fb_gflops": round(achieved, 3), **({"fb_mfu": round(mfu(achieved, ceiling, cores), 4)} if ceiling else {})}


CUDA_PEAK_SIZE = 8192  # a square product this large keeps a datacenter GPU's tensor cores busy for milliseconds


def probe_cuda_peak(dtype: torch.dtype, device: str = "cuda", repeats: int = 20) -> float:
    """GFLOP/s of the GPU on an [8192, 8192] x [8192, 8192] product in `dtype`, best of `repeats` timed by CUDA
    events: the measured peak a GPU run's MFU is over (a CPU probe's small shapes would say nothing of it)."""
    a = torch.randn(CUDA_PEAK_SIZE, CUDA_PEAK_SIZE, device=device, dtype=dtype)  # [S, S]
    b = torch.randn(CUDA_PEAK_SIZE, CUDA_PEAK_SIZE, device=device, dtype=dtype)  # [S, S]
    torch.mm(a, b)  # first call: kernel choice
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b)  # [S, S]
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return round(gflops(2 * CUDA_PEAK_SIZE**3, best), 1)
