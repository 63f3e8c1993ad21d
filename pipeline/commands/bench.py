"""`asyncrl bench <name>` runs pipeline/bench/<name>.py; its options are declared here, so --help stays light."""

from __future__ import annotations

import argparse

from pipeline.commands.options import add_device_option, add_no_progress, add_task_option


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="measure the system's parts against baselines")
    kinds = bench.add_subparsers(dest="bench", required=True)
    for name, add_options, texts in KINDS:
        add_options(kinds.add_parser(name, **texts))
    bench.set_defaults(handle=handle)


def handle(args: argparse.Namespace) -> int:
    from pipeline.bench import run

    return run(args)


def add_model_options(parser: argparse.ArgumentParser, demo_task: str) -> None:
    """--task, and --model with --eval-rows: a bench on the demo model of a task, or on a real model."""
    from pipeline.bench import REAL_MODEL_TASK

    add_task_option(parser, default=demo_task, real_model=REAL_MODEL_TASK)
    parser.add_argument(
        "--model",
        help=f"a model directory or an imported model's short name (e.g. smollm2): run on it with the shipped "
        f"real-model config {REAL_MODEL_TASK} (wordmath, chat template, its lr, batch, output limit, temperature and "
        "loss aggregation) unless --task names another (default: the task's demo model)",
    )
    parser.add_argument(
        "--eval-rows", type=int, help="held-out rows evaluated (eval.max_rows; default: the config's, 0 = all)"
    )


def add_pipeline_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. rollout.max_batch=16")
    add_model_options(parser, demo_task="chain")
    parser.add_argument("--out", help="JSON results file (default: runs/bench/pipeline-<task>.json)")
    parser.add_argument(
        "--steps", type=int, help="trainer steps per run (default: 60; with --model: the config's trainer.steps)"
    )
    parser.add_argument(
        "--warmup-steps", type=int, default=10, help="steps left out of the measurement (default: %(default)s)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        help="output length limit (default: the task config's rollout.max_new_tokens, 0 = the task's own)",
    )
    parser.add_argument("--batch-groups", type=int, help="groups per step (default: 8; with --model: the config's)")
    parser.add_argument("--n-samples", type=int, help="samples per group (default: 8; with --model: the config's)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument(
        "--lr",
        type=float,
        help="trainer learning rate; tiny by default, so the policy (and its output lengths) stays "
        "the same in every run and the ratios measure the system, not learning (default: 1e-09; with --model: "
        "the config's, whose policy learns)",
    )
    add_no_progress(parser)


def add_peer_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the task config, for both systems")
    add_model_options(parser, demo_task="arith")
    parser.add_argument(
        "--steps",
        type=int,
        help="trainer steps of each (default: 1,200 on arith, TRL's run in docs: Benchmarks, which needs them to learn "
        "what asyncrl's shipped arith config learns in 600; else the task config's trainer.steps)",
    )
    parser.add_argument("--seed", type=int, default=0, help="demo model, data order and sampling (default: 0)")
    parser.add_argument(
        "--threads", type=int, help="cores both systems are pinned to, the peer's torch threads (default: all usable)"
    )
    parser.add_argument(
        "--eval-every", type=int, help="steps between held-out evaluations (default: the task config's eval.every)"
    )
    parser.add_argument("--out", help="JSON results file, the plot next to it (default: runs/bench/peer-<task>.json)")
    add_no_progress(parser)


def add_sandbox_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--executions", type=int, default=200, help="per program and parallelism (default: %(default)s)"
    )
    parser.add_argument(
        "--parallelism", type=int, nargs="+", default=[1, 2], help="executions at a time, threads (default: 1 2)"
    )
    parser.add_argument("--out", default="runs/bench/sandbox.json", help="JSON results file (default: %(default)s)")


def add_generate_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/bench/generate.json", help="JSON results file (default: %(default)s)")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=64,
        help="engine max_batch, and HF batch size unless --hf-batch (default: %(default)s)",
    )
    parser.add_argument(
        "--requests", type=int, default=256, help="requests per length distribution (default: %(default)s)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=96,
        help="the longest output; every fixed-length request is this long (default: %(default)s)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="weights, prompts, lengths and sampling (default: %(default)s)"
    )
    parser.add_argument("--hf-batch", type=int, default=None, help="HF generate batch size (default: --concurrency)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; more only pays on an idle machine, tiny matmuls lose under contention "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="alternating runs per system and length distribution; the fastest counts (default: %(default)s)",
    )
    add_device_option(parser)
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="the model's weights and activations, in both systems; auto as model.dtype=auto: bfloat16 on CUDA, "
        "and on a CPU with native bfloat16 for a model 512 wide or wider, else float32 (default: %(default)s)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a model directory or an imported model's short name (e.g. smollm2), on chat-template wordmath "
        "prompts (default: the demo-sized model, random weights, on random digit prompts)",
    )


