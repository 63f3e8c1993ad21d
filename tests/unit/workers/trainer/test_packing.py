"""Packing: exact layout by hand, and packed micro-batched training equal to padded training."""

import copy

import pytest
import torch

from tests.factories import tiny_qwen2
from workers.trainer import packing
from workers.trainer.losses import LossSettings, decoupled_ppo_loss
from workers.trainer.microbatch import allocator
from workers.trainer.packing import block_causal_mask, chunks, pack
from workers.trainer.step import Row, accumulate_gradients, collate, token_logprobs

torch.set_num_threads(1)


def test_pack_by_hand():
    ids = torch.tensor([[3, 4, 5, 0], [6, 7, 0, 0], [8, 0, 0, 0]])
    packed = pack(ids, (ids > 0).long())
    assert packed.input_ids.tolist() == [[3, 4, 5, 6, 7, 8]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0]]
    assert packed.cu_seqlens.tolist() == [0, 3, 5, 6]  # attention stays inside tokens 0-2, 3-4, 5
    # padded position t of row r predicts token t+1 of r: packed position start_r + t, for t < length_r - 1
    assert packed.valid.tolist() == [[True, True, False], [True, False, False], [False, False, False]]
    assert packed.index.tolist() == [[0, 1, 0], [3, 0, 0], [0, 0, 0]]
    # packed position 2 predicts across sequences (5 -> 6): no valid position reads it


def test_pack_shares_a_prompt_by_hand():
    # rows 0 and 2 have the prompt [3, 4]; row 1's prompt [3] is another one; row 3 shares [3, 4] but has no
    # completion, so there is nothing to share
    ids = torch.tensor([[3, 4, 5, 6], [3, 8, 0, 0], [3, 4, 7, 0], [3, 4, 0, 0]])
    packed = pack(ids, (ids > 0).long(), prompt_lengths=torch.tensor([2, 1, 2, 2]))
    assert packed.input_ids.tolist() == [[3, 4, 5, 6, 7, 3, 8, 3, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 0, 1]]  # completions go on from the prompt
    assert packed.cu_seqlens.tolist() == [0, 2, 4, 5, 7, 9]  # the prompt, row 0's and row 2's rest, rows 1 and 3
    assert packed.parents == [-1, 0, 0, -1, -1]
    # row 2 predicts 4 from packed position 0 and 7 from the shared prompt's last position, 1
    assert packed.index.tolist() == [[0, 1, 2], [5, 0, 0], [0, 1, 0], [7, 0, 0]]
    assert packed.targets.tolist() == ids[:, 1:].tolist()


def test_pack_shares_a_repeated_answer_by_hand():
    # rows 0 and 2 are the same prompt and answer: row 2 reads row 0's packed positions
    ids = torch.tensor([[3, 4, 5, 6], [3, 4, 7, 0], [3, 4, 5, 6]])
    packed = pack(ids, (ids > 0).long(), prompt_lengths=torch.tensor([2, 2, 2]))
    assert packed.input_ids.tolist() == [[3, 4, 5, 6, 7]]
    assert packed.cu_seqlens.tolist() == [0, 2, 4, 5] and packed.parents == [-1, 0, 0]
    assert packed.index.tolist() == [[0, 1, 2], [0, 1, 0], [0, 1, 2]]


def test_chunks_group_neighbouring_sequences_up_to_the_limit_and_a_longer_one_alone():
    # sequences of 3, 2, 1, 9, 2, 2 positions
    assert chunks([0, 3, 5, 6, 15, 17, 19], limit=6) == [[0, 3, 5, 6], [6, 15], [15, 17, 19]]
    assert chunks([0, 3, 5, 6, 15, 17, 19], limit=100) == [[0, 3, 5, 6, 15, 17, 19]]
    assert chunks([0, 3, 5, 6, 15, 17, 19], limit=1) == [[0, 3], [3, 5], [5, 6], [6, 15], [15, 17], [17, 19]]


