"""Run configuration: a TOML file validated by pydantic, with ``--section.key value`` overrides.

The resolved config is recorded in the run's RunStarted event and in ``<run dir>/config.json``.
Each process receives only its own settings (trainer, inference, producer), derived here.
"""

from __future__ import annotations

import contextlib
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jetrl.bus.streams import GiB, StreamLimits
from jetrl.bus.subjects import check_token
from jetrl.consumers.inference.worker import InferenceSettings
from jetrl.consumers.trainer.trainer import TrainerSettings
from jetrl.producers.environments import make_environment
from jetrl.producers.producer import ProducerSettings


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunSection(_Section):
    name: str = "run"  # run ids are <name>-<timestamp> unless --run-id is given
    seed: int = 0
    runs_dir: str = "runs"
    max_wall_s: float | None = Field(None, gt=0)  # stop the run after this many seconds


class ModelSection(_Section):
    name: str = "tiny-moe"  # a config of jetrl.policy.models.CONFIGS
    overrides: dict[str, Any] = Field(default_factory=dict)


class TrainerSection(_Section):
    lr: float = 5e-4
    weight_decay: float = 0.0
    batch_groups: int = Field(8, ge=1)
    max_off_policy_steps: int = Field(1, ge=0)
    max_steps: int = Field(1000, ge=1)
    stop_at_reward: float | None = None
    reward_window: int = Field(10, ge=1)
    replay: bool = True
    kl_coef: float = Field(1e-3, ge=0)
    entropy_coef: float = Field(0.0, ge=0)
    std_scale_advantages: bool = False
    max_grad_norm: float = 1.0
    checkpoint_every: int = Field(10, ge=0)
    threads: int = Field(1, ge=1)
    ack_wait_s: float = Field(30.0, gt=0)  # how soon rollouts held by a dead trainer are redelivered


class InferenceSection(_Section):
    workers: int = Field(1, ge=1)
    precision: Literal["bf16", "fp32"] = "bf16"
    max_batch_tasks: int = Field(8, ge=1)
    top_p: float = Field(1.0, gt=0, le=1)
    threads: int = Field(1, ge=1)
    ack_wait_s: float = Field(30.0, gt=0)  # how soon tasks held by a dead worker go to another


class EnvSection(_Section):
    name: str = "modsum"  # the environment's name in subjects, ids and the store
    kind: str | None = None  # which environment: a built-in or "verifiers"; default: name
    tenant: str = "default"
    group_size: int = Field(16, ge=2)
    share: float = Field(1.0, gt=0)  # relative share of each trainer batch
    temperature: float = Field(1.0, ge=0)
    params: dict[str, Any] = Field(default_factory=dict)
    latency_median_s: float = Field(0.0, ge=0)
    latency_sigma: float = Field(1.0, ge=0)
    inflight_groups: int | None = Field(None, ge=1)  # see ProducerSettings.max_inflight_groups
    ack_wait_s: float = Field(30.0, gt=0)  # how soon generations held by a dead producer are rescored

    @field_validator("name", "tenant")
    @classmethod
    def _token(cls, v: str) -> str:
        return check_token(v, "env/tenant name")


class BusSection(_Section):
    max_gib: float = Field(8.0, gt=0)  # the run's log
    payload_max_gib: float = Field(32.0, gt=0)  # the run's payload bucket
    # Where weights travel: the run's object store (any machine), or files in the run directory
    # (every process on one filesystem; far faster for weights of tens of MB and more).
    weights_store: Literal["objstore", "file"] = "objstore"

    def limits(self) -> StreamLimits:
        return StreamLimits(
            max_bytes=int(self.max_gib * GiB), payload_max_bytes=int(self.payload_max_gib * GiB)
        )


class StoreSection(_Section):
    db: str | None = None  # SQLAlchemy URL; default: SQLite file <run dir>/store.db
    recorder: bool = True


