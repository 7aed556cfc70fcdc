"""The train-engine seam: what the trainer asks of whatever holds the model and its optimizer.

The trainer (and replay) own the run's logic: which rollouts, in which order, with which
advantages, when to checkpoint and publish. An engine owns the computation: logprobs under
Router Replay, one optimizer step on a batch of rollouts, the weights' checksum and their
serialised form to publish, loading published weights, and its whole state for a checkpoint.
Given the same state and inputs, an engine's step must be deterministic (replay checks every
step's checksum). ``[trainer] engine`` names one: a built-in of :data:`ENGINES`, or any
``package.module:attr`` (a class or factory taking the trainer's :class:`TrainerPart`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from jetrl.bus.plugins import load_plugin
from jetrl.consumers.trainer.settings import TrainerPart

if TYPE_CHECKING:
    import torch

    from jetrl.policy.train import Rollout

ENGINES = {
    "local": "jetrl.consumers.trainer.local_engine:LocalTrainEngine",
    "parallel": "jetrl.consumers.trainer.parallel.engine:ParallelTrainEngine",
}


class TrainEngine(Protocol):
    def logprobs(self, rollouts: Sequence[Rollout]) -> list[torch.Tensor]:
        """Each rollout's completion-token logprobs under the current weights (replaying its
        recorded routing), without a step."""
        ...

    def step(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        """One optimizer step on ``rollouts``, in this order; returns the step's metrics."""
        ...

    def step_token_stats(self) -> list[torch.Tensor] | None:
        """Of the last ``step``, per rollout: float32 ``[completion tokens, 2]``, each token's
        trainer log-prob and how many MoE layers' own routing differed from the replayed one
        (None: the engine does not record them). What the monitor's inspector shows."""
        ...

    def checksum(self) -> str:
        """The weights checksum (policy/weights.py) over canonical full tensors."""
        ...

    def export_weights(self, metadata: Mapping[str, str]) -> tuple[bytes | bytearray, str]:
        """The weights as the bytes inference loads (safetensors), and their checksum (a
        bytearray where the engine serialised them in place: the payload stores take it as is)."""
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


def make_train_engine(part: TrainerPart) -> TrainEngine:
    factory = load_plugin(part.trainer.engine_name, ENGINES, "train engine")
    engine: TrainEngine = factory(part)
    return engine
