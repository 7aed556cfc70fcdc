"""The command line of each part of a run, the same wherever the part runs.

The local supervisor (deploy/supervisor.py) starts them all on one machine; ``jetrl part``
(deploy/part_cmd.py) starts one on any machine, from the configuration the run recorded in
its log. Both build the commands here, so a part started by hand, by Slurm or by Kubernetes is
the very process the supervisor would have started. A part is handed its settings as a JSON
file under ``<run dir>/settings``; the bus address, run id and credentials on the command line.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from jetrl.consumers.monitor.settings import MonitorPart
from jetrl.consumers.recorder.settings import RecorderPart
from jetrl.consumers.trainer.settings import TrainerSettings
from jetrl.deploy.config import ConfigError, RunConfig

# The kinds of part a run has; `jetrl run --parts` and `jetrl part KIND` name them so.
KINDS = ("producer", "inference", "trainer", "recorder", "monitor")


@dataclass(frozen=True)
class PartCommand:
    name: str  # the part's name in logs and restarts: env-<tenant>-<env>-<k>, inference-<i>, ...
    argv: list[str]
    threads: int = 1  # OMP_NUM_THREADS it is started with


@dataclass(frozen=True)
class Nodes:
    """The machines a trainer's ranks span: one (torchrun's ``--standalone``), or ``nnodes``
    with this one's ``node_rank`` and rank 0's machine at ``master`` (``host:port``)."""

    nnodes: int = 1
    node_rank: int = 0
    master: str | None = None

    def check(self, world: int) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node rank {self.node_rank} is not one of {self.nnodes} node(s)")
        if world % self.nnodes:
            raise ConfigError(f"the trainer's {world} ranks do not split evenly over {self.nnodes} nodes")
        if self.nnodes > 1 and (self.master is None or ":" not in self.master):
            raise ConfigError("a trainer over several nodes needs --rdzv-endpoint HOST:PORT (rank 0's node)")


class PartCommands:
    """The commands of run ``run_id``'s parts, connecting to ``url`` (one server, or a
    cluster's URLs comma-separated)."""

    def __init__(self, cfg: RunConfig, run_id: str, run_dir: Path, url: str) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.run_dir = run_dir
        self.url = url

    def settings_file(self, name: str, settings: BaseModel) -> str:
        path = self.run_dir / "settings" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(settings.model_dump_json(indent=2))
        return f"@{path}"

    def _argv(self, module: str, creds: str | None, *extra: str) -> list[str]:
        return [
            *(sys.executable, "-m", module, "--nats-url", self.url, "--run", self.run_id),
            *(["--creds", creds] if creds else []),
            *extra,
        ]

    def producers(self, creds_of: dict[str, str | None], envs: list[str] | None = None) -> list[PartCommand]:
        """One producer per env the run's own machines run (a ``remote`` env's tenant runs its
        own); ``creds_of`` maps a tenant to the credentials its producer connects with,
        ``envs`` keeps only the named envs."""
        return [
            PartCommand(
                f"env-{pp.env.tenant}-{pp.env.name}-{k}",
                self._argv(
                    "jetrl.producers",
                    creds_of.get(pp.env.tenant),
                    *("--settings", self.settings_file(f"env-{k}", pp)),
                ),
            )
            for k, pp in enumerate(self.cfg.producer_parts())
            if not pp.env.remote and (envs is None or pp.env.name in envs)
        ]

    def inference(
        self, worker_ids: list[str], creds: str | None, inline_tenants: list[str]
    ) -> list[PartCommand]:
        """One worker per id, all handed the same settings file."""
        part = self.cfg.inference_part(self.run_dir)
        part.inline_tenants = inline_tenants  # their producers read only their views
        settings = self.settings_file("inference", part)
        return [
            PartCommand(
                f"inference-{worker_id.removeprefix('inf-')}",
                self._argv(
                    "jetrl.consumers.inference", creds, *("--worker-id", worker_id, "--settings", settings)
                ),
                threads=self.cfg.inference.threads,
            )
            for worker_id in worker_ids
        ]

    def trainer(self, creds: str | None, nodes: Nodes = Nodes()) -> PartCommand:
        argv = self._argv(
            "jetrl.consumers.trainer",
            creds,
            *("--run-dir", str(self.run_dir)),
            *("--settings", self.settings_file("trainer", self.cfg.trainer_part(self.run_dir))),
        )
        return PartCommand(
            "trainer", torchrun(argv, self.cfg.trainer, nodes), threads=self.cfg.trainer.threads
        )

    def recorder(self, db: str, creds: str | None) -> PartCommand:
        rec = self.settings_file("recorder", RecorderPart(db=db))
        return PartCommand("recorder", self._argv("jetrl.consumers.recorder", creds, "--settings", rec))

    def monitor(self, creds: str | None) -> PartCommand:
        mon = MonitorPart(monitor=self.cfg.monitor, out_dir=str((self.run_dir / "monitor").resolve()))
        return PartCommand(
            "monitor",
            self._argv("jetrl.consumers.monitor", creds, "--settings", self.settings_file("monitor", mon)),
        )


def torchrun(argv: list[str], trainer: TrainerSettings, nodes: Nodes = Nodes()) -> list[str]:
    """The trainer's command: as it is for one rank; for more, under torchrun, global rank 0
    running it and the others serving rank 0 (consumers/trainer/parallel/launch.py). Over
    several nodes each node runs this with its own ``node_rank``, and ranks are numbered by
    node (static rendezvous at rank 0's node), so rank 0 is always on node 0. torchrun restarts
    nothing (``--max-restarts 0``): a rank that dies ends the group, and whatever started the
    trainer restarts it as it restarts any part; it then rebuilds from its newest checkpoint
    and the log."""
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
