"""Delta versions (workers/weight_deltas.py): the pure encode/apply pair bit for bit, the chain a reader
rebuilds when it misses or finds a broken delta, what is collected, and a restarted publisher's chain."""

import hashlib
import re
import zlib

import pytest
import torch

from workers import weight_deltas as wd
from workers.runtime import (
    delta_path,
    delta_versions_on_disk,
    stored_path,
    stored_versions,
    version_path,
    versions_on_disk,
)
from workers.weights import WeightsError, WeightsFile, drop_versions_after, file_hash, unique_state_dict


def blob(data: bytes) -> bytes:
    return zlib.decompress(data)


def test_encode_exact_bytes_and_bitwise_changes():
    """-0.0 -> +0.0 and one NaN payload -> another are changes (bits, not values); an equal NaN is not."""
    nan_a = torch.tensor([0x7FC1], dtype=torch.int16).view(torch.bfloat16)
    nan_b = torch.tensor([0x7FC2], dtype=torch.int16).view(torch.bfloat16)
    base = {"w": torch.cat([torch.tensor([-0.0, 1.0, 2.0]).bfloat16(), nan_a, nan_a]), "same": torch.ones(2)}
    new = {"w": torch.cat([torch.tensor([0.0, 1.0, 3.0]).bfloat16(), nan_a, nan_b]), "same": torch.ones(2)}
    payload = wd.encode_delta(base, new)
    assert list(payload) == ["w:gaps", "w:values"]  # "same" did not change
    assert blob(payload["w:gaps"].numpy().tobytes()) == bytes([1, 2, 2])  # indices 0, 2, 4 from -1, as uint8
    values = torch.frombuffer(bytearray(blob(payload["w:values"].numpy().tobytes())), dtype=torch.int16)
    assert values.tolist() == [0x0000, 0x4040, 0x7FC2]  # +0.0, 3.0, the new NaN's bits
    result = wd.apply_delta(base, payload)
    assert torch.equal(wd.bits(result["w"]), wd.bits(new["w"]))
    assert result["same"] is base["same"]  # unchanged tensors are shared, changed ones copies
    assert wd.bits(base["w"])[0].item() == -0x8000  # the base kept its -0.0


def test_wide_gaps_take_a_wider_type_and_every_dtype_round_trips():
    base = {
        "big": torch.zeros(70_000),
        "i64": torch.arange(5),
        "flag": torch.tensor([True, False]),
        "h": torch.zeros(3, dtype=torch.float16),
    }
    new = {
        "big": base["big"].clone().index_fill_(0, torch.tensor([3, 69_999]), 1.0),  # a gap of 69,996: int32
        "i64": torch.tensor([0, 1, 7, 3, 4]),
        "flag": torch.tensor([True, True]),
        "h": torch.tensor([0.0, -0.0, 0.5], dtype=torch.float16),
    }
    payload = wd.encode_delta(base, new)
    gaps = torch.frombuffer(bytearray(blob(payload["big:gaps"].numpy().tobytes())), dtype=torch.int32)
    assert gaps.tolist() == [4, 69_996]
    result = wd.apply_delta(base, payload)
    assert all(torch.equal(wd.bits(result[n]), wd.bits(new[n])) for n in new)


def test_layout_change_and_corrupt_payloads_are_refused():
    base, new = {"w": torch.zeros(4)}, {"w": torch.ones(4)}
    with pytest.raises(ValueError):
        wd.encode_delta(base, {"w": torch.ones(5)})
    payload = wd.encode_delta(base, new)
    with pytest.raises(wd.DeltaError):
        wd.apply_delta({"w": torch.zeros(2)}, payload)  # indices out of range
    with pytest.raises(wd.DeltaError):
        wd.apply_delta(base, {"w:gaps": payload["w:gaps"], "w:values": torch.tensor([1, 2, 3], dtype=torch.uint8)})
    with pytest.raises(wd.DeltaError):
        wd.apply_delta(base, {"w:gaps": payload["w:gaps"]})


def test_whole_hash_is_the_whole_files_hash(tmp_path):
    tensors = {"b": torch.randn(3).bfloat16(), "a": torch.arange(4)}  # not in name order: the file's order counts
    path, digest = wd.write_version(tensors, tmp_path, 7, 2)
    assert wd.whole_hash(tensors, 7) == digest == file_hash(path)
    assert list(wd.load_ordered(path.read_bytes())) == ["b", "a"]


