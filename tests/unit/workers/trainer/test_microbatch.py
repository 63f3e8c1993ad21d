"""Micro-batch allocation: exact assignments by hand, and fixed vs dynamic training."""

import copy
import random

import pytest
import torch

from tests.factories import tiny_qwen2
from workers.trainer.losses import LossSettings
from workers.trainer.microbatch import allocate_dynamic, allocate_fixed, allocator
from workers.trainer.step import StepSettings, collate, token_logprobs, train_step

torch.set_num_threads(1)


def test_dynamic_by_hand():
    # longest first: 9(i1) 7(i3) 6(i5) 5(i0) 3(i2) 2(i4), budget 12, at least 2 micro-batches
    # i1 -> new [1] (fewer than 2 exist); i3 -> new [3]; i5: 9+6, 7+6 > 12 -> new [5]
    # i0 (5): fits [3] (12) and [5] (11), both hold 1 sequence -> the first opened, [3, 0]
    # i2 (3): fits [1] (12) and [5] (9), both hold 1 -> [1, 2]; i4 (2): fits only [5] (8) -> [5, 4]
    assert allocate_dynamic([5, 9, 3, 7, 2, 6], max_tokens=12, min_count=2) == [[1, 2], [3, 0], [5, 4]]


def test_dynamic_prefers_fewest_sequences_over_fewest_tokens():
    # 4(i0) -> [0]; 3(i4) -> [4] (min 2); 1(i1): both fit, 1 sequence each -> [0, 1] (5 tokens)
    # 1(i2): both fit; [4] holds fewer sequences (though 3 < 5 tokens too) -> [4, 2]
    # 1(i3): both fit, 2 sequences each -> the first opened, [0, 1, 3]
    assert allocate_dynamic([4, 1, 1, 1, 3], max_tokens=8, min_count=2) == [[0, 1, 3], [4, 2]]


def test_dynamic_edge_cases():
    assert allocate_dynamic([10, 3], max_tokens=8) == [[0], [1]]  # too long for the budget: alone
    assert allocate_dynamic([2, 2], max_tokens=100, min_count=3) == [[0], [1]]  # never an empty one
    assert allocate_dynamic([2, 2, 2], max_tokens=4) == [[0, 1], [2]]  # equal lengths keep index order
    assert allocate_dynamic([], max_tokens=4) == []


def test_dynamic_invariants_on_random_lengths():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        budget, least = rng.randint(20, 120), rng.randint(1, 4)
        parts = allocate_dynamic(lengths, budget, least)
        assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
        assert len(parts) >= min(least, len(lengths))
        assert all(len(part) == 1 or sum(lengths[i] for i in part) <= budget for part in parts)


def test_fixed_by_hand():
    assert allocate_fixed([9, 1, 1, 1, 1], count=2) == [[0, 1], [2, 3, 4]]  # lengths are ignored
    assert allocate_fixed([1, 1, 1], count=4) == [[0], [1], [2]]
    assert allocate_fixed([1, 1, 1], count=1) == [[0, 1, 2]]


def test_allocator_from_config_names():
    assert allocator("dynamic", 12, 2, 1)([5, 9, 3, 7, 2, 6]) == [[1, 2], [3, 0], [5, 4]]
    assert allocator("fixed", 12, 2, 3)([5, 9, 3, 7, 2, 6]) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="micro-batch mode"):
        allocator("random", 12, 2, 1)


SEQS = [
    ([3, 4, 5], [6, 7], [-1.0, -2.0]),
    ([3, 4], [8, 9, 1], [-0.5, -0.25, -3.0]),
    ([5], [6], [-1.5]),
    ([2, 3, 4, 5], [9, 9, 9, 2], [-2.0, -2.0, -1.0, -0.5]),
]
ADV = [1.0, -0.5, 0.25, 0.75]


@pytest.fixture
def model():
    return tiny_qwen2()


def test_fixed_and_dynamic_both_train_and_agree(model):
    batch = collate(SEQS, ADV, pad_id=0)
    splits = {"dynamic": allocator("dynamic", 9, 1, 1), "fixed": allocator("fixed", 9, 1, 3)}
    before = (token_logprobs(model, batch, 1.0) * batch.loss_mask * batch.advantages).sum().item()
    trained = {}
    for name, split in splits.items():
        trained[name] = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(trained[name].parameters(), lr=1e-2)
        for _ in range(2):
            settings = StepSettings(
                decoupled=True,
                minibatches=2,
                grad_clip=1.0,
                temperature=1.0,
                loss=LossSettings(clip_eps=0.2),
                split=split,
            )
            stats = train_step(trained[name], optimizer, batch, settings)
        after = (token_logprobs(trained[name], batch, 1.0) * batch.loss_mask * batch.advantages).sum().item()
        assert after > before  # advantage-weighted log-likelihood went up
        assert stats["microbatches"] == 2  # lengths 5+5 and 8+2 exceed 9 (dynamic); 3 asked of 2 sequences (fixed)
    for got, want in zip(trained["dynamic"].parameters(), trained["fixed"].parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # the same update, however it is split
