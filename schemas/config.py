"""The typed run configuration: one Struct per section, a description per field.

`pipeline.config` loads it from YAML plus dotted overrides; every worker gets the
same resolved file, so what a worker does is fully named by it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

AUTO = "auto"  # the one spelling of an automatic value: `pipeline.config.resolve` makes it explicit
Auto = Literal["auto"]


def doc(text: str, **constraints) -> msgspec.Meta:
    """Field description (shown by `asyncrl run --dry-run --explain`) plus constraints."""
    return msgspec.Meta(description=text, **constraints)


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    pass


class BrokerConfig(Section):
    bootstrap: Annotated[str, doc("Kafka bootstrap HOST:PORT; empty = start the embedded Tansu broker")] = ""
    topic_prefix: Annotated[str, doc("prefix for every topic name, to share one broker between runs")] = ""
    partitions: Annotated[int, doc("partitions of prompts/segments/scored (weights always has 1)", ge=1)] = 1
    fetch_wait_ms: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | Auto,
        doc(
            "longest a worker's fetch waits at the broker for new records; auto = 20 when trainer.max_staleness is 0 "
            "(every hop on a synchronous step's path), else 50 (docs: Running a pipeline)"
        ),
    ] = AUTO


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(Section):
    """model.lora: train a low-rank adapter on the frozen base model (PEFT) instead of every weight."""

    rank: Annotated[
        int,
        doc(
            "LoRA rank r: the trainer trains B·A (r x in, out x r) on each target module, its base frozen, and a "
            "version is the adapter alone; 0 = off, full fine-tuning (docs: Train a real model, LoRA)",
            ge=0,
        ),
    ] = 0
    alpha: Annotated[float, doc("LoRA alpha: a module computes W0·x + (alpha / rank)·B·A·x", gt=0)] = 32.0
    dropout: Annotated[float, doc("dropout on the adapter's input in the trainer's forwards", ge=0, lt=1)] = 0.0
    target_modules: Annotated[
        tuple[Annotated[str, msgspec.Meta(min_length=1)], ...],
        doc(
            "names of the linear modules adapted (PEFT's target_modules: a module whose name ends with one)",
            min_length=1,
        ),
    ] = LORA_TARGETS


class ModelConfig(Section):
    path: Annotated[
        str,
        doc(
            "local directory of a Hugging Face causal LM, or an imported model's name (`asyncrl model import`: "
            "smollm2); empty = build the demo model"
        ),
    ] = ""
    device: Annotated[str, doc("torch device for rollout and trainer: cpu, cuda, cuda:1 ...")] = "cpu"
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        doc(
            "rollout's and evaluation's weights, the trainer's autocast compute (docs: Running a pipeline). auto = "
            "bfloat16 on CUDA and, for models 512+ wide, on CPUs with native bfloat16; else float32"
        ),
    ] = "auto"
    warmup_steps: Annotated[
        Annotated[int, msgspec.Meta(ge=0)] | Auto,
        doc(
            "demo model only: at most this many supervised warm-up steps, fewer once the task's target is reached; 0 ="
            " none (a random model), auto = the task's own cap"
        ),
    ] = AUTO
    lora: LoraConfig = LoraConfig()


class DataConfig(Section):
    task: Annotated[
        str,
        doc(
            "'arith' (the demo), 'chain' (long chains of thought), 'code' (programs run against tests), or your own "
            "Task subclass as path/to/file.py:Class or module:Class (docs: Tasks and rewards)"
        ),
    ] = "arith"
    source: Annotated[
        str, doc("'builtin' (the task's own rows) or a JSONL or Parquet file with prompt/answer fields")
    ] = "builtin"
    reward: Annotated[
        str,
        doc(
            "'builtin' (the task's verifier), 'math' (math-verify), 'math-strict' (the boxed or last stated number "
            "only), 'code' (the row's tests), or path/to/file.py:fn or module:fn (docs: Tasks and rewards)"
        ),
    ] = "builtin"
    eval_source: Annotated[
        str,
        doc(
            "held-out rows scored as it trains: a JSONL/Parquet file, 'builtin' (the task's held-out split), "
            "'humaneval' or 'none' (docs: Evaluation and export). auto = builtin for the task's own rows, else none"
        ),
    ] = AUTO
    template: Annotated[
        Literal["raw", "chat"],
        doc("'raw': the prompt text tokenised as is; 'chat': the tokenizer's chat template, one user turn"),
    ] = "raw"
    system_prompt: Annotated[str, doc("chat template only: a system turn before the prompt; empty = none")] = ""
    n_samples: Annotated[int, doc("completions per prompt (the GRPO group size)", ge=1)] = 8
    epochs: Annotated[int, doc("passes over the dataset before the prompt source stops", ge=1)] = 1000
    held_out: Annotated[int, doc("the task's own rows: problems kept out of training for evaluation", ge=1)] = 200

    def eval_source_or_default(self) -> str:
        """eval_source with auto filled in: the task's held-out split for the task's own rows; a file has none."""
        if self.eval_source != AUTO:
            return self.eval_source
        return "builtin" if self.source == "builtin" else "none"


class RolloutConfig(Section):
    workers: Annotated[int, doc("rollout worker processes started by `asyncrl run`", ge=1)] = 1
    max_batch: Annotated[int, doc("sequences decoded together by one engine", ge=1)] = 64
    cache_mb: Annotated[
        int,
        doc(
            "the most memory an engine's KV cache may take (torch engine, rollout and evaluation): fewer sequences "
            "run at once where their budgets are long; 0 = no limit but max_batch",
            ge=0,
        ),
    ] = 0
    temperature: Annotated[float, doc("sampling temperature (0 = greedy)", ge=0)] = 1.0
    top_p: Annotated[float, doc("nucleus sampling mass", gt=0, le=1)] = 1.0
    top_k: Annotated[int, doc("sample among the k most likely tokens; 0 = off", ge=0)] = 0
    max_new_tokens: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | Auto, doc("completion length limit; auto = the task's default")
    ] = AUTO
    stop: Annotated[
        tuple[Annotated[str, msgspec.Meta(min_length=1)], ...],
        doc(
            "stop strings: a completion ends with the token completing one, kept; the model's end-of-sequence ids "
            "always stop (docs: Evaluation and export)"
        ),
    ] = ()
    interrupt: Annotated[bool, doc("interrupt in-flight sequences when new weights arrive")] = True
    cache_lag: Annotated[
        Annotated[int, msgspec.Meta(ge=0)] | Auto,
        doc(
            "versions a running sequence's KV cache may lag the weights before an interruption recomputes it: 0 = "
            "always (AReaL), large = never (PipelineRL); auto = 1 on torch, 0 on vLLM (docs: Concepts)"
        ),
    ] = AUTO
    threads: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | Auto,
        doc("torch CPU threads of each rollout worker; auto = its share of the launcher's cores (1 in a deployment)"),
    ] = AUTO
    backend: Annotated[
        Literal["torch", "vllm"],
        doc("inference engine: 'torch' (embedded, CPU or CUDA) or 'vllm' (CUDA, needs the vllm extra)"),
    ] = "torch"
    workflow: Annotated[
        str,
        doc(
            "multi-turn rollouts: '' = one turn; 'python' = the model's `[code]` calls run in the sandbox, their "
            "output following untrained; or your own Workflow as path/to/file.py:Class (docs: Multi-turn tools)"
        ),
    ] = ""


class RewardConfig(Section):
    processes: Annotated[
        int,
        doc(
            "size of the scoring process pool; 0 = the 'builtin' verifier scores in the reward worker itself, without "
            "time limit or isolation (a fast one you trust), any other function in a pool of one",
            ge=0,
        ),
    ] = 1
    max_processes: Annotated[
        int,
        doc(
            "most scoring processes at once: calls waiting behind one that may hang (past a quarter of timeout_s) get "
            "spare processes up to this many, so hung calls time out together (docs: Promises)",
            ge=1,
        ),
    ] = 8
    timeout_s: Annotated[float, doc("per-call scoring time limit; a timeout is a failure reward", gt=0)] = 10.0
    failure_reward: Annotated[
        float,
        doc("reward given when scoring raises, times out or returns no finite number within ±1e6", ge=-1e6, le=1e6),
    ] = 0.0
    max_failure_rate: Annotated[
        float,
        doc(
            "the reward worker stops the run when more than this share of the last reward.failure_window calls "
            "of the reward function failed (raised, timed out, returned no reward); 1 = never",
            ge=0,
            le=1,
        ),
    ] = 0.5
    failure_window: Annotated[
        int, doc("reward function calls over which reward.max_failure_rate is measured (once that many ran)", ge=1)
    ] = 200


class OptimConfig(Section):
    """trainer.optim: the AdamW update of each minibatch."""

    lr: Annotated[float, doc("AdamW learning rate", gt=0)] = 1e-4
    weight_decay: Annotated[float, doc("AdamW weight decay", ge=0)] = 0.0
    grad_clip: Annotated[float, doc("max global gradient norm", gt=0)] = 1.0
    minibatches: Annotated[int, doc("PPO minibatch updates per step", ge=1)] = 1


class LossConfig(Section):
    """trainer.loss: the advantages and the decoupled PPO objective (`workers.trainer.losses`)."""

    objective: Annotated[
        Literal["decoupled", "naive", "m2po"],
        doc(
            "decoupled PPO (pi_prox recomputed), naive PPO (pi_prox = pi_behav), or m2po: no ratio clip, the tokens "
            "of largest (log pi_prox/pi_behav)^2 dropped until the rest's mean is at most m2_threshold (M2PO)"
        ),
    ] = "decoupled"
    advantage: Annotated[
        Literal["grpo", "drgrpo", "rloo"],
        doc("advantage estimator: grpo (group mean/std), drgrpo (group mean, no std), rloo (leave-one-out mean)"),
    ] = "grpo"
    clip_eps: Annotated[float, doc("PPO ratio clip epsilon", gt=0, lt=1)] = 0.2
    clip_eps_high: Annotated[
        Annotated[float, msgspec.Meta(gt=0)] | Auto,
        doc("upper ratio clip epsilon (clip-higher): clip(r, 1-clip_eps, 1+clip_eps_high); auto = clip_eps"),
    ] = AUTO
    behaviour_weight_cap: Annotated[float, doc("cap on the behaviour weight pi_prox/pi_behav; 0 = no cap", ge=0)] = 0.0
    behaviour_weight_mode: Annotated[
        Literal["cap", "mask", "icepop"],
        doc(
            "above behaviour_weight_cap: 'cap' clamps the weight to the cap, 'mask' drops the token/sequence; "
            "'icepop': drops it outside [icepop_low, icepop_high] (IcePop), no cap"
        ),
    ] = "cap"
    behaviour_weight_level: Annotated[
        Literal["token", "sequence"],
        doc("behaviour weight per token, or per sequence (product over its completion tokens, given to each token)"),
    ] = "token"
    icepop_low: Annotated[
        float, doc("IcePop: the lowest behaviour weight kept (behaviour_weight_mode=icepop)", gt=0)
    ] = 0.5
    icepop_high: Annotated[
        float, doc("IcePop: the highest behaviour weight kept (behaviour_weight_mode=icepop)", gt=0)
    ] = 5.0
    m2_threshold: Annotated[
        float,
        doc("M2PO: the largest mean (log pi_prox/pi_behav)^2 of a minibatch's kept tokens (objective=m2po)", gt=0),
    ] = 0.04
    aggregation: Annotated[
        Literal["token_mean", "seq_mean", "token_sum_norm"],
        doc(
            "token_mean: over all tokens of the minibatch; seq_mean: per sequence, then over sequences; "
            "token_sum_norm: token sum / (sequences * rollout.max_new_tokens), Dr.GRPO's (use with advantage=drgrpo)"
        ),
    ] = "token_mean"
    kl_coef: Annotated[
        float,
        doc("weight of a KL(pi_theta || pi_ref) penalty to the frozen initial model (k3 estimator); 0 = off", ge=0),
    ] = 0.0

    def __post_init__(self) -> None:
        if self.behaviour_weight_mode == "icepop" and self.behaviour_weight_cap > 0:
            raise ValueError("trainer.loss.behaviour_weight_mode=icepop has its band, icepop_low/high: no cap")
        if self.icepop_low >= self.icepop_high:
            raise ValueError("trainer.loss.icepop_low must be below icepop_high")
        weighted = self.behaviour_weight_cap > 0 or self.behaviour_weight_mode == "icepop"
        if self.objective == "m2po" and (weighted or self.behaviour_weight_level != "token"):
            raise ValueError(
                "trainer.loss.objective=m2po weighs each token by pi_theta/pi_behav, masked by its second moment: "
                "behaviour_weight_cap, behaviour_weight_mode=icepop and behaviour_weight_level=sequence do not apply"
            )


class MicrobatchConfig(Section):
    """trainer.microbatch: how a minibatch is cut into packed micro-batches (memory, not maths)."""

    mode: Annotated[
        Literal["dynamic", "fixed"],
        doc("split of each minibatch into packed micro-batches: 'dynamic' under a token budget, 'fixed' count"),
    ] = "dynamic"
    max_tokens: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | Auto,
        doc(
            "dynamic: token budget (prompt + completion) of one packed micro-batch, a longer sequence alone; "
            "auto = 1024 on a CPU, 16384 on CUDA, where each micro-batch costs thousands of kernel launches"
        ),
    ] = AUTO
    min_count: Annotated[int, doc("dynamic: at least this many micro-batches per minibatch", ge=1)] = 1
    fixed_count: Annotated[int, doc("fixed: micro-batches per minibatch (contiguous, equal sequence counts)", ge=1)] = 1


class CheckpointConfig(Section):
    """trainer.checkpoint: what the trainer keeps on disk, and how often."""

    every: Annotated[int, doc("steps between checkpoints", ge=1)] = 100
    keep: Annotated[
        int, doc("checkpoints kept; `asyncrl replay retrain --step N` needs one from before step N", ge=1)
    ] = 2
    keep_versions: Annotated[int, doc("weight versions kept on shared storage", ge=2)] = 4
    whole_every: Annotated[
        int,
        doc(
            "every K-th version is written whole, the others as deltas against the one before (the changed "
            "elements: ~6 % of a bf16 version); 1 = whole only, as LoRA needs (docs: Life of a prompt, Delta versions)",
            ge=1,
        ),
    ] = 1
    weights_dir: Annotated[str, doc("shared storage for weight versions; auto = <run dir>/weights", min_length=1)] = (
        AUTO
    )


class TrainerConfig(Section):
    """The trainer's own loop; its sections hold the optimizer, the loss, micro-batching and checkpoints."""

    steps: Annotated[int, doc("optimizer steps; the run ends after the last one", ge=1)] = 600
    threads: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | Auto,
        doc("torch CPU threads of each trainer rank; auto = its share of the launcher's cores (1 in a deployment)"),
    ] = AUTO
    ranks: Annotated[
        int, doc("trainer processes on this machine, FSDP2 ranks under torchrun (gloo on CPU, NCCL on CUDA)", ge=1)
    ] = 1
    batch_groups: Annotated[int, doc("prompt groups per step (B)", ge=1)] = 8
    max_staleness: Annotated[int, doc("eta: a group released at version v trains by version v + eta", ge=0)] = 4
    max_in_flight: Annotated[
        int,
        doc(
            "most groups released and not yet trained or dropped, under eta's cap of (eta + 1) * B: groups beyond what"
            " rollout decodes wait in a queue, spending their eta versions; 0 = eta's cap (docs: Concepts)",
            ge=0,
        ),
    ] = 0
    skip_uniform_groups: Annotated[
        int,
        doc(
            "per step, drop up to this many groups whose samples all got the same reward (no advantage) and train on "
            "later ones instead (DAPO's dynamic sampling); 0 = off (docs: Concepts)",
            ge=0,
        ),
    ] = 0
    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()
    microbatch: MicrobatchConfig = MicrobatchConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()


