"""Weight announcements: the run's key, the exact signature, and readers that take only signed announcements
of whole files, dead-letter the rest with the reason and keep the weights they have."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import hmac
import stat

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.config import load_config, resolve
from schemas.messages import DeadLetter, WeightVersion, encode
from tests.factories import tiny_qwen2
from topics.memory import MemoryTransport
from topics.names import TopicLayout
from topics.transport import WeightsFollower
from workers import runtime
from workers.announce import (
    AnnouncementCheck,
    create_key,
    load_key,
    signature,
    signature_problem,
    signed_headers,
)
from workers.rollout import worker as rollout_worker
from workers.weights import load_into, unique_state_dict, write_version

KEY = b"0123456789abcdef"
ANNOUNCED = WeightVersion(
    version=7,
    uri="/runs/r/weights/v000007.safetensors",
    content_hash="ab" * 32,
    step=7,
    groups_consumed=56,
    groups_dropped=1,
    final=True,
)
SIGNED = "84214665d30bf0d638fe84d96cd6806b4f8fbb24ab496d06325b1cf6ae4582cc"  # of schema_version 4 bytes


def test_the_signature_is_hmac_sha256_of_the_announcement_bytes():
    assert signature(KEY, ANNOUNCED) == SIGNED
    assert hmac.new(KEY, encode(ANNOUNCED), hashlib.sha256).hexdigest() == SIGNED
    assert signature(b"another run's key", ANNOUNCED) != SIGNED
    assert signature(KEY, msgspec.structs.replace(ANNOUNCED, final=False)) != SIGNED  # every field is signed
    assert signed_headers(KEY, ANNOUNCED) == {"asyncrl-signature": SIGNED}
    assert signed_headers(None, ANNOUNCED) == {}  # a run without a key signs nothing


def test_the_run_key_is_private_and_written_once(tmp_path):
    path = create_key(tmp_path)
    assert path == tmp_path / "run.key" and stat.S_IMODE(path.stat().st_mode) == 0o600
    key = load_key(tmp_path)
    assert len(key) == 64 and bytes.fromhex(key.decode())
    assert create_key(tmp_path) == path and load_key(tmp_path) == key  # `prepare` again keeps it
    assert load_key(tmp_path / "elsewhere") is None


def test_signature_problems_name_what_is_wrong():
    header = [("asyncrl-signature", SIGNED.encode())]
    assert signature_problem(KEY, ANNOUNCED, header) is None
    assert signature_problem(None, ANNOUNCED, []) is None  # no key: nothing to check against
    assert signature_problem(KEY, ANNOUNCED, []) == (
        "weights v7: unsigned announcement (this run signs every one), ignored"
    )
    assert signature_problem(KEY, ANNOUNCED, [("asyncrl-signature", b"0" * 64)]) == (
        "weights v7: wrong signature (not this run's trainer), ignored"
    )
    moved = msgspec.structs.replace(ANNOUNCED, uri="/tmp/mine.safetensors")  # a real signature, another path
    assert "wrong signature" in signature_problem(KEY, moved, header)


def announcement(weights_dir, version: int, final: bool = False) -> WeightVersion:
    """A whole version file of one tensor, announced with its path and sha256."""
    path, digest = write_version({"w": torch.full((4,), float(version))}, weights_dir, version, keep=10)
    return WeightVersion(
        version=version, uri=str(path), content_hash=digest, step=version, groups_consumed=0, groups_dropped=0,
        final=final,
    )  # fmt: skip


async def test_the_follower_keeps_its_version_past_forged_missing_and_corrupt_announcements(tmp_path):
    transport = MemoryTransport(TopicLayout())
    first, forged_final, foreign, missing, corrupt, later = (announcement(tmp_path, n) for n in range(1, 7))
    forged_final = msgspec.structs.replace(forged_final, final=True)
    missing = msgspec.structs.replace(missing, uri=str(tmp_path / "gone.safetensors"))
    corrupt_file = tmp_path / "v000005.safetensors"
    corrupt_file.write_bytes(corrupt_file.read_bytes()[:-1] + b"\x00")
    async with transport.outbox() as outbox, transport.weights_follower(outbox, origin="reader") as inbox:
        follower = WeightsFollower(inbox, AnnouncementCheck(KEY))
        await outbox.send_now("weights", first, headers=signed_headers(KEY, first))
        assert await follower.poll() == first
        await outbox.send_now("weights", forged_final)  # unsigned
        await outbox.send_now("weights", foreign, headers=signed_headers(b"another run's key", foreign))
        for bad in (missing, corrupt):
            await outbox.send_now("weights", bad, headers=signed_headers(KEY, bad))
        assert await follower.poll() == first  # each refused, newest first: the old weights stay
        await outbox.send_now("weights", later, headers=signed_headers(KEY, later))
        assert await follower.poll() == later
    letters = transport.broker.messages("dead-letter", DeadLetter)
    reasons = {msgspec.msgpack.decode(letter.payload, type=WeightVersion).version: letter.reason for letter in letters}
    assert reasons == {
        2: "weights v2: unsigned announcement (this run signs every one), ignored",
        3: "weights v3: wrong signature (not this run's trainer), ignored",
        4: f"weights v4: {tmp_path / 'gone.safetensors'} does not exist (deleted, or storage not shared)",
        5: reasons[5],
    }
    assert reasons[5].startswith(f"weights v5: {corrupt_file} has sha256 ") and "announced" in reasons[5]
    assert {letter.source for letter in letters} == {transport.layout.name("weights")}


async def test_a_forged_final_does_not_stop_the_rollout_worker_the_trainers_does(tmp_path, demo_model_dir):
    config = resolve(
        load_config(None, [f"runs_dir={tmp_path}", "name=key", f"model.path={demo_model_dir}", "broker.bootstrap=m"])
    )
    runtime.run_dir(config).mkdir(parents=True)
    create_key(runtime.run_dir(config))
    key, weights_dir = load_key(runtime.run_dir(config)), runtime.weights_dir(config)
    state = unique_state_dict(AutoModelForCausalLM.from_pretrained(demo_model_dir))
    forged, real = (
        WeightVersion(version=n, uri=str(path), content_hash=digest, step=n, groups_consumed=0, groups_dropped=0,
                      final=True)
        for n, (path, digest) in ((n, write_version(state, weights_dir, n, keep=4)) for n in (1, 2))
    )  # fmt: skip
    transport, stop = MemoryTransport(TopicLayout()), asyncio.Event()
    letters = lambda: transport.broker.messages("dead-letter", DeadLetter)  # noqa: E731
    worker = asyncio.create_task(rollout_worker.main(config, stop, transport))
    try:
        async with transport.outbox() as outbox:
            await outbox.send_now("weights", forged)
            for _ in range(1000):
                if letters() or worker.done():
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            assert not worker.done() and "unsigned" in letters()[0].reason
            await outbox.send_now("weights", real, headers=signed_headers(key, real))
            await asyncio.wait_for(worker, 20)  # the trainer's final: loaded, then the worker ends by itself
    finally:
        stop.set()
        await asyncio.wait_for(worker, 20)


def test_weights_that_do_not_fit_load_nothing():
    model = tiny_qwen2()
    before = copy.deepcopy(model.state_dict())
    state = {name: torch.zeros_like(t) for name, t in before.items()}
    state["model.norm.weight"] = torch.zeros(7)  # one tensor of another shape, after others that fit
    with pytest.raises(ValueError, match=r"1 tensors of another shape \(model.norm.weight, ...\)"):
        load_into(model, state)
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())
