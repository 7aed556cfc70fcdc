"""The monitor against a log growing at a steady rate: does it keep up, how far behind, at what
CPU cost; beside a bare ordered consumer reading the same kind of log at the same rate.

    python bench/monitor.py [--rate 5000] [--seconds 20] [--groups 32] [--group-size 8]
                            [--catch-up 15] [--load N]

One private nats-server. Two phases, each on a fresh run stream, each with the same load:

* load: a process of its own publishes a run's mix at ``--rate`` events/s for ``--seconds``:
  per group a TaskSubmitted (the prompt as a token list), its CompletionsGenerated (the
  ``--group-size`` samples' completion tokens and log-probs inline, as the inference worker
  carries small arrays; the prompt by reference to the task) and its RolloutsScored (LogArray
  references to the generation's arrays, as the producer writes them), a StepCompleted every
  ``--groups`` groups (the rollout ids and sequences, the trainer's metrics) and a
  WorkerHeartbeat of each of 5 workers every second.
  Events are made with ``new_event`` at the moment they are sent (their envelope time is the
  publish time) and published with core NATS publishes onto the stream's subjects (no ack
  awaited), paced on the wall clock in bursts of a few milliseconds' worth. A machine that
  cannot publish that fast publishes what it can in the same time; the achieved rate is shown.
* reader, in a process of its own, subscribed before the load starts:
  - baseline: a bare nats-py ordered consumer (``js.subscribe(ordered_consumer=True)``, as
    ``Bus.tail`` subscribes) whose callback counts each message and, for every 8th, reads the
    envelope's time (one field, msgspec) for the lag;
  - monitor: ``reader.follow(bus, state)`` from the start of the log into a MonitorState whose
    ``apply`` notes ``time.time() - event.time`` of every fact before folding it.
  Its window runs from the first message to the moment it has read every event the stream
  stored (or ``--catch-up`` seconds after the load ended, whichever comes first); its CPU time
  over that window (``time.process_time``: the whole process, every thread) over the window's
  wall time is its CPU share, in cores.

Each phase prints its figures (and the CPU shares of the nats-server and the load process in
the same window: on a 2-core machine they share the cores with the reader); the summary ends
with one line per headline figure.
"""

from __future__ import annotations

import os

# Quiet before jetrl configures structlog at import: only the figures go to the terminal.
os.environ.setdefault("JETRL_LOG_LEVEL", "warning")

import argparse
import asyncio
import ctypes
import multiprocessing as mp
import multiprocessing.process
import multiprocessing.queues
import multiprocessing.sharedctypes
import multiprocessing.synchronize
import queue
import random
import sys
import tempfile
import time
import uuid
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from load import cpu_load
from nats.aio.msg import Msg
from nats.js import api
from stats import pct

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.log import configure
from jetrl.bus.payloads import inline_array, log_array, token_list_ref
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.streams import GiB, StreamLimits, stream_name
from jetrl.consumers.monitor import reader
from jetrl.consumers.monitor.series import TRAINER_METRICS, MonitorState, StepPoint
from jetrl.store import readmodel as rec

LIMITS = StreamLimits(max_bytes=4 * GiB, payload_max_bytes=64 * 1024**2)
TENANTS = ("acme", "globex")
ENVS = ("math", "code", "swe")
INFERENCE_WORKERS = tuple(f"inf-{i}" for i in range(4))
HEARTBEAT_S = 1.0  # each worker's heartbeat period
TICK_S = 0.002  # the load sleeps this long once on schedule, so a burst is ~rate * TICK_S events
MAX_BURST = 256  # events sent before yielding to nats-py's flusher when behind schedule
POLL_S = 0.01  # how often a reader checks whether it has read everything
LAG_EVERY = 8  # the baseline reads the envelope time of one message in this many
SUBSCRIBE_S = 60.0  # a reader that has not subscribed by then is reported, not waited for
CPU_COUNT = os.cpu_count() or 1


# ----------------------------------------------------------------------------- load


