"""`asyncrl bench microbatch`: micro-batches under a token budget against a fixed micro-batch count.

Both modes train the same model (a Qwen2 built here, random weights, nothing downloaded)
from the same initial weights on the same batches with the trainer's own step
(`train_step`, padding-free packing); only the split of each batch into micro-batches
differs: `allocate_dynamic` (AReaL's Algorithm 1: longest first, each into the fitting
micro-batch with the fewest sequences, under `--budget` tokens) or `allocate_fixed`
(contiguous, equal sequence counts). The batches are long-tailed, as RL rollouts are:
completion lengths log-normal, most short, a few at the limit.

Fairness: the budget is a memory bound, so the fixed count is set the way a user sets it to
avoid running out of memory: the smallest count whose largest micro-batch, over every batch
of the workload, stays within the budget. Both modes then fit the same bound; what the fixed
count pays for it is more, smaller micro-batches. (Matching measured peaks instead would pick
about the same count, since the peak follows the largest micro-batch's tokens, at the cost of
a search over counts.) Attention runs per packed sequence, so its cost does not depend on
the split.

Peak memory is measured per mode in a fresh process, after one untimed warm-up step (the
optimizer state exists, first-call costs are paid): on CUDA `max_memory_allocated` above
what was allocated before; on CPU, where allocations are plain malloc, the peak resident set
(VmHWM, reset through /proc/self/clear_refs) above the resident set before, with glibc told
to map every allocation over 64 KiB on its own (MALLOC_MMAP_THRESHOLD_) so that freed tensors
leave the resident set at once instead of being reused unseen (both modes run under it).
tracemalloc would miss torch's allocations, and an in-process high-water mark would carry the
previous mode's peak.

Trained tokens are completion tokens, as the trainer counts them (`trained_tokens`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import Qwen2Config, Qwen2ForCausalLM

from pipeline.bench import machine
from pipeline.bench.generate import TAIL_MEDIAN_FRACTION, TAIL_SIGMA, long_tailed_lengths, summary
from workers.trainer.losses import LossSettings
from workers.trainer.microbatch import allocate_fixed, allocator
from workers.trainer.step import StepSettings, collate, train_step

MODES = ("dynamic", "fixed")
PROMPT_LENGTHS = (16, 64)  # uniform, inclusive; completions fill the rest up to --max-length
MMAP_THRESHOLD = 64 * 1024  # bytes: bigger allocations are mapped alone and unmapped on free


@dataclass
class Settings:
    """Defaults live with the CLI options (pipeline/commands/bench.py), which must not import this module for --help."""

    sequences: int  # per step: one minibatch
    steps: int  # measured steps per run, after one warm-up step
    max_length: int  # prompt + completion
    budget: int  # dynamic: tokens per micro-batch
    hidden_size: int
    layers: int
    vocab_size: int
    repeats: int
    seed: int
    threads: int
    device: str
    dtype: str = "float32"  # the forwards' autocast dtype (float32: none); weights and AdamW stay float32


def workload(s: Settings) -> list[tuple[list[tuple[list[int], list[int], list[float]]], list[float]]]:
    """Warm-up batch, then `steps` batches: (prompt, completion, behaviour logprobs) and advantages per sequence.
    A pure function of the settings, so every process trains on exactly these batches."""
    rng = random.Random(s.seed)
    uniform_logp = -math.log(s.vocab_size)  # what a random model gives any token

    def sequence(completion_length: int) -> tuple[list[int], list[int], list[float]]:
        prompt = [rng.randrange(1, s.vocab_size) for _ in range(rng.randint(*PROMPT_LENGTHS))]
        completion = [rng.randrange(1, s.vocab_size) for _ in range(completion_length)]
        return prompt, completion, [uniform_logp] * completion_length

    batches = []
    for _ in range(s.steps + 1):
        lengths = long_tailed_lengths(s.sequences, s.max_length - PROMPT_LENGTHS[1], rng)
        batches.append(([sequence(n) for n in lengths], [rng.choice((-1.0, 1.0)) for _ in lengths]))
    return batches


def batch_lengths(s: Settings) -> list[list[int]]:
    """Prompt + completion tokens of each sequence, per batch (warm-up first)."""
    return [[len(p) + len(c) for p, c, _ in sequences] for sequences, _ in workload(s)]


def fixed_count(lengths: list[list[int]], budget: int) -> int:
    """The smallest fixed count whose largest micro-batch, over all batches, is within `budget` tokens."""
    most = max(map(len, lengths))
    for count in range(1, most + 1):
        if all(sum(b[i] for i in rows) <= budget for b in lengths for rows in allocate_fixed(b, count)):
            return count
    raise ValueError(f"a sequence is longer than the budget of {budget} tokens")


def build_model(s: Settings) -> Qwen2ForCausalLM:
    """A Qwen2 with random weights from the seed: the same initial weights in every process."""
    heads = max(1, s.hidden_size // 64)
    config = Qwen2Config(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        num_hidden_layers=s.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        intermediate_size=4 * s.hidden_size,
        max_position_embeddings=s.max_length,
        tie_word_embeddings=True,
        dtype="float32",
    )
    torch.manual_seed(s.seed)
    return Qwen2ForCausalLM(config).to(s.device)


class PeakMemory:
    """Peak memory above a baseline: CUDA's allocator statistics, or the resident set on CPU."""

    def __init__(self, device: str):
        self.cuda = torch.device(device).type == "cuda"
        self.baseline = 0

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current resident set
                f.write("5")
            self.baseline = _status_bytes("VmRSS")

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.baseline
        return _status_bytes("VmHWM") - self.baseline


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def measure(s: Settings, mode: str, count: int) -> dict:
    """One run in this process: a warm-up step, then `steps` timed steps; prints a line per step."""
    torch.set_num_threads(s.threads)
    model = build_model(s)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    data = workload(s)
    batches = [collate(sequences, advantages, pad_id=0, device=s.device) for sequences, advantages in data]
    settings = StepSettings(
        decoupled=True,
        minibatches=1,
        grad_clip=1.0,
        temperature=1.0,
        loss=LossSettings(clip_eps=0.2),
        split=allocator(mode, s.budget, 1, count),
        dtype=getattr(torch, s.dtype),
    )

    def step(batch) -> dict:
        return train_step(model, optimizer, batch, settings)

    step(batches[0])
    memory = PeakMemory(s.device)
    memory.start()
    started = time.perf_counter()
    microbatches = []
    for batch in batches[1:]:
        microbatches.append(step(batch)["microbatches"])
        print("step", flush=True)
    if memory.cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    completion_tokens = sum(len(c) for sequences, _ in data[1:] for _, c, _ in sequences)
    return {
        "seconds": round(seconds, 3),
        "trained_tokens_per_s": round(completion_tokens / seconds, 1),
        "microbatches_per_step": statistics.fmean(microbatches),
        "peak_memory_mib": round(memory.peak() / 2**20, 1),
    }


