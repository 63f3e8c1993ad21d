"""Exact values of the policy loss and the advantage estimator, computed by hand."""

import math

import pytest
import torch

from workers.trainer.advantages import grpo_advantages
from workers.trainer.losses import decoupled_ppo_loss


def logs(*probs: float) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float64)


def loss_of(theta, prox, behav, adv, mask=None, cap=0.0):
    adv = torch.tensor([adv], dtype=torch.float64)
    mask = torch.ones_like(adv) if mask is None else torch.tensor([mask], dtype=torch.float64)
    return decoupled_ppo_loss(logs(*theta), logs(*prox), logs(*behav), adv, mask, clip_eps=0.2, behaviour_weight_cap=cap)


def test_positive_advantage_is_clipped_above():
    # r = 0.7/0.5 = 1.4 -> clipped to 1.2; loss = -1.2 * 2
    loss, stats = loss_of([0.7], [0.5], [0.5], [2.0])
    assert loss.item() == pytest.approx(-2.4)
    assert stats["clip_fraction"] == 1.0


def test_negative_advantage_keeps_the_pessimistic_unclipped_term():
    # r = 1.4, A = -1: min(-1.4, -1.2) = -1.4; loss = 1.4, nothing clipped
    loss, stats = loss_of([0.7], [0.5], [0.5], [-1.0])
    assert loss.item() == pytest.approx(1.4)
    assert stats["clip_fraction"] == 0.0


def test_behaviour_weight_scales_and_cap_clamps():
    # w = 0.5/0.25 = 2, r = 0.55/0.5 = 1.1, A = 1 -> -2.2; capped at 1.5 -> -1.65
    loss, stats = loss_of([0.55], [0.5], [0.25], [1.0])
    assert loss.item() == pytest.approx(-2.2)
    assert stats["behaviour_weight_mean"] == pytest.approx(2.0)
    capped, _ = loss_of([0.55], [0.5], [0.25], [1.0], cap=1.5)
    assert capped.item() == pytest.approx(-1.65)


def test_token_mean_ignores_masked_positions():
    # tokens: -2.4 (real), +1.4 (real), anything (padding) -> mean -0.5
    loss, _ = loss_of([0.7, 0.7, 0.9], [0.5, 0.5, 0.1], [0.5, 0.5, 0.3], [2.0, -1.0, 5.0], mask=[1, 1, 0])
    assert loss.item() == pytest.approx(-0.5)


def test_decoupled_equals_standard_ppo_when_prox_is_behaviour():
    torch.manual_seed(0)
    behav = -torch.rand(4, 6, dtype=torch.float64) * 3
    theta = behav + torch.randn(4, 6, dtype=torch.float64) * 0.3
    adv = torch.randn(4, 1, dtype=torch.float64).expand(4, 6)
    mask = (torch.rand(4, 6) > 0.2).double()
    loss, _ = decoupled_ppo_loss(theta, behav, behav, adv, mask, clip_eps=0.2)
    ratio = torch.exp(theta - behav)
    standard = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    assert loss.item() == pytest.approx(((standard * mask).sum() / mask.sum()).item(), abs=1e-12)


def test_gradient_flows_only_through_theta():
    theta = logs(0.6).requires_grad_(True)
    loss, _ = decoupled_ppo_loss(theta, logs(0.5), logs(0.5), torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64), 0.2)
    loss.backward()
    # d/dtheta of -exp(theta - prox) * A at r = 1.2 (inside the clip range) = -1.2
    assert theta.grad.item() == pytest.approx(-1.2)


def test_grpo_advantages_by_hand():
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]]))
    assert adv[0].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]
    # mean 0.75, std sqrt(27/16) = 1.299
    std = math.sqrt(((3 - 0.75) ** 2 + 3 * 0.75**2) / 4)
    assert adv[2].tolist() == pytest.approx([2.25 / std, -0.75 / std, -0.75 / std, -0.75 / std], abs=1e-5)
    assert adv.sum(dim=1).tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-5)