class LoadMix:
    """An endless run's events in log order, each made when asked for (its time is then)."""

    def __init__(self, run_id: str, *, group_size: int, groups: int, seed: int = 0) -> None:
        self.run_id = run_id
        self.group_size = group_size
        self.groups = groups
        self.rng = random.Random(seed)
        npr = np.random.default_rng(seed)
        # Pools of arrays, packed once: what varies per event is its ids, numbers and sizes.
        self.completions: list[tuple[ev.InlineArray, ev.InlineArray]] = []
        for _ in range(64):
            n = int(npr.integers(32, 1025))
            self.completions.append(
                (
                    inline_array(npr.integers(0, 150_000, n, dtype=np.int32)),
                    inline_array(-npr.random(n, dtype=np.float32) * 3),
                )
            )
        self.prompts: list[tuple[list[int], ev.InlineArray]] = []
        for _ in range(16):
            p = npr.integers(0, 150_000, int(npr.integers(64, 513)), dtype=np.int32)
            self.prompts.append((p.tolist(), inline_array(p)))
        self.steps = 0
        self._bodies = self._make()

    def next(self) -> ev.Event:
        body, tenant, event_id = next(self._bodies)
        return ev.new_event(body, run_id=self.run_id, tenant=tenant, event_id=event_id)

    def _heartbeats(self, version: int) -> Iterator[tuple[ev.EventBody, str, str]]:
        rng = self.rng
        for wid in (*INFERENCE_WORKERS, "trainer-0"):
            inference = wid != "trainer-0"
            yield (
                ev.WorkerHeartbeat(
                    worker_id=wid,
                    kind="inference" if inference else "trainer",
                    status="busy",
                    loaded_version=max(0, version - rng.randint(0, 1)) if inference else None,
                    inflight=rng.randint(0, 64) if inference else 0,
                    stats={
                        "tokens_per_s": round(rng.uniform(2_000, 9_000), 1),
                        "generated": float(rng.randint(0, 10**6)),
                        "kv_cache_usage": round(rng.random(), 3),
                    },
                ),
                "default",
                ev.new_event_id(),
            )

    def _make(self) -> Iterator[tuple[ev.EventBody, str, str]]:
        rng, g_size = self.rng, self.group_size
        seq = 0  # the stream sequence each event gets: a fresh stream, this one publisher
        next_beat = time.monotonic()
        step_t = time.monotonic()
        while True:
            step = self.steps + 1
            version = step - 1  # the weights the workers generate with
            rollout_ids: list[str] = []
            rollout_seqs: list[int] = []
            tokens = 0
            for _ in range(self.groups):
                tenant, env = rng.choice(TENANTS), rng.choice(ENVS)
                task_id = f"{env}.{tenant}.{uuid.uuid4().hex}"
                prompt_list, _ = rng.choice(self.prompts)
                seq += 1
                yield (
                    ev.TaskSubmitted(
                        task_id=task_id,
                        env=env,
                        group_size=g_size,
                        prompt_tokens=prompt_list,
                        max_tokens=1024,
                        min_policy_version=max(0, version - 2),
                    ),
                    tenant,
                    ev.new_event_id(),
                )
                task_seq = seq
                v_start = max(0, version - (rng.random() < 0.2))
                drawn = [rng.choice(self.completions) for _ in range(g_size)]
                seq += 1
                gen_seq = seq
                gen_id = ev.new_event_id()
                yield (
                    ev.CompletionsGenerated(
                        task_id=task_id,
                        env=env,
                        prompt_tokens=token_list_ref(task_seq, "prompt_tokens", prompt_list),
                        samples=[
                            ev.Completion(
                                generation_id=f"{task_id}-{i}",
                                sample_index=i,
                                completion_tokens=completion,
                                logprobs=logprobs,
                                finish_reason="length" if completion.shape[0] >= 1024 else "stop",
                            )
                            for i, (completion, logprobs) in enumerate(drawn)
                        ],
                        policy_version_start=v_start,
                        policy_version_end=version,
                        worker_id=rng.choice(INFERENCE_WORKERS),
                        timings=ev.GenerationTimings(
                            queued_s=round(rng.uniform(0.0, 2.0), 4),
                            generate_s=round(rng.uniform(0.5, 8.0), 4),
                            load_wait_s=round(rng.uniform(0.0, 0.3), 4) if rng.random() < 0.1 else 0.0,
                        ),
                    ),
                    tenant,
                    gen_id,
                )
                rewards = [float(rng.random() < 0.4) for _ in drawn]
                seq += 1
                yield (
                    ev.RolloutsScored(
                        generation_event_id=gen_id,
                        task_id=task_id,
                        env=env,
                        group_id=task_id,
                        group_size=g_size,
                        prompt_tokens=token_list_ref(task_seq, "prompt_tokens", prompt_list),
                        rollouts=[
                            ev.ScoredRollout(
                                rollout_id=f"{task_id}-{i}",
                                sample_index=i,
                                reward=rewards[i],
                                reward_parts={"correct": rewards[i], "format": 1.0},
                                completion_tokens=log_array(
                                    gen_seq, f"samples.{i}.completion_tokens", completion
                                ),
                                logprobs=log_array(gen_seq, f"samples.{i}.logprobs", logprobs),
                                policy_version_start=v_start,
                                policy_version_end=version,
                            )
                            for i, (completion, logprobs) in enumerate(drawn)
                        ],
                    ),
                    tenant,
                    ev.new_event_id(),
                )
                for i, (completion, _) in enumerate(drawn):
                    rollout_ids.append(f"{task_id}-{i}")
                    rollout_seqs.append(seq)
                    tokens += completion.shape[0]
                if time.monotonic() >= next_beat:
                    next_beat += HEARTBEAT_S
                    for beat in self._heartbeats(version):
                        seq += 1
                        yield beat
            now = time.monotonic()
            metrics = {k: round(rng.uniform(0.0, 1.0), 6) for k in TRAINER_METRICS}
            metrics |= {
                "reward_mean": round(rng.random(), 6),
                "kl": round(rng.uniform(0.0, 0.05), 6),
                "lr": 1e-6,
                "clip_frac": round(rng.uniform(0.0, 0.2), 6),
                "adv_std": round(rng.uniform(0.5, 1.5), 6),
                "step_s": round(now - step_t, 6),
            }
            seq += 1
            self.steps = step
            yield (
                ev.StepCompleted(
                    step=step,
                    policy_version=step,
                    rollout_ids=rollout_ids,
                    rollout_seqs=rollout_seqs,
                    metrics=metrics,
                    tokens=tokens,
                    duration_s=round(now - step_t, 6),
                ),
                "default",
                ev.new_event_id(),
            )
            step_t = now


