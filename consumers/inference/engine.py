"""The generation-engine seam: what the inference worker asks of whatever generates.

An engine takes a batch of groups (a prompt's token ids, how many samples, sampling
parameters) and returns every sample's completion token ids, the logprobs of the sampled tokens
under the distribution they were drawn from, its finish reason and, for MoE models, its Router
Replay trace (``[prompt + completion - 1, moe_layers, top_k]``, uint8, uint16 past 256 experts).
It loads the weights a WeightsReady names (checksum-verified) and says which version it holds.
The worker owns everything else: tasks, leases, events, payloads. ``[inference] engine`` names
one of the plugin registry's (jetrl/plugins.py, ``GENERATION_ENGINES``: a built-in, an installed
package's, or any ``package.module:attr``): a class or factory taking the worker's
:class:`InferencePart` and worker id, registered with its :class:`EngineChecks` (what the run
config checks before any process starts). Besides its methods an engine says how many
batches it takes at once (``batches_in_flight``: N for one that batches continuously, which the
worker then hands up to N batches, never across a weights load) and what its model takes
(``limits``: the vocabulary and context the worker refuses tasks past; None for an engine without
a model of its own, checked against ``[model]``). Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from jetrl.bus import events as ev
from jetrl.bus.payloads import Payloads
from jetrl.consumers.inference.settings import InferencePart, InferenceSettings
from jetrl.plugins import GENERATION_ENGINES
from jetrl.policy.settings import ModelSettings

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class GroupRequest:
    """``n`` samples of one prompt."""

    prompt_tokens: Sequence[int]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    stop_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Sample:
    completion_tokens: np.ndarray  # int32 [C]
    logprobs: np.ndarray  # float32 [C]
    finish_reason: FinishReason
    routing_trace: np.ndarray | None = None  # MoE only


@dataclass(frozen=True)
class Limits:
    """What a model takes: token ids below ``vocab_size``; a prompt plus its completion up to
    ``max_context`` tokens (None: not checked)."""

    vocab_size: int | None
    max_context: int | None


@runtime_checkable
class GenerationEngine(Protocol):
    batches_in_flight: int  # batches the worker may hand it at once (1: one at a time)
    limits: Limits | None  # None: no model of its own; the worker reads [model]'s

    @property
    def loaded_version(self) -> int | None:
        """The policy version of the weights generated with (None before the first load)."""
        ...

    async def generate(self, groups: Sequence[GroupRequest]) -> list[list[Sample]]:
        """Each group's ``n`` samples, in the order asked, all under one weights version."""
        ...

    async def load_weights(self, ready: ev.WeightsReady, payloads: Payloads) -> None:
        """Load the weights ``ready`` names, verifying their checksum; raises if they do not match."""
        ...

    async def close(self) -> None: ...


class EngineChecks:
    """What a generation engine says of a run before any process starts: torch-free, registered
    with it as its checks (jetrl/plugins.py). These defaults refuse nothing and send routing
    traces; an engine's own checks subclass them."""

    def check(self, inference: InferenceSettings, model: ModelSettings) -> None:
        """Refuse (ValueError) settings it cannot serve, on any machine (the run config's
        validation, also of a run's recorded config)."""

    def check_here(self, inference: InferenceSettings) -> None:
        """Refuse what this machine lacks to run it (where a run starts or resumes)."""

    def no_routing(self, inference: InferenceSettings) -> str | None:
        """Why it sends no Router Replay traces of an MoE model with these settings; None when
        it sends them (the run config refuses an MoE run that replays routes without them)."""
        return None


def engine_checks(engine: str) -> EngineChecks:
    """The checks of the generation engine ``engine`` names (the defaults where it registered none)."""
    checks = GENERATION_ENGINES.checks(engine)
    if checks is None:
        return EngineChecks()
    if not isinstance(checks, EngineChecks):
        raise TypeError(f"the checks of generation engine {engine!r} are {checks!r}, not EngineChecks")
    return checks


def make_generation_engine(part: InferencePart, worker_id: str) -> GenerationEngine:
    factory = GENERATION_ENGINES.load(part.inference.engine)
    engine = factory(part, worker_id)
    if not isinstance(engine, GenerationEngine):
        members = {*GenerationEngine.__annotations__, *vars(GenerationEngine)}
        missing = sorted(m for m in members if not m.startswith("_") and not hasattr(engine, m))
        raise TypeError(f"generation engine {part.inference.engine!r} lacks {missing} (GenerationEngine)")
    return engine
