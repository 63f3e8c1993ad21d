"""The weights file the trainer streams every step (workers/weights.py) is a safetensors file that
safetensors itself reads back exactly, and the hash computed while writing is the file's sha256."""

import hashlib
import io

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, load_file

from workers import weights
from workers.runtime import versions_on_disk
from workers.weights import (
    WeightsError,
    WeightsFile,
    drop_versions_after,
    file_hash,
    file_metadata,
    read_verified,
    verify,
    write_safetensors,
    write_version,
)


def every_kind() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).to(torch.bfloat16),  # 14 bytes: the next tensor starts unaligned
        "f16": torch.randn(2, 2).to(torch.float16),
        "f64": torch.randn(3).double(),
        "i64": torch.tensor([1, -2, 3]),
        "i8": torch.tensor([-1, 2], dtype=torch.int8),
        "u8": torch.tensor([255, 0, 7], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "transposed": torch.arange(12.0).view(3, 4).t(),  # not contiguous
        "param": torch.nn.Parameter(torch.ones(2, 3)),  # requires grad
    }


def test_safetensors_reads_back_every_tensor_exactly_and_the_hash_is_the_files():
    tensors, stream = every_kind(), io.BytesIO()
    digest = write_safetensors(tensors, stream, {"version": "7"})
    data = stream.getvalue()
    assert digest == hashlib.sha256(data).hexdigest()
    back = load(data)
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(back[name], tensor.detach()), name
    header_size = int.from_bytes(data[:8], "little")
    assert (8 + header_size) % 8 == 0  # the tensor data starts aligned, as safetensors writes it


def test_write_version_announces_the_sha256_every_reader_verifies(tmp_path):
    tensors = every_kind()
    path, digest = write_version(tensors, tmp_path, 3, keep=2)
    assert digest == file_hash(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert verify(path, digest, 3).path == path
    with safe_open(str(path), "pt") as opened:
        assert opened.metadata() == {"version": "3"} == file_metadata(path.read_bytes())  # the header, from bytes
    assert torch.equal(load_file(path)["transposed"], tensors["transposed"])
    assert not list(tmp_path.glob("*.partial"))


def test_read_verified_loads_the_bytes_it_hashed_and_refuses_others(tmp_path, monkeypatch):
    tensors = every_kind()
    path, digest = write_version(tensors, tmp_path, 3, keep=2)
    other, _ = write_version({"f32": torch.zeros(3, 5)}, tmp_path / "other", 3, keep=1)
    real_sha256 = hashlib.sha256

    def replaced_while_hashing(data: bytes):  # a writer swaps the file in between a check and a load
        path.write_bytes(other.read_bytes())
        return real_sha256(data)

    monkeypatch.setattr(weights.hashlib, "sha256", replaced_while_hashing)
    loaded = read_verified(WeightsFile(path, 3, digest))
    assert set(loaded) == set(tensors) and torch.equal(loaded["transposed"], tensors["transposed"])
    monkeypatch.undo()
    with pytest.raises(WeightsError, match=r"weights v3: .* has sha256 .*, announced " + digest[:16]):
        read_verified(WeightsFile(path, 3, digest))  # now the other file's bytes
    assert set(read_verified(WeightsFile(path, 3))) == {"f32"}  # no hash given: loaded unchecked
    with pytest.raises(FileNotFoundError, match=r"weights v4: .* does not exist \(deleted, or storage not shared\)"):
        read_verified(WeightsFile(tmp_path / "gone.safetensors", 4, digest))


def test_a_dtype_safetensors_cannot_store_is_named():
    with pytest.raises(ValueError, match=r"weights: z has dtype torch.complex64, which safetensors cannot store"):
        write_safetensors({"a": torch.ones(1), "z": torch.ones(2, dtype=torch.complex64)}, io.BytesIO(), {})


def test_a_version_written_is_kept_with_the_newest_before_it_and_a_resume_drops_those_after_it(tmp_path):
    tensors = {"w": torch.ones(2)}
    for version in range(1, 7):
        write_version(tensors, tmp_path, version, keep=3)
    assert versions_on_disk(tmp_path) == [4, 5, 6]
    for version in range(7, 11):  # a run gets 4 versions past its checkpoint of step 6, then is killed
        write_version(tensors, tmp_path, version, keep=3)
    assert versions_on_disk(tmp_path) == [8, 9, 10]
    write_version(tensors, tmp_path, 6, keep=3)  # its resumed trainer announces the checkpoint's version
    assert versions_on_disk(tmp_path) == [6, 8, 9, 10]  # not deleted as the oldest: it is the one announced
    assert drop_versions_after(tmp_path, 6) == [8, 9, 10] and versions_on_disk(tmp_path) == [6]
    assert drop_versions_after(tmp_path, 6) == [] and drop_versions_after(tmp_path / "none", 0) == []
