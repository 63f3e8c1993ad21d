"""The embedded engine against Hugging Face reference computations on tiny random models.

Engine-level tests run with both forwards (the direct Llama-family one and the HF
fallback over the slot cache): they must give the same results.
"""

import pytest
import torch
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tests.factories import tiny_qwen2
from workers.rollout import engine as engine_module
from workers.rollout import forward as forward_module
from workers.rollout.engine import Engine
from workers.rollout.forward import DirectForward, HFForward
from workers.rollout.protocol import SamplingParams, generate_all, stop_cut
from workers.weights import WeightsFile, write_version

torch.set_num_threads(1)

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [3, 1, 4, 1, 5]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def tiny_model(seed: int) -> Qwen2ForCausalLM:
    sizes = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    return tiny_qwen2(seed=seed, max_position_embeddings=128, **sizes).eval()


@pytest.fixture
def model() -> Qwen2ForCausalLM:
    return tiny_model(0)


@pytest.fixture(params=["direct", "hf"])
def forward(request) -> str:
    return request.param


def perturbed(model: Qwen2ForCausalLM) -> dict[str, torch.Tensor]:
    """New weights far enough from the old ones to change greedy choices."""
    g = torch.Generator().manual_seed(1)
    return {
        k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) if v.ndim > 1 else v.clone()
        for k, v in model.state_dict().items()
    }


def as_version(tensors: dict[str, torch.Tensor], weights_dir, version: int) -> WeightsFile:
    """`tensors` written as the file every engine's update_weights takes."""
    path, _ = write_version(tensors, weights_dir, version, keep=1)
    return WeightsFile(path, version)


def greedy_across_an_update(engine: Engine, prompts: list[list[int]], steps: int, tmp_path):
    """`prompts` decoded greedily, `steps` tokens on the engine's weights and the rest on `perturbed` ones loaded
    then as version 1: the sequences and those new weights."""
    seqs = [engine.submit(f"s{i}", prompt, GREEDY) for i, prompt in enumerate(prompts)]
    for _ in range(steps):
        engine.step()
    new_weights = perturbed(engine.model)
    engine.update_weights(as_version(new_weights, tmp_path, 1))
    while not engine.idle():
        engine.step()
    return seqs, new_weights


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_hf_generate(model, forward):
    seqs = generate_all(Engine(model, forward=forward), PROMPTS, GREEDY)
    for prompt, seq in zip(PROMPTS, seqs, strict=True):
        assert seq.token_ids == hf_greedy(model, prompt, GREEDY.max_new_tokens)
        assert seq.finish_reason == "length" and seq.versions == [0] * GREEDY.max_new_tokens


def full_forward_logits(model, seq) -> torch.Tensor:
    """Next-token logits [new, V] at every generated position, from one forward of the whole sequence."""
    ids = torch.tensor([seq.prompt_ids + seq.token_ids])  # [1, T]
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # [T, V]
    return logits[len(seq.prompt_ids) - 1 : -1]


@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.7, 0), (1.0, 3), (0.8, 4)])
def test_behaviour_logprobs_match_full_forward(model, forward, top_p, top_k):
    params = SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=10, top_k=top_k)
    seqs = generate_all(Engine(model, seed=0, forward=forward), PROMPTS, params)
    for seq in seqs:
        logp = torch.log_softmax(full_forward_logits(model, seq), -1)  # [new, V], unfiltered
        want = logp.gather(-1, torch.tensor(seq.token_ids)[:, None]).squeeze(-1)  # [new]
        torch.testing.assert_close(torch.tensor(seq.logprobs), want, atol=1e-4, rtol=0)


def test_decode_runs_cut_where_contexts_differ():
    """Rows attend in runs up to each run's longest context: the cut reading the fewest cache columns, counting
    `call_cost` columns per run."""
    assert engine_module.decode_runs([]) == []
    assert engine_module.decode_runs([9] * 8) == [(0, 8, 10)]  # one length: one run
    # a long row among short ones: 4 x 301 + 4 x 21 + 2 x 256 = 1800 columns beat 8 x 301 + 256 = 2664
    assert engine_module.decode_runs([300] + [20] * 7) == [(0, 4, 301), (4, 8, 21)]
    assert engine_module.decode_runs([300] + [20] * 7, call_cost=2000) == [(0, 8, 301)]  # calls too dear to cut
    assert engine_module.decode_runs([5, 3, 8], block=1, call_cost=0) == [(0, 1, 6), (1, 2, 4), (2, 3, 9)]
    assert engine_module.decode_runs([200, 190, 180, 170, 10, 9], block=4, call_cost=0) == [(0, 4, 201), (4, 6, 11)]


