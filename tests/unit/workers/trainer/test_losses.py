"""Exact values of the policy loss and the advantage estimator, computed by hand."""

import math

import pytest
import torch

from workers.trainer.advantages import ESTIMATORS, drgrpo_advantages, grpo_advantages, rloo_advantages
from workers.trainer.losses import LossSettings, decoupled_ppo_loss, m2po_cutoff


def logs(*probs: float) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float64)


def loss_of(theta, prox, behav, adv, mask=None, cap=0.0):
    adv = torch.tensor([adv], dtype=torch.float64)
    mask = torch.ones_like(adv) if mask is None else torch.tensor([mask], dtype=torch.float64)
    settings = LossSettings(clip_eps=0.2, behaviour_weight_cap=cap)
    return decoupled_ppo_loss(logs(*theta), logs(*prox), logs(*behav), adv, mask, settings)


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
    loss, _ = decoupled_ppo_loss(theta, behav, behav, adv, mask, LossSettings(clip_eps=0.2))
    ratio = torch.exp(theta - behav)
    standard = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    assert loss.item() == pytest.approx(((standard * mask).sum() / mask.sum()).item(), abs=1e-12)


def test_gradient_flows_only_through_theta():
    theta = logs(0.6).requires_grad_(True)
    one = torch.ones(1, 1, dtype=torch.float64)
    loss, _ = decoupled_ppo_loss(theta, logs(0.5), logs(0.5), one, one, LossSettings(clip_eps=0.2))
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


CLIP_HIGHER = LossSettings(clip_eps=0.2, clip_eps_high=0.28)


def test_clip_higher_moves_only_the_upper_bound():
    # r = 1.4, A = 2: clipped at 1 + 0.28 -> -1.28 * 2 = -2.56
    loss, stats = decoupled_ppo_loss(
        logs(0.7),
        logs(0.5),
        logs(0.5),
        torch.tensor([[2.0]], dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.float64),
        CLIP_HIGHER,
    )
    assert loss.item() == pytest.approx(-2.56)
    assert stats["clip_fraction"] == 1.0
    # r = 0.5/0.7 = 0.714, A = -1: the lower bound stays 1 - 0.2: min(-0.714, -0.8) = -0.8 -> loss 0.8
    loss, _ = decoupled_ppo_loss(
        logs(0.5),
        logs(0.7),
        logs(0.7),
        -torch.ones(1, 1, dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.float64),
        CLIP_HIGHER,
    )
    assert loss.item() == pytest.approx(0.8)


# Two sequences of two tokens, r = 1.1 everywhere (theta = 1.1 * prox), A = 1:
#   row 0: w = 0.5/0.25 = 2 and 0.3/0.4 = 0.75 (sequence weight 2 * 0.75 = 1.5); row 1: w = 1, 1.
THETA, PROX, BEHAV = [[0.55, 0.33], [0.55, 0.55]], [[0.5, 0.3], [0.5, 0.5]], [[0.25, 0.4], [0.5, 0.5]]


def weighted(**options):
    table = lambda rows: torch.tensor(rows, dtype=torch.float64).log()  # noqa: E731
    ones = torch.ones(2, 2, dtype=torch.float64)
    settings = LossSettings(clip_eps=0.2, **options)
    return decoupled_ppo_loss(table(THETA), table(PROX), table(BEHAV), ones, ones, settings)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        # token weights: -1.1 * (2 + 0.75 + 1 + 1) / 4
        (dict(), -1.30625),
        # cap 1.2 clamps token 0 of row 0 to 1.2: -1.1 * (1.2 + 0.75 + 2) / 4
        (dict(behaviour_weight_cap=1.2), -1.08625),
        # mask drops token 0 of row 0 (still counted in the 4 tokens): -1.1 * (0.75 + 2) / 4
        (dict(behaviour_weight_cap=1.2, behaviour_weight_mode="mask"), -0.75625),
        # sequence weights 1.5, 1.5, 1, 1: -1.1 * 5 / 4
        (dict(behaviour_weight_level="sequence"), -1.375),
        # sequence weight capped at 1.2: -1.1 * (1.2 + 1.2 + 2) / 4
        (dict(behaviour_weight_level="sequence", behaviour_weight_cap=1.2), -1.21),
        # the whole of row 0 dropped: -1.1 * 2 / 4
        (dict(behaviour_weight_level="sequence", behaviour_weight_cap=1.2, behaviour_weight_mode="mask"), -0.55),
    ],
)
def test_behaviour_weight_cap_and_mask_by_hand(options, expected):
    loss, _ = weighted(**options)
    assert loss.item() == pytest.approx(expected)


