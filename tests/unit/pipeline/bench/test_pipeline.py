"""bench pipeline: the window (rates after warm-up, the trainer's busy share) from metrics lines, the configs
of the three runs (the task's, default chain; --model's real-model config), the shared model, the cores per
role, each run's model FLOPs utilisation and the table.

Nothing runs a pipeline or builds a model here."""

import argparse
import json
from pathlib import Path

from pipeline.bench import bench_task, cores_given, cores_line, task_config, with_model
from pipeline.bench.pipeline import (
    cpu_bound,
    flops_line,
    model_flops,
    out_path,
    rollout_bound,
    rollout_utilisation,
    run_settings,
    shared_model,
    straggler_bound,
    table,
    variant_configs,
    window_rates,
)
from pipeline.cli import build_parser
from pipeline.config import resolve
from workers import flops


def trainer(step: int, time: float, step_seconds: float) -> dict:
    return {
        "source": "trainer",
        "step": step,
        "time": time,
        "step_seconds": step_seconds,
        "trained_tokens": 100 * step,
        "staleness_mean": 1.0,
        "interrupted_trajectories": step,
        "time_train": step_seconds / 2,
        "write_seconds": step / 1000,  # the version's file: 1 ms at step 1, ...
        "fb_gflops": 10.0 * step,  # the trainer's own model FLOPs: 30 at step 3, 40 at step 4
        **({"fb_mfu": 0.01 * step} if step != 4 else {}),  # a step without a ceiling has no fb_mfu
        **({"time_checkpoint": 1.0} if step == 4 else {}),  # every few steps only
    }


def test_window_rates_after_warm_up():
    lines = [
        trainer(1, 0.0, 9.0),
        trainer(2, 1.0, 0.5),
        trainer(3, 2.0, 0.25),
        trainer(4, 3.0, 0.75),
        {"source": "rollout", "time": 1.0, "generated_tokens": 50, "weight_loads": 1, "weights_load_seconds": 0.1},
        {"source": "rollout", "time": 3.0, "generated_tokens": 450, "weight_loads": 5, "weights_load_seconds": 0.14},
    ]
    engine = (
        {"engine_steps": 10, "engine_tokens": 100, "engine_seconds": 0.2},
        {"engine_steps": 30, "engine_tokens": 900, "engine_seconds": 1.0},
    )
    lines[-2].update(engine[0])
    lines[-1].update(engine[1])
    rates = window_rates(lines, warmup_steps=2)  # from step 2 (t=1) to step 4 (t=3): steps 3 and 4
    assert rates["steps_measured"] == 2 and rates["seconds"] == 2.0
    assert rates["trained_tokens_per_s"] == 100.0 and rates["steps_per_s"] == 1.0
    assert rates["generated_tokens_per_s"] == 200.0
    assert rates["train_step_seconds"] == 0.5 and rates["trainer_busy"] == 0.5  # (0.25 + 0.75) / 2 s
    assert rates["window"] == (1.0, 3.0)  # where the CPU sampler reads the cores used
    assert rates["step_breakdown"] == {"checkpoint": 0.5, "train": 0.25}  # means over steps 3 and 4
    assert rates["write_ms_per_version"] == 3.5  # steps 3 and 4 wrote in 3 and 4 ms
    assert rates["load_ms_per_version"] == 10.0  # 4 versions loaded in 40 ms over the window
    assert rates["engine_rows_per_step"] == 40.0  # 800 tokens in 20 steps
    assert rates["engine_busy"] == 0.4 and rates["engine_ms_per_token"] == 1.0  # 0.8 s of 2, for 800 tokens
    assert rates["fb_gflops"] == 35.0 and rates["fb_mfu"] == 0.03  # means over steps 3 and 4, of those that have it


def test_each_rollout_workers_counters_are_its_own():
    lines = [trainer(1, 0.0, 1.0), trainer(2, 1.0, 1.0), trainer(3, 3.0, 1.0)]
    for worker, tokens, loads in (("a", 100, 3), ("b", 5000, 40)):  # b started earlier: higher counters
        lines += [
            {
                "source": "rollout",
                "worker": worker,
                "time": 1.0,
                "generated_tokens": tokens,
                "weight_loads": loads,
                "weights_load_seconds": loads / 100,
            },
            {
                "source": "rollout",
                "worker": worker,
                "time": 3.0,
                "generated_tokens": tokens + 400,
                "weight_loads": loads + 2,
                "weights_load_seconds": (loads + 2) / 100,
            },
        ]
    lines.sort(key=lambda line: line["time"])
    rates = window_rates(lines, warmup_steps=2)
    assert rates["generated_tokens_per_s"] == 400.0  # 200 tok/s each
    assert rates["load_ms_per_version"] == 10.0


