"""Embedded PyTorch inference engine for the rollout worker.

Continuous batching over a preallocated slot KV cache, on CPU or CUDA (the model's device):

    kv    : [2, layers, slots, kv_heads, capacity, head_dim], keys and values of every slot,
            allocated once (it grows, copying, only when a request needs a longer slot)
    slots : the running sequences; sequence i lives in slot i, and slots stay a dense prefix

Slot invariant: at a step boundary slot i's cache holds every token of its sequence but
the newest (positions 0..len-2). A step admits waiting requests into the free slots
after the running ones, then runs ONE forward over the weights: every running slot
feeds its newest token, written at that slot's own position and attending over
`kv[..., :span, :]` (a view up to the longest context of its run of slots, masked per
row), while the newcomers' whole contexts are prefilled from position 0 in the same pass,
packed (`Batch`).
It then samples one token per slot and retires finished sequences at once: the last
slot's sequence moves into the hole (one slot's cache copied), so no cache tensor is
concatenated, re-padded or re-sliced per step. A weight update loads in place and
marks for a full re-prefill (prompt + generated) in the next step's forward every
running sequence whose cache would lag the weights by more than `cache_lag` versions
(all of them at 0), so their next token comes from the new weights over a cache of
them; the others' next tokens come from the new weights over the cache they have.
Slots with the same whole context (a group's samples of one prompt; after an update, the
same answer so far) are computed once. The first is the leader; the others follow it from
the end of the slots, holding no cache and sampling from the leader's logits, and each
step's draws decide: a follower that drew what its leader drew still shares its context,
one that drew another token gets a copy of the leader's cache and decodes on its own (the
first of each new draw; the others that drew the same follow that one). A low-entropy
policy's group often decodes the same tokens for a while, or throughout (on chain's demo
model ~20 % of decode rows at 64 rows): those rows cost nothing but their sampling.

Slots are kept in descending length order where that is free: after an update every slot
is re-prefilled longest first, newcomers (the shortest) join at the end, and one decode
step lengthens every slot by one token. Only a retirement moves a (short) last slot into
the hole. Decode attention then runs over runs of neighbouring slots, each up to its own
longest context (`decode_runs`): with long-tailed lengths, attending every row up to the
longest one read ~5x the cache the rows' own contexts hold (measured on chain's demo model).

The forward. For the Llama family (Llama, Qwen2, Qwen3) the engine runs its own
forward over the HF model's own modules' parameters (embedding, q/k/v/o projections,
the model's rotary embedding tabulated per position, RMSNorm, gated MLP, LM head; a
small model's projections laid out fused, see DirectForward) as plain tensor ops on a
flat token batch, because a transformers Cache cannot serve decode and prefill rows of
different widths in one pass, and at rollout sizes a step is dominated by reading the
weights and by per-op overhead. Measured on the demo
model (2 cores, 1 thread), before the fused layout: the direct decode step took
0.6-0.75x the time of the HF forward over the same slot cache at 1-8 rows, 0.9x at 64
rows, and the long-tailed benchmark ran ~1.2x faster; the fused layout then made the direct
step 1.21x / 1.33x / 1.20x faster at 1 / 16 / 64 rows. Any other full-attention model goes through
its HF forward with `SlotCache` (a transformers Cache writing into the same slot
storage) and a per-row 4D mask: same scheduling and results, decode and prefill in
separate calls. `forward="hf"` forces that path (the tests run both).

Behaviour logprobs are log_softmax(logits / temperature) (plain log_softmax for
temperature 0) over the full vocabulary, taken from the same logits the sampler used
and *before* top-k/top-p filtering: they only restrict which token may be drawn. This
keeps π_behav a property of the policy at that temperature, which is what the trainer
recomputes as π_prox/π_θ, rather than of a truncated sampling distribution.

Top-k and top-p combine as in Hugging Face's warpers: keep the k most likely tokens,
then the smallest prefix of those whose renormalised mass reaches top_p.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from functools import partial
from itertools import accumulate

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from workers.models import avoid_cudnn_attention
from workers.rollout.protocol import EngineStats, SamplingParams, Sequence, check_request
from workers.weights import WeightsFile, load_into, read_verified

NO_TOP_K = torch.iinfo(torch.long).max  # a rank no token reaches
DIRECT_FAMILIES = {"llama", "qwen2", "qwen3"}  # pre-norm, rotary, gated MLP, RMSNorm; no sliding window
STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # frequencies independent of the sequence length
CAPACITY_STEP = 64  # slot capacity grows in multiples of this
PREFILL_SPREAD = 1.5  # a prefill chunk's longest row is at most this times its shortest (`prefill_cut`)
FUSE_BYTES = 64 << 20  # DirectForward lays decoder weights out fused up to this size (see there)
RUN_BLOCK = 4  # decode rows are cut into attention runs at multiples of this many slots (`decode_runs`)
SORT_WASTE = 1.6  # decoding slots are sorted again once blocks of them would attend this times their own columns


@dataclass
class Chunk:
    """Prefill rows that attend in one call: their contexts, packed in the batch's tokens, laid out right-padded to
    `width` (a padded position repeats its row's last token; it writes cache columns past the row's end, which the
    row's own later tokens overwrite before anything attends them, and its output is dropped)."""

    slots: slice  # the chunk's rows among the batch's slots
    width: int  # its longest context
    tokens: slice | torch.Tensor  # [rows*width], the batch token at each padded position
    valid: torch.Tensor | None  # [its tokens], their padded positions, in token order; None where none is padded


@dataclass
class Batch:
    """One forward's rows: `decode` slots feeding their newest token, then slots prefilled from position 0.

    Tokens are flat and packed: decode row i is token i; the prefill rows' whole contexts follow, one after
    the other, unpadded. Dense ops see only real tokens; prefill attention runs per `Chunk` of rows of
    similar lengths, padded there only.
    """

    kv: torch.Tensor  # [2, layers, rows, Hkv, C, D], the slots of these rows, in row order
    ids: torch.Tensor  # [N]
    pos: torch.Tensor  # [N], each token's position in its sequence
    out: torch.Tensor  # [rows], the token whose next-token logits each row returns
    decode: int  # decode rows (one token each)
    prefill: int  # prefill rows
    chunks: list[Chunk]  # the prefill rows, cut for attention
    span: int  # cache columns the decode rows attend: their longest context
    runs: list[tuple[int, int, int]]  # (first, end, span): decode rows first..end-1 attend `span` columns

    def decode_mask(self) -> torch.Tensor:
        """[Bd, 1, 1, span] bool: column j is visible to decode row i iff j <= its position."""
        return (torch.arange(self.span, device=self.pos.device) <= self.pos[: self.decode, None])[:, None, None]


Linear = tuple[torch.Tensor, torch.Tensor | None]  # weight [out, in] (maybe a transposed view), bias [out]


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer's tensors, gathered once: a module attribute lookup per step costs a fair part
    of an op."""

    attn_norm: torch.Tensor  # [H]
    qkv: list[Linear]  # one linear to [Hq*D + 2*Hkv*D], or q, k and v
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None  # [D] each, Qwen3's q and k norm weights
    o: Linear
    mlp_norm: torch.Tensor  # [H]
    gate_up: list[Linear]  # one linear to [2*I], or gate and up
    act: torch.nn.Module
    down: Linear


class DirectForward:
    """The Llama-family forward as plain tensor ops over the HF model's own parameters.

    Decode and prefill rows share every dense op (one weight read per layer per step);
    only attention is per kind. A small model's step is mostly per-op overhead, so where
    the layers' weights are at most FUSE_BYTES they are moved once into the layout that
    runs fastest: q/k/v and gate/up fused into one matmul each, every matrix input-major
    (x @ W.T from it is 1.1-1.7x faster on CPU for the demo model's matrices at 1-64
    rows; at 1 row it sums in another order than HF's layout, so logits may differ in
    the last bits). The modules' parameters become views into that layout (`fuse`), so
    every load into the model (the engine's, or an in-place `load_state_dict`) writes
    straight into what the forward reads: no copy to rebuild, none to go stale. The
    engine owns the model from then on: converting it (`.to(dtype)`) would cut the views.
    Larger models use their parameters as they are. Rotary turns q and k together; its
    table is the model's own rotary embedding evaluated once per position (hence
    STATIC_ROPE only).
    """

    def __init__(self, model):
        self.base, self.head = model.model, model.get_output_embeddings()
        attn = self.base.layers[0].self_attn
        self.head_dim, self.scale = attn.head_dim, attn.scaling
        self.heads = attn.q_proj.out_features // self.head_dim, attn.k_proj.out_features // self.head_dim  # Hq, Hkv
        self.eps = self.base.norm.variance_epsilon  # these families make every RMSNorm with the config's eps
        self.fused = sum(p.numel() * p.element_size() for p in self.base.layers.parameters()) <= FUSE_BYTES
        self.cos = self.sin = None  # [C, 1, D] each, sin signed so that rotate_half(x) * sin = x.roll(D/2) * sin
        self.head_rows = None  # [Hkv], each kv head's first row in a slot's cache flattened to [Hkv*C, D]
        with torch.no_grad():
            self.layers = [self.layer_weights(layer) for layer in self.base.layers]

    def layer_weights(self, layer) -> LayerWeights:
        """A decoder layer's tensors: fused input-major ones where `self.fused`, else the parameters as they are."""
        attn, mlp = layer.self_attn, layer.mlp

        def group(*linears: torch.nn.Linear) -> list[Linear]:
            return [fuse(linears)] if self.fused else [(m.weight, m.bias) for m in linears]

        qk_norm = None
        if hasattr(attn, "q_norm"):  # Qwen3 normalises each head's q and k before rotary
            qk_norm = attn.q_norm.weight, attn.k_norm.weight
        return LayerWeights(
            attn_norm=layer.input_layernorm.weight,
            qkv=group(attn.q_proj, attn.k_proj, attn.v_proj),
            qk_norm=qk_norm,
            o=group(attn.o_proj)[0],
            mlp_norm=layer.post_attention_layernorm.weight,
            gate_up=group(mlp.gate_proj, mlp.up_proj),
            act=mlp.act_fn,
            down=group(mlp.down_proj)[0],
        )

    def reserve(self, capacity: int) -> None:
        """Rotary table for positions 0..capacity-1."""
        pos = torch.arange(capacity, device=self.head.weight.device)[None]  # [1, C]
        cos, sin = self.base.rotary_emb(self.head.weight, pos)  # [1, C, D] each
        half = self.head_dim // 2
        self.cos = cos[0, :, None]  # [C, 1, D]
        self.sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)[:, None]  # [C, 1, D]
        self.head_rows = torch.arange(self.heads[1], device=pos.device) * capacity  # [Hkv]

    def __call__(self, batch: Batch) -> torch.Tensor:
        """Next-token logits [rows, V] of every row of `batch`."""
        d, (hq, hkv), n = self.head_dim, self.heads, len(batch.ids)
        x = F.embedding(batch.ids, self.base.embed_tokens.weight)  # [N, H]
        cos, sin = self.cos[batch.pos], self.sin[batch.pos]  # [N, 1, D]
        mask = at = None
        if batch.decode:
            visible = batch.decode_mask()  # [Bd, 1, 1, span]; made additive once, not by every layer's attention
            mask = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill_(~visible, -math.inf)
            rows = torch.arange(batch.decode, device=x.device) * (hkv * batch.kv.shape[-2])  # [Bd]
            at = (rows + batch.pos[: batch.decode])[:, None] + self.head_rows  # [Bd, Hkv], rows of [Bd*Hkv*C, D]
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w.attn_norm, self.eps)  # [N, H]
            qkv = linear(h, w.qkv).view(n, -1, d)  # [N, Hq+2*Hkv, D]
            qk, v = qkv[:, : hq + hkv], qkv[:, hq + hkv :]  # [N, Hq+Hkv, D], [N, Hkv, D]
            if w.qk_norm is not None:
                q_norm, k_norm = w.qk_norm  # [D] each, to q's heads and k's heads side by side: [Hq+Hkv, D]
                qk = rms_norm(qk, torch.cat([q_norm.expand(hq, -1), k_norm.expand(hkv, -1)]), self.eps)
            qk = qk * cos + qk.roll(d // 2, -1) * sin  # [N, Hq+Hkv, D], rotary
            o = self.attend(batch, i, qk[:, :hq], qk[:, hq:], v, mask, at)  # [N, Hq*D]
            x = x + F.linear(o, *w.o)  # [N, H]
            h = rms_norm(x, w.mlp_norm, self.eps)  # [N, H]
            gate, up = linear(h, w.gate_up).chunk(2, -1)  # [N, I] each
            x = x + F.linear(w.act(gate) * up, *w.down)  # [N, H]
        h = rms_norm(x[batch.out], self.base.norm.weight, self.eps)  # [rows, H]
        return F.linear(h, self.head.weight, self.head.bias).float()  # [rows, V]

    def attend(self, batch: Batch, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, at) -> torch.Tensor:
        """Layer i's attention output [N, Hq*D] for q [N, Hq, D], k and v [N, Hkv, D], caching k and v.

        Decode rows write their token at `at` ([Bd, Hkv], rows of their slots' cache flattened) and
        attend the cache up to `span` under `mask` ([Bd, 1, 1, span], additive); prefill rows attend
        their own tokens, causally.
        """
        d, bd, hkv = self.head_dim, batch.decode, self.heads[1]
        parts = []
        if bd:
            keys, values = batch.kv[0, i, :bd], batch.kv[1, i, :bd]  # [Bd, Hkv, C, D]
            keys.view(-1, d).index_put_((at,), k[:bd])  # [Bd, Hkv, D], each at its row's own position
            values.view(-1, d).index_put_((at,), v[:bd])
            grouped = q[:bd].view(bd, hkv, -1, d)  # [Bd, Hkv, Hq/Hkv, D], query heads under their kv head
            for first, end, span in batch.runs:  # each run of rows up to its own longest context
                o = F.scaled_dot_product_attention(
                    grouped[first:end],
                    keys[first:end, :, :span],  # [r, Hkv, span, D]
                    values[first:end, :, :span],
                    attn_mask=mask[first:end, ..., :span],  # [r, 1, 1, span]
                    scale=self.scale,
                )
                parts.append(o.reshape(end - first, -1))  # [r, Hq*D]
        for c in batch.chunks:
            b, t = c.slots.stop - c.slots.start, c.width
            qp = q[c.tokens].view(b, t, -1, d).transpose(1, 2)  # [b, Hq, T, D]
            kp = k[c.tokens].view(b, t, hkv, d).transpose(1, 2)  # [b, Hkv, T, D]
            vp = v[c.tokens].view(b, t, hkv, d).transpose(1, 2)  # [b, Hkv, T, D]
            batch.kv[0, i, c.slots, :, :t] = kp
            batch.kv[1, i, c.slots, :, :t] = vp
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=self.scale, enable_gqa=True)
            o = o.transpose(1, 2).reshape(b * t, -1)  # [b*T, Hq*D]
            parts.append(o if c.valid is None else o[c.valid])  # [its tokens, Hq*D]
        return parts[0] if len(parts) == 1 else torch.cat(parts)  # [N, Hq*D]


