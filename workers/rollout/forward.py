"""The rollout engine's forward: next-token logits of one packed `Batch` of slots, over the slot KV cache.

For the Llama family (Llama, Qwen2, Qwen3) `DirectForward` runs its own forward over the HF model's own
modules' parameters (embedding, q/k/v/o projections, the model's rotary embedding tabulated per position,
RMSNorm, gated MLP, LM head; a small model's projections laid out fused, see DirectForward) as plain tensor
ops on a flat token batch, because a transformers Cache cannot serve decode and prefill rows of different
widths in one pass, and at rollout sizes a step is dominated by reading the weights and by per-op overhead.
Measured on the demo model, 2 cores (Intel Xeon), 1 thread (2026-11-22 and 2026-11-24): the direct decode
step unfused took 0.6-0.75x the time of the HF forward over the same slot cache at 1-8 rows and 0.9x at 64
rows (the long-tailed benchmark ran ~1.2x faster), and the fused layout makes it 1.21x / 1.33x / 1.20x
faster again at 1 / 16 / 64 rows. Any other full-attention model goes through its HF forward (`HFForward`)
with `SlotCache` (a transformers Cache writing into the same slot storage) and a per-row 4D mask: same
scheduling and results, decode and prefill in separate calls. `forward="hf"` forces that path (the tests
run both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

DIRECT_FAMILIES = {"llama", "qwen2", "qwen3"}  # pre-norm, rotary, gated MLP, RMSNorm; no sliding window
STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # frequencies independent of the sequence length
INPUT_MAJOR_BYTES = 64 << 20  # float32 decoder weights up to this size are laid out input-major (DirectForward)


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
    qkv: Linear  # q, k and v side by side: to [Hq*D + 2*Hkv*D]
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None  # [D] each, Qwen3's q and k norm weights
    o: Linear
    mlp_norm: torch.Tensor  # [H]
    gate_up: Linear  # gate and up side by side: to [2*I]
    act: torch.nn.Module
    down: Linear


class DirectForward:
    """The Llama-family forward as plain tensor ops over the HF model's own parameters.

    Decode and prefill rows share every dense op (one weight read per layer per step);
    only attention is per kind. The layers' weights are moved once into the layout that
    runs fastest: q/k/v and gate/up fused into one matmul each (fewer, wider products:
    SmolLM2's bfloat16 decode step at 32 rows spent a quarter less in them), and in
    float32 up to INPUT_MAJOR_BYTES every matrix input-major (x @ W.T from it is
    1.1-1.7x faster on CPU for the demo model's matrices at 1-64 rows, and 1.8x slower in
    bfloat16; at 1 row it sums in another order than HF's layout, so logits may differ in
    the last bits). The modules' parameters become views into that layout (`fuse`), so
    every load into the model (the engine's, or an in-place `load_state_dict`) writes
    straight into what the forward reads: no copy to rebuild, none to go stale. The
    engine owns the model from then on: converting it (`.to(dtype)`) would cut the views.
    Rotary turns q and k together; its table is the model's own rotary embedding
    evaluated once per position (hence STATIC_ROPE only).
    """

    def __init__(self, model):
        self.base, self.head = model.model, model.get_output_embeddings()
        attn = self.base.layers[0].self_attn
        self.head_dim, self.scale = attn.head_dim, attn.scaling
        self.heads = attn.q_proj.out_features // self.head_dim, attn.k_proj.out_features // self.head_dim  # Hq, Hkv
        self.eps = self.base.norm.variance_epsilon  # these families make every RMSNorm with the config's eps
        layers = self.base.layers.parameters()
        self.input_major = (
            self.head.weight.dtype == torch.float32
            and sum(p.numel() * p.element_size() for p in layers) <= INPUT_MAJOR_BYTES
        )
        self.cos = self.sin = None  # [C, 1, D] each, sin signed so that rotate_half(x) * sin = x.roll(D/2) * sin
        self.head_rows = None  # [Hkv], each kv head's first row in a slot's cache flattened to [Hkv*C, D]
        with torch.no_grad():
            self.layers = [self.layer_weights(layer) for layer in self.base.layers]

    def layer_weights(self, layer) -> LayerWeights:
        """A decoder layer's tensors, laid out fused (input-major where `self.input_major`)."""
        attn, mlp = layer.self_attn, layer.mlp

        qk_norm = None
        if hasattr(attn, "q_norm"):  # Qwen3 normalises each head's q and k before rotary
            qk_norm = attn.q_norm.weight, attn.k_norm.weight
        return LayerWeights(
            attn_norm=layer.input_layernorm.weight,
            qkv=fuse((attn.q_proj, attn.k_proj, attn.v_proj), self.input_major),
            qk_norm=qk_norm,
            o=fuse((attn.o_proj,), self.input_major),
            mlp_norm=layer.post_attention_layernorm.weight,
            gate_up=fuse((mlp.gate_proj, mlp.up_proj), self.input_major),
            act=mlp.act_fn,
            down=fuse((mlp.down_proj,), self.input_major),
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
            qkv = F.linear(h, *w.qkv).view(n, -1, d)  # [N, Hq+2*Hkv, D]
            qk, v = qkv[:, : hq + hkv], qkv[:, hq + hkv :]  # [N, Hq+Hkv, D], [N, Hkv, D]
            if w.qk_norm is not None:
                q_norm, k_norm = w.qk_norm  # [D] each, to q's heads and k's heads side by side: [Hq+Hkv, D]
                qk = rms_norm(qk, torch.cat([q_norm.expand(hq, -1), k_norm.expand(hkv, -1)]), self.eps)
            qk = qk * cos + qk.roll(d // 2, -1) * sin  # [N, Hq+Hkv, D], rotary
            o = self.attend(batch, i, qk[:, :hq], qk[:, hq:], v, mask, at)  # [N, Hq*D]
            x = x + F.linear(o, *w.o)  # [N, H]
            h = rms_norm(x, w.mlp_norm, self.eps)  # [N, H]
            gate, up = F.linear(h, *w.gate_up).chunk(2, -1)  # [N, I] each
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


def fuse(linears: tuple[torch.nn.Linear, ...], input_major: bool) -> Linear:
    """One linear computing `linears` side by side, each module's weight and bias re-made as a view into it: a load
    into a module is a load into the fused one. Its weight is stored [out, in], or input-major ([in, out], used
    transposed) where `input_major`."""
    if input_major:
        weight = torch.cat([m.weight.t() for m in linears], 1).t()  # [out, in], a view of [in, out] storage
    else:
        weight = torch.cat([m.weight for m in linears])  # [out, in]
    bias = None
    if any(m.bias is not None for m in linears):  # a module without one reads zeros there
        zeros = partial(torch.zeros, dtype=weight.dtype, device=weight.device)
        bias = torch.cat([zeros(m.out_features) if m.bias is None else m.bias for m in linears])  # [out]
    start = 0
    for m in linears:
        end = start + m.out_features
        m.weight = torch.nn.Parameter(weight[start:end], requires_grad=m.weight.requires_grad)  # [o, in]
        if m.bias is not None:
            m.bias = torch.nn.Parameter(bias[start:end], requires_grad=m.bias.requires_grad)  # [o]
        start = end
    return weight, bias


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
