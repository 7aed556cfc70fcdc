"""The command line of each part of a run, the same wherever the part runs.

The local supervisor (deploy/supervisor.py) starts them all on one machine; ``jetrl part``
(deploy/part_cmd.py) starts one on any machine, from the configuration the run recorded in
its log. Both build the commands here, so a part started by hand, by Slurm or by Kubernetes is
the very process the supervisor would have started. A part is handed its settings as a JSON
file under ``<run dir>/settings``; the bus address, run id and credentials on the command line.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from jetrl.consumers.monitor.settings import MonitorPart
from jetrl.consumers.recorder.settings import RecorderPart
from jetrl.consumers.trainer.engine import ONE_NODE, Nodes, train_launch
from jetrl.consumers.trainer.settings import TrainerSettings
from jetrl.deploy.config import ConfigError, RunConfig

# The kinds of part a run has; `jetrl run --parts` and `jetrl part KIND` name them so.
KINDS = ("producer", "inference", "trainer", "recorder", "monitor")


FOLLOWERS = frozenset({"recorder", "monitor"})  # parts that only read the log (stopped last)


@dataclass(frozen=True)
class PartCommand:
    name: str  # the part's name in logs and restarts: env-<tenant>-<env>-<k>, inference-<i>, ...
    argv: list[str]
    threads: int = 1  # OMP_NUM_THREADS it is started with
    kind: str = ""  # one of KINDS ("host" for several parts in one process, deploy/host.py)
    hosts_followers: bool = False  # a host of parts that only read the log
    hosts_trainer: bool = False  # a host of the trainer and others: it exits when the trainer does

    @property
    def ends_run(self) -> bool:
        """Whether its exiting 0 says the run is done (the trainer's process)."""
        return self.kind == "trainer" or self.hosts_trainer

    @property
    def follows(self) -> bool:
        """Whether it only reads the log: stopped after the others, once it has caught up."""
        return self.kind in FOLLOWERS or self.hosts_followers


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
                kind="producer",
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
                kind="inference",
            )
            for worker_id in worker_ids
        ]

    def trainer(self, creds: str | None, nodes: Nodes = ONE_NODE) -> PartCommand:
        argv = self._argv(
            "jetrl.consumers.trainer",
            creds,
            *("--run-dir", str(self.run_dir)),
            *("--settings", self.settings_file("trainer", self.cfg.trainer_part(self.run_dir))),
        )
        return PartCommand(
            "trainer",
            trainer_command(argv, self.cfg.trainer, nodes),
            threads=self.cfg.trainer.threads,
            kind="trainer",
        )

    def recorder(self, db: str, creds: str | None) -> PartCommand:
        gather = self.cfg.store.recorder_gather_s
        part = RecorderPart(db=db) if gather is None else RecorderPart(db=db, gather_s=gather)
        rec = self.settings_file("recorder", part)
        return PartCommand(
            "recorder", self._argv("jetrl.consumers.recorder", creds, "--settings", rec), kind="recorder"
        )

    def monitor(self, creds: str | None) -> PartCommand:
        mon = MonitorPart(monitor=self.cfg.monitor, out_dir=str((self.run_dir / "monitor").resolve()))
        return PartCommand(
            "monitor",
            self._argv("jetrl.consumers.monitor", creds, "--settings", self.settings_file("monitor", mon)),
            kind="monitor",
        )

    def hosted(self, commands: list[PartCommand], kinds: list[str]) -> list[PartCommand]:
        """``commands``, with the parts of ``kinds`` run as tasks of shared processes
        (deploy/host.py): the followers (recorder, monitor) in one, the others in another, so
        that the run's end still stops the others first and the followers once they caught up.
        A part that is not one ``python -m`` process (a trainer of several ranks) keeps its own.
        A host of the trainer ends when the trainer does (its other parts stopped then): its
        exit is the run's end, as the trainer's own process's would be."""
        groups: dict[bool, list[PartCommand]] = {True: [], False: []}
        for c in commands:
            if c.kind in kinds and c.argv[:2] == [sys.executable, "-m"]:
                groups[c.kind in FOLLOWERS].append(c)
        host_of: dict[str, PartCommand] = {}
        for followers, members in groups.items():
            if len(members) < 2:
                continue
            name = "host-" + "-".join(dict.fromkeys(m.kind for m in members))
            spec = [
                {"module": m.argv[2], "args": m.argv[3:], "ends_process": m.kind == "trainer"}
                for m in members
            ]
            path = self.run_dir / "settings" / f"{name}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(spec, indent=2))
            argv = [sys.executable, "-m", "jetrl.deploy.host", "--parts", f"@{path}"]
            threads = max(m.threads for m in members)
            host = PartCommand(
                name,
                argv,
                threads=threads,
                kind="host",
                hosts_followers=followers,
                hosts_trainer=any(m.kind == "trainer" for m in members),
            )
            host_of.update((m.name, host) for m in members)
        # In the order of the commands, a host where its first member was.
        out: list[PartCommand] = []
        for c in commands:
            chosen = host_of.get(c.name, c)
            if chosen not in out:
                out.append(chosen)
        return out


def trainer_command(argv: list[str], trainer: TrainerSettings, nodes: Nodes = ONE_NODE) -> list[str]:
    """The trainer's command on this node, from the part's own: its train engine's launch says
    how (consumers/trainer/engine.py's TrainLaunch, registered with the engine: one process, or
    its ranks under torchrun)."""
    try:
        return train_launch(trainer.engine_name).command(argv, trainer, nodes)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