def test_runs_without_weights_timings_report_none():
    lines = [trainer(1, 0.0, 1.0), trainer(2, 1.0, 1.0), {"source": "rollout", "time": 1.0, "generated_tokens": 5}]
    for line in lines[:2]:
        del line["write_seconds"]
    rates = window_rates(lines, warmup_steps=1)
    assert rates["write_ms_per_version"] is None and rates["load_ms_per_version"] is None
    assert rates["fb_gflops"] == 20.0 and rates["fb_mfu"] == 0.02  # step 2's
    assert rates["engine_rows_per_step"] is None and rates["engine_busy"] is None


SHAPE = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "vocab_size": 100,
}
# N = 2 layers x (q, k, v, o: 64 x 16 x 16 + gate, up, down: 3 x 64 x 128) + the LM head 64 x 100 = 88,320


def rollout(worker: str, time: float, tokens: int) -> dict:
    return {"source": "rollout", "worker": worker, "time": time, "generated_tokens": tokens}


def test_rollout_model_flops_are_2n_per_generated_token_over_each_workers_time():
    lines = [rollout("a", 1.0, 1000), rollout("b", 2.0, 7), rollout("a", 3.0, 501_000), rollout("b", 3.0, 100_007)]
    # a: 250,000 tok/s x 176,640 FLOPs = 44.16 GFLOP/s; b: 100,000 tok/s = 17.664; over 100 GFLOP/s x 2 cores
    assert rollout_utilisation(lines, SHAPE, ceiling=100.0, cores=2) == {
        "rollout_gflops": 61.824,
        "rollout_mfu": 0.3091,
    }
    assert rollout_utilisation(lines, SHAPE, ceiling=0.0, cores=2) == {"rollout_gflops": 61.824, "rollout_mfu": None}
    unmeasured = {"rollout_gflops": None, "rollout_mfu": None}
    assert rollout_utilisation(lines, None, ceiling=100.0, cores=2) == unmeasured  # a model flops cannot count
    assert rollout_utilisation(lines[:2], SHAPE, ceiling=100.0, cores=2) == unmeasured  # one line per worker


def test_the_flops_line_names_n_and_the_ceiling_in_the_runs_dtype():
    model = {
        "dtype": "bfloat16",
        "ceiling_gflops_per_core": 1013.2,
        "cpu_model": "Intel Xeon",
        "matmul_parameters": 88_320,
    }
    assert flops_line(model) == (
        "model FLOPs: N = 88,320 matmul parameters; ceiling 1,013.2 GFLOP/s per core in bfloat16 (one thread, "
        "a 512x1024 by 1024x1024 product; Intel Xeon)"
    )
    on_gpu = {**model, "ceiling_gflops_per_core": 0.0, "matmul_parameters": None}
    assert flops_line(on_gpu) == "model FLOPs: not counted; no ceiling measured (bfloat16 off a CPU): no MFU"


def test_model_flops_count_the_models_config_and_probe_no_ceiling_off_a_cpu(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SHAPE))
    config = with_model(task_config("arith", ["model.device=cuda", "model.dtype=bfloat16"]), str(tmp_path))
    assert model_flops(config) == {
        "dtype": "bfloat16",
        "ceiling_gflops_per_core": 0.0,
        "cpu_model": flops.cpu_model(),
        "matmul_parameters": 88_320,
        "shape": SHAPE,
    }
    (tmp_path / "config.json").write_text(json.dumps({"n_embd": 64}))  # a GPT-2's names: not counted
    assert model_flops(config)["matmul_parameters"] is None and model_flops(config)["shape"] is None


def args_for(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "pipeline", *argv])


def test_the_task_defaults_to_chain_with_its_own_output_length():
    args = args_for()
    configs, max_new_tokens = variant_configs(args)
    assert bench_task(args, "chain") == "chain" and list(configs) == ["sync", "async", "async_no_interrupt"]
    assert max_new_tokens == resolve(task_config("chain", [])).rollout.max_new_tokens  # chain.yaml's, else 288
    assert {(c.data.task, c.rollout.max_new_tokens) for c in configs.values()} == {("chain", max_new_tokens)}
    assert out_path(args) == Path("runs/bench/pipeline-chain.json")