def decode_runs(positions: list[int], block: int = RUN_BLOCK, call_cost: int = 256) -> list[tuple[int, int, int]]:
    """Decode rows (their positions, in slot order) cut into runs of neighbouring rows, each attending up to its
    own longest context: [(first, end, span)], the cut with the fewest cache columns read (rows x span, summed)
    plus `call_cost` columns per run (an attention call's own cost). Runs start at multiples of `block` rows."""
    n = len(positions)
    spans = [max(positions[b : b + block]) + 1 for b in range(0, n, block)]  # each block's longest context
    cost, cut = [0] + [math.inf] * len(spans), [0] * (len(spans) + 1)  # best cost of blocks 0..j-1, its last run
    for j in range(1, len(spans) + 1):
        span = 0
        for i in range(j - 1, -1, -1):  # the last run is blocks i..j-1
            span = max(span, spans[i])
            total = cost[i] + (min(j * block, n) - i * block) * span + call_cost
            if total < cost[j]:
                cost[j], cut[j] = total, i
    runs, j = [], len(spans)
    while j:
        runs.append((cut[j] * block, min(j * block, n), max(spans[cut[j] : j])))
        j = cut[j]
    return runs[::-1]


def block_columns(positions: list[int], block: int = RUN_BLOCK) -> int:
    """Cache columns decode rows (their positions, in slot order) read in one run per `block` slots: how far the
    slot order is from longest first (sorted, it is about their own columns, sum(positions) + len(positions))."""
    return sum(
        len(rows) * (max(rows) + 1) for rows in (positions[b : b + block] for b in range(0, len(positions), block))
    )