async def publish_load(
    url: str,
    run_id: str,
    rate: float,
    seconds: float,
    group_size: int,
    groups: int,
    started: multiprocessing.synchronize.Event,
) -> dict[str, float]:
    mix = LoadMix(run_id, group_size=group_size, groups=groups)
    bus = await Bus.connect(url, name="bench-monitor-load")
    nc = bus.nc
    sent = nbytes = 0
    behind_max = 0
    started.set()
    cpu0, t0 = time.process_time(), time.perf_counter()
    last_sent_at = t0
    while True:
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            break
        due = int(rate * elapsed) + 1
        behind_max = max(behind_max, due - sent)
        burst = 0
        while sent < due and burst < MAX_BURST:
            e = mix.next()
            data = ev.encode_event(e)
            await nc.publish(subjects.subject_for(e), data, headers=ev.event_headers(e))
            sent += 1
            burst += 1
            nbytes += len(data)
        last_sent_at = time.perf_counter()
        # On schedule: sleep a tick. Behind it: only let nats-py's flusher run, then go on.
        await asyncio.sleep(TICK_S if sent >= due else 0)
    await nc.flush(timeout=30)
    took = max(last_sent_at - t0, 1e-9)
    cpu = time.process_time() - cpu0
    wall = time.perf_counter() - t0
    await bus.close()
    return {
        "sent": float(sent),
        "bytes": float(nbytes),
        "seconds": took,
        "steps": float(mix.steps),
        "behind_max": float(behind_max),
        "cpu_share": cpu / max(wall, 1e-9),
    }


