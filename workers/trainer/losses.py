"""Policy losses as pure functions of per-token tensors (no model, no config).

Shapes: every tensor is [N, T] over N sequences and T completion positions;
`mask` is 1.0 on the model's completion tokens and 0.0 on padding and on tool
tokens (environment output the model conditions on but is not trained on). Every
sum, mean, statistic and total counts masked tokens as absent, whatever finite
logprobs and advantages they hold.

Micro-batches: a loss over part of a minibatch is divided by the totals of the
whole minibatch (`totals`, see `batch_totals`), so the losses and gradients of its
micro-batches add up to those of the minibatch in one piece. Tokens and sequences
dropped by the behaviour-weight mask still count in those totals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


def batch_totals(mask: torch.Tensor) -> tuple[float, float]:
    """(trained tokens, sequences with at least one trained token), each at least 1."""
    tokens = mask.sum().clamp(min=1).item()
    sequences = (mask.sum(-1) > 0).sum().clamp(min=1).item()
    return tokens, sequences


def aggregate(
    per_token: torch.Tensor,  # [N, T]
    mask: torch.Tensor,  # [N, T]
    aggregation: str,
    totals: tuple[float, float],
    max_new_tokens: int = 0,
) -> torch.Tensor:
    """One scalar from per-token losses.

    'token_mean': sum over all tokens / tokens;
    'seq_mean': sum over sequences of (mean over the sequence's tokens) / sequences;
    'token_sum_norm' (Dr. GRPO): sum over all tokens / (sequences * max_new_tokens),
    so every token weighs the same whatever the length of its sequence.
    """
    tokens, sequences = totals
    weighted = per_token * mask  # [N, T]
    if aggregation == "token_mean":
        return weighted.sum() / tokens
    if aggregation == "seq_mean":
        return (weighted.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / sequences
    if aggregation == "token_sum_norm":
        if max_new_tokens < 1:
            raise ValueError("aggregation 'token_sum_norm' needs max_new_tokens >= 1 (the generation budget)")
        return weighted.sum() / (sequences * max_new_tokens)
    raise ValueError(f"unknown aggregation {aggregation!r}: use 'token_mean', 'seq_mean' or 'token_sum_norm'")


def behaviour_weights(
    prox_logp: torch.Tensor,  # [N, T]
    behav_logp: torch.Tensor,  # [N, T]
    mask: torch.Tensor,  # [N, T]
    level: str,
) -> torch.Tensor:
    """pi_prox/pi_behav per token ('token'), or per sequence ('sequence'): the product of its
    tokens' weights, exp(sum of log-ratios over its completion), given to each of its tokens."""
    log_ratio = (prox_logp - behav_logp) * mask  # [N, T]
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)  # [N, T]
    elif level != "token":
        raise ValueError(f"unknown behaviour weight level {level!r}: use 'token' or 'sequence'")
    return torch.exp(log_ratio)  # [N, T]


def kl_to_reference(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref), the non-negative, unbiased "k3" estimator on the sampled token:
    exp(ref - logp) - (ref - logp) - 1, [N, T]; zero where the two policies agree."""
    log_ratio = ref_logp - logp  # [N, T]
    return torch.exp(log_ratio) - log_ratio - 1.0


@dataclass(frozen=True)
class LossSettings:
    """Every option of `decoupled_ppo_loss`, one value passed whole, so an option added here reaches the loss
    without touching its callers (built from the run config by `workers.trainer.model.step_settings`)."""

    clip_eps: float  # PPO ratio clip: clip(r, 1 - clip_eps, 1 + upper)
    clip_eps_high: float = 0.0  # the upper clip ("clip-higher"); 0 = clip_eps
    behaviour_weight_cap: float = 0.0  # 0 = none; above it w is clamped ('cap') or its token/sequence dropped ('mask')
    behaviour_weight_mode: Literal["cap", "mask", "icepop"] = "cap"  # 'icepop': dropped outside the band below
    behaviour_weight_level: Literal["token", "sequence"] = "token"  # see `behaviour_weights`
    icepop_low: float = 0.5  # IcePop's band [low, high] on w: outside it the token/sequence is dropped
    icepop_high: float = 5.0
    objective: Literal["ppo", "m2po"] = "ppo"  # 'm2po': see `m2po_per_token`
    m2_threshold: float = 0.04  # M2PO: the largest second moment of log(pi_prox/pi_behav) the kept tokens may have
    aggregation: Literal["token_mean", "seq_mean", "token_sum_norm"] = "token_mean"  # see `aggregate`
    max_new_tokens: int = 0  # the generation budget: 'token_sum_norm' divides by sequences x this
    kl_coef: float = 0.0  # weight of KL(pi_theta || pi_ref) per token (`kl_to_reference`); needs ref_logp


def capped_behaviour_weights(
    weight: torch.Tensor,  # [N, T]
    settings: LossSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights the loss applies and where the raw ones were cut, [N, T] each.

    'cap' clamps w above `behaviour_weight_cap` (0 = no cap) to the cap, 'mask' drops those tokens (or
    sequences). 'icepop' is IcePop's two-sided mask (Ring-1T, inclusionAI): w outside [icepop_low, icepop_high]
    is dropped, the rest keep w, so a token the trainer and the sampler disagree on in either direction gives
    no gradient."""
    s = settings
    if s.behaviour_weight_mode == "icepop":
        outside = (weight < s.icepop_low) | (weight > s.icepop_high)  # [N, T]
        return torch.where(outside, 0.0, weight), outside
    cap = s.behaviour_weight_cap
    over_cap = weight > cap if cap > 0 else torch.zeros_like(weight, dtype=torch.bool)  # [N, T]
    if s.behaviour_weight_mode == "cap":
        return torch.where(over_cap, cap, weight), over_cap
    if s.behaviour_weight_mode == "mask":
        return torch.where(over_cap, 0.0, weight), over_cap
    raise ValueError(f"unknown behaviour weight mode {s.behaviour_weight_mode!r}: use 'cap', 'mask' or 'icepop'")


