"""Pre-flight: what would crash-loop the workers is one line with the fix before any worker starts, and
rows the model cannot take go to dead-letter with their line numbers, counted on the console."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from pipeline.cli import main as cli
from pipeline.config import ConfigError, load_config, resolve
from pipeline.demo_model import build_tokenizer
from pipeline.preflight import check_device, preflight
from schemas.messages import DeadLetter, PromptGroup
from topics.memory import MemoryTransport
from topics.names import TopicLayout
from workers import prompt_source

LONG = "1" * 120 + "="  # 121 tokens of the demo's 128 positions: no room for 16 new ones
ROWS = [
    {"prompt": "1+2=", "answer": "3"},
    {"prompt": "1+2=é", "answer": "3"},  # the demo tokenizer has no 'é': it would become <unk>
    "{not json",
    {"prompt": LONG, "answer": "1"},
]


def config_for(tmp_path, model_path, *overrides: str):
    names = [f"runs_dir={tmp_path}", "name=pre", f"model.path={model_path}", "broker.bootstrap=memory"]
    return resolve(load_config(None, [*names, *overrides]))


def write_rows(path, rows) -> str:
    path.write_text("\n".join(row if isinstance(row, str) else json.dumps(row) for row in rows) + "\n")
    return str(path)


def refused(config) -> str:
    with pytest.raises(ConfigError) as error:
        preflight(config)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_a_missing_or_unknown_model_is_one_line(tmp_path):
    assert refused(config_for(tmp_path, tmp_path / "nowhere")) == (
        f"model.path {tmp_path / 'nowhere'}: no Hugging Face model there (no config.json): give a local directory"
    )
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "nonesuch"}))
    build_tokenizer(tmp_path / "odd")
    message = refused(config_for(tmp_path, tmp_path / "odd"))
    assert message.startswith(f"model.path {tmp_path / 'odd'} does not load as a causal LM (ValueError: ")
    assert "nonesuch" in message and message.endswith("of a type transformers knows")


def test_an_architecture_the_engine_cannot_serve_is_refused(tmp_path):
    tokenizer = build_tokenizer(tmp_path / "mistral")
    torch.manual_seed(0)
    MistralForCausalLM(
        MistralConfig(
            vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64, sliding_window=16,
        )
    ).save_pretrained(tmp_path / "mistral")  # fmt: skip
    assert refused(config_for(tmp_path, tmp_path / "mistral")) == (
        f"model.path {tmp_path / 'mistral'}: the torch rollout engine cannot serve it (mistral: the slot cache "
        "supports full attention only, not sliding windows): use a full-attention causal LM (rollout.backend=vllm "
        "may serve this one)"
    )


def test_cuda_without_cuda_is_one_line(tmp_path, demo_model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert refused(config_for(tmp_path, demo_model_dir, "model.device=cuda")) == (
        "model.device=cuda but CUDA is not available here (torch.cuda.is_available() is False): use "
        "model.device=cpu, or run on a machine with a GPU and a CUDA build of torch"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"^model\.device=cuda:3 but this machine has 1 CUDA devices$"):
        check_device("cuda:3")
    with pytest.raises(ConfigError, match=r"^model\.device='gpu' is not a torch device"):
        check_device("gpu")


def test_a_reward_that_cannot_import_or_fails_on_a_real_row_is_one_line(tmp_path, demo_model_dir):
    assert refused(config_for(tmp_path, demo_model_dir, "data.reward=no_such_module:score")) == (
        "data.reward no_such_module:score cannot be loaded (reward function 'no_such_module:score' cannot be "
        "loaded: No module named 'no_such_module'): fix the module or its name"
    )
    assert refused(config_for(tmp_path, demo_model_dir, "data.reward=bad_rewards:raises")) == (
        "data.reward bad_rewards:raises fails on line 1 with its answer as the completion (RuntimeError: the "
        "verifier is broken): fix the reward function"
    )


def test_a_dataset_of_rows_the_model_cannot_take_is_one_line(tmp_path, demo_model_dir):
    source = write_rows(tmp_path / "rows.jsonl", [ROWS[1], ROWS[3]])
    assert refused(config_for(tmp_path, demo_model_dir, f"data.source={source}", "data.reward=math")) == (
        f"data.source {source}: none of its 2 rows fits the model (line 1: the tokenizer cannot represent 'é': the "
        "prompt would not be what the row says; line 2: prompt of 121 tokens + rollout.max_new_tokens=16 exceeds "
        "the model's 128 positions): shorten the prompts or rollout.max_new_tokens, or use a model whose tokenizer "
        "spells them"
    )


async def test_rows_the_model_cannot_take_are_counted_then_dead_lettered_with_their_lines(
    tmp_path, demo_model_dir, capsys
):
    source = write_rows(tmp_path / "rows.jsonl", ROWS)
    config = config_for(tmp_path, demo_model_dir, f"data.source={source}", "data.reward=math", "trainer.steps=1")
    await asyncio.to_thread(preflight, config)  # its scoring process runs its own event loop
    assert capsys.readouterr().err.splitlines()[-1] == (  # after transformers' loading bar
        f"asyncrl: 2 of 3 rows of {source} cannot be used and go to dead-letter with their line numbers (line 2: the "
        "tokenizer cannot represent 'é': the prompt would not be what the row says; line 4: prompt of 121 tokens + "
        "rollout.max_new_tokens=16 exceeds the model's 128 positions)"
    )
    transport, stop = MemoryTransport(TopicLayout()), asyncio.Event()
    task = asyncio.create_task(prompt_source.main(config, stop, transport))
    try:
        for _ in range(1000):
            if transport.broker.messages("prompts", PromptGroup) or task.done():
                break
            await asyncio.sleep(0.01)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    letters = transport.broker.messages("dead-letter", DeadLetter)
    assert [(letter.offset, letter.reason.split(":")[0]) for letter in letters] == [
        (2, "line 2"),
        (3, "line 3"),
        (4, "line 4"),
    ]
    assert "cannot represent 'é'" in letters[0].reason and "exceeds the model's 128 positions" in letters[2].reason
    assert {group.prompt_text for group in transport.broker.messages("prompts", PromptGroup)} == {"1+2="}


def test_asyncrl_prepare_says_it_in_one_line(tmp_path, capsys):
    code = cli(
        ["prepare", f"runs_dir={tmp_path}", "name=p", f"model.path={tmp_path / 'nowhere'}", "broker.bootstrap=x:1"]
    )
    assert code == 2
    assert capsys.readouterr().err == (  # nothing but the one line
        f"asyncrl: model.path {tmp_path / 'nowhere'}: no Hugging Face model there (no config.json): give a local "
        "directory\n"
    )


REWARD_FILE = "def score(prompt, completion, metadata):\n    return float(completion == metadata['answer'])\n"


@pytest.mark.parametrize("form", ["path/to/file.py:fn", "module:fn"])
def test_a_reward_function_of_your_own_passes_by_file_or_by_module_beside_you(
    tmp_path, demo_model_dir, monkeypatch, form
):
    """Found as `asyncrl eval` and `replay` find it, and as the run's workers do (`python -m`, in this directory)."""
    (tmp_path / "my_preflight_reward.py").write_text(REWARD_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_preflight_reward", raising=False)
    spec = f"{tmp_path}/my_preflight_reward.py:score" if form == "path/to/file.py:fn" else "my_preflight_reward:score"
    preflight(config_for(tmp_path, demo_model_dir, f"data.reward={spec}"))


def test_prepare_warns_once_a_model_of_ones_own_passed_pre_flight_with_the_demo_learning_rate(
    tmp_path, demo_model_dir, capsys
):
    args = ["prepare", f"runs_dir={tmp_path}", "name=p", f"model.path={demo_model_dir}", "broker.bootstrap=x:1"]
    assert cli(args) == 2  # no broker answers there: after pre-flight, so the warning came first
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("asyncrl:")]  # no progress bars
    assert len(lines) == 2 and "no broker answers" in lines[1]
    assert lines[0].startswith("asyncrl: warning: trainer.optim.lr is 0.0001, the demo model's default")
    assert cli([*args, "trainer.optim.lr=2e-6"]) == 2
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("asyncrl: warning")]
