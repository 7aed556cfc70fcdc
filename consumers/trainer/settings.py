"""The trainer's settings: ``[trainer]`` as written in a run config, and what the trainer
process is handed (that section, the model, and the run-wide values it needs). Torch-free."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from jetrl.bus.settings import MAX_OFF_POLICY_STEPS, BusSettings, EnvRoute, Section, TenantSettings
from jetrl.plugins import TRAIN_ENGINES
from jetrl.policy.schedule import Decay, LrSchedule
from jetrl.policy.settings import ModelSettings

if TYPE_CHECKING:
    from jetrl.policy.loss import LossConfig


class ParallelismSettings(Section):
    """How the trainer's ranks split the work (torchtitan's parallelisms). The world size is
    ``dp_replicate * dp_shard * cp * tp``; expert parallelism borrows its ranks from
    ``dp_shard * cp * tp`` (as in torchtitan), so ``ep`` must divide that product."""

    dp_shard: int = Field(1, ge=1)  # FSDP2: parameters, gradients and optimizer state sharded
    dp_replicate: int = Field(1, ge=1)  # replicas of the sharded model (HSDP)
    ep: int = Field(1, ge=1)  # experts of each MoE layer split across ranks, tokens all-to-all
    cp: int = Field(1, ge=1)  # the sequence split across ranks (refused for now: see _check)
    tp: int = Field(1, ge=1)  # tensor parallelism (refused for now: see _check)
    device: Literal["cpu", "cuda"] = "cpu"
    # The MoE all-to-all: torch's all_to_all_single (gloo or NCCL); "deepep" (Hopper GPUs) is
    # refused until it has been checked on one.
    all_to_all: Literal["torch", "deepep"] = "torch"

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Ranks that take different rollouts of a step."""
        return self.dp_replicate * self.dp_shard

    @model_validator(mode="after")
    def _check(self) -> ParallelismSettings:
        if (self.dp_shard * self.cp * self.tp) % self.ep:
            raise ValueError(
                f"ep = {self.ep} must divide dp_shard * cp * tp = {self.dp_shard * self.cp * self.tp}"
            )
        # Refused before any process starts, each with why (consumers/trainer/parallel/).
        if self.cp > 1:
            raise ValueError(
                "cp > 1: context parallel training is not available (torch has no CP backward on "
                "CPU, and it has not been checked on a GPU); its forward is (parallel/context.py)"
            )
        if self.tp > 1:
            raise ValueError(
                "tp > 1: tensor parallel training is not wired yet: torchtitan's TP leaves logits "
                "and router scores as DTensors, which the loss and Router Replay do not take"
            )
        if self.all_to_all == "deepep":
            raise ValueError(
                "all_to_all = 'deepep' needs Hopper GPUs and has not been checked on one yet; "
                "use 'torch' (torch's all_to_all_single, on gloo or NCCL)"
            )
        return self