def second_moments(
    prox_logp: torch.Tensor,  # [N, T]
    behav_logp: torch.Tensor,  # [N, T]
    mask: torch.Tensor,  # [N, T]
) -> torch.Tensor:
    """M2PO's per-token second moment (log pi_prox/pi_behav)^2, [N, T]; 0 where masked."""
    return ((prox_logp - behav_logp) * mask) ** 2  # [N, T]


def m2po_cutoff(m2: torch.Tensor, threshold: float) -> tuple[float, dict[str, float]]:
    """M2PO's mask (Zheng et al., "Prosperity before Collapse", 2025) as a cutoff on the second moments `m2` ([K],
    every trained token of the minibatch): the tokens kept are those with m2 <= cutoff, the largest set of the
    smallest moments whose mean is at most `threshold`, so the fewest, most extreme tokens go. Equal moments go
    or stay together. Nothing kept: cutoff -inf. Also the mean moment of all tokens and of those kept."""
    if m2.numel() == 0:
        return float("inf"), {"m2po_m2": 0.0, "m2po_m2_kept": 0.0}
    ascending = torch.sort(m2.double()).values  # [K]
    count = torch.arange(1, len(ascending) + 1, dtype=torch.float64)  # [K]
    means = ascending.cumsum(0) / count  # [K] the mean of the j+1 smallest; non-decreasing
    boundary = torch.cat([ascending[1:] > ascending[:-1], torch.tensor([True])])  # [K] a cut between two values
    fits = torch.nonzero((means <= threshold) & boundary).flatten()  # [k]
    kept = int(fits[-1]) + 1 if len(fits) else 0
    cutoff = ascending[kept - 1].item() if kept else float("-inf")
    return cutoff, {"m2po_m2": means[-1].item(), "m2po_m2_kept": means[kept - 1].item() if kept else 0.0}


