"""`bench generate`'s pure parts."""

from pipeline.bench import generate
from pipeline.bench.generate import decode_rows


def test_decode_rows_time_one_sixteen_the_powers_of_two_from_32_and_the_concurrency():
    assert decode_rows(4) == [1, 4, 16]
    assert decode_rows(64) == [1, 16, 32, 64]
    assert decode_rows(200) == [1, 16, 32, 64, 128, 200]


def test_a_model_whose_config_flops_cannot_count_gets_no_mfu_and_one_line_saying_so():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=64))
    settings = generate.Settings(
        concurrency=2, requests=2, max_new_tokens=4, seed=0, hf_batch=None, threads=1, repeats=1
    )
    assert generate.model_utilisation(model, [[1, 2]], {}, {}, settings) is None
    report = {"utilisation": None, "settings": {"threads": 1}}
    assert generate.utilisation_lines(report) == [
        "model FLOPs: not counted (workers.flops reads a Llama-like config; this model names its sizes otherwise)"
    ]
