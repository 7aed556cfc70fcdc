"""The plugin registry: for each seam, the implementations a setting may name.

A seam (generation engines, train engines, tokenizers, environments, payload stores) is a
:class:`Seam`. A setting names one of its plugins in one of three ways:

- a built-in: its name in the seam's table below (one line each: this is where jetrl's own
  implementations register);
- a plugin an installed package registers: an entry point of the seam's group
  (``jetrl.<seam>``, e.g. ``[project.entry-points."jetrl.generation_engines"] oracle =
  "mypkg.oracle:OracleEngine"``), and its checks, if any, under the same name in
  ``jetrl.<seam>.checks``; every process of a run finds it where the package is installed;
- any ``package.module:attr`` (no checks).

A registration (:class:`Plugin`) names the implementation and, optionally, its checks: a
torch-free object of the shape the seam's own module defines (what callers need before building
the plugin: its settings checks, how it is launched). The seam's module says what a plugin of it
is; this module only finds them. Nothing is imported until asked for, so a torch-free caller
stays torch-free until it builds the thing.

A leaf (it imports nothing of jetrl's): every room may use it, bus/ and policy/ included
(tests/system/test_layout.py)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any


class UnknownPlugin(ValueError):
    """A setting names no plugin of its seam."""


@dataclass(frozen=True)
class Plugin:
    """A registration: the implementation and its checks, each ``package.module:attr``."""

    target: str
    checks: str | None = None


def _load(target: str, what: str, spec: str) -> Any:
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise UnknownPlugin(f"{what} {spec!r}: {target!r} is not 'package.module:attr'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {what} {spec!r} ({target}): {exc}") from exc


class Seam:
    """The plugins of one seam: ``key`` names its entry-point group (``jetrl.<key>``), ``what``
    is how messages name one of them."""

    def __init__(self, key: str, what: str, builtins: Mapping[str, Plugin]) -> None:
        self.key = key
        self.what = what
        self.builtins = dict(builtins)

    @property
    def group(self) -> str:
        return f"jetrl.{self.key}"

    def _installed(self, name: str, group: str) -> str | None:
        found = entry_points(group=group, name=name)
        return next(iter(found)).value if found else None

    def names(self) -> list[str]:
        """The names a setting may give: the built-ins, then those installed packages register."""
        installed = sorted({ep.name for ep in entry_points(group=self.group)} - self.builtins.keys())
        return [*self.builtins, *installed]

    def plugin(self, spec: str) -> Plugin:
        """The registration ``spec`` names; :class:`UnknownPlugin` when there is none."""
        if spec in self.builtins:
            return self.builtins[spec]
        if ":" in spec:
            module, _, attr = spec.partition(":")
            if not module or not attr:
                raise UnknownPlugin(f"{self.what} {spec!r} is not 'package.module:attr'")
            return Plugin(spec)
        target = self._installed(spec, self.group)
        if target is None:
            raise UnknownPlugin(
                f"unknown {self.what} {spec!r}: give one of {self.names()} or 'package.module:attr'"
            )
        return Plugin(target, self._installed(spec, f"{self.group}.checks"))

    def check(self, spec: str) -> str:
        """``spec`` if it names a plugin (nothing imported): a settings validator's test."""
        self.plugin(spec)
        return spec

    def load(self, spec: str) -> Any:
        """The implementation ``spec`` names (its module imported now)."""
        return _load(self.plugin(spec).target, self.what, spec)

    def checks(self, spec: str) -> Any | None:
        """The checks registered with ``spec`` (None: it registered none)."""
        checks = self.plugin(spec).checks
        return None if checks is None else _load(checks, f"{self.what} checks of", spec)


# ------------------------------------------------------------------ jetrl's own plugins

_INFERENCE = "jetrl.consumers.inference"
_TRAINER = "jetrl.consumers.trainer"

# [inference] engine: a class or factory taking (InferencePart, worker id); checks:
# consumers/inference/engine.py's EngineChecks.
GENERATION_ENGINES = Seam(
    "generation_engines",
    "generation engine",
    {
        "titan": Plugin(f"{_INFERENCE}.titan_engine:TitanEngine"),
        "vllm": Plugin(f"{_INFERENCE}.vllm_engine:VLLMEngine", checks=f"{_INFERENCE}.vllm_engine:CHECKS"),
    },
)

# [trainer] engine: a class or factory taking a TrainerPart; checks: consumers/trainer/engine.py's
# TrainLaunch (how its processes start, the layouts it takes). "auto" picks the first built-in
# whose launch fits [trainer.parallelism].
TRAIN_ENGINES = Seam(
    "train_engines",
    "train engine",
    {
        "local": Plugin(f"{_TRAINER}.local_engine:LocalTrainEngine", checks=f"{_TRAINER}.engine:ONE_PROCESS"),
        "parallel": Plugin(
            f"{_TRAINER}.parallel.engine:ParallelTrainEngine", checks=f"{_TRAINER}.parallel.launch:TORCHRUN"
        ),
    },
)

# [model] tokenizer: a factory taking [model] hf_path (the checkpoint directory, or None).
TOKENIZERS = Seam(
    "tokenizers",
    "tokenizer",
    {
        "char": Plugin("jetrl.policy.tokenizer:char_tokenizer"),
        "hf": Plugin("jetrl.policy.hf_tokenizer:hf_tokenizer"),
    },
)

# [[envs]] kind: a subclass of producers/environments.py's Environment.
ENVIRONMENTS = Seam(
    "environments",
    "environment",
    {
        "reverse": Plugin("jetrl.producers.environments:ReverseEnv"),
        "sort": Plugin("jetrl.producers.environments:SortEnv"),
        "modsum": Plugin("jetrl.producers.environments:ModSumEnv"),
        "chainsum": Plugin("jetrl.producers.environments:ChainSumEnv"),
        "arithmetic": Plugin("jetrl.producers.arithmetic:ArithmeticEnv"),
        "parity": Plugin("jetrl.producers.parity:ParityEnv"),
        "calculator": Plugin("jetrl.producers.tool_env:CalculatorToolEnv"),
        "verifiers": Plugin("jetrl.producers.verifiers_env:VerifiersEnv"),
    },
)

# [bus] weights_store, traces_store: a class with `open(site)` (bus/payloads.py's StoreKind);
# checks: a `check(bus)` of the [bus] section. A reference carries the name (PayloadRef.store).
PAYLOAD_STORES = Seam(
    "payload_stores",
    "payload store",
    {
        "objstore": Plugin("jetrl.bus.payloads:ObjectStorePayloads"),
        "file": Plugin("jetrl.bus.payloads:FilePayloads", checks="jetrl.bus.payloads:FilePayloads"),
        "mooncake": Plugin("jetrl.bus.mooncake:MooncakePayloads"),
    },
)

SEAMS = (GENERATION_ENGINES, TRAIN_ENGINES, TOKENIZERS, ENVIRONMENTS, PAYLOAD_STORES)
