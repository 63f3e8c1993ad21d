"""Embedded PyTorch inference engine for the rollout worker.

Continuous batching over any Hugging Face causal LM with a KV cache, on CPU or CUDA.
Every running sequence is one row of a left-padded batch:

    cache  : per layer keys/values [B, H, L, D]; row i holds its context right-aligned
    mask   : [B, L], 1 where the cache column is a real token of that row
    logits : [B, V], the next-token logits of each row (from the last forward)

Row invariant: the cache holds every token of the sequence (prompt + generated) and
`logits` is the model's prediction for the next one. A step samples one token per row
from `logits`, retires finished rows, and runs one decode forward over the rest.
Newcomers are prefilled as their own left-padded batch and merged in by left-padding
both caches to a common length. A weight update recomputes every row the same way.

Behaviour logprobs are log_softmax(logits / temperature) (plain log_softmax for
temperature 0) over the full vocabulary, taken from the same logits the sampler used
and *before* top-k/top-p filtering: they only restrict which token may be drawn. This
keeps π_behav a property of the policy at that temperature, which is what the trainer
recomputes as π_prox/π_θ, rather than of a truncated sampling distribution.

Top-k and top-p combine as in Hugging Face's warpers: keep the k most likely tokens,
then the smallest prefix of those whose renormalised mass reaches top_p.
"""

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from workers.weights import load_into

NO_TOP_K = torch.iinfo(torch.long).max  # a rank no token reaches


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0  # 0 = off; last, so positional construction of the fields above still works


@dataclass
class Sequence:
    """One request's state, owned by the engine while it runs; read it between steps."""

    key: str
    prompt_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # policy version that produced each token
    finish_reason: str | None = None  # "stop" | "length"

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)


