"""Padding-free packing: the rows of a right-padded batch laid end to end in one row.

Each sequence keeps its own positions (restarting at 0) and attends only to its own
earlier tokens: the packed row goes through the model with attention registered as
`PACKED_ATTENTION` (`cu_seq_lens_q` marks the segments, the variable-length convention
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

Shared prompts: GRPO samples each prompt n times, so most rows of a batch repeat their
group's prompt. Given the prompt lengths, rows with the same prompt tokens share one copy:
the prompt is packed once as a segment of its own, and each row's completion follows as a
segment that attends to that prompt and causally to itself (`segment_parents`), its
positions going on from the prompt's. Every logit is the one the row alone would give (up
to float rounding), the prompt's forward and backward run once instead of n times (arith:
6 prompt tokens, 3-token answers, 8 samples: a group packs in 30 positions instead of 72).
A low-entropy policy often samples the same answer several times: rows that repeat another
row of their group whole point at its packed positions and add none, and the gradients of
both flow back through the one copy (their advantages and behaviour logprobs stay their own).
"""

from __future__ import annotations

import bisect
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
    input_ids: torch.Tensor  # [1, L] every real token of the batch, shared prompts once
    position_ids: torch.Tensor  # [1, L] position inside its own sequence (a shared prompt's completions go on from it)
    cu_seqlens: torch.Tensor  # [S+1] int32: segment i is packed positions cu_seqlens[i]..cu_seqlens[i+1]-1
    parents: list[int]  # [S] the segment whose tokens segment i also attends to (its shared prompt), -1 for none
    index: torch.Tensor  # [N, T-1] packed position predicting each padded position's next token (0 where not valid)
    targets: torch.Tensor  # [N, T-1] that next token
    valid: torch.Tensor  # [N, T-1] True where the padded position predicts a token of its own sequence

    def model_inputs(self) -> dict:
        """Keyword arguments of a Hugging Face causal LM set to `PACKED_ATTENTION` (see `use_packed_attention`)."""
        return dict(
            input_ids=self.input_ids,
            position_ids=self.position_ids,
            cu_seq_lens_q=self.cu_seqlens,
            segment_parents=self.parents,
        )


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor | None = None) -> Packed:
    """Pack right-padded rows ([N, T] ids and 0/1 mask) into one row; with `prompt_lengths` ([N]), rows whose
    prompts are the same tokens share one copy of it (see the module's docstring)."""
    n, width = input_ids.shape
    lengths = attention_mask.sum(-1).tolist()
    prompts = [0] * n if prompt_lengths is None else prompt_lengths.tolist()
    sharing: dict[tuple, list[int]] = {}  # prompt tokens -> rows with a completion after them
    host_ids = input_ids.tolist() if prompt_lengths is not None else []  # one copy from the device, not one per row
    for row in range(n):
        if 0 < prompts[row] < lengths[row]:
            sharing.setdefault(tuple(host_ids[row][: prompts[row]]), []).append(row)
    family = {rows[0]: rows for rows in sharing.values() if len(rows) > 1}  # first row -> the rows sharing
    shared = {row for rows in family.values() for row in rows}
    pieces, positions, bounds, parents = [], [], [0], []
    starts = [[0, 0] for _ in range(n)]  # per row: packed start of its prompt part, and of the rest (- prompt length)

    def segment(row: int, begin: int, end: int, parent: int) -> int:
        pieces.append(input_ids[row, begin:end])
        positions.append(torch.arange(begin, end, device=input_ids.device))
        bounds.append(bounds[-1] + end - begin)
        parents.append(parent)
        return bounds[-2]

    for row in range(n):
        if row in family:
            prompt = len(parents)
            shared_start = segment(row, 0, prompts[row], -1)
            answers: dict[tuple, list[int]] = {}  # completion tokens -> the packed starts of the first row with them
            for member in family[row]:
                answer = tuple(host_ids[member][prompts[row] : lengths[member]])
                if answer not in answers:
                    answers[answer] = [
                        shared_start,
                        segment(member, prompts[row], lengths[member], prompt) - prompts[row],
                    ]
                starts[member] = answers[answer]
        elif row not in shared:
            start = segment(row, 0, lengths[row], -1)
            starts[row], prompts[row] = [start, start], lengths[row]
    offsets = torch.arange(width - 1, device=input_ids.device)  # [T-1]
    valid = offsets[None, :] < (torch.tensor(lengths, device=input_ids.device) - 1)[:, None]  # [N, T-1]
    begin = torch.tensor(starts, device=input_ids.device)  # [N, 2]
    in_prompt = offsets[None, :] < torch.tensor(prompts, device=input_ids.device)[:, None]  # [N, T-1]
    index = torch.where(in_prompt, begin[:, :1], begin[:, 1:]) + offsets[None, :]  # [N, T-1]
    return Packed(
        input_ids=torch.cat(pieces)[None],  # [1, L]
        position_ids=torch.cat(positions)[None],  # [1, L]
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=input_ids.device),  # [S+1]
        parents=parents,
        index=torch.where(valid, index, 0),
        targets=input_ids[:, 1:],
        valid=valid,
    )


