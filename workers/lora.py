"""LoRA: the trainer trains a low-rank adapter on the frozen base model; a version is that adapter alone.

With `model.lora.rank` > 0 the trainer wraps its model with PEFT (`wrap`): each target linear module
computes W0·x + scale·B·A·x (scale = alpha / rank), only A and B train, and a published version holds
A and B under PEFT's own names (`published_names`, what `PeftModel.from_pretrained` and vLLM read) with
the adapter's PEFT config in the file's metadata (`adapter_metadata`): the file says what it is.

A reader keeps the base weights W0 of the adapted modules and writes W0 + scale·B·A into the model at
each new version (`VersionLoader`), computed from W0 every time, so rounding never accumulates across
versions; the forward then runs at the base model's cost. Merging beats applying the adapter on the fly
for a decode step (docs: Benchmarks, LoRA). A whole version loaded in place makes its weights the new W0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors.torch
import torch

from schemas.config import LoraConfig
from workers.weights import file_metadata, load_into

if TYPE_CHECKING:
    from peft import PeftModel

ADAPTER = "lora"  # a version file's `adapter` metadata when it holds a LoRA adapter
CONFIG_KEY = "adapter_config"  # the metadata holding the adapter's PEFT config (JSON)
WEIGHTS_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"  # PEFT's directory layout
ADAPTER_NAME = "default"  # PEFT's name for the one adapter the trainer trains


def enabled(lora: LoraConfig) -> bool:
    return lora.rank > 0


INSTALL_HINT = "model.lora needs PEFT, which is not installed here: `pip install 'asyncrl[lora]'`"


def peft_config(lora: LoraConfig):
    """PEFT's LoraConfig of `model.lora`."""
    try:
        from peft import LoraConfig as PeftLoraConfig
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc

    return PeftLoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules)
    )


def wrap(model: torch.nn.Module, lora: LoraConfig) -> PeftModel:
    """`model` with a fresh adapter (A random, B zero: the base model's outputs), every base weight frozen. Modules
    in eval mode, as the trainer's full model is, except the adapter's dropout, which is on when `lora.dropout` > 0."""
    from peft import get_peft_model

    wrapped = get_peft_model(model, peft_config(lora), adapter_name=ADAPTER_NAME).eval()
    for name, module in wrapped.named_modules():
        if name.endswith(f"lora_dropout.{ADAPTER_NAME}"):
            module.train()
    return wrapped


def published_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's adapter tensors under PEFT's saved names: `...q_proj.lora_A.default.weight` ->
    `...q_proj.lora_A.weight` (names already saved so stay)."""
    tag = f".{ADAPTER_NAME}.weight"
    return {name.removesuffix(tag) + ".weight" if name.endswith(tag) else name: t for name, t in tensors.items()}


def adapter_metadata(lora: LoraConfig) -> dict[str, str]:
    """A version file's metadata saying it holds this adapter, with PEFT's config of it."""
    config = {key: sorted(v) if isinstance(v, set) else v for key, v in peft_config(lora).to_dict().items()}
    return {"adapter": ADAPTER, CONFIG_KEY: json.dumps(config, sort_keys=True, default=str)}


def is_adapter(metadata: dict[str, str]) -> bool:
    return metadata.get("adapter") == ADAPTER


def scale_of(metadata: dict[str, str]) -> float:
    """alpha / rank (alpha / sqrt(rank) for rsLoRA), from a version's metadata."""
    config = json.loads(metadata[CONFIG_KEY])
    rank = config["r"]
    return config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)


def adapter_pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module name in the plain model (`model.layers.0.self_attn.q_proj`) -> (A [r, in], B [out, r]);
    ValueError for a tensor that is not one of a pair."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module, _, half = name.removeprefix("base_model.model.").rpartition(".lora_")
        if half not in ("A.weight", "B.weight"):
            raise ValueError(f"adapter: {name} is not a LoRA A or B weight")
        halves.setdefault(module, {})[half[0]] = tensor
    unpaired = [module for module, pair in halves.items() if len(pair) != 2]
    if unpaired:
        raise ValueError(f"adapter: {len(unpaired)} modules lack A or B ({unpaired[0]}, ...)")
    return {module: (pair["A"], pair["B"]) for module, pair in halves.items()}


def merged(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W0 + scale·B·A, [out, in], computed in float32 (one addmm: the fewest passes over W0) and rounded once to
    W0's dtype."""
    return base.to(torch.float32, copy=True).addmm_(b.float(), a.float(), alpha=scale).to(base.dtype)  # [out, in]


class VersionLoader:
    """Loads versions into one model in place: a whole version as it is, an adapter merged into the base weights
    (those the model had when the first adapter came, or the last whole version loaded), kept aside."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.base: dict[str, torch.Tensor] = {}  # module name -> W0 [out, in], of the modules an adapter adapted

    def load(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        """Either kind of version; all or nothing (ValueError when it does not fit the model, which is unchanged)."""
        if not is_adapter(metadata):
            load_into(self.model, tensors)
            self.base.clear()  # these are the weights a later adapter adapts
            return
        pairs, scale = adapter_pairs(tensors), scale_of(metadata)
        modules = dict(self.model.named_modules())
        for name, (a, b) in pairs.items():
            module = modules.get(name)
            if not isinstance(module, torch.nn.Linear):
                raise ValueError(f"adapter: the model has no linear module {name}")
            if a.shape != (a.shape[0], module.in_features) or b.shape != (module.out_features, a.shape[0]):
                raise ValueError(f"adapter: {name} has A {[*a.shape]} and B {[*b.shape]}, not fitting {module}")
        with torch.no_grad():
            for name in self.base.keys() - pairs.keys():  # adapted by an earlier adapter only: back to W0
                modules[name].weight.copy_(self.base[name])
            for name, (a, b) in pairs.items():
                weight = modules[name].weight  # a view into a fused layout, maybe (workers.rollout.forward.fuse)
                base = self.base.setdefault(name, weight.detach().clone())  # [out, in]
                weight.copy_(merged(base, a.to(weight.device), b.to(weight.device), scale))  # rounded in `merged`

    def load_bytes(self, data: bytes) -> None:
        """A version from its file's bytes (already checked against the announced hash)."""
        self.load(safetensors.torch.load(data), file_metadata(data))

    def load_file(self, path: str | Path) -> None:
        """A version from its file (FileNotFoundError once it was deleted)."""
        self.load_bytes(Path(path).read_bytes())


def write_adapter_dir(data: bytes, out_dir: Path, base_model: str) -> None:
    """A PEFT adapter directory from an adapter version's bytes: adapter_config.json (its metadata's, naming
    `base_model`) and adapter_model.safetensors (the version's bytes as they are)."""
    config = json.loads(file_metadata(data)[CONFIG_KEY]) | {"base_model_name_or_path": base_model}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / WEIGHTS_FILE).write_bytes(data)
