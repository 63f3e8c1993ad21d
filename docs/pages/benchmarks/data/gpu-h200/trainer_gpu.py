"""The trainer's forward and backward on a GPU at the real-pipeline check's shape: 8 groups x 8 completions of
160 tokens after a 90-token prompt, SmolLM2-135M's architecture with random weights, float32 master weights under
bfloat16 autocast. Two measurements, from the repository root with the GPU check's wheels on PYTHONPATH:

    python3 trainer_gpu.py cuda budgets    # four micro-batch token budgets, then torch.profiler's tables for two
    python3 trainer_gpu.py cuda attention  # packed attention: grouped-query SDPA against heads repeated, interleaved

`cpu` instead of `cuda` runs either at toy sizes (there the two attentions are the same code)."""

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from pipeline.bench.gpu import REHEARSAL, build_real_architecture
from workers.models import load_causal_lm
from workers.trainer import packing, step
from workers.trainer.losses import LossSettings
from workers.trainer.microbatch import allocator

DEVICE, MODE = sys.argv[1], sys.argv[2]
SMALL = DEVICE == "cpu"
build_real_architecture(Path("/tmp/trainer-gpu-model"), REHEARSAL.real_model if SMALL else {})
MODEL = load_causal_lm("/tmp/trainer-gpu-model", "float32", DEVICE)


def shaped_batch() -> tuple[list[step.Row], step.TrainBatch]:
    groups, samples, prompt_length, completion = (2, 2, 10, 8) if SMALL else (8, 8, 90, 160)
    g, vocab = torch.Generator().manual_seed(0), MODEL.config.vocab_size
    rows, advantages = [], []
    for _ in range(groups):
        prompt = torch.randint(0, vocab, (prompt_length,), generator=g).tolist()
        for _ in range(samples):
            tokens = torch.randint(0, vocab, (completion,), generator=g).tolist()
            rows.append(step.Row(prompt, tokens, [-1.0] * completion))
            advantages.append(float(torch.randn(1, generator=g)))
    return rows, step.collate(rows, advantages, pad_id=0, device=DEVICE)


ROWS, BATCH = shaped_batch()
LOSS = LossSettings(clip_eps=0.2)


def one_pass(split) -> tuple[float, dict]:
    MODEL.zero_grad(set_to_none=False)
    if DEVICE != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    stats, _ = step.accumulate_gradients(MODEL, BATCH, BATCH.behav_logp, split, 0.8, LOSS, dtype=torch.bfloat16)
    if DEVICE != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - start, stats


def budgets() -> None:
    splits = {f"dynamic {t}": allocator("dynamic", t, 1, 1) for t in (1024, 4096, 16384)}
    splits["whole batch"] = step.WHOLE_BATCH
    for name, split in splits.items():
        one_pass(split)
        times = [one_pass(split)[0] for _ in range(3)]
        count = len(split([len(r.prompt) + len(r.completion) for r in ROWS]))
        print(f"{name:>14}: median {statistics.median(times):.3f} s, all {times}, micro-batches {count}", flush=True)
    activities = [ProfilerActivity.CPU] + ([] if SMALL else [ProfilerActivity.CUDA])
    for name in ("dynamic 1024", "whole batch"):
        with profile(activities=activities) as prof:
            one_pass(splits[name])
        averages = prof.key_averages()
        kernels = sum(e.count for e in averages if e.device_type.name == "CUDA")
        print(f"== profile, {name}: CUDA kernels {kernels}", flush=True)
        key = "self_cpu_time_total" if SMALL else "self_cuda_time_total"
        print(averages.table(sort_by=key, row_limit=14, max_name_column_width=50), flush=True)
        print(averages.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=50), flush=True)


def grouped_query_attend(query, key, value, run, parents, dropout, scale, grouped):
    """`packing.attend` with SDPA's own grouped-query heads, masked runs included (the A side)."""
    s, e = run[0], run[-1]
    one = len(run) == 2
    mask = None if one else packing.block_causal_mask(run, query.device, parents)
    q, k, v = query[:, :, s:e], key[:, :, s:e], value[:, :, s:e]
    return F.scaled_dot_product_attention(q, k, v, mask, dropout, one, scale=scale, enable_gqa=grouped)


def attention() -> None:
    variants = {"old": grouped_query_attend, "new": packing.attend}
    for name, split in {"16384": allocator("dynamic", 16384, 1, 1), "whole batch": step.WHOLE_BATCH}.items():
        times, losses = {"old": [], "new": []}, {}
        for attend in variants.values():  # warm-up
            packing.attend = attend
            one_pass(split)
        for _ in range(3):
            for variant, attend in variants.items():
                packing.attend = attend
                seconds, stats = one_pass(split)
                times[variant].append(seconds)
                losses[variant] = stats["loss"]
        old, new = (statistics.median(times[v]) for v in ("old", "new"))
        print(
            f"{name:>12}: grouped-query SDPA {old:.3f} s, heads repeated {new:.3f} s, old/new {old / new:.2f}x; "
            f"loss {losses['old']:.6f} vs {losses['new']:.6f}; all {times}",
            flush=True,
        )


{"budgets": budgets, "attention": attention}[MODE]()
