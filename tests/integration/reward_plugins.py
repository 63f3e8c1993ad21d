"""A user's reward module, as `data.reward: reward_plugins:judge` would name it (used by the tests)."""

import time


def judge(prompt: str, completion: str, metadata: dict[str, str]):
    if completion == "raise":
        raise RuntimeError("the user's verifier broke")
    if completion == "hang":
        time.sleep(60)
    if completion == "nan":
        return float("nan")
    return (1.0 if completion == metadata["answer"] else 0.0), {"prompt_seen": prompt}


def coin(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    """0 or 1 by the parity of the completion's characters: a random model's samples of one prompt earn different
    rewards, so its advantages and updates are not all zero (the demo's verifier gives it 0 everywhere)."""
    return float(sum(map(ord, completion)) % 2)