def run_in_subprocess(s: Settings, mode: str, count: int, bar: tqdm) -> dict:
    """`measure` in a fresh Python, so each mode's peak is its own; its step lines advance the bar."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    command = [
        sys.executable,
        "-m",
        "pipeline.bench.microbatch",
        json.dumps({**asdict(s), "mode": mode, "count": count}),
    ]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) as child:
        result = None
        for line in child.stdout:
            if line.startswith("{"):
                result = json.loads(line)
            else:
                bar.update(1)
    if child.returncode != 0 or result is None:
        raise RuntimeError(f"the {mode} run failed (exit {child.returncode}); its error is above")
    return result


def largest_microbatch(lengths: list[list[int]], split) -> int:
    """Tokens of the largest micro-batch over the measured batches."""
    return max(sum(b[i] for i in rows) for b in lengths[1:] for rows in split(b))


def benchmark(s: Settings) -> dict:
    lengths = batch_lengths(s)
    count = fixed_count(lengths, s.budget)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tqdm(total=s.repeats * len(MODES) * s.steps, unit="step", desc="bench microbatch", file=sys.stderr) as bar:
        for attempt in range(1, s.repeats + 1):  # alternate, so a burst of load elsewhere hits both alike
            for mode in MODES:
                bar.set_description(f"{attempt}/{s.repeats}: {mode}")
                runs[mode].append(run_in_subprocess(s, mode, count, bar))
    modes = {}
    for mode in MODES:
        fastest = min(runs[mode], key=lambda r: r["seconds"])  # load from other processes only ever slows a run
        modes[mode] = {
            **fastest,
            "seconds_all": [r["seconds"] for r in runs[mode]],
            "peak_memory_mib": max(r["peak_memory_mib"] for r in runs[mode]),
            "largest_microbatch_tokens": largest_microbatch(lengths, allocator(mode, s.budget, 1, count)),
        }
    return summarize(s, count, lengths, modes)


def summarize(s: Settings, count: int, lengths: list[list[int]], modes: dict[str, dict]) -> dict:
    """The report: both ratios on top, each mode's numbers, the workload, every setting, model and machine."""
    dynamic, fixed = modes["dynamic"], modes["fixed"]
    with torch.device("meta"):  # the shape alone: no weights
        parameters = sum(p.numel() for p in build_model(replace(s, device="meta")).parameters())
    return {
        "dynamic_over_fixed": round(dynamic["trained_tokens_per_s"] / fixed["trained_tokens_per_s"], 3),
        "peak_memory_ratio": round(dynamic["peak_memory_mib"] / fixed["peak_memory_mib"], 3),
        "modes": modes,
        "workload": {
            "sequence_lengths": summary([n for batch in lengths[1:] for n in batch]),
            "tokens_per_step": [sum(batch) for batch in lengths[1:]],
        },
        "settings": {
            **asdict(s),
            "fixed_count": count,
            "fixed_count_rule": "smallest count whose largest micro-batch over the workload is within the budget",
            "prompt_lengths": list(PROMPT_LENGTHS),
            "completion_lengths": f"lognormal(median={TAIL_MEDIAN_FRACTION:g}*limit, sigma={TAIL_SIGMA:g}) clipped "
            f"to [1, limit], limit = max_length - {PROMPT_LENGTHS[1]}",
            "measured": "best of repeats for tokens/s, the largest for peak memory; one warm-up step per run",
            "peak_memory": "torch.cuda.max_memory_allocated above the start"
            if s.device.startswith("cuda")
            else f"VmHWM above VmRSS at the start, MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}",
            "train_step": "decoupled PPO, 1 minibatch, AdamW, clip_eps 0.2, grad_clip 1",
        },
        "model": {
            "name": "Qwen2, random weights",
            "layers": s.layers,
            "hidden_size": s.hidden_size,
            "vocab_size": s.vocab_size,
            "parameters": parameters,
            "dtype": "float32",
            "compute_dtype": s.dtype,
        },
        "machine": {**machine(), "torch_threads": s.threads, "device": s.device},
    }


