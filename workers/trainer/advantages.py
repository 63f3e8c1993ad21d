"""Advantage estimators as pure functions of rewards.

Each maps rewards [G, n] (G groups of n samples of one prompt) to one advantage per
sample, [G, n]. A group whose rewards are all equal gets zero advantages under every
estimator (it carries no learning signal), and so does a group of one sample.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages: (r - mean(group)) / (std(group) + eps); std is the population std."""
    mean = rewards.mean(dim=1, keepdim=True)  # [G, 1]
    std = rewards.std(dim=1, keepdim=True, unbiased=False)  # [G, 1]
    return (rewards - mean) / (std + eps)  # [G, n]


def drgrpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: r - mean(group), without the std normalisation (which favours groups of near-equal rewards)."""
    return rewards - rewards.mean(dim=1, keepdim=True)  # [G, n]


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out: r_i - mean of the other n-1 rewards of the group.

    r_i - (sum - r_i)/(n-1) = n/(n-1) * (r_i - mean); written that way it is 0 for n = 1.
    """
    n = rewards.shape[1]
    return (rewards - rewards.mean(dim=1, keepdim=True)) * n / max(n - 1, 1)  # [G, n]


ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
}
