"""`asyncrl bench peer`: the ratio, the curves read from a run's metrics, TRL's settings (on a demo task and on
--model's real-model config), the prompts TRL is given, the report, the message without TRL, and a few real steps
of TRL's GRPOTrainer."""

import json
import sys

import pytest
from tokenizers import processors
from transformers import AutoTokenizer

from pipeline.bench import bench_task, build_demo_model, peer, task_config, with_model
from pipeline.cli import build_parser, main
from pipeline.config import ConfigError, resolve
from pipeline.demo_model import EOS_TEXT, build_tokenizer
from workers.evaluator.scoring import make_scorer
from workers.models import encode_prompt
from workers.rows import Row


def curve(*points: tuple[float, float]) -> list[dict]:
    return [{"step": 10 * i, "seconds": s, "accuracy": a} for i, (s, a) in enumerate(points)]


ASYNCRL = curve((0.0, 0.16), (50.0, 0.30), (100.0, 0.52))


def test_ratio_is_asyncrl_seconds_to_the_peer_final_over_the_peer_seconds():
    assert peer.time_to_peer_final_ratio(ASYNCRL, 0.30, 200.0) == 0.25  # equal accuracy counts as reached
    assert peer.time_to_peer_final_ratio(ASYNCRL, 0.31, 200.0) == 0.5
    assert peer.time_to_peer_final_ratio(ASYNCRL, 0.52, 50.0) == 2.0  # asyncrl slower: above 1


def test_ratio_is_none_when_never_reached_and_zero_when_the_base_already_is():
    assert peer.time_to_peer_final_ratio(ASYNCRL, 0.53, 200.0) is None
    assert peer.time_to_peer_final_ratio(ASYNCRL, 0.10, 200.0) == 0.0


def test_the_first_point_reaching_counts_even_if_accuracy_falls_later():
    assert peer.time_to_reach(curve((0.0, 0.1), (10.0, 0.5), (20.0, 0.3)), 0.4) == 10.0
    assert peer.time_to_reach([], 0.4) is None


def trainer(step: int, at: float, tokens: int) -> dict:
    return {"time": at, "source": "trainer", "step": step, "trained_tokens": tokens}


def evaluation(version: int, at: float, accuracy: float) -> dict:
    return {"time": at, "source": "eval", "step": version, "version": version, "heldout_accuracy": accuracy}


def test_asyncrl_curve_times_a_version_by_the_trainers_report_of_its_step_from_the_first_line():
    lines = [
        evaluation(0, 1000.0, 0.16),  # the base evaluation, written as the workers start
        trainer(1, 1003.0, 10),
        {"time": 1004.0, "source": "rollout", "worker": "0", "generated_tokens": 99},
        trainer(2, 1005.0, 20),
        evaluation(2, 1009.5, 0.25),  # written after its evaluation, while the trainer went on
        trainer(2, 1008.0, 20),  # a restarted trainer redid step 2: its later line stands
        trainer(3, 1012.0, 30),
        trainer(4, 1020.5, 40),
        evaluation(4, 1031.0, 0.40),
    ]
    assert peer.asyncrl_curve(lines) == [
        {"step": 0, "seconds": 0.0, "accuracy": 0.16},
        {"step": 2, "seconds": 8.0, "accuracy": 0.25},
        {"step": 4, "seconds": 20.5, "accuracy": 0.40},
    ]


def test_measured_row_from_a_curve():
    row = peer.measured(ASYNCRL, 100.0, 150.04, 40, 12_345, threads=2)
    assert row == {
        "base_accuracy": 0.16,
        "final_accuracy": 0.52,
        "wall_seconds": 100.0,
        "steps": 40,
        "steps_per_s": 0.4,
        "trained_tokens": 12_345,
        "trained_tokens_per_s": 123.5,
        "cpu_seconds": 150.0,
        "threads": 2,
        "curve": ASYNCRL,
    }