def test_each_variant_is_the_tasks_config_with_the_bench_settings_and_its_own(tmp_path):
    out = tmp_path / "p.json"
    configs, max_new_tokens = variant_configs(args_for("--task", "arith", "--out", str(out), "rollout.max_batch=16"))
    assert max_new_tokens == 16  # arith's own (arith.yaml leaves rollout.max_new_tokens at 0)
    assert {name: (c.trainer.max_staleness, c.rollout.interrupt) for name, c in configs.items()} == {
        "sync": (0, True),
        "async": (4, True),
        "async_no_interrupt": (4, False),
    }
    for name, c in configs.items():
        assert (c.data.task, c.name, c.runs_dir, c.trainer.steps, c.trainer.optim.lr) == (
            "arith",
            f"bench-{name}",
            str(tmp_path / "pipeline-runs"),
            60,
            1e-9,
        )
        assert (c.trainer.batch_groups, c.data.n_samples, c.eval.every, c.rollout.max_batch) == (8, 8, 0, 16)
    given, _ = variant_configs(args_for("--task", "arith", "--max-new-tokens", "50"))
    assert {c.rollout.max_new_tokens for c in given.values()} == {50}


def test_model_runs_the_real_model_config_with_its_own_batch_lr_and_sampling(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    (cache / "smollm2").mkdir(parents=True)
    (cache / "smollm2" / "asyncrl-import.json").write_text("{}")  # an imported model, as `model import` leaves it
    monkeypatch.setenv("ASYNCRL_MODEL_CACHE", str(cache))
    args = args_for("--model", "smollm2", "--steps", "3", "--eval-rows", "4")
    configs, max_new_tokens = variant_configs(args)
    assert out_path(args) == Path("runs/bench/pipeline-smollm2-math.json") and max_new_tokens == 160
    for c in configs.values():
        assert (c.data.task, c.data.template, c.model.path, c.trainer.steps, c.eval.max_rows) == (
            "wordmath",
            "chat",
            "smollm2",
            3,
            4,
        )
        assert (c.trainer.batch_groups, c.data.n_samples, c.trainer.optim.lr, c.rollout.temperature) == (
            2,
            8,
            1e-5,
            0.8,
        )
        assert (c.trainer.loss.aggregation, c.max_wall_s, c.eval.every) == ("seq_mean", 0.0, 0)
    assert resolve(configs["sync"]).model.path == str(cache / "smollm2")
    assert shared_model(configs, progress=False) == configs  # no demo model is built
    settings = run_settings(args, configs["async"], max_new_tokens)
    assert (settings["steps"], settings["batch_groups"], settings["n_samples"], settings["lr"]) == (3, 2, 8, 1e-5)
    assert (settings["task_config"], settings["template"]) == ("smollm2-math", "chat")
    assert settings["model"] == "smollm2, given by --model, shared by the three runs"
    given, _ = variant_configs(args_for("--model", str(tmp_path), "--batch-groups", "4", "--lr", "2e-6"))
    c = given["async"]
    assert (c.model.path, c.trainer.steps, c.trainer.batch_groups, c.trainer.optim.lr) == (str(tmp_path), 80, 4, 2e-6)


def test_one_demo_model_for_the_task_and_seed_serves_the_three_runs(monkeypatch):
    import pipeline.demo_model

    calls = []

    def fake_prepare(out_dir, task, **kwargs):
        calls.append((Path(out_dir).name, task, kwargs))
        return out_dir

    monkeypatch.setattr(pipeline.demo_model, "prepare_demo_model", fake_prepare)
    configs = shared_model(variant_configs(args_for("--task", "arith", "--seed", "3"))[0], progress=False)
    assert calls == [
        (
            "arith-seed3",
            "arith",
            {"seed": 3, "task_seed": 3, "steps": 150, "progress": False, "held_out": 200, "workflow": None},
        )
    ]  # 150: arith's warm-up cap, as `asyncrl run` resolves it
    assert len({c.model.path for c in configs.values()}) == 1 and configs["sync"].model.path.endswith("arith-seed3")


def test_cpu_bound_is_work_per_step_against_the_cores():
    runs = {
        "sync": {"steps_per_s": 0.5, "cpu_cores": {"rollout": 1.0, "trainer": 0.25}},  # 2.5 core-seconds a step
        "async": {"steps_per_s": 1.0, "cpu_cores": {"rollout": 1.5, "trainer": 0.3, "broker": 0.2}},  # 2.0
    }
    assert cpu_bound(runs, usable_cores=2) == {
        "core_seconds_per_step": {"sync": 2.5, "async": 2.0},
        "async_ceiling_steps_per_s": 1.0,  # async already keeps both cores busy
        "async_ceiling_over_sync": 2.0,
    }
    assert cpu_bound(runs, usable_cores=4)["async_ceiling_over_sync"] == 4.0
    runs["async"]["cpu_cores"] = {}  # a window shorter than the CPU sampler's interval: no samples, no division
    assert cpu_bound(runs, usable_cores=2) is None


def test_a_busy_rollout_beside_idle_cores_is_named_with_the_fix():
    one_worker = cores_given(task_config("chain", []), cpu_count=2, usable_cores=2)
    busy = {"cpu_cores": {"rollout": 0.96, "trainer": 0.28, "broker": 0.05}}  # 0.71 of 2 cores idle
    assert rollout_bound(busy, one_worker) == (
        "the rollout worker(s) used 0.96 of the 1 core(s) given them while 0.71 stood idle: generation bounds this "
        "run; more workers can use the idle cores (rollout.workers=2 broker.partitions=2)"
    )
    assert rollout_bound({"cpu_cores": {"rollout": 0.8, "trainer": 0.3}}, one_worker) is None  # room in its core
    assert rollout_bound({"cpu_cores": {"rollout": 0.96, "trainer": 0.7}}, one_worker) is None  # no core idle
    two_workers = cores_given(
        task_config("chain", ["rollout.workers=2", "broker.partitions=2"]), cpu_count=2, usable_cores=2
    )
    assert rollout_bound({"cpu_cores": {"rollout": 1.33, "trainer": 0.37}}, two_workers) is None


def test_a_trainer_waiting_for_due_stragglers_is_named():
    # the trainer's step breakdown (s) of `asyncrl bench pipeline --task chain rollout.workers=2 broker.partitions=2`
    # on 2 cores of an AMD EPYC, 2026-11-25
    held = {"step_breakdown": {"train": 0.397, "wait": 0.394, "wait_due": 0.373}}
    assert straggler_bound(held) == (
        "the trainer waited 0.394 s a step, 0.373 s of it for stragglers of groups due at their staleness deadline "
        "while a batch was ready: long answers hold training back (a larger trainer.max_staleness gives them more "
        "versions; with trainer.max_in_flight, at no more staleness for the others)"
    )
    assert straggler_bound({"step_breakdown": {"wait": 0.394, "wait_due": 0.1}}) is None  # mostly generation
    assert straggler_bound({"step_breakdown": {"wait": 0.04, "wait_due": 0.04}}) is None  # too short to matter
    assert straggler_bound({"step_breakdown": {"wait": 1.3}}) is None  # a summary without wait_due


def test_cores_given_per_role_against_the_machine():
    given = ["rollout.workers=2", "broker.partitions=2", "rollout.threads=3", "trainer.ranks=2", "reward.processes=4"]
    config = task_config("arith", given)
    cores = cores_given(config, cpu_count=16, usable_cores=8)
    assert cores == {
        "rollout": {"processes": 2, "threads": 3},
        "trainer": {"processes": 2, "threads": 1},
        "reward": {"processes": 4, "threads": 1},
        "threads_total": 12,
        "usable_cores": 8,
        "cpu_count": 16,
    }
    assert cores_line(cores) == (
        "cores given: rollout 2 process(es) x 3 thread(s), trainer 2 process(es) x 1 thread(s), "
        "reward 4 process(es) x 1 thread(s); 12 threads in all on 8 usable cores (machine: 16)"
    )
    inline = cores_given(task_config("arith", []), cpu_count=2, usable_cores=2)  # arith.yaml: reward.processes=0
    assert "reward scored in the reward worker (reward.processes=0)" in cores_line(inline)


def test_the_table_names_the_task_and_the_cores_given_and_used():
    run = {
        "trained_tokens_per_s": 2915.04,
        "steps_per_s": 0.5,
        "generated_tokens_per_s": 3000.0,
        "staleness_mean": 4.0,
        "interrupted_trajectories": 12,
        "trainer_busy": 0.97,
        "cpu_cores": {"trainer": 0.9, "rollout": 0.83},
        "step_breakdown": {"wait": 0.01, "train": 0.3812},
        "write_ms_per_version": 11.4,
        "load_ms_per_version": 9.87,
        "engine_rows_per_step": 41.5,
        "engine_busy": 0.82,
        "engine_ms_per_token": 0.25,
        "rollout_gflops": 12.3456,
        "rollout_mfu": 0.0122,
        "fb_gflops": 45.6,
        "fb_mfu": None,
    }
    settings = {"task": "chain", "steps": 60, "batch_groups": 8, "n_samples": 8, "max_new_tokens": 288}
    report = {
        "runs": {"async": run},
        "settings": {**settings, "warmup_steps": 10},
        "cores_given": cores_given(task_config("arith", []), cpu_count=2, usable_cores=2),
        "cpu_bound": {
            "core_seconds_per_step": {"async": 3.46},
            "async_ceiling_steps_per_s": 0.578,
            "async_ceiling_over_sync": 2.89,
        },
        "model_flops": {
            "dtype": "float32",
            "ceiling_gflops_per_core": 150.0,
            "cpu_model": "",
            "matmul_parameters": 88_320,
        },
        "async_over_sync": 2.2834,
        "interrupt_on_over_off": 0.98,
        "interrupt_on_over_off_trained": 0.981,
    }
    lines = table(report).splitlines()
    assert lines[0] == "task chain: 60 steps of 8 x 8 samples, outputs up to 288 tokens, measured after step 10"
    assert lines[2] == "async                       2915.0    0.500          3000.0      4.00          12          97%"
    assert lines[3] == (
        "cores given: rollout 1 process(es) x 1 thread(s), trainer 1 process(es) x 1 thread(s), "
        "reward scored in the reward worker (reward.processes=0); 2 threads in all on 2 usable cores (machine: 2)"
    )
    assert lines[4] == "async cores used: trainer 0.90, rollout 0.83 (total 1.73)"
    assert lines[5] == (
        "core-seconds per step: async 3.46; all 2 usable cores busy with async's work: 0.578 steps/s, 2.89x sync "
        "(this machine's ceiling)"
    )
    assert lines[6:] == [
        "trainer step breakdown, mean seconds per step:",
        "  async: wait 0.010, train 0.381",
        "weights per version, ms: trainer write + hash | rollout interrupt + read, hash and load",
        "  async: 11.4 | 9.87",
        "rollout engines: rows per step | share of the workers' time in steps | ms per token",
        "  async: 41.5 | 0.82 | 0.25",
        "model FLOPs: N = 88,320 matmul parameters; ceiling 150.0 GFLOP/s per core in float32 (one thread, "
        "a 512x1024 by 1024x1024 product; CPU model unknown)",
        "  rollout: 2N a generated token over the window, MFU over its 1 core(s); trainer: its forwards' and "
        "backwards' fb_gflops and fb_mfu, means over the measured steps",
        "  async: rollout 12.35 GFLOP/s (MFU 1.22%), trainer 45.60 GFLOP/s",
        "async/sync effective training throughput: 2.28x",
        "interruption on/off generation throughput: 0.98x (training throughput 0.98x)",
    ]
    busy = {**report, "runs": {"async": {**run, "cpu_cores": {"rollout": 0.96, "trainer": 0.28}}}}
    assert table(busy).splitlines()[6] == f"async: {rollout_bound(busy['runs']['async'], report['cores_given'])}"
    held = {**run, "step_breakdown": {"wait": 0.394, "wait_due": 0.373, "train": 0.397}}
    assert table({**report, "runs": {"async": held}}).splitlines()[6] == f"async: {straggler_bound(held)}"
    unmeasured = {**report, "cpu_bound": None, "interrupt_on_over_off": None, "interrupt_on_over_off_trained": None}
    unmeasured["runs"] = {"async": {**run, "cpu_cores": {}}}  # a run too short for the CPU sampler
    lines = table(unmeasured).splitlines()
    assert lines[4] == "async cores used: not measured"  # not "0.00", and no idle cores to fill
    assert (
        lines[5] == "core-seconds per step: not measured (a run's window was shorter than the CPU sampler's interval)"
    )
    assert lines[-1] == "interruption on/off generation throughput: not measured (training throughput not measured)"
