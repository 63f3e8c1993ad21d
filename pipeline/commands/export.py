"""`asyncrl export`: one weight version of a run as a Hugging Face model directory (pipeline/export_model.py)."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export",
        help="write a run's weight version as a Hugging Face model directory (from_pretrained loads it)",
        description="config.json, generation_config.json, model.safetensors (the version's weights, in the dtype "
        "the run published; a LoRA run's adapter merged into its base model), the tokenizer of the run's model.path, "
        "and asyncrl.json (run, version, sha256).",
    )
    export.add_argument("--run", required=True, metavar="DIR", help="a run directory (runs/<run>, with config.yaml)")
    export.add_argument("--version", type=int, default=None, help="the weight version (default: the newest on disk)")
    export.add_argument("--out", required=True, metavar="DIR", help="the directory to write (new, or an export)")
    export.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run: write the adapter alone (adapter_config.json, adapter_model.safetensors: PEFT's layout)",
    )
    export.set_defaults(handle=handle)


def handle(args: argparse.Namespace) -> int:
    from pipeline.export_model import export_model

    print(export_model(args.run, args.version, args.out, adapter=args.adapter))
    return 0
