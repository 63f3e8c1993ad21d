"""The LM head on completion positions only, in checkpointed chunks: the logprobs, entropies and gradients of
the full-vocabulary log-softmax over every packed position, without keeping vocabulary-wide tensors."""

import copy

import pytest
import torch

from schemas.config import LoraConfig
from tests.factories import tiny_qwen2
from tests.unit.workers.trainer.test_packing import random_sequences
from workers.lora import wrap
from workers.trainer import step
from workers.trainer.packing import pack, use_packed_attention
from workers.trainer.step import Row, collate, packed_logprobs

torch.set_num_threads(1)

VOCAB = 40  # no other width of the tiny model: a tensor this wide is the head's


def full_vocabulary(model, batch, temperature):
    """The reference: the head and a float32 log-softmax over every packed position, [L, V], then the
    completion positions' logprobs and entropies, [N, T-1] each."""
    use_packed_attention(model)
    packed = pack(batch.input_ids, batch.attention_mask, batch.prompt_lengths)
    logits = model(**packed.model_inputs()).logits[0].float()  # [L, V]
    logp = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)  # [L, V]
    entropy = -(logp.exp() * logp).sum(-1).detach()  # [L]
    where = batch.completion_positions()  # [N, T-1]
    return torch.where(where, logp[packed.index, packed.targets], 0.0), torch.where(where, entropy[packed.index], 0.0)


def batch_of(group: int, repeats: bool = False):
    sequences, advantages = random_sequences(9, seed=4, group=group, repeats=repeats)
    return collate(sequences, advantages, pad_id=0)


def weighted_loss(logp: torch.Tensor) -> torch.Tensor:
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(5))  # [N, T-1]
    return (logp * weights).sum()


def assert_same_logprobs_and_gradients(model, batch, temperature):
    reference = copy.deepcopy(model)
    want_logp, want_entropy = full_vocabulary(reference, batch, temperature)
    logp, entropy, _ = packed_logprobs(model, batch, temperature)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-6)
    assert not entropy.requires_grad
    weighted_loss(want_logp).backward()
    weighted_loss(logp).backward()
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    for (name, got), wanted in zip(trained, [p for p in reference.parameters() if p.requires_grad], strict=True):
        scale = wanted.grad.abs().max().item()  # the chunks' parts of a head gradient add up in another order
        torch.testing.assert_close(got.grad, wanted.grad, rtol=0, atol=1e-6 * scale, msg=name)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0], ids=["t=1", "t=0.7", "t=0 (no division)"])
@pytest.mark.parametrize("head_rows", [step.HEAD_ROWS, 3], ids=["one chunk", "chunks of 3"])
@pytest.mark.parametrize("group", [1, 3, "3 with repeats"], ids=["own prompts", "shared prompts", "repeats"])
def test_chunked_head_equals_the_full_vocabulary_softmax(group, head_rows, temperature, monkeypatch):
    monkeypatch.setattr(step, "HEAD_ROWS", head_rows)
    model = tiny_qwen2(vocab_size=VOCAB, tie_word_embeddings=True)
    batch = batch_of(3 if group != 1 else 1, repeats=group == "3 with repeats")
    assert_same_logprobs_and_gradients(model, batch, temperature)


def test_chunked_head_of_a_lora_model_with_an_adapted_head(monkeypatch):
    monkeypatch.setattr(step, "HEAD_ROWS", 5)
    model = wrap(tiny_qwen2(vocab_size=VOCAB), LoraConfig(rank=4, target_modules=("q_proj", "lm_head")))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)  # a fresh B is zero: A's gradients would be too
    assert_same_logprobs_and_gradients(model, batch_of(3), 0.9)


def test_no_vocabulary_wide_tensor_is_kept_for_backward(monkeypatch):
    monkeypatch.setattr(step, "HEAD_ROWS", 4)
    model, batch = tiny_qwen2(vocab_size=VOCAB), batch_of(3)
    kept = []

    def widths(method):
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.shape[-1]) or t, lambda t: t):
            method(model, batch, 1.0)[0].sum()
        return kept

    assert VOCAB in widths(full_vocabulary)  # the check sees the reference's [L, V]
    assert VOCAB not in widths(packed_logprobs)


def test_rows_without_completions_still_reach_every_weight():
    """Every row prompt only: nothing to predict, yet the backward runs through the model (FSDP2's filler
    micro-batches need every rank's backward to reach every layer)."""
    model = tiny_qwen2(vocab_size=VOCAB)
    logp, entropy, work = packed_logprobs(
        model, collate([Row([3, 4, 5], [], []), Row([6], [], [])], [1.0, 1.0], 0), 1.0
    )
    assert work == (4, 1 + 2 + 3 + 1, 0)  # 4 packed positions at contexts 1, 2, 3 and 1; none through the head
    assert logp.tolist() == entropy.tolist() == [[0, 0], [0, 0]]
    logp.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_completion_positions_are_those_predicting_a_completion_token_tool_tokens_included():
    rows = [Row([3, 4, 5], [6, 7], [-1.0, -2.0]), Row([3, 4], [6, 7, 8, 9], [-1.0, 0.0, 0.0, -2.0], [1, 0, 0, 1])]
    batch = collate([*rows, Row([5], [6], [-1.5])], [1.0, 1.0, 1.0], pad_id=0)
    assert batch.completion_positions().tolist() == [
        [False, False, True, True, False],
        [False, True, True, True, True],  # the tool's tokens 7 and 8 too, which the loss mask leaves out
        [True, False, False, False, False],
    ]


def test_a_swapped_forward_leaves_the_module_as_it_was():
    linear = torch.nn.Linear(2, 2)
    with step.swapped_forward(linear, lambda x: "swapped"):
        assert linear(torch.ones(2)) == "swapped"
    assert "forward" not in vars(linear)  # the class's forward again
    hooked = linear.forward = lambda x: "hooked"  # as a hook library sets it on the instance
    with step.swapped_forward(linear, lambda x: "swapped"):
        assert linear(torch.ones(2)) == "swapped"
    assert linear.forward is hooked


def test_the_work_counts_the_head_at_the_positions_it_ran_at():
    """Two rows sharing a 2-token prompt (packed once), completions of 2 and 1 tokens: the prompt's last position
    predicts both rows' first token and goes through the head once, the first row's first completion token
    predicts its second; the last tokens of the rows predict nothing."""
    batch = collate([Row([3, 4], [5, 6], [-1.0, -1.0]), Row([3, 4], [7], [-1.0])], [1.0, -1.0], pad_id=0)
    work = packed_logprobs(tiny_qwen2(vocab_size=VOCAB), batch, 1.0)[2]
    assert work == (5, (1 + 2) + (3 + 4) + 3, 2)  # packed: 3 4 | 5 6 | 7, the 7 at context 3
