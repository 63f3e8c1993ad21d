"""A task's demo model: a character-level tokenizer and a tiny Qwen2, made locally.

No machine here reaches a model hub, so the demo builds its own Hugging Face model
directory for the task (its `DemoRecipe`: size, positions, warm-up), then warms it up with
supervised steps on the task's worked solutions so that RL starts from a policy that is
sometimes right (a reward signal) but mostly wrong (headroom).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from workers.rollout.workflow import Workflow
from workers.tasks import EOS_TEXT, DemoRecipe, Problem, Task, load_task
from workers.tasks.arith import Arith

PAD_TEXT = "<pad>"
UNK_TEXT = "<unk>"
BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

# Measured on 2 CPU cores for `arith`: held-out greedy accuracy climbs ~1.5 points per step
# around the target and the step where it gets there varies by seed (58–92), so warm-up
# stops on a probe of unseen training problems rather than at a fixed step.
WARMUP_MAX_STEPS = 150
DEMO_MARKER = "asyncrl-demo.json"  # in a built demo model's folder: what it was built for (its rate is the default)
PROBE_EVERY = 2


def build_tokenizer(path: str | Path, alphabet: str = Arith.alphabet) -> PreTrainedTokenizerFast:
    """One token per character of `alphabet`, saved so that `AutoTokenizer.from_pretrained(path)` loads it.

    Tokens are spelt byte-level (a space is "Ġ", a newline "Ċ"; printable ASCII as itself), because
    transformers 5 loads a qwen2 model directory's tokenizer as a Qwen2Tokenizer, which rebuilds a byte-level
    pre-tokenizer over the vocabulary: a plain " " token would silently vanish from every text after a reload.
    """
    vocab = {tok: i for i, tok in enumerate([PAD_TEXT, EOS_TEXT, UNK_TEXT, *dict.fromkeys(map(byte_level, alphabet))])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TEXT))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"), BYTE_LEVEL]  # one piece per character
    )
    core.decoder = decoders.ByteLevel()  # characters back from their byte-level spelling, joined without spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TEXT,
        eos_token=EOS_TEXT,
        unk_token=UNK_TEXT,
        padding_side="left",  # generation pads on the left; training pads itself
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(str(path))
    return tokenizer


def byte_level(character: str) -> str:
    """A character as a byte-level vocabulary spells it."""
    return "".join(piece for piece, _ in BYTE_LEVEL.pre_tokenize_str(character))


def build_model(
    path: str | Path, tokenizer: PreTrainedTokenizerFast, seed: int = 0, recipe: DemoRecipe = Arith.demo
) -> Qwen2ForCausalLM:
    """A float32 Qwen2 with random weights (~2.2M parameters for `arith`), saved as safetensors."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.kv_heads,
        intermediate_size=4 * recipe.hidden_size,
        max_position_embeddings=recipe.positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(path))
    return model


