"""`jetrl part KIND --nats-url URLS --run RUN [--creds FILE] ...`: one part of a run, anywhere.

The part reads the run's configuration from its log (the newest of RunStarted and
RunResumed), waiting with a clear message when it starts before the run does, and runs the very
process the local supervisor would (deploy/parts.py) as its child; a resume with another config
(`jetrl resume RUN --trainer.max_steps 2000`) restarts the child with it. It ends when the run
does: when RunFinished enters the log the child is stopped (the recorder once it has recorded up
to it), or when the child exits, with its exit code, so whatever started the part (Slurm,
Kubernetes, a shell loop) restarts a crashed one; a restarted part rebuilds itself from the
log. A trainer over several machines runs this on each, with its node rank (torchrun under it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import nats.js.errors
from pydantic import ValidationError

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.log import get_logger
from jetrl.bus.runtime import connect_until, run_process
from jetrl.bus.streams import stream_name
from jetrl.consumers.trainer.engine import Nodes
from jetrl.deploy.config import ConfigError, RunConfig
from jetrl.deploy.parts import KINDS, PartCommand, PartCommands
from jetrl.store import queries
from jetrl.store.db import Store, StoreError, open_store_read_only

WAIT_SAY_EVERY_S = 30.0  # how often a part waiting for its run says so again
RECORDER_CATCH_UP_S = 120.0  # the recorder's time to record the log up to RunFinished
ENDS_AT_GOAL = ("producer", "inference")  # parts that stop at the trainer's final step


class RunState:
    """What a part knows of its run from the log's run subject."""

    def __init__(self) -> None:
        self.config: RunConfig | None = None  # the newest: RunStarted's, or a resume's
        self.resumed: RunConfig | None = None  # a resume's seen while serving, not yet taken up
        self.resumed_seq = 0  # the newest RunResumed: a final step before it is a past goal
        self.finished_seq: int | None = None  # the RunFinished that ends the run
        self.finished_status = ""
        self.goal_reached = False  # the trainer's final step is in the log


async def read_run(bus: Bus, run_id: str) -> tuple[RunState, int] | None:
    """The run's state and its log's head now; None while it has no log or no RunStarted."""
    try:
        head = await bus.last_seq(run_id)
    except nats.js.errors.NotFoundError:
        return None
    state = RunState()
    for item in await bus.read_log(run_id, filter_subject=subjects.run_subject(run_id)):
        b = item.event.body if item.event else None
        if isinstance(b, ev.RunStarted) and state.config is None:
            state.config = recorded_config(run_id, b)
        elif isinstance(b, ev.RunResumed):
            state.config = recorded_config(run_id, b)
            state.finished_seq, state.finished_status = None, ""  # it goes on
            state.resumed_seq = item.seq
        elif isinstance(b, ev.RunFinished):
            state.finished_seq, state.finished_status = item.seq, b.status
    return (state, head) if state.config is not None else None


def recorded_config(run_id: str, b: ev.RunStarted | ev.RunResumed) -> RunConfig:
    try:
        return RunConfig.model_validate(b.config)
    except ValidationError as exc:  # recorded by another version of jetrl, say
        raise ConfigError(f"the config run {run_id} recorded is not one this jetrl reads: {exc}") from None


async def wait_for_run(bus: Bus, run_id: str, stop: asyncio.Event) -> tuple[RunState, int] | None:
    """Wait for the run to start (its RunStarted), saying so now and then; None if stopped."""
    log = get_logger(__name__, run_id=run_id)
    loop = asyncio.get_running_loop()
    said = -WAIT_SAY_EVERY_S
    while not stop.is_set():
        found = await read_run(bus, run_id)
        if found is not None:
            return found
        if loop.time() - said >= WAIT_SAY_EVERY_S:
            said = loop.time()
            log.warning("waiting_for_run", hint=f"no RunStarted in the log of run {run_id} yet")
            print(
                f"jetrl part: waiting for run {run_id} to start (`jetrl run --run-id {run_id}`)", flush=True
            )
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)
    return None


