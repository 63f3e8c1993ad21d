"""Builders of the messages and the model the tests share: keyword arguments only, each field overridable, the
defaults those most tests want."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from schemas.messages import PromptGroup, Scored, Segment

if TYPE_CHECKING:  # torch and transformers load only in the tests that build a model
    from transformers import PreTrainedTokenizerBase, Qwen2ForCausalLM


def segment(
    *,
    trajectory_id: str = "p/0/0",
    attempt: str = "rollout-0:1",
    token_ids: list[int] | None = None,
    logprobs: list[float] | None = None,
    **fields: Any,
) -> Segment:
    """A segment of `attempt` (its worker: "rollout-0" of "rollout-0:1"), tokens [4, 5] at logprob -0.5 each unless
    given; `fields` sets any other field (segment_index 0, version 0, finish_reason "stop", group None)."""
    token_ids = [4, 5] if token_ids is None else token_ids
    defaults = {"segment_index": 0, "version": 0, "finish_reason": "stop"}
    return Segment(
        trajectory_id=trajectory_id,
        attempt=attempt,
        token_ids=token_ids,
        logprobs=[-0.5] * len(token_ids) if logprobs is None else logprobs,
        worker_id=attempt.split(":")[0],
        **(defaults | fields),
    )


def text_segment(tokenizer: PreTrainedTokenizerBase, text: str, **fields: Any) -> Segment:
    """A `segment` of `text`'s tokens, plus EOS when it stops (finish_reason "stop", the default)."""
    token_ids = tokenizer(text)["input_ids"]
    if fields.get("finish_reason", "stop") == "stop":
        token_ids = [*token_ids, tokenizer.eos_token_id]
    return segment(token_ids=token_ids, **fields)


def scored(*, group: PromptGroup, sample: int = 0, completion_tokens: list[int] | None = None, **fields: Any) -> Scored:
    """Sample `sample` of `group` scored: its ids, release and prompt from the group, completion [5, 6, 1] at
    logprob -1.0 and the group's release version per token unless given; `fields` sets any other field (attempt
    "a", reward 1.0, one segment, finish_reason "stop")."""
    completion = [5, 6, 1] if completion_tokens is None else completion_tokens
    defaults = {
        "trajectory_id": f"{group.prompt_id}/{sample}",
        "prompt_id": group.prompt_id,
        "sample_index": sample,
        "n_samples": group.n_samples,
        "release_index": group.release_index,
        "released_at_version": group.released_at_version,
        "attempt": "a",
        "prompt_tokens": group.prompt_tokens,
        "logprobs": [-1.0] * len(completion),
        "versions": [group.released_at_version] * len(completion),
        "finish_reason": "stop",
        "num_segments": 1,
        "reward": 1.0,
    }
    return Scored(completion_tokens=completion, **(defaults | fields))


def tiny_qwen2(*, seed: int = 0, **config: Any) -> Qwen2ForCausalLM:
    """A two-layer Qwen2 of random weights drawn after `torch.manual_seed(seed)`, in float32; `config` sets any
    Qwen2Config field (vocabulary 16, hidden size 32, 2 heads sharing 1 key-value head, 32 positions)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sizes = {
        "vocab_size": 16,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 64,
        "max_position_embeddings": 32,
    }
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**(sizes | config))).float()
