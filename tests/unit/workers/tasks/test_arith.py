"""The built-in demo: task rows, verifier, tokenizer, model and warm-up (fast, CPU)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.demo_model import build_model, build_tokenizer, completion_loss, exact_match, sft_batch, warm_up
from workers.tasks import EOS_TEXT, Problem
from workers.tasks.arith import Arith

ARITH = Arith()
score = ARITH.score


def all_problems() -> list[dict[str, str]]:
    return [{"prompt": p.prompt, "answer": p.answer} for p in ARITH.problems(0)]


def split_rows(seed: int = 0, n_heldout: int = 200) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    train, held_out = ARITH.split(seed, n_heldout)
    return [{"prompt": p.prompt, "answer": p.answer} for p in train], [
        {"prompt": p.prompt, "answer": p.answer} for p in held_out
    ]


def test_split_is_disjoint_complete_and_deterministic():
    train, held_out = split_rows(seed=3, n_heldout=200)
    assert len(train) == 700 and len(held_out) == 200
    train_prompts, held_prompts = {r["prompt"] for r in train}, {r["prompt"] for r in held_out}
    assert not train_prompts & held_prompts
    assert train_prompts | held_prompts == {r["prompt"] for r in all_problems()}
    assert split_rows(seed=3, n_heldout=200) == (train, held_out)
    assert split_rows(seed=4, n_heldout=200)[1] != held_out


def test_rows_are_correct_sums():
    rows = all_problems()
    assert len(rows) == 900
    assert {"prompt": "47+8=", "answer": "55"} in rows
    for row in rows:
        a, b = row["prompt"].rstrip("=").split("+")
        assert 10 <= int(a) <= 99 and 0 <= int(b) <= 9 and int(row["answer"]) == int(a) + int(b)


def test_score_exact_values():
    assert score("55", "55") == 1.0
    assert score("56", "55") == 0.0
    assert score("", "55") == 0.0
    assert score("55" + EOS_TEXT, "55") == 1.0
    assert score("55" + EOS_TEXT + "<pad><pad>", "55") == 1.0
    assert score(" 55 \n", "55") == 1.0
    assert score("5", "55") == 0.0
    assert score("550", "55") == 0.0
    assert score(EOS_TEXT + "55", "55") == 0.0


def test_tokenizer_one_token_per_character_and_reloads(tmp_path):
    build_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer("47+8=")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == list("47+8=")
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == "47+8="
    assert tokenizer.decode([*ids, tokenizer.eos_token_id]) == "47+8=" + EOS_TEXT
    assert tokenizer.pad_token_id is not None and tokenizer.eos_token_id is not None
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert len(tokenizer) <= 16


def test_whitespace_survives_the_reload_of_a_model_directory(tmp_path):
    """transformers 5 loads a qwen2 directory's tokenizer as a Qwen2Tokenizer (byte-level): spaces and newlines
    must still be one token each, the same ids as the tokenizer warm-up trained with."""
    from workers.tasks.code import Code

    built = build_tokenizer(tmp_path, Code.alphabet)
    build_model(tmp_path, built, recipe=Code.demo)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "add 3, times 2\ndef f(x):\n x=x+3\n x=x*2\n return x"
    ids = built(text, add_special_tokens=False)["input_ids"]
    assert reloaded(text, add_special_tokens=False)["input_ids"] == ids and len(ids) == len(text)
    assert reloaded.decode([*ids, reloaded.eos_token_id], skip_special_tokens=True) == text == built.decode(ids)


def test_model_size_and_reload(tmp_path):
    tokenizer = build_tokenizer(tmp_path)
    model = build_model(tmp_path, tokenizer, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    assert 2.0e6 < n_params < 2.4e6
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.dtype == torch.float32
    assert reloaded.config.tie_word_embeddings
    for (name, p), (_, q) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
    same_seed = build_model(tmp_path / "again", tokenizer, seed=0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), same_seed.parameters(), strict=True))


def test_warm_up_reduces_loss(tmp_path):
    torch.set_num_threads(1)
    tokenizer = build_tokenizer(tmp_path)
    model = build_model(tmp_path, tokenizer, seed=0)
    rows = ARITH.split(0, 200)[0][:64]
    batch = sft_batch(tokenizer, rows)
    with torch.no_grad():
        before = completion_loss(model, *batch).item()
    losses = warm_up(model, tokenizer, rows, steps=8, batch_size=32, seed=0, progress=False)
    with torch.no_grad():
        after = completion_loss(model, *batch).item()
    assert len(losses) == 8
    assert after < before - 0.3


def test_sft_batch_learns_only_the_completion(tmp_path):
    tokenizer = build_tokenizer(tmp_path)
    rows = [Problem("47+8=", "55", "55"), Problem("10+0=", "10", "10")]
    ids, attention, learn = sft_batch(tokenizer, rows)
    assert tokenizer.decode(ids[0]) == "47+8=55" + EOS_TEXT
    assert learn[0].tolist() == [False] * 5 + [True] * 3
    assert attention.tolist() == [[1] * 8, [1] * 8]


def test_exact_match_probe_stops_warm_up(tmp_path):
    tokenizer = build_tokenizer(tmp_path)
    model = build_model(tmp_path, tokenizer, seed=0)
    rows = ARITH.split(0, 200)[0][:32]
    assert exact_match(model, tokenizer, rows) == 0.0
    losses = warm_up(model, tokenizer, rows, steps=50, seed=0, probe_rows=rows, target_accuracy=0.0, progress=False)
    assert len(losses) == 2  # the first probe (every 2 steps) already meets a zero target