def prefill_cut(lengths: list[int]) -> list[tuple[int, int]]:
    """Rows to prefill (their context lengths, longest first) cut into attention chunks [(first, end)] whose first
    (longest) row is at most PREFILL_SPREAD times each of theirs: padding each to its chunk's first stays bounded."""
    cut, first = [], 0
    for i, n in enumerate(lengths):
        if lengths[first] > PREFILL_SPREAD * n:
            cut.append((first, i))
            first = i
    return [*cut, (first, len(lengths))] if lengths else []


def fuse(linears: tuple[torch.nn.Linear, ...]) -> Linear:
    """One linear computing `linears` side by side, its weight stored input-major ([in, out], used transposed),
    each module's weight and bias re-made as a view into it: a load into a module is a load into the fused one."""
    weight = torch.cat([m.weight.t() for m in linears], 1)  # [in, out]
    bias = None
    if any(m.bias is not None for m in linears):  # a module without one reads zeros there
        zeros = partial(torch.zeros, dtype=weight.dtype, device=weight.device)
        bias = torch.cat([zeros(m.out_features) if m.bias is None else m.bias for m in linears])  # [out]
    start = 0
    for m in linears:
        end = start + m.out_features
        m.weight = torch.nn.Parameter(weight[:, start:end].t(), requires_grad=m.weight.requires_grad)  # [o, in]
        if m.bias is not None:
            m.bias = torch.nn.Parameter(bias[start:end], requires_grad=m.bias.requires_grad)  # [o]
        start = end
    return weight.t(), bias


