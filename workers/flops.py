"""Model FLOPs and the machine's matmul ceiling: what a benchmark's or a trainer's tokens/s is worth in
compute, and what fraction of the cores it reaches (model FLOPs utilisation, MFU).

Model FLOPs of one token's forward pass at context length c (the token itself and those it attends to):

    2·N + 2·2·layers·c·width

N: the parameters of the matrix products: the body's (the layers' projections) and the LM head's (hidden ×
vocab, tied to the embedding or not, it is a matmul), the embedding lookup left out (a gather), norms and
biases too (no matmul); each weight is one multiply and one add per token. width: the attention's query width
(heads × head dim); per layer QK^T and AV each take c·width multiply-adds. A forward that runs the head at only
some positions (the trainer's: at those predicting a completion token) counts the head's 2·hidden·vocab at
those alone. Training a token costs three forwards (the backward: two, gradients of the activations and of the
weights): 6·N + 12·layers·c·width. The FLOPs are the model's, not the kernels': padding, recomputation (the
trainer's checkpointed head) and masked work a kernel does count for nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping

import torch

PROBE_SHAPES = {"prefill": 512, "decode": 32}  # rows of a [rows, 1024] x [1024, 1024] product
PROBE_WIDTH = 1024


def attention_width(config: Mapping) -> int:
    heads = config["num_attention_heads"]
    return heads * (config.get("head_dim") or config["hidden_size"] // heads)


def projection_shapes(config: Mapping) -> list[tuple[int, int]]:
    """One decoder layer's projections as (inputs, outputs): q, k, v, o (k and v at the key-value heads), then
    the gated MLP's gate, up, down."""
    hidden, width, inner = config["hidden_size"], attention_width(config), config["intermediate_size"]
    kv = width // config["num_attention_heads"] * (config.get("num_key_value_heads") or config["num_attention_heads"])
    return [
        (hidden, width),
        (hidden, kv),
        (hidden, kv),
        (width, hidden),
        (hidden, inner),
        (hidden, inner),
        (inner, hidden),
    ]


def body_parameters(config: Mapping) -> int:
    """The body's share of N for a decoder-only transformer with a gated MLP (Llama, Qwen2, Mistral; `hidden_act`
    silu or gelu, three projections), from its config.json: per layer q, k, v, o and gate, up, down."""
    return config["num_hidden_layers"] * sum(inputs * outputs for inputs, outputs in projection_shapes(config))


def head_parameters(config: Mapping) -> int:
    """The LM head's share of N: hidden × vocab, counted once whether or not it is tied to the embedding."""
    return config["hidden_size"] * config["vocab_size"]


def matmul_parameters(config: Mapping) -> int:
    """N: the body's and the LM head's."""
    return body_parameters(config) + head_parameters(config)


def forward_flops(config: Mapping, positions: int, context_sum: int, head_positions: int | None = None) -> float:
    """Model FLOPs of a forward over `positions` tokens whose context lengths sum to `context_sum`, with the LM
    head at `head_positions` of them (None: at every one)."""
    heads = positions if head_positions is None else head_positions
    attention = 4 * config["num_hidden_layers"] * attention_width(config) * context_sum
    return 2 * (body_parameters(config) * positions + head_parameters(config) * heads) + attention


def train_flops(config: Mapping, positions: int, context_sum: int, head_positions: int | None = None) -> float:
    """Forward and backward: three forwards' worth (a recomputed head counts once)."""
    return 3 * forward_flops(config, positions, context_sum, head_positions)


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


PROBE_BURSTS = 5  # rounds of both shapes: each shape's timings spread over the whole probe


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside (a probe measures one core), the process's thread count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def probe_ceiling(dtype: torch.dtype, seconds: float = 1.0, bursts: int = PROBE_BURSTS) -> dict[str, float]:
    """GFLOP/s of one CPU thread on a [rows, 1024] x [1024, 1024] product in `dtype`: 'prefill' at 512 rows (the
    machine's ceiling), 'decode' at 32; each its fastest product in `bursts` short bursts taking turns over
    `seconds` (`fastest_runs`), so that other work busy on the machine for part of the probe does not set it.
    Runs on one thread and restores the process's thread count after."""
    with one_thread():
        products = {name: matmul_product(rows, dtype) for name, rows in PROBE_SHAPES.items()}
        fastest = fastest_runs(products, seconds / (bursts * len(products)), bursts)
    return {name: product_gflops(PROBE_SHAPES[name], fastest[name]) for name in PROBE_SHAPES}


