"""The train-engine seam: what the trainer asks of whatever holds the model and its optimizer.

The trainer (and replay) own the run's logic: which rollouts, in which order, with which
advantages, when to checkpoint and publish. An engine owns the computation: logprobs under
Router Replay, one optimizer step on a batch of rollouts, the weights' checksum and their
serialised form to publish, loading published weights, and its whole state for a checkpoint.
Given the same state and inputs, an engine's step must be deterministic (replay checks every
step's checksum). ``[trainer] engine`` names one of the plugin registry's (jetrl/plugins.py,
``TRAIN_ENGINES``: a built-in, an installed package's, or any ``package.module:attr``): a class
or factory taking the trainer's :class:`TrainerPart`, registered with its :class:`TrainLaunch`,
which says how its processes start (one, or a group of ranks under torchrun) and which layouts
of ``[trainer.parallelism]`` it takes. This module is torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from jetrl.plugins import TRAIN_ENGINES

if TYPE_CHECKING:
    import torch

    # Types only: trainer/settings.py resolves "auto" through the launches defined here.
    from jetrl.consumers.trainer.settings import TrainerPart, TrainerSettings
    from jetrl.policy.train import Rollout
    from jetrl.policy.weights import ExportedWeights


class TrainEngine(Protocol):
    def logprobs(self, rollouts: Sequence[Rollout]) -> list[torch.Tensor]:
        """Each rollout's completion-token logprobs under the current weights (replaying its
        recorded routing), without a step."""
        ...

    def step(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        """One optimizer step on ``rollouts``, in this order; returns the step's metrics."""
        ...

    def step_token_stats(self) -> torch.Tensor | None:
        """Of the last ``step``, its rollouts' completion tokens, rollout after rollout:
        float32 ``[tokens, 2]``, each token's trainer log-prob and how many MoE layers' own
        routing differed from the replayed one (None: the engine does not record them). What
        the monitor's inspector shows."""
        ...

    def checksum(self) -> str:
        """The weights checksum (policy/weights.py) over canonical full tensors."""
        ...

    def export_weights(self, metadata: Mapping[str, str]) -> ExportedWeights:
        """The weights as the bytes inference loads (safetensors, serialised in one pass and
        handed over read-only: the payload stores take them as they are), their checksum and
        their transfer digest (policy/weights.py)."""
        ...

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace the weights (the optimizer state stays)."""
        ...

    def layout(self) -> dict[str, Any]:
        """How the engine is laid out (its world size and how it is split): recorded with
        every checkpoint, which only an engine of the same layout resumes."""
        ...

    def save_state(self, directory: Path) -> None:
        """Write everything needed to resume bit for bit (weights, optimizer) into the empty
        ``directory``; the caller makes the checkpoint atomic and adds its metadata."""
        ...

    def load_state(self, directory: Path) -> None:
        """Restore what :meth:`save_state` wrote."""
        ...


@runtime_checkable
class StreamingEngine(TrainEngine, Protocol):
    """An engine that takes a step's micro-batches as they come (``[trainer] stream_groups``):
    forward and backward of each now, the optimizer step once the step's last is in."""

    def accumulate(self, rollouts: Sequence[Rollout]) -> None:
        """Forward and backward of one micro-batch of the step under way (the first starts it)."""
        ...

    def finish_step(self) -> dict[str, float]:
        """The optimizer step over the micro-batches accumulated; returns the step's metrics
        (and :meth:`step_token_stats` gives their rollouts', in order)."""
        ...


def make_train_engine(part: TrainerPart) -> TrainEngine:
    factory = TRAIN_ENGINES.load(part.trainer.engine_name)
    engine: TrainEngine = factory(part)
    return engine


# ------------------------------------------------------------------ how it is launched


@dataclass(frozen=True)
class Nodes:
    """The machines a trainer's ranks span: one (torchrun's ``--standalone``), or ``nnodes``
    with this one's ``node_rank`` and rank 0's machine at ``master`` (``host:port``)."""

    nnodes: int = 1
    node_rank: int = 0
    master: str | None = None

    def check(self, world: int) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node rank {self.node_rank} is not one of {self.nnodes} node(s)")
        if world % self.nnodes:
            raise ValueError(f"the trainer's {world} ranks do not split evenly over {self.nnodes} nodes")
        if self.nnodes > 1 and (self.master is None or ":" not in self.master):
            raise ValueError("a trainer over several nodes needs --rdzv-endpoint HOST:PORT (rank 0's node)")


ONE_NODE = Nodes()


class TrainLaunch:
    """How a train engine's processes start and which layouts it takes: torch-free, registered
    with the engine as its checks (jetrl/plugins.py). This one, the default of an engine that
    registered none: one process, the trainer part itself."""

    def fits(self, trainer: TrainerSettings) -> bool:
        """Whether ``engine = "auto"`` may pick it for this layout (built-ins, in their order)."""
        return trainer.parallelism.world_size == 1

    def check(self, trainer: TrainerSettings) -> None:
        """Refuse (ValueError) a layout it cannot run, when the config is validated."""

    def command(self, argv: list[str], trainer: TrainerSettings, nodes: Nodes) -> list[str]:
        """The trainer's command line on this node, from the part's own (``[python, -m, module,
        *args]``), on ``nodes``."""
        world = trainer.parallelism.world_size
        nodes.check(world)
        if world != 1:
            raise ValueError(
                f"train engine {trainer.engine_name!r} registered no launch for {world} ranks "
                "(a TrainLaunch as its checks, jetrl/plugins.py)"
            )
        return argv


class OneProcess(TrainLaunch):
    """The single-process engine's: it refuses a layout of more than one rank."""

    def check(self, trainer: TrainerSettings) -> None:
        world = trainer.parallelism.world_size
        if world != 1:
            raise ValueError(
                f"train engine {trainer.engine_name!r} runs in one process, but [trainer.parallelism] "
                f"asks for {world} ranks"
            )


ONE_PROCESS = OneProcess()


def train_launch(engine: str) -> TrainLaunch:
    """The launch of the train engine ``engine`` names (one process where it registered none)."""
    launch = TRAIN_ENGINES.checks(engine)
    if launch is None:
        return TrainLaunch()
    if not isinstance(launch, TrainLaunch):
        raise TypeError(f"the checks of train engine {engine!r} are {launch!r}, not a TrainLaunch")
    return launch


def auto_engine(trainer: TrainerSettings) -> str:
    """What ``engine = "auto"`` picks: the first built-in train engine whose launch fits."""
    for name in TRAIN_ENGINES.builtins:
        if train_launch(name).fits(trainer):
            return name
    raise ValueError(f"no built-in train engine takes [trainer.parallelism] {trainer.parallelism}")