def add_staleness_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. trainer.optim.lr=3e-4")
    add_task_option(parser)
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true", help="eta 0 and 4 only, seed 0, half the steps")
    preset.add_argument("--large", action="store_true", help="large staleness: eta 0 4 8 16 32, every variant, 3 seeds")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=("naive", "decoupled", "icepop", "m2po"),
        help="objectives: naive PPO, decoupled PPO, decoupled with IcePop, M2PO (default: naive decoupled; "
        "--large: all four)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds (default: 0 1 2; --quick: 0)")
    parser.add_argument(
        "--etas",
        type=int,
        nargs="+",
        help="max_staleness values (default: 0 1 2 4 8; --quick: 0 4; --large: 0 4 8 16 32); part of a grid, "
        "to --merge with the rest",
    )
    parser.add_argument(
        "--steps", type=int, help="trainer steps per run (default: the task config's trainer.steps; --quick: half)"
    )
    parser.add_argument(
        "--eval-every", type=int, default=50, help="steps between held-out evaluations (default: %(default)s)"
    )
    parser.add_argument(
        "--out",
        help="JSON results file, the plot next to it as .png "
        "(default: runs/bench/staleness-<task>.json; --quick, --large: runs/bench/staleness-<task>-quick.json, "
        "-large.json)",
    )
    add_no_progress(parser)
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="run nothing: one table and plot from reports of separate runs (e.g. one seed each)",
    )


