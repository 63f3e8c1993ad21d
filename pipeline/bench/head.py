"""`asyncrl bench head`: the trainer's forward and backward of one packed micro-batch on a real model, with its
LM head and log-softmax computed two ways.

- `full`: the full-vocabulary log-softmax over every packed position: the head's logits for all L positions,
  a float32 log-softmax [L, V] and the entropy over it, kept for backward, then the completion tokens' logprobs.
- `chunked`: what the trainer runs (`workers.trainer.step.packed_logprobs`): the head only on the positions
  that predict a completion token, a few hundred at a time under activation checkpointing.

The micro-batch is shaped as the smollm2-math recipe trains: GROUPS groups of SAMPLES completions after one
PROMPT-token prompt each (packed once), the completions of equal length filling about --tokens positions,
random token ids. A pass is `accumulate_gradients` (forward, loss, backward) on the model loaded in float32 as
the trainer holds it, under autocast at model.dtype=auto's dtype. Memory, one fresh process per method: a
warm-up pass, then the process's peak resident set (VmHWM, the model load included) and the peak of one more
pass above the resident set before it (`bench microbatch`'s measure, under its MALLOC_MMAP_THRESHOLD_). Time,
one process for both: a warm-up pass of each, then --repeats rounds of one pass of each, alternating, so other
work on the machine weighs on both alike; wall and CPU seconds, medians. `fb_mfu` is the trainer's
(`workers.flops.step_utilisation`, over the wall median) against one ceiling probe made before the runs: both
methods are charged the same model FLOPs, the head's at the positions that predict a completion token only.
Beside them, the pass's matrix products alone at its own shapes (`workers.flops.pass_products_gflops`, one
thread): the most fb_mfu could reach were everything else in the pass free.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

from pipeline.bench import machine
from pipeline.bench.microbatch import MMAP_THRESHOLD, PeakMemory, _status_bytes
from pipeline.model_cache import model_path
from workers import flops
from workers.cores import auto_dtype
from workers.models import load_causal_lm
from workers.trainer import step
from workers.trainer.losses import LossSettings
from workers.trainer.packing import pack, use_packed_attention

METHODS = ("full", "chunked")
GROUPS, SAMPLES, PROMPT = 2, 8, 90  # smollm2-math: 2 groups of 8 per step; a chat-template prompt of ~90 tokens


def micro_batch(tokens: int, vocab: int, seed: int = 0) -> step.TrainBatch:
    """GROUPS groups of SAMPLES equal-length completions after a shared PROMPT-token prompt: about `tokens`
    packed positions (each group's prompt packed once)."""
    completion = max(1, (tokens // GROUPS - PROMPT) // SAMPLES)
    g = torch.Generator().manual_seed(seed)
    rows, advantages = [], []
    for _ in range(GROUPS):
        prompt = torch.randint(0, vocab, (PROMPT,), generator=g).tolist()
        for _ in range(SAMPLES):
            rows.append(
                step.Row(prompt, torch.randint(0, vocab, (completion,), generator=g).tolist(), [-1.0] * completion)
            )
            advantages.append(float(torch.randn(1, generator=g)))
    return step.collate(rows, advantages, pad_id=0)


def full_vocabulary_logprobs(model, batch, temperature, dtype=torch.float32):
    """The `full` method: `packed_logprobs` with the head and a float32 log-softmax over every packed position;
    its work is `packed_logprobs`'s (the head's model FLOPs at the positions that predict a completion token)."""
    use_packed_attention(model)
    packed = pack(batch.input_ids, batch.attention_mask, batch.prompt_lengths)
    with step.autocast(batch.input_ids.device, dtype):
        logits = model(**packed.model_inputs()).logits[0]  # [L, V]
    logits = logits.float()  # [L, V]
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)  # [L, V]
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)  # [L]
    where = batch.completion_positions()  # [N, T-1]
    chosen = torch.where(where, logp[packed.index, packed.targets], 0.0)  # [N, T-1]
    positions, predicting = packed.position_ids.shape[1], len(packed.index[where].unique())
    return (
        chosen,
        torch.where(where, entropy[packed.index], 0.0),
        (positions, int(packed.position_ids.sum()) + positions, predicting),
    )


LOGPROBS = {"full": full_vocabulary_logprobs, "chunked": step.packed_logprobs}
TEMPERATURE = 0.8  # smollm2-math's sampling temperature


def trainer_pass(given: dict) -> tuple[step.TrainBatch, Callable[[str], dict]]:
    """The micro-batch of `given`, and one forward+backward of it by a method (`accumulate_gradients` with that
    method's logprobs), timed: wall and CPU seconds and the pass's work."""
    torch.set_num_threads(given["threads"])
    model = load_causal_lm(given["model"], "float32", "cpu")
    batch = micro_batch(given["tokens"], model.config.vocab_size)
    dtype, loss = getattr(torch, given["dtype"]), LossSettings(clip_eps=0.2)

    def one_pass(method: str) -> dict:
        model.zero_grad(set_to_none=False)
        started, cpu = time.perf_counter(), time.process_time()
        with mock.patch.object(step, "packed_logprobs", LOGPROBS[method]):
            stats, _ = step.accumulate_gradients(
                model, batch, batch.behav_logp, step.WHOLE_BATCH, TEMPERATURE, loss, dtype=dtype
            )
        seconds = {"seconds": time.perf_counter() - started, "cpu_seconds": time.process_time() - cpu}
        return seconds | {key: stats[key] for key in step.WORK}

    return batch, one_pass


def measure_memory(given: dict) -> dict:
    """One method's peak memory in this process: a warm-up pass, then one measured pass."""
    batch, one_pass = trainer_pass(given)
    one_pass(given["method"])
    loaded_peak = _status_bytes("VmHWM")  # the load's and the warm-up's, before the reset below
    memory = PeakMemory("cpu")
    memory.start()
    work = one_pass(given["method"])
    return {
        **{key: work[key] for key in step.WORK},
        "completion_tokens": int(batch.completion_positions().sum()),
        "peak_rss_mib": round(max(loaded_peak, _status_bytes("VmHWM")) / 2**20, 1),
        "peak_above_model_mib": round(memory.peak() / 2**20, 1),
    }


def measure_time(given: dict) -> dict:
    """Both methods' seconds in this process: a warm-up pass of each, then `repeats` rounds of one pass of each,
    alternating, so that other work on the machine weighs on both alike."""
    _, one_pass = trainer_pass(given)
    for method in METHODS:
        one_pass(method)
    passes: dict[str, list[dict]] = {method: [] for method in METHODS}
    for _ in range(given["repeats"]):
        for method in METHODS:
            passes[method].append(one_pass(method))
    kinds = ("seconds", "cpu_seconds")
    return {
        method: {key: [round(p[key], 3) for p in done] for key in kinds}
        | {f"{key}_median": round(statistics.median(p[key] for p in done), 3) for key in kinds}
        | {f"{key}_min": round(min(p[key] for p in done), 3) for key in kinds}  # the least disturbed pass
        for method, done in passes.items()
    }


def run_in_subprocess(given: dict) -> dict:
    """`measure_memory` (each method's peak its own, under bench microbatch's MALLOC_MMAP_THRESHOLD_) or
    `measure_time` (the allocator as the trainer runs it) in a fresh Python."""
    env = dict(os.environ)
    if given["what"] == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    command = [sys.executable, "-m", "pipeline.bench.head", json.dumps(given)]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the {given['what']} run at {given['tokens']} tokens failed (exit {done.returncode})")
    return json.loads(lines[-1])


def one_size(args: argparse.Namespace, given: dict, shape: dict, ceiling: float) -> dict:
    """Both methods at one size: a memory run each, then one timing run of both; fb_mfu over the wall median.
    Beside them, the pass's matrix products alone at its shapes: the most its fb_mfu could be."""
    runs = {method: run_in_subprocess(given | {"what": "memory", "method": method}) for method in METHODS}
    times = run_in_subprocess(given | {"what": "time", "repeats": args.repeats})
    for method, run in runs.items():
        run |= times[method]
        work = tuple(run[key] for key in step.WORK)
        run |= flops.step_utilisation(shape, work, run["seconds_median"], ceiling, args.threads)
        print(f"{given['tokens']} tokens, {method}: {run}", flush=True)
    positions, _, head_positions = (runs["chunked"][key] for key in step.WORK)
    products = flops.pass_products_gflops(shape, positions, head_positions, getattr(torch, given["dtype"]))
    alone = {"products_gflops_per_core": products, "products_mfu": round(products / ceiling, 4)}
    keys = ("seconds_median", "cpu_seconds_median", "cpu_seconds_min", "peak_rss_mib", "peak_above_model_mib")
    ratios = {f"{key}_full_over_chunked": round(runs["full"][key] / runs["chunked"][key], 3) for key in keys}
    return {"tokens": given["tokens"], **runs, **alone, **ratios}


def benchmark(args: argparse.Namespace) -> dict:
    """Every size with both methods; fb_mfu over one ceiling probe made first."""
    path = model_path(args.model)
    shape = json.loads((Path(path) / "config.json").read_text())
    dtype = auto_dtype("cpu", shape["hidden_size"])
    ceiling = flops.probe_ceiling(getattr(torch, dtype))["prefill"]
    sizes = [
        one_size(args, dict(model=path, tokens=tokens, dtype=dtype, threads=args.threads), shape, ceiling)
        for tokens in args.tokens
    ]
    settings = {"model": args.model, "dtype": dtype, "threads": args.threads, "repeats": args.repeats}
    return {**settings, "ceiling_gflops_per_core": ceiling, "cpu": flops.cpu_model(), "sizes": sizes}


def table(report: dict) -> str:
    lines = [
        "| packed positions | method | s forward+backward | CPU s | CPU s, least | peak RSS MiB | above the model MiB "
        "| fb_mfu | its products alone, MFU |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for size in report["sizes"]:
        for method in METHODS:
            run = size[method]
            lines.append(
                f"| {run['packed_positions']:,} | {method} | {run['seconds_median']:.2f} | {run['cpu_seconds_median']:.2f} "
                f"| {run['cpu_seconds_min']:.2f} "
                f"| {run['peak_rss_mib']:,.0f} "
                f"| {run['peak_above_model_mib']:,.0f} | {run.get('fb_mfu', 0):.3f} | {size['products_mfu']:.3f} |"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if min(*args.tokens, args.repeats, args.threads) < 1:
        print("asyncrl: --tokens, --repeats and --threads must be positive", file=sys.stderr)
        return 2
    report = benchmark(args)
    print(table(report))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report | {"machine": machine()}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":  # one measured run, started by `run_in_subprocess`
    given = json.loads(sys.argv[1])
    print(json.dumps((measure_memory if given["what"] == "memory" else measure_time)(given)), flush=True)
