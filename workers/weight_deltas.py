"""Delta versions for full fine-tuning: a version written as the elements that changed since the one before.

With `trainer.checkpoint.whole_every` K > 1, version v is whole (`v<N>.safetensors`, as `write_version` writes
it) when v % K == 0, else a delta against v - 1 (`v<N>.delta.safetensors`). After one optimizer step in bf16 a
few percent of the elements change (SmolLM2-135M at lr 5e-6: 5.4 %; docs: Benchmarks, weights). A delta is a
safetensors file holding, per changed tensor, two zlib-compressed byte strings: `<name>:gaps`, the distances
between successive changed flat indices (the first counts from -1) in the narrowest integer type that holds
them, and `<name>:values`, the new elements' bit patterns in the published dtype. Elements are compared by
bits, so -0.0 -> +0.0 is a change and a NaN's payload is kept. Measured against the alternatives (raw int32
indices: 16 % of the whole; XOR of all bytes + zlib: 7.2 %, 3x slower), this form is 5.9 %.

Its header's metadata names the base version and the sha256 of the base and of the result as WHOLE versions
(the hash `write_version` would give their whole files), and the sha256 of its own payload. The announcement
carries the base version, the delta's path and the result's whole hash. A reader (`ChainReader`) walks back
from the announced version to the version it holds or to a whole file, whichever comes first, applies the
deltas forward and loads the result only if its whole hash is the announced one. A delta missing or corrupt
on that walk refuses the version (the rollout worker sends it to `dead-letter` and keeps its weights); since
every later delta up to the next whole version needs it, those are refused at once too, and the reader
resumes at the next whole version. The evaluator's queue and the offline tools read a version from the files
on disk alone (`read_stored_version`): the same chain, its result checked against the hash its delta names.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch

from workers.runtime import delta_path, delta_versions_on_disk, stored_path, version_path, versions_on_disk
from workers.weights import (
    NonFiniteWeights,
    WeightsError,
    WeightsFile,
    check_hash,
    file_metadata,
    non_finite,
    verified_bytes,
    write_safetensors,
    write_version,
)

FORMAT = "asyncrl-delta-1"
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> an integer view
GAP_TYPES = [(1 << 8, torch.uint8), (1 << 15, torch.int16), (1 << 31, torch.int32), (1 << 63, torch.int64)]
ZLIB_LEVEL = 1  # level 6 saves 0.7 % of the whole's bytes for 5x the seconds


class DeltaError(WeightsError):
    """A delta file that is corrupt, or does not fit the version it is applied to."""


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """[numel] the tensor's elements as integers of the same width: compared, they compare bit patterns."""
    return tensor.detach().contiguous().reshape(-1).view(BITS[tensor.element_size()])