def _load_main(
    url: str,
    run_id: str,
    rate: float,
    seconds: float,
    group_size: int,
    groups: int,
    started: multiprocessing.synchronize.Event,
    out: multiprocessing.queues.Queue[dict[str, Any]],
) -> None:
    configure("warning")
    try:
        got: dict[str, Any] = dict(
            asyncio.run(publish_load(url, run_id, rate, seconds, group_size, groups, started))
        )
    except Exception as exc:  # reported by the parent, which goes on without the figure
        got = {"error": repr(exc)}
    out.put(got)


# ----------------------------------------------------------------------------- readers


class Meter:
    """A reader's count, lags and the start of its measured window."""

    def __init__(self) -> None:
        self.count = 0
        self.lags: array[float] = array("d")
        self.t0: float | None = None  # perf_counter at the first message
        self.cpu0 = 0.0

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.cpu0 = time.process_time()


class TimedState(MonitorState):
    """The monitor's fold, noting each fact's lag (now minus its event's time) first."""

    def __init__(self, run_id: str, meter: Meter) -> None:
        super().__init__(run_id)
        self.meter = meter

    def apply(self, r: rec.Fact) -> StepPoint | None:
        m = self.meter
        if m.t0 is None:
            m.start()
        m.lags.append(time.time() - r.t)
        return super().apply(r)


class _EnvelopeTime(msgspec.Struct):
    time: float


_time_decoder = msgspec.msgpack.Decoder(_EnvelopeTime)


async def watch(
    count: Callable[[], int],
    target: multiprocessing.sharedctypes.Synchronized[int],
    catch_up_s: float,
    limit_s: float,
    failed: Callable[[], str | None],
) -> str:
    """Wait until the reader has read ``target`` events (set once the load is done); returns
    how it ended."""
    begun = time.monotonic()
    target_at: float | None = None
    while True:
        n, want = count(), target.value
        if want >= 0:
            if target_at is None:
                target_at = time.monotonic()
            if n >= want:
                return "caught up"
            if time.monotonic() - target_at > catch_up_s:
                return f"not caught up {catch_up_s:.0f} s after the load ended"
        if time.monotonic() - begun > limit_s:
            return f"stopped at the time limit of {limit_s:.0f} s"
        why = failed()
        if why is not None:
            return why
        await asyncio.sleep(POLL_S)


async def read(
    kind: str,
    url: str,
    run_id: str,
    target: multiprocessing.sharedctypes.Synchronized[int],
    catch_up_s: float,
    limit_s: float,
) -> dict[str, Any]:
    bus = await Bus.connect(url, name=f"bench-monitor-{kind}")
    meter = Meter()
    extra: dict[str, Any] = {}
    if kind == "monitor":
        state = TimedState(run_id, meter)
        task = asyncio.create_task(reader.follow(bus, state))

        def failed() -> str | None:
            if not task.done():
                return None
            exc = task.exception() if not task.cancelled() else None
            return f"reader.follow ended: {exc!r}"

        how = await watch(lambda: state.events, target, catch_up_s, limit_s, failed)
        t1, cpu1 = time.perf_counter(), time.process_time()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        meter.count = state.events
        extra = {"steps": len(state.steps), "undecodable": state.undecodable}
    else:

        async def on_msg(msg: Msg) -> None:
            if meter.t0 is None:
                meter.start()
            meter.count += 1
            if meter.count % LAG_EVERY == 0:
                meter.lags.append(time.time() - _time_decoder.decode(msg.data).time)

        sub = await bus.js.subscribe(
            subjects.all_subjects(run_id),
            stream=stream_name(run_id),
            cb=on_msg,
            ordered_consumer=True,
            config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL),
            idle_heartbeat=1.0,  # as Bus.tail subscribes
        )
        how = await watch(lambda: meter.count, target, catch_up_s, limit_s, lambda: None)
        t1, cpu1 = time.perf_counter(), time.process_time()
        await sub.unsubscribe()
    await bus.close()
    wall = t1 - meter.t0 if meter.t0 is not None else 0.0
    lags = meter.lags
    return {
        "count": meter.count,
        "wall": wall,
        "cpu": cpu1 - meter.cpu0 if meter.t0 is not None else 0.0,
        "lag_p50": pct(lags, 0.5),
        "lag_p99": pct(lags, 0.99),
        "lag_max": max(lags, default=float("nan")),
        "lag_n": len(lags),
        "how": how,
        **extra,
    }