def linear(x: torch.Tensor, parts: list[Linear]) -> torch.Tensor:
    """x through each linear of `parts`, their outputs side by side."""
    out = [F.linear(x, w, b) for w, b in parts]
    return out[0] if len(out) == 1 else torch.cat(out, -1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """An HF RMSNorm's computation: float32 statistics, the weight applied in the input dtype.

    In float32 that is one fused op with the weight (the same arithmetic, measured bit-equal).
    """
    if x.dtype == weight.dtype == torch.float32 and weight.shape == x.shape[-1:]:
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype) * weight


class SlotCache(Cache):
    """A transformers Cache over the engine's slot storage, for models without a direct forward.

    `update` writes each row's keys/values at that row's positions and hands attention
    the slot view up to `span`; the per-row 4D mask passed with it hides the rest.
    """

    def __init__(self):
        super().__init__(layers=[])
        self.kv: torch.Tensor | None = None  # [2, layers, b, Hkv, C, D], set per call
        self.pos: torch.Tensor | None = None  # [b, T]
        self.span = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.kv[0, layer_idx], self.kv[1, layer_idx]  # [b, Hkv, C, D]
        where = self.pos[:, None, :, None].expand_as(key_states)  # [b, Hkv, T, D]
        keys.scatter_(2, where, key_states)
        values.scatter_(2, where, value_states)
        return keys[:, :, : self.span], values[:, :, : self.span]  # [b, Hkv, span, D]


class HFForward:
    """Any full-attention HF causal LM, through its own forward with a SlotCache and a 4D mask.

    Decode rows and each prefill chunk go through separate model calls (their widths differ).
    """

    def __init__(self, model):
        config = model.config.get_text_config()
        if getattr(config, "final_logit_softcapping", None):
            raise NotImplementedError(f"{config.model_type}: final logit softcapping is not supported")
        self.base, self.head, self.cache = model.base_model, model.get_output_embeddings(), SlotCache()
        self.dtype = next(model.parameters()).dtype

    def reserve(self, capacity: int) -> None:
        pass  # positions come from position_ids

    def __call__(self, batch: Batch) -> torch.Tensor:
        """Next-token logits [rows, V] of every row of `batch`."""
        bd = batch.decode
        hidden = []  # [tokens, H] per call, in token order
        if bd:
            hidden.append(self.run(batch.kv[:, :, :bd], batch.ids[:bd, None], batch.pos[:bd, None], batch.span)[:, 0])
        for c in batch.chunks:
            b, t = c.slots.stop - c.slots.start, c.width
            pos = torch.arange(t, device=batch.pos.device).expand(b, t)  # [b, T], padding past each row's end
            out = self.run(batch.kv[:, :, c.slots], batch.ids[c.tokens].view(b, t), pos, t)  # [b, T, H]
            out = out.reshape(b * t, -1)  # [b*T, H]
            hidden.append(out if c.valid is None else out[c.valid])
        return self.head(torch.cat(hidden)[batch.out]).float()  # [rows, V]

    def run(self, kv: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        """Hidden states [b, T, H] of ids [b, T] at positions pos [b, T], cached in kv [2, layers, b, Hkv, C, D]."""
        self.cache.kv, self.cache.pos, self.cache.span = kv, pos, span
        visible = torch.arange(span, device=pos.device) <= pos[:, :, None]  # [b, T, span]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=pos.device)  # [b, T, span]
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        hidden = self.base(
            input_ids=ids, attention_mask=mask[:, None], position_ids=pos, past_key_values=self.cache, use_cache=True
        ).last_hidden_state  # [b, T, H]
        self.cache.kv = None  # the storage may be reallocated before the next call
        return hidden


def make_forward(model, forward: str) -> DirectForward | HFForward:
    """`auto`: the direct forward where the architecture is known to match it, else the HF one.

    Both attend every cached position, so models that attend a window only are refused.
    """
    if forward not in ("auto", "direct", "hf"):
        raise ValueError(f"forward must be auto, direct or hf, not {forward!r}")
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()) or (
        window is not None and window < getattr(config, "max_position_embeddings", window + 1)
    ):
        raise NotImplementedError(
            f"{config.model_type}: the slot cache supports full attention only, not sliding windows"
        )
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    direct = config.model_type in DIRECT_FAMILIES and rope in STATIC_ROPE
    if forward == "direct" and not direct:
        raise NotImplementedError(f"no direct forward for {config.model_type} (rope {rope}); use forward='hf'")
    return DirectForward(model) if direct and forward != "hf" else HFForward(model)