class EvalConfig(Section):
    enabled: Annotated[
        bool, doc("false: no held-out evaluation at all (no evaluator process; summary.json's accuracies null)")
    ] = True
    every: Annotated[int, doc("evaluate the held-out set every N versions; 0 = only first/last", ge=0)] = 50
    k: Annotated[
        int, doc("sampled completions per prompt beside the greedy one (pass@k, maj@k); 0 = greedy only", ge=0)
    ] = 0
    temperature: Annotated[float, doc("sampling temperature of the k samples", gt=0)] = 1.0
    max_rows: Annotated[int, doc("evaluate at most this many held-out rows (the first ones); 0 = all", ge=0)] = 0


WANDB_FORBIDDEN = "/\\#?%:"  # characters W&B rejects in a project name


class TelemetryConfig(Section):
    sample_ratio: Annotated[
        float, doc("share of prompts whose whole journey is traced (decided once, at release)", ge=0, le=1)
    ] = 0.05
    otlp_endpoint: Annotated[
        str,
        doc(
            "OTLP/HTTP endpoint for spans, e.g. http://127.0.0.1:4318; "
            "empty = $OTEL_EXPORTER_OTLP_ENDPOINT, else <run dir>/traces.jsonl"
        ),
    ] = ""
    wandb_project: Annotated[
        str,
        doc(
            "Weights & Biases project that `asyncrl run` streams metrics.jsonl to (needs the wandb extra); empty = off",
            max_length=128,
        ),
    ] = ""
    wandb_entity: Annotated[str, doc("W&B user or team that owns the project; empty = your default entity")] = ""
    wandb_mode: Annotated[
        Literal["", "online", "offline"],
        doc("'online', or 'offline' (kept in <run dir>/wandb for `wandb sync`); empty = $WANDB_MODE, else online"),
    ] = ""

    def __post_init__(self) -> None:
        if (self.wandb_entity or self.wandb_mode) and not self.wandb_project:
            raise ValueError("telemetry.wandb_entity and telemetry.wandb_mode need telemetry.wandb_project")
        if set(self.wandb_project) & set(WANDB_FORBIDDEN):
            raise ValueError(
                f"telemetry.wandb_project {self.wandb_project!r}: W&B forbids any of {WANDB_FORBIDDEN} in a name"
            )


