"""One token per slot from the forward's logits, with its behaviour logprob.

Behaviour logprobs are log softmax(logits / temperature) (temperature 1 for greedy
rows) over the full vocabulary, taken from the same probabilities the sampler used
and *before* top-k/top-p filtering: they only restrict which token may be drawn. This
keeps π_behav a property of the policy at that temperature, which is what the trainer
recomputes as π_prox/π_θ, rather than of a truncated sampling distribution.

Top-k and top-p combine as in Hugging Face's warpers: keep the k most likely tokens,
then the smallest prefix of those whose renormalised mass reaches top_p.
"""

from __future__ import annotations

import math

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
        """Draw one token per slot from logits [B, V] (this step's own: scaled in place); return it with its
        behaviour logprob (see module doc)."""
        tokens = first_argmax(logits) if self.any_greedy else None  # [B]
        probs = torch.softmax(logits.div_(self.temperature), dim=-1)  # [B, V]
        if self.any_random:
            allowed = self.filtered(probs) if self.any_filter else probs  # [B, V]
            drawn = draw(allowed, generator)  # [B]
            tokens = torch.where(self.greedy, tokens, drawn) if self.any_greedy else drawn  # [B]
        # [B], [B]; a drawn or greedy token's probability is never 0, so its log is finite
        return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1).log()

    def filtered(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [B, V] with the tokens outside each row's top-k, then top-p, at 0."""
        sorted_probs, order = probs.sort(-1, descending=True)  # [B, V]
        rank = torch.arange(probs.shape[-1], device=self.device)  # [V]
        beyond_k = rank >= self.top_k[:, None]  # [B, V], exactly k candidates even under ties
        kept = sorted_probs.masked_fill(beyond_k, 0.0)  # [B, V]
        cum = kept.cumsum(-1)  # [B, V]
        before = (cum - kept) / cum[:, -1:]  # [B, V], renormalised top-k mass ranked above it
        # [B, V]; top_p=1 must never cut, even where rounding pushes `before` to 1
        beyond_p = (before >= self.top_p[:, None]) & (self.top_p[:, None] < 1)
        outside = beyond_k | beyond_p  # [B, V]
        outside = torch.empty_like(outside).scatter_(-1, order, outside)  # [B, V], back to vocab order
        return probs.masked_fill(outside, 0.0)  # [B, V]


BLOCK = 256  # vocabulary entries per block of the two-level searches below


def blocks(x: torch.Tensor, fill: float) -> torch.Tensor:
    """x [B, V] as [B, V/BLOCK, BLOCK], padded with `fill` to a whole number of blocks."""
    pad = -x.shape[-1] % BLOCK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=fill)  # [B, V + pad]
    return x.view(x.shape[0], -1, BLOCK)


def in_block(x: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Row i's block block[i] of x [B, nb, BLOCK]: [B, BLOCK]."""
    return x.gather(1, block[:, None, None].expand(-1, 1, BLOCK))[:, 0]


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest entry of logits [B, V], as argmax, found block by block: a full-width argmax
    costs ~15x an amax on a CPU."""
    x = blocks(logits, -math.inf)  # [B, nb, BLOCK]
    block = x.amax(-1).argmax(-1)  # [B], the first block holding the row's maximum
    return block * BLOCK + in_block(x, block).argmax(-1)  # [B]


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of weights [B, V] (>= 0, 0: never drawn), at probability proportional to its weight, by
    inverting the row's cumulative distribution at a uniform draw: torch.multinomial's law. It searches the
    blocks' cumulative masses, then the chosen block's entries, so no [B, V] cumulative sum is made (which took
    ~80 % of a 128-row draw over a 49k vocabulary on one Xeon core); torch.multinomial draws a random number
    per entry, ~12x slower again."""
    x = blocks(weights, 0.0)  # [B, nb, BLOCK]
    cdf = x.sum(-1).double().cumsum(-1)  # [B, nb], float64: the blocks' sum keeps its tail
    total = cdf[:, -1:]  # [B, 1]
    uniform = torch.rand(total.shape, dtype=torch.float64, device=cdf.device, generator=generator)  # [B, 1]
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))  # [B, 1], < total
    # [B, 1]; right=True: the first block whose cumulative mass exceeds the target, so one with mass
    block = torch.searchsorted(cdf, target, right=True)
    before = torch.where(block > 0, cdf.gather(-1, (block - 1).clamp(min=0)), 0.0)  # [B, 1], earlier blocks' mass
    inner = in_block(x, block[:, 0]).double().cumsum(-1)  # [B, BLOCK]
    # [B, 1]; the block's entries summed one by one may differ from its float32 sum in the last bits: stay inside
    rest = torch.minimum(target - before, inner[:, -1:] * (1 - 2**-40))
    return (block * BLOCK + torch.searchsorted(inner, rest, right=True)).squeeze(-1)  # [B]