class TrainerSettings(Section):
    # A train engine of jetrl/plugins.py, or "package.module:attr"; "auto": the first built-in
    # whose launch fits [trainer.parallelism] (one process for one rank, torchrun for more),
    # resolved as the settings are validated: the run records the engine's own name.
    engine: str = "auto"
    parallelism: ParallelismSettings = ParallelismSettings()
    lr: float = 5e-4
    weight_decay: float = 0.0
    # The learning rate through the run (policy/schedule.py): rising linearly over the first
    # lr_warmup_steps optimizer steps, then lr_decay ("linear" or "cosine") over lr_decay_steps
    # down to lr * lr_min_ratio. Part of the maths: a run replays with its own; the schedule's
    # clock is AdamW's step count, which checkpoints keep. lr_decay_steps left out is the rest
    # of max_steps, resolved as the settings are validated, so the run records the number and a
    # resume that raises max_steps replays the steps before it at the rates they were taken at.
    lr_warmup_steps: int = Field(0, ge=0)
    lr_decay: Decay = "constant"
    lr_decay_steps: int | None = Field(None, ge=1)
    lr_min_ratio: float = Field(0.0, ge=0, le=1)
    batch_groups: int = Field(8, ge=1)  # groups per optimizer step
    max_off_policy_steps: int = Field(MAX_OFF_POLICY_STEPS, ge=0)
    max_steps: int = Field(1000, ge=1)
    # Take each fresh group as it arrives (its forward and backward at once, gradients summed)
    # and step the optimizer once `batch_groups` are in, instead of waiting for the whole batch
    # first: the trainer computes while slow environments finish the rest (bench/async.py).
    # The same groups give the same step up to float round-off; StepCompleted records the
    # micro-batches, so replay takes them the same way. true needs an engine that accumulates
    # (local); "auto" streams where the engine can and the trainer's recent batches were still
    # incomplete late into their steps (consumers/trainer/groups.py StreamChoice), else it
    # takes whole batches.
    stream_groups: bool | Literal["auto"] = "auto"
    stop_at_reward: float | None = None  # stop once the mean reward over `reward_window` steps reaches it
    reward_window: int = Field(10, ge=1)
    replay: bool = True
    kl_coef: float = Field(1e-3, ge=0)
    # PPO's clip against the policy that sampled each rollout (policy/loss.py LossConfig.clipped):
    # a token its own policy has moved past 1 +- ratio_clip, on the side its advantage pushes,
    # gets no more push. Keeps off-policy steps as sample-efficient as on-policy ones
    # (docs/policy.md); 0: off, only the train/inference mismatch mask. Part of the maths: a run
    # replays with its own.
    ratio_clip: float = Field(0.2, ge=0, lt=1)
    # The clip's upper side for tokens with a positive advantage, where it differs (DAPO's
    # "clip-higher"); None: ratio_clip.
    ratio_clip_high: float | None = Field(None, ge=0)
    # Dual-clip PPO: a token with a negative advantage whose ratio has risen past this since its
    # rollout was sampled gets no more push; 8: only the mismatch mask. 3 (the paper's) did not
    # keep a stale run's reward past its target better than 8 (docs/policy.md, "Holding the
    # reward"). Part of the maths: a run replays with its own.
    dual_clip: float = Field(8.0, ge=1, le=8)
    entropy_coef: float = Field(0.0, ge=0)
    std_scale_advantages: bool = False
    max_grad_norm: float = 1.0
    checkpoint_every: int = Field(10, ge=0)
    threads: int = Field(1, ge=1)
    ack_wait_s: float = Field(30.0, gt=0)  # how soon rollouts held by a dead trainer are redelivered
    # The layout of the weights it publishes: jetrl's (torchtitan names, grouped experts) or
    # Hugging Face's (per-expert tensors), for engines that load that. Checksums are the same.
    weights_layout: Literal["jetrl", "hf"] = "jetrl"
    # Published weights kept in their store: the newest `weights_keep` versions and version 0
    # (where `jetrl replay` and a recovery without a checkpoint start); each older one is
    # discarded as a newer one is announced (a 1000-step run of a 135M model in fp32 would
    # otherwise leave 538 GB). None: every version kept, for `jetrl export-model --version`.
    weights_keep: int | None = Field(4, ge=2)
    # Each step's per-token trainer log-probs and routing differences, published with its
    # StepCompleted (8 bytes a completion token) for the monitor's rollout inspector.
    record_token_stats: bool = True
    # Sequence packing: rows of up to this many tokens hold several rollouts (attention and
    # positions kept within each, policy/packing.py), so a step of mixed lengths pads little.
    # 0: one rollout per right-padded row. Part of the maths: a run replays with its own.
    pack_tokens: int = Field(0, ge=0)

    def loss_config(self) -> LossConfig:
        """The loss these settings make (the engines' one way to it)."""
        from jetrl.policy.loss import LossConfig

        return LossConfig.clipped(
            self.ratio_clip,
            eps_high=self.ratio_clip_high,
            dual_clip=self.dual_clip,
            kl_coef=self.kl_coef,
            entropy_coef=self.entropy_coef,
        )

    def lr_schedule(self) -> LrSchedule:
        """The learning rate's schedule these settings make (the engines' one way to it)."""
        steps = self.lr_decay_steps or 0  # resolved by validation unless the rate is constant
        return LrSchedule(self.lr, self.lr_warmup_steps, self.lr_decay, steps, self.lr_min_ratio)

    @property
    def engine_name(self) -> str:
        """The train engine (``auto`` is resolved as the settings are validated)."""
        return self.engine

    @model_validator(mode="after")
    def _clip(self) -> TrainerSettings:
        if self.ratio_clip_high is not None and self.ratio_clip == 0:
            raise ValueError("ratio_clip_high sets the clip's upper side apart: it needs ratio_clip > 0")
        return self

    @model_validator(mode="after")
    def _lr_decay(self) -> TrainerSettings:
        if self.lr_decay == "constant" and (self.lr_decay_steps is not None or self.lr_min_ratio):
            raise ValueError("lr_decay_steps and lr_min_ratio shape a decay: set lr_decay (linear, cosine)")
        if self.lr_decay != "constant" and self.lr_decay_steps is None:
            self.lr_decay_steps = max(self.max_steps - self.lr_warmup_steps, 1)
        return self

    @model_validator(mode="after")
    def _engine(self) -> TrainerSettings:
        from jetrl.consumers.trainer.engine import auto_engine, train_launch

        if self.engine == "auto":
            # Resolved here, once: what the run records (RunStarted) is the engine that runs.
            self.engine = auto_engine(self)
        else:
            TRAIN_ENGINES.check(self.engine)
        train_launch(self.engine).check(self)
        return self


class TrainerPart(Section):
    """The trainer process's input (``python -m jetrl.consumers.trainer --settings``)."""

    trainer: TrainerSettings = TrainerSettings()
    model: ModelSettings = ModelSettings()
    seed: int = 0
    temperature: float = 1.0  # the sampling temperature: trainer logprobs are taken under it
    # The run's [bus]: where weights go (`weights_store`, a payload store of jetrl/plugins.py),
    # each store's own section.
    bus: BusSettings = BusSettings()
    # The run's shared directory, for a store that keeps files there ("file": much faster than
    # the object store for models past a few MB when every process sees the same filesystem).
    weights_dir: str | None = None
    # The run's tenants and environments (batch shares; rollouts of any other pair are refused);
    # empty: any environment, batches filled in arrival order.
    tenants: list[TenantSettings] = Field(default_factory=list)
    envs: list[EnvRoute] = Field(default_factory=list)
