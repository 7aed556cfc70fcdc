"""A train engine with no model: its "weights" are a tally of the steps it took and a hash of
every rollout it trained on, so each version has its own checksum, reproducible from the log.
Its launch runs the trainer part through this module, which marks the process (every step's
metrics then say it was launched so): the trainer's command is the engine's to make.

    python -m tests.support.plugins.tally_engine MODULE [ARGS...]
"""

from __future__ import annotations

import hashlib
import json
import os
import runpy
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from jetrl.consumers.trainer.engine import Nodes, TrainLaunch
from jetrl.consumers.trainer.settings import TrainerPart, TrainerSettings
from jetrl.policy.weights import ExportedWeights, transfer_digest

if TYPE_CHECKING:
    from jetrl.policy.train import Rollout

LAUNCHED = "JETRL_TEST_TALLY_LAUNCHED"
STATE_FILE = "tally.json"


class TallyEngine:
    def __init__(self, part: TrainerPart) -> None:
        self.steps = 0
        self.digest = hashlib.sha256(str(part.seed).encode()).hexdigest()
        self.launched = float(os.environ.get(LAUNCHED) == "1")

    def logprobs(self, rollouts: Sequence[Rollout]) -> list[torch.Tensor]:
        return [torch.zeros(len(r.completion_ids)) for r in rollouts]

    def step(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        h = hashlib.sha256(self.digest.encode())
        for r in rollouts:
            # Token ids come as a list or an array (policy/train.Rollout): tallied as ints.
            tokens = [[int(t) for t in r.prompt_ids], [int(t) for t in r.completion_ids]]
            h.update(json.dumps([*tokens, r.advantage]).encode())
        self.digest = h.hexdigest()
        self.steps += 1
        return {"loss": 0.0, "tally_launched": self.launched}

    def step_token_stats(self) -> torch.Tensor | None:
        return None

    def checksum(self) -> str:
        return self.digest

    def export_weights(self, metadata: Mapping[str, str]) -> ExportedWeights:
        data = json.dumps({"steps": self.steps, "digest": self.digest, **metadata}).encode()
        return ExportedWeights(memoryview(data), self.digest, transfer_digest(data))

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError("the tally has no tensors to load")

    def layout(self) -> dict[str, Any]:
        return {"engine": "tally", "world_size": 1}

    def save_state(self, directory: Path) -> None:
        (directory / STATE_FILE).write_text(json.dumps({"steps": self.steps, "digest": self.digest}))

    def load_state(self, directory: Path) -> None:
        state = json.loads((directory / STATE_FILE).read_text())
        self.steps, self.digest = int(state["steps"]), str(state["digest"])


class TallyLaunch(TrainLaunch):
    """One process, started through this module."""

    def command(self, argv: list[str], trainer: TrainerSettings, nodes: Nodes) -> list[str]:
        python, dash_m, module, *rest = super().command(argv, trainer, nodes)
        return [python, dash_m, __name__, module, *rest]


LAUNCH = TallyLaunch()


if __name__ == "__main__":
    os.environ[LAUNCHED] = "1"
    target, *args = sys.argv[1:]
    sys.argv = [target, *args]
    runpy.run_module(target, run_name="__main__", alter_sys=True)