def sft_batch(
    tokenizer: PreTrainedTokenizerFast, rows: list[Problem]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded "prompt + solution + eos" ids, their attention mask, and the tokens to learn."""
    seqs, masks = [], []
    for row in rows:
        prompt = tokenizer(row.prompt, add_special_tokens=False)["input_ids"]
        answer = tokenizer(row.solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in seqs])  # [B, T]
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])  # [B, T]
    learn = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.bool)  # [B, T]
    return ids, attention, learn


def completion_loss(
    model: Qwen2ForCausalLM, ids: torch.Tensor, attention: torch.Tensor, learn: torch.Tensor
) -> torch.Tensor:
    """Mean next-token cross-entropy over the completion tokens only."""
    logits = model(input_ids=ids, attention_mask=attention).logits  # [B, T, V]
    token_loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T-1]
    target_mask = learn[:, 1:].float()  # [B, T-1]: token t+1 is predicted from position t
    return (token_loss * target_mask).sum() / target_mask.sum()


@torch.no_grad()
def exact_match(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, rows: list[Problem]) -> float:
    """Share of rows whose every completion token is the argmax under teacher forcing.

    Equals greedy accuracy (greedy decoding reproduces "solution + eos" exactly when each
    step's argmax is right given the right prefix), at the cost of one forward pass.
    """
    was_training = model.training
    model.eval()
    ids, attention, learn = sft_batch(tokenizer, rows)
    predicted = model(input_ids=ids, attention_mask=attention).logits[:, :-1].argmax(-1)  # [B, T-1]
    right = (predicted == ids[:, 1:]) | ~learn[:, 1:]  # [B, T-1]: non-completion positions always pass
    model.train(was_training)
    return right.all(1).float().mean().item()


def batches(rows: list[Problem], batch_size: int, length_buckets: int, rng: random.Random) -> Iterator[list[Problem]]:
    """Endless shuffled epochs cut into batches. With `length_buckets` > 1, every `length_buckets` batches are drawn
    together and regrouped by solution length, so that a long-tailed task pads each batch to a similar length."""
    order: list[int] = []
    while True:
        while len(order) < batch_size * length_buckets:  # a fresh shuffled epoch when the current one runs out
            epoch = list(range(len(rows)))
            rng.shuffle(epoch)
            order += epoch
        drawn, order = order[: batch_size * length_buckets], order[batch_size * length_buckets :]
        if length_buckets > 1:
            drawn.sort(key=lambda i: len(rows[i].solution))
        group = [drawn[i : i + batch_size] for i in range(0, len(drawn), batch_size)]
        if length_buckets > 1:
            rng.shuffle(group)
        yield from ([rows[i] for i in batch] for batch in group)


def warm_up(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    rows: list[Problem],
    steps: int = WARMUP_MAX_STEPS,
    batch_size: int = Arith.demo.warmup_batch,
    lr: float = Arith.demo.warmup_lr,
    seed: int = 0,
    probe_rows: list[Problem] | None = None,
    target_accuracy: float = Arith.demo.warmup_target,
    progress: bool = True,
    length_buckets: int = 1,
    probe_every: int = PROBE_EVERY,
) -> list[float]:
    """Teacher-forced SFT on completion tokens; returns the loss of every step taken.

    Deliberately short: the goal is a weak policy (for `arith` ~15–20 % held-out accuracy),
    not a solved task, so that RL has room to climb. With `probe_rows` (problems warm-up never
    trains on) it stops as soon as their greedy accuracy reaches `target_accuracy`,
    else it runs all `steps`.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    bar = tqdm(range(1, steps + 1), desc="warm-up", disable=not progress)
    for step, batch in zip(bar, batches(rows, batch_size, length_buckets, random.Random(seed)), strict=False):
        loss = completion_loss(model, *sft_batch(tokenizer, batch))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if probe_rows and step % probe_every == 0:
            accuracy = exact_match(model, tokenizer, probe_rows)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", probe_acc=f"{accuracy:.2f}")
            if accuracy >= target_accuracy:
                break
    bar.close()
    model.eval()
    return losses


def prepare_demo_model(
    out_dir: str | Path,
    task: Task | str = "arith",
    seed: int = 0,
    task_seed: int = 0,
    steps: int = WARMUP_MAX_STEPS,
    progress: bool = True,
    held_out: int = 200,
    workflow: Workflow | None = None,
) -> Path:
    """Build, warm up and save the task's demo model and tokenizer into `out_dir`.

    `seed` sets the weights and the warm-up order; `task_seed` and `held_out` must be
    the run's `split` arguments, so that warm-up never sees a held-out problem.
    `steps` caps the warm-up, which normally stops earlier on its probe. Warm-up learns the task's
    `demonstrations`; its probe is scored against the right solutions. With a multi-turn `workflow` the
    tokenizer also spells its calls, and warm-up learns the right solutions as the workflow writes them (a
    tool does not make the teacher's mistakes).
    """
    task = load_task(task) if isinstance(task, str) else task
    recipe = task.demo
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, task.alphabet + (workflow.alphabet if workflow else ""))
    model = build_model(out, tokenizer, seed=seed, recipe=recipe)
    train_rows, _ = task.split(task_seed, held_out)
    warm_rows = train_rows[: recipe.warmup_rows]
    if workflow is None:
        warm_rows = task.demonstrations(warm_rows, seed)
    else:
        warm_rows = [replace(row, solution=workflow.demonstrate(row.solution)) for row in warm_rows]
    probe_rows = train_rows[recipe.warmup_rows : recipe.warmup_rows + recipe.probe_rows]
    warm_up(
        model,
        tokenizer,
        warm_rows,
        steps=steps,
        batch_size=recipe.warmup_batch,
        lr=recipe.warmup_lr,
        seed=seed,
        probe_rows=probe_rows,
        target_accuracy=recipe.warmup_target,
        progress=progress,
        length_buckets=recipe.length_buckets,
        probe_every=recipe.probe_every,
    )
    model.save_pretrained(str(out))
    provenance = {"task": type(task).__name__, "seed": seed, "task_seed": task_seed, "held_out": held_out}
    (out / DEMO_MARKER).write_text(json.dumps(provenance) + "\n")
    return out
