"""Padding-free packing: the rows of a right-padded batch laid end to end in one row.

Each sequence keeps its own positions (restarting at 0) and attends only to its own
earlier tokens: the packed row goes through the model with attention registered as
`PACKED_ATTENTION` (`cu_seq_lens_q` marks the sequences, the variable-length convention
of Hugging Face's flash-attention path). Neighbouring short sequences are attended
together, in chunks of up to CHUNK_TOKENS packed positions, by one SDPA call with a
block-diagonal causal mask; a longer sequence alone, by causal SDPA without a mask.
Attention then costs at most the sum of squared chunk lengths, never the square of the
packed length, and no [L, L] mask is built; one call per chunk rather than per sequence
matters where sequences are short (64 arith rows of ~9 tokens: 5 calls per layer, not 64,
and the step's forward and backward pass 1.2x faster on a CPU core). On a CPU, attention
runs in float32 under bfloat16 autocast: there bfloat16 SDPA is slow (its backward was the
slowest op of the step) and coarse, while the matmuls gain from bfloat16. A packed pass
computes what the padded one does without spending compute on padding.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface

from workers.models import avoid_cudnn_attention

PACKED_ATTENTION = "asyncrl_packed"
CHUNK_TOKENS = 128  # packed positions attended by one call: wasted masked work (~len^2) against per-call overhead


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


def chunks(bounds: list[int], limit: int) -> list[list[int]]:
    """The sequence bounds (cu_seqlens) cut into runs of consecutive sequences spanning at most `limit` positions
    each (a longer sequence makes a run of its own): each run's bounds, first to last."""
    runs = [[bounds[0]]]
    for end in bounds[1:]:
        if end - runs[-1][0] > limit and len(runs[-1]) > 1:
            runs.append([runs[-1][-1]])
        runs[-1].append(end)
    return runs


def block_causal_mask(run: list[int], device: torch.device) -> torch.Tensor:
    """[n, n] True where position i may attend to j: both in the same sequence of the run, j <= i."""
    lengths = torch.tensor(run, device=device).diff()  # [S]
    owner = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)  # [n]
    order = torch.arange(run[-1] - run[0], device=device)  # [n]
    return (owner[:, None] == owner[None, :]) & (order[None, :] <= order[:, None])  # [n, n]


def chunked_attention(
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
    """Causal SDPA within each packed sequence, a chunk of sequences per call (`chunks`):
    query [1, H, L, D], key/value [1, Hkv, L, D] -> [1, L, H, D]."""
    if cu_seq_lens_q is None:
        raise ValueError(f"attention {PACKED_ATTENTION!r} needs packed inputs (Packed.model_inputs())")
    if sliding_window is not None:
        raise NotImplementedError("packed attention with a sliding window is not implemented")
    grouped, dtype, on_cpu = query.shape[1] != key.shape[1], query.dtype, query.device.type == "cpu"
    if on_cpu:  # float32 (see above), and no autocast to cast it back; on a GPU bfloat16 is the fast kernel
        query, key, value = query.float(), key.float(), value.float()
    with torch.autocast("cpu", enabled=False) if on_cpu else contextlib.nullcontext():
        parts = [
            attend(query, key, value, run, dropout, scaling, grouped)
            for run in chunks(cu_seq_lens_q.tolist(), CHUNK_TOKENS)
        ]
    return torch.cat(parts, dim=2).to(dtype).transpose(1, 2), None  # [1, L, H, D]


def attend(query, key, value, run: list[int], dropout: float, scale: float | None, grouped: bool) -> torch.Tensor:
    """Causal SDPA within each sequence of a run of them, packed positions run[0]..run[-1]: [1, H, n, D]."""
    s, e = run[0], run[-1]
    one = len(run) == 2  # a single sequence: plain causal attention, no mask
    return F.scaled_dot_product_attention(
        query[:, :, s:e],
        key[:, :, s:e],
        value[:, :, s:e],
        attn_mask=None if one else block_causal_mask(run, query.device),
        dropout_p=dropout,
        is_causal=one,
        scale=scale,
        enable_gqa=grouped,
    )


AttentionInterface.register(PACKED_ATTENTION, chunked_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, lambda *args, **kwargs: None)  # sequences are the mask


def use_packed_attention(model: torch.nn.Module) -> None:
    """Switch a Hugging Face model to `PACKED_ATTENTION` (once; the trainer owns its models)."""
    if model.config._attn_implementation != PACKED_ATTENTION:
        avoid_cudnn_attention(next(model.parameters()).device)  # every packed row has new sequence lengths
        model.set_attn_implementation(PACKED_ATTENTION)
