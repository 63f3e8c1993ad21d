"""The trainer's model and optimizer: what every rank holds, and rank 0's holder of it.

`RankModel` is one rank's part: the policy (an FSDP2 shard of it under torchrun),
the frozen reference of the KL penalty and AdamW; its methods are the rank commands
(`ranks.RankCommands`). `Trainer` is what the Kafka loop uses: it joins the ranks,
restores the checkpoint, turns groups into a batch with advantages, has every rank
run each command (`ranks.LeadRank`) and keeps the counters of `TrainerState`.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from schemas.config import RunConfig
from schemas.messages import Scored, model_token_mask
from workers import flops, lora, runtime
from workers.cores import BF16_MIN_WIDTH, token_budget
from workers.models import cast_floating, compute_dtype, load_causal_lm
from workers.trainer import checkpoint
from workers.trainer.advantages import ESTIMATORS
from workers.trainer.buffer import Group
from workers.trainer.distributed import Collective, close_distributed, full_state_dict, join_ranks, shard_model
from workers.trainer.losses import LossSettings
from workers.trainer.microbatch import allocator
from workers.trainer.ranks import LeadRank, follow
from workers.trainer.step import WORK, PhaseClock, Row, Sequences, StepSettings, collate, train_step
from workers.weight_deltas import Published, Publisher
from workers.weights import write_version


def checkpoints_dir(config: RunConfig) -> Path:
    return runtime.run_dir(config) / "checkpoints"


def step_settings(config: RunConfig) -> StepSettings:
    """The step's settings, built in this one place from the whole config: the loss and the logprobs
    also need the rollout's generation budget and sampling temperature."""
    optim, loss, split = config.trainer.optim, config.trainer.loss, config.trainer.microbatch
    return StepSettings(
        decoupled=loss.objective != "naive",  # M2PO's moments need pi_prox too
        minibatches=optim.minibatches,
        grad_clip=optim.grad_clip,
        temperature=config.rollout.temperature,
        dtype=compute_dtype(config.model.dtype, config.model.device),
        split=allocator(
            split.mode, token_budget(split.max_tokens, config.model.device), split.min_count, split.fixed_count
        ),
        loss=LossSettings(
            clip_eps=loss.clip_eps,
            clip_eps_high=loss.clip_eps_high,
            behaviour_weight_cap=loss.behaviour_weight_cap,
            behaviour_weight_mode=loss.behaviour_weight_mode,
            behaviour_weight_level=loss.behaviour_weight_level,
            icepop_low=loss.icepop_low,
            icepop_high=loss.icepop_high,
            objective="m2po" if loss.objective == "m2po" else "ppo",
            m2_threshold=loss.m2_threshold,
            aggregation=loss.aggregation,
            max_new_tokens=config.rollout.max_new_tokens,
            kl_coef=loss.kl_coef,
        ),
    )