def test_a_shared_prompt_and_its_completions_are_never_cut_apart():
    # a prompt of 3 with completions of 2 and 2 (7 positions), then a sequence of 2
    parents = [-1, 0, 0, -1]
    assert chunks([0, 3, 5, 7, 9], limit=4, parents=parents) == [[0, 3, 5, 7], [7, 9]]
    assert chunks([0, 3, 5, 7, 9], limit=9, parents=parents) == [[0, 3, 5, 7, 9]]


def test_block_causal_mask_into_a_shared_prompt_by_hand():
    got = block_causal_mask([0, 2, 4, 5], torch.device("cpu"), parents=[-1, 0, 0]).int().tolist()
    assert got == [  # a prompt of 2, completions of 2 and 1 attending to it and to themselves
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],
    ]


def test_block_causal_mask_by_hand():
    got = block_causal_mask([4, 6, 7, 9], torch.device("cpu")).int().tolist()  # sequences of 2, 1 and 2
    assert got == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]


def random_sequences(n: int, seed: int = 0, tools: bool = False, group: int = 1, repeats: bool = False):
    """`n` random rows and their advantages; `tools`: with a random loss mask each (about a third tool tokens);
    `group`: consecutive rows sampled from one prompt, as GRPO's groups are; `repeats`: every third row of a group
    repeats the answer before it (with its own behaviour logprobs and advantage)."""
    g = torch.Generator().manual_seed(seed)
    sequences = []
    for i in range(n):
        prompt_len, completion_len = (int(torch.randint(1, hi, (1,), generator=g)) for hi in (5, 8))
        prompt = torch.randint(1, 16, (prompt_len,), generator=g).tolist() if i % group == 0 else sequences[-1][0]
        completion = torch.randint(1, 16, (completion_len,), generator=g).tolist()
        if repeats and i % group and i % 3 == 2:
            completion, completion_len = sequences[-1][1], len(sequences[-1][1])
        behav = (-torch.rand(completion_len, generator=g) * 3 - 1).tolist()
        mask = (torch.rand(completion_len, generator=g) > 0.3).long().tolist() if tools else []
        sequences.append(Row(prompt, completion, behav, mask))
    return sequences, torch.randn(n, generator=g).tolist()


def padded_logprobs(model, batch):
    """The reference: one padded forward pass with the 2D padding mask."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]  # [N, T-1, V]
    return torch.log_softmax(logits, dim=-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)  # [N, T-1]


@pytest.mark.parametrize("group", [1, 3], ids=["own prompts", "shared prompts"])
@pytest.mark.parametrize("chunk_tokens", [packing.CHUNK_TOKENS, 7, 1], ids=["default", "mixed", "one by one"])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_logprobs_equal_padded(attn_implementation, chunk_tokens, group, monkeypatch):
    monkeypatch.setattr(packing, "CHUNK_TOKENS", chunk_tokens)  # sequences attended alone, in runs, or mixed
    model = tiny_qwen2(attn_implementation=attn_implementation)
    batch = collate(*random_sequences(9, group=group), pad_id=0)
    assert len(pack(batch.input_ids, batch.attention_mask, batch.prompt_lengths).parents) == 9 + (group > 1) * 3
    valid = batch.completion_positions()  # [N, T-1] positions that predict a completion token
    with torch.no_grad():
        want = padded_logprobs(model, batch)
        got = token_logprobs(model, batch, 1.0, split=allocator("dynamic", 12, 2, 1))
    torch.testing.assert_close(got[valid], want[valid], rtol=0, atol=1e-5)
    assert not got[~valid].any()


def test_packed_bfloat16_logprobs_stay_near_float32():
    """Under bfloat16 autocast the matmuls run in bfloat16 but attention in float32 (CPU bfloat16 SDPA is slow):
    the logprobs stay within bfloat16's rounding of the float32 ones."""
    model = tiny_qwen2()
    batch = collate(*random_sequences(6), pad_id=0)
    valid = batch.completion_positions()  # [N, T-1]
    with torch.no_grad():
        want = token_logprobs(model, batch, 1.0)
        got = token_logprobs(model, batch, 1.0, dtype=torch.bfloat16)
    assert got.dtype == torch.float32 and not torch.equal(got[valid], want[valid])  # really computed in bfloat16
    torch.testing.assert_close(got[valid], want[valid], rtol=0, atol=0.05)