def test_block_columns_measure_how_far_slots_are_from_longest_first():
    assert engine_module.block_columns([]) == 0
    assert engine_module.block_columns([9, 9, 9, 9, 9]) == 50  # one length: their own columns
    assert engine_module.block_columns([300, 5, 5, 5, 300, 5, 5, 5]) == 8 * 301  # a long row in every block
    assert engine_module.block_columns([300, 300, 5, 5, 5, 5, 5]) == 4 * 301 + 3 * 6  # sorted: 2 x 295 wasted
    assert engine_module.block_columns([3, 1, 2], block=1) == 4 + 2 + 3


def test_mixed_up_slots_are_sorted_again_with_their_caches(model, forward, monkeypatch):
    """Retirements move the last slot into holes and mix the order up; the decoding slots are then sorted longest
    first again, each keeping its own cache: every behaviour logprob still equals a full forward's."""
    monkeypatch.setattr(engine_module, "SORT_WASTE", 1.0)  # sort at any disorder
    orders, sort = [], Engine._sort_decoding

    def recording(self):
        before = [len(s) for s in self.slots[: self.decoding]]
        sort(self)
        orders.append((before, [len(s) for s in self.slots[: self.decoding]]))

    monkeypatch.setattr(Engine, "_sort_decoding", recording)
    engine = Engine(model, max_batch=6, seed=0, forward=forward)
    lengths = [30, 2, 25, 3, 20, 1, 28, 4, 15, 2, 22, 6]  # short ones retire among long ones, refilled from the queue
    seqs = [
        engine.submit(f"s{i}", PROMPTS[i % 4], SamplingParams(temperature=1.0, max_new_tokens=n))
        for i, n in enumerate(lengths)
    ]
    while not engine.idle():
        engine.step()
    assert any(before != sorted(before, reverse=True) for before, _ in orders)  # the order was mixed up...
    assert all(after == sorted(after, reverse=True) for _, after in orders)  # ...and every forward saw it sorted
    for seq, n in zip(seqs, lengths, strict=True):
        assert len(seq.token_ids) == n
        logp = torch.log_softmax(full_forward_logits(model, seq), -1)  # [new, V]
        want = logp.gather(-1, torch.tensor(seq.token_ids)[:, None]).squeeze(-1)  # [new]
        torch.testing.assert_close(torch.tensor(seq.logprobs), want, atol=1e-4, rtol=0)


def test_decode_in_runs_changes_nothing(model, monkeypatch):
    """Every decode row in a run of its own (up to its own context) gives the tokens and logprobs of one run
    over the longest context."""
    params, cut = SamplingParams(temperature=1.0, max_new_tokens=10), engine_module.decode_runs

    def generate(runs_of) -> tuple[list, list[list[tuple[int, int, int]]]]:
        runs = []
        monkeypatch.setattr(engine_module, "decode_runs", lambda pos: runs.append(runs_of(pos)) or runs[-1])
        return generate_all(Engine(model, seed=0, forward="direct"), PROMPTS, params), runs

    one_run, _ = generate(lambda pos: [(0, len(pos), max(pos) + 1)] if pos else [])
    own_runs, runs = generate(lambda pos: cut(pos, block=1, call_cost=0))
    assert max(map(len, runs)) == len(PROMPTS)  # the runs were used: a row each
    for a, b in zip(one_run, own_runs, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_top_k_one_is_greedy(model, top_p):
    greedy = generate_all(Engine(model), PROMPTS, GREEDY)
    params = SamplingParams(temperature=1.5, top_p=top_p, top_k=1, max_new_tokens=12)
    sampled = generate_all(Engine(model, seed=0), PROMPTS, params)
    assert [s.token_ids for s in sampled] == [s.token_ids for s in greedy]
    assert all(lp < 0 for s in sampled for lp in s.logprobs)  # still the full tempered distribution, not 1


def test_top_k_is_per_sequence_and_bounds_every_draw(model):
    engine = Engine(model, seed=0)
    capped = [
        engine.submit(f"k{i}", p, SamplingParams(temperature=2.0, top_k=2, max_new_tokens=20))
        for i, p in enumerate(PROMPTS * 3)
    ]
    free = [
        engine.submit(f"f{i}", p, SamplingParams(temperature=2.0, max_new_tokens=20)) for i, p in enumerate(PROMPTS)
    ]
    while not engine.idle():
        engine.step()

    def ranks(seq) -> torch.Tensor:
        logits = full_forward_logits(model, seq)  # [new, V]
        return (logits > logits.gather(-1, torch.tensor(seq.token_ids)[:, None])).sum(-1)  # [new], 0 = argmax

    capped_ranks = torch.cat([ranks(s) for s in capped])
    assert capped_ranks.max() <= 1 and capped_ranks.min() == 0 and (capped_ranks == 1).any()
    assert torch.cat([ranks(s) for s in free]).max() >= 2  # the same batch drew outside the top 2 for uncapped rows


def test_seed_reproducible(model):
    params = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=8)
    a = generate_all(Engine(model, seed=3), PROMPTS, params)
    b = generate_all(Engine(model, seed=3), PROMPTS, params)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]