def encode_delta(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The payload turning `base` into `new` (the same names, shapes and dtypes): per tensor with a changed
    element, `<name>:gaps` and `<name>:values` as uint8 tensors of zlib-compressed bytes. ValueError when the
    two do not have the same layout (then only a whole version can publish `new`)."""
    if list(base) != list(new) or any((base[n].shape, base[n].dtype) != (new[n].shape, new[n].dtype) for n in new):
        raise ValueError("weights: a delta needs the same tensor names, shapes and dtypes as its base")
    payload: dict[str, torch.Tensor] = {}
    for name in new:
        old_bits, new_bits = bits(base[name]), bits(new[name])
        changed = torch.ne(old_bits, new_bits).nonzero().reshape(-1)  # [changed] flat indices, ascending
        if not changed.numel():
            continue
        gaps = torch.diff(changed, prepend=changed.new_tensor([-1]))  # [changed] >= 1
        gap_type = next(dtype for bound, dtype in GAP_TYPES if int(gaps.max()) < bound)
        payload[f"{name}:gaps"] = compressed(gaps.to(gap_type))
        payload[f"{name}:values"] = compressed(new_bits[changed])
    return payload


def compressed(tensor: torch.Tensor) -> torch.Tensor:
    """[bytes] uint8: the tensor's raw bytes, zlib-compressed."""
    raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    return torch.frombuffer(bytearray(zlib.compress(raw, ZLIB_LEVEL)), dtype=torch.uint8)


def decompressed(blob: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n] the elements of `dtype` a `compressed` blob holds; DeltaError when it is not one."""
    try:
        raw = bytearray(zlib.decompress(blob.numpy().tobytes()))
    except zlib.error as error:
        raise DeltaError(f"weights delta: corrupt payload ({error})") from None
    width = torch.tensor([], dtype=dtype).element_size()
    if len(raw) % width:
        raise DeltaError("weights delta: a payload's length is not a whole number of elements")
    return torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)


def apply_delta(base: dict[str, torch.Tensor], payload: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`base` with `payload` (`encode_delta`'s) applied, in `base`'s order; changed tensors are new copies,
    the others `base`'s own. DeltaError when the payload does not fit `base`."""
    names = {key.rpartition(":")[0] for key in payload}
    if unknown := sorted(names - base.keys()):
        raise DeltaError(f"weights delta: tensors not in the base ({unknown[0]}, ...)")
    result = dict(base)
    for name in names:
        if f"{name}:gaps" not in payload or f"{name}:values" not in payload:
            raise DeltaError(f"weights delta: {name} lacks its gaps or its values")
        out = base[name].clone()
        flat = bits(out)  # a view of `out`'s memory: writing it writes `out`
        values = decompressed(payload[f"{name}:values"], flat.dtype)
        gaps_raw = decompressed(payload[f"{name}:gaps"], torch.uint8)
        width = len(gaps_raw) // max(len(values), 1)
        if width not in BITS or width * len(values) != len(gaps_raw):
            raise DeltaError(f"weights delta: {name}'s gaps do not match its {len(values)} values")
        gaps = gaps_raw.view(BITS[width]).to(torch.int64)
        if gaps.numel() and (int(gaps.min()) < 1 or int(gaps.sum()) > flat.numel()):
            raise DeltaError(f"weights delta: {name}'s indices are out of order or out of range")
        flat[gaps.cumsum(0) - 1] = values
        result[name] = out
    return result


class _Discard:
    """A stream that keeps nothing: `write_safetensors` into it only hashes."""

    def write(self, data: object) -> None:
        pass


def whole_hash(tensors: dict[str, torch.Tensor], version: int) -> str:
    """The sha256 that `write_version` would give the whole file of `tensors` as `version`, without writing it."""
    return write_safetensors(tensors, _Discard(), {"version": str(version)})  # type: ignore[arg-type]


def load_ordered(data: bytes) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors in the order of their bytes in it (the order `whole_hash` hashes them in;
    safetensors' own `load` sorts them by name)."""
    tensors = safetensors.torch.load(data)
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    offsets = {name: entry["data_offsets"][0] for name, entry in header.items() if name != "__metadata__"}
    return {name: tensors[name] for name in sorted(tensors, key=offsets.__getitem__)}


@dataclass(frozen=True)
class Delta:
    """One delta file, its payload checked against the hash in its header."""

    version: int
    base_version: int
    base_sha256: str  # the base's whole hash
    sha256: str  # the result's whole hash: what the version is announced with
    payload: dict[str, torch.Tensor]


def payload_hash(payload: dict[str, torch.Tensor]) -> str:
    """sha256 of the payload's names and bytes, in order."""
    digest = hashlib.sha256()
    for name, blob in payload.items():
        digest.update(name.encode() + b"\0")
        digest.update(blob.numpy().tobytes())
    return digest.hexdigest()


def write_delta(path: Path, payload: dict[str, torch.Tensor], version: int, base: Held, sha256: str) -> None:
    """Write a delta file atomically (a `.partial` renamed into place)."""
    metadata = {
        "format": FORMAT,
        "version": str(version),
        "base_version": str(base.version),
        "base_sha256": base.sha256,
        "sha256": sha256,
        "payload_sha256": payload_hash(payload),
    }
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as stream:
        write_safetensors(payload, stream, metadata)
    os.replace(partial, path)


def read_delta(path: Path, version: int) -> Delta:
    """The delta file of `version`; FileNotFoundError when it is gone, DeltaError when it is corrupt."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"weights v{version}: delta {path} does not exist") from None
    try:
        meta = file_metadata(data)
        payload = load_ordered(data)
        delta = Delta(version, int(meta["base_version"]), meta["base_sha256"], meta["sha256"], payload)
        fits = meta["format"] == FORMAT and int(meta["version"]) == version and delta.base_version < version
    except Exception as error:  # a torn or overwritten header: any of JSON, key, number or safetensors errors
        raise DeltaError(f"weights v{version}: delta {path} is corrupt ({type(error).__name__})") from None
    if not fits:
        raise DeltaError(f"weights v{version}: {path} is not the delta of version {version}")
    if payload_hash(payload) != meta["payload_sha256"]:
        raise DeltaError(f"weights v{version}: delta {path} is corrupt (its payload's sha256 is not its header's)")
    return delta


@dataclass
class Held:
    """A verified version's whole tensors (CPU, published dtype), kept to apply the next delta to."""

    version: int
    sha256: str | None
    tensors: dict[str, torch.Tensor] = field(repr=False)


@dataclass(frozen=True)
class Published:
    """What a publication wrote: the file to announce, the version's whole hash, its base (-1: whole)."""

    path: Path
    sha256: str
    base_version: int = -1


class Publisher:
    """The trainer's side: every `whole_every`-th version whole, the others deltas against the version before.
    It keeps the last published version's tensors (one more copy of the published weights) to encode against."""

    def __init__(self, weights_dir: Path, keep: int, whole_every: int):
        self.weights_dir, self.keep, self.whole_every = weights_dir, keep, whole_every
        self.previous: Held | None = None

    def publish(self, tensors: dict[str, torch.Tensor], version: int) -> Published:
        """Write version `version` and collect what no reader can need any more. The first version after a
        (re)start reuses its delta file when that holds these very weights (a resumed trainer then continues
        the chain as an uninterrupted one would), else it is written whole."""
        base = self.previous if self.previous is not None and self.previous.version == version - 1 else None
        published = self._reuse(tensors, version) if base is None else None
        if published is None and (base is None or version % self.whole_every == 0):
            published = self._write_whole(tensors, version)
        elif published is None:
            published = self._write_delta(tensors, version, base)
        self.previous = Held(version, published.sha256, tensors)
        collect(self.weights_dir, version, self.keep)
        return published

    def _write_whole(self, tensors: dict[str, torch.Tensor], version: int) -> Published:
        path, digest = write_version(tensors, self.weights_dir, version, sys.maxsize)  # `collect` collects
        delta_path(self.weights_dir, version).unlink(missing_ok=True)  # one file per version
        return Published(path, digest)

    def _write_delta(self, tensors: dict[str, torch.Tensor], version: int, base: Held) -> Published:
        if bad := non_finite(tensors):  # as `write_version` refuses them
            raise NonFiniteWeights(
                f"weights v{version} not published: NaN or inf in {len(bad)} tensors ({bad[0]}, ...)"
            )
        try:
            payload = encode_delta(base.tensors, tensors)
        except ValueError:  # another layout: only a whole version can say it
            return self._write_whole(tensors, version)
        digest, path = whole_hash(tensors, version), delta_path(self.weights_dir, version)
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        write_delta(path, payload, version, base, digest)
        version_path(self.weights_dir, version).unlink(missing_ok=True)
        return Published(path, digest, base.version)

    def _reuse(self, tensors: dict[str, torch.Tensor], version: int) -> Published | None:
        """The delta file already written for `version`, when its result is these tensors."""
        path = delta_path(self.weights_dir, version)
        if version % self.whole_every == 0 or not path.is_file():
            return None
        try:
            delta = read_delta(path, version)
        except WeightsError:
            return None
        digest = whole_hash(tensors, version)
        base_there = any(
            p.is_file()
            for p in (
                version_path(self.weights_dir, delta.base_version),
                delta_path(self.weights_dir, delta.base_version),
            )
        )
        fits = delta.sha256 == digest and base_there
        return Published(path, digest, delta.base_version) if fits else None


def collect(weights_dir: Path, newest: int, keep: int) -> list[int]:
    """Delete the files of the versions no reader can need: of the versions up to `newest`, the newest `keep`
    stay, with the whole version their chain starts from and every delta after it. Returns the versions
    deleted. Without a whole version under the oldest kept one, nothing is deleted."""
    wholes = [v for v in versions_on_disk(weights_dir) if v <= newest]
    every = sorted({*wholes, *(v for v in delta_versions_on_disk(weights_dir) if v <= newest)})
    if not every:
        return []
    roots = [v for v in wholes if v <= every[-keep:][0]]
    if not roots:
        return []
    deleted = [v for v in every if v < roots[-1]]
    for version in deleted:
        version_path(weights_dir, version).unlink(missing_ok=True)
        delta_path(weights_dir, version).unlink(missing_ok=True)
    return deleted


class ChainReader:
    """A reader's side: turns an announced version (whole or delta) into its whole tensors, verified.

    `retain`: keep the last loaded version's tensors (one more copy of the published weights, on the CPU), so
    a delta against it needs only its own file; without, every delta is rebuilt from its whole version."""

    def __init__(self, retain: bool = False):
        self.retain = retain
        self.held: Held | None = None
        self.broken: dict[tuple[int, str], str] = {}  # (version, whole hash) -> why its file is unusable

    def read(self, weights: WeightsFile) -> dict[str, torch.Tensor]:
        """The version's whole tensors, in the order of its whole file; WeightsError (or FileNotFoundError)
        when a file is missing, corrupt or the result's hash is not the announced one. Call `hold` once they
        are loaded."""
        if weights.base_version < 0:
            return load_ordered(verified_bytes(weights))
        if weights.sha256 is None:
            raise WeightsError(f"weights v{weights.version}: a delta version needs its announced whole hash")
        deltas, tensors = self._walk(weights)
        for delta in reversed(deltas):
            tensors = apply_delta(tensors, delta.payload)
        check_hash(Path(weights.path), weights.version, whole_hash(tensors, weights.version), weights.sha256)
        return tensors

    def hold(self, weights: WeightsFile, tensors: dict[str, torch.Tensor]) -> None:
        """`tensors` (what `read` returned for `weights`) are now the loaded version."""
        if self.retain:
            self.held = Held(weights.version, weights.sha256, tensors)

    def _walk(self, weights: WeightsFile) -> tuple[list[Delta], dict[str, torch.Tensor]]:
        """The deltas from the announced version back to the held version or a whole file (newest first),
        and the tensors they start from."""
        directory, deltas = Path(weights.path).parent, []
        version, expected, path = weights.version, weights.sha256, Path(weights.path)
        while True:
            if self.held is not None and (self.held.version, self.held.sha256) == (version, expected):
                return deltas, self.held.tensors
            if deltas and version_path(directory, version).is_file():
                whole = WeightsFile(version_path(directory, version), version, expected)
                return deltas, load_ordered(verified_bytes(whole))
            if (version, expected) in self.broken:
                raise WeightsError(f"weights v{weights.version} needs v{version}: {self.broken[version, expected]}")
            try:
                delta = read_delta(path, version)
                if delta.sha256 != expected:
                    raise DeltaError(f"weights v{version}: delta {path} makes {delta.sha256[:16]}..., not {expected}")
            except (WeightsError, FileNotFoundError) as error:
                self.broken[version, expected] = str(error)
                raise
            deltas.append(delta)
            version, expected = delta.base_version, delta.base_sha256
            path = delta_path(directory, version)


@dataclass(frozen=True)
class StoredVersion:
    """A version read from a weights directory as a whole version: the bytes of its whole file (rebuilt for a
    delta version, as `write_version` would have written it) and the tensors and metadata they hold."""

    version: int
    path: Path  # the file read: the whole file, or the delta whose chain was rebuilt
    data: bytes = field(repr=False)  # their sha256 is the version's whole hash, the one announced
    tensors: dict[str, torch.Tensor] = field(repr=False)  # in the whole file's order
    metadata: dict[str, str] = field(repr=False)


def read_stored_version(weights_dir: Path, version: int, sha256: str | None = None) -> StoredVersion:
    """Version `version` from the files in `weights_dir` alone (the evaluator's queue and the offline tools:
    export, eval, replay retrain): its whole file, else its delta chain rebuilt and checked against the whole
    hash the delta's header names. `sha256`: the version's announced hash, where known. WeightsError, one line
    naming the version and the file, when a file is missing, corrupt, of another version or hashes otherwise."""
    path = stored_path(weights_dir, version)
    try:
        if path == version_path(weights_dir, version):
            data = verified_bytes(WeightsFile(path, version, sha256))
            tensors = load_ordered(data)
        else:
            tensors = rebuilt(path, version, sha256)
            stream = io.BytesIO()
            write_safetensors(tensors, stream, {"version": str(version)})  # the bytes `whole_hash` hashed
            data = stream.getvalue()
        metadata = file_metadata(data)
    except (WeightsError, FileNotFoundError) as error:
        raise WeightsError(str(error)) from None
    except Exception as error:  # safetensors' own error for a torn header or body
        raise WeightsError(
            f"weights v{version}: {path} is unreadable ({type(error).__name__}: {error}); "
            "truncated or not a safetensors file"
        ) from None
    if metadata.get("version", str(version)) != str(version):
        raise WeightsError(f"weights v{version}: {path} holds version {metadata['version']}")
    return StoredVersion(version, path, data, tensors, metadata)


def rebuilt(path: Path, version: int, sha256: str | None) -> dict[str, torch.Tensor]:
    """The whole tensors of the delta version at `path`, its chain applied and the result's hash checked;
    WeightsError naming the asked version and its file when a delta on the chain is missing or corrupt."""
    try:
        delta = read_delta(path, version)
        if sha256 is not None and delta.sha256 != sha256:
            raise WeightsError(f"weights v{version}: {path} makes {delta.sha256[:16]}..., announced {sha256[:16]}...")
        return ChainReader().read(WeightsFile(path, version, delta.sha256, delta.base_version))
    except (WeightsError, FileNotFoundError) as error:
        if str(error).startswith(f"weights v{version}: "):
            raise
        raise WeightsError(f"weights v{version}: {path} is a delta on a broken chain: {error}") from None