def test_trl_settings_are_the_task_configs():
    settings = peer.grpo_settings(resolve(task_config("arith", [])), 50, "out")
    assert (settings["per_device_train_batch_size"], settings["num_generations"]) == (64, 8)
    assert (settings["learning_rate"], settings["max_completion_length"], settings["max_steps"]) == (1e-4, 16, 600)
    assert (settings["loss_type"], settings["scale_rewards"], settings["temperature"]) == ("dapo", "group", 1.0)
    assert (settings["lr_scheduler_type"], settings["bf16"], settings["gradient_checkpointing"]) == (
        "constant",
        False,
        False,
    )
    chain = peer.grpo_settings(resolve(task_config("chain", [])), 50, "out")
    assert (chain["loss_type"], chain["learning_rate"], chain["max_completion_length"]) == ("grpo", 5e-5, 400)
    with pytest.raises(ConfigError, match="rloo"):
        peer.grpo_settings(resolve(task_config("arith", ["trainer.loss.advantage=rloo"])), 50, "out")


def test_trl_settings_on_the_real_model_config_are_its_own(tmp_path):
    args = build_parser().parse_args(["bench", "peer", "--model", str(tmp_path), "model.dtype=bfloat16"])
    config = resolve(task_config(bench_task(args, "arith"), peer.shared_overrides(args, tmp_path / "runs")))
    assert (config.data.task, config.data.template, config.model.path) == ("wordmath", "chat", str(tmp_path))
    settings = peer.grpo_settings(config, 25, "out")
    assert (settings["per_device_train_batch_size"], settings["num_generations"], settings["max_steps"]) == (16, 8, 80)
    assert (settings["learning_rate"], settings["max_completion_length"], settings["temperature"]) == (1e-5, 160, 0.8)
    assert (settings["loss_type"], settings["bf16"], config.max_wall_s) == ("grpo", True, 0.0)


CHAT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|a|>{% endif %}"


def chat_tokenizer(path, appends_eos: bool = False):
    """A character tokenizer with a chat template, saved and loaded back; `appends_eos`: its own call adds a special
    token that the template's tokenization does not (as a Llama's BOS)."""
    tokenizer = build_tokenizer(path, "0123456789+=<|>aersuy \n")
    tokenizer.chat_template = CHAT
    if appends_eos:
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"$A {EOS_TEXT}", special_tokens=[(EOS_TEXT, tokenizer.eos_token_id)]
        )
    tokenizer.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("template", ["raw", "chat"])
def test_trl_is_given_the_text_that_tokenizes_to_the_rollouts_prompt_ids(tmp_path, template):
    tokenizer = chat_tokenizer(tmp_path)
    rows = [Row(0, "12+3=", "15", {}), Row(1, "40+9=", "49", {})]
    texts = peer.rollout_prompts(tokenizer, rows, template, system_prompt="")
    assert texts == (["12+3=", "40+9="] if template == "raw" else ["<|user|>12+3=\n<|a|>", "<|user|>40+9=\n<|a|>"])
    ids = [tokenizer(text)["input_ids"] for text in texts]  # what TRL's GRPOTrainer does with a text prompt
    assert ids == [encode_prompt(tokenizer, row.prompt, template) for row in rows]


def test_a_prompt_text_that_tokenizes_to_other_ids_is_a_config_error(tmp_path):
    tokenizer = chat_tokenizer(tmp_path, appends_eos=True)
    assert peer.rollout_prompts(tokenizer, [Row(0, "12", "12", {})], "raw", system_prompt="") == ["12"]
    with pytest.raises(ConfigError, match="row 0's chat prompt does not tokenize back to its ids"):
        peer.rollout_prompts(tokenizer, [Row(0, "12", "12", {})], "chat", system_prompt="")


def test_verifier_scores_by_row_and_counts_the_completion_tokens():
    rows = [Row(0, "12+3=", "15", {}), Row(1, "40+9=", "49", {})]
    verifier = peer.Verifier(rows, make_scorer("builtin", "arith"))
    rewards = verifier(
        prompts=["40+9=", "12+3="], completions=["49", "16"], completion_ids=[[1, 2, 3], [4]], row=[1, 0]
    )
    assert rewards == [1.0, 0.0] and verifier.tokens == 4


def test_cli_defaults_to_arith_and_model_to_the_real_model_config():
    args = build_parser().parse_args(["bench", "peer"])
    assert (args.task, args.steps, args.seed, args.threads, args.out, args.model) == (None, None, 0, None, None, None)
    assert bench_task(args, "arith") == "arith"
    assert bench_task(build_parser().parse_args(["bench", "peer", "--model", "smollm2"]), "arith") == "smollm2-math"
    given = build_parser().parse_args(["bench", "peer", "--model", "smollm2", "--task", "chain"])
    assert bench_task(given, "arith") == "chain"


