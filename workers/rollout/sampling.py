"""One token per slot from the forward's logits, with its behaviour logprob.

Behaviour logprobs are log_softmax(logits / temperature) (plain log_softmax for
temperature 0) over the full vocabulary, taken from the same logits the sampler used
and *before* top-k/top-p filtering: they only restrict which token may be drawn. This
keeps π_behav a property of the policy at that temperature, which is what the trainer
recomputes as π_prox/π_θ, rather than of a truncated sampling distribution.

Top-k and top-p combine as in Hugging Face's warpers: keep the k most likely tokens,
then the smallest prefix of those whose renormalised mass reaches top_p.
"""

from __future__ import annotations

import torch

from workers.rollout.protocol import SamplingParams

NO_TOP_K = torch.iinfo(torch.long).max  # a rank no token reaches


class SlotSampling:
    """The slots' sampling settings as device tensors, row i for slot i: built when the slots change."""

    def __init__(self, params: list[SamplingParams], device: torch.device):
        self.device = device
        temperature = torch.tensor([p.temperature for p in params])  # [B], on the CPU
        greedy = temperature == 0  # [B], also where a tiny temperature rounds to 0
        self.any_greedy = bool(greedy.any())  # skip sampling work the batch does not need
        self.greedy = greedy.to(device)  # [B], rows at temperature 0: they take the argmax
        self.temperature = torch.where(greedy, 1.0, temperature)[:, None].to(device)  # [B, 1], 1 for greedy rows
        self.top_p = torch.tensor([p.top_p for p in params], device=device)  # [B]
        self.top_k = torch.tensor([p.top_k or NO_TOP_K for p in params], device=device)  # [B], NO_TOP_K where off
        self.any_random = any(p.temperature > 0 for p in params)
        self.any_filter = any(p.temperature > 0 and (p.top_p < 1 or p.top_k > 0) for p in params)

    def sample(self, logits: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per slot from logits [B, V]; return it with its behaviour logprob (see module doc)."""
        logp = torch.log_softmax(logits / self.temperature, dim=-1)  # [B, V]
        tokens = logits.argmax(-1) if self.any_greedy else None  # [B]
        if self.any_random:
            allowed = self.filtered(logp) if self.any_filter else logp  # [B, V]
            drawn = draw(allowed, generator)  # [B]
            tokens = torch.where(self.greedy, tokens, drawn) if self.any_greedy else drawn  # [B]
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)  # [B], [B]

    def filtered(self, logp: torch.Tensor) -> torch.Tensor:
        """logp [B, V] with the tokens outside each row's top-k, then top-p, at -inf."""
        sorted_logp, order = logp.sort(-1, descending=True)  # [B, V]
        rank = torch.arange(logp.shape[-1], device=self.device)  # [V]
        beyond_k = rank >= self.top_k[:, None]  # [B, V], exactly k candidates even under ties
        probs = sorted_logp.exp().masked_fill(beyond_k, 0.0)  # [B, V]
        cum = probs.cumsum(-1)  # [B, V]
        before = (cum - probs) / cum[:, -1:]  # [B, V], renormalised top-k mass ranked above it
        # [B, V]; top_p=1 must never cut, even where rounding pushes `before` to 1
        beyond_p = (before >= self.top_p[:, None]) & (self.top_p[:, None] < 1)
        outside = beyond_k | beyond_p  # [B, V]
        outside = torch.empty_like(outside).scatter_(-1, order, outside)  # [B, V], back to vocab order
        return logp.masked_fill(outside, float("-inf"))  # [B, V]


def draw(logp: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of logp [B, V] (-inf: never), at probability exp(logp), by inverting each row's
    cumulative distribution at a uniform draw: torch.multinomial's law, ~12x faster on a CPU for a 49k
    vocabulary (it draws a random number per entry: 75 ms against 6 ms for 32 rows, one Xeon core)."""
    cdf = logp.exp().cumsum(-1, dtype=torch.float64)  # [B, V], float64: a 49k-term sum keeps its tail
    uniform = torch.rand(cdf.shape[0], 1, dtype=torch.float64, device=cdf.device, generator=generator)  # [B, 1]
    # [B]; right=True: the first entry whose cumulative mass exceeds the draw, never a zero-probability one
    return torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