def test_interruption_continues_like_fresh_engine_with_new_weights(model, forward, tmp_path):
    engine = Engine(model, version=0, forward=forward)
    seqs = [engine.submit(f"s{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    for _ in range(5):
        engine.step()
    new_weights = perturbed(model)
    engine.update_weights(as_version(new_weights, tmp_path, 1))
    late = engine.submit("late", [2], GREEDY)  # prefilled in the same forward as the recomputed ones
    while not engine.idle():
        engine.step()

    fresh = Engine(tiny_model(0), version=1, forward=forward)
    fresh.model.load_state_dict(new_weights)
    for seq in seqs:
        rest = SamplingParams(temperature=0.0, max_new_tokens=7)
        ref = generate_all(fresh, [seq.prompt_ids + seq.token_ids[:5]], rest)[0]
        assert seq.token_ids[5:] == ref.token_ids
        assert seq.versions == [0] * 5 + [1] * 7
    assert late.token_ids == generate_all(fresh, [late.prompt_ids], GREEDY)[0].token_ids and set(late.versions) == {1}
    old = generate_all(Engine(tiny_model(0)), PROMPTS, GREEDY)
    assert any(s.token_ids != o.token_ids for s, o in zip(seqs, old, strict=True))  # the update did change the policy


def greedy_over_old_cache(old, new, cached: list[int], token: int, n: int) -> tuple[list[int], list[float]]:
    """`n` tokens decoded greedily under `new` from `token`, attending Hugging Face's cache of `cached` under `old`:
    the tokens and their logprobs."""
    tokens, logprobs = [], []
    with torch.no_grad():
        cache = old(torch.tensor([cached]), use_cache=True).past_key_values
        for _ in range(n):
            logp = torch.log_softmax(new(torch.tensor([[token]]), past_key_values=cache).logits[0, -1], -1)  # [V]
            token = int(logp.argmax())
            tokens.append(token)
            logprobs.append(float(logp[token]))
    return tokens, logprobs


def with_weights(weights: dict[str, torch.Tensor]) -> Qwen2ForCausalLM:
    model = tiny_model(0)
    model.load_state_dict(weights)
    return model


def test_an_update_without_recompute_keeps_the_old_cache_and_computes_what_follows_with_the_new_weights(
    model, forward, tmp_path
):
    """An unbounded cache lag: the reference is Hugging Face's cache of prompt + the first 4 tokens under the old
    weights, then greedy decoding under the new ones from the 5th token on (the newest, not yet cached)."""
    engine = Engine(model, version=0, forward=forward, cache_lag=1000)
    seqs, new_weights = greedy_across_an_update(engine, PROMPTS, 5, tmp_path)

    for seq in seqs:
        want_tokens, want_logp = greedy_over_old_cache(
            tiny_model(0), with_weights(new_weights), seq.prompt_ids + seq.token_ids[:4], seq.token_ids[4], 7
        )
        assert seq.token_ids[5:] == want_tokens and seq.versions == [0] * 5 + [1] * 7
        torch.testing.assert_close(torch.tensor(seq.logprobs[5:]), torch.tensor(want_logp), atol=1e-4, rtol=0)
    recomputed = Engine(tiny_model(0), version=0, forward=forward)
    again = [recomputed.submit(f"s{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    for _ in range(5):
        recomputed.step()
    recomputed.update_weights(as_version(new_weights, tmp_path, 1))
    while not recomputed.idle():
        recomputed.step()
    assert any(a.logprobs != b.logprobs for a, b in zip(seqs, again, strict=True))  # the kept cache made a difference


def test_a_cache_lagging_more_than_cache_lag_versions_is_recomputed(model, forward, tmp_path):
    """cache_lag=1: sequences begun at v0 keep their cache over the update to v1 and are re-prefilled at v2, those
    begun at v1 keep theirs at v2; twins (a follower each) go with their leader. Every token is checked against
    Hugging Face over the cache each rule gives."""
    engine = Engine(model, version=0, forward=forward, cache_lag=1)
    early = [engine.submit(f"a{i}", p, GREEDY) for i, p in enumerate([*PROMPTS[:2], PROMPTS[0]])]
    for _ in range(3):
        engine.step()
    w0, w1 = model.state_dict(), perturbed(model)
    w0 = {k: v.clone() for k, v in w0.items()}
    engine.update_weights(as_version(w1, tmp_path, 1))
    assert engine.decoding == 2 and len(engine.leads) == 1  # nothing to recompute yet
    late = [engine.submit(f"b{i}", p, GREEDY) for i, p in enumerate([PROMPTS[2], PROMPTS[3], PROMPTS[3]])]
    for _ in range(3):
        engine.step()
    w2 = perturbed(model)
    engine.update_weights(as_version(w2, tmp_path, 2))
    assert engine.decoding == 2 and [s.key for s in engine.slots[:2]] == ["b1", "b0"]  # only the late ones kept
    while not engine.idle():
        engine.step()

    fresh = Engine(with_weights(w2), version=2, forward=forward)
    for seq in early:
        assert seq.versions == [0] * 3 + [1] * 3 + [2] * 6
        kept, _ = greedy_over_old_cache(
            with_weights(w0), with_weights(w1), seq.prompt_ids + seq.token_ids[:2], seq.token_ids[2], 3
        )
        assert seq.token_ids[3:6] == kept
        rest = generate_all(
            fresh, [seq.prompt_ids + seq.token_ids[:6]], SamplingParams(temperature=0.0, max_new_tokens=6)
        )
        assert seq.token_ids[6:] == rest[0].token_ids
    for seq in late:
        assert seq.versions == [1] * 3 + [2] * 9
        kept, logp = greedy_over_old_cache(
            with_weights(w1), with_weights(w2), seq.prompt_ids + seq.token_ids[:2], seq.token_ids[2], 9
        )
        assert seq.token_ids[3:] == kept
        torch.testing.assert_close(torch.tensor(seq.logprobs[3:]), torch.tensor(logp), atol=1e-4, rtol=0)
    assert not engine.cached_at


@pytest.mark.parametrize("input_major", [True, False])
@pytest.mark.parametrize("load", ["update_weights", "in_place"])
def test_direct_forward_follows_weight_loads(model, tmp_path, load, input_major, monkeypatch):
    """The direct forward runs on the weights laid out fused, the model's parameters views into them: after a
    load, through the engine or straight into the model in place, every next logit must be a fresh forward's
    under the new weights, in either layout."""
    if not input_major:
        monkeypatch.setattr(forward_module, "INPUT_MAJOR_BYTES", 0)
    engine = Engine(model, forward="direct")
    assert engine.forward.input_major == input_major  # a tiny float32 model's weights are laid out input-major
    generate_all(engine, PROMPTS, GREEDY)  # the old weights in use
    new_weights = perturbed(model)
    if load == "update_weights":
        engine.update_weights(as_version(new_weights, tmp_path, 1))
    else:
        model.load_state_dict(new_weights)
    for seq in generate_all(engine, PROMPTS, GREEDY):
        logp = torch.log_softmax(full_forward_logits(model, seq), -1)  # [new, V]: the model holds the new weights
        assert seq.token_ids == logp.argmax(-1).tolist()
        want = logp.gather(-1, torch.tensor(seq.token_ids)[:, None]).squeeze(-1)  # [new]
        torch.testing.assert_close(torch.tensor(seq.logprobs), want, atol=1e-4, rtol=0)


def test_direct_forward_output_major_matches_hf_generate(model, monkeypatch):
    """A model over INPUT_MAJOR_BYTES (or not in float32) runs the direct forward on fused [out, in] weights."""
    monkeypatch.setattr(forward_module, "INPUT_MAJOR_BYTES", 0)
    engine = Engine(model, forward="direct")
    assert not engine.forward.input_major
    for prompt, seq in zip(PROMPTS, generate_all(engine, PROMPTS, GREEDY), strict=True):
        assert seq.token_ids == hf_greedy(model, prompt, GREEDY.max_new_tokens)


def test_prefill_cut_bounds_each_chunks_padding():
    """Contexts to prefill, longest first, are cut where the chunk's first would be over PREFILL_SPREAD times a row."""
    assert engine_module.prefill_cut([]) == []
    assert engine_module.prefill_cut([41, 21, 13, 5, 4]) == [(0, 1), (1, 2), (2, 3), (3, 5)]
    assert engine_module.prefill_cut([6, 5, 4]) == [(0, 3)]  # 6 is 1.5 times 4: still one chunk
    assert engine_module.prefill_cut([7, 5, 4]) == [(0, 2), (2, 3)]


def test_re_prefill_is_one_packed_forward_chunked_by_length_and_changes_nothing(model, forward, monkeypatch, tmp_path):
    """After an interruption, contexts of 4 to 41 tokens are re-prefilled in one forward over their tokens alone,
    attending in chunks of similar lengths (padding each to the longest would cost several times the real
    tokens); a token budget splits them over forwards. The tokens are the same every way."""
    prompts = [[1, 2, 3], [4, 5, 6, 7], [2] * 12, [3] * 20, [5] * 40]
    new_weights = as_version(perturbed(model), tmp_path, 1)

    def run(spread: float, budget: int = 16384) -> tuple[list[tuple[list[int], int]], list[list[int]]]:
        monkeypatch.setattr(engine_module, "PREFILL_SPREAD", spread)
        engine = Engine(tiny_model(0), forward=forward, max_prefill_tokens=budget)
        for i, prompt in enumerate(prompts):
            engine.submit(f"s{i}", prompt, GREEDY)
        engine.step()
        engine.update_weights(new_weights)
        calls, inner = [], engine.forward  # per forward: its chunks' widths, its tokens
        engine.forward = lambda batch: calls.append(([c.width for c in batch.chunks], len(batch.ids))) or inner(batch)
        for _ in range(3):
            engine.step()
        return calls, [s.token_ids for s in engine.slots]

    chunked_calls, chunked = run(1.5)
    one_calls, one = run(float("inf"))
    split_calls, split = run(1.5, budget=41 + 21)
    assert chunked_calls[0] == ([41, 21, 13, 5], 84)  # longest first; 5 and 4 tokens together, the others alone
    assert one_calls[0] == ([41], 84)  # every context padded to the longest in attention only
    assert split_calls[:2] == [([41, 21], 62), ([13, 5], 22)]
    assert chunked == one == split


def test_a_context_to_prefill_twice_is_computed_once(model, forward, tmp_path):
    """A group's samples share their prompt, and greedy ones their answer so far: each context is prefilled once,
    at admission and again after a weight update, and every sequence goes on as if it were alone."""
    prompts = [[1, 2, 3]] * 3 + [[4, 5, 6, 7]] * 2
    engine = Engine(model, forward=forward)
    prefilled = []

    class Counted:  # the engine's forward, counting the rows each call prefills
        def __call__(self, batch):
            prefilled.append(batch.prefill)
            return run(batch)

        def __getattr__(self, name):
            return getattr(run, name)

    run, engine.forward = engine.forward, Counted()
    seqs, new_weights = greedy_across_an_update(engine, prompts, 3, tmp_path)
    assert prefilled[:4] == [2, 0, 0, 2]  # two contexts at admission, two again after the update

    fresh = Engine(tiny_model(0), version=1, forward=forward)
    fresh.model.load_state_dict(new_weights)
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.token_ids[:3] == hf_greedy(tiny_model(0), prompt, 3)  # `model` holds the new weights now
        rest = generate_all(fresh, [prompt + seq.token_ids[:3]], SamplingParams(temperature=0.0, max_new_tokens=9))
        assert seq.token_ids[3:] == rest[0].token_ids and seq.versions == [0] * 3 + [1] * 9


def test_samples_share_one_row_while_their_contexts_agree(model, forward):
    """A group's samples decode as one row until their draws part; each then goes on from a copy of the cache it
    shared, and every behaviour logprob is still a full forward's of its own context."""
    engine = Engine(model, seed=0, forward=forward)
    rows, distinct = [], []

    class Counted:  # the engine's forward, counting the rows it computes against the contexts running
        def __call__(self, batch):
            rows.append(batch.decode + batch.prefill)
            distinct.append(len({(*s.prompt_ids, *s.token_ids) for s in engine.slots}))
            return run(batch)

        def __getattr__(self, name):
            return getattr(run, name)

    run, engine.forward = engine.forward, Counted()
    params = SamplingParams(temperature=0.7, max_new_tokens=16)
    seqs = generate_all(engine, [[1, 2, 3]] * 6 + [[4, 5]] * 2, params)
    assert rows == distinct  # one row per context, every step
    assert rows[0] == 2 and max(rows) > 2 and sum(rows) < 8 * len(rows)  # shared at first, parted later
    for seq in seqs:
        logp = torch.log_softmax(full_forward_logits(model, seq) / 0.7, -1)  # [new, V]
        want = logp.gather(-1, torch.tensor(seq.token_ids)[:, None]).squeeze(-1)  # [new]
        torch.testing.assert_close(torch.tensor(seq.logprobs), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("end", ["abort", "length"])
def test_followers_go_on_alone_when_the_row_they_shared_ends(model, forward, end):
    """The sequence computing a shared context is aborted, or reaches its length limit before the others: one of
    them takes its cache, the other follows that one, and both decode as if they had been alone."""
    engine = Engine(model, forward=forward)
    first = engine.submit("s0", [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=3 if end == "length" else 12))
    others = [engine.submit(f"s{i}", [1, 2, 3], GREEDY) for i in (1, 2)]
    for _ in range(2):
        engine.step()
    assert len(engine.leads) == 2 and all(lead is first for lead in engine.leads.values())
    if end == "abort":
        assert engine.abort("s0") is first
    while not engine.idle():
        engine.step()
    assert first.finish_reason == ("length" if end == "length" else None)
    for seq in others:
        assert seq.token_ids == hf_greedy(model, [1, 2, 3], GREEDY.max_new_tokens)


def test_admission_mid_flight_does_not_change_others(model, forward):
    alone = generate_all(Engine(model, forward=forward), PROMPTS[:2], GREEDY)
    engine = Engine(model, forward=forward)
    first = [engine.submit(f"a{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:2])]
    engine.step()
    engine.step()
    capacity = engine.kv.shape[-2]
    # long enough to make the slot cache grow while the first two are mid-flight
    later = [
        engine.submit(f"b{i}", p, SamplingParams(temperature=0.0, max_new_tokens=70)) for i, p in enumerate(PROMPTS[2:])
    ]
    while not engine.idle():
        engine.step()
    assert engine.kv.shape[-2] > capacity
    assert [s.token_ids for s in first] == [s.token_ids for s in alone]
    for seq in later:
        assert seq.token_ids == hf_greedy(model, seq.prompt_ids, 70)


def test_slots_are_reused_and_the_cache_allocated_once(model, forward):
    engine = Engine(model, max_batch=2, forward=forward)
    lengths = [3, 9, 1, 5, 2, 7, 4, 6]
    seqs = [
        engine.submit(f"s{i}", PROMPTS[i % 4], SamplingParams(temperature=0.0, max_new_tokens=n))
        for i, n in enumerate(lengths)
    ]
    storage, slot_steps = None, 0
    while not engine.idle():
        finished = engine.step()
        used = len(engine.slots) + len(finished)  # slots that decoded in this step
        slot_steps += used
        storage = storage or engine.kv.data_ptr()
        assert engine.kv.data_ptr() == storage and engine.kv.shape[2] == 2  # allocated once, two slots
        assert used <= 2 and all(s.finish_reason for s in finished)
        if engine.waiting:  # a finished sequence's slot is refilled at the very next step
            assert used == 2
    assert slot_steps == sum(lengths)  # every slot-step produced a token: no slot idled, none held a finished sequence
    for seq, n in zip(seqs, lengths, strict=True):
        assert seq.token_ids == hf_greedy(model, seq.prompt_ids, n)


ARCHITECTURES = {  # tiny configs of other families: two with the direct forward, two through the HF fallback
    "llama": (LlamaConfig, LlamaForCausalLM, {}, DirectForward),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}, DirectForward),
    "gemma": (GemmaConfig, GemmaForCausalLM, {"head_dim": 16}, HFForward),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}, HFForward),
}


@pytest.mark.parametrize("family", ARCHITECTURES)
def test_other_architectures_match_hf_generate(family):
    config_cls, model_cls, extra, forward_cls = ARCHITECTURES[family]
    torch.manual_seed(0)
    model = model_cls(
        config_cls(
            vocab_size=16,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=128,
            **extra,
        )
    ).eval()
    engine = Engine(model)
    assert isinstance(engine.forward, forward_cls)
    for prompt, seq in zip(PROMPTS, generate_all(engine, PROMPTS, GREEDY), strict=True):
        assert seq.token_ids == hf_greedy(model, prompt, GREEDY.max_new_tokens)


def test_hf_fallback_without_rotary_or_grouped_heads():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=16, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0)
    ).eval()
    for prompt, seq in zip(PROMPTS, generate_all(Engine(model), PROMPTS, GREEDY), strict=True):
        assert seq.token_ids == hf_greedy(model, prompt, GREEDY.max_new_tokens)


def test_sliding_window_models_are_refused():
    model = MistralForCausalLM(
        MistralConfig(
            vocab_size=16,
            hidden_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=128,
            sliding_window=32,
        )
    )
    with pytest.raises(NotImplementedError, match="sliding"):
        Engine(model)


def test_finish_reasons_and_max_batch(model, forward):
    engine = Engine(model, max_batch=2, forward=forward)
    free = generate_all(Engine(model), [PROMPTS[1]], GREEDY)[0].token_ids
    stop_at = free[3]
    first_stop = free.index(stop_at)
    stop_params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop_at,))
    stopped = engine.submit("stop", PROMPTS[1], stop_params)
    short = engine.submit("short", PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=2))
    queued = [engine.submit(f"q{i}", p, SamplingParams(max_new_tokens=3)) for i, p in enumerate(PROMPTS)]
    assert len(engine.running()) == 6
    done = []
    while not engine.idle():
        done += engine.step()
        assert len(engine.slots) <= 2
    assert sorted(s.key for s in done) == sorted(s.key for s in [stopped, short, *queued])
    assert stopped.finish_reason == "stop" and stopped.token_ids == free[: first_stop + 1]
    assert short.finish_reason == "length" and len(short.token_ids) == 2
    assert all(s.finish_reason in ("stop", "length") and len(s.token_ids) <= 3 for s in queued)
    with pytest.raises(ValueError):
        engine.submit("bad", [1], SamplingParams(top_p=0.0))
    with pytest.raises(ValueError):
        engine.submit("bad", [1], SamplingParams(top_k=-1))


