"""Cores of its own for the trainer: the parts on the training's path are kept off them.

The trainer sets a run's pace (docs/running.md, "Where a step's time goes"): every step waits
for its train call, while inference and the environments have the window of
``max_off_policy_steps`` to be ready. Left to the kernel's scheduler, the other parts and the
nats-server take turns on the trainer's core too, and its train call pays for each. So the
supervisor keeps the inference workers and producers it starts, and the nats-server it starts,
off ``threads x ranks`` of the cores it may use (the lowest numbered). The trainer itself is
not pinned: alone on those cores the kernel keeps it there, and two runs on one machine do not
have their trainers share one core (pinning it as well measured the same). Nor are the parts
that only read the log (recorder, monitor): they run at a lower priority and yield the
trainer's cores to it, while kept on one core with the others they made the chain to the
trainer the bottleneck (`make run`, the recorder on: 39.5 s, the trainer idle 37%). Where the
others would have no core left, nothing is confined; ``[run] trainer_own_cores = false``
leaves it all to the kernel. Measured on two cores (an AMD EPYC), interleaved, in
docs/running.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jetrl.deploy.config import RunConfig


@dataclass(frozen=True)
class CoreSplit:
    trainer: frozenset[int]  # kept for the trainer's ranks and their threads
    rest: frozenset[int]  # where inference, the producers and the run's own nats-server run


def split_cores(available: Iterable[int], trainer_cores: int) -> CoreSplit | None:
    """``trainer_cores`` of ``available`` (the lowest numbered) for the trainer, the rest for
    the others; None where the others would have none."""
    cores = sorted(set(available))
    if trainer_cores < 1 or len(cores) <= trainer_cores:
        return None
    return CoreSplit(frozenset(cores[:trainer_cores]), frozenset(cores[trainer_cores:]))


def usable_cores() -> frozenset[int]:
    """The cores this process may run on (its affinity: a container's or a job's share)."""
    return frozenset(os.sched_getaffinity(0))


def others_cores(cfg: RunConfig) -> frozenset[int] | None:
    """Where a nats-server started for such a run goes (None: anywhere)."""
    split = run_split(cfg)
    return None if split is None else split.rest


def run_split(cfg: RunConfig) -> CoreSplit | None:
    """The split for a run whose trainer is a process of its own on this machine (None: off,
    or the trainer hosted with other parts, or too few cores)."""
    if not cfg.run.trainer_own_cores or "trainer" in cfg.run.host_together:
        return None
    return split_cores(usable_cores(), cfg.trainer.threads * cfg.trainer.parallelism.world_size)