def left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Prepend zeros along `dim` up to `length`; zero mask columns keep the padding unattended."""
    shape = list(t.shape)
    shape[dim] = length - t.shape[dim]
    return torch.cat([t.new_zeros(shape), t], dim)


class Engine:
    """Continuous-batching generator with in-place weight updates.

    Not thread-safe: call submit/step/update_weights from one thread (the worker loop).
    """

    def __init__(self, model, *, max_batch: int = 64, version: int = 0, seed: int | None = None,
                 max_prefill_tokens: int = 16384):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens  # padded tokens per prefill forward
        self.max_len = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.version = version
        self.generator = None
        if seed is not None:
            self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.waiting: deque[Sequence] = deque()
        self.rows: list[Sequence] = []  # row i of the batch tensors below
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [B, L]
        self.logits: torch.Tensor | None = None  # [B, V] float32
        self.temperature: torch.Tensor | None = None  # [B]
        self.top_p: torch.Tensor | None = None  # [B]
        self.top_k: torch.Tensor | None = None  # [B], NO_TOP_K where off
        self.any_random = self.any_filter = False  # skip sampling work the batch does not need

    # ---- public API ----

    def submit(self, key: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request; it joins the batch at the next step with room."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.max_new_tokens < 1 or params.top_k < 0:
            raise ValueError(f"bad sampling params {params}")
        if self.max_len is not None and len(prompt_ids) >= self.max_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room under {self.max_len} positions")
        if any(s.key == key for s in self.running()):
            raise ValueError(f"sequence {key!r} is already in the engine")
        seq = Sequence(key, list(prompt_ids), params)
        self.waiting.append(seq)
        return seq

    def running(self) -> list[Sequence]:
        """Unfinished sequences, admitted first, then waiting."""
        return self.rows + list(self.waiting)

    def idle(self) -> bool:
        return not self.rows and not self.waiting

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Admit waiting requests while there is room, then produce one token per running sequence.

        Returns the sequences that finished in this step; they have left the engine.
        """
        self._admit()
        if not self.rows:
            return []
        tokens, logprobs = self._sample()  # [B], [B]
        finished, keep = [], []
        for i, (seq, tok, lp) in enumerate(zip(self.rows, tokens.tolist(), logprobs.tolist())):
            seq.token_ids.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(self.version)
            if tok in seq.params.stop_token_ids:
                seq.finish_reason = "stop"
            elif len(seq.token_ids) >= seq.params.max_new_tokens or (self.max_len and len(seq) >= self.max_len):
                seq.finish_reason = "length"
            if seq.finish_reason:
                finished.append(seq)
            else:
                keep.append(i)
        if finished:
            tokens = tokens[keep]  # [B']
            self._keep_rows(keep)
        if self.rows:
            self._decode(tokens)
        return finished

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new weights in place and recompute the cache of every running sequence with them.

        Tokens already generated keep their old version; the next token is sampled
        from logits of the new weights.
        """
        load_into(self.model, state_dict)  # in place, outside inference mode: parameters stay normal tensors
        self.version = version
        if self.rows:
            rows = sorted(self.rows, key=len)
            self._clear()
            with torch.inference_mode():
                self._prefill(rows)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
        """Run a whole batch to completion (evaluation); results in prompt order."""
        if not self.idle():
            raise RuntimeError("generate() needs an idle engine")
        seqs = [self.submit(f"generate/{i}", p, params) for i, p in enumerate(prompts)]
        while not self.idle():
            self.step()
        return seqs

    # ---- batch bookkeeping ----

    def _admit(self) -> None:
        """Move waiting requests into the batch, up to max_batch rows."""
        room = self.max_batch - len(self.rows)
        if room <= 0 or not self.waiting:
            return
        new = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        self._prefill(sorted(new, key=len))

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Forward the full context of `seqs` (sorted by length) in left-padded chunks and append them as rows."""
        start = 0
        while start < len(seqs):
            end = start + 1  # grow the chunk while its padded size fits the budget (lengths ascend)
            while end < len(seqs) and (end + 1 - start) * len(seqs[end]) <= self.max_prefill_tokens:
                end += 1
            chunk = seqs[start:end]
            length = len(chunk[-1])
            ids = torch.zeros(len(chunk), length, dtype=torch.long)  # [b, l], pad id 0 is never attended
            mask = torch.zeros(len(chunk), length, dtype=torch.long)  # [b, l]
            for i, seq in enumerate(chunk):
                ids[i, length - len(seq):] = torch.tensor(seq.prompt_ids + seq.token_ids)
                mask[i, length - len(seq):] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, l]
            cache = DynamicCache()  # plain full-attention layers, so rows can be padded and merged freely
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            self._append_rows(chunk, cache, mask, out.logits[:, -1].float())  # logits [b, V]
            start = end

    def _append_rows(self, seqs: list[Sequence], cache: DynamicCache, mask: torch.Tensor, logits: torch.Tensor) -> None:
        """Merge a freshly prefilled batch into the running one, left-padding the shorter cache."""
        if self.cache is None:
            self.cache, self.mask, self.logits = cache, mask, logits
        else:
            n = max(self.mask.shape[1], mask.shape[1])
            for old, new in zip(self.cache.layers, cache.layers):
                old.keys = torch.cat([left_pad(old.keys, n, 2), left_pad(new.keys, n, 2)])  # [B+b, H, L, D]
                old.values = torch.cat([left_pad(old.values, n, 2), left_pad(new.values, n, 2)])  # [B+b, H, L, D]
            self.mask = torch.cat([left_pad(self.mask, n, 1), left_pad(mask, n, 1)])  # [B+b, L]
            self.logits = torch.cat([self.logits, logits])  # [B+b, V]
        self.rows = self.rows + seqs
        self._sampling_tensors()

    def _keep_rows(self, keep: list[int]) -> None:
        """Drop finished rows and the cache columns that are padding in every remaining row."""
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self._clear()
            return
        trim = self.mask.shape[1] - max(len(s) - 1 for s in self.rows)  # the newest token is not cached yet
        idx = torch.tensor(keep, device=self.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys[idx, :, trim:]  # [B', H, L', D]
            layer.values = layer.values[idx, :, trim:]  # [B', H, L', D]
        self.mask = self.mask[idx, trim:]  # [B', L']
        self.logits = None  # replaced by the decode forward that follows
        self._sampling_tensors()

    def _clear(self) -> None:
        self.rows = []
        self.cache = self.mask = self.logits = self.temperature = self.top_p = self.top_k = None

    def _sampling_tensors(self) -> None:
        """Per-row sampling settings as device tensors, rebuilt only when the row set changes."""
        self.temperature = torch.tensor([s.params.temperature for s in self.rows], device=self.device)  # [B]
        self.top_p = torch.tensor([s.params.top_p for s in self.rows], device=self.device)  # [B]
        self.top_k = torch.tensor([s.params.top_k or NO_TOP_K for s in self.rows], device=self.device)  # [B]
        self.any_random = any(s.params.temperature > 0 for s in self.rows)
        self.any_filter = any(s.params.temperature > 0 and (s.params.top_p < 1 or s.params.top_k > 0)
                              for s in self.rows)

    # ---- model calls ----

    def _decode(self, tokens: torch.Tensor) -> None:
        """Feed each row's newest token (tokens [B]) and keep the next-token logits."""
        pos = self.mask.sum(-1, keepdim=True)  # [B, 1], real tokens already cached = index of the new one
        self.mask = F.pad(self.mask, (0, 1), value=1)  # [B, L+1]
        out = self.model(input_ids=tokens[:, None], attention_mask=self.mask, position_ids=pos,
                         past_key_values=self.cache, use_cache=True)
        self.logits = out.logits[:, -1].float()  # [B, V]

    def _sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per row; return it with its behaviour logprob (pre-filtering, see module doc)."""
        greedy = self.temperature == 0  # [B]
        temp = torch.where(greedy, 1.0, self.temperature)  # [B]
        logp = torch.log_softmax(self.logits / temp[:, None], dim=-1)  # [B, V]
        tokens = self.logits.argmax(-1)  # [B]
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
            tokens = torch.where(greedy, tokens, drawn)  # [B]
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)  # [B], [B]
