"""`asyncrl bench generate`: the embedded engine's continuous batching against Hugging Face `generate`.

Both systems run the same model (the demo-sized Qwen2, random weights), the same prompts
and the same output length per request, at the same concurrency. Lengths are forced so
that only batching differs: sampling has no stop token and each request's max_new_tokens
is drawn up front, so both produce exactly the same useful tokens. Hugging Face runs as a
static batcher would: requests in arrival order, `hf_batch` at a time, left-padded, each
batch decoded to its longest request; tokens past a request's own length are waste and
are not counted.

Two length distributions: long-tailed (what RL rollouts look like: most answers short, a
few running to the limit, where static batching idles on the stragglers) and fixed (every
request at the limit, where static batching wastes nothing).

It also prints what an interruption costs here (`step_costs`): a decode step at 1, 16
and `concurrency` rows, and a weight update of a full batch (interrupt, load the
weights file in place, and the step that re-prefills every sequence).

Speedups compare the fastest wall-clock run of each system. Each run also records the
process CPU time it took, and `speedup_vs_hf_cpu` compares those: on a machine shared
with other work, CPU time is the steadier measure of the same thing.

`--model DIR` (or an imported model's short name) runs a real model instead, on chat-template prompts of the
`wordmath` task. `--device` and `--dtype` move the model (both systems share it) before anything runs:
`asyncrl gpu-check` runs this bench on CUDA in bfloat16; the defaults are cpu and `auto`, which resolves as
model.dtype=auto does (`workers.cores.auto_dtype`: float32 for the demo model).

Each report states the run's own matmul ceiling (`workers.flops.probe_ceiling`: one thread, in the dtype used)
and each system's model GFLOP/s on it (`workers.flops.generate_flops`, the prompts' prefill included), whose
share of the ceiling times the threads is its model FLOPs utilisation (MFU).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from pipeline.bench import machine
from pipeline.demo_model import build_model, build_tokenizer
from pipeline.model_cache import model_path, model_width
from workers import flops
from workers.cores import auto_dtype, native_bf16_cpu
from workers.models import encode_prompt, load_causal_lm
from workers.rollout.engine import Engine
from workers.rollout.protocol import SamplingParams
from workers.weights import WeightsFile, unique_state_dict, write_version

PROMPT_LENGTHS = (4, 16)  # uniform, inclusive: the demo task's prompts are this short
TAIL_MEDIAN_FRACTION = 1 / 8  # long-tailed lengths: median at 1/8 of the limit...
TAIL_SIGMA = 1.0  # ...log-normal spread, so ~2 % of requests hit the limit


@dataclass
class Settings:
    """Defaults live with the CLI options (pipeline/commands/bench.py), which must not import this module for --help."""

    concurrency: int
    requests: int
    max_new_tokens: int
    seed: int
    hf_batch: int | None  # None = concurrency
    threads: int
    repeats: int
    temperature: float = 1.0
    device: str = "cpu"
    dtype: str = "auto"  # a torch dtype's name, or auto: the model's weights and activations in both systems
    model: str | None = None  # a model directory or imported short name; None: the demo-sized model


def long_tailed_lengths(n: int, limit: int, rng: random.Random) -> list[int]:
    """Log-normal output lengths clipped to [1, limit]: most short, a few at the limit."""
    median = max(1.0, limit * TAIL_MEDIAN_FRACTION)
    return [min(limit, max(1, round(rng.lognormvariate(math.log(median), TAIL_SIGMA)))) for _ in range(n)]


def summary(lengths: list[int]) -> dict[str, float]:
    ordered = sorted(lengths)
    return {
        "total": sum(ordered),
        "mean": round(sum(ordered) / len(ordered), 2),
        "p50": ordered[len(ordered) // 2],
        "p90": ordered[int(len(ordered) * 0.9)],
        "max": ordered[-1],
    }


def own_engine(model, **settings) -> Engine:
    """An engine over its own copy of `model`, as a rollout worker's: the engine lays the weights out its way
    (workers.rollout.forward.fuse), which must not change the model that Hugging Face generate and the matmul
    ceiling run on."""
    return Engine(copy.deepcopy(model), **settings)


def run_engine(model, prompts: list[list[int]], lengths: list[int], s: Settings, bar: tqdm) -> dict:
    """Submit everything at once; the engine keeps `concurrency` rows busy, admitting as rows finish."""
    engine = own_engine(model, max_batch=s.concurrency, seed=s.seed)
    start, cpu = time.perf_counter(), time.process_time()
    seqs = [
        engine.submit(str(i), p, SamplingParams(temperature=s.temperature, max_new_tokens=n))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    steps = 0
    while not engine.idle():
        bar.update(sum(len(seq.token_ids) for seq in engine.step()))
        steps += 1
    synchronize(engine.device)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    if [len(seq.token_ids) for seq in seqs] != lengths:
        raise RuntimeError("engine produced other lengths than requested")
    return {
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu, 3),
        "tokens_per_s": round(sum(lengths) / seconds, 1),
        "steps": steps,
        "forward": type(engine.forward).__name__,
    }


def run_hf(model, prompts: list[list[int]], lengths: list[int], s: Settings, bar: tqdm) -> dict:
    """Static batching: fixed batches in arrival order, each decoded to its longest request."""
    batch = s.hf_batch or s.concurrency
    torch.manual_seed(s.seed)
    generated = 0
    start, cpu = time.perf_counter(), time.process_time()
    for first in range(0, len(prompts), batch):
        chunk, wanted = prompts[first : first + batch], lengths[first : first + batch]
        width, longest = max(map(len, chunk)), max(wanted)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=model.device)  # [b, width], padded
        starts = torch.tensor([width - len(p) for p in chunk], device=model.device)  # [b]
        mask = (torch.arange(width, device=model.device) >= starts[:, None]).long()  # [b, width]
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=s.temperature,
            top_p=1.0,
            top_k=0,
            max_new_tokens=longest,
            pad_token_id=0,
            eos_token_id=None,
        )
        if out.shape[1] != width + longest:
            raise RuntimeError("HF generate stopped early; the comparison needs forced lengths")
        generated += len(chunk) * longest
        bar.update(sum(wanted))
    synchronize(model.device)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu, 3),
        "tokens_per_s": round(sum(lengths) / seconds, 1),
        "generated_tokens": generated,
        "useful_fraction": round(sum(lengths) / generated, 3),
    }


def step_costs(model, prompts: list[list[int]], lengths: list[int], s: Settings) -> dict:
    """Milliseconds of a decode step by batch size, and of a weight update mid-run (best of `repeats`):
    the two sides of interruption."""

    def best_ms(run) -> float:
        times = []
        for _ in range(max(3, s.repeats)):
            start = time.perf_counter()
            run()
            times.append(1000 * (time.perf_counter() - start))
        return round(min(times), 2)

    params = SamplingParams(temperature=s.temperature, max_new_tokens=s.max_new_tokens)
    decode, contexts = {}, {}
    for rows in decode_rows(s.concurrency):
        engine = own_engine(model, max_batch=rows, seed=s.seed)
        for i in range(rows):
            engine.submit(str(i), prompts[i % len(prompts)], params)
        engine.step()  # the prefill
        contexts[rows] = sum(len(seq) for seq in engine.slots)  # each row attends its whole sequence
        decode[rows] = best_ms(engine.step)
    engine = own_engine(model, max_batch=s.concurrency, seed=s.seed)  # mid-run: contexts of many lengths
    for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.submit(str(i), prompt, SamplingParams(temperature=s.temperature, max_new_tokens=n))
    for _ in range(s.max_new_tokens // 2):
        engine.step()
    marked = []  # per timed update: the contexts it re-prefilled
    with tempfile.TemporaryDirectory() as tmp:  # the trainer's part, written before, untimed
        count = max(3, s.repeats)  # a new version for each timed update: the same one again leaves nothing stale
        files = []
        for v in range(engine.version + 1, engine.version + 1 + count):
            path, digest = write_version(unique_state_dict(model), Path(tmp), v, keep=count)
            files.append(WeightsFile(path, v, digest))
        versions = iter(files)

        def update() -> None:
            """Timed: interrupt(), reading and hashing the file, loading it in place, the re-prefill step."""
            engine.interrupt()
            engine.update_weights(next(versions))
            marked.append([len(seq) for seq in engine.slots[engine.decoding :][: engine.stats().prefilling]])
            engine.step()

        reprefill = best_ms(update)
    rows = min(marked, key=len)  # every timed update re-prefilled every running sequence, or this says less
    return {
        "decode_step_ms": decode,
        "decode_context_sum": contexts,  # at the first timed step, for its FLOPs
        "reprefill_ms": reprefill,
        "reprefill_rows": len(rows),
        "reprefill_context_mean": round(sum(rows) / max(1, len(rows)), 1),
    }


def decode_rows(concurrency: int) -> list[int]:
    """The batch sizes whose decode step is timed: 1, 16, every power of two from 32 below `concurrency`, and it."""
    return sorted({1, 16, concurrency, *(2**k for k in range(5, 16) if 2**k < concurrency)})


def decode_utilisation(model, costs: dict, ceiling: float, cores: int, repeats: int) -> dict:
    """Per timed batch size: the decode step's model GFLOP/s and MFU, beside its matmuls alone (every weight
    matrix once at those rows) as a share of the ceiling: how much of the gap is the matmuls' shape, how much the
    rest of the step (attention, norms, sampling, Python)."""
    config, out = model.config.to_dict(), {}
    for rows, ms in costs["decode_step_ms"].items():
        achieved = flops.gflops(flops.forward_flops(config, rows, costs["decode_context_sum"][rows]), ms / 1000)
        matmuls = matmul_ceiling(model, rows, repeats)
        alone = flops.gflops(flops.forward_flops(config, rows, 0), matmuls["pass_ms"] / 1000)
        out[rows] = {
            "step_ms": ms,
            "gflops": round(achieved, 2),
            "mfu": round(flops.mfu(achieved, ceiling, cores), 4),
            "matmul_ms": matmuls["pass_ms"],
            "matmul_mfu": round(flops.mfu(alone, ceiling, cores), 4),
        }
    return out


def matmul_ceiling(model, rows: int, repeats: int) -> dict:
    """Tokens/s if a decode step were nothing but its matmuls: every weight matrix of the model (the layers'
    projections and the LM head) applied to `rows` random rows, best of `repeats`. What no engine can beat at
    this batch on this machine; the engine's share of it says how much of a step is not matmul."""
    weights = [p for p in model.parameters() if p.dim() == 2 and p is not model.get_input_embeddings().weight]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}
    times = []
    with torch.inference_mode():
        for _ in range(max(5, repeats)):
            start = time.perf_counter()
            for w in weights:
                torch.nn.functional.linear(inputs[w.shape[1]], w)  # [rows, out]
            synchronize(weights[0].device)
            times.append(time.perf_counter() - start)
    return {"rows": rows, "pass_ms": round(1000 * min(times), 3), "tokens_per_s": round(rows / min(times), 1)}


