"""Signed weight announcements: only this run's trainer can announce a version (and `final`).

Anyone who can write to the broker can put a record on `weights`; a forged `final: true`
would stop every worker, a forged path would point them at any file. So `asyncrl prepare`
writes a random key once into the run directory (`run.key`, mode 0600, on the storage every
worker already shares), the trainer sends an HMAC-SHA256 of each announcement's bytes in a
header, and every reader refuses an announcement without the right one while a key exists.
A reader also refuses one whose file is missing or (`verify_file`) whose sha256 is not the
announced one. Runs without a key (unit tests on the in-memory transport) are not signed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from schemas.messages import WeightVersion, encode
from topics.transport import Delivery
from workers.weight_deltas import read_delta
from workers.weights import WeightsError, verify

KEY_FILE = "run.key"
SIGNATURE_HEADER = "asyncrl-signature"


def key_path(run_dir: Path) -> Path:
    return Path(run_dir) / KEY_FILE


def create_key(run_dir: Path) -> Path:
    """The run's key file, written once (0600, 32 random bytes as hex); an existing one is kept, so
    `prepare` may run again (compose, Slurm) without invalidating what the trainer already signed."""
    path = key_path(run_dir)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "w") as stream:
        stream.write(secrets.token_hex(32))
    return path


def load_key(run_dir: Path) -> bytes | None:
    """The run's key, or None when the run has none (then nothing is signed or checked)."""
    try:
        return key_path(run_dir).read_bytes().strip()
    except FileNotFoundError:
        return None


def signature(key: bytes, announcement: WeightVersion) -> str:
    """HMAC-SHA256 of the announcement's encoded bytes (what the trainer sends), as hex."""
    return hmac.new(key, encode(announcement), hashlib.sha256).hexdigest()


def signed_headers(key: bytes | None, announcement: WeightVersion) -> dict[str, str]:
    """The headers the trainer sends the announcement with: its signature, none without a key."""
    return {} if key is None else {SIGNATURE_HEADER: signature(key, announcement)}


def signature_problem(key: bytes | None, announcement: WeightVersion, headers: list[tuple[str, bytes]]) -> str | None:
    """Why the announcement is not the trainer's (no signature, a wrong one), or None."""
    if key is None:
        return None
    given = [value for name, value in headers if name == SIGNATURE_HEADER]
    if not given:
        return f"weights v{announcement.version}: unsigned announcement (this run signs every one), ignored"
    if not hmac.compare_digest(given[-1], signature(key, announcement).encode()):
        return f"weights v{announcement.version}: wrong signature (not this run's trainer), ignored"
    return None


@dataclass(frozen=True)
class AnnouncementCheck:
    """What a `WeightsFollower` asks of an announcement before it takes it: the trainer's signature, then
    the file (its sha256 with `verify_file`, a delta's its payload's, else that it exists: a loader verifies the
    hash itself)."""

    key: bytes | None
    verify_file: bool = True

    def __call__(self, delivery: Delivery[WeightVersion]) -> str | None:
        announced = delivery.message
        if problem := signature_problem(self.key, announced, delivery.headers):
            return problem
        if not self.verify_file:
            exists = Path(announced.uri).is_file()
            return None if exists else f"weights v{announced.version}: {announced.uri} does not exist"
        try:
            if announced.base_version >= 0:  # a delta: its payload's own hash; a loader checks the result's
                read_delta(Path(announced.uri), announced.version)
            else:
                verify(announced.uri, announced.content_hash, announced.version)
        except (WeightsError, OSError) as error:
            return str(error)
        return None