def test_behaviour_weight_stats():
    # raw token weights 2, 0.75, 1, 1; one of four above the cap
    _, stats = weighted(behaviour_weight_cap=1.2, behaviour_weight_mode="mask")
    assert stats["behaviour_weight_mean"] == pytest.approx(4.75 / 4)
    assert (stats["behaviour_weight_max"], stats["behaviour_weight_min"]) == pytest.approx((2.0, 0.75))
    assert stats["behaviour_weight_over_cap"] == 0.25
    assert stats["ratio_mean"] == pytest.approx(1.1)


# Ratio 1 everywhere, so the per-token loss is -A: row 0 has two tokens with A = 1, row 1 one token with A = -4.
AGG_MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
AGG_ADV = torch.tensor([[1.0, 1.0], [-4.0, -4.0]], dtype=torch.float64)


def aggregated(rows=slice(None), totals=None, **options):
    zeros = torch.zeros(2, 2, dtype=torch.float64)[rows]
    settings = LossSettings(clip_eps=0.2, **options)
    return decoupled_ppo_loss(zeros, zeros, zeros, AGG_ADV[rows], AGG_MASK[rows], settings, totals)[0].item()


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("token_mean", 2 / 3),  # (-1 - 1 + 4) / 3 tokens
        ("seq_mean", 1.5),  # (mean(-1, -1) + 4) / 2 sequences
        ("token_sum_norm", 0.25),  # (-1 - 1 + 4) / (2 sequences * 4 max new tokens)
    ],
)
def test_aggregations_by_hand_and_split_into_microbatches(aggregation, expected):
    assert aggregated(aggregation=aggregation, max_new_tokens=4) == pytest.approx(expected)
    # each row alone, divided by the totals of both (3 tokens, 2 sequences), adds up to the same
    parts = [aggregated(slice(r, r + 1), aggregation=aggregation, max_new_tokens=4, totals=(3.0, 2.0)) for r in (0, 1)]
    assert sum(parts) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("options", "expected", "masked"),
    [
        # the paper's band [0.5, 5] holds every token weight (2, 0.75, 1, 1): as no cap
        (dict(), -1.30625, 0.0),
        # band [0.8, 1.5]: 2 is above, 0.75 below, both dropped (still counted in the 4 tokens): -1.1 * 2 / 4
        (dict(icepop_low=0.8, icepop_high=1.5), -0.55, 0.5),
        # sequence weights 1.5, 1.5, 1, 1 and band [0.5, 1.2]: row 0 dropped whole
        (dict(icepop_high=1.2, behaviour_weight_level="sequence"), -0.55, 0.5),
    ],
)
def test_icepop_drops_weights_outside_its_band_by_hand(options, expected, masked):
    loss, stats = weighted(behaviour_weight_mode="icepop", **options)
    assert loss.item() == pytest.approx(expected)
    assert stats["icepop_masked"] == masked
    assert "behaviour_weight_over_cap" not in stats
    assert stats["behaviour_weight_max"] == pytest.approx(2.0 if options.get("behaviour_weight_level") is None else 1.5)


def test_icepop_gradient_is_zero_on_dropped_tokens_and_weighted_elsewhere():
    table = lambda rows: torch.tensor(rows, dtype=torch.float64).log()  # noqa: E731
    theta = table(THETA).requires_grad_(True)
    ones = torch.ones(2, 2, dtype=torch.float64)
    settings = LossSettings(clip_eps=0.2, behaviour_weight_mode="icepop", icepop_low=0.8, icepop_high=1.5)
    decoupled_ppo_loss(theta, table(PROX), table(BEHAV), ones, ones, settings)[0].backward()
    # kept tokens: d/dlogp of -w * r * A / 4 = -1 * 1.1 / 4; the dropped ones (w = 2, 0.75) get none
    assert theta.grad.flatten().tolist() == pytest.approx([0.0, 0.0, -0.275, -0.275])


