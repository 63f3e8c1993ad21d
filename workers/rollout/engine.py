"""Embedded PyTorch inference engine for the rollout worker: the scheduler of its slots.

Continuous batching over a slot KV cache, on CPU or CUDA (the model's device):

    kv    : [2, layers, rows, kv_heads, capacity, head_dim], keys and values of every slot, sized
            by the sequences admitted (it grows, copying, when more slots or a longer budget need it)
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

The forward over the slots is `workers.rollout.forward`'s; the draw from its logits is
`workers.rollout.sampling`'s.
"""

from __future__ import annotations

import math
from collections import deque
from itertools import accumulate

import torch

from workers.lora import VersionLoader
from workers.models import avoid_cudnn_attention
from workers.rollout.forward import Batch, Chunk, make_forward
from workers.rollout.protocol import EngineStats, SamplingParams, Sequence, check_request, stop_cut
from workers.rollout.sampling import SlotSampling
from workers.weight_deltas import ChainReader
from workers.weights import WeightsFile, verified_bytes

CAPACITY_STEP = 64  # slot capacity (positions) grows in multiples of this
SLOT_STEP = 8  # the cache's slot rows grow in multiples of this, up to max_batch
PREFILL_SPREAD = 1.5  # a prefill chunk's longest row is at most this times its shortest (`prefill_cut`)
RUN_BLOCK = 4  # decode rows are cut into attention runs at multiples of this many slots (`decode_runs`)
SORT_WASTE = 1.6  # decoding slots are sorted again once blocks of them would attend this times their own columns


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
        tokenizer=None,
        cache_mb: int = 0,
        chain: ChainReader | None = None,
    ):
        """`cache_lag`: versions a running sequence's cache may lag the weights before an update recomputes it
        (`update_weights`); `tokenizer`: decodes completions' tails for stop strings (without one, requests with
        `stop` are refused); `cache_mb`: the most the KV cache may take (0: no limit but max_batch), fewer
        sequences running at once where their budgets are long (`_admit`); `chain`: reads whole and delta versions
        (default: one that keeps no copy, rebuilding each delta from its whole version)."""
        self.model = model.eval()
        self.chain = chain or ChainReader()
        self.tokenizer = tokenizer
        self.cache_lag = cache_lag
        self.device = next(model.parameters()).device
        avoid_cudnn_attention(self.device)  # every decode step has a new span
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens  # padded tokens per prefill forward
        config = model.config.get_text_config()
        self.max_len = getattr(config, "max_position_embeddings", None)
        self.vocab = model.get_input_embeddings().num_embeddings
        self.forward = make_forward(model, forward)
        self.loader = VersionLoader(model)  # after `fuse`: it writes into the layout the forward reads
        heads = config.num_attention_heads
        self.kv_shape = (
            config.num_hidden_layers,
            getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads,
        )
        self.kv: torch.Tensor | None = None  # [2, layers, rows, Hkv, C, D], rows >= the slots (`_reserve`)
        position_bytes = 2 * math.prod(self.kv_shape) * model.dtype.itemsize  # one position of one slot, k and v
        self.cache_positions = (cache_mb << 20) // position_bytes if cache_mb else None  # rows x C at most
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
        self.sampling: SlotSampling | None = None  # the slots' sampling settings, row i for slot i
        self.slots_changed = False  # `sampling` needs a rebuild
        self.generated_tokens = self.weight_updates = self.interrupted = 0  # for stats()

    # ---- RolloutEngine ----

    def submit(self, key: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request; it joins the batch at the next step with room."""
        check_request(prompt_ids, params, self.max_len, self.vocab, self.tokenizer)
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
            stopped = tok in seq.params.stop_token_ids or stop_cut(
                seq.token_ids, [tok], seq.params.stop, self.tokenizer
            )
            seq.token_ids.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(self.version)
            if stopped:
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
        A LoRA version (an adapter) is merged into the base weights (`workers.lora.VersionLoader`).
        """
        # outside inference mode: parameters stay normal tensors
        if weights.base_version >= 0 or self.chain.retain:  # delta versions: the chain applied, its hash checked
            tensors = self.chain.read(weights)
            self.loader.load(tensors, {})
            self.chain.hold(weights, tensors)
        else:  # a whole version or a LoRA adapter, as its file says
            self.loader.load_bytes(verified_bytes(weights))
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
        new = []
        while len(new) < room and self.waiting and self._fits([*new, self.waiting[0]]):
            new.append(self.waiting.popleft())
        if not new:
            return
        end = len(self.slots) - len(self.leads)  # the followers stay last
        self.slots[self.decoding : end] = sorted(self.slots[self.decoding : end] + new, key=len, reverse=True)
        self.slots_changed = True
        self._reserve()

    def _fits(self, new: list[Sequence]) -> bool:
        """Whether the cache, with `new` admitted too, stays within `cache_mb`: rows for every slot (at least
        those allocated) times the longest budget. A lone sequence always fits: the engine must make progress."""
        if self.cache_positions is None or (not self.slots and len(new) == 1):
            return True
        rows = max(len(self.slots) + len(new), 0 if self.kv is None else self.kv.shape[2])
        return rows * self._capacity(self.slots + new) <= self.cache_positions

    def _capacity(self, seqs: list[Sequence]) -> int:
        """Cache positions `seqs` need: their longest prompt + max_new_tokens, in multiples of CAPACITY_STEP, at
        most the model's length (and never less than the cache has)."""
        need = max(len(seq.prompt_ids) + seq.params.max_new_tokens for seq in seqs)
        need = math.ceil(need / CAPACITY_STEP) * CAPACITY_STEP
        if self.max_len is not None:
            need = min(need, self.max_len)
        return max(need, 0 if self.kv is None else self.kv.shape[-2])

    def _reserve(self) -> None:
        """Make the cache hold every slot's whole budget (prompt + max_new_tokens, capped at the model's length),
        keeping what is cached.

        Sized by the sequences admitted, not by a worst case of max_batch slots: rows for the slots in use (in
        multiples of SLOT_STEP, doubling as more are admitted, up to max_batch and what `cache_mb` allows),
        positions for the longest budget among them (`_capacity`). Growing copies the cache once, so a batch
        submitted at once (`generate_all`, longest first) allocates it once.
        """
        rows, capacity = len(self.slots), self._capacity(self.slots)
        have_rows, have = (0, 0) if self.kv is None else (self.kv.shape[2], self.kv.shape[-2])
        if rows <= have_rows and capacity <= have:
            return
        if rows > have_rows:
            most = self.max_batch if self.cache_positions is None else self.cache_positions // capacity
            rows = max(rows, min(max(math.ceil(rows / SLOT_STEP) * SLOT_STEP, 2 * have_rows), self.max_batch, most))
        rows = max(rows, have_rows)
        layers, kv_heads, head_dim = self.kv_shape
        kv = torch.zeros(
            2, layers, rows, kv_heads, capacity, head_dim, dtype=self.model.dtype, device=self.device
        )  # [2, layers, slots, Hkv, C, D]
        if self.kv is not None:
            kv[:, :, :have_rows, :, :have] = self.kv
        self.kv = kv
        if capacity > have:
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

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per slot from logits [B, V], with its behaviour logprob (`workers.rollout.sampling`)."""
        if self.slots_changed:
            self.sampling = SlotSampling([s.params for s in self.slots], self.device)
            self.slots_changed = False
        return self.sampling.sample(logits, self.generator)  # [B], [B]