def _reader_main(
    kind: str,
    url: str,
    run_id: str,
    target: multiprocessing.sharedctypes.Synchronized[int],
    catch_up_s: float,
    limit_s: float,
    out: multiprocessing.queues.Queue[dict[str, Any]],
) -> None:
    configure("warning")
    try:
        got = asyncio.run(read(kind, url, run_id, target, catch_up_s, limit_s))
    except Exception as exc:  # reported by the parent, which goes on without the figure
        got = {"error": repr(exc)}
    out.put(got)


# ----------------------------------------------------------------------------- phases


@dataclass
class Phase:
    kind: str  # "baseline" | "monitor"
    load: dict[str, Any] = field(default_factory=dict)
    reading: dict[str, Any] = field(default_factory=dict)
    stored: int = 0
    server_share: float | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def published(self) -> int:
        return int(self.load.get("sent", 0))

    @property
    def rate(self) -> float:
        s = float(self.load.get("seconds", 0.0))
        return self.published / s if s > 0 else 0.0

    @property
    def share(self) -> float | None:
        wall = float(self.reading.get("wall", 0.0))
        return float(self.reading["cpu"]) / wall if wall > 0 else None


def server_cpu_s(pid: int | None) -> float | None:
    """The nats-server's CPU seconds so far (Linux /proc), None where that cannot be read."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


async def result_of(
    q: multiprocessing.queues.Queue[dict[str, Any]], proc: multiprocessing.process.BaseProcess, timeout: float
) -> dict[str, Any]:
    """What a child put on ``q``, or an error saying why nothing came."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return q.get_nowait()
        except queue.Empty:
            pass
        if not proc.is_alive():
            try:
                return q.get(timeout=1.0)  # put just before it exited
            except queue.Empty:
                return {"error": f"the process died (exit {proc.exitcode})"}
        await asyncio.sleep(0.05)
    return {"error": f"no result within {timeout:.0f} s"}


async def stored_count(bus: Bus, run_id: str, expect: int) -> int:
    """The stream's message count once it holds ``expect`` or stops growing (1 s, 10 s at most)."""
    deadline = time.monotonic() + 10.0
    last, since = -1, time.monotonic()
    while True:
        n = int((await bus.js.stream_info(stream_name(run_id))).state.messages)
        if n >= expect or time.monotonic() > deadline:
            return n
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since > 1.0:
            return n
        await asyncio.sleep(0.05)


def stop(proc: multiprocessing.process.BaseProcess) -> None:
    proc.join(timeout=5)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5)