class RankModel:
    """One rank's policy, reference model and optimizer; its methods are the rank commands, every one a
    collective under FSDP2 (`ranks.RankCommands`)."""

    def __init__(self, config: RunConfig, ranks: Collective, device: torch.device):
        self.config, self.ranks, self.device = config, ranks, device
        self.settings = step_settings(config)
        self.adapter = lora.enabled(config.model.lora)  # LoRA: only the adapter trains, and a version is it alone
        self.model = lora.wrap(self._load(), config.model.lora) if self.adapter else self._load()
        if ranks.world > 1:
            shard_model(self.model)  # before the optimizer: the parameters become sharded DTensors
        # with LoRA the reference, the initial policy, is the base model (its adapter's B starts at zero)
        self.reference = self._load().eval().requires_grad_(False) if config.trainer.loss.kl_coef > 0 else None
        optim = config.trainer.optim
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            fused=ranks.world == 1 or None,  # one kernel over all tensors (3x faster on CPU); FSDP2's DTensors: foreach
        )

    def _load(self) -> torch.nn.Module:
        """float32 whatever model.dtype says: the master weights and AdamW's moments keep full precision, and
        the step computes in `StepSettings.dtype` under autocast."""
        return load_causal_lm(self.config.model.path, "float32", str(self.device))

    def restore(self, path: Path | None) -> checkpoint.TrainerState:
        """Model, optimizer and RNG from the checkpoint at `path` (None: the initial weights); its state."""
        return checkpoint.load(path, self.model, self.optimizer)

    def train_batch(self, sequences: Sequences, advantages: list[float]) -> dict[str, float]:
        clock = PhaseClock()
        batch = collate(sequences, advantages, pad_id=0, device=self.device)
        clock.lap("time_collate")
        stats = train_step(self.model, self.optimizer, batch, self.settings, self.ranks, self.reference, clock)
        return {**stats, **clock.seconds}

    def gather_weights(self) -> dict[str, torch.Tensor]:
        """What a version holds: the whole weights, or with LoRA the adapter under PEFT's saved names."""
        if self.adapter:
            return lora.published_names(full_state_dict(self.model, trainable_only=True))
        return full_state_dict(self.model)

    def save_checkpoint(self, state: checkpoint.TrainerState) -> Path:
        keep = self.config.trainer.checkpoint.keep
        return checkpoint.save(checkpoints_dir(self.config), state, self.model, self.optimizer, keep)

    def stop(self) -> None:
        close_distributed()


def trained_versions(scored: Scored) -> list[int]:
    """The policy version of each trained token: tool tokens (mask 0) are not trained, their versions are
    placeholders that no statistic may count."""
    mask = model_token_mask(scored.loss_mask, len(scored.versions))
    return [version for version, trained in zip(scored.versions, mask, strict=True) if trained]


def measure_ceiling(
    model: torch.nn.Module, dtype: torch.dtype, device: torch.device, rank: int
) -> tuple[dict | None, float]:
    """The model's config for its FLOPs (None where `workers.flops` cannot count them) and rank 0's one-thread
    matmul ceiling in the step's dtype, GFLOP/s (0: not measured: on CUDA, where one small product says nothing of
    the peak, and for a model narrower than `BF16_MIN_WIDTH`, whose step is overhead-bound and whose runs
    should not pay the probe's one second)."""
    shape = model.config.to_dict()
    if not flops.counts(shape):
        return None, 0.0
    if rank != 0 or device.type != "cpu" or shape["hidden_size"] < BF16_MIN_WIDTH:
        return shape, 0.0
    return shape, flops.probe_ceiling(dtype)["prefill"]


