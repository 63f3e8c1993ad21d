"""Padding-free packing: the rows of a right-padded batch laid end to end in one row.

Each sequence keeps its own positions (restarting at 0) and attends only to its own
earlier tokens, through a block-diagonal causal 4D mask that Hugging Face models
take as it is (`masking_utils` returns a 4D mask unchanged; eager attention adds
it, SDPA uses it as `attn_mask`), so a packed forward pass computes what the padded
one does without spending compute on padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    input_ids: torch.Tensor  # [1, L] every real token of the batch, row after row
    position_ids: torch.Tensor  # [1, L] position inside its own sequence
    attention_mask: torch.Tensor  # [1, 1, L, L] additive: 0 where query may see key, dtype min elsewhere
    index: torch.Tensor  # [N, T-1] packed position of each padded prediction position (0 where not valid)
    valid: torch.Tensor  # [N, T-1] True where the padded position predicts a token of its own sequence

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position values of the packed row, [L-1] (position p predicts token p+1) -> [N, T-1], 0 elsewhere."""
        return torch.where(self.valid, values[self.index], 0.0)  # [N, T-1]


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> Packed:
    """Pack right-padded rows ([N, T] ids and 0/1 mask) into one row; `dtype` is the model's (for the mask)."""
    n, width = input_ids.shape
    lengths = attention_mask.sum(-1)  # [N]
    starts = lengths.cumsum(0) - lengths  # [N] packed position of each sequence's first token
    sequence = torch.repeat_interleave(torch.arange(n, device=input_ids.device), lengths)  # [L] owner of each token
    total = sequence.shape[0]
    positions = torch.arange(total, device=input_ids.device) - starts[sequence]  # [L]
    causal = torch.ones(total, total, dtype=torch.bool, device=input_ids.device).tril()  # [L, L]
    allowed = causal & (sequence[:, None] == sequence[None, :])  # [L, L]
    mask = torch.zeros(total, total, dtype=dtype, device=input_ids.device).masked_fill(~allowed, torch.finfo(dtype).min)
    offsets = torch.arange(width - 1, device=input_ids.device)  # [T-1]
    valid = offsets[None, :] < (lengths - 1)[:, None]  # [N, T-1]
    index = torch.where(valid, starts[:, None] + offsets[None, :], 0)  # [N, T-1]
    return Packed(
        input_ids=input_ids[attention_mask.bool()][None],  # [1, L]
        position_ids=positions[None],  # [1, L]
        attention_mask=mask[None, None],  # [1, 1, L, L]
        index=index,
        valid=valid,
    )