def shares_an_answer(packed) -> bool:
    """Two rows of the pack read the same packed positions."""
    rows = [
        tuple(index) for index, valid in zip(packed.index.tolist(), packed.valid.tolist(), strict=True) if any(valid)
    ]
    return len(set(rows)) < len(rows)


LOSS_OPTIONS = [  # caps that hit some tokens / sequences of the batch below (its sequence weights are 0.01-0.81)
    dict(
        aggregation="token_mean", behaviour_weight_level="token", behaviour_weight_mode="cap", behaviour_weight_cap=1.5
    ),
    dict(
        aggregation="seq_mean",
        behaviour_weight_level="sequence",
        behaviour_weight_mode="mask",
        behaviour_weight_cap=0.3,
    ),
    dict(
        aggregation="token_sum_norm",
        behaviour_weight_level="token",
        behaviour_weight_mode="mask",
        behaviour_weight_cap=1.5,
    ),
]


@pytest.mark.parametrize("group", [1, 4, "4 with repeats"], ids=["own prompts", "shared prompts", "repeated answers"])
@pytest.mark.parametrize("tools", [False, True], ids=["model tokens", "with tool tokens"])
@pytest.mark.parametrize("options", LOSS_OPTIONS, ids=[o["aggregation"] for o in LOSS_OPTIONS])
def test_packed_microbatched_gradients_equal_padded(options, tools, group):
    settings = LossSettings(clip_eps=0.2, clip_eps_high=0.28, max_new_tokens=8, **options)
    padded_model = tiny_qwen2()
    packed_model = copy.deepcopy(padded_model)
    repeats, group = group == "4 with repeats", 4 if group == "4 with repeats" else group
    sequences, advantages = random_sequences(8, seed=1, tools=tools, group=group, repeats=repeats)
    batch = collate(sequences, advantages, pad_id=0)
    assert (batch.loss_mask.sum() < sum(len(row.completion) for row in sequences)) == tools  # tool tokens masked
    noise = torch.randn(batch.behav_logp.shape, generator=torch.Generator().manual_seed(2)) * 0.3  # [N, T-1]
    with torch.no_grad():
        prox = (padded_logprobs(padded_model, batch) + noise) * batch.loss_mask  # [N, T-1] ratios off 1
    split = allocator("dynamic", 16, 2, 1)
    assert len(split(batch.attention_mask.sum(-1).tolist())) >= 3  # really several packed micro-batches
    packs = [
        pack(mb.input_ids, mb.attention_mask, mb.prompt_lengths) for mb in map(batch.select, batch.microbatches(split))
    ]
    assert any(max(p.parents) >= 0 for p in packs) == (group > 1)  # some micro-batch shares a prompt
    assert any(shares_an_answer(p) for p in packs) == repeats  # some micro-batch packs an answer once for two rows

    logp = padded_logprobs(padded_model, batch)
    want, _ = decoupled_ppo_loss(logp, prox, batch.behav_logp, batch.advantages, batch.loss_mask, settings)
    want.backward()
    stats, _ = accumulate_gradients(packed_model, batch, prox, split, 1.0, settings)

    assert stats["loss"] == pytest.approx(want.item(), abs=1e-5)
    assert 0 < stats["behaviour_weight_over_cap"] < 1 and 0 < stats["clip_fraction"] < 1  # the options are in play
    for (name, got), wanted in zip(packed_model.named_parameters(), padded_model.parameters(), strict=True):
        torch.testing.assert_close(got.grad, wanted.grad, rtol=0, atol=1e-5, msg=name)
