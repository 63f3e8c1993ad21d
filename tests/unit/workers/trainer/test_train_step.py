"""The training step: collation, pi_prox from the first minibatch's own pass, and real updates."""

import copy

import pytest
import torch

from tests.factories import tiny_qwen2
from tests.message_examples import SCORED, SCORED_TOOL
from workers.trainer.losses import LossSettings, decoupled_ppo_loss
from workers.trainer.microbatch import allocator
from workers.trainer.model import trained_versions
from workers.trainer.step import WHOLE_BATCH, Row, StepSettings, TrainBatch, collate, token_logprobs, train_step

SEQS = [([3, 4, 5], [6, 7], [-1.0, -2.0]), ([3, 4], [8, 9, 1], [-0.5, -0.25, -3.0]), ([5], [6], [-1.5])]
# a tool call (6), its output (7 8: mask 0, placeholder logprobs), the answer (9); a plain row; output first
TOOL_SEQS = [
    Row([3, 4], [6, 7, 8, 9], [-1.0, 0.0, 0.0, -2.0], [1, 0, 0, 1]),
    Row([3, 4], [8, 9, 1], [-0.5, -0.25, -3.0]),
    Row([5], [6, 9], [0.0, -0.5], [0, 1]),
]
ADV = [1.0, -0.5, 0.25]
PPO = LossSettings(clip_eps=0.2)


@pytest.fixture
def model():
    return tiny_qwen2()


def test_collate_aligns_completion_tokens_with_their_predicting_position():
    batch = collate(SEQS, ADV, pad_id=0)
    assert batch.input_ids.tolist()[1] == [3, 4, 8, 9, 1]
    assert batch.input_ids.tolist()[2] == [5, 6, 0, 0, 0]
    # position t predicts token t+1: the completion of row 0 is predicted from positions 2, 3
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1], [1, 0, 0, 0]]
    assert batch.behav_logp[1].tolist() == [0, -0.5, -0.25, -3.0]
    assert batch.advantages[0].tolist() == [0, 0, 1.0, 1.0]


def test_collate_trains_the_model_tokens_only():
    batch = collate(TOOL_SEQS, ADV, pad_id=0)
    assert batch.input_ids.tolist()[0] == [3, 4, 6, 7, 8, 9]
    assert batch.loss_mask.tolist() == [[0, 1, 0, 0, 1], [0, 1, 1, 1, 0], [0, 1, 0, 0, 0]]
    assert batch.behav_logp[0].tolist() == [0, -1.0, 0.0, 0.0, -2.0]
    assert batch.advantages[0].tolist() == [0, 1.0, 1.0, 1.0, 1.0]  # sequence level; the mask decides
    plain = collate([Row(*SEQS[0], [1, 1]), SEQS[0]], [1.0, 1.0], pad_id=0)  # the empty mask means all ones
    assert plain.loss_mask[0].tolist() == plain.loss_mask[1].tolist() == [0, 0, 1, 1]


def test_only_model_tokens_count_in_the_token_statistics():
    assert trained_versions(SCORED_TOOL) == [2, 2, 3, 3]  # tokens 8 9 are the tool's: no version trained
    assert trained_versions(SCORED) == SCORED.versions


def tampered(batch: TrainBatch) -> TrainBatch:
    """`batch` with arbitrary behaviour logprobs and advantages wherever the loss mask is 0 (tool tokens, prompt,
    padding): far enough off that exp() of their log-ratio overflows."""
    masked = batch.loss_mask == 0  # [N, T-1]
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(batch.behav_logp.shape, generator=g) * 1e3  # [N, T-1]
    behav = torch.where(masked, -noise.abs() - 200.0, batch.behav_logp)  # [N, T-1]
    advantages = torch.where(masked, noise, batch.advantages)  # [N, T-1]
    return TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, behav, advantages, batch.prompt_lengths)


M2PO = LossSettings(clip_eps=0.2, objective="m2po", m2_threshold=1.0)
TWO_MICRO = allocator("fixed", 0, 0, 2)


