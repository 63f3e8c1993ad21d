"""Token ids against the model's vocabulary: the one check of a message that needs the model.

The schema (`schemas/validate.py`) keeps ids >= 0 and within int32; only a worker holding the model knows
its embedding table. An id past it is an IndexError on CPU and a device-side assert that takes the whole
process down on CUDA, so the rollout checks a prompt before generating and the trainer a trajectory before
it enters the buffer.
"""

from __future__ import annotations


def outside_vocab(vocab: int, **token_lists: list[int]) -> str | None:
    """Why these lists (by name) cannot enter a model of `vocab` embeddings, or None if they can."""
    for name, ids in token_lists.items():
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            return f"{name} must lie in [0, {vocab}) (the model's vocabulary), got {min(ids)}..{max(ids)}"
    return None