class WordTokenizer:
    """A tokenizer for the 16-token test models: token i is WORDS[i], of one to three characters (some ending
    inside what a stop string spans)."""

    WORDS = ("a", "bc", "d", "ef", "g", "hij", "k", "l", "mn", "o", "pq", "r", "st", "u", "vw", "xyz")

    def __init__(self):
        self.decoded = []  # the length of every id list decoded

    def decode(self, ids: list[int]) -> str:
        self.decoded.append(len(ids))
        return "".join(self.WORDS[i] for i in ids)


def first_completing(tokens: list[int], stop: str) -> int:
    """Tokens a completion keeps under `stop`: up to the first whose text completes it (decoding it all)."""
    words = WordTokenizer()
    return next(n for n in range(1, len(tokens) + 1) if stop in words.decode(tokens[:n]))


@pytest.mark.parametrize("start,end", [(4, 6), (0, 1), (2, 9)])
def test_stop_cut_keeps_tokens_up_to_the_one_completing_a_stop_string(start, end):
    tokens = [7, 1, 12, 5, 15, 3, 9, 14, 2, 11]  # "l bc st hij xyz ef o vw d r"
    text = "".join(WordTokenizer.WORDS[i] for i in tokens)
    stop = text[start:end]
    want = first_completing(tokens, stop)
    words = WordTokenizer()
    cuts = [stop_cut(tokens[:n], [tokens[n]], (stop, "nowhere"), words) for n in range(len(tokens))]
    assert cuts[:want] == [None] * (want - 1) + [1]  # the engine checks after every token: the first one counts
    if want > 2:  # several new tokens at once (vLLM's outputs), after two without it
        assert stop_cut(tokens[:2], tokens[2:], ("nowhere", stop), WordTokenizer()) == want - 2
    assert max(words.decoded) == len("nowhere") + 1  # a tail only: the longest stop string's bytes, plus one