@pytest.mark.parametrize(
    ("decoupled", "minibatches", "split", "loss"),
    [
        (False, 1, WHOLE_BATCH, PPO),
        (True, 1, WHOLE_BATCH, PPO),
        (True, 2, WHOLE_BATCH, PPO),
        (True, 1, TWO_MICRO, PPO),
        (True, 1, TWO_MICRO, M2PO),
    ],
    ids=["naive", "decoupled", "2 minibatches", "2 micro-batches", "m2po"],
)
def test_tool_tokens_change_neither_the_update_nor_its_stats(model, decoupled, minibatches, split, loss):
    """Whatever the masked positions hold, the step is bit for bit the same: the packed forward, the loss,
    the gradients, the AdamW update and every statistic (entropy, clip fraction, behaviour weights)."""
    batch = collate(TOOL_SEQS, ADV, pad_id=0)
    settings = StepSettings(decoupled, minibatches, grad_clip=1.0, temperature=1.0, loss=loss, split=split)
    results = []
    for data in (batch, tampered(batch)):
        local = copy.deepcopy(model)
        stats = train_step(local, torch.optim.AdamW(local.parameters(), lr=1e-2), data, settings)
        results.append((stats, [p.detach() for p in local.parameters()]))
    (stats, weights), (stats_tampered, weights_tampered) = results
    assert stats == stats_tampered and stats["skipped_updates"] == 0 and stats["grad_norm"] > 0
    assert stats["microbatches"] == (1 if split is WHOLE_BATCH else 2)
    assert all(torch.equal(a, b) for a, b in zip(weights, weights_tampered, strict=True))


def comparable_optimizer(model) -> torch.optim.Optimizer:
    """Steps that compare to 1e-6: AdamW's first step, ~lr * g / |g|, turns the last bits of a near-eps gradient
    into ~1e-5 of weight (seen on an AMD EPYC); weight decay and momentum still move weights on a zero gradient."""
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=0.1)


def reference_step(model, batch, minibatches):
    """pi_prox computed separately for the whole batch before any update (the textbook order)."""
    optimizer = comparable_optimizer(model)
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


def step_like_the_textbook(model, batch, minibatches) -> dict:
    """train_step's stats, once its weights are checked against `reference_step`'s from the same start."""
    expected = reference_step(copy.deepcopy(model), batch, minibatches)
    optimizer = comparable_optimizer(model)
    settings = StepSettings(decoupled=True, minibatches=minibatches, grad_clip=1.0, temperature=1.0, loss=PPO)
    stats = train_step(model, optimizer, batch, settings)
    for (name, got), want in zip(model.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
    return stats


@pytest.mark.parametrize("minibatches", [1, 2])
def test_update_equals_the_textbook_order(model, minibatches):
    assert step_like_the_textbook(model, collate(SEQS, ADV, pad_id=0), minibatches)["grad_norm"] > 0


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


@pytest.mark.parametrize(
    ("advantages", "minibatches", "skipped"),
    [([1.0, 0.0, 0.25], 1, 1), ([0.0, 0.0, 0.0], 1, 2), ([0.0, 0.0, 0.5], 2, 1)],
    ids=["one row", "every row (the shortest runs)", "a whole minibatch"],
)
def test_rows_without_advantage_are_skipped_and_the_update_is_unchanged(model, advantages, minibatches, skipped):
    """A row with zero advantage adds exactly nothing to the gradient: its passes are skipped, and the weights
    after the step are those of the textbook step over every row (the optimizer steps even on an all-zero minibatch)."""
    stats = step_like_the_textbook(model, collate(SEQS, advantages, pad_id=0), minibatches)
    assert stats["zero_advantage_rows"] == skipped and stats["microbatches"] == 1  # per minibatch
    assert 0.9 < stats["ratio_mean"] < 1.1  # a mean over the tokens that ran, not diluted by the skipped ones


def test_m2po_masks_over_the_whole_minibatch_whatever_its_micro_batches(model):
    """M2PO's mask is cut once over every trained token of the minibatch: split into two micro-batches, the step
    drops the same tokens and ends at the same weights. The threshold keeps the 3 smallest of the 6 moments."""
    batch = collate(SEQS, ADV, pad_id=0)
    with torch.no_grad():
        prox = token_logprobs(model, batch, 1.0)  # [N, T-1]
    m2 = ((prox - batch.behav_logp) ** 2)[batch.loss_mask > 0].sort().values  # [6]
    between = (m2[:3].mean() + m2[:4].mean()).item() / 2  # the mean of the 3 smallest fits, of the 4 smallest not
    loss = LossSettings(clip_eps=0.2, objective="m2po", m2_threshold=between)
    runs = []
    for split in (WHOLE_BATCH, TWO_MICRO):
        local = copy.deepcopy(model)
        settings = StepSettings(True, 1, grad_clip=1.0, temperature=1.0, loss=loss, split=split)
        runs.append((train_step(local, comparable_optimizer(local), batch, settings), list(local.parameters())))
    (whole, weights), (split, split_weights) = runs
    assert whole["m2po_masked"] == split["m2po_masked"] == 0.5 and split["microbatches"] == 2
    assert whole["m2po_m2"] == pytest.approx(m2.mean().item()) and whole["m2po_m2_kept"] <= loss.m2_threshold
    assert whole["clip_fraction"] == 0.0 and whole["grad_norm"] > 0
    for got, want in zip(split_weights, weights, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