def test_both_systems_run_the_peers_1200_steps_on_arith_else_the_task_configs_unless_told(tmp_path):
    def steps(*argv: str) -> list[str]:
        overrides = peer.shared_overrides(build_parser().parse_args(["bench", "peer", *argv]), tmp_path)
        return [o for o in overrides if o.startswith("trainer.steps=")]

    assert steps() == ["trainer.steps=1200"]  # arith.yaml's own 600 drop groups without advantage; TRL's do not
    assert steps("--task", "chain") == []  # chain.yaml's 200
    assert steps("--steps", "40") == steps("--task", "chain", "--steps", "40") == ["trainer.steps=40"]
    assert steps("--model", "smollm2") == []  # smollm2-math.yaml's 80
    real = peer.shared_overrides(
        build_parser().parse_args(["bench", "peer", "--model", "m", "--eval-rows", "4"]), tmp_path
    )
    assert real[:3] == ["model.path=m", "eval.max_rows=4", "max_wall_s=0"]


def test_too_many_threads_is_a_config_error():
    with pytest.raises(ConfigError, match="--threads 4096"):
        peer.use_cores(4096)


def test_without_trl_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises ImportError
    assert main(["bench", "peer", "--steps", "1"]) == 2
    assert capsys.readouterr().err == "asyncrl bench peer needs TRL: pip install -e '.[peer]'\n"


def test_report_table_and_plot(tmp_path, capsys):
    peer_row = peer.measured(
        curve((0.0, 0.16), (100.0, 0.30), (200.0, 0.40)), 200.0, 390.0, 40, 9000, first_step_seconds=1.0
    )
    ours = peer.measured(ASYNCRL, 100.0, 190.0, 40, 12_000, first_step_seconds=9.0)
    report = {
        "time_to_peer_final_ratio": peer.time_to_peer_final_ratio(ASYNCRL, 0.40, 200.0),
        "asyncrl_seconds_to_peer_final": peer.time_to_reach(ASYNCRL, 0.40),
        "asyncrl": ours,
        "peer": {"system": "TRL x GRPOTrainer", **peer_row},
        "settings": {
            "task": "arith",
            "steps": 40,
            "batch_groups": 8,
            "n_samples": 8,
            "lr": 1e-4,
            "max_new_tokens": 16,
            "seed": 0,
            "cores": [0, 1],
            "eval_every": 20,
            "eval_rows": 200,
            "model": "runs/models/arith-seed0",
            "dtype": "float32",
            "template": "raw",
        },
    }
    peer.write(report, tmp_path / "peer.json")
    printed = capsys.readouterr().out
    assert (
        "held-out greedy accuracy every 20 steps on 200 held-out rows\nmodel runs/models/arith-seed0 in float32, raw"
        in printed
    )
    assert "time_to_peer_final_ratio: 0.5 (asyncrl reached the peer's final 40.0 % at 100.0 s" in printed
    assert "at or below the base" not in printed
    assert json.loads((tmp_path / "peer.json").read_text())["time_to_peer_final_ratio"] == 0.5
    assert (tmp_path / "peer.png").stat().st_size > 0


def test_trl_trains_a_few_steps_and_is_evaluated_by_asyncrls_evaluator(tmp_path):
    pytest.importorskip("trl")
    config = task_config(
        "arith",
        [
            "trainer.steps=2",
            "trainer.batch_groups=2",
            "data.n_samples=2",
            "eval.max_rows=8",
            "model.warmup_steps=0",
            "rollout.max_new_tokens=4",
        ],
    )
    config = resolve(with_model(config, build_demo_model(config, tmp_path / "model", progress=False)))
    result = peer.run_peer(config, threads=1, eval_every=1, out_dir=tmp_path / "trl", progress=False)
    assert [point["step"] for point in result["curve"]] == [0, 1, 2]
    assert result["steps"] == 2 and 0 < result["trained_tokens"] <= 2 * 2 * 2 * 4
    assert 0 < result["curve"][1]["seconds"] <= result["curve"][2]["seconds"] == result["wall_seconds"]
    assert 0 < result["first_step_seconds"] <= result["curve"][1]["seconds"]