def add_microbatch_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/bench/microbatch.json", help="JSON results file (default: %(default)s)")
    parser.add_argument("--sequences", type=int, default=32, help="sequences per step (default: %(default)s)")
    parser.add_argument(
        "--steps", type=int, default=5, help="timed steps per run, after one warm-up (default: %(default)s)"
    )
    parser.add_argument(
        "--max-length", type=int, default=512, help="longest sequence, prompt + completion (default: %(default)s)"
    )
    parser.add_argument(
        "--budget",
        type=int,
        default=1024,
        help="tokens per dynamic micro-batch; the fixed count is chosen to stay within it (default: %(default)s)",
    )
    parser.add_argument("--hidden-size", type=int, default=256, help="model width (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="model depth (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="(default: %(default)s)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="alternating runs per mode, each in a fresh process; the fastest counts (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights, lengths and tokens (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    add_device_option(parser)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the forwards' compute dtype (autocast; float32 master weights either way) (default: %(default)s)",
    )


def add_smollm2_model_option(parser: argparse.ArgumentParser) -> None:
    """--model for the benchmarks that only make sense on a real model: SmolLM2 unless told otherwise."""
    parser.add_argument(
        "--model",
        default="smollm2",
        help="a Hugging Face model directory or an imported model's name (default: %(default)s, SmolLM2-135M-Instruct)",
    )


def add_weights_options(parser: argparse.ArgumentParser) -> None:
    add_smollm2_model_option(parser)
    parser.add_argument("--lr", type=float, default=5e-6, help="AdamW's learning rate (default: %(default)s)")
    parser.add_argument("--sequences", type=int, default=4, help="random-token sequences (default: %(default)s)")
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="of the tokens (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--scratch", help="where the versions are written (default: the system's temporary dir)")
    parser.add_argument("--out", default="runs/bench/weights.json", help="JSON results file (default: %(default)s)")


def add_head_options(parser: argparse.ArgumentParser) -> None:
    add_smollm2_model_option(parser)
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[1024, 2750],
        help="packed positions of each micro-batch measured, about (default: %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="rounds of one timed pass per method, after a warm-up pass of each (default: %(default)s)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--out", default="runs/bench/head.json", help="JSON results file (default: %(default)s)")


KINDS = [  # (name, its options, add_parser's help and description), in the order `asyncrl bench --help` lists them
    ("generate", add_generate_options, dict(help="engine tokens/s vs Hugging Face generate at equal concurrency")),
    (
        "head",
        add_head_options,
        dict(
            help="trainer forward+backward on a real model: full-vocabulary log-softmax vs the chunked head",
            description="One packed micro-batch of --model per --tokens, shaped as smollm2-math trains (2 groups of "
            "8 completions after a shared prompt), forward and backward as the trainer runs them (autocast at "
            "model.dtype=auto's dtype) with the LM head's log-softmax over every position's full vocabulary, and "
            "with the trainer's head over completion positions in checkpointed chunks; each in a fresh process. "
            "Reports seconds, peak resident memory and fb_mfu, beside the MFU of the pass's matrix products alone at "
            "its shapes: the most fb_mfu could be.",
        ),
    ),
    (
        "microbatch",
        add_microbatch_options,
        dict(help="trainer tokens/s and peak memory: token-budget vs fixed-count micro-batches"),
    ),
    (
        "pipeline",
        add_pipeline_options,
        dict(
            help="training throughput: eta=0 vs eta=4, interruption on vs off",
            description="Three whole pipelines of --task's shipped config (default chain), back to back on one demo "
            "model: eta 0 (sync), eta 4 with interruption, eta 4 without. Reports trained and generated tokens/s, "
            "the cores each role was given and used, the machine's cores, and each run's rollout and trainer model "
            "GFLOP/s and MFU against one core's matmul ceiling in the runs' dtype. --model runs them on a real model "
            "with the shipped smollm2-math config (its batch, lr, output limit and sampling).",
        ),
    ),
    (
        "staleness",
        add_staleness_options,
        dict(
            help="held-out accuracy vs staleness bound eta, naive vs decoupled PPO (the paper's Table 2), "
            "IcePop and M2PO",
            description="Train --task (its shipped config, default chain) with eta in {0, 1, 2, 4, 8} under naive "
            "and decoupled PPO, one whole pipeline per run, from one warm-up model per seed; each cell is the mean "
            "+- sample sd over the seeds. The full grid is 5 x 2 x 3 seeds = 30 runs of the task's trainer.steps "
            "(arith: 1,200 steps, about 3 h on 2 idle CPU cores, 4-6 h on busy ones; chain: to be measured). "
            "--quick: eta 0 and 4, one seed, half the steps, 4 runs (arith: about 15 min idle, 21 min on 2 busy "
            "cores). --large: eta in {0, 4, 8, 16, 32} x naive, decoupled, decoupled with IcePop and M2PO x 3 "
            "seeds = 60 runs. --variants picks the objectives of any grid.",
        ),
    ),
    (
        "peer",
        add_peer_options,
        dict(
            help="held-out accuracy vs wall time: asyncrl run against TRL's GRPOTrainer (the peer extra)",
            description="TRL's GRPOTrainer, then `asyncrl run --task`, one after the other on the same cores, from "
            "the same demo model, with the task config's batch, samples, lr and output limit; both scored by "
            "asyncrl's evaluator. Reports each one's accuracy against wall time and time_to_peer_final_ratio "
            "(asyncrl's time to the peer's final accuracy / the peer's wall time). --model runs both on a real model "
            "with the shipped smollm2-math config, TRL in the dtype model.dtype=auto resolves to and on the chat "
            "prompts asyncrl's rollout sends. Needs pip install -e '.[peer]'.",
        ),
    ),
    (
        "sandbox",
        add_sandbox_options,
        dict(
            help="sandboxed executions of untrusted Python per second, cold (a bwrap each) and warm",
            description="Runs `pass` and a small checker in workers/sandbox/bwrap.py's sandbox, cold (a fresh "
            "bwrap per execution) and warm (a fork of a warm server in fresh namespaces), --executions times at "
            "each --parallelism, and the same Python alone outside it for scale; needs bwrap (package bubblewrap).",
        ),
    ),
    (
        "weights",
        add_weights_options,
        dict(
            help="bytes written per weight version and seconds to publish and load it: whole vs delta",
            description="Loads --model in float32, trains one AdamW step on random tokens, casts both versions to "
            "bfloat16 and measures the second as a whole version and as a delta against the first "
            "(trainer.checkpoint.whole_every): bytes, publish and load seconds, the fraction of elements changed.",
        ),
    ),
]
