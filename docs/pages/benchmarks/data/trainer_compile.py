"""The trainer's forward and backward on SmolLM2-135M-Instruct (`bench head`'s 1,012-position micro-batch, float32
master weights under bfloat16 autocast, one thread), eager against parts of every decoder layer compiled by
torch.compile (inductor's CPU backend, dynamic shapes): a warm-up pass of each (the compile), then interleaved
timed passes. From the repository root, with the model imported (`asyncrl model import smollm2`):

    python docs/pages/benchmarks/data/trainer_compile.py layer 3      # each whole decoder layer compiled
    python docs/pages/benchmarks/data/trainer_compile.py mlp+norms 3  # each layer's MLP and RMSNorms compiled
"""

import statistics
import sys
import time

import torch

from pipeline.bench.head import TEMPERATURE, micro_batch
from pipeline.model_cache import model_path
from workers import flops
from workers.models import load_causal_lm
from workers.trainer import step
from workers.trainer.losses import LossSettings


def compile_parts(model: torch.nn.Module, what: str) -> None:
    for layer in model.model.layers:
        if what == "layer":
            layer.compile(dynamic=True)
        elif what == "mlp+norms":
            for part in (layer.mlp, layer.input_layernorm, layer.post_attention_layernorm):
                part.compile(dynamic=True)
        else:
            raise SystemExit(f"unknown part {what!r}: layer or mlp+norms")


def main(what: str, repeats: int) -> None:
    torch.set_num_threads(1)
    path = model_path("smollm2")
    models = {"eager": load_causal_lm(path, "float32", "cpu"), what: load_causal_lm(path, "float32", "cpu")}
    compile_parts(models[what], what)
    batch = micro_batch(1024, models[what].config.vocab_size)
    loss = LossSettings(clip_eps=0.2)

    def one_pass(model: torch.nn.Module) -> tuple[float, dict]:
        model.zero_grad(set_to_none=False)
        started = time.perf_counter()
        stats, _ = step.accumulate_gradients(
            model, batch, batch.behav_logp, step.WHOLE_BATCH, TEMPERATURE, loss, dtype=torch.bfloat16
        )
        return time.perf_counter() - started, stats

    for name, model in models.items():
        seconds, stats = one_pass(model)
        print(f"{name}: warm-up {seconds:.2f} s, loss {stats['loss']:.5f}", flush=True)
    passes: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            seconds, stats = one_pass(model)
            passes[name].append(round(seconds, 3))
    work = tuple(stats[key] for key in step.WORK)
    done = flops.train_flops(models[what].config.to_dict(), *work)
    for name, seconds in passes.items():
        median = statistics.median(seconds)
        print(f"{name}: {seconds} s, median {median} s, {flops.gflops(done, median):.1f} model GFLOP/s")
    print(f"eager / {what}: {statistics.median(passes['eager']) / statistics.median(passes[what]):.3f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)
