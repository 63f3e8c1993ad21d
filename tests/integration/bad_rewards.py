"""Reward functions that fail, as `data.reward: bad_rewards:<name>` names them (the failure budget tests), and
ones that misbehave on the rows marked `"misbehave": true` only (a run's held-out rows, in the evaluation tests)."""

import os
import time


def raises(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    raise RuntimeError("the verifier is broken")


def hangs(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    time.sleep(60)
    return 1.0


def huge(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    return 1e30


def hangs_on_marked(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    if metadata.get("misbehave") == "true":
        time.sleep(600)
    return float(completion.strip() == metadata["answer"])


def exits_on_marked(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    if metadata.get("misbehave") == "true":
        os._exit(1)  # no exception, no cleanup: the process that called it is gone
    return float(completion.strip() == metadata["answer"])