class Engine:
    """Continuous-batching generator with in-place weight updates: a `RolloutEngine` (workers.rollout.protocol).

    Not thread-safe: call it from one thread (the worker loop). It owns the model it is given: a small
    Llama-family model's weights are laid out anew (`fuse`), its parameters views into that layout.
    """

    def __init__(
        self,
        model,
        *,
        max_batch: int = 64,
        version: int = 0,
        seed: int | None = None,
        max_prefill_tokens: int = 16384,
        forward: str = "auto",
        cache_lag: int = 0,
    ):
        """`cache_lag`: versions a running sequence's cache may lag the weights before an update recomputes it
        (`update_weights`)."""
        self.model = model.eval()
        self.cache_lag = cache_lag
        self.device = next(model.parameters()).device
        avoid_cudnn_attention(self.device)  # every decode step has a new span
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens  # padded tokens per prefill forward
        config = model.config.get_text_config()
        self.max_len = getattr(config, "max_position_embeddings", None)
        self.vocab = model.get_input_embeddings().num_embeddings
        self.forward = make_forward(model, forward)
        heads = config.num_attention_heads
        self.kv_shape = (
            config.num_hidden_layers,
            getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads,
        )
        self.kv: torch.Tensor | None = None  # [2, layers, max_batch, Hkv, C, D], allocated on first admission
        self.version = version
        self.generator = None
        if seed is not None:
            self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.waiting: deque[Sequence] = deque()
        self.slots: list[Sequence] = []  # slot i of the cache and row i of the sampling tensors below
        # slots: [decoding | to prefill | followers]; decoding ones have all but their newest token cached, the
        # last len(leads) follow a decoding one with the same whole context and hold no cache
        self.decoding = 0
        self.leads: dict[str, Sequence] = {}  # follower key -> the decoding sequence whose row it shares
        self.cached_at: dict[str, int] = {}  # decoding key -> version of the weights its oldest cache entries are of
        self.greedy: torch.Tensor | None = None  # [B], rows at temperature 0: they take the argmax
        self.temperature: torch.Tensor | None = None  # [B, 1], what logits are divided by (1 for greedy rows)
        self.top_p: torch.Tensor | None = None  # [B]
        self.top_k: torch.Tensor | None = None  # [B], NO_TOP_K where off
        self.any_greedy = self.any_random = self.any_filter = False  # skip sampling work the batch does not need
        self.slots_changed = False  # the per-slot sampling tensors need a rebuild
        self.generated_tokens = self.weight_updates = self.interrupted = 0  # for stats()

    # ---- RolloutEngine ----

    def submit(self, key: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request; it joins the batch at the next step with room."""
        check_request(prompt_ids, params, self.max_len, self.vocab)
        if any(s.key == key for s in self.running()):
            raise ValueError(f"sequence {key!r} is already in the engine")
        seq = Sequence(key, list(prompt_ids), params)
        self.waiting.append(seq)
        return seq

    def running(self) -> list[Sequence]:
        """Unfinished sequences, admitted first, then waiting."""
        return self.slots + list(self.waiting)

    def idle(self) -> bool:
        return not self.slots and not self.waiting

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Admit waiting requests into free slots, then produce one token per running sequence.

        One forward feeds every running sequence's newest token and prefills the
        newcomers (and, after a weight update, re-prefills everyone). Returns the
        sequences that finished in this step; they have left the engine.
        """
        self._admit()
        if not self.slots:
            return []
        logits = self._forward()  # [B, V]
        tokens, logprobs = self._sample(logits)  # [B], [B]
        self.generated_tokens += len(self.slots)
        for seq, tok, lp in zip(self.slots, tokens.tolist(), logprobs.tolist(), strict=True):
            seq.token_ids.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(self.version)
            if tok in seq.params.stop_token_ids:
                seq.finish_reason = "stop"
            elif len(seq.token_ids) >= seq.params.max_new_tokens or (self.max_len and len(seq) >= self.max_len):
                seq.finish_reason = "length"
        self._part()
        finished = [i for i, seq in enumerate(self.slots) if seq.finish_reason]
        done = [self.slots[i] for i in finished]
        for i in reversed(finished):  # descending, so the slot moved into a hole is never a finished one
            self._free(i)
        return done

    def interrupt(self) -> list[Sequence]:
        """Every unfinished sequence as it stands. Nothing runs between steps, so there is nothing to stop:
        the caches stay valid for the current weights, and update_weights marks them for recomputation."""
        seqs = self.running()
        self.interrupted += len(seqs)
        return seqs

    def update_weights(self, weights: WeightsFile) -> None:
        """Load a version in place; the next step recomputes the cache of every running sequence whose cache
        would lag the weights by more than `cache_lag` versions.

        Tokens already generated keep their old version; the next token is sampled from
        logits of the new weights. With `cache_lag` 0 (AReaL) they attend a cache of the
        whole sequence under the new weights: every running sequence is re-prefilled,
        which on a CPU costs ~25 decode steps of 64 rows. Otherwise a sequence keeps the
        cache older weights made while its oldest entries are at most `cache_lag` versions
        back, and only what comes next is computed with the new ones (an in-flight update,
        as PipelineRL's when the lag is unbounded): most sequences of a long-tailed task end
        before they are recomputed once. Each token's logprob is the one it was sampled
        with either way. A missing file raises FileNotFoundError before anything changed.
        """
        load_into(self.model, read_verified(weights))  # outside inference mode: parameters stay normal tensors
        self.version = weights.version
        self.weight_updates += 1
        stale = [seq for seq in self.slots[: self.decoding] if self.version - self.cached_at[seq.key] > self.cache_lag]
        if stale:
            self._recompute(stale)

    @torch.inference_mode()  # the slot cache was made in step()'s inference mode
    def _recompute(self, stale: list[Sequence]) -> None:
        """Move the `stale` decoding sequences, and their followers, to the slots to prefill (longest first, for
        tight chunks; the prefill finds shared contexts again), the others' caches into the first slots."""
        redo = {id(seq) for seq in stale}
        kept = [i for i, seq in enumerate(self.slots[: self.decoding]) if id(seq) not in redo]
        self._move_caches(kept)
        end = len(self.slots) - len(self.leads)
        followers = self.slots[end:]
        orphans = [seq for seq in followers if id(self.leads[seq.key]) in redo]
        for seq in stale:
            del self.cached_at[seq.key]
        for seq in orphans:
            del self.leads[seq.key]
        prefill = sorted(stale + orphans + self.slots[self.decoding : end], key=len, reverse=True)
        following = [seq for seq in followers if seq.key in self.leads]
        self.slots = [self.slots[i] for i in kept] + prefill + following
        self.decoding = len(kept)
        self.slots_changed = True

    @torch.inference_mode()  # the slot cache was made in step()'s inference mode, and _free may copy in it
    def abort(self, key: str) -> Sequence | None:
        """Drop one unfinished sequence: its slot is refilled at the next step."""
        for seq in self.slots:
            if seq.key == key:
                self._part(gone=seq)
                self._free(next(i for i, s in enumerate(self.slots) if s is seq))
                return seq
        for i, seq in enumerate(self.waiting):
            if seq.key == key:
                del self.waiting[i]
                return seq
        return None

    def stats(self) -> EngineStats:
        return EngineStats(
            version=self.version,
            running=len(self.slots) + len(self.waiting),
            queued=len(self.waiting),
            capacity=self.max_batch,
            generated_tokens=self.generated_tokens,
            weight_updates=self.weight_updates,
            interrupted=self.interrupted,
            prefilling=len(self.slots) - self.decoding - len(self.leads),
        )

    def close(self) -> None:
        """Nothing to release: the model and the caches go with the engine."""

    # ---- slots ----

    def _admit(self) -> None:
        """Move waiting requests into the free slots after the decoding ones.

        Slots still to prefill hold no cache yet, so they are kept in descending length
        order: each prefill chunk then pads only to its first row.
        """
        room = self.max_batch - len(self.slots)
        if room <= 0 or not self.waiting:
            return
        new = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        self._reserve(max(len(s.prompt_ids) + s.params.max_new_tokens for s in new))
        end = len(self.slots) - len(self.leads)  # the followers stay last
        self.slots[self.decoding : end] = sorted(self.slots[self.decoding : end] + new, key=len, reverse=True)
        self.slots_changed = True

    def _reserve(self, need: int) -> None:
        """Make every slot hold `need` positions (capped at the model's), keeping what is cached."""
        if self.max_len is not None:
            need = min(need, self.max_len)
        capacity = 0 if self.kv is None else self.kv.shape[-2]
        if need <= capacity:
            return
        capacity = max(need, 2 * capacity)
        capacity = math.ceil(capacity / CAPACITY_STEP) * CAPACITY_STEP
        if self.max_len is not None:
            capacity = min(capacity, self.max_len)
        layers, kv_heads, head_dim = self.kv_shape
        kv = torch.zeros(
            2, layers, self.max_batch, kv_heads, capacity, head_dim, dtype=self.model.dtype, device=self.device
        )  # [2, layers, slots, Hkv, C, D]
        if self.kv is not None:
            kv[..., : self.kv.shape[-2], :] = self.kv
        self.kv = kv
        self.forward.reserve(capacity)

    def _free(self, i: int) -> None:
        """Retire the sequence in slot i, keeping the slots dense and the slot invariant.

        A cached slot takes the last cached slot's sequence and cache. Slots still to
        prefill (after admission or a weight update) and followers hold no cache, and the
        former keep their descending length order, which the prefill chunks rely on.
        """
        if i >= self.decoding:
            self.leads.pop(self.slots[i].key, None)
            del self.slots[i]
        else:
            del self.cached_at[self.slots[i].key]
            last = self.decoding - 1
            if i < last:
                cached = len(self.slots[last]) - 1  # its newest token is fed by the next step's forward
                self.kv[:, :, i, :, :cached] = self.kv[:, :, last, :, :cached]  # [2, layers, Hkv, n, D]
                self.slots[i] = self.slots[last]
            del self.slots[last]
            self.decoding -= 1
        self.slots_changed = True

    # ---- model calls ----

    def _forward(self) -> torch.Tensor:
        """Decode slots 0..decoding-1, prefill the ones up to the followers (whole context); next-token logits
        [B, V], a follower's its leader's.

        The decode rows and every context to prefill go through one forward, packed (no padding in the dense
        ops; attention per chunk of similar lengths, `prefill_cut`), unless their padded tokens exceed
        max_prefill_tokens: then the contexts are split over several forwards, the decode rows riding with the
        first. A context to prefill that another slot prefills too (a group's samples of one prompt, or the same
        answer so far) is not computed again: its slot follows that one (`_share_contexts`).
        """
        self._sort_decoding()
        self._share_contexts()
        computed = len(self.slots) - len(self.leads)
        lengths = [len(seq) for seq in self.slots[self.decoding : computed]]
        padded = [lengths[first] for first, end in prefill_cut(lengths) for _ in range(first, end)]  # per row
        logits, start = [], self.decoding
        while start < computed or not logits:
            end, tokens = start, 0  # grow the forward while its padded tokens fit the budget
            while end < computed and tokens + padded[end - self.decoding] <= self.max_prefill_tokens:
                tokens += padded[end - self.decoding]
                end += 1
            end = max(end, min(start + 1, computed))  # a context longer than the budget goes alone
            decode = self.decoding if not logits else 0
            logits.append(self.forward(self._batch(start - decode, start, end)))
            start = end
        for seq in self.slots[self.decoding : computed]:
            self.cached_at[seq.key] = self.version
        self.decoding = computed
        logits = logits[0] if len(logits) == 1 else torch.cat(logits)  # [computed, V]
        if not self.leads:
            return logits
        row = {id(seq): i for i, seq in enumerate(self.slots[:computed])}
        return torch.cat([logits, logits[[row[id(self.leads[seq.key])] for seq in self.slots[computed:]]]])  # [B, V]

    def _sort_decoding(self) -> None:
        """Sort the decoding slots longest first again once retirements have mixed them up so far that blocks of
        them would attend SORT_WASTE times their own cache columns; the moved slots' caches move with them.

        Measured on chain's long tail at 64 rows without weight updates (2 CPU cores): without it the decode cut
        read 2.3x the rows' own columns and attention took a third of a step; re-sorting (~3 ms, every ~8 steps)
        cut that to ~1.4x and made decoding 11-20 % faster.
        """
        cached = [len(seq) - 1 for seq in self.slots[: self.decoding]]  # positions 0..len-2 of each are cached
        if block_columns(cached) <= SORT_WASTE * (sum(cached) + len(cached)):
            return
        order = sorted(range(len(cached)), key=lambda j: -cached[j])  # stable: equal lengths stay put
        if order == sorted(order):
            return
        self._move_caches(order)
        self.slots[: len(order)] = [self.slots[source] for source in order]
        self.slots_changed = True

    def _move_caches(self, order: list[int]) -> None:
        """Slot k takes the cache of decoding slot order[k] (all but its newest token)."""
        moved = [(slot, source) for slot, source in enumerate(order) if slot != source]
        caches = [self.kv[:, :, source, :, : len(self.slots[source]) - 1].clone() for _, source in moved]
        for (slot, _), cache in zip(moved, caches, strict=True):  # [2, layers, Hkv, n, D]
            self.kv[:, :, slot, :, : cache.shape[-2]] = cache

    def _share_contexts(self) -> None:
        """Make every slot to prefill whose whole context another one to prefill has too a follower of the first
        such slot (the others keep their descending lengths)."""
        end = len(self.slots) - len(self.leads)
        first: dict[tuple[int, ...], Sequence] = {}
        unique, again = [], []
        for seq in self.slots[self.decoding : end]:
            context = (*seq.prompt_ids, *seq.token_ids)
            if context in first:
                self.leads[seq.key] = first[context]
                again.append(seq)
            else:
                first[context] = seq
                unique.append(seq)
        if again:
            self.slots[self.decoding : end] = unique + again  # `again` joins the followers
            self.slots_changed = True

    def _part(self, gone: Sequence | None = None) -> None:
        """Followers whose newest token differs from their leader's, or whose leader ended (or is `gone`) without
        them, decode on their own from now on: the first of each such draw with a copy of the leader's cache (their
        contexts agree up to that token), the others that drew the same following it."""
        if not self.leads:
            return
        slot = {id(seq): i for i, seq in enumerate(self.slots[: self.decoding])}
        heads: dict[tuple[int, int], Sequence] = {}  # (leader, token) -> the follower promoted for that draw
        for seq in self.slots[self.decoding :]:  # a copy: promotions move followers
            leader = self.leads.get(seq.key)
            if leader is None or seq.finish_reason:  # a slot to prefill, or a follower ending with its leader
                continue
            ended = leader.finish_reason or leader is gone
            if not ended and leader.token_ids[-1:] == seq.token_ids[-1:]:
                continue
            draw = (id(leader), seq.token_ids[-1] if seq.token_ids else -1)
            if draw in heads:
                self.leads[seq.key] = heads[draw]
                continue
            del self.leads[seq.key]
            heads[draw] = seq
            j = next(i for i in range(self.decoding, len(self.slots)) if self.slots[i] is seq)
            d, cached = self.decoding, len(seq) - 1
            self.slots.insert(d, self.slots.pop(j))  # slots still to prefill (after an update) keep their order
            self.kv[:, :, d, :, :cached] = self.kv[:, :, slot[id(leader)], :, :cached]  # [2, layers, Hkv, n, D]
            self.cached_at[seq.key] = self.cached_at[leader.key]
            self.decoding += 1
            self.slots_changed = True

    def _batch(self, first: int, prefill: int, end: int) -> Batch:
        """Slots first..prefill-1 decode their newest token; slots prefill..end-1 feed their whole context."""
        decode, news = self.slots[first:prefill], self.slots[prefill:end]
        ids = [s.token_ids[-1] for s in decode]
        pos = [len(s) - 1 for s in decode]
        out = list(range(len(decode)))
        for seq in news:
            ids += seq.prompt_ids + seq.token_ids
            pos += range(len(seq))
            out.append(len(ids) - 1)
        return Batch(
            kv=self.kv[:, :, first:end],
            ids=torch.tensor(ids, device=self.device),
            pos=torch.tensor(pos, device=self.device),
            out=torch.tensor(out, device=self.device),
            decode=len(decode),
            prefill=len(news),
            chunks=self._chunks([len(seq) for seq in news], len(decode)),
            span=max(pos[: len(decode)], default=-1) + 1,
            runs=decode_runs(pos[: len(decode)]),
        )

    def _chunks(self, lengths: list[int], decode: int) -> list[Chunk]:
        """The prefill rows (their context lengths, longest first), packed after `decode` one-token rows, as
        attention chunks."""
        chunks, token = [], decode  # the chunk's first token in the batch
        for first, end in prefill_cut(lengths):
            rows, width = lengths[first:end], lengths[first]
            tokens, valid = slice(token, token + width * len(rows)), None
            if any(n < width for n in rows):
                starts = accumulate(rows[:-1], initial=token)  # each row's first token
                tokens = [start + min(j, n - 1) for start, n in zip(starts, rows, strict=True) for j in range(width)]
                valid = [r * width + j for r, n in enumerate(rows) for j in range(n)]
                tokens, valid = torch.tensor(tokens, device=self.device), torch.tensor(valid, device=self.device)
            chunks.append(Chunk(slice(decode + first, decode + end), width, tokens, valid))
            token += sum(rows)
        return chunks

    def _sampling_tensors(self) -> None:
        """Per-slot sampling settings as device tensors, rebuilt only when the slots change."""
        temperature = torch.tensor([s.params.temperature for s in self.slots])  # [B], on the CPU
        greedy = temperature == 0  # [B], also where a tiny temperature rounds to 0
        self.any_greedy = bool(greedy.any())
        self.greedy = greedy.to(self.device)  # [B]
        self.temperature = torch.where(greedy, 1.0, temperature)[:, None].to(self.device)  # [B, 1]
        self.top_p = torch.tensor([s.params.top_p for s in self.slots], device=self.device)  # [B]
        self.top_k = torch.tensor([s.params.top_k or NO_TOP_K for s in self.slots], device=self.device)  # [B]
        self.any_random = any(s.params.temperature > 0 for s in self.slots)
        self.any_filter = any(
            s.params.temperature > 0 and (s.params.top_p < 1 or s.params.top_k > 0) for s in self.slots
        )
        self.slots_changed = False

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per slot from logits [B, V]; return it with its behaviour logprob (see module doc)."""
        if self.slots_changed:
            self._sampling_tensors()
        logp = torch.log_softmax(logits / self.temperature, dim=-1)  # [B, V]
        tokens = logits.argmax(-1) if self.any_greedy else None  # [B]
        if self.any_random:
            allowed = logp
            if self.any_filter:
                sorted_logp, order = logp.sort(-1, descending=True)  # [B, V]
                rank = torch.arange(logp.shape[-1], device=self.device)  # [V]
                beyond_k = rank >= self.top_k[:, None]  # [B, V], exactly k candidates even under ties
                probs = sorted_logp.exp().masked_fill(beyond_k, 0.0)  # [B, V]
                cum = probs.cumsum(-1)  # [B, V]
                before = (cum - probs) / cum[:, -1:]  # [B, V], renormalised top-k mass ranked above it
                # [B, V]; top_p=1 must never cut, even where rounding pushes `before` to 1
                beyond_p = (before >= self.top_p[:, None]) & (self.top_p[:, None] < 1)
                outside = beyond_k | beyond_p  # [B, V]
                outside = torch.empty_like(outside).scatter_(-1, order, outside)  # [B, V], back to vocab order
                allowed = logp.masked_fill(outside, float("-inf"))  # [B, V]
            drawn = torch.multinomial(allowed.exp(), 1, generator=self.generator).squeeze(-1)  # [B]
            tokens = torch.where(self.greedy, tokens, drawn) if self.any_greedy else drawn  # [B]
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)  # [B], [B]