class ProfileConfig(Section):
    roles: Annotated[
        tuple[Literal["trainer", "rollout"], ...],
        doc(
            "roles whose steps torch.profiler records, op by op (trainer: its optimizer steps, rank 0; rollout: "
            "engine steps, in every rollout worker), to <run dir>/profile/; empty = off"
        ),
    ] = ()
    start: Annotated[int, doc("steps a profiled worker takes before recording (past its warm-up)", ge=0)] = 10
    steps: Annotated[int, doc("steps recorded: a Chrome trace and a table of the ops' times per worker", ge=1)] = 5
    record_shapes: Annotated[bool, doc("also record each op's input shapes (the table then splits ops by shape)")] = (
        False
    )
    with_stack: Annotated[bool, doc("also record the Python stack of each op (a much larger trace)")] = False


class LauncherState(Section):
    """What the launcher found and did, written into a run's config.yaml for its workers. Never set by a user:
    an override of it is refused (`pipeline.config.load_config`), and a launcher running a config writes it
    anew (`on_one_machine`, `prepare`), a run's config.yaml given again included."""

    cores: Annotated[
        int,
        doc(
            "cores the workers of `asyncrl run` share on its machine (its CPU affinity), split into automatic threads;"
            " 0 = a deployment, where each replica's cores are its own",
            ge=0,
        ),
    ] = 0
    embedded_broker: Annotated[
        bool,
        doc(
            "the run's broker is the embedded one, whose topics live in memory only: the trainer exports them before "
            "each checkpoint for `asyncrl run --resume`"
        ),
    ] = False
    sole_consumers: Annotated[
        bool,
        doc(
            "a role's only worker reads every partition without joining its consumer group: true under `asyncrl run`, "
            "which starts every worker, false in a deployment (whose workers may scale)"
        ),
    ] = False


