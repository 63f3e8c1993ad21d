"""`asyncrl export`: one weight version of a run as a Hugging Face model directory.

A run keeps its weights as bare safetensors versions (`workers.weights`), which the rollout
engine loads into the model it built from `model.path`. To use a trained policy elsewhere the
version goes back into that model and out as a directory `AutoModelForCausalLM.from_pretrained`
loads: config.json, generation_config.json, model.safetensors (in the dtype the run published,
so greedy outputs equal the run's engine at that version), the tokenizer (with its chat
template), and asyncrl.json naming the run, version and the version's sha256 (its whole file's, the hash the
trainer announced). A delta version (`trainer.checkpoint.whole_every` > 1) is rebuilt from its chain of
deltas and checked against that hash first. `asyncrl run` exports its final version to `<run dir>/final-model/`.

A LoRA run's version is an adapter: the export merges it into the base model (W0 + scale·B·A, as the
rollout engine does, `workers.lora`), or with `adapter=True` (`--adapter`) writes the adapter alone as a
PEFT directory (adapter_config.json, adapter_model.safetensors) that `PeftModel.from_pretrained` loads
onto the base model, with the tokenizer and asyncrl.json beside it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipeline.config import ConfigError, load_config
from schemas.config import RunConfig

if TYPE_CHECKING:
    from workers.weight_deltas import StoredVersion

NOTE = "asyncrl.json"  # what an export holds beside the model files; also marks a directory as an export
FINAL_DIR = "final-model"


def run_config(run_dir: Path) -> RunConfig:
    """The config a run's workers ran with; ConfigError when `run_dir` is not a run directory."""
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} does not exist")
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no config.yaml: not a run directory (runs/<name>-<time>)")
    return load_config(path)


def on_disk(configured: str, fallback: Path) -> Path:
    """A path the config names, or its usual place in the run directory when the run was moved."""
    path = Path(configured) if configured else fallback
    return fallback if not path.exists() and fallback.exists() else path


def pick_version(weights_dir: Path, version: int | None) -> int:
    """`version`, or the newest on disk (None), whole or delta; ConfigError when it is gone."""
    from workers.runtime import stored_versions

    kept = stored_versions(weights_dir)
    if not kept:
        raise ConfigError(f"{weights_dir} holds no weight versions (the trainer published none, or they are gone)")
    version = kept[-1] if version is None else version
    if version not in kept:
        listed = ", ".join(map(str, kept))
        raise ConfigError(
            f"version {version} is not on disk in {weights_dir} (kept: {listed}); trainer.checkpoint.keep_versions "
            "keeps more"
        )
    return version


def clear_out_dir(out_dir: Path) -> None:
    """Refuse to write into a directory holding anything but an earlier export (its files are replaced)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir} is a file")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / NOTE).exists():
        raise ConfigError(f"--out {out_dir} is not empty and not an earlier export: choose a new directory")
    out_dir.mkdir(parents=True, exist_ok=True)


def export_model(run_dir: str | Path, version: int | None, out_dir: str | Path, adapter: bool = False) -> Path:
    """Write weight `version` of the run (None: the newest on disk) as a Hugging Face model directory at
    `out_dir` (a LoRA version merged into the base; `adapter`: the adapter alone, as PEFT saves one); returns
    `out_dir`. ConfigError (one line) when the run, its config, base model or version is missing, or `adapter` is
    asked of a whole version; WeightsError (one line, naming the file) when the version's file or a delta of
    its chain is corrupt."""
    from transformers import AutoTokenizer

    from workers.lora import is_adapter, write_adapter_dir
    from workers.weight_deltas import read_stored_version

    run_dir, out_dir = Path(run_dir).resolve(), Path(out_dir).resolve()
    config = run_config(run_dir)
    weights_dir = on_disk(config.trainer.checkpoint.weights_dir, run_dir / "weights")
    version = pick_version(weights_dir, version)
    base = on_disk(config.model.path, run_dir / "model")
    if not (base / "config.json").is_file():
        raise ConfigError(f"model.path {base}: no Hugging Face model there (its config and tokenizer are exported)")
    stored = read_stored_version(weights_dir, version)
    if adapter and not is_adapter(stored.metadata):
        raise ConfigError(f"--adapter: version {version} is a whole model, not a LoRA adapter (model.lora.rank 0)")
    clear_out_dir(out_dir)
    dtype = next((t.dtype for t in stored.tensors.values() if t.is_floating_point()), torch.float32)  # as published
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    if adapter:
        write_adapter_dir(stored.data, out_dir, str(base))
    else:
        write_model(base, stored, dtype, tokenizer, out_dir)
    tokenizer.save_pretrained(str(out_dir))
    note = {
        "run": str(run_dir),
        "version": version,
        "weights_file": str(stored.path),
        "sha256": hashlib.sha256(stored.data).hexdigest(),
        "adapter": adapter,
        "dtype": str(dtype).removeprefix("torch."),
        "base_model": str(base),
        "template": config.data.template,
        "system_prompt": config.data.system_prompt,
    }
    (out_dir / NOTE).write_text(json.dumps(note, indent=2) + "\n")
    (out_dir / "README.md").write_text(readme(note))
    return out_dir


def write_model(base: Path, stored: StoredVersion, dtype: torch.dtype, tokenizer, out_dir: Path) -> None:
    """The base model in `dtype` with the version `stored` loaded (an adapter merged), saved to `out_dir`."""
    from transformers import AutoModelForCausalLM

    from workers.lora import VersionLoader

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=dtype)
    VersionLoader(model).load(stored.tensors, stored.metadata)
    generation = model.generation_config
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):  # generate() stops and pads as the run did
        if getattr(generation, name, None) is None and getattr(tokenizer, name, None) is not None:
            setattr(generation, name, getattr(tokenizer, name))
    model.save_pretrained(str(out_dir))


def readme(note: dict) -> str:
    """A few lines for whoever finds the directory: where it came from and how to load it."""
    prompt = "the tokenizer's chat template" if note["template"] == "chat" else "the prompt text as is (raw)"
    load = (
        "    from peft import PeftModel\n"
        "    from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), THIS_DIRECTORY)\n"
        if note["adapter"]
        else "    from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "    model = AutoModelForCausalLM.from_pretrained(THIS_DIRECTORY)\n"
    )
    what = "A LoRA adapter" if note["adapter"] else "Weights"
    return (
        f"# asyncrl export: version {note['version']} of {Path(note['run']).name}\n\n"
        f"{what} from {note['weights_file']} (the version's sha256 {note['sha256']}), {note['dtype']}, on the "
        f"architecture and tokenizer of {note['base_model']} (BASE). The run encoded prompts with {prompt}.\n\n"
        f"{load}"
        "    tokenizer = AutoTokenizer.from_pretrained(THIS_DIRECTORY)\n"
    )


def export_final(run_dir: Path, summary: dict) -> dict:
    """The run's newest version to `<run dir>/final-model/`, its path in summary.json as `exported_model`.
    A failure is one line on stderr and `exported_model: null`: the run's summary is never lost to it."""
    try:
        exported = str(export_model(run_dir, None, run_dir / FINAL_DIR))
    except Exception as exc:  # the run is over and its results are written; say what is missing
        reason = next(iter(str(exc).splitlines()), type(exc).__name__)
        print(f"asyncrl: final model not exported ({reason})", file=sys.stderr)
        exported = None
    summary = {**summary, "exported_model": exported}
    try:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    except OSError as exc:
        print(f"asyncrl: summary.json not updated with exported_model ({exc})", file=sys.stderr)
    return summary