def m2po_per_token(
    logp: torch.Tensor,  # [N, T] log pi_theta, with grad
    behav_logp: torch.Tensor,  # [N, T]
    advantages: torch.Tensor,  # [N, T]
    mask: torch.Tensor,  # [N, T]
    m2: torch.Tensor,  # [N, T] `second_moments`
    cutoff: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """M2PO's per-token loss: -M * (pi_theta/pi_behav) * A, with M = 1 where m2 <= cutoff, else 0. No ratio
    clip: the second-moment mask is the whole trust region. Also where M drops a trained token, [N, T] each."""
    kept = m2 <= cutoff  # [N, T]
    ratio = torch.exp((logp - behav_logp) * mask)  # [N, T]; 1 where masked, as in `decoupled_ppo_loss`
    return -torch.where(kept, ratio * advantages, 0.0), ~kept & (mask > 0)


CUT_STAT = {"cap": "behaviour_weight_over_cap", "mask": "behaviour_weight_over_cap", "icepop": "icepop_masked"}


@torch.no_grad()
def loss_stats(
    mask: torch.Tensor,  # [N, T]
    tokens: float,
    ratio: torch.Tensor,  # [N, T] pi_theta / pi_prox
    weight: torch.Tensor,  # [N, T] raw behaviour weights
    cut: tuple[str, torch.Tensor],  # the stat's name and where the weight was capped or the token dropped, [N, T]
    clipped: torch.Tensor,  # [N, T] bool: the clipped term was the smaller
    kl: torch.Tensor | None,  # [N, T]
) -> dict[str, float]:
    """Token sums divided by the minibatch's token total, so summed over its micro-batches they give the
    minibatch's own (`_max`/`_min`: max/min over them)."""
    real = mask > 0  # [N, T]
    stats = {
        "clip_fraction": (clipped & real).sum().item() / tokens,
        "ratio_mean": (ratio * mask).sum().item() / tokens,
        "behaviour_weight_mean": (weight * mask).sum().item() / tokens,
        "behaviour_weight_max": torch.where(real, weight, -torch.inf).max().item(),
        "behaviour_weight_min": torch.where(real, weight, torch.inf).min().item(),
        cut[0]: (cut[1] & real).sum().item() / tokens,
    }
    if kl is not None:
        stats["kl_ref"] = (kl * mask).sum().item() / tokens
    return stats


def decoupled_ppo_loss(
    logp: torch.Tensor,  # [N, T] log pi_theta, with grad
    prox_logp: torch.Tensor,  # [N, T] log pi_prox (trainer weights when the batch arrived)
    behav_logp: torch.Tensor,  # [N, T] log pi_behav (recorded at generation)
    advantages: torch.Tensor,  # [N, T] (a sequence's advantage broadcast over its tokens)
    mask: torch.Tensor,  # [N, T]
    settings: LossSettings,
    totals: tuple[float, float] | None = None,
    ref_logp: torch.Tensor | None = None,  # [N, T] log pi_ref of a frozen reference; needed when kl_coef > 0
    m2_cutoff: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """AReaL's decoupled PPO objective, or M2PO, and its stats (`loss_stats`).

    loss_t = -w * min(r*A, clip(r, 1-eps, 1+eps_high)*A), r = pi_theta/pi_prox, w = pi_prox/pi_behav
    (capped or masked, `capped_behaviour_weights`); objective 'm2po': `m2po_per_token` instead, its mask cut at
    `m2_cutoff` (`m2po_cutoff` of the whole minibatch; default: of this batch's own tokens). Plus
    kl_coef * KL(pi_theta || pi_ref), aggregated alike. With prox_logp == behav_logp it is
    standard (naive) PPO. `totals`: (tokens, sequences) of the whole minibatch this batch is a
    micro-batch of; default: this batch's own. Masked tokens (padding, prompt, tool output) enter only as
    ratios of 1: the model may find a tool's output unlikely enough that exp(log-ratio) overflows, and
    inf * 0 would make the loss NaN.
    """
    s = settings
    totals = totals if totals is not None else batch_totals(mask)
    weight = behaviour_weights(prox_logp, behav_logp, mask, s.behaviour_weight_level)  # [N, T]
    ratio = torch.exp((logp - prox_logp) * mask)  # [N, T]; 1 where masked: a tool token's may overflow
    if s.objective == "m2po":
        m2 = second_moments(prox_logp, behav_logp, mask)  # [N, T]
        if m2_cutoff is None:
            m2_cutoff = m2po_cutoff(m2[mask > 0], s.m2_threshold)[0]
        per_token, dropped = m2po_per_token(logp, behav_logp, advantages, mask, m2, m2_cutoff)  # [N, T] each
        cut, clipped = ("m2po_masked", dropped), torch.zeros_like(dropped)
    else:
        applied, over_cap = capped_behaviour_weights(weight, s)  # [N, T]
        unclipped = ratio * advantages  # [N, T]
        clipped_term = ratio.clamp(1.0 - s.clip_eps, 1.0 + (s.clip_eps_high or s.clip_eps)) * advantages  # [N, T]
        per_token = -applied * torch.minimum(unclipped, clipped_term)  # [N, T]
        cut, clipped = (CUT_STAT[s.behaviour_weight_mode], over_cap), clipped_term < unclipped
    kl = None
    if s.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp, the reference policy's logprobs")
        kl = kl_to_reference(logp * mask, ref_logp * mask)  # [N, T]; 0 where masked, as the ratio
        per_token = per_token + s.kl_coef * kl
    loss = aggregate(per_token, mask, s.aggregation, totals, s.max_new_tokens)
    return loss, loss_stats(mask, totals[0], ratio, weight, cut, clipped, kl)