class Trainer:
    """The model and the counters. Rank 0 calls `train`, `publish` and `save`, each run by every rank
    (the others wait in `follow`); every rank calls `close`."""

    def __init__(self, config: RunConfig, restore_from: Path | None):
        """`restore_from`: a checkpoint to start from; None = the initial weights at model.path."""
        self.config = config
        self.ranks, device = join_ranks(config.model.device)
        self.rank, self.world = self.ranks.rank, self.ranks.world
        self.nodes = [found["node"] for found in self.ranks.gather({"node": runtime.node_name()})]  # by rank
        self.local = RankModel(config, self.ranks, device)
        self.vocab = self.local.model.get_input_embeddings().num_embeddings  # token ids it can train: [0, vocab)
        self.state = self.local.restore(restore_from)
        self.commands = LeadRank(self.local, self.ranks)
        saved = config.trainer.checkpoint  # whole_every > 1: delta versions (`workers.weight_deltas`)
        self.publisher = Publisher(runtime.weights_dir(config), saved.keep_versions, saved.whole_every)
        self.shape, self.ceiling = measure_ceiling(self.local.model, self.local.settings.dtype, device, self.rank)

    def train(self, groups: list[Group]) -> dict[str, float]:
        """One optimizer step on these groups (rank 0); returns the step's stats."""
        version = self.state.step
        rewards = torch.tensor([[s.reward for s, _ in g.trajectories()] for g in groups])  # [G, n]
        advantages = ESTIMATORS[self.config.trainer.loss.advantage](rewards).flatten().tolist()
        trajectories = [s for g in groups for s, _ in g.trajectories()]
        sequences = [Row(s.prompt_tokens, s.completion_tokens, s.logprobs, s.loss_mask) for s in trajectories]
        stats = self.commands.train_batch(sequences, advantages)
        stats |= self.utilisation(stats)
        lags = [version - s.released_at_version for s in trajectories]
        trained = [trained_versions(s) for s in trajectories]
        tokens = sum(map(len, trained))
        st = self.state
        st.step += 1
        st.groups_consumed += len(groups)
        st.trained_tokens += tokens
        st.trained_trajectories += len(trajectories)
        st.interrupted_trajectories += sum(s.interruptions > 0 for s in trajectories)
        truncated = sum(s.finish_reason == "length" for s in trajectories)
        st.truncated_trajectories += truncated
        st.mixed_version_trajectories += sum(len(set(versions)) > 1 for versions in trained)
        st.max_staleness_trained = max(st.max_staleness_trained, *lags)
        st.skipped_steps += bool(stats["skipped_updates"])  # its groups are consumed all the same (worker.py)
        histogram = Counter(lags)
        return {
            **stats,
            "reward_mean": rewards.mean().item(),
            "tokens": tokens,
            "completion_lengths": [len(s.completion_tokens) for s in trajectories],  # the run's percentiles
            "truncated": truncated,  # this step's trajectories cut at the output budget
            "staleness_mean": sum(lags) / len(lags),
            "staleness_max": max(lags),
            "staleness_histogram": [histogram[lag] for lag in range(max(lags) + 1)],  # trajectories per staleness
            "token_staleness_mean": sum(version - v for versions in trained for v in versions) / max(tokens, 1),
        }

    def utilisation(self, stats: dict[str, float]) -> dict[str, float]:
        """The step's forwards' and backwards' model GFLOP/s (fb_gflops), share of the ceiling (fb_mfu) and the
        ceiling it was measured against (fb_ceiling_gflops_per_core)."""
        if not self.shape:
            return {}
        work, cores = tuple(stats[key] for key in WORK), torch.get_num_threads() * self.world
        seconds, reference = stats["time_forward_backward"], self.local.reference is not None
        return flops.step_utilisation(self.shape, work, seconds, self.ceiling, cores, reference)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The whole, unsharded weights of the current version, cast to model.dtype (what the rollout runs, at that
        size on disk), in memory of their own: the next step may train while they are written."""
        return cast_floating(self.commands.gather_weights(), self.config.model.dtype)

    def publish(self, weights: dict[str, torch.Tensor] | None = None, version: int | None = None) -> Published:
        """Write `weights` (default: a snapshot now) as `version` (default: the current step) to shared storage:
        whole, or with trainer.checkpoint.whole_every > 1 every K-th whole and the others as deltas."""
        weights = self.snapshot() if weights is None else weights
        version = self.state.step if version is None else version
        saved = self.config.trainer.checkpoint
        if saved.whole_every > 1:
            return self.publisher.publish(weights, version)
        metadata = lora.adapter_metadata(self.config.model.lora) if lora.enabled(self.config.model.lora) else None
        written = write_version(weights, runtime.weights_dir(self.config), version, saved.keep_versions, metadata)
        return Published(*written)

    def save(self) -> Path:
        """A checkpoint of the model, optimizer and `state` as it is now (set its resume fields first)."""
        return self.commands.save_checkpoint(self.state)

    def follow(self) -> None:
        """Ranks > 0: run what rank 0 commands until it stops."""
        follow(self.local, self.ranks)

    def close(self) -> None:
        """Rank 0 stops the other ranks; every rank leaves the process group (again is harmless)."""
        (self.commands if self.rank == 0 else self.local).stop()
