"""The parallel train engine: the train-engine seam over a group of torchtitan ranks.

Rank 0 alone talks to the bus; the trainer there holds a :class:`ParallelTrainEngine`, and
every call on it is one command on the control channel that all ranks then carry out together
(consumers/trainer/parallel/sharded.py). A step's rollouts are not broadcast: rank 0 sends
each rank only its share (a ``scatter``), so no rank but 0 reads the log or the payload store,
and the bytes sent per step are the step's rollouts once, not once per rank. The other ranks
run :func:`serve` until rank 0 says stop, or dies (then their collectives fail and they exit,
and the launcher or the supervisor restarts the whole group).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from jetrl.consumers.trainer.parallel.group import STOP, RankGroup, join
from jetrl.consumers.trainer.settings import TrainerPart

if TYPE_CHECKING:
    import torch

    from jetrl.consumers.trainer.parallel.sharded import ShardedPolicy
    from jetrl.policy.train import Rollout
    from jetrl.policy.weights import ExportedWeights

log = structlog.get_logger("jetrl.trainer.ranks")

BUILD = "build"
# Commands whose input rank 0 hands over itself (a scatter or a broadcast of tensors).
_OWN_TRANSFER = frozenset({"step", "logprobs", "load_weights"})
COMMANDS = frozenset(
    {"step", "logprobs", "checksum", "export_weights", "load_weights", "save_state", "load_state"}
)


class ParallelTrainEngine:
    def __init__(self, part: TrainerPart) -> None:
        from jetrl.consumers.trainer.parallel.sharded import ShardedPolicy

        self.part = part
        self.group: RankGroup = join(part.trainer.parallelism)
        if self.group.rank != 0:
            raise RuntimeError("the parallel train engine is rank 0's; the other ranks serve()")
        self.group.broken = True
        self.group.broadcast((BUILD, part.model_dump(mode="json")))
        self.local: ShardedPolicy = ShardedPolicy(part, self.group)
        self.group.broken = False

    def _run(self, command: str, arg: Any = None) -> Any:
        self.group.broken = True  # until every rank is through it
        self.group.broadcast((command, None if command in _OWN_TRANSFER else arg))
        out = getattr(self.local, command)(arg)
        self.group.broken = False
        return out

    def logprobs(self, rollouts: Sequence[Rollout]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = self._run("logprobs", list(rollouts))
        return out

    def step(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        metrics: dict[str, float] = self._run("step", list(rollouts))
        return metrics

    def step_token_stats(self) -> torch.Tensor | None:
        return self.local.last_token_stats

    def checksum(self) -> str:
        digest: str = self._run("checksum")
        return digest

    def export_weights(self, metadata: Mapping[str, str]) -> ExportedWeights:
        out: ExportedWeights = self._run("export_weights", dict(metadata))
        return out

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._run("load_weights", tensors)

    def layout(self) -> dict[str, Any]:
        par = self.part.trainer.parallelism
        return {"engine": "parallel", "world_size": par.world_size, **par.model_dump(include=_LAYOUT_FIELDS)}

    def save_state(self, directory: Path) -> None:
        self._run("save_state", str(directory))

    def load_state(self, directory: Path) -> None:
        self._run("load_state", str(directory))


# What a checkpoint or a replay must share with the run that made it (not the device or the
# all-to-all backend: the maths is the same on either).
_LAYOUT_FIELDS = {"dp_shard", "dp_replicate", "ep", "cp", "tp"}


def serve(group: RankGroup) -> None:
    """A rank other than 0: carry out rank 0's commands until it says stop."""
    from jetrl.consumers.trainer.parallel.sharded import ShardedPolicy

    bound = log.bind(rank=group.rank, world=group.world)
    policy: ShardedPolicy | None = None
    while True:
        command, arg = group.broadcast()
        if command == STOP:
            bound.info("rank_stopped")
            return
        if command == BUILD:
            policy = ShardedPolicy(TrainerPart.model_validate(arg), group)
            bound.info("rank_built", model=policy.mcfg.name)
            continue
        if command not in COMMANDS or policy is None:
            raise RuntimeError(
                f"rank {group.rank}: unexpected command {command!r} (built: {policy is not None})"
            )
        getattr(policy, command)(arg)