def versions(count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`count` successive bf16 weight sets of a tiny model, each with about 3 % of its elements changed."""
    torch.manual_seed(seed)
    state = {n: t.bfloat16() for n, t in unique_state_dict(tiny_model()).items()}
    out = [state]
    for _ in range(count - 1):
        state = {n: torch.where(torch.rand(t.shape) < 0.03, t + 1, t) for n, t in state.items()}
        out.append(state)
    return out


def tiny_model() -> torch.nn.Module:
    from tests.factories import tiny_qwen2

    return tiny_qwen2()


def publish_all(directory, weight_sets, whole_every=4, keep=100, start=0):
    publisher = wd.Publisher(directory, keep, whole_every)
    return [publisher.publish(t, v) for v, t in enumerate(weight_sets) if v >= start]


def announced(published: wd.Published, version: int) -> WeightsFile:
    return WeightsFile(published.path, version, published.sha256, published.base_version)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(wd.bits(a[n]), wd.bits(b[n])) for n in a)


def read_every(reader: wd.ChainReader, published, only) -> dict[int, dict[str, torch.Tensor]]:
    """What `reader` makes of each version in `only` (WeightsError -> None), holding each one it loads."""
    out = {}
    for version in only:
        weights = announced(published[version], version)
        try:
            out[version] = reader.read(weights)
        except (WeightsError, FileNotFoundError):
            out[version] = None
            continue
        reader.hold(weights, out[version])
    return out


def test_the_chain_written_is_the_schedule(tmp_path):
    published = publish_all(tmp_path, versions(7))
    assert [p.base_version for p in published] == [-1, 0, 1, 2, -1, 4, 5]
    assert versions_on_disk(tmp_path) == [0, 4] and delta_versions_on_disk(tmp_path) == [1, 2, 3, 5, 6]
    assert published[5].path == delta_path(tmp_path, 5)
    assert delta_path(tmp_path, 5).stat().st_size < version_path(tmp_path, 4).stat().st_size / 4


def test_a_reader_that_misses_deltas_ends_bit_for_bit_equal(tmp_path):
    weight_sets = versions(10)
    published = publish_all(tmp_path, weight_sets)
    every = read_every(wd.ChainReader(retain=True), published, range(10))
    assert all(same_bits(every[v], weight_sets[v]) for v in range(10))
    skipping = read_every(wd.ChainReader(retain=True), published, [0, 3, 6, 9])  # rebuilds 1-2, 4(whole)-5, 7-8
    fresh = read_every(wd.ChainReader(retain=False), published, [7])  # holds nothing: from whole version 4
    assert all(same_bits(skipping[v], every[v]) for v in (3, 6, 9)) and same_bits(fresh[7], every[7])


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_broken_delta_refuses_its_chain_until_the_next_whole_version(tmp_path, damage):
    weight_sets = versions(10)
    published = publish_all(tmp_path, weight_sets)
    broken = delta_path(tmp_path, 5)
    if damage == "missing":
        broken.unlink()
    else:
        data = bytearray(broken.read_bytes())
        data[-3] ^= 0x01  # one bit of the payload
        broken.write_bytes(bytes(data))
    reader = wd.ChainReader(retain=True)
    got = read_every(reader, published, [0, 4, 5, 6, 7, 8, 9])
    assert [v for v, t in got.items() if t is None] == [5, 6, 7]  # they all need v5; v8 is whole
    assert reader.held.version == 9 and same_bits(got[9], weight_sets[9])
    assert same_bits(got[8], weight_sets[8]) and same_bits(got[4], weight_sets[4])
    assert (5, published[5].sha256) in reader.broken


def test_a_delta_whose_result_is_not_announced_is_refused(tmp_path):
    published = publish_all(tmp_path, versions(3))
    forged = WeightsFile(published[2].path, 2, published[1].sha256, 1)
    with pytest.raises(WeightsError):
        wd.ChainReader().read(forged)


def test_collect_keeps_the_whole_version_a_kept_delta_needs(tmp_path):
    publisher = wd.Publisher(tmp_path, keep=2, whole_every=4)
    for version, tensors in enumerate(versions(10)):
        publisher.publish(tensors, version)
        if version == 6:
            assert versions_on_disk(tmp_path) == [4] and delta_versions_on_disk(tmp_path) == [5, 6]
    assert versions_on_disk(tmp_path) == [8] and delta_versions_on_disk(tmp_path) == [9]
    assert wd.collect(tmp_path, 9, 2) == []


def test_drop_versions_after_deletes_deltas_too(tmp_path):
    publish_all(tmp_path, versions(7))
    assert drop_versions_after(tmp_path, 4) == [5, 6]
    assert delta_versions_on_disk(tmp_path) == [1, 2, 3]


@pytest.mark.parametrize("killed_after", [2, 3, 4])
def test_a_restarted_publisher_continues_the_chain_exactly(tmp_path, killed_after):
    """Publish 0..killed_after, 'restart' (a new publisher that republishes the checkpointed version, as the
    trainer does on start), go on to 9: every file and announcement is the uninterrupted run's."""
    weight_sets = versions(10)
    straight = publish_all(tmp_path / "straight", weight_sets)
    run = tmp_path / "resumed"
    publish_all(run, weight_sets[: killed_after + 1])
    resumed = publish_all(run, weight_sets, start=killed_after)
    for version, (a, b) in enumerate(zip(straight[killed_after:], resumed, strict=True), start=killed_after):
        assert (a.sha256, a.base_version, a.path.name) == (b.sha256, b.base_version, b.path.name), version
        assert a.path.read_bytes() == b.path.read_bytes()


def test_stored_versions_and_their_files(tmp_path):
    publish_all(tmp_path, versions(5), whole_every=3)
    assert stored_versions(tmp_path) == [0, 1, 2, 3, 4]
    assert [stored_path(tmp_path, v).name for v in (0, 2, 3, 4, 9)] == [
        "v000000.safetensors",
        "v000002.delta.safetensors",
        "v000003.safetensors",
        "v000004.delta.safetensors",
        "v000009.safetensors",  # neither file: the whole file's name
    ]


def test_read_stored_version_rebuilds_a_delta_version_as_its_whole_file(tmp_path):
    """The bytes of a delta version are the whole file `write_version` would have written: the announced hash."""
    weight_sets = versions(7)
    published = publish_all(tmp_path, weight_sets, whole_every=3)
    for version in (2, 3, 5):  # a delta two deep, a whole version, a delta on a whole version
        stored = wd.read_stored_version(tmp_path, version, published[version].sha256)
        assert stored.path == published[version].path and stored.metadata == {"version": str(version)}
        assert same_bits(stored.tensors, weight_sets[version])
        assert hashlib.sha256(stored.data).hexdigest() == published[version].sha256
        assert same_bits(wd.load_ordered(stored.data), weight_sets[version])
    with pytest.raises(WeightsError, match="announced"):
        wd.read_stored_version(tmp_path, 5, published[4].sha256)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("corrupt 4", r"^weights v5: {dir}/v000005.delta.safetensors is a delta on a broken chain: weights v4: "
         r"delta {dir}/v000004.delta.safetensors is corrupt \(its payload's sha256 is not its header's\)$"),
        ("missing 4", r"^weights v5: {dir}/v000005.delta.safetensors is a delta on a broken chain: weights v4: "
         r"delta {dir}/v000004.delta.safetensors does not exist$"),
        ("corrupt 5", r"^weights v5: delta {dir}/v000005.delta.safetensors is corrupt \(its payload's sha256"),
        ("torn 3", r"^weights v5: .* broken chain: weights v3: {dir}/v000003.safetensors has sha256 "),
        ("missing 3", r"^weights v5: .* broken chain: weights v3: delta {dir}/v000003.delta.safetensors does not "),
        ("missing 5", r"^weights v5: {dir}/v000005.safetensors does not exist"),
    ],
)  # fmt: skip
def test_a_broken_chain_is_one_line_naming_the_version_and_the_file(tmp_path, damage, message):
    publish_all(tmp_path, versions(6), whole_every=3)
    what, version = damage.split()
    path = stored_path(tmp_path, int(version))
    if what == "missing":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[-3 if what == "corrupt" else len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    with pytest.raises(WeightsError) as error:
        wd.read_stored_version(tmp_path, 5)
    assert re.match(message.format(dir=re.escape(str(tmp_path))), str(error.value)), str(error.value)
    assert "\n" not in str(error.value)


def test_a_torn_whole_file_without_an_announced_hash_is_unreadable_or_of_another_version(tmp_path):
    publish_all(tmp_path, versions(2), whole_every=3)
    whole = version_path(tmp_path, 0)
    whole.write_bytes(whole.read_bytes()[:100])
    with pytest.raises(WeightsError, match=r"^weights v0: .*v000000.safetensors is unreadable \(.*truncated"):
        wd.read_stored_version(tmp_path, 0)
    wd.write_version({"w": torch.ones(2)}, tmp_path, 7, 10)
    version_path(tmp_path, 7).rename(version_path(tmp_path, 6))
    with pytest.raises(WeightsError, match=r"^weights v6: .*v000006.safetensors holds version 7$"):
        wd.read_stored_version(tmp_path, 6)


def test_the_engine_loads_delta_versions_and_refuses_a_broken_one(tmp_path):
    """The torch engine reads through its chain: it ends on a version's exact bits, and a delta whose result
    does not hash as announced leaves its weights as they were."""
    from workers.rollout.engine import Engine

    model = tiny_model()
    weight_sets = [{n: t.float() for n, t in s.items()} for s in versions(4)]
    published = publish_all(tmp_path, weight_sets, whole_every=8)
    engine = Engine(model, max_batch=2, version=0, chain=wd.ChainReader(retain=True))
    engine.update_weights(announced(published[1], 1))
    engine.update_weights(announced(published[3], 3))  # missed v2: rebuilt from the files
    assert same_bits(unique_state_dict(model), weight_sets[3]) and engine.version == 3
    forged = WeightsFile(published[2].path, 4, published[3].sha256, 3)
    with pytest.raises(WeightsError):
        engine.update_weights(forged)
    assert same_bits(unique_state_dict(model), weight_sets[3]) and engine.version == 3
