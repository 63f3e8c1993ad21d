"""The training step: collation, pi_prox from the first minibatch's own pass, and real updates."""

import copy

import pytest
import torch

from workers.trainer.losses import LossSettings, decoupled_ppo_loss
from workers.trainer.step import StepSettings, collate, token_logprobs, train_step

SEQS = [([3, 4, 5], [6, 7], [-1.0, -2.0]), ([3, 4], [8, 9, 1], [-0.5, -0.25, -3.0]), ([5], [6], [-1.5])]
ADV = [1.0, -0.5, 0.25]
PPO = LossSettings(clip_eps=0.2)


@pytest.fixture
def model(tiny_qwen2):
    return tiny_qwen2()


def test_collate_aligns_completion_tokens_with_their_predicting_position():
    batch = collate(SEQS, ADV, pad_id=0)
    assert batch.input_ids.tolist()[1] == [3, 4, 8, 9, 1]
    assert batch.input_ids.tolist()[2] == [5, 6, 0, 0, 0]
    # position t predicts token t+1: the completion of row 0 is predicted from positions 2, 3
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1], [1, 0, 0, 0]]
    assert batch.behav_logp[1].tolist() == [0, -0.5, -0.25, -3.0]
    assert batch.advantages[0].tolist() == [0, 0, 1.0, 1.0]


def reference_step(model, batch, minibatches):
    """pi_prox computed separately for the whole batch before any update (the textbook order)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with torch.no_grad():
        prox = token_logprobs(model, batch, 1.0)
    for rows in torch.arange(3).chunk(minibatches):
        mb = batch.select(rows)
        logp = token_logprobs(model, mb, 1.0)
        loss, _ = decoupled_ppo_loss(logp, prox[rows], mb.behav_logp, mb.advantages, mb.loss_mask, PPO)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return model


@pytest.mark.parametrize("minibatches", [1, 2])
def test_update_equals_the_textbook_order(model, minibatches):
    batch = collate(SEQS, ADV, pad_id=0)
    expected = reference_step(copy.deepcopy(model), batch, minibatches)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    settings = StepSettings(decoupled=True, minibatches=minibatches, grad_clip=1.0, temperature=1.0, loss=PPO)
    stats = train_step(model, optimizer, batch, settings)
    for (name, got), want in zip(model.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
    assert stats["grad_norm"] > 0


def test_positive_advantage_makes_its_tokens_more_likely(model):
    batch = collate([SEQS[0]], [1.0], pad_id=0)
    before = token_logprobs(model, batch, 1.0)[0, 2:].sum().item()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        train_step(
            model,
            optimizer,
            batch,
            StepSettings(decoupled=False, minibatches=1, grad_clip=1.0, temperature=1.0, loss=PPO),
        )
    assert token_logprobs(model, batch, 1.0)[0, 2:].sum().item() > before