def commands(args: argparse.Namespace, cfg: RunConfig, run_dir: Path) -> list[PartCommand]:
    """What this part runs, from the run's recorded configuration."""
    cmds = PartCommands(cfg, args.run, run_dir, args.nats_url)
    match args.kind:
        case "producer":
            chosen = cmds.producers({e.tenant: args.creds for e in cfg.envs}, args.env or None)
            if not chosen:
                raise ConfigError("no env of the run is left for jetrl's producers to run (see --env)")
            return chosen
        case "inference":
            # Tenants running their own producers read only their views: arrays inline for them.
            inline = sorted({e.tenant for e in cfg.envs if e.remote})
            # By default the host's name, as one subject token (gpu01.cluster -> inf-gpu01-cluster).
            worker = args.worker_id or "inf-" + re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:60]
            return cmds.inference([subjects.check_token(worker, "worker id")], args.creds, inline)
        case "trainer":
            nodes = Nodes(args.nnodes, args.node_rank, args.rdzv_endpoint)
            return [cmds.trainer(args.creds, nodes)]
        case "recorder":
            if not args.db:
                raise ConfigError("the recorder needs --db (the store's URL)")
            return [cmds.recorder(args.db, args.creds)]
        case _:
            return [cmds.monitor(args.creds)]


def start(cmd: PartCommand) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(cmd.threads))
    # Its own session: stopping it stops a trainer's torchrun and every rank under it.
    return subprocess.Popen(cmd.argv, env=env, start_new_session=True)


def stop_all(procs: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


async def recorded_up_to(db: str, run_id: str, seq: int, timeout: float) -> bool:
    store: Store | None = None
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if store is None:  # read-only: the recorder makes and migrates the store
                with contextlib.suppress(StoreError):
                    store = await asyncio.to_thread(open_store_read_only, db)
            if store is not None and await asyncio.to_thread(queries.recorded_seq, store, run_id) >= seq:
                return True
            await asyncio.sleep(0.5)
        return False
    finally:
        if store is not None:
            store.close()


async def follow_run(bus: Bus, run_id: str, from_seq: int, state: RunState) -> None:
    """Follow the run subject after ``from_seq``: a resume's config, until RunFinished."""
    log = get_logger(__name__, run_id=run_id)
    async for item in bus.tail(run_id, filter_subject=subjects.run_subject(run_id), from_seq=from_seq):
        b = item.event.body if item.event else None
        if isinstance(b, ev.RunResumed):
            try:
                state.resumed = recorded_config(run_id, b)
            except ConfigError as exc:  # the children go on with the config they have
                log.error("resume_config_unreadable", error=str(exc))
        elif isinstance(b, ev.RunFinished):
            state.finished_seq, state.finished_status = item.seq, b.status
            return


async def goal_reached(bus: Bus, run_id: str, after_seq: int = 0) -> bool:
    """Whether the newest step in the log is the trainer's final one (after ``after_seq``)."""
    try:
        msg = await bus.js.get_last_msg(stream_name(run_id), subjects.step_subject(run_id), direct=True)
    except nats.js.errors.NotFoundError:
        return False
    body = ev.decode_event(msg.data or b"", msg.headers).body
    return isinstance(body, ev.StepCompleted) and body.final and (msg.seq or 0) > after_seq


async def follow_goal(bus: Bus, run_id: str, from_seq: int, state: RunState) -> None:
    """Wait for the trainer's final step: past it nothing more is trained, so producers and
    inference stop, and the run's close-out accounts for the last rollouts they made (a
    resumed run with more steps has a new final step; the old one is before ``from_seq``)."""
    subject = subjects.step_subject(run_id)
    async for item in bus.tail(run_id, filter_subject=subject, from_seq=from_seq):
        b = item.event.body if item.event else None
        if isinstance(b, ev.StepCompleted) and b.final:
            state.goal_reached = True
            return


async def take_up_resume(
    args: argparse.Namespace,
    state: RunState,
    run_dir: Path,
    procs: list[subprocess.Popen[bytes]],
    cmds: list[PartCommand],
) -> tuple[list[subprocess.Popen[bytes]], list[PartCommand]]:
    """The run was resumed: with another config, the children restart with it (each rebuilds
    itself from the log, as after a crash); with the same, they go on."""
    new, state.resumed = state.resumed, None
    assert new is not None and state.config is not None
    log = get_logger(__name__, run_id=args.run, worker_id=f"part-{args.kind}")
    if new.model_dump(mode="json") == state.config.model_dump(mode="json"):
        log.info("run_resumed", config="unchanged")
        return procs, cmds
    try:
        new_cmds = commands(args, new, run_dir)
    except (ConfigError, ValueError) as exc:
        log.error("resume_config_refused", error=str(exc))
        return procs, cmds
    state.config = new
    await asyncio.to_thread(stop_all, procs)
    log.info("run_resumed", config="changed", parts=[c.name for c in new_cmds])
    print(f"jetrl part {args.kind}: run {args.run} resumed with another config; restarting", flush=True)
    return [start(c) for c in new_cmds], new_cmds


async def serve(args: argparse.Namespace, bus: Bus, stop: asyncio.Event) -> int:
    log = get_logger(__name__, run_id=args.run, worker_id=f"part-{args.kind}")
    try:
        found = await wait_for_run(bus, args.run, stop)
    except ConfigError as exc:
        print(f"jetrl part {args.kind}: {exc}", flush=True)
        return 2
    if found is None:
        return 0
    state, head = found
    assert state.config is not None  # read_run returns only a started run
    run_dir = Path(args.run_dir or Path("runs") / args.run)
    if state.finished_status == "completed" and args.kind != "recorder":
        print(f"jetrl part: run {args.run} has completed; nothing to do", flush=True)
        return 0
    past_goal = state.finished_seq is None and await goal_reached(bus, args.run, state.resumed_seq)
    if args.kind in ENDS_AT_GOAL and past_goal:
        print(f"jetrl part: run {args.run} has trained its last step; nothing to do", flush=True)
        return 0
    if state.finished_seq is not None and state.finished_status != "completed":
        # Stopped (Ctrl-C, a failure): `jetrl resume` carries it on, with this part.
        print(f"jetrl part: run {args.run} stopped ({state.finished_status}); serving it as resumed")
        state.finished_seq = None
    try:
        cmds = commands(args, state.config, run_dir)
    except (ConfigError, ValueError) as exc:  # ValueError: a worker id no subject can carry
        print(f"jetrl part {args.kind}: {exc}", flush=True)
        return 2
    procs = [start(c) for c in cmds]
    log.info("part_started", kind=args.kind, parts=[c.name for c in cmds], pids=[p.pid for p in procs])
    print(f"jetrl part {args.kind}: run {args.run}, started {', '.join(c.name for c in cmds)}", flush=True)
    watchers = [asyncio.create_task(follow_run(bus, args.run, head + 1, state))]
    if args.kind in ENDS_AT_GOAL:
        watchers.append(asyncio.create_task(follow_goal(bus, args.run, head + 1, state)))
    try:
        while not stop.is_set() and state.finished_seq is None and not state.goal_reached:
            if state.resumed is not None:
                procs, cmds = await take_up_resume(args, state, run_dir, procs, cmds)
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                log.info("part_exited", kind=args.kind, exit_codes=codes)
                return int(failed[0]) if failed else 0
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)
        end = state.finished_seq
        recorder = args.kind == "recorder" and end is not None
        if recorder and not await recorded_up_to(args.db, args.run, end or 0, RECORDER_CATCH_UP_S):
            log.warning("recorder_behind", finished_seq=end)
        ended = state.finished_status or ("goal reached" if state.goal_reached else "stopped")
        log.info("part_stopping", kind=args.kind, ended=ended)
        return 0
    finally:
        for w in watchers:
            w.cancel()
        await asyncio.to_thread(stop_all, procs)


