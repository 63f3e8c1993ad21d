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
