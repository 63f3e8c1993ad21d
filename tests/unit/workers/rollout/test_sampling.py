"""The sampler: torch.multinomial's law, never a token filtered out; the greedy token is argmax's."""

from __future__ import annotations

import math

import torch

from workers.rollout.protocol import SamplingParams
from workers.rollout.sampling import BLOCK, SlotSampling, draw, first_argmax


def test_draw_follows_the_row_s_probabilities_and_never_picks_an_excluded_token():
    probs = torch.softmax(torch.tensor([[0.0, 1.0, 2.0, -1.0, -math.inf]]), -1).expand(100_000, 5)  # [N, V]
    tokens = draw(probs, torch.Generator().manual_seed(0))  # [N]
    frequencies = torch.bincount(tokens, minlength=5) / len(tokens)  # [V]
    assert frequencies[4] == 0  # probability 0: never drawn
    # within 4 standard errors of each probability (the largest is sqrt(p(1-p)/N) < 0.0016)
    assert torch.all((frequencies - probs[0]).abs() < 4 * 0.0016), (frequencies, probs[0])


def test_draw_follows_the_law_across_blocks_of_a_vocabulary_not_a_whole_number_of_blocks():
    vocab = 3 * BLOCK + 5
    weights = torch.zeros(vocab)  # [V]
    weights[[0, BLOCK - 1, BLOCK, 2 * BLOCK + 7, vocab - 1]] = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0])
    tokens = draw(weights.expand(100_000, vocab), torch.Generator().manual_seed(4))  # [N]
    frequencies = torch.bincount(tokens, minlength=vocab) / len(tokens)  # [V]
    expected = weights / weights.sum()  # [V], unnormalised weights are proportions
    assert frequencies[expected == 0].sum() == 0
    assert torch.all((frequencies - expected).abs() < 4 * 0.0016), (frequencies[expected > 0], expected[expected > 0])


def test_draw_skips_zero_probability_tokens_between_and_at_the_edges():
    probs = torch.zeros(2000, 6)  # [N, V]
    probs[:, 2] = probs[:, 4] = 0.5  # only tokens 2 and 4 may be drawn
    tokens = draw(probs, torch.Generator().manual_seed(1))  # [N]
    assert set(tokens.tolist()) == {2, 4}


def test_draw_is_reproducible_with_a_seeded_generator():
    probs = torch.softmax(torch.randn(8, 49152, generator=torch.Generator().manual_seed(2)), -1)  # [B, V]
    first = draw(probs, torch.Generator().manual_seed(3))
    assert torch.equal(first, draw(probs, torch.Generator().manual_seed(3)))


def test_first_argmax_is_argmax_with_ties_to_the_first_and_a_partial_last_block():
    logits = torch.randn(6, 2 * BLOCK + 3, generator=torch.Generator().manual_seed(5))  # [B, V]
    logits[1, [7, BLOCK + 7]] = 100.0  # a tie across blocks: the first wins
    logits[2, [BLOCK + 1, BLOCK + 2]] = 100.0  # a tie inside a block
    logits[3, -1] = 100.0  # the partial block's last entry
    logits[4] = 0.0  # all equal: token 0
    assert torch.equal(first_argmax(logits), logits.argmax(-1))
    assert first_argmax(logits)[[1, 2, 3, 4]].tolist() == [7, BLOCK + 1, 2 * BLOCK + 2, 0]


def test_sample_returns_the_log_softmax_of_the_scaled_logits_at_the_drawn_and_greedy_tokens():
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=0.0), SamplingParams(top_k=1)]
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(6))  # [B, V]
    expected = torch.log_softmax(logits / torch.tensor([[0.5], [1.0], [1.0]]), -1)  # [B, V]
    tokens, logprobs = SlotSampling(params, torch.device("cpu")).sample(logits.clone(), torch.Generator())
    assert tokens[1] == logits[1].argmax() and tokens[2] == logits[2].argmax()  # greedy, and top-k 1
    torch.testing.assert_close(logprobs, expected.gather(-1, tokens[:, None]).squeeze(-1))
