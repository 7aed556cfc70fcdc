"""The trainer's ranks: one process group, torchtitan's device meshes over it, and a control
channel on which rank 0 (the one process that talks to the bus) tells the others what to do.

Ranks come from torchrun (``WORLD_SIZE`` and friends in the environment: the supervisor, Slurm
and Kubernetes start the trainer that way) or, where none launched them (``jetrl replay``, a
test), rank 0 starts the other ranks of this machine itself. Either way every rank but 0 runs
:func:`jetrl.consumers.trainer.parallel.engine.serve`.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from jetrl.bus.server import free_port
from jetrl.consumers.trainer.settings import ParallelismSettings
from jetrl.policy.titan_dist import SPMD_BACKEND, ParallelDims, configure

WORKER_MODULE = "jetrl.consumers.trainer.parallel.launch"
# Ranks idle in the control channel's broadcast while the trainer waits for rollouts, for as
# long as that takes; a rank that dies is noticed at once (its sockets close), not by this.
CONTROL_TIMEOUT = timedelta(days=7)


def launched() -> bool:
    """Whether a launcher (torchrun) made this process one rank of a group."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


@dataclass
class RankGroup:
    par: ParallelismSettings
    rank: int
    world: int
    dims: ParallelDims
    control: Any  # a gloo ProcessGroup: commands and Python objects, whatever the device
    device: torch.device
    broken: bool = False  # a command failed midway: the ranks may be out of step
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)  # ranks this process started

    def dp_rank(self, rank: int) -> int:
        """Which share of a step's rollouts ``rank`` trains (cp and tp ranks share one)."""
        return rank // (self.par.cp * self.par.tp)

    @property
    def reports(self) -> bool:
        """The one rank of its data-parallel group whose results rank 0 counts."""
        return self.rank % (self.par.cp * self.par.tp) == 0

    def broadcast(self, obj: Any = None) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def scatter(self, objs: list[Any] | None) -> Any:
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs if self.rank == 0 else None, src=0, group=self.control)
        return out[0]

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        for w in self.workers:
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()


_GROUP: RankGroup | None = None


def join(par: ParallelismSettings | None) -> RankGroup:
    """This process's rank group, made on first use (one per process: every engine built on
    rank 0 after the first reuses it, and tells the others to rebuild theirs). Rank 0 passes
    the layout; the other ranks (``None``) receive it from rank 0, so the run's settings stay
    the one place it is written."""
    global _GROUP
    if _GROUP is not None:
        if par is not None and _GROUP.par != par:
            raise ValueError(f"this process's ranks are laid out as {_GROUP.par}, not {par}")
        return _GROUP
    workers: list[subprocess.Popen[bytes]] = []
    if not launched():
        if par is None:
            raise RuntimeError("a rank without a launcher needs the layout")
        workers = _start_local_ranks(par.world_size)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if (rank == 0) != (par is not None):
        raise RuntimeError(f"rank {rank}: only rank 0 is given the layout")
    timeout = CONTROL_TIMEOUT
    # Where a GPU is, NCCL carries the model's collectives; gloo always carries the control's.
    backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    box: list[Any] = [par.model_dump(mode="json") if par is not None else None]
    dist.broadcast_object_list(box, src=0, group=control)
    par = ParallelismSettings.model_validate(box[0])
    if world != par.world_size:
        raise ValueError(
            f"{world} ranks were launched but [trainer.parallelism] needs {par.world_size} "
            f"(dp_replicate {par.dp_replicate} x dp_shard {par.dp_shard} x cp {par.cp} x tp {par.tp})"
        )
    device = torch.device("cpu")
    if par.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    configure(par.device)
    dims = ParallelDims(
        dp_replicate=par.dp_replicate,
        dp_shard=par.dp_shard,
        cp=par.cp,
        tp=par.tp,
        pp=1,
        ep=par.ep,
        world_size=world,
        spmd_backend=SPMD_BACKEND,
    )
    dims.build_mesh()
    _GROUP = RankGroup(par, rank, world, dims, control, device, workers=workers)
    if rank == 0:
        atexit.register(leave)
    return _GROUP


STOP = "stop"  # rank 0's last command


def leave() -> None:
    """Rank 0: tell the others to exit (unless a failed command left them elsewhere, where they
    die with this process instead), then close. Any rank: close. Runs at exit too."""
    global _GROUP
    if _GROUP is not None:
        group, _GROUP = _GROUP, None
        if group.rank == 0 and not group.broken:
            group.broadcast((STOP, None))
        group.close()


def _start_local_ranks(world: int) -> list[subprocess.Popen[bytes]]:
    """Make this process rank 0 of ``world`` on this machine and start ranks 1.. as children
    (they exit when this process does: see launch.py)."""
    port = free_port()
    common = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "JETRL_PARENT_PID": str(os.getpid()),
    }
    os.environ.update(common, RANK="0", LOCAL_RANK="0")
    env = dict(os.environ)
    return [
        subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE, "--serve"],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(1, world)
    ]
