"""Model FLOPs per token and the MFU arithmetic, on a tiny config counted by hand."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from workers import flops

TINY = {
    "hidden_size": 8,
    "num_attention_heads": 2,  # head dim 8 / 2 = 4
    "num_key_value_heads": 1,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "vocab_size": 10,
}


def test_matmul_parameters_count_every_projection_and_the_head_not_the_embedding():
    # per layer: q 8x8, o 8x8, k 8x4, v 8x4 = 192; gate, up, down 3 x 8x16 = 384; two layers; head 8x10
    assert flops.matmul_parameters(TINY) == 2 * (192 + 384) + 80 == 1232
    wide_heads = {**TINY, "head_dim": 6}  # q and o 8x12, k and v 8x6 = 288
    assert flops.matmul_parameters(wide_heads) == 2 * (288 + 384) + 80 == 1424
    assert flops.attention_width(TINY) == 8 and flops.attention_width(wide_heads) == 12


def test_matmul_parameters_equal_a_built_models_linear_weights():
    config = LlamaConfig(**TINY, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert flops.matmul_parameters(TINY) == linear


def test_forward_train_and_generate_flops():
    # 3 positions at contexts 1, 2, 3: 2 x 1232 x 3 + 4 x 2 layers x width 8 x (1 + 2 + 3)
    assert flops.forward_flops(TINY, 3, 6) == 7392 + 384 == 7776
    assert flops.train_flops(TINY, 3, 6) == 3 * 7776
    # a 2-token prompt and 2 new tokens: positions 0..2 are forwarded (the last token is never fed back)
    assert flops.generate_flops(TINY, prompt=2, new_tokens=2) == 7776
    assert flops.generate_flops(TINY, prompt=1, new_tokens=1) == 2 * 1232 + 4 * 2 * 8 * 1


def test_gflops_and_mfu():
    assert flops.gflops(3e9, 2.0) == 1.5 and flops.gflops(1.0, 0.0) == 0.0
    assert flops.mfu(50.0, ceiling_per_core=100.0, cores=2) == 0.25
    assert flops.mfu(50.0, ceiling_per_core=0.0, cores=2) == 0.0  # no ceiling measured: no fraction


def test_cpu_model_reads_the_model_name(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu\n")
    assert flops.cpu_model(str(info)) == "AMD EPYC 9B14"
    assert flops.cpu_model(str(tmp_path / "absent")) == ""


def test_probe_ceiling_is_short_and_keeps_the_thread_count():
    threads = torch.get_num_threads()
    ceiling = flops.probe_ceiling(torch.float32, seconds=0.05)
    assert set(ceiling) == {"prefill", "decode"} and min(ceiling.values()) > 0
    assert torch.get_num_threads() == threads


def test_step_utilisation_of_a_training_step():
    # 3 positions at contexts 1..3: 3 x 7776 FLOPs in 2 us = 11.664 GFLOP/s; ceiling 10 x 2 cores
    assert flops.step_utilisation(TINY, (3, 6), 2e-6, ceiling=10.0, cores=2) == {"fb_gflops": 11.664, "fb_mfu": 0.5832}
    with_reference = flops.step_utilisation(TINY, (3, 6), 2e-6, ceiling=10.0, cores=2, reference=True)
    assert with_reference["fb_gflops"] == 15.552  # plus one forward
    assert flops.step_utilisation(TINY, (3, 6), 2e-6, ceiling=0.0, cores=2) == {"fb_gflops": 11.664}
    assert flops.counts(TINY) and not flops.counts({"n_embd": 8, "n_layer": 2})
