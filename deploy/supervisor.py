"""The local supervisor behind `jetrl run`.

It starts the embedded nats-server (unless given a URL), creates the run's stream, records
RunStarted, and launches every part as its own process: one producer per environment, N
inference workers, the trainer and the recorder. It restarts a part that crashes, feeds the
log's StepCompleted events to a `RunReport` (deploy/report.py) for live progress, and when the
trainer finishes (or on Ctrl-C) stops the others cleanly, lets the recorder catch up, records
RunFinished, and leaves the report's summary and reward curve in the run directory. The parts
never talk to the supervisor: it only reads the log and watches processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jetrl import __version__
from jetrl.bus import events as ev
from jetrl.bus import ids, subjects
from jetrl.bus.client import Bus
from jetrl.bus.log import get_logger
from jetrl.bus.runtime import SUPERVISOR_PID_ENV
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.streams import ensure_tenant_view, run_usage, stream_name
from jetrl.consumers.trainer.withholding import close_out
from jetrl.deploy.config import RunConfig, library_versions
from jetrl.deploy.cores import CoreSplit, run_split
from jetrl.deploy.launcher import PartProcess, check_working_folder, start_part, warm_up
from jetrl.deploy.parts import KINDS, PartCommand, PartCommands
from jetrl.deploy.report import RunReport
from jetrl.deploy.tenants import ADMIN, TenantRegistry
from jetrl.store import queries
from jetrl.store.db import Store, StoreError, open_store_read_only

log = get_logger(__name__)

MAX_RESTARTS = 10
POLL_S = 0.1  # how often the parts are looked at: a part that ended is seen within it
USAGE_EVERY_S = 10.0  # how often the log's and the payload bucket's fill is checked
USAGE_WARN = 0.8  # the share of a limit past which the run is warned about
SETTLE_S = 3.0  # quiet on the rollout subjects after which parts elsewhere have stopped


class PartFailed(RuntimeError):
    """A part crash-looped: the run stops, as failed, with the part's log named."""


@dataclass
class Part:
    name: str
    argv: list[str]
    threads: int = 1
    cpus: frozenset[int] | None = None  # the cores it may run on (None: any; deploy/cores.py)
    follows: bool = False  # only reads the log: stopped last, once caught up
    proc: PartProcess | None = None
    restarts: int = 0
    finished: bool = False  # exited 0 on its own (the trainer, when the run is done)
    ends_run: bool = False  # the trainer's process (its own, or a host of it with others)
    history: list[float] = field(default_factory=list)


@dataclass
class Progress:
    """The live tail of the step subject: the report it feeds, the clock step times count from,
    and when it last printed."""

    report: RunReport = field(default_factory=RunReport)
    started: float = field(default_factory=time.monotonic)
    last_print: float = 0.0

    @property
    def steps(self) -> list[dict[str, float]]:
        return self.report.steps


