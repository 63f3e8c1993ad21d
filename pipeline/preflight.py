"""Pre-flight: what would otherwise show only as workers crash-looping, found before any worker starts.

`prepare` (so `asyncrl run` and `asyncrl prepare`) calls `preflight` once the model exists: the
device is there, the model and its tokenizer load, the rollout engine can serve the architecture,
the weights are finite, the reward function imports and scores a real row, the rows fit the
model, and a multi-turn workflow can answer calls (its call token, the sandbox). Each problem is
a ConfigError: one line on the console, with the fix. Rows the model cannot take are not an error
while others can (the prompt source sends them to `dead-letter` with their line numbers): their
count is printed; a dataset of such rows alone is an error.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from pipeline.config import ConfigError
from schemas.config import OptimConfig, RunConfig


def preflight(config: RunConfig) -> None:
    """Check a resolved config whose model.path exists (`prepare` builds the demo model first)."""
    check_device(config.model.device)
    model, tokenizer = load_model(config)
    check_model(config, model)
    del model  # the launcher may load it again for evaluation: one copy at a time
    rows = usable_rows(config, tokenizer)
    check_reward(config, rows[0])
    check_workflow(config, tokenizer)


def learning_rate_warning(config: RunConfig, demo_dir: Path) -> str | None:
    """One line when a run on a model of one's own (model.path, not the demo model built in `demo_dir`) keeps the
    demo's learning rate: tuned for a tiny model from its warm-up, it wrecks a pretrained one in a few steps. A LoRA
    adapter (model.lora.rank > 0) trains well at about ten times a full fine-tune's rate, near that default."""
    from pipeline.demo_model import DEMO_MARKER

    lr, path = config.trainer.optim.lr, config.model.path
    if not path or Path(path).resolve() == demo_dir.resolve() or lr != OptimConfig().lr or config.model.lora.rank:
        return None
    if (Path(path) / DEMO_MARKER).is_file():  # a demo model built elsewhere (a benchmark's, shared by its runs)
        return None
    return (
        f"asyncrl: warning: trainer.optim.lr is {lr:g}, the demo model's default; a pretrained model ({path}) usually "
        f"wants 1e-6 to 1e-5 (for example trainer.optim.lr=5e-6), or model.lora.rank=8 at this rate"
    )


def check_workflow(config: RunConfig, tokenizer=None) -> None:
    """This machine can answer the workflow's calls (the sandbox), and with `tokenizer`, its call ends with one
    token of the model. Without, it runs before the demo model's warm-up, so a missing sandbox costs no wait."""
    from workers.rollout.workflow import call_token_of, load_workflow

    if (workflow := load_workflow(config.rollout.workflow)) is None:
        return
    try:
        workflow.check()
        if tokenizer is not None:
            call_token_of(tokenizer, workflow.call_end)
    except Exception as exc:  # the workflow's own check may raise anything: one line, not a traceback
        raise ConfigError(f"rollout.workflow={config.rollout.workflow}: {first_line(exc)}") from None


def first_line(error: BaseException | str) -> str:
    """An error's first non-empty line (an exception's type when it has no message): one line on the console."""
    fallback = error if isinstance(error, str) else type(error).__name__
    return next((line.strip() for line in str(error).splitlines() if line.strip()), fallback)


def check_device(device: str) -> None:
    """The device names one this machine has."""
    import torch

    try:
        where = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(
            f"model.device={device!r} is not a torch device ({first_line(exc)}): use cpu or cuda"
        ) from None
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"model.device={device} but CUDA is not available here (torch.cuda.is_available() is False): "
            "use model.device=cpu, or run on a machine with a GPU and a CUDA build of torch"
        )
    if where.type == "cuda" and where.index is not None and where.index >= torch.cuda.device_count():
        raise ConfigError(f"model.device={device} but this machine has {torch.cuda.device_count()} CUDA devices")


def load_model(config: RunConfig):
    """The model (on CPU, in model.dtype) and its tokenizer, as the workers will load them."""
    from transformers import AutoTokenizer

    from workers.models import load_causal_lm

    path = config.model.path
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"model.path {path}: no Hugging Face model there (no config.json): give a local directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = load_causal_lm(path, config.model.dtype, "cpu")
    except Exception as exc:  # transformers raises many kinds (OSError, ValueError, KeyError, ImportError ...)
        raise ConfigError(
            f"model.path {path} does not load as a causal LM ({type(exc).__name__}: {first_line(exc)}): "
            "give a Hugging Face causal LM directory (config.json, weights, tokenizer) of a type transformers knows"
        ) from None
    return model, tokenizer


def check_model(config: RunConfig, model) -> None:
    """The rollout engine serves the architecture, and the weights hold no NaN or inf (never publishable)."""
    from workers.rollout.forward import make_forward
    from workers.weights import non_finite

    path = config.model.path
    if config.rollout.backend == "torch":
        try:
            make_forward(model, "auto")
        except NotImplementedError as exc:
            raise ConfigError(
                f"model.path {path}: the torch rollout engine cannot serve it ({exc}): use a full-attention "
                "causal LM (rollout.backend=vllm may serve this one)"
            ) from None
    if bad := non_finite(model.state_dict()):
        raise ConfigError(f"model.path {path}: NaN or inf in {len(bad)} tensors ({bad[0]}, ...): use sound weights")


def usable_rows(config: RunConfig, tokenizer):
    """The rows the model can take; the others counted on the console (their dead-letters are the prompt
    source's); ConfigError when there are none."""
    from workers.prompt_source import fit_rows
    from workers.rows import load_rows

    rows, _ = load_rows(config)  # rows that do not parse: `check_dataset` already counted on their dead-letters
    fit, unfit = fit_rows(config, tokenizer, rows)
    first = "; ".join(str(row) for row in unfit[:3])
    if not fit:
        raise ConfigError(
            f"data.source {config.data.source}: none of its {len(rows)} rows fits the model ({first}): shorten the "
            "prompts or rollout.max_new_tokens, or use a model whose tokenizer spells them"
        )
    if unfit:
        print(
            f"asyncrl: {len(unfit)} of {len(rows)} rows of {config.data.source} cannot be used and go to dead-letter "
            f"with their line numbers ({first}{'; ...' if len(unfit) > 3 else ''})",
            file=sys.stderr,
        )
    return fit


def check_reward(config: RunConfig, row) -> None:
    """The reward function imports and scores one real row (its answer as the completion) in a scoring
    process of its own, under reward.timeout_s, without raising or returning what is no reward."""
    from workers.reward.pool import ScoringPool

    spec = config.data.reward
    try:
        pool = ScoringPool(spec, 1, config.reward.timeout_s, config.data.task)
    except Exception as exc:  # the user's module: anything may come out of its import
        raise ConfigError(
            f"data.reward {spec} cannot be loaded ({first_line(exc)}): fix the module or its name"
        ) from None
    try:
        metadata = {**row.metadata, "answer": row.answer}
        reward, details = asyncio.run(pool.score(row.prompt, row.answer, metadata))
    finally:
        pool.close()
    if reward is None:
        raise ConfigError(
            f"data.reward {spec} fails on line {row.line} with its answer as the completion "
            f"({first_line(details['error'])}): fix the reward function"
        )
