"""A/B on a GPU: the trainer's pass at the real-pipeline shape with packed attention's grouped-query SDPA (old)
against heads repeated (new, workers/trainer/packing.py `attend`), at micro-batch budgets 16384 and the whole
batch; interleaved, median of 3. From the repository root, the GPU check's wheels on PYTHONPATH: python3 <this file>
cuda (cpu: toy sizes, where both are the same code)."""

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.bench.gpu import build_real_architecture
from workers.models import load_causal_lm
from workers.trainer import packing, step
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
for _ in range(groups):
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=g).tolist()
    for _ in range(samples):
        c = torch.randint(0, model.config.vocab_size, (completion,), generator=g).tolist()
        rows.append(step.Row(prompt, c, [-1.0] * completion))
        advantages.append(float(torch.randn(1, generator=g)))
batch = step.collate(rows, advantages, pad_id=0, device=device)
loss = LossSettings(clip_eps=0.2)
new_attend = packing.attend


def old_attend(query, key, value, run, parents, dropout, scale, grouped):
    s, e = run[0], run[-1]
    one = len(run) == 2
    return F.scaled_dot_product_attention(
        query[:, :, s:e],
        key[:, :, s:e],
        value[:, :, s:e],
        attn_mask=None if one else packing.block_causal_mask(run, query.device, parents),
        dropout_p=dropout,
        is_causal=one,
        scale=scale,
        enable_gqa=grouped,
    )


def one_pass(split):
    model.zero_grad(set_to_none=False)
    if device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    stats, _ = step.accumulate_gradients(model, batch, batch.behav_logp, split, 0.8, loss, dtype=torch.bfloat16)
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - start, stats["loss"]


for name, split in {"16384": allocator("dynamic", 16384, 1, 1), "whole batch": step.WHOLE_BATCH}.items():
    times = {"old": [], "new": []}
    losses = {}
    for fn in (old_attend, new_attend):  # warm-up
        packing.attend = fn
        one_pass(split)
    for _ in range(3):
        for variant, fn in (("old", old_attend), ("new", new_attend)):
            packing.attend = fn
            seconds, losses[variant] = one_pass(split)
            times[variant].append(seconds)
    old, new = (statistics.median(times[v]) for v in ("old", "new"))
    print(
        f"{name:>12}: grouped-query SDPA {old:.3f} s, heads repeated {new:.3f} s, old/new {old / new:.2f}x; "
        f"loss {losses['old']:.6f} vs {losses['new']:.6f}; all {times}",
        flush=True,
    )
