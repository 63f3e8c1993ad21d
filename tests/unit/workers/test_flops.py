"""Model FLOPs per token and the MFU arithmetic, on a tiny config counted by hand."""

import pytest
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
    assert flops.body_parameters(TINY) == 2 * (192 + 384) == 1152 and flops.head_parameters(TINY) == 80
    assert flops.matmul_parameters(TINY) == 2 * (192 + 384) + 80 == 1232
    wide_heads = {**TINY, "head_dim": 6}  # q and o 8x12, k and v 8x6 = 288
    assert flops.matmul_parameters(wide_heads) == 2 * (288 + 384) + 80 == 1424
    assert flops.attention_width(TINY) == 8 and flops.attention_width(wide_heads) == 12


@pytest.mark.parametrize("tied", [False, True], ids=["own head", "head tied to the embedding"])
def test_matmul_parameters_equal_a_built_models_linear_weights(tied):
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tied))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert flops.matmul_parameters(TINY) == linear  # a tied head is a matmul all the same, counted once
    assert flops.head_parameters(TINY) == model.get_output_embeddings().weight.numel()


def test_forward_train_and_generate_flops():
    # 3 positions at contexts 1, 2, 3: 2 x 1232 x 3 + 4 x 2 layers x width 8 x (1 + 2 + 3)
    assert flops.forward_flops(TINY, 3, 6) == 7392 + 384 == 7776
    assert flops.train_flops(TINY, 3, 6) == 3 * 7776
    # a 2-token prompt and 2 new tokens: positions 0..2 are forwarded (the last token is never fed back)
    assert flops.generate_flops(TINY, prompt=2, new_tokens=2) == 7776
    assert flops.generate_flops(TINY, prompt=1, new_tokens=1) == 2 * 1232 + 4 * 2 * 8 * 1


def test_the_head_counts_only_at_the_positions_it_runs_at():
    # 3 positions at contexts 1..3, the head at 1 of them: 2 x 1152 x 3 + 2 x 80 x 1 + attention 384
    assert flops.forward_flops(TINY, 3, 6, head_positions=1) == 6912 + 160 + 384 == 7456
    assert flops.forward_flops(TINY, 3, 6, head_positions=3) == flops.forward_flops(TINY, 3, 6) == 7776
    assert flops.forward_flops(TINY, 3, 6, head_positions=0) == 6912 + 384
    assert flops.train_flops(TINY, 3, 6, head_positions=1) == 3 * 7456  # the recomputed head: once


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


def test_projection_shapes_are_a_layers_linear_weights_in_order():
    layer = LlamaForCausalLM(LlamaConfig(**TINY)).model.layers[0]
    projections = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj]
    projections += [layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
    assert flops.projection_shapes(TINY) == [(p.in_features, p.out_features) for p in projections]
    assert flops.projection_shapes(TINY) == [(8, 8), (8, 4), (8, 4), (8, 8), (8, 16), (8, 16), (16, 8)]


def test_training_products_run_the_forward_and_both_backward_products_of_each_projection(monkeypatch):
    shapes = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: shapes.append((tuple(a.shape), tuple(b.shape))) or real_mm(a, b))
    flops.training_products([(8, 4)], rows=3, dtype=torch.float32)
    assert shapes == [((3, 8), (8, 4)), ((3, 4), (4, 8)), ((4, 3), (3, 8))]  # x·Wᵀ, dY·W, dYᵀ·x


def test_pass_products_gflops_count_every_layer_and_the_head_at_its_rows(monkeypatch):
    monkeypatch.setattr(flops, "fastest_runs", lambda runs, burst_s, bursts: {"layer": 5e-6, "head": 2.5e-6})
    threads = torch.get_num_threads()
    done = 6 * (1152 * 100 + 80 * 40)  # three products of two flops per multiply-add: body at 100 rows, head at 40
    assert flops.pass_products_gflops(TINY, rows=100, head_rows=40, dtype=torch.float32) == 56.8
    assert done / (2 * 5e-6 + 2.5e-6) / 1e9 == pytest.approx(56.832)
    assert torch.get_num_threads() == threads


class FakeClock:
    """A clock that only the fake runs move: each run takes the next of its given durations."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def run(self, durations: list[float], calls: list[str], name: str):
        def one() -> None:
            calls.append(name)
            self.now += durations.pop(0)

        return one


def test_fastest_runs_take_turns_in_bursts_and_keep_each_ones_fastest_call():
    clock, calls = FakeClock(), []
    # bursts of 2.5 s: a calls of 1 s stop at the third (at 3 s); b's one call of 4 s passes the burst's end
    a = clock.run([1.0, 1.0, 1.0, 0.5, 1.0, 1.0], calls, "a")  # a's second burst: 0.5, 1, 1
    b = clock.run([4.0, 3.0], calls, "b")
    fastest = flops.fastest_runs({"a": a, "b": b}, burst_s=2.5, bursts=2, clock=clock)
    assert fastest == {"a": 0.5, "b": 3.0}
    assert calls == ["a"] * 3 + ["b"] + ["a"] * 3 + ["b"]
    assert clock.now == 3 + 4 + 2.5 + 3
    assert flops.fastest_runs({"a": a}, burst_s=1.0, bursts=0, clock=clock) == {"a": float("inf")}


def test_product_gflops_of_the_probes_product():
    # 512 x 1024 x 1024 multiply-adds = 1.073741824 GFLOP in 1 ms
    assert flops.product_gflops(512, 0.001) == 1073.7 and flops.product_gflops(32, 0.001) == 67.1
    assert flops.product_gflops(512, float("inf")) == 0.0


def test_step_utilisation_of_a_training_step():
    # 3 positions at contexts 1..3, the head at 1: 3 x 7456 FLOPs in 2 us = 11.184 GFLOP/s; ceiling 10 x 2 cores
    assert flops.step_utilisation(TINY, (3, 6, 1), 2e-6, ceiling=10.0, cores=2) == {
        "fb_gflops": 11.184,
        "fb_mfu": 0.5592,
        "fb_ceiling_gflops_per_core": 10.0,
    }
    with_reference = flops.step_utilisation(TINY, (3, 6, 1), 2e-6, ceiling=10.0, cores=2, reference=True)
    assert with_reference["fb_gflops"] == 14.912  # plus one forward
    assert flops.step_utilisation(TINY, (3, 6, 1), 2e-6, ceiling=0.0, cores=2) == {"fb_gflops": 11.184}
    assert flops.step_utilisation(TINY, (3, 6, 3), 2e-6, ceiling=0.0, cores=2) == {"fb_gflops": 11.664}
    assert flops.counts(TINY) and not flops.counts({"n_embd": 8, "n_layer": 2})
