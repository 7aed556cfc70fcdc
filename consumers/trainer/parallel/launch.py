"""Run a jetrl program as rank 0 of the trainer's ranks, the other ranks serving it.

    torchrun --nproc-per-node N -m jetrl.consumers.trainer.parallel.launch -- MODULE [ARGS...]
    python -m jetrl.consumers.trainer.parallel.launch --serve      # a rank rank 0 started

Under torchrun, rank 0 runs ``MODULE`` as ``__main__`` (the trainer part, ``jetrl replay``)
and every other rank serves it; a rank that rank 0 started itself (group.py) serves too, and
exits when rank 0's process is gone. :data:`TORCHRUN` is the parallel engine's launch
(registered with it, jetrl/plugins.py): the torchrun command that runs this module. Torch-free
until a rank serves.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time
from typing import TYPE_CHECKING

from jetrl.bus.log import configure
from jetrl.consumers.trainer.engine import Nodes, TrainLaunch

if TYPE_CHECKING:
    from jetrl.consumers.trainer.settings import TrainerSettings


class TorchrunLaunch(TrainLaunch):
    """The parallel engine's ranks under torchrun, global rank 0 running the trainer part and
    the others serving rank 0; one rank runs as the part itself. Over several nodes each node
    runs this with its own ``node_rank``, and ranks are numbered by node (static rendezvous at
    rank 0's node), so rank 0 is always on node 0. torchrun restarts nothing (``--max-restarts
    0``): a rank that dies ends the group, and whatever started the trainer restarts it as it
    restarts any part; it then rebuilds from its newest checkpoint and the log."""

    def fits(self, trainer: TrainerSettings) -> bool:
        return trainer.parallelism.world_size > 1

    def check(self, trainer: TrainerSettings) -> None:
        # Any world size (ParallelismSettings refuses what no rank can run); the ranks take a
        # step's batch at once ("auto" takes whole batches here).
        if trainer.stream_groups is True:
            raise ValueError(
                f"train engine {trainer.engine_name!r} takes each step's batch at once: "
                "[trainer] stream_groups needs the local engine"
            )

    def command(self, argv: list[str], trainer: TrainerSettings, nodes: Nodes) -> list[str]:
        world = trainer.parallelism.world_size
        nodes.check(world)
        if world == 1:
            return argv
        python, _, module, *rest = argv
        if nodes.nnodes == 1:
            where = ["--standalone", "--nproc-per-node", str(world)]
        else:
            assert nodes.master is not None  # checked above
            host, _, port = nodes.master.rpartition(":")
            where = [
                *("--nnodes", str(nodes.nnodes), "--node-rank", str(nodes.node_rank)),
                *("--nproc-per-node", str(world // nodes.nnodes)),
                *("--master-addr", host, "--master-port", port),
            ]
        return [
            *(python, "-m", "torch.distributed.run", *where),
            *("--max-restarts", "0", "--monitor-interval", "0.5"),
            # "--": torchrun's parser would take the part's --run for an abbreviation of its --run-path.
            *("-m", "jetrl.consumers.trainer.parallel.launch", "--", module, *rest),
        ]


TORCHRUN = TorchrunLaunch()


def _exit_with_parent(parent: int) -> None:
    """A rank started by rank 0 must not outlive it (a collective waiting on a dead rank 0
    may not notice for a long time)."""

    def watch() -> None:
        while True:
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                os._exit(3)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _serve() -> int:
    from jetrl.consumers.trainer.parallel import group as g
    from jetrl.consumers.trainer.parallel.engine import serve

    if parent := os.environ.get("JETRL_PARENT_PID"):
        _exit_with_parent(int(parent))
    group = g.join(None)  # the layout comes from rank 0
    try:
        serve(group)
    finally:
        g.leave()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:  # torchrun drops it; a launcher that passes it on
        args = args[1:]
    configure()
    if args[:1] == ["--serve"] or int(os.environ.get("RANK", "0")) != 0:
        return _serve()
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    module, rest = args[0], args[1:]
    sys.argv = [module, *rest]
    # Rank 0's group tells the others to stop when this process exits (group.join's atexit).
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