@pytest.mark.parametrize(
    ("m2", "threshold", "cutoff", "kept_mean"),
    [
        # ascending prefix means 0, 0.005, 0.01, 0.03, 0.224: the 4 smallest fit under 0.04, 1.0 goes
        ([1.0, 0.0, 0.09, 0.01, 0.02], 0.04, 0.09, 0.03),
        # under 0.02 only the 3 smallest (mean 0.01) fit: 0.09 and 1.0 go
        ([1.0, 0.0, 0.09, 0.01, 0.02], 0.02, 0.02, 0.01),
        # the two 0.07 go together: with one of them the mean is 0.035, with both 0.0467
        ([0.07, 0.0, 0.07], 0.04, 0.0, 0.0),
        # no token is close enough: none kept
        ([0.5, 0.6], 0.04, float("-inf"), 0.0),
        # everything fits: nothing dropped
        ([0.01, 0.03], 0.04, 0.03, 0.02),
    ],
)
def test_m2po_cutoff_drops_the_fewest_largest_moments_by_hand(m2, threshold, cutoff, kept_mean):
    got, stats = m2po_cutoff(torch.tensor(m2, dtype=torch.float64), threshold)
    assert got == pytest.approx(cutoff)
    assert stats == pytest.approx({"m2po_m2": sum(m2) / len(m2), "m2po_m2_kept": kept_mean})


# One row, three tokens: pi_behav 0.5 each, pi_prox 0.5, 0.55, 0.25, pi_theta 0.8, 0.55, 0.3, A = 2, -1, 3.
#   second moments (log pi_prox/pi_behav)^2: 0, log(1.1)^2 = 0.0091, log(0.5)^2 = 0.4805 -> under 0.04 the
#   last goes; pi_theta/pi_behav = 1.6, 1.1, 0.6 (no clip: PPO would cut 1.6 at 1.2).
M2PO = LossSettings(clip_eps=0.2, objective="m2po", m2_threshold=0.04)


def m2po_loss(theta, **kwargs):
    adv = torch.tensor([[2.0, -1.0, 3.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    return decoupled_ppo_loss(theta, logs(0.5, 0.55, 0.25), logs(0.5, 0.5, 0.5), adv, mask, M2PO, **kwargs)


def test_m2po_loss_gradient_and_stats_by_hand():
    theta = logs(0.8, 0.55, 0.3).requires_grad_(True)
    loss, stats = m2po_loss(theta)
    loss.backward()
    # -(1.6 * 2 + 1.1 * -1) / 3 tokens (the dropped one still counts)
    assert loss.item() == pytest.approx(-0.7)
    # d/dlogp of -r * A / 3 = -r * A / 3, none for the dropped token
    assert theta.grad[0].tolist() == pytest.approx([-3.2 / 3, 1.1 / 3, 0.0])
    assert stats["m2po_masked"] == pytest.approx(1 / 3)
    assert stats["clip_fraction"] == 0.0
    assert stats["behaviour_weight_mean"] == pytest.approx((1 + 1.1 + 0.5) / 3)
    # the cutoff of a whole minibatch, here one that keeps every token, overrides this batch's own
    assert m2po_loss(theta.detach(), m2_cutoff=1.0)[0].item() == pytest.approx(-(3.2 - 1.1 + 1.8) / 3)


def test_bad_options_raise():
    with pytest.raises(ValueError, match="max_new_tokens"):
        aggregated(aggregation="token_sum_norm")
    with pytest.raises(ValueError, match="aggregation"):
        aggregated(aggregation="sum")
    with pytest.raises(ValueError, match="mode"):
        weighted(behaviour_weight_mode="clip")
    with pytest.raises(ValueError, match="mode"):
        weighted(behaviour_weight_mode="clip", behaviour_weight_cap=1.2)
    with pytest.raises(ValueError, match="level"):
        weighted(behaviour_weight_level="group")


def test_drgrpo_and_rloo_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    # Dr. GRPO: r - group mean (0.5, 1, 0.75), no std
    assert drgrpo_advantages(rewards).tolist() == [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0], [2.25, -0.75, -0.75, -0.75]]
    # RLOO: r_i - mean of the other three; row 0: 1 - 1/3, 0 - 2/3; row 2: 3 - 0, 0 - 3/3
    expected = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0, 0, 0, 0], [3.0, -1.0, -1.0, -1.0]])
    torch.testing.assert_close(rloo_advantages(rewards), expected)