def chunks(bounds: list[int], limit: int, parents: list[int] | None = None) -> list[list[int]]:
    """The segment bounds (cu_seqlens) cut into runs of consecutive segments spanning at most `limit` positions
    each (a longer sequence makes a run of its own; a shared prompt and the completions after it, whose
    `parents` name it, are one sequence here): each run's bounds, first to last."""
    roots = [b for i, b in enumerate(bounds[:-1]) if parents is None or parents[i] < 0]
    runs = [[bounds[0]]]
    for end in [*roots[1:], bounds[-1]]:
        if end - runs[-1][0] > limit and len(runs[-1]) > 1:
            runs.append([runs[-1][-1]])
        runs[-1].append(end)
    return [bounds[bisect.bisect_left(bounds, run[0]) : bisect.bisect_right(bounds, run[-1])] for run in runs]


def block_causal_mask(run: list[int], device: torch.device, parents: list[int] | None = None) -> torch.Tensor:
    """[n, n] True where position i may attend to j: j <= i in the same segment of the run, or j in the segment
    `parents` names for i's (indices into the run's segments, -1 for none)."""
    lengths = torch.tensor(run, device=device).diff()  # [S]
    owner = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)  # [n]
    order = torch.arange(run[-1] - run[0], device=device)  # [n]
    allowed = (owner[:, None] == owner[None, :]) & (order[None, :] <= order[:, None])  # [n, n]
    if parents is not None and max(parents) >= 0:
        parent = torch.tensor(parents, device=device)[owner]  # [n] the segment each position's own continues
        allowed |= parent[:, None] == owner[None, :]
    return allowed


def chunked_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    cu_seq_lens_q=None,
    segment_parents=None,
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
    bounds = cu_seq_lens_q.tolist()
    parents = segment_parents or [-1] * (len(bounds) - 1)
    parts, first = [], 0  # first: the index of the run's first segment
    with torch.autocast("cpu", enabled=False) if on_cpu else contextlib.nullcontext():
        for run in chunks(bounds, CHUNK_TOKENS, parents):
            own = [p - first if p >= 0 else -1 for p in parents[first : first + len(run) - 1]]
            parts.append(attend(query, key, value, run, own, dropout, scaling, grouped))
            first += len(run) - 1
    return torch.cat(parts, dim=2).to(dtype).transpose(1, 2), None  # [1, L, H, D]


def attend(query, key, value, run: list[int], parents, dropout: float, scale: float | None, grouped: bool):
    """Causal SDPA within each segment of a run of them (and into its parent's), packed positions
    run[0]..run[-1]: [1, H, n, D]."""
    s, e = run[0], run[-1]
    one = len(run) == 2  # a single sequence: plain causal attention, no mask
    key, value = key[:, :, s:e], value[:, :, s:e]  # [1, Hkv, n, D]
    if grouped and not one and query.device.type == "cuda":
        # with a mask, CUDA's SDPA has no grouped-query kernel but its float32 math one: heads repeated instead
        key, value = (t.repeat_interleave(query.shape[1] // t.shape[1], dim=1) for t in (key, value))  # [1, H, n, D]
        grouped = False
    return F.scaled_dot_product_attention(
        query[:, :, s:e],
        key,
        value,
        attn_mask=None if one else block_causal_mask(run, query.device, parents),
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
