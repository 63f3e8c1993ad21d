"""Where the trainer's forward+backward goes on a GPU at the real-pipeline check's shape (8 groups x 8 completions
of 160 tokens after a 90-token prompt, SmolLM2-135M architecture, random weights, float32 master, bf16 autocast),
under four micro-batch token budgets, then torch.profiler's tables for two of them.

From the repository root, the GPU check's wheels on PYTHONPATH: python3 <this file> cuda (cpu: toy sizes)."""

import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pipeline.bench.gpu import build_real_architecture
from workers.models import load_causal_lm
from workers.trainer import step
from workers.trainer.losses import LossSettings
from workers.trainer.microbatch import allocator

device = sys.argv[1]
small = device == "cpu"
changes = (
    {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }
    if small
    else {}
)
path = Path("/tmp/prof-model")
build_real_architecture(path, changes)
model = load_causal_lm(str(path), "float32", device)
groups, samples, prompt_len, completion = (2, 2, 10, 8) if small else (8, 8, 90, 160)
g = torch.Generator().manual_seed(0)
rows, advantages = [], []
vocab = model.config.vocab_size
for _ in range(groups):
    prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
    for _ in range(samples):
        rows.append(step.Row(prompt, torch.randint(0, vocab, (completion,), generator=g).tolist(), [-1.0] * completion))
        advantages.append(float(torch.randn(1, generator=g)))
batch = step.collate(rows, advantages, pad_id=0, device=device)
loss = LossSettings(clip_eps=0.2)
dtype = torch.bfloat16


def sync():
    if device != "cpu":
        torch.cuda.synchronize()


def one_pass(split):
    model.zero_grad(set_to_none=False)
    sync()
    start = time.perf_counter()
    stats, _ = step.accumulate_gradients(model, batch, batch.behav_logp, split, 0.8, loss, dtype=dtype)
    sync()
    return time.perf_counter() - start, stats


splits = {f"dynamic {t}": allocator("dynamic", t, 1, 1) for t in (1024, 4096, 16384)} | {
    "whole batch": step.WHOLE_BATCH
}
for name, split in splits.items():
    one_pass(split)
    times = [one_pass(split)[0] for _ in range(3)]
    _, stats = one_pass(split)
    print(
        f"{name:>14}: median {statistics.median(times):.3f} s  (all {[round(t, 3) for t in times]}), "
        f"micro-batches {len(split([len(r.prompt) + len(r.completion) for r in rows]))}, "
        f"positions {stats.get('packed_positions')}",
        flush=True,
    )


activities = [ProfilerActivity.CPU] + ([] if small else [ProfilerActivity.CUDA])
for name in ("dynamic 1024", "whole batch"):
    with profile(activities=activities) as prof:
        one_pass(splits[name])
    averages = prof.key_averages()
    kernels = sum(e.count for e in averages if e.device_type.name == "CUDA") if not small else 0
    print(f"== profile, {name}: CUDA kernels {kernels}", flush=True)
    key = "self_cpu_time_total" if small else "self_cuda_time_total"
    print(averages.table(sort_by=key, row_limit=14, max_name_column_width=50), flush=True)
    print(averages.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=50), flush=True)
