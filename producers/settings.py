"""The environment producers' settings: one ``[[envs]]`` entry as written in a run config, and
what one producer process is handed (that entry, the model's tokenizer, its share of a trainer
batch). Torch-free."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from jetrl.bus.settings import MAX_OFF_POLICY_STEPS, Section
from jetrl.bus.subjects import check_token
from jetrl.policy.settings import ModelSettings


class EnvSettings(Section):
    name: str = "modsum"  # the environment's name in subjects, ids and the store
    kind: str | None = None  # which environment: a built-in or "verifiers"; default: name
    tenant: str = "default"
    # Run by its tenant on its own machine (`jetrl producer --creds ...`), not by the supervisor;
    # the run still counts its share and knows its (tenant, env) pair.
    remote: bool = False
    group_size: int = Field(16, ge=2)
    share: float = Field(1.0, gt=0)  # relative share of each trainer batch
    temperature: float = Field(1.0, ge=0)
    params: dict[str, Any] = Field(default_factory=dict)
    latency_median_s: float = Field(0.0, ge=0)  # simulated environment latency per rollout (0 = none)
    latency_sigma: float = Field(1.0, ge=0)  # lognormal shape: 1.3 puts ~1% of episodes past 20x the median
    max_concurrent_scoring: int = Field(512, ge=1)
    # Groups in flight (submitted, not yet trained or withheld). Default: one batch share per
    # step of allowed staleness, (1 + max_off_policy_steps) * groups_per_step. Slow, long-tailed
    # environments need more in flight to keep the trainer busy (Little's law); the trainer
    # still withholds whatever ends up staler than the bound.
    inflight_groups: int | None = Field(None, ge=1)
    # A single-turn group's scores go out once this share of its samples is scored (at least
    # 2): the rest are late, left out of the group and listed in its RolloutsScored's
    # late_samples. Below 1 it cuts a long-tailed environment's wait for a group's slowest
    # sample, at a bias where scoring time depends on the answer (docs/running.md).
    group_quorum: float = Field(1.0, gt=0, le=1)
    ack_wait_s: float = Field(30.0, gt=0)  # how soon generations held by a dead producer are rescored
    # Evaluation on the environment's held-out split (producers/evaluation.py): every
    # `eval_every` policy versions (0 = never; version 0 is evaluated too), its first
    # `eval_tasks` tasks, `eval_samples` samples each (the k of pass@k), never trained on.
    eval_every: int = Field(0, ge=0)
    eval_tasks: int = Field(32, ge=1, le=10_000)
    eval_samples: int = Field(4, ge=1, le=1024)
    eval_temperature: float = Field(1.0, ge=0)

    @field_validator("name", "tenant")
    @classmethod
    def _token(cls, v: str) -> str:
        return check_token(v, "env/tenant name")

    @property
    def env_kind(self) -> str:
        return self.kind or self.name


class ProducerPart(Section):
    """One producer process's input (``python -m jetrl.producers --settings``)."""

    env: EnvSettings = EnvSettings()
    model: ModelSettings = ModelSettings()
    groups_per_step: int = Field(8, ge=1)  # this environment's share of a trainer batch
    max_off_policy_steps: int = Field(MAX_OFF_POLICY_STEPS, ge=0)
    seed: int = 0