def main(args: argparse.Namespace) -> int:
    if args.kind not in KINDS:
        print(f"jetrl part: unknown kind {args.kind!r}")
        return 2

    async def go(stop: asyncio.Event) -> int:
        bus = await connect_until(stop, args.nats_url, name=f"part-{args.kind}", creds=args.creds)
        if bus is None:
            return 0
        try:
            return await serve(args, bus, stop)
        finally:
            await bus.close()

    return run_process(go)


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "part",
        help="one part of a run on this machine, configured from the run's log (docs/cluster.md)",
        description="Runs one kind of part of a run that `jetrl run --parts none` (or another "
        "machine's `jetrl run`) started, and ends with the run.",
    )
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--nats-url", required=True, help="the run's NATS server(s), comma-separated")
    p.add_argument("--run", required=True, help="the run id")
    p.add_argument("--creds", default=None, help="this part's credentials file (servers with auth)")
    p.add_argument("--run-dir", default=None, help="checkpoints, settings, file payloads (default runs/RUN)")
    p.add_argument("--worker-id", default=None, help="inference: its id (default inf-HOSTNAME, dots as -)")
    p.add_argument("--env", action="append", default=[], help="producer: run only this env (repeatable)")
    p.add_argument("--db", default=None, help="recorder: the store's URL")
    p.add_argument("--nnodes", type=int, default=1, help="trainer: the machines its ranks span")
    p.add_argument("--node-rank", type=int, default=0, help="trainer: this machine's place among them")
    p.add_argument("--rdzv-endpoint", default=None, help="trainer: HOST:PORT on node 0 where ranks meet")
    p.set_defaults(func=main)
