"""Weights on shared storage: written whole, made visible by atomic rename, then announced.

Tied parameters (e.g. embeddings shared with the LM head) are stored once; loading
restores them through the module, since both names point at one tensor. The
announced hash is the file's sha256; every reader checks it before it loads a version
(`read_verified` hashes the very bytes it loads), so a torn or corrupted file is refused,
never half-loaded.

The trainer publishes a version every step, so the write is streamed: each tensor's
own memory goes to the file and into the hash as it is written (`write_safetensors`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import safetensors.torch
import torch

from workers.runtime import delta_path, delta_versions_on_disk, version_path, versions_on_disk


def unique_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """state_dict on CPU with every shared storage kept under its first name only."""
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.detach().to("cpu").contiguous()
    return tensors


@dataclass(frozen=True)
class WeightsFile:
    """One weight version on shared storage: what every engine's `update_weights` takes."""

    path: Path  # a safetensors file written by `write_version`
    version: int  # the trainer version the file holds
    sha256: str | None = None  # the announced hash: an engine given one never loads bytes that hash otherwise
    base_version: int = -1  # -1: `path` is a whole version; else a delta against this version (`weight_deltas`)


class WeightsError(ValueError):
    """A weight file that is missing or does not match its announced hash."""


class NonFiniteWeights(ValueError):
    """Weights holding NaN or inf: never published, since every reader would generate garbage from them."""


def non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an inf. One sum per tensor first (NaN and inf
    make it non-finite), 10x cheaper than a test per element, which then runs only if a sum is not finite."""
    floats = {name: t for name, t in tensors.items() if t.is_floating_point()}
    if not floats or bool(torch.isfinite(torch.stack([t.sum(dtype=torch.float32) for t in floats.values()])).all()):
        return []
    return [name for name, t in floats.items() if not bool(torch.isfinite(t).all())]


SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(tensors: dict[str, torch.Tensor], stream: BinaryIO, metadata: dict[str, str]) -> str:
    """Write `tensors` (on the CPU) to `stream` in the safetensors format, each straight from its own memory
    and hashed as it is written; returns the sha256 of what was written. safetensors' `save` builds the
    whole file in memory first: for the demo's 9 MB that was 16 of the 26 ms a publication took; now 11 in all."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"weights: {name} has dtype {tensor.dtype}, which safetensors cannot store")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": [*tensor.shape],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # padded as safetensors pads it: the tensor data starts 8-byte aligned
    digest = hashlib.sha256()
    for piece in (struct.pack("<Q", len(encoded)), encoded):
        stream.write(piece)
        digest.update(piece)
    for tensor in tensors.values():
        # [bytes]: a view of the tensor's own memory, no copy (unless it was not contiguous)
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        stream.write(raw)
        digest.update(raw)
    return digest.hexdigest()


def file_hash(path: Path) -> str:
    """sha256 of a file, read in chunks (a version can be many GB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def verify(path: str | Path, expected_hash: str, version: int) -> WeightsFile:
    """The version's file, once its sha256 is the announced one; WeightsError otherwise (also when it is gone)."""
    path = Path(path)
    try:
        actual = file_hash(path)
    except FileNotFoundError:
        raise WeightsError(missing(path, version)) from None
    check_hash(path, version, actual, expected_hash)
    return WeightsFile(path, version, expected_hash)


def read_verified(weights: WeightsFile) -> dict[str, torch.Tensor]:
    """The tensors of a version, from one read of its file: the bytes hashed against `weights.sha256` (if set)
    are the bytes loaded, so a file replaced between a check and a load is never loaded unchecked.
    FileNotFoundError once the file is gone, WeightsError if the bytes are not the announced ones."""
    return safetensors.torch.load(verified_bytes(weights))