def test_stop_strings_end_a_sequence_keeping_the_stop_string(model, forward):
    words = WordTokenizer()
    free = generate_all(Engine(model, forward=forward), [PROMPTS[1]], GREEDY)[0].token_ids
    text = words.decode(free)
    stop = text[len(words.decode(free[:5])) - 1 :][:3]  # from the last letter of the 5th token: across tokens
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop=(stop,))
    engine = Engine(model, forward=forward, tokenizer=words)
    stopped, other = generate_all(engine, [PROMPTS[1], PROMPTS[0]], params)
    keep = first_completing(free, stop)
    assert stopped.finish_reason == "stop" and stopped.token_ids == free[:keep] and stop in words.decode(free[:keep])
    assert len(stopped.logprobs) == len(stopped.versions) == keep
    assert other.finish_reason == "stop" or stop not in words.decode(other.token_ids)
    with pytest.raises(ValueError, match="tokenizer"):
        Engine(model, forward=forward).submit("no tokenizer", PROMPTS[0], params)
    with pytest.raises(ValueError, match="non-empty"):
        engine.submit("empty", PROMPTS[0], SamplingParams(stop=("",)))


def test_the_cache_is_sized_by_the_sequences_admitted_not_a_worst_case(model, forward):
    """Rows for the slots in use (multiples of 8, doubling), positions for the longest prompt + max_new_tokens among
    them (multiples of 64): not max_batch slots; grown, keeping every cached token, when more or longer come."""
    engine = Engine(model, max_batch=64, forward=forward)
    short, long = (SamplingParams(temperature=0.0, max_new_tokens=n) for n in (40, 70))  # budgets of <= 47, 77
    first = [engine.submit(f"a{i}", p, short) for i, p in enumerate(PROMPTS[:3])]
    for _ in range(20):
        engine.step()
    assert tuple(engine.kv.shape[2::2]) == (8, 64)
    later = [engine.submit(f"b{i}", p, long) for i, p in enumerate(PROMPTS * 3)]
    while not engine.idle():
        engine.step()
    assert tuple(engine.kv.shape[2::2]) == (16, 128)  # 15 slots
    for seq in first + later:
        assert seq.token_ids == hf_greedy(model, seq.prompt_ids, seq.params.max_new_tokens)