class RunConfig(Section):
    name: Annotated[str, doc("run name: the run directory is <runs_dir>/<name>", min_length=1)] = "demo"
    runs_dir: Annotated[str, doc("where run directories are created")] = "runs"
    seed: Annotated[int, doc("seed for data order, sampling and the demo model")] = 0
    max_wall_s: Annotated[float, doc("stop the run after this many seconds; 0 = no limit", ge=0)] = 0.0
    broker: BrokerConfig = BrokerConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    trainer: TrainerConfig = TrainerConfig()
    eval: EvalConfig = EvalConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    profile: ProfileConfig = ProfileConfig()
    launcher: LauncherState = LauncherState()

    def __post_init__(self) -> None:
        if "/" in self.name or self.name in {".", "..", "latest"}:
            raise ValueError(f"name {self.name!r} must be a plain directory name other than 'latest'")
        if self.data.reward not in {"builtin", "math", "math-strict", "code"} and ":" not in self.data.reward:
            raise ValueError(
                f"data.reward {self.data.reward!r}: use builtin, math, math-strict, code, path/to/file.py:function "
                "or module:function"
            )
        if self.data.source != "builtin" and self.data.reward == "builtin":
            raise ValueError(
                "data.reward 'builtin' verifies the built-in task only; use 'math', 'math-strict', 'code' or 'module:function'"
            )
        if self.data.source != "builtin" and not self.model.path:
            raise ValueError(
                "data.source other than 'builtin' needs model.path (the demo model only knows its task's rows)"
            )
        if self.model.lora.rank > 0 and self.trainer.checkpoint.whole_every > 1:
            raise ValueError(
                "trainer.checkpoint.whole_every > 1 needs model.lora.rank 0: a LoRA run's versions (adapters, "
                "a few MB) are written whole"
            )
        if self.data.system_prompt and self.data.template != "chat":
            raise ValueError("data.system_prompt needs data.template=chat (a raw prompt has no system turn)")
        if self.rollout.backend == "vllm" and self.rollout.cache_lag not in (0, AUTO):
            raise ValueError(
                "rollout.cache_lag above 0 needs rollout.backend=torch (vLLM re-prefills a resumed request)"
            )
        if self.rollout.workers > self.broker.partitions:
            raise ValueError(
                f"rollout.workers={self.rollout.workers} needs broker.partitions >= {self.rollout.workers} "
                "(each rollout worker consumes its own partitions of `prompts`)"
            )
        if self.trainer.skip_uniform_groups and self.data.n_samples < 2:
            raise ValueError("trainer.skip_uniform_groups needs data.n_samples >= 2 (a group of one is always uniform)")
        if self.trainer.optim.minibatches > self.trainer.batch_groups * self.data.n_samples:
            raise ValueError(
                "trainer.optim.minibatches cannot exceed the trajectories per step "
                "(trainer.batch_groups * data.n_samples)"
            )