def matmul_product(rows: int, dtype: torch.dtype) -> Callable[[], None]:
    """One [rows, 1024] x [1024, 1024] product in `dtype` on the CPU to time, run once already (allocation)."""
    a = torch.randn(rows, PROBE_WIDTH).to(dtype)  # [rows, 1024]
    b = torch.randn(PROBE_WIDTH, PROBE_WIDTH).to(dtype)  # [1024, 1024]

    def product() -> None:
        torch.mm(a, b)  # [rows, 1024]

    product()
    return product


def fastest_runs(
    runs: Mapping[str, Callable[[], None]],
    burst_s: float,
    bursts: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Each run's fastest single call in seconds (inf with no bursts), over `bursts` rounds in which each in turn
    is called back to back for `burst_s` (at least once)."""
    fastest = dict.fromkeys(runs, float("inf"))
    for _ in range(bursts):
        for name, run in runs.items():
            end = clock() + burst_s
            while True:
                start = clock()
                run()
                now = clock()
                fastest[name] = min(fastest[name], now - start)
                if now >= end:
                    break
    return fastest


def product_gflops(rows: int, seconds: float) -> float:
    """GFLOP/s of one [rows, 1024] x [1024, 1024] product in `seconds` (0 where it never ran)."""
    return round(gflops(2 * rows * PROBE_WIDTH * PROBE_WIDTH, seconds), 1) if seconds < float("inf") else 0.0


def training_products(shapes: list[tuple[int, int]], rows: int, dtype: torch.dtype) -> Callable[[], None]:
    """The three products of each (inputs, outputs) projection's training at `rows` positions, run once already:
    forward x·Wᵀ, and backward dY·W (the inputs' gradient) and dYᵀ·x (the weight's)."""
    operands = [
        (torch.randn(rows, i).to(dtype), torch.randn(o, i).to(dtype), torch.randn(rows, o).to(dtype)) for i, o in shapes
    ]  # x [rows, in], W [out, in], dY [rows, out]

    def products() -> None:
        for x, weight, grad in operands:
            torch.mm(x, weight.t())  # [rows, out]
            torch.mm(grad, weight)  # [rows, in]
            torch.mm(grad.t(), x)  # [out, in]

    products()
    return products


def pass_products_gflops(config: Mapping, rows: int, head_rows: int, dtype: torch.dtype, seconds: float = 2.0) -> float:
    """GFLOP/s of one thread on the matrix products alone of a training pass over `rows` packed positions with
    the LM head at `head_rows`: the ceiling at the model's own shapes, which the whole pass cannot pass (its
    attention, norms, casts and loss come on top). Each layer's products and the head's, fastest of
    `PROBE_BURSTS` bursts; the layers are alike, so one is timed and counted `num_hidden_layers` times."""
    with one_thread():
        runs = {
            "layer": training_products(projection_shapes(config), rows, dtype),
            "head": training_products([(config["hidden_size"], config["vocab_size"])], head_rows, dtype),
        }
        fastest = fastest_runs(runs, seconds / (PROBE_BURSTS * len(runs)), PROBE_BURSTS)
    done = 6 * (body_parameters(config) * rows + head_parameters(config) * head_rows)
    return round(gflops(done, config["num_hidden_layers"] * fastest["layer"] + fastest["head"]), 1)


REQUIRED = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers", "vocab_size")


def counts(config: Mapping) -> bool:
    """Whether `config` names what `matmul_parameters` needs (a Llama-like decoder's; a GPT-2's does not)."""
    return all(isinstance(config.get(key), int) for key in REQUIRED)


def step_utilisation(
    config: Mapping, work: tuple[int, int, int], seconds: float, ceiling: float, cores: int, reference: bool = False
) -> dict[str, float]:
    """A training step's `fb_gflops` (model FLOPs of its forwards and backwards, `work` = (packed positions, sum
    of their contexts, positions through the LM head), over their `seconds`; a KL reference model's forwards add
    one forward's worth) and, with a ceiling measured, `fb_mfu` (over `ceiling` GFLOP/s per core × `cores`) and
    the ceiling itself (`fb_ceiling_gflops_per_core`)."""
    done = train_flops(config, *work) + (forward_flops(config, *work) if reference else 0.0)
    achieved = gflops(done, seconds)
    measured = {"fb_mfu": round(mfu(achieved, ceiling, cores), 4), "fb_ceiling_gflops_per_core": ceiling}
    return {"fb_gflops": round(achieved, 3), **(measured if ceiling else {})}


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