def test_cache_mb_runs_fewer_sequences_at_once_and_keeps_the_cache_within_it(model, forward):
    """1 MB holds 32 slots of 64 positions of this model: 32 run at once, never more cache than that, each as it
    would alone; a lone sequence needing more than the budget still runs."""
    engine = Engine(model, max_batch=64, forward=forward, cache_mb=1)
    layers, kv_heads, head_dim = engine.kv_shape
    positions = (1 << 20) // (2 * layers * kv_heads * head_dim * 4)  # float32 keys and values
    assert engine.cache_positions == positions == 32 * 64
    params = SamplingParams(temperature=0.0, max_new_tokens=40)  # budgets of <= 47: 64 positions each
    seqs = [engine.submit(f"s{i}", PROMPTS[i % 4], params) for i in range(37)]
    most = 0
    while not engine.idle():
        engine.step()
        most = max(most, len(engine.slots))
        assert engine.kv.shape[2] * engine.kv.shape[-2] <= positions
    assert most == 32
    for seq in seqs:
        assert seq.token_ids == hf_greedy(model, seq.prompt_ids, 40)
    lone = Engine(model, forward=forward, cache_mb=1)
    lone.cache_positions = 64  # a budget below one sequence's 128 positions
    long = generate_all(lone, [PROMPTS[1], PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=100))
    assert [len(seq.token_ids) for seq in long] == [100, 100] and lone.kv.shape[2] == 1  # one at a time
