"""`asyncrl export`: one weight version of a run as a Hugging Face model directory (pipeline/export_model.py)."""

from __future__ import annotations

import argparse
import sys


def add_parser(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export",
        help="write a run's weight version as a Hugging Face model directory (from_pretrained loads it)",
        description="config.json, generation_config.json, model.safetensors (the version's weights, in the dtype "
        "the run published; a LoRA run's adapter merged into its base model), the tokenizer of the run's model.path, "
        "and asyncrl.json (run, version, sha256). A delta version is rebuilt from its chain and its hash checked.",
    )
    export.add_argument("--run", required=True, metavar="DIR", help="a run directory (runs/<run>, with config.yaml)")
    export.add_argument(
        "--version", type=int, default=None, help="the weight version, whole or delta (default: the newest on disk)"
    )
    export.add_argument("--out", required=True, metavar="DIR", help="the directory to write (new, or an export)")
    export.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run: write the adapter alone (adapter_config.json, adapter_model.safetensors: PEFT's layout)",
    )
    export.set_defaults(handle=handle)


def handle(args: argparse.Namespace) -> int:
    """0 when exported, 2 for unusable input (ConfigError, printed by the CLI), 1 for a corrupt version."""
    from pipeline.export_model import export_model
    from workers.weights import WeightsError

    try:
        print(export_model(args.run, args.version, args.out, adapter=args.adapter))
    except WeightsError as exc:  # a version file, or a delta of its chain, missing or corrupt
        print(f"asyncrl: {exc}", file=sys.stderr)
        return 1
    return 0
