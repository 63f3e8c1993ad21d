"""Loading the policy and turning a prompt into its token ids: the same for rollout, trainer and evaluation.

One place decides the precisions of a run (`model.dtype`, resolved by `pipeline.config.resolve`):
rollout and evaluation hold the weights in it; the trainer keeps float32 master weights and AdamW
state and computes its forward in `compute_dtype` under autocast; the weights it publishes are cast
to `model.dtype` (`cast_floating`), so a rollout worker loads exactly what it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, PreTrainedTokenizerBase

if TYPE_CHECKING:  # modeling code: ~1.3 s more import for the prompt source, which never loads a model
    from transformers import GenerationConfig, PreTrainedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TEMPLATES = ("raw", "chat")


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a resolved model.dtype; 'auto' is an error (resolve it first, it depends on the device)."""
    if dtype not in DTYPES:
        raise ValueError(
            f"model.dtype {dtype!r}: expected one of {', '.join(DTYPES)} (pipeline.config.resolve turns 'auto' "
            "into one of them)"
        )
    return DTYPES[dtype]


def load_causal_lm(path: str, dtype: str = "float32", device: str = "cpu") -> PreTrainedModel:
    """A Hugging Face causal LM from a local directory, in `dtype` (a resolved model.dtype), on `device`."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype)).to(torch.device(device))


def avoid_cudnn_attention(device: torch.device | str) -> None:
    """On CUDA, turn off PyTorch's cuDNN attention backend (process-wide); elsewhere do nothing.

    cuDNN builds an execution plan for every new shape, and rollout and training change shapes at every
    step (a decode step's span, a packed row's sequence lengths). Measured on an H100 (torch 2.11, a 104M
    Qwen2, bfloat16): a 64-row decode step 89 -> 10 ms, the packed forward + backward of 16 variable-length
    rows 2.2-4.6 s -> 0.15-0.22 s. SDPA's flash, memory-efficient and math kernels serve every call instead.
    """
    if torch.device(device).type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def context_positions(path: str) -> int | None:
    """The most tokens (prompt + completion) the model at `path` can hold, from its config; None if it says none."""
    return getattr(AutoConfig.from_pretrained(path).get_text_config(), "max_position_embeddings", None)


def end_token_ids(tokenizer: PreTrainedTokenizerBase, generation: GenerationConfig | None) -> tuple[int, ...]:
    """Every id that ends a completion: the tokenizer's EOS and each end-of-sequence id the model's generation
    config names (one or a list: a chat model often lists its end-of-turn token there too)."""
    named = generation.eos_token_id if generation is not None else None
    ids = [tokenizer.eos_token_id, *(named if isinstance(named, list) else [named])]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def generation_config_of(path: str) -> GenerationConfig:
    """The generation config of the model at `path`: its generation_config.json, else what its config.json says."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))


def compute_dtype(dtype: str, device: str) -> torch.dtype:
    """The dtype the trainer's forward runs in under autocast (float32: no autocast at all).

    bfloat16 on any device. float16 on CUDA; on CPU float16 trains in float32, because CPU half
    matmuls are slow and float16 without a loss scaler (the trainer has none) flushes small gradients
    to zero, while float32 costs nothing in precision. The rollout still runs float16 either way.
    """
    wanted = torch_dtype(dtype)
    if wanted == torch.float16 and not str(device).startswith("cuda"):
        return torch.float32
    return wanted


def cast_floating(tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """Floating-point tensors cast to `dtype` (others as they are): the published weights of a version.
    float32 returns the same tensors, so the default run writes bit for bit what it wrote before."""
    target = torch_dtype(dtype)
    return {name: t.to(target) if t.is_floating_point() else t for name, t in tensors.items()}


def check_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    """ValueError (one line) unless the tokenizer has a chat template that opens the assistant's turn:
    without it a chat prompt would end after the user's turn and the model would continue that instead."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "data.template=chat: the tokenizer has no chat template (tokenizer_config.json or chat_template.jinja); "
            "use data.template=raw or a model that has one"
        )
    turn = [{"role": "user", "content": "x"}]
    opened = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    closed = tokenizer.apply_chat_template(turn, add_generation_prompt=False, tokenize=False)
    if opened == closed:
        raise ValueError(
            "data.template=chat: the tokenizer's chat template ignores add_generation_prompt (it never opens "
            "the assistant's turn); use data.template=raw or fix the template"
        )


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, text: str, template: str = "raw", system_prompt: str = ""
) -> list[int]:
    """The prompt's token ids: the text as is ('raw'), or one user turn in the tokenizer's chat template
    followed by the assistant's opening ('chat'), with an optional system turn first."""
    if template not in TEMPLATES:
        raise ValueError(f"data.template {template!r}: expected one of {', '.join(TEMPLATES)}")
    if template == "raw":
        return tokenizer(text)["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        check_chat_template(tokenizer)  # raises its one-line reason
    turns = [{"role": "system", "content": system_prompt}] if system_prompt else []
    turns.append({"role": "user", "content": text})
    return list(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False))