class Supervisor:
    def __init__(
        self,
        cfg: RunConfig,
        run_id: str,
        run_dir: Path,
        *,
        nats_url: str | None = None,
        db_url: str | None = None,
        quiet: bool = False,
        tenants_dir: Path | None = None,
        local: frozenset[str] = frozenset(KINDS),
        overrides: list[str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_id = subjects.check_token(run_id, "run id")
        self.run_dir = run_dir
        self.nats_url = nats_url
        self.db_url = db_url or cfg.store.db or f"sqlite:///{(run_dir / 'store.db').resolve()}"
        self.quiet = quiet
        self.local = local  # the kinds of part started here; the others run elsewhere
        if local:
            check_working_folder()
        self.overrides = list(overrides or [])  # a resume's, recorded in its RunResumed
        self.final_step_seen = asyncio.Event()  # the trainer said its goal is reached
        self.announced_seq = 0  # this run's RunStarted, or this resume's RunResumed
        self.end_reason: str | None = None  # set by end(): the run stops as completed
        self.server: EmbeddedServer | None = None
        self.parts: list[Part] = []
        self.progress = Progress()
        self.server_restarts = 0
        self.unfinished = 0  # rollouts withheld as run_finished at the end
        self.warned_full: set[str] = set()  # streams past USAGE_WARN of their limit
        self.log = log.bind(run_id=run_id)
        # Tenants: when the deployment has any, the server authenticates every client and each
        # part connects as its own identity (deploy/tenants.py).
        reg = TenantRegistry(tenants_dir) if tenants_dir is not None else None
        self.registry = reg if reg is not None and reg.has_tenants() else None
        self.registry_mtime = 0.0
        self.cores = self.core_split()

    # ------------------------------------------------------------------ processes

    def core_split(self) -> CoreSplit | None:
        """The trainer's cores and the others' (deploy/cores.py), where this machine runs the
        trainer as a process of its own; None leaves every process to the kernel."""
        split = run_split(self.cfg) if "trainer" in self.local else None
        if split is not None:
            self.log.info("cores_split", trainer=sorted(split.trainer), others=sorted(split.rest))
        return split

    def creds(self, identity: str) -> str | None:
        """The credentials file a part connects with (none on a server without authentication)."""
        return None if self.registry is None else str(self.registry.creds_path(identity))

    def producer_identity(self, tenant: str) -> str:
        """A registered tenant's envs run as that tenant (through its view, as on its own
        machine); the others as jetrl's producer."""
        reg = self.registry
        return tenant if reg is not None and tenant in {t.name for t in reg.tenants()} else "producer"

    def plan(self, url: str) -> list[Part]:
        """The parts this machine runs: every kind of ``local`` (the others run elsewhere,
        started with `jetrl part`)."""
        cmds = PartCommands(self.cfg, self.run_id, self.run_dir, url)
        chosen: list[PartCommand] = []
        if "producer" in self.local:
            tenants = {e.tenant for e in self.cfg.envs}
            chosen += cmds.producers({t: self.creds(self.producer_identity(t)) for t in tenants})
        if "inference" in self.local:
            # Registered tenants' producers read only their views: arrays inline for them.
            inline = self.registry.tenants_of(self.run_id) if self.registry is not None else []
            workers = [f"inf-{i}" for i in range(self.cfg.inference.workers)]
            chosen += cmds.inference(workers, self.creds("inference"), inline)
        if "trainer" in self.local:
            chosen.append(cmds.trainer(self.creds("trainer")))
        if "recorder" in self.local and self.cfg.store.recorder:
            chosen.append(cmds.recorder(self.db_url, self.creds("recorder")))
        if "monitor" in self.local and self.cfg.monitor.wanted:
            chosen.append(cmds.monitor(self.creds("monitor")))
        chosen = cmds.hosted(chosen, list(self.cfg.run.host_together))
        split = self.cores
        return [
            Part(
                c.name,
                c.argv,
                threads=c.threads,
                follows=c.follows,
                ends_run=c.ends_run,
                # The trainer may run anywhere, and so may the parts that only read the log
                # (at a lower priority, they yield its cores to it): the others keep off them.
                cpus=None if split is None or c.kind == "trainer" or c.follows else split.rest,
            )
            for c in chosen
        ]

    def start(self, part: Part) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(part.threads), JETRL_LOG_JSON="1")
        env[SUPERVISOR_PID_ENV] = str(os.getpid())  # a part outliving this process stops itself
        # A wandb-core this process may run is not the part's: a part shares none, so that a
        # killed monitor's W&B run is not left "in use" there for its successor.
        env.pop("WANDB_SERVICE", None)
        part.proc = start_part(
            part.argv,
            env,
            logs / f"{part.name}.log",
            fork=self.cfg.run.fork_parts,
            nice=self.cfg.run.follower_nice if part.follows else 0,
            cpus=part.cpus,
        )
        self.log.info("part_started", part=part.name, pid=part.proc.pid, restarts=part.restarts)

    def join_tenants(self, reg: TenantRegistry) -> None:
        """The registered tenants whose envs this run lists join it (so their identities may
        publish on its subjects); jetrl's own identities are made if missing."""
        before = {n: (i.public_key, tuple(i.runs)) for n, i in reg.identities.items()}
        reg.ensure_jetrl_identities()
        known = {t.name for t in reg.tenants()}
        for tenant in {e.tenant for e in self.cfg.envs} & known:
            reg.add(tenant, [self.run_id])
        if {n: (i.public_key, tuple(i.runs)) for n, i in reg.identities.items()} != before:
            reg.save()  # a reload only when something changed

    async def ensure_views(self, bus: Bus) -> None:
        """Every tenant that joined the run reads it through its view: made at the start, and
        for a tenant that joins while the run goes on (the registry file changes)."""
        reg = self.registry
        if reg is None:
            return
        with contextlib.suppress(OSError):
            mtime = reg.path.stat().st_mtime
            if mtime == self.registry_mtime:
                return
            self.registry_mtime = mtime
            reg = self.registry = TenantRegistry(reg.dir)
        for tenant in reg.tenants_of(self.run_id):
            try:
                await ensure_tenant_view(bus.js, self.run_id, tenant, self.cfg.bus.limits())
            except Exception as exc:  # a view is the tenant's way in, not the run's: keep going
                self.log.warning("tenant_view_failed", tenant=tenant, error=repr(exc))

    async def announce(self, bus: Bus) -> None:
        """RunStarted for a new run; a resumed one keeps its RunStarted and says RunResumed with
        the config it goes on with, which parts elsewhere take up (deploy/part_cmd.py)."""
        items = await bus.read_log(self.run_id, filter_subject=subjects.run_subject(self.run_id))
        resumed = any(item.event and isinstance(item.event.body, ev.RunStarted) for item in items)
        started = ev.RunStarted(
            config=self.cfg.model_dump(mode="json"),
            code_version=__version__,
            host=socket.gethostname(),
            library_versions=library_versions(),
        )
        body: ev.EventBody = started
        event_id = ids.run_started_id(self.run_id)
        if resumed:
            body = ev.RunResumed(
                config=started.config,
                code_version=started.code_version,
                host=started.host,
                library_versions=started.library_versions,
                overrides=self.overrides,
            )
            event_id = ids.run_resumed_id(self.run_id, items[-1].seq)
        ack = await bus.publish(ev.new_event(body, run_id=self.run_id, event_id=event_id))
        self.announced_seq = int(ack.seq)

    def check_server(self) -> None:
        """The embedded nats-server is a part too: restarted on its port and files, where
        every client reconnects to it."""
        if self.server is None or self.server.proc is None or self.server.proc.poll() is None:
            return
        self.server_restarts += 1
        self.log.warning(
            "nats_server_crashed", exit_code=self.server.proc.returncode, restarts=self.server_restarts
        )
        self.say(f"  ! nats-server exited with {self.server.proc.returncode}; restarting")
        self.server.start()

    async def check_usage(self, bus: Bus) -> None:
        """Warn, once per stream, when the run's log or payload bucket passes 80% of its limit:
        a full one refuses publishes and the run stops (docs/events.md, "Sizing the limits")."""
        try:
            usage = await run_usage(bus.js, self.run_id)
        except Exception as exc:  # advisory: never let it stop the run
            self.log.warning("usage_unavailable", error=repr(exc))
            return
        for u in usage:
            if u.fraction >= USAGE_WARN and u.stream not in self.warned_full:
                self.warned_full.add(u.stream)
                self.log.warning("stream_nearly_full", stream=u.stream, bytes=u.bytes, max_bytes=u.max_bytes)
                self.say(
                    f"  ! {u.stream} is {100 * u.fraction:.0f}% full ({u.bytes / 2**30:.2f} of "
                    f"{u.max_bytes / 2**30:.2f} GiB): raise [bus] max_gib / payload_max_gib for a longer run"
                )

    def check_parts(self) -> Part | None:
        """Restart crashed parts; return the trainer once it has finished on its own."""
        self.check_server()
        for p in self.parts:
            if p.proc is None or p.finished:
                continue
            code = p.proc.poll()
            if code is None:
                continue
            if code == 0 and p.ends_run:
                p.finished = True
                return p
            now = time.monotonic()
            p.history = [t for t in p.history if now - t < 300] + [now]
            if len(p.history) > MAX_RESTARTS:
                raise PartFailed(
                    f"{p.name} crashed {len(p.history)} times in 5 minutes; see "
                    f"{self.run_dir / 'logs' / (p.name + '.log')}"
                )
            p.restarts += 1
            self.log.warning("part_crashed", part=p.name, exit_code=code, restarts=p.restarts)
            self.say(f"  ! {p.name} exited with {code}; restarting (restart {p.restarts})")
            self.start(p)
        return None

    def stop_parts(self, names: set[str] | None = None, timeout: float = 15.0) -> None:
        chosen = [
            p for p in self.parts if p.proc and p.proc.poll() is None and (names is None or p.name in names)
        ]
        for p in chosen:
            p.finished = True  # stopped on purpose: not to be restarted
            with contextlib.suppress(ProcessLookupError):
                p.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]  # chosen: parts with a process
        deadline = time.monotonic() + timeout
        for p in chosen:
            try:
                p.proc.wait(max(0.1, deadline - time.monotonic()))  # type: ignore[union-attr]  # chosen: parts with a process
            except subprocess.TimeoutExpired:
                self.log.warning("part_killed", part=p.name)
                # The whole session: a trainer's torchrun and every rank it started.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]  # chosen: parts with a process
                p.proc.wait()  # type: ignore[union-attr]  # chosen: parts with a process

    # ------------------------------------------------------------------ progress

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, flush=True)

    async def follow_steps(self, bus: Bus) -> None:
        evals = asyncio.create_task(self.follow_evaluations(bus))  # ends with this follower
        try:
            async for item in bus.tail(self.run_id, filter_subject=subjects.step_subject(self.run_id)):
                b = item.event.body if item.event else None
                if not isinstance(b, ev.StepCompleted):
                    continue
                self.progress.report.add(b, time.monotonic() - self.progress.started)
                # A final step before a resume is the goal of the run before it, unless the
                # resume asks no more steps than it reached.
                if b.final and (item.seq > self.announced_seq or b.step >= self.cfg.trainer.max_steps - 1):
                    self.final_step_seen.set()
                now = time.monotonic()
                if now - self.progress.last_print >= 2.0 or b.step == self.cfg.trainer.max_steps - 1:
                    self.progress.last_print = now
                    self.say(self.progress.report.line())
        finally:
            evals.cancel()

    async def follow_evaluations(self, bus: Bus) -> None:
        """Held-out evaluations, into the report (and the summary), one line each."""
        async for item in bus.tail(self.run_id, filter_subject=subjects.eval_subject(self.run_id)):
            if item.event is not None and isinstance(item.event.body, ev.EvaluationReported):
                self.progress.report.add_evaluation(item.event.body, item.event.tenant)
                self.say(self.progress.report.evaluation_line(item.event.body))

    # ------------------------------------------------------------------ the run

    def end(self, reason: str = "ended by its caller") -> None:
        """End the run as its time budget does (completed, closed out, recorded), from code
        that runs it in-process: a notebook, a test that has seen what it waited for."""
        self.end_reason = reason

    async def run(self) -> int:
        if self.cfg.run.fork_parts:
            warm_up()  # the parts' imports, while the server starts and the run is announced
        RunReport.warm_up_plot()  # the reward curve's at the end, while the parts start
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(self.cfg.model_dump_json(indent=2))
        url = self.nats_url
        reg = self.registry
        if reg is not None:
            self.join_tenants(reg)
        if url is None:
            self.server = EmbeddedServer(
                self.run_dir / "nats",
                auth_conf=reg.auth_conf if reg else None,
                pid_dir=reg.servers_dir if reg else None,
                cpus=None if self.cores is None else self.cores.rest,
            ).start()
            url = self.server.url
        (self.run_dir / "nats_url").write_text(url)  # for `jetrl gateway` and other clients
        admin = None if reg is None else str(reg.creds_path(ADMIN))
        bus = await Bus.connect(url, name="supervisor", creds=admin)
        status: ev.RunStatus
        status, reason = "failed", ""
        follower: asyncio.Task[None] | None = None
        try:
            await bus.ensure_run(self.run_id, self.cfg.bus.limits())
            await self.ensure_views(bus)
            await self.announce(bus)
            self.say(
                f"jetrl run {self.run_id}: {len(self.cfg.envs)} env(s), "
                f"{self.cfg.inference.workers} inference worker(s), model {self.cfg.model.name}, "
                f"max_off_policy_steps {self.cfg.trainer.max_off_policy_steps}; "
                f"run dir {self.run_dir}; nats {url}"
            )
            self.parts = self.plan(url)
            for p in self.parts:
                self.start(p)
            follower = asyncio.create_task(self.follow_steps(bus))
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            budget = self.cfg.run.max_wall_s
            t_start = time.monotonic()
            next_usage = 0.0
            while not stop.is_set():
                if self.check_parts() is not None:
                    status = "completed"
                    break
                if "trainer" not in self.local and self.final_step_seen.is_set():
                    await self.wait_for_parts_elsewhere(bus)
                    status = "completed"
                    break
                if time.monotonic() >= next_usage:
                    next_usage = time.monotonic() + USAGE_EVERY_S
                    await self.check_usage(bus)
                    await self.ensure_views(bus)
                if self.end_reason is not None:
                    status, reason = "completed", self.end_reason
                    self.say(self.end_reason)
                    break
                if budget is not None and time.monotonic() - t_start > budget:
                    status, reason = "completed", f"time budget of {budget:.0f}s reached"
                    self.say(f"time budget of {budget:.0f}s reached")
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=POLL_S)
            else:
                status, reason = "cancelled", "interrupted"
                self.say("stopping (Ctrl-C)...")
        except PartFailed as exc:
            reason = str(exc)
            self.say(f"run failed: {exc}")
        except Exception as exc:
            reason = repr(exc)
            self.say(f"run failed: {exc}")
            raise
        finally:
            # The recorder and the monitor read the log to its end after the others stop.
            self.stop_parts({p.name for p in self.parts if not p.follows})
            # The follower sees the last steps: at once where it has seen the final one.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.final_step_seen.wait(), timeout=0.5)
            if follower:
                follower.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await follower
            steps = len(self.progress.steps)
            if status == "completed":  # a finished run accounts for every rollout in its log
                await self.close_out(bus)
            with contextlib.suppress(Exception):
                await bus.publish(
                    ev.new_event(
                        ev.RunFinished(status=status, steps=steps, reason=reason),
                        run_id=self.run_id,
                        event_id=ids.run_finished_id(self.run_id, status, steps, self.announced_seq),
                    )
                )
            # The monitor stops first: stopped, it folds the log to its end and checks its
            # alerts once more, and what it raises then is for the recorder to record too.
            self.stop_parts({"monitor"})
            head = await bus.last_seq(self.run_id)
            await self.wait_for_recorder(head)
            self.stop_parts()
            await bus.close()
            if self.server:
                self.server.stop()
        self.finish(status)
        return 0 if status == "completed" else 1

    async def wait_for_parts_elsewhere(self, bus: Bus) -> None:
        """With the trainer on another machine, the run ends when its final step is in the log;
        producers and inference elsewhere stop then (`jetrl part` ends them there). The close-out
        must see every rollout: this waits until no new one has come for ``SETTLE_S``, and the
        close-out then drains the trainer's durable (not waited for here: a rollout the trainer
        returned with a nak counts as unacknowledged there until the close-out fetches it)."""
        stream = stream_name(self.run_id)
        rollouts = subjects.rollout_subject(self.run_id)
        deadline = time.monotonic() + self.cfg.trainer.ack_wait_s + 30.0
        seen, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            info = await bus.js.stream_info(stream, subjects_filter=rollouts)
            count = sum((info.state.subjects or {}).values())
            if count != seen:
                seen, since = count, time.monotonic()
            elif time.monotonic() - since >= SETTLE_S:
                return
            await asyncio.sleep(0.25)
        self.log.warning("parts_elsewhere_not_settled", rollouts=seen)

    async def close_out(self, bus: Bus, attempts: int = 4) -> None:
        """Withhold what the trainer left, retried (it is idempotent: withheld events have
        derived ids) when the cluster is electing a leader meanwhile."""
        for attempt in range(1, attempts + 1):
            try:
                self.unfinished = await close_out(bus, self.run_id, self.cfg.trainer)
                return
            except Exception as exc:  # the run's result stands; a gap left is logged
                self.log.warning("close_out_failed", error=repr(exc), attempt=attempt, of=attempts)
                await asyncio.sleep(2.0 * attempt)

    async def wait_for_recorder(self, head: int, timeout: float = 60.0) -> None:
        if not self.cfg.store.recorder:
            return
        deadline = time.monotonic() + timeout
        store: Store | None = None
        try:
            while time.monotonic() < deadline:
                if store is None:  # read-only: the recorder makes and migrates the store
                    with contextlib.suppress(StoreError):
                        store = open_store_read_only(self.db_url)
                if store is not None and queries.recorded_seq(store, self.run_id) >= head:
                    return
                self.check_parts()  # the recorder may crash while catching up, too
                await asyncio.sleep(0.25)
            self.say(f"  ! the recorder did not reach sequence {head} in {timeout:.0f}s")
        finally:
            if store is not None:
                store.close()

    def finish(self, status: str) -> None:
        report = self.progress.report
        summary: dict[str, Any] = {"run_id": self.run_id, "status": status, **report.summary()}
        if status == "completed":
            summary["withheld_at_end"] = self.unfinished
        if report.steps:
            summary["restarts"] = {p.name: p.restarts for p in self.parts if p.restarts} | (
                {"nats-server": self.server_restarts} if self.server_restarts else {}
            )
        if self.cfg.store.recorder:
            try:
                store = open_store_read_only(self.db_url)
            except StoreError as exc:  # the recorder never made it: the summary says so
                summary["db"] = self.db_url
                summary["store_error"] = str(exc)
            else:
                with store:
                    summary["store_steps"] = len(queries.step_history(store, self.run_id))
                    # Alerts the run's monitor raised: how often each rule fired.
                    counts = queries.alert_counts(store, self.run_id)
                    summary["alerts"] = {rule: c["firing"] for rule, c in counts.items()}
                    summary["db"] = self.db_url
        if report.steps:
            summary["reward_curve"] = str(report.plot(self.run_dir / "reward.png", self.run_id))
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.say("\nsummary")
        for k, v in summary.items():
            self.say(f"  {k:<18} {v}")
