"""Policy losses as pure functions of per-token tensors (no model, no config).

Shapes: every tensor is [N, T] over N sequences and T completion positions;
`mask` is 1.0 on real completion tokens and 0.0 on padding.
"""

from __future__ import annotations

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token mean over the real tokens of the whole batch."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def decoupled_ppo_loss(
    logp: torch.Tensor,  # [N, T] log pi_theta, with grad
    prox_logp: torch.Tensor,  # [N, T] log pi_prox (trainer weights when the batch arrived)
    behav_logp: torch.Tensor,  # [N, T] log pi_behav (recorded at generation)
    advantages: torch.Tensor,  # [N, T] (a sequence's advantage broadcast over its tokens)
    mask: torch.Tensor,  # [N, T]
    clip_eps: float,
    behaviour_weight_cap: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """AReaL's decoupled PPO objective, token-mean aggregated.

    loss_t = -(pi_prox/pi_behav) * min(r*A, clip(r, 1-eps, 1+eps)*A), r = pi_theta/pi_prox.
    With prox_logp == behav_logp it is standard (naive) PPO. A positive
    `behaviour_weight_cap` clamps the behaviour weight from above.
    """
    behaviour_weight = torch.exp(prox_logp - behav_logp)  # [N, T]
    if behaviour_weight_cap > 0:
        behaviour_weight = behaviour_weight.clamp(max=behaviour_weight_cap)
    ratio = torch.exp(logp - prox_logp)  # [N, T]
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_token = -behaviour_weight * torch.minimum(unclipped, clipped)  # [N, T]
    loss = masked_mean(per_token, mask)
    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean((clipped < unclipped).float(), mask).item(),
            "behaviour_weight_mean": masked_mean(behaviour_weight, mask).item(),
            "behaviour_weight_max": (behaviour_weight * mask).max().item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
        }
    return loss, stats
