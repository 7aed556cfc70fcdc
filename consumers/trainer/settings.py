"""The trainer's settings: ``[trainer]`` as written in a run config, and what the trainer
process is handed (that section, the model, and the run-wide values it needs). Torch-free."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from jetrl.bus.settings import EnvRoute, Section, TenantSettings
from jetrl.policy.settings import ModelSettings


class TrainerSettings(Section):
    engine: str = "local"  # a name of consumers.trainer.engine.ENGINES, or "module:attr"
    lr: float = 5e-4
    weight_decay: float = 0.0
    batch_groups: int = Field(8, ge=1)  # groups per optimizer step
    max_off_policy_steps: int = Field(1, ge=0)
    max_steps: int = Field(1000, ge=1)
    stop_at_reward: float | None = None  # stop once the mean reward over `reward_window` steps reaches it
    reward_window: int = Field(10, ge=1)
    replay: bool = True
    kl_coef: float = Field(1e-3, ge=0)
    entropy_coef: float = Field(0.0, ge=0)
    std_scale_advantages: bool = False
    max_grad_norm: float = 1.0
    checkpoint_every: int = Field(10, ge=0)
    threads: int = Field(1, ge=1)
    ack_wait_s: float = Field(30.0, gt=0)  # how soon rollouts held by a dead trainer are redelivered
    # The layout of the weights it publishes: jetrl's (torchtitan names, grouped experts) or
    # Hugging Face's (per-expert tensors), for engines that load that. Checksums are the same.
    weights_layout: Literal["jetrl", "hf"] = "jetrl"
    # Each step's per-token trainer log-probs and routing differences, published with its
    # StepCompleted (8 bytes a completion token) for the monitor's rollout inspector.
    record_token_stats: bool = True


class TrainerPart(Section):
    """The trainer process's input (``python -m jetrl.consumers.trainer --settings``)."""

    trainer: TrainerSettings = TrainerSettings()
    model: ModelSettings = ModelSettings()
    seed: int = 0
    temperature: float = 1.0  # the sampling temperature: trainer logprobs are taken under it
    # Weights go to this shared directory (a FilePayloads store) instead of the run's object
    # store: much faster for models past a few MB when every process sees the same filesystem.
    weights_dir: str | None = None
    # The run's tenants and environments (batch shares; rollouts of any other pair are refused);
    # empty: any environment, batches filled in arrival order.
    tenants: list[TenantSettings] = Field(default_factory=list)
    envs: list[EnvRoute] = Field(default_factory=list)
