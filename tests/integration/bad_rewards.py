"""Reward functions that fail, as `data.reward: bad_rewards:<name>` names them (the failure budget tests)."""

import time


def raises(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    raise RuntimeError("the verifier is broken")


def hangs(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    time.sleep(60)
    return 1.0


def huge(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    return 1e30
