"""Run configuration: a TOML file validated by pydantic, with ``--section.key value`` overrides.

Each section is the settings class of the room that uses it (``[trainer]`` is
consumers/trainer/settings.py's, ``[[envs]]`` producers/settings.py's, ...); this module only
composes them and checks what spans sections. What a plugin (an engine, a store) asks of the
settings is its own checks' (registered with it, jetrl/plugins.py). The resolved config is
recorded in the run's RunStarted event and in ``<run dir>/config.json``. Each process is handed
only its part (trainer, inference, producer), composed here. Nothing here imports torch: any
config is read and validated without it (a run's Hugging Face checkpoint is checked with torch,
by ``config_for_run``).
"""

from __future__ import annotations

import contextlib
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from jetrl.bus.settings import BusSettings, EnvRoute, Section, TenantSettings
from jetrl.consumers.inference.engine import engine_checks
from jetrl.consumers.inference.settings import InferencePart, InferenceSettings
from jetrl.consumers.monitor.settings import MonitorSettings
from jetrl.consumers.trainer.settings import TrainerPart, TrainerSettings
from jetrl.policy.settings import ModelSettings
from jetrl.policy.tokenizer import tokenizer_for
from jetrl.producers.environments import make_environment
from jetrl.producers.settings import EnvSettings, ProducerPart
from jetrl.store.settings import StoreSettings


class RunSettings(Section):
    name: str = "run"  # run ids are <name>-<timestamp> unless --run-id is given
    seed: int = 0
    runs_dir: str = "runs"
    max_wall_s: float | None = Field(None, gt=0)  # stop the run after this many seconds
    # Parts forked from a server that imported their modules once (deploy/launcher.py): each is
    # still its own process; false starts each as a fresh interpreter.
    fork_parts: bool = True
    # Kinds of part that run as tasks of shared processes instead of each its own
    # (deploy/host.py): still meeting only through the log, restarted together from it. Parts
    # that only read the log (recorder, monitor) share one process, the others another.
    host_together: list[Literal["producer", "inference", "trainer", "recorder", "monitor"]] = Field(
        default_factory=list
    )
    # Added to the niceness of the parts that only read the log (the monitor, the recorder):
    # off the training's path, they yield the cores to it when the machine is short of them
    # (docs/running.md "Where a step's time goes"). 0 keeps them level with the others.
    follower_nice: int = Field(10, ge=0, le=19)
    # The inference workers and producers this machine starts, and its nats-server, kept off as
    # many cores as the trainer has ranks x threads, where some are left for them
    # (deploy/cores.py): the trainer sets the pace, and they took turns on its core.
    trainer_own_cores: bool = True


class RunConfig(Section):
    """A run config: each section is the settings class of the room that uses it."""

    run: RunSettings = RunSettings()
    model: ModelSettings = ModelSettings()
    trainer: TrainerSettings = TrainerSettings()
    inference: InferenceSettings = InferenceSettings()
    envs: list[EnvSettings] = Field(default_factory=lambda: [EnvSettings()])
    tenants: list[TenantSettings] = Field(default_factory=list)
    bus: BusSettings = BusSettings()
    store: StoreSettings = StoreSettings()
    monitor: MonitorSettings = MonitorSettings()

    @model_validator(mode="after")
    def _one_temperature(self) -> RunConfig:
        # The trainer takes logprobs at the sampling temperature, so all envs must share it.
        if not self.envs:
            raise ValueError("at least one [[envs]] entry is needed")
        temps = {e.temperature for e in self.envs}
        if len(temps) > 1:
            raise ValueError(f"all envs must sample at one temperature, got {sorted(temps)}")
        pairs = [(e.tenant, e.name) for e in self.envs]
        if len(set(pairs)) != len(pairs):
            raise ValueError(f"two [[envs]] entries share a (tenant, name): {sorted(pairs)}")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"a tenant is listed twice in [[tenants]]: {sorted(names)}")
        engine_checks(self.inference.engine).check(self.inference, self.model)
        return self

    # ------------------------------------------------------------ what each process is handed

    def tenant_settings(self) -> list[TenantSettings]:
        """Every tenant of the run: those of ``[[tenants]]``, then any other an env names."""
        out = {t.name: t for t in self.tenants}
        for e in self.envs:
            out.setdefault(e.tenant, TenantSettings(name=e.tenant))
        return list(out.values())

    def env_routes(self) -> list[EnvRoute]:
        return [
            EnvRoute(tenant=e.tenant, env=e.name, group_size=e.group_size, share=e.share) for e in self.envs
        ]

    def weights_dir(self, run_dir: Path) -> str:
        """The run's shared directory, for a payload store that keeps files there (``[bus]
        weights_store = "file"``): ``payloads`` in the run directory."""
        return str((run_dir / "payloads").resolve())

    def trainer_part(self, run_dir: Path) -> TrainerPart:
        t = self.envs[0].temperature
        return TrainerPart(
            trainer=self.trainer,
            model=self.model,
            seed=self.run.seed,
            temperature=t if t > 0 else 1.0,
            bus=self.bus,
            weights_dir=self.weights_dir(run_dir),
            tenants=self.tenant_settings(),
            envs=self.env_routes(),
        )

    def inference_part(self, run_dir: Path) -> InferencePart:
        return InferencePart(
            inference=self.inference,
            model=self.model,
            seed=self.run.seed,
            bus=self.bus,
            weights_dir=self.weights_dir(run_dir),
            tenants=self.tenant_settings(),
            envs=self.env_routes(),
        )

    def producer_parts(self) -> list[ProducerPart]:
        total = sum(e.share for e in self.envs)
        return [
            ProducerPart(
                env=e,
                model=self.model,
                groups_per_step=max(1, round(self.trainer.batch_groups * e.share / total)),
                max_off_policy_steps=self.trainer.max_off_policy_steps,
                seed=self.run.seed + 1000 * k,
            )
            for k, e in enumerate(self.envs)
        ]


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
            data["envs"] = [EnvSettings().model_dump()]
        apply_overrides(data, overrides)
    try:
        cfg = RunConfig.model_validate(data)
        vocab = None
        engine = engine_checks(cfg.inference.engine)
        if cfg.model.hf_path:  # a checkpoint is checked here, before any process starts (torch)
            from jetrl.policy.origin import check_model

            mcfg = check_model(cfg.model)
            vocab = mcfg.vocab_size
            why = engine.no_routing(cfg.inference)
            if mcfg.is_moe and cfg.trainer.replay and why:
                raise ValueError(f"{why}: an MoE run needs [trainer] replay = false then")
        engine.check_here(cfg.inference)
        tok = tokenizer_for(cfg.model)
        if vocab is not None and tok.vocab_size > vocab:
            raise ValueError(f"the tokenizer's {tok.vocab_size} ids exceed the model's vocabulary of {vocab}")
        for e in cfg.envs:
            make_environment(e.env_kind, tok, **e.params).prepare()
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