def test_a_group_of_one_sample_has_no_signal_under_any_estimator():
    for name, estimator in ESTIMATORS.items():
        assert estimator(torch.tensor([[5.0]])).tolist() == [[0.0]], name
    assert set(ESTIMATORS) == {"grpo", "drgrpo", "rloo"}


KL = LossSettings(clip_eps=0.2, kl_coef=0.1)


def test_kl_penalty_to_reference_by_hand():
    # two tokens, A = 0 (no policy term): p_theta = 0.5, 0.2; p_ref = 0.25, 0.2
    # k3 = q/p - log(q/p) - 1: 0.5 - log 0.5 - 1 = 0.193147..., and 0 where they agree
    theta, ref = logs(0.5, 0.2), logs(0.25, 0.2)
    zero = torch.zeros(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    loss, stats = decoupled_ppo_loss(theta, theta, theta, zero, mask, KL, ref_logp=ref)
    expected_kl = (0.5 - math.log(0.5) - 1) / 2  # token mean over the two tokens
    assert stats["kl_ref"] == pytest.approx(expected_kl)
    assert loss.item() == pytest.approx(0.1 * expected_kl)
    # its gradient pulls log pi_theta towards the reference: d/dlogp (exp(ref-logp) - (ref-logp) - 1) = 1 - q/p
    theta = theta.clone().requires_grad_(True)
    decoupled_ppo_loss(theta, theta.detach(), theta.detach(), zero, mask, KL, ref_logp=ref)[0].backward()
    assert theta.grad[0, 0].item() == pytest.approx(0.1 * (1 - 0.5) / 2)
    assert theta.grad[0, 1].item() == pytest.approx(0.0)
    with pytest.raises(ValueError, match="ref_logp"):
        decoupled_ppo_loss(theta, theta, theta, zero, mask, KL)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_tool_token_is_absent_from_loss_gradient_and_stats_by_hand(level):
    """Token 1 is a tool's output (mask 0): in float32 its log-ratios overflow (exp(200), exp(100)), yet it adds
    nothing, not even NaN. Tokens 0 and 2: r = 0.7/0.5 = 1.4; A = 2 clips to -1.2 * 2, A = -1 keeps -1.4 * -1."""
    theta = torch.tensor([[math.log(0.7), -100.0, math.log(0.7)]], requires_grad=True)
    prox = torch.tensor([[math.log(0.5), -300.0, math.log(0.5)]])  # naive PPO: the behaviour placeholder
    ref = torch.tensor([[math.log(0.7), 0.0, math.log(0.7)]])  # agrees with theta on the model's tokens
    adv, mask = torch.tensor([[2.0, -1.0, -1.0]]), torch.tensor([[1.0, 0.0, 1.0]])
    settings = LossSettings(clip_eps=0.2, kl_coef=0.1, behaviour_weight_level=level)
    loss, stats = decoupled_ppo_loss(theta, prox, prox, adv, mask, settings, ref_logp=ref)
    loss.backward()
    assert loss.item() == pytest.approx((-2.4 + 1.4) / 2)
    # token 0 is clipped (no gradient); token 2: d/dtheta of -r*A = 1.4, over 2 tokens; the KL's is 0 where equal
    assert theta.grad[0].tolist() == pytest.approx([0.0, 0.0, 0.7])
    assert stats == pytest.approx(
        {
            "clip_fraction": 0.5,
            "ratio_mean": 1.4,
            "behaviour_weight_mean": 1.0,
            "behaviour_weight_max": 1.0,
            "behaviour_weight_min": 1.0,
            "behaviour_weight_over_cap": 0.0,
            "kl_ref": 0.0,
        }
    )
