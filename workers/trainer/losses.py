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
    behaviour_weight_mode: Literal["cap", "mask"] = "cap"
    behaviour_weight_level: Literal["token", "sequence"] = "token"  # see `behaviour_weights`
    aggregation: Literal["token_mean", "seq_mean", "token_sum_norm"] = "token_mean"  # see `aggregate`
    max_new_tokens: int = 0  # the generation budget: 'token_sum_norm' divides by sequences x this
    kl_coef: float = 0.0  # weight of KL(pi_theta || pi_ref) per token (`kl_to_reference`); needs ref_logp


def capped_behaviour_weights(weight: torch.Tensor, cap: float, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights the loss applies and where the raw ones exceed `cap` (0 = no cap), [N, T] each."""
    over_cap = weight > cap if cap > 0 else torch.zeros_like(weight, dtype=torch.bool)  # [N, T]
    if mode == "cap":
        return torch.where(over_cap, cap, weight), over_cap
    if mode == "mask":
        return torch.where(over_cap, 0.0, weight), over_cap
    raise ValueError(f"unknown behaviour weight mode {mode!r}: use 'cap' or 'mask'")


@torch.no_grad()
def loss_stats(
    mask: torch.Tensor,  # [N, T]
    tokens: float,
    ratio: torch.Tensor,  # [N, T] pi_theta / pi_prox
    weight: torch.Tensor,  # [N, T] raw behaviour weights
    over_cap: torch.Tensor,  # [N, T] bool
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
        "behaviour_weight_over_cap": (over_cap & real).sum().item() / tokens,
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
) -> tuple[torch.Tensor, dict[str, float]]:
    """AReaL's decoupled PPO objective and its stats (`loss_stats`).

    loss_t = -w * min(r*A, clip(r, 1-eps, 1+eps_high)*A), r = pi_theta/pi_prox, w = pi_prox/pi_behav,
    plus kl_coef * KL(pi_theta || pi_ref), aggregated alike. With prox_logp == behav_logp it is
    standard (naive) PPO. `totals`: (tokens, sequences) of the whole minibatch this batch is a
    micro-batch of; default: this batch's own. Masked tokens (padding, prompt, tool output) enter only as
    ratios of 1: the model may find a tool's output unlikely enough that exp(log-ratio) overflows, and
    inf * 0 would make the loss NaN.
    """
    s = settings
    totals = totals if totals is not None else batch_totals(mask)
    weight = behaviour_weights(prox_logp, behav_logp, mask, s.behaviour_weight_level)  # [N, T]
    applied, over_cap = capped_behaviour_weights(weight, s.behaviour_weight_cap, s.behaviour_weight_mode)  # [N, T]
    ratio = torch.exp((logp - prox_logp) * mask)  # [N, T]; 1 where masked: a tool token's may overflow
    unclipped = ratio * advantages  # [N, T]
    clipped = ratio.clamp(1.0 - s.clip_eps, 1.0 + (s.clip_eps_high or s.clip_eps)) * advantages  # [N, T]
    per_token = -applied * torch.minimum(unclipped, clipped)  # [N, T]
    kl = None
    if s.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp, the reference policy's logprobs")
        kl = kl_to_reference(logp * mask, ref_logp * mask)  # [N, T]; 0 where masked, as the ratio
        per_token = per_token + s.kl_coef * kl
    loss = aggregate(per_token, mask, s.aggregation, totals, s.max_new_tokens)
    return loss, loss_stats(mask, totals[0], ratio, weight, over_cap, clipped < unclipped, kl)
