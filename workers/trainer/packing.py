"""Padding-free packing: the rows of a right-padded batch laid end to end in one row.

Each sequence keeps its own positions (restarting at 0) and attends only to its own
earlier tokens: the packed row goes through the model with attention registered as
`PACKED_ATTENTION`, which runs causal SDPA on each sequence's slice of the row
(`cu_seq_lens_q` marks them, the variable-length convention of Hugging Face's
flash-attention path). Attention then costs the sum of squared sequence lengths, not
the square of the packed length, and no [L, L] mask is built; a packed forward pass
computes what the padded one does without spending compute on padding.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface

PACKED_ATTENTION = "asyncrl_packed"


@dataclass
class Packed:
    input_ids: torch.Tensor  # [1, L] every real token of the batch, row after row
    position_ids: torch.Tensor  # [1, L] position inside its own sequence
    cu_seqlens: torch.Tensor  # [N+1] int32: sequence i is packed positions cu_seqlens[i]..cu_seqlens[i+1]-1
    index: torch.Tensor  # [N, T-1] packed position of each padded prediction position (0 where not valid)
    valid: torch.Tensor  # [N, T-1] True where the padded position predicts a token of its own sequence

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position values of the packed row, [L-1] (position p predicts token p+1) -> [N, T-1], 0 elsewhere."""
        return torch.where(self.valid, values[self.index], 0.0)  # [N, T-1]

    def model_inputs(self) -> dict:
        """Keyword arguments of a Hugging Face causal LM set to `PACKED_ATTENTION` (see `use_packed_attention`)."""
        return dict(input_ids=self.input_ids, position_ids=self.position_ids, cu_seq_lens_q=self.cu_seqlens)


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packed:
    """Pack right-padded rows ([N, T] ids and 0/1 mask) into one row."""
    n, width = input_ids.shape
    lengths = attention_mask.sum(-1)  # [N]
    starts = lengths.cumsum(0) - lengths  # [N] packed position of each sequence's first token
    sequence = torch.repeat_interleave(torch.arange(n, device=input_ids.device), lengths)  # [L] owner of each token
    positions = torch.arange(sequence.shape[0], device=input_ids.device) - starts[sequence]  # [L]
    offsets = torch.arange(width - 1, device=input_ids.device)  # [T-1]
    valid = offsets[None, :] < (lengths - 1)[:, None]  # [N, T-1]
    index = torch.where(valid, starts[:, None] + offsets[None, :], 0)  # [N, T-1]
    return Packed(
        input_ids=input_ids[attention_mask.bool()][None],  # [1, L]
        position_ids=positions[None],  # [1, L]
        cu_seqlens=F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32),  # [N+1]
        index=index,
        valid=valid,
    )


def per_sequence_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    cu_seq_lens_q=None,
    sliding_window=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA over each packed sequence alone: query [1, H, L, D], key/value [1, Hkv, L, D] -> [1, L, H, D]."""
    if cu_seq_lens_q is None:
        raise ValueError(f"attention {PACKED_ATTENTION!r} needs packed inputs (Packed.model_inputs())")
    if sliding_window is not None:
        raise NotImplementedError("packed attention with a sliding window is not implemented")
    bounds = cu_seq_lens_q.tolist()
    grouped = query.shape[1] != key.shape[1]
    parts = [
        F.scaled_dot_product_attention(
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
            enable_gqa=grouped,
        )  # [1, H, e-s, D]
        for s, e in itertools.pairwise(bounds)
    ]
    return torch.cat(parts, dim=2).transpose(1, 2), None  # [1, L, H, D]


AttentionInterface.register(PACKED_ATTENTION, per_sequence_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, lambda *args, **kwargs: None)  # sequences are the mask


def use_packed_attention(model: torch.nn.Module) -> None:
    """Switch a Hugging Face model to `PACKED_ATTENTION` (once; the trainer owns its models)."""
    if model.config._attn_implementation != PACKED_ATTENTION:
        model.set_attn_implementation(PACKED_ATTENTION)