def verified_bytes(weights: WeightsFile) -> bytes:
    """A version's file, read once and checked against `weights.sha256` (if set); errors as `read_verified`."""
    try:
        data = Path(weights.path).read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(missing(weights.path, weights.version)) from None
    if weights.sha256 is not None:
        check_hash(weights.path, weights.version, hashlib.sha256(data).hexdigest(), weights.sha256)
    return data


def file_metadata(data: bytes) -> dict[str, str]:
    """The string metadata in a safetensors file's header (a little-endian u64 length, then JSON)."""
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size]).get("__metadata__") or {}


def missing(path: Path, version: int) -> str:
    return f"weights v{version}: {path} does not exist (deleted, or storage not shared)"


def check_hash(path: Path, version: int, actual: str, expected: str) -> None:
    if actual != expected:
        raise WeightsError(f"weights v{version}: {path} has sha256 {actual[:16]}..., announced {expected[:16]}...")


def write_version(
    tensors: dict[str, torch.Tensor], weights_dir: Path, version: int, keep: int, metadata: dict[str, str] | None = None
) -> tuple[Path, str]:
    """Write the whole weights (`unique_state_dict`, or FSDP2's gathered `full_state_dict`) as version
    `version`, atomically; of the versions up to it, delete all but the newest `keep` (it first: a newer file
    is one a restarted trainer writes again, or removed by `drop_versions_after`). Returns (path, sha256).
    NonFiniteWeights, with nothing written, when a tensor holds NaN or inf. `metadata`: more of the file's header
    metadata (a LoRA adapter's, `workers.lora.adapter_metadata`)."""
    if bad := non_finite(tensors):
        raise NonFiniteWeights(f"weights v{version} not published: NaN or inf in {len(bad)} tensors ({bad[0]}, ...)")
    weights_dir.mkdir(parents=True, exist_ok=True)
    final = version_path(weights_dir, version)
    partial = final.with_suffix(".partial")
    with open(partial, "wb") as stream:
        digest = write_safetensors(
            tensors, stream, {**(metadata or {}), "version": str(version)}
        )  # hashed while written: no read-back
    os.replace(partial, final)
    for old in [v for v in versions_on_disk(weights_dir) if v <= version][:-keep]:
        version_path(weights_dir, old).unlink(missing_ok=True)
    return final, digest


def drop_versions_after(weights_dir: Path, version: int) -> list[int]:
    """Delete the weights files of versions after `version` and return those versions. A run resumed from
    an earlier checkpoint than its newest step abandoned them: no record of its topics names them, and the
    steps it trains anew write other weights (left, they would be the newest version on disk meanwhile)."""
    abandoned = sorted(v for v in {*versions_on_disk(weights_dir), *delta_versions_on_disk(weights_dir)} if v > version)
    for newer in abandoned:
        version_path(weights_dir, newer).unlink(missing_ok=True)
        delta_path(weights_dir, newer).unlink(missing_ok=True)  # a delta version's file (`weight_deltas`)
    return abandoned


def read_version(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of one version (raises FileNotFoundError once it was deleted)."""
    return safetensors.torch.load_file(str(path))


def load_into(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy weights in place; only names tied to a loaded tensor may be absent. All or nothing: names and
    shapes are checked before anything is copied, so a file that does not fit leaves the model as it was."""
    params = model.state_dict()
    missing = [name for name in params if name not in state_dict and not _is_tied(model, name, state_dict)]
    unexpected = [name for name in state_dict if name not in params]
    if unexpected or missing:
        raise ValueError(f"weights do not match the model: missing {sorted(missing)}, unexpected {unexpected}")
    shapes = [name for name, t in state_dict.items() if t.shape != params[name].shape]
    if shapes:
        raise ValueError(f"weights do not match the model: {len(shapes)} tensors of another shape ({shapes[0]}, ...)")
    model.load_state_dict(state_dict, strict=False)


def _is_tied(model: torch.nn.Module, name: str, state_dict: dict[str, torch.Tensor]) -> bool:
    params = model.state_dict()
    return any(params[name].data_ptr() == params[other].data_ptr() for other in state_dict if other in params)
