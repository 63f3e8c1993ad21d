"""One optimizer step of decoupled PPO on a batch of trajectories, in plain torch.

Read top to bottom: collate -> pi_prox -> minibatch updates. The loss itself is a
pure function in `losses.py`; the advantages come in already computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.trainer.losses import decoupled_ppo_loss


@dataclass
class TrainBatch:
    """Right-padded tensors; position t of the [N, T-1] tensors predicts token t+1."""

    input_ids: torch.Tensor  # [N, T] prompt + completion, padded
    attention_mask: torch.Tensor  # [N, T]
    loss_mask: torch.Tensor  # [N, T-1] 1.0 where the predicted token is a completion token
    behav_logp: torch.Tensor  # [N, T-1] recorded behaviour logprobs (0 elsewhere)
    advantages: torch.Tensor  # [N, T-1] the sequence advantage on its completion tokens

    def select(self, rows: torch.Tensor) -> "TrainBatch":
        return TrainBatch(*(t[rows] for t in vars(self).values()))

    def to(self, device: torch.device | str) -> "TrainBatch":
        return TrainBatch(*(t.to(device) for t in vars(self).values()))


def collate(
    sequences: list[tuple[list[int], list[int], list[float]]],  # (prompt, completion, behaviour logprobs)
    advantages: list[float],
    pad_id: int,
    device: torch.device | str = "cpu",
) -> TrainBatch:
    n, width = len(sequences), max(len(p) + len(c) for p, c, _ in sequences)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(n, width, dtype=torch.long)
    loss_mask = torch.zeros(n, width - 1)
    behav = torch.zeros(n, width - 1)
    adv = torch.zeros(n, width - 1)
    for row, ((prompt, completion, logprobs), advantage) in enumerate(zip(sequences, advantages)):
        length, start = len(prompt) + len(completion), len(prompt) - 1  # logits at start predict completion[0]
        input_ids[row, :length] = torch.tensor(prompt + completion)
        attention_mask[row, :length] = 1
        loss_mask[row, start : length - 1] = 1.0
        behav[row, start : length - 1] = torch.tensor(logprobs)
        adv[row, start : length - 1] = advantage
    return TrainBatch(input_ids, attention_mask, loss_mask, behav, adv).to(device)


def token_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """log pi(token t+1 | tokens <= t) at the sampling temperature, [N, T-1]."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]  # [N, T-1, V]
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, T-1, V]
    return logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)  # [N, T-1]


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    *,
    decoupled: bool,
    clip_eps: float,
    behaviour_weight_cap: float,
    minibatches: int,
    grad_clip: float,
    temperature: float,
) -> dict[str, float]:
    """pi_prox with the weights as they are when the batch arrives, then `minibatches` PPO updates.

    The first minibatch's own forward pass runs on those same weights, so its
    pi_prox is that pass detached: with one minibatch pi_prox costs nothing extra.
    """
    chunks = torch.arange(batch.input_ids.shape[0]).chunk(minibatches)
    prox = batch.behav_logp.clone()  # [N, T-1]; stays pi_behav for naive PPO
    if decoupled and minibatches > 1:
        with torch.no_grad():
            rest = torch.cat(chunks[1:])
            prox[rest] = token_logprobs(model, batch.select(rest), temperature)
    stats: dict[str, float] = {}
    for index, rows in enumerate(chunks):
        mb = batch.select(rows)
        logp = token_logprobs(model, mb, temperature)  # [n, T-1]
        if decoupled and index == 0:
            prox[rows] = logp.detach()
        loss, loss_stats = decoupled_ppo_loss(
            logp, prox[rows], mb.behav_logp, mb.advantages, mb.loss_mask, clip_eps, behaviour_weight_cap
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        for key, value in {"loss": loss.item(), "grad_norm": grad_norm.item(), **loss_stats}.items():
            stats[key] = stats.get(key, 0.0) + value / minibatches
    mask = batch.loss_mask.bool()
    stats["prox_behav_abs_diff"] = (prox - batch.behav_logp)[mask].abs().mean().item()
    return stats
