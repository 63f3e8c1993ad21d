"""Advantage estimators as pure functions of rewards."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages: (r - mean(group)) / (std(group) + eps).

    rewards: [G, n] for G groups of n samples. A group whose rewards are all equal
    gets zero advantages (it carries no learning signal). std is the population std.
    """
    mean = rewards.mean(dim=1, keepdim=True)  # [G, 1]
    std = rewards.std(dim=1, keepdim=True, unbiased=False)  # [G, 1]
    return (rewards - mean) / (std + eps)  # [G, n]