async def run_phase(kind: str, srv: EmbeddedServer, args: argparse.Namespace) -> Phase:
    phase = Phase(kind)
    run_id = f"benchmon{kind[:4]}{uuid.uuid4().hex[:6]}"
    bus = await Bus.connect(srv.url, name="bench-monitor")
    await bus.ensure_run(run_id, LIMITS)
    ctx = mp.get_context("spawn")
    target = ctx.Value(ctypes.c_longlong, -1)
    reader_out: multiprocessing.queues.Queue[dict[str, Any]] = ctx.Queue()
    load_out: multiprocessing.queues.Queue[dict[str, Any]] = ctx.Queue()
    started = ctx.Event()
    limit_s = args.seconds + args.catch_up + SUBSCRIBE_S + 60
    rd = ctx.Process(
        target=_reader_main,
        args=(kind, srv.url, run_id, target, args.catch_up, limit_s, reader_out),
        daemon=True,
    )
    rd.start()
    # The load starts once the reader's consumer exists, so its start-up is not measured as lag.
    deadline = time.monotonic() + SUBSCRIBE_S
    while not (await bus.js.stream_info(stream_name(run_id))).state.consumer_count:
        if not rd.is_alive() or time.monotonic() > deadline:
            phase.errors.append(f"the reader did not subscribe within {SUBSCRIBE_S:.0f} s")
            target.value = 0
            break
        await asyncio.sleep(0.05)
    pid = srv.proc.pid if srv.proc is not None else None
    if not phase.errors:
        ld = ctx.Process(
            target=_load_main,
            args=(srv.url, run_id, args.rate, args.seconds, args.group_size, args.groups, started, load_out),
            daemon=True,
        )
        ld.start()
        deadline = time.monotonic() + SUBSCRIBE_S
        while not started.is_set() and ld.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        cpu0, t0 = server_cpu_s(pid), time.perf_counter()
        phase.load = await result_of(load_out, ld, args.seconds + 60)
        cpu1, t1 = server_cpu_s(pid), time.perf_counter()
        if cpu0 is not None and cpu1 is not None and t1 > t0:
            phase.server_share = (cpu1 - cpu0) / (t1 - t0)
        stop(ld)
        if "error" in phase.load:
            phase.errors.append(f"load: {phase.load.pop('error')}")
        phase.stored = await stored_count(bus, run_id, phase.published)
        target.value = phase.stored
    phase.reading = await result_of(reader_out, rd, args.catch_up + 60)
    stop(rd)
    if "error" in phase.reading:
        phase.errors.append(f"reader: {phase.reading.pop('error')}")
    await bus.js.delete_stream(stream_name(run_id))
    await bus.close()
    return phase


# ----------------------------------------------------------------------------- report

LABEL = {
    "baseline": "baseline: a bare ordered consumer (nats-py js.subscribe, its callback counts)",
    "monitor": "monitor: reader.follow into a MonitorState",
}


def phase_lines(p: Phase, asked: float) -> list[str]:
    out = [f"\n== {LABEL[p.kind]}"]
    out += [f"error     {e}" for e in p.errors]
    if p.load:
        n = p.published
        size = float(p.load["bytes"]) / n / 1024 if n else 0.0
        mbs = float(p.load["bytes"]) / max(float(p.load["seconds"]), 1e-9) / 1e6
        out.append(
            f"load      {n:,} events in {float(p.load['seconds']):.1f} s = {p.rate:,.0f} events/s"
            f" (asked {asked:,.0f}), {size:.1f} KiB each = {mbs:.1f} MB/s; {int(p.load['steps'])} steps;"
            f" at most {int(p.load['behind_max']):,} events behind schedule; {p.stored:,} stored"
        )
    r = p.reading
    if r:
        folded = "folded" if p.kind == "monitor" else "counted"
        n = int(r["count"])
        share = p.share
        per_event = float(r["cpu"]) / n * 1e6 if n else float("nan")
        line = (
            f"reader    {n:,} events {folded} of {p.published:,} published in {float(r['wall']):.1f} s"
            f" ({r['how']}): cpu {float(r['cpu']):.1f} s"
            f" = {share if share is not None else float('nan'):.2f} core, {per_event:.0f} us/event;"
            f" lag p50 {float(r['lag_p50']):.3f} s, p99 {float(r['lag_p99']):.3f} s,"
            f" max {float(r['lag_max']):.3f} s ({int(r['lag_n']):,} samples)"
        )
        if p.kind == "monitor":
            line += f"; {int(r['steps'])} steps charted, {int(r['undecodable'])} undecodable"
        out.append(line)
    machine = []
    if p.server_share is not None:
        machine.append(f"nats-server {p.server_share:.2f} core")
    if "cpu_share" in p.load:
        machine.append(f"load generator {float(p.load['cpu_share']):.2f} core")
    if machine:
        out.append(f"beside it {', '.join(machine)} (of {CPU_COUNT} CPUs)")
    return out