def synchronize(device: torch.device) -> None:
    """Wait for queued CUDA work, so that a timed region ends when its work does (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fastest(runs: list[dict]) -> dict:
    """The quickest of repeated runs: load from other processes only ever slows a run down."""
    return {
        **min(runs, key=lambda r: r["seconds"]),
        "seconds_all": [r["seconds"] for r in runs],
        "cpu_seconds_min": min(r["cpu_seconds"] for r in runs),
    }


def warm_up(model, prompts: list[list[int]], s: Settings) -> None:
    """One small untimed run of each system, so first-call costs land in neither measurement."""
    small = Settings(**{**asdict(s), "concurrency": 8, "hf_batch": 8})
    quiet, few = tqdm(disable=True), prompts[:8]
    run_engine(model, few, [4] * len(few), small, quiet)
    run_hf(model, few, [4] * len(few), small, quiet)


def compare(model, prompts: list[list[int]], scenarios: dict[str, list[int]], s: Settings) -> dict:
    """Each length scenario on both systems, runs alternating: the fastest of each and the speedups."""
    results = {}
    total = 2 * s.repeats * sum(sum(lengths) for lengths in scenarios.values())
    with tqdm(total=total, unit="tok", desc="bench generate", file=sys.stderr) as bar:
        for name, lengths in scenarios.items():
            runs = {"engine": [], "hf": []}
            for attempt in range(1, s.repeats + 1):  # alternate, so a burst of load elsewhere hits both alike
                bar.set_description(f"{name} {attempt}/{s.repeats}: engine")
                runs["engine"].append(run_engine(model, prompts, lengths, s, bar))
                bar.set_description(f"{name} {attempt}/{s.repeats}: hf generate")
                runs["hf"].append(run_hf(model, prompts, lengths, s, bar))
            engine, hf = (fastest(runs[system]) for system in ("engine", "hf"))
            results[name] = {
                "lengths": summary(lengths),
                "engine": engine,
                "hf": hf,
                "speedup_vs_hf": round(engine["tokens_per_s"] / hf["tokens_per_s"], 3),
                "speedup_vs_hf_cpu": round(hf["cpu_seconds_min"] / engine["cpu_seconds_min"], 3),
            }
    return results


def resolved_dtype(s: Settings, width: int) -> str:
    """--dtype, with auto resolved as model.dtype=auto is for a model of hidden size `width` (0: the demo's)."""
    return auto_dtype(s.device, width) if s.dtype == "auto" else s.dtype


def load(s: Settings, rng: random.Random) -> tuple[transformers.PreTrainedModel, list[list[int]], str]:
    """The model in its dtype on its device, `s.requests` prompts and the model's name: --model's on chat-template
    wordmath problems, else the demo-sized one on random digit strings of `PROMPT_LENGTHS` tokens."""
    if s.model is None:
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = build_tokenizer(tmp)
            model = build_model(tmp, tokenizer, seed=s.seed)
        vocab = [tokenizer.convert_tokens_to_ids(c) for c in "0123456789+="]
        prompts = [[rng.choice(vocab) for _ in range(rng.randint(*PROMPT_LENGTHS))] for _ in range(s.requests)]
        name, width = "demo-sized Qwen2, random weights", 0
    else:
        from workers.tasks import load_task

        path = model_path(s.model)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        model = load_causal_lm(path, "float32", "cpu")
        problems = load_task("wordmath").split(s.seed, held_out=0)[0][: s.requests]
        prompts = [encode_prompt(tokenizer, problem.prompt, "chat") for problem in problems]
        name, width = path, model_width(path)
    dtype = getattr(torch, resolved_dtype(s, width))
    return model.eval().to(device=s.device, dtype=dtype), prompts, name


def engine_flops(config: dict, prompts: list[list[int]], results: dict) -> dict:
    """Per scenario, the model GFLOP/s of each system's fastest run: the same useful work for both."""
    out = {}
    for name, r in results.items():
        work = sum(flops.generate_flops(config, len(p), n) for p, n in zip(prompts, r["new_tokens"], strict=True))
        out[name] = {system: round(flops.gflops(work, r[system]["seconds"]), 2) for system in ("engine", "hf")}
    return out


def measured_ceiling(dtype: torch.dtype, device: str) -> dict:
    """What MFU is over: one CPU thread's probe (`flops.probe_ceiling`), or on a GPU its measured peak on a large
    square product (`flops.probe_cuda_peak`; a decode-shaped product there measures launches, not the chip)."""
    if device == "cpu":
        return {**flops.probe_ceiling(dtype), "probe": "one thread, 512x1024 by 1024x1024; decode: 32 rows"}
    peak = flops.probe_cuda_peak(dtype, device)
    return {"prefill": peak, "decode": peak, "probe": f"the GPU, {flops.CUDA_PEAK_SIZE} square"}


def utilisation(model, prompts: list[list[int]], results: dict, s: Settings) -> dict:
    """The run's own one-thread ceiling in the model's dtype, and each system's GFLOP/s and MFU against it
    (the ceiling times the threads)."""
    ceiling = measured_ceiling(model.dtype, s.device)
    achieved = engine_flops(model.config.to_dict(), prompts, results)
    cores = s.threads if s.device == "cpu" else 1
    return {
        "ceiling_gflops_per_core": ceiling["prefill"],
        "ceiling_decode_shape_gflops_per_core": ceiling["decode"],
        "ceiling_probe": ceiling["probe"],
        "dtype": str(model.dtype).removeprefix("torch."),
        "cpu_model": flops.cpu_model(),
        "gpu": torch.cuda.get_device_name(s.device) if s.device != "cpu" else None,
        "native_bf16": native_bf16_cpu(),
        "matmul_parameters": flops.matmul_parameters(model.config.to_dict()),
        "scenarios": {
            name: {
                **rates,
                **{
                    f"{system}_mfu": round(flops.mfu(rates[system], ceiling["prefill"], cores), 4)
                    for system in ("engine", "hf")
                },
            }
            for name, rates in achieved.items()
        },
    }


def model_utilisation(model, prompts: list[list[int]], results: dict, costs: dict, s: Settings) -> dict | None:
    """`utilisation` with each decode step's; None for a model whose config `workers.flops` cannot count (a
    GPT-2's names its sizes otherwise): its tokens/s and speedups stand without it."""
    if not flops.counts(model.config.to_dict()):
        return None
    used = utilisation(model, prompts, results, s)
    cores = s.threads if s.device == "cpu" else 1
    used["decode_steps"] = decode_utilisation(model, costs, used["ceiling_gflops_per_core"], cores, s.repeats)
    return used


def benchmark(s: Settings) -> dict:
    rng = random.Random(s.seed)
    model, prompts, name = load(s, rng)
    limit, longest = model.config.max_position_embeddings, max(map(len, prompts))
    if longest + s.max_new_tokens > limit:
        raise ValueError(
            f"--max-new-tokens {s.max_new_tokens} plus {longest}-token prompts exceed the model's {limit} positions"
        )
    model.generation_config.eos_token_id = None  # lengths are forced; nothing may stop a request early
    scenarios = {
        "long_tailed": long_tailed_lengths(s.requests, s.max_new_tokens, rng),
        "fixed": [s.max_new_tokens] * s.requests,
    }
    warm_up(model, prompts, s)
    results = compare(model, prompts, scenarios, s)
    ceiling = matmul_ceiling(model, s.concurrency, s.repeats)
    costs = step_costs(model, prompts, scenarios["long_tailed"], s)
    used = model_utilisation(
        model, prompts, {k: {**r, "new_tokens": scenarios[k]} for k, r in results.items()}, costs, s
    )
    return {
        "speedup_vs_hf": results["long_tailed"]["speedup_vs_hf"],
        "speedup_vs_hf_fixed": results["fixed"]["speedup_vs_hf"],
        "engine_mfu": used["scenarios"]["long_tailed"]["engine_mfu"] if used else None,
        "utilisation": used,
        "matmul_ceiling": ceiling,  # the engine's long-tailed tok/s over it: its share of the ceiling
        "engine_share_of_matmul_ceiling": round(
            results["long_tailed"]["engine"]["tokens_per_s"] / ceiling["tokens_per_s"], 3
        ),
        "scenarios": results,
        "step_costs": costs,
        "settings": settings_record(s, prompts, str(model.dtype).removeprefix("torch.")),
        "model": {
            "name": name,
            "parameters": sum(p.numel() for p in model.parameters()),
            "vocab_size": model.config.vocab_size,
            "layers": model.config.num_hidden_layers,
            "hidden_size": model.config.hidden_size,
            "dtype": str(model.dtype),
        },
        "machine": {**machine(), "device": s.device},
    }


def settings_record(s: Settings, prompts: list[list[int]], dtype: str) -> dict:
    lengths = sorted(map(len, prompts))
    return {
        **asdict(s),
        "dtype": dtype,  # --dtype resolved
        "dtype_option": s.dtype,
        "hf_batch": s.hf_batch or s.concurrency,
        "prompts": "wordmath, chat template" if s.model else "random digits",
        "prompt_lengths": [lengths[0], lengths[-1]],
        "long_tail": f"lognormal(median={TAIL_MEDIAN_FRACTION:g}*max_new_tokens, sigma={TAIL_SIGMA:g})"
        " clipped to [1, max_new_tokens]",
        "stop_tokens": None,
        "top_p": 1.0,
        "top_k": 0,
    }


def table(report: dict) -> str:
    settings = report["settings"]
    lines = [
        f"best of {settings['repeats']} alternating runs, concurrency {settings['concurrency']}, "
        f"{settings['requests']} requests, {report['machine']['torch_threads']} torch thread(s), "
        f"{settings['device']} {settings['dtype']}",
        f"{'lengths':<12} {'system':<13} {'useful tok':>10} {'seconds':>8} {'tok/s':>9} {'speedup':>8}",
    ]
    for name, r in report["scenarios"].items():
        useful = r["lengths"]["total"]
        lines.append(
            f"{name:<12} {'engine':<13} {useful:>10} {r['engine']['seconds']:>8.2f} "
            f"{r['engine']['tokens_per_s']:>9.1f} {r['speedup_vs_hf']:>7.2f}x"
        )
        lines.append(
            f"{'':<12} {'hf generate':<13} {useful:>10} {r['hf']['seconds']:>8.2f} "
            f"{r['hf']['tokens_per_s']:>9.1f} {'1.00x':>8}"
        )
    long = report["scenarios"]["long_tailed"]
    lines.append(
        f"long-tailed lengths: mean {long['lengths']['mean']}, p50 {long['lengths']['p50']}, "
        f"p90 {long['lengths']['p90']}, max {long['lengths']['max']}; "
        f"HF useful fraction {long['hf']['useful_fraction']:.0%}"
    )
    lines.append(
        "speedup in process CPU time: "
        + ", ".join(f"{name} {r['speedup_vs_hf_cpu']:.2f}x" for name, r in report["scenarios"].items())
    )
    ceiling = report["matmul_ceiling"]
    lines.append(
        f"matmul ceiling at {ceiling['rows']} rows: {ceiling['tokens_per_s']:.0f} tok/s (every weight matrix once, "
        f"{ceiling['pass_ms']} ms); the engine's long-tailed run reaches {report['engine_share_of_matmul_ceiling']:.0%}"
    )
    lines += utilisation_lines(report)
    costs = report["step_costs"]
    decode = costs["decode_step_ms"]
    lines.append(
        "decode step: "
        + ", ".join(f"{rows} rows {ms:.2f} ms" for rows, ms in decode.items())
        + f"; a weight update (interrupt, load the file, re-prefilling {costs['reprefill_rows']} sequences "
        f"of {costs['reprefill_context_mean']} tokens on average): {costs['reprefill_ms']:.1f} ms "
        f"= {costs['reprefill_ms'] / decode[max(decode)]:.1f} decode steps of {max(decode)} rows"
    )
    return "\n".join(lines)


def utilisation_lines(report: dict) -> list[str]:
    used, threads = report["utilisation"], report["settings"]["threads"]
    if used is None:
        return [
            "model FLOPs: not counted (workers.flops reads a Llama-like config; this model names its sizes otherwise)"
        ]
    lines = [
        f"ceiling: {used['ceiling_gflops_per_core']:.1f} GFLOP/s per {'GPU' if used['gpu'] else 'core'} in "
        f"{used['dtype']} ({used['ceiling_probe']}, "
        f"{used['ceiling_decode_shape_gflops_per_core']:.1f} at decode shape) on "
        + (
            used["gpu"]
            or f"{used['cpu_model'] or 'an unnamed CPU'}, native bfloat16: {'yes' if used['native_bf16'] else 'no'}"
        )
    ]
    for name, r in used["scenarios"].items():
        lines.append(
            f"{name:<12} model GFLOP/s: engine {r['engine']:.2f} (MFU {r['engine_mfu']:.1%} of the ceiling x "
            f"{threads} thread(s)), hf generate {r['hf']:.2f} (MFU {r['hf_mfu']:.1%})"
        )
    for rows, r in used["decode_steps"].items():
        lines.append(
            f"decode step at {rows} rows: {r['step_ms']:.1f} ms, {r['gflops']:.1f} GFLOP/s, MFU {r['mfu']:.1%}; "
            f"its matmuls alone {r['matmul_ms']:.1f} ms, MFU {r['matmul_mfu']:.1%}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    s = Settings(
        concurrency=args.concurrency,
        requests=args.requests,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        hf_batch=args.hf_batch,
        threads=args.threads,
        repeats=args.repeats,
        device=args.device,
        dtype=args.dtype,
        model=args.model,
    )
    if s.device != "cpu" and not (s.device.startswith("cuda") and torch.cuda.is_available()):
        print(f"asyncrl: --device {s.device}: use cpu, or cuda where a GPU is present", file=sys.stderr)
        return 2
    if min(s.concurrency, s.requests, s.max_new_tokens, s.hf_batch or 1, s.threads, s.repeats) < 1:
        print(
            "asyncrl: --concurrency, --requests, --max-new-tokens, --hf-batch, --threads and --repeats "
            "must be positive",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(s.threads)
    transformers.logging.set_verbosity_error()  # generate's notes on flags would break the progress bar
    transformers.utils.logging.disable_progress_bar()  # build_model's save is not part of the benchmark
    try:
        report = benchmark(s)
    except ValueError as exc:
        print(f"asyncrl: {exc}", file=sys.stderr)
        return 2
    print(table(report))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