def table(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"{s['sequences']} sequences per step, lengths up to {s['max_length']}, budget {s['budget']} tokens, "
        f"{s['steps']} steps, best of {s['repeats']}, {s['threads']} torch thread(s) on {s['device']}, computing in {s['dtype']}",
        f"{'mode':<10} {'micro-batches/step':>18} {'largest mb':>10} {'trained tok/s':>13} {'peak MiB':>9}",
    ]
    for mode, r in report["modes"].items():
        name = f"fixed({s['fixed_count']})" if mode == "fixed" else mode
        lines.append(
            f"{name:<10} {r['microbatches_per_step']:>18.1f} {r['largest_microbatch_tokens']:>10} "
            f"{r['trained_tokens_per_s']:>13.1f} {r['peak_memory_mib']:>9.1f}"
        )
    lines.append(
        f"dynamic/fixed: trained tokens/s {report['dynamic_over_fixed']:.2f}x, "
        f"peak memory {report['peak_memory_ratio']:.2f}x"
    )
    return "\n".join(lines)


def check(s: Settings) -> str | None:
    """What is wrong with the settings, or None."""
    if min(s.sequences, s.steps, s.layers, s.repeats, s.threads) < 1:
        return "--sequences, --steps, --layers, --repeats and --threads must be positive"
    if s.max_length <= PROMPT_LENGTHS[1]:
        return f"--max-length must exceed the longest prompt, {PROMPT_LENGTHS[1]} tokens"
    if s.budget < s.max_length:
        return "--budget must hold the longest sequence (--max-length), or no fixed count fits it"
    if s.hidden_size < 64 or s.hidden_size % 64:
        return "--hidden-size must be a multiple of 64 (attention heads of 64)"
    if s.dtype not in ("float32", "bfloat16"):
        return f"--dtype {s.dtype}: float32 or bfloat16"
    if s.vocab_size < 2:
        return "--vocab-size must be at least 2"
    if s.device != "cpu" and not (s.device.startswith("cuda") and torch.cuda.is_available()):
        return f"--device {s.device}: use cpu, or cuda where a GPU is present"
    return None


def run(args: argparse.Namespace) -> int:
    s = Settings(
        sequences=args.sequences,
        steps=args.steps,
        max_length=args.max_length,
        budget=args.budget,
        hidden_size=args.hidden_size,
        layers=args.layers,
        vocab_size=args.vocab_size,
        repeats=args.repeats,
        seed=args.seed,
        threads=args.threads,
        device=args.device,
        dtype=args.dtype,
    )
    if problem := check(s):
        print(f"asyncrl: {problem}", file=sys.stderr)
        return 2
    report = benchmark(s)
    print(table(report))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":  # one measured run, started by `run_in_subprocess`
    given = json.loads(sys.argv[1])
    mode, count = given.pop("mode"), given.pop("count")
    print(json.dumps(measure(Settings(**given), mode, count)), flush=True)