def _why_not(p: Phase | None) -> str | None:
    if p is None:
        return "phase not run"
    if not p.reading or not int(p.reading.get("count", 0)):
        return "; ".join(p.errors) or "no event read"
    return None


def summary_lines(mon: Phase | None, base: Phase | None, asked: float) -> list[str]:
    out = []
    rates = [f"{p.rate:,.0f} events/s during the {p.kind}" for p in (mon, base) if p is not None and p.load]
    out.append(f"load rate {', '.join(rates) or 'not measured'} (asked {asked:,.0f})")
    for p, name, what, targets in (
        (mon, "monitor", "folded", ("(target < 1 s)", "(target < 1)", "target 1.00")),
        (base, "baseline", "counted", ("(bare ordered consumer)",) * 2 + ("bare ordered consumer",)),
    ):
        slow = ""
        if p is not None and p.load and p.rate < 0.95 * asked:
            slow = f"; at {p.rate:,.0f} events/s, below the {asked:,.0f} asked"
        why = _why_not(p)
        if why is not None:
            out.append(f"{name} lag p99: not measured ({why}) {targets[0]}")
            out.append(f"{name} cpu share: not measured ({why}) {targets[1]}")
            out.append(f"{name} kept up: not measured ({why}) ({targets[2]})")
            continue
        assert p is not None
        share = p.share
        share_s = f"{share:.2f} core" if share is not None else "not measured (no window)"
        kept = int(p.reading["count"]) / p.published if p.published else 0.0
        out.append(f"{name} lag p99 {float(p.reading['lag_p99']):.3f} s {targets[0][:-1]}{slow})")
        out.append(f"{name} cpu share {share_s} {targets[1][:-1]}{slow})")
        out.append(f"{name} kept up {kept:.2f} (events {what} / published, {targets[2]})")
    ms, bs = (mon.share if mon else None), (base.share if base else None)
    if ms is not None and bs is not None and bs > 0 and _why_not(mon) is None and _why_not(base) is None:
        out.append(f"monitor cpu / baseline cpu {ms / bs:.2f}x")
    else:
        out.append("monitor cpu / baseline cpu: not measured (a phase has no cpu share)")
    return out


async def amain(args: argparse.Namespace) -> int:
    loaded = f" beside {args.load} busy processes" if args.load else ""
    print(
        f"monitor bench: {args.rate:,.0f} events/s for {args.seconds:.0f} s per phase,"
        f" {args.groups} groups of {args.group_size} per step{loaded}, {CPU_COUNT} CPUs"
    )
    phases: dict[str, Phase] = {}
    with (
        tempfile.TemporaryDirectory(prefix="jetrl-bench-monitor-") as tmp,
        EmbeddedServer(Path(tmp) / "nats") as srv,
        cpu_load(args.load),
    ):
        for kind in ("baseline", "monitor"):
            try:
                phases[kind] = await run_phase(kind, srv, args)
            except Exception as exc:  # the bus itself failed: reported, the other phase still runs
                phases[kind] = Phase(kind, errors=[f"phase failed: {exc!r}"])
            print("\n".join(phase_lines(phases[kind], args.rate)), flush=True)
    print()
    print("\n".join(summary_lines(phases.get("monitor"), phases.get("baseline"), args.rate)))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=5000.0, help="events/s the load publishes")
    p.add_argument("--seconds", type=float, default=20.0, help="how long the load runs, per phase")
    p.add_argument("--groups", type=int, default=32, help="groups per trainer step")
    p.add_argument("--group-size", type=int, default=8, help="samples per group")
    p.add_argument(
        "--catch-up", type=float, default=15.0, help="how long a reader may take after the load ends"
    )
    p.add_argument("--load", type=int, default=0, help="busy CPU processes running beside the bench")
    args = p.parse_args(argv)
    if args.rate <= 0 or args.seconds <= 0 or args.groups < 1 or args.group_size < 1 or args.catch_up < 0:
        p.error("--rate, --seconds, --groups and --group-size must be positive, --catch-up at least 0")
    configure("warning")
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