class RunConfig(_Section):
    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    trainer: TrainerSection = TrainerSection()
    inference: InferenceSection = InferenceSection()
    envs: list[EnvSection] = Field(default_factory=lambda: [EnvSection()])
    bus: BusSection = BusSection()
    store: StoreSection = StoreSection()

    # ------------------------------------------------------------ per-process settings

    @model_validator(mode="after")
    def _one_temperature(self) -> RunConfig:
        # The trainer takes logprobs at the sampling temperature, so all envs must share it.
        temps = {e.temperature for e in self.envs}
        if len(temps) > 1:
            raise ValueError(f"all envs must sample at one temperature, got {sorted(temps)}")
        if not self.envs:
            raise ValueError("at least one [[envs]] entry is needed")
        return self

    def trainer_settings(self) -> TrainerSettings:
        return TrainerSettings(
            model=self.model.name,
            model_overrides=self.model.overrides,
            seed=self.run.seed,
            temperature=self.envs[0].temperature if self.envs[0].temperature > 0 else 1.0,
            **self.trainer.model_dump(),
        )

    def inference_settings(self) -> InferenceSettings:
        return InferenceSettings(
            model=self.model.name,
            model_overrides=self.model.overrides,
            seed=self.run.seed,
            **self.inference.model_dump(exclude={"workers"}),
        )

    def producer_settings(self) -> list[ProducerSettings]:
        total = sum(e.share for e in self.envs)
        out = []
        for k, e in enumerate(self.envs):
            groups = max(1, round(self.trainer.batch_groups * e.share / total))
            out.append(
                ProducerSettings(
                    env=e.name,
                    kind=e.kind,
                    env_params=e.params,
                    tenant=e.tenant,
                    group_size=e.group_size,
                    groups_per_step=groups,
                    max_off_policy_steps=self.trainer.max_off_policy_steps,
                    temperature=e.temperature,
                    seed=self.run.seed + 1000 * k,
                    latency_median_s=e.latency_median_s,
                    latency_sigma=e.latency_sigma,
                    max_inflight_groups=e.inflight_groups,
                    ack_wait_s=e.ack_wait_s,
                )
            )
        return out


class ConfigError(ValueError):
    pass


def _parse_value(text: str) -> Any:
    """A TOML literal (``0.01``, ``true``, ``"x"``, ``[1, 2]``), else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``["--trainer.lr", "0.01", "--envs.0.group_size", "8"]`` applied to ``data`` in place."""
    it = iter(overrides)
    for flag in it:
        if not flag.startswith("--") or "." not in flag:
            raise ConfigError(f"unexpected argument {flag!r}: overrides look like --section.key value")
        key, eq, inline = flag[2:].partition("=")
        value = inline if eq else next(it, None)
        if value is None:
            raise ConfigError(f"{flag} needs a value")
        node: Any = data
        parts = key.split(".")
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        last = parts[-1]
        if isinstance(node, list):
            node[int(last)] = _parse_value(value)
        else:
            node[last] = _parse_value(value)
    return data


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    return config_for_run(data, overrides)


def config_for_run(data: dict[str, Any], overrides: list[str] | None = None) -> RunConfig:
    """The config a run starts (or resumes) with: validated, and every environment built and
    prepared once, so that a bad one fails here and not in a producer that would crash-loop.
    (Reading a recorded config, e.g. for replay, needs only ``RunConfig.model_validate``.)"""
    if overrides:
        if "envs" not in data and any(o.startswith("--envs.") for o in overrides):
            data["envs"] = [EnvSection().model_dump()]
        apply_overrides(data, overrides)
    try:
        cfg = RunConfig.model_validate(data)
        for e in cfg.envs:
            make_environment(e.kind or e.name, **e.params).prepare()
    except Exception as exc:
        raise ConfigError(f"invalid run config: {exc}") from None
    return cfg


def library_versions() -> dict[str, str]:
    """The versions a run records in RunStarted, which replay compares with its own: the
    libraries whose changes can change a step's numbers."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "torchtitan", "nats-py", "msgspec", "sqlalchemy", "verifiers"):
        with contextlib.suppress(PackageNotFoundError):
            out[pkg] = version(pkg)
    return out
