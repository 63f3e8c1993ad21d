"""The sampler's draw: torch.multinomial's law, never a token filtered to -inf."""

from __future__ import annotations

import math

import torch

from workers.rollout.sampling import draw


def test_draw_follows_the_row_s_probabilities_and_never_picks_an_excluded_token():
    logp = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0, -1.0, -math.inf]]), -1).expand(100_000, 5)  # [N, V]
    tokens = draw(logp, torch.Generator().manual_seed(0))  # [N]
    frequencies = torch.bincount(tokens, minlength=5) / len(tokens)  # [V]
    expected = logp[0].exp()  # [V]
    assert frequencies[4] == 0  # -inf: never drawn
    # within 4 standard errors of each probability (the largest is sqrt(p(1-p)/N) < 0.0016)
    assert torch.all((frequencies - expected).abs() < 4 * 0.0016), (frequencies, expected)


def test_draw_skips_zero_probability_tokens_between_and_at_the_edges():
    logp = torch.full((2000, 6), -math.inf)  # [N, V]
    logp[:, 2] = logp[:, 4] = math.log(0.5)  # only tokens 2 and 4 may be drawn
    tokens = draw(logp, torch.Generator().manual_seed(1))  # [N]
    assert set(tokens.tolist()) == {2, 4}


def test_draw_is_reproducible_with_a_seeded_generator():
    logp = torch.log_softmax(torch.randn(8, 49152, generator=torch.Generator().manual_seed(2)), -1)  # [B, V]
    first = draw(logp, torch.Generator().manual_seed(3))
    assert torch.equal(first, draw(logp, torch.Generator().manual_seed(3)))
