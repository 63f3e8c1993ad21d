"""`asyncrl model import`: a GGUF file (llama.cpp's quantized format) as an ordinary Hugging Face model directory
in the model cache (pipeline/model_cache.py), in float32, with its tokenizer and chat template.

transformers reads a GGUF file with the `gguf` package, dequantizing every tensor (and needs `accelerate` to do
so), but will not save a model it loaded that way. The import builds a plain model from the same config, copies
the weights in and checks that both give the same logits, then saves that one. It writes into a temporary
directory renamed into place once complete, so an interrupted import leaves nothing a config could name; a
second import of the same file is instant.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

from pipeline.model_cache import IMPORTED, SHIPPED, model_cache, shipped_file
from schemas.errors import ConfigError

NEEDED = ("gguf", "accelerate")  # beside transformers and torch: the `real` extra
CHECK_TOKENS = [[1, 4093, 28, 1041, 314, 216, 34, 1232, 216, 34, 47]]  # any ids below the vocabulary will do


def source(spec: str) -> tuple[str, Path]:
    """(name in the cache, GGUF file) for a shipped model's short name or a path to a .gguf file."""
    if spec in SHIPPED:
        return spec, shipped_file(spec)
    path = Path(spec)
    if path.suffix != ".gguf":
        names = ", ".join(SHIPPED)
        raise ConfigError(f"model import {spec!r}: give a .gguf file or a shipped model's name ({names})")
    if not path.is_file():
        raise ConfigError(f"model import {spec}: no such file")
    return path.stem, path.resolve()


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def import_model(spec: str, name: str | None = None) -> Path:
    """The cached model directory of `spec` (a shipped model's short name or a .gguf path), imported unless
    the same file already is. `name`: its name in the cache (default: the short name, or the file's stem)."""
    default_name, gguf = source(spec)
    name = name or default_name
    if Path(name).name != name or name in (".", ".."):
        raise ConfigError(f"model import --name {name!r}: give a plain name (model.path={name} names it)")
    out = model_cache() / name
    digest = sha256(gguf)
    note = out / IMPORTED
    if note.is_file() and json.loads(note.read_text()).get("sha256") == digest:
        return out
    missing = [module for module in NEEDED if importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigError(f"model import needs {', '.join(missing)}: pip install 'asyncrl[real]'")
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    started = time.perf_counter()
    try:
        parameters = convert(gguf, partial)
    except BaseException:  # a file transformers cannot read, or Ctrl-C: nothing half-written is left
        shutil.rmtree(partial, ignore_errors=True)
        raise
    record = {"source": str(gguf), "sha256": digest, "parameters": parameters, "dtype": "float32"}
    record["seconds"] = round(time.perf_counter() - started, 1)
    (partial / IMPORTED).write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():  # another file under that name, or an import cut short before its note
        shutil.rmtree(out)
    partial.rename(out)
    return out


def convert(gguf: Path, out: Path) -> int:
    """The GGUF file's model and tokenizer saved as a Hugging Face directory `out`; its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    settings = {k: v for k, v in loaded.config.to_dict().items() if k not in ("quantization_config", "dtype")}
    config = type(loaded.config).from_dict(settings)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    plain.eval()
    with torch.no_grad():
        ids = torch.tensor(CHECK_TOKENS)  # [1, T]
        if not torch.equal(plain(ids).logits, loaded(ids).logits):  # [1, T, vocab]
            raise RuntimeError(f"{gguf}: the rebuilt model's logits differ from the GGUF-loaded model's")
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in plain.parameters())
