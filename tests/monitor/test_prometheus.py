"""The monitor's Prometheus endpoint (consumers/monitor/prometheus.py): the newest step's figures
and the live state, parsed back with prometheus_client's own parser, rendered and served."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from jetrl.consumers.monitor.prometheus import Exporter, metric_name
from jetrl.consumers.monitor.reader import QueueDepth
from jetrl.consumers.monitor.series import MonitorState, StepPoint
from jetrl.consumers.monitor.service import Monitor
from jetrl.store import readmodel as rec
from jetrl.store.db import Store, open_store

RUN = "prom-run"


def records() -> list[rec.Fact]:
    """Two steps over two envs and tenants, two workers, dead letters, a withheld rollout and
    an alert that fired on one key and resolved on another."""
    seq = iter(range(1, 1000))
    out: list[rec.Fact] = [rec.Started(next(seq), 100.0, {})]
    for step in range(2):
        t = 100.0 + 10 * step
        out.append(rec.Tasked(next(seq), t, "run", "add", 4))
        ids = []
        for i in range(3):
            env, tenant = ("add", "run") if i < 2 else ("mul", "acme")
            gen, rid = f"g{step}{i}", f"r{step}{i}"
            out.append(
                rec.Generated(
                    next(seq), t + 1, gen, "w0", (rec.GeneratedSample(rid, 0, "stop", None),), 0.0, 0.5
                )
            )
            one = rec.ScoredOne(rid, 0.25 * (i + step), step, 8)
            out.append(rec.Scored(next(seq), t + 2, tenant, env, gen, (one,)))
            ids.append(rid)
        metrics = {"loss": 0.5 - 0.1 * step, "trainer_idle_frac": 0.2, "trainer_wait_s": 1.5}
        out.append(rec.Stepped(next(seq), t + 5, step, step + 1, 300, metrics, tuple(ids)))
    out += [
        rec.Beat(next(seq), 111.0, "w0", "inference", "ready", 2, 3),
        rec.Beat(next(seq), 104.0, "w1", "inference", "ready", None, 0),
        rec.Dead(next(seq), 112.0, "run", "undecodable"),
        rec.Dead(next(seq), 113.0, "acme", "undecodable"),
        rec.Dead(next(seq), 114.0, "acme", "max_deliver"),
        rec.Scored(next(seq), 114.5, "run", "add", "gx", (rec.ScoredOne("rx", 1.0, 0, 8),)),
        rec.Withheld(next(seq), 115.0, "rx", "too_stale"),
        rec.Tasked(next(seq), 115.5, "run", "add", 4),
        rec.Alerted(next(seq), 116.0, "heartbeat_lost", "w1", "firing", "warning", "w1 silent", 1),
        rec.Alerted(next(seq), 117.0, "mismatch_kl", "trainer", "firing", "warning", "kl", 1),
        rec.Alerted(next(seq), 118.0, "mismatch_kl", "trainer", "resolved", "warning", "kl ok", 1),
        rec.Stepped(next(seq), 120.0, 9, 9, 0, {}, ()),  # a later step is not told to the exporter
    ]
    return out


def fold(state: MonitorState, upto: int | None = None) -> list[StepPoint]:
    rs = records()
    return [p for r in rs[:upto] if (p := state.apply(r)) is not None]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = open_store(f"sqlite:///{tmp_path}/s.db")
    yield s
    s.close()


def samples(body: bytes) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            assert s.labels["run"] == RUN, s
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "run"))
            out.setdefault(s.name, {})[labels] = s.value
    return out


def one(got: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, **labels: str) -> float:
    return got[name][tuple(sorted(labels.items()))]


def test_names() -> None:
    assert metric_name("reward/mean") == "jetrl_reward_mean"
    assert metric_name("trainer/loss") == "jetrl_trainer_loss"
    assert metric_name("trainer/trainer_idle_frac") == "jetrl_trainer_idle_ratio"
    assert metric_name("trainer/trainer_wait_s") == "jetrl_trainer_wait_seconds"
    assert metric_name("throughput/tokens_per_s") == "jetrl_throughput_tokens_per_second"


def test_render(store: Store) -> None:
    monitor = Monitor(RUN, store=store)
    exporter = Exporter(monitor)
    state = MonitorState(RUN)
    pts = fold(state, upto=-1)  # all but the last step
    monitor.state = state
    monitor.queues = [QueueDepth("trainer", 5, 2), QueueDepth("inference-run", 0, 1)]

    body, content_type = exporter.render()
    assert content_type.startswith("text/plain") and "version=" in content_type
    got = samples(body)
    last = pts[-1]
    assert one(got, "jetrl_step") == 1
    assert one(got, "jetrl_policy_version") == 2
    assert one(got, "jetrl_step_time_seconds") == last.t
    assert one(got, "jetrl_reward_mean") == pytest.approx(last.reward_mean)
    assert one(got, "jetrl_reward_env_mean", env="add") == pytest.approx(last.reward_by_env["add"])
    assert one(got, "jetrl_reward_env_mean", env="mul") == pytest.approx(0.75)
    assert one(got, "jetrl_reward_tenant_mean", tenant="acme") == pytest.approx(0.75)
    assert one(got, "jetrl_trainer_loss") == pytest.approx(0.4)
    assert one(got, "jetrl_trainer_idle_ratio") == pytest.approx(0.2)
    assert one(got, "jetrl_trainer_wait_seconds") == pytest.approx(1.5)
    assert one(got, "jetrl_staleness_mean") == pytest.approx(last.staleness_mean)
    assert one(got, "jetrl_throughput_tokens_per_second") == pytest.approx(last.tokens_per_s)
    assert one(got, "jetrl_rollouts_count") == 3
    # Each step scalar is there, under one name (the backlog: the live series below).
    for key in last.scalars():
        if not key.startswith(("reward/env/", "reward/tenant/", "queue/")):
            assert metric_name(key) in got, key

    # Live state: the monitor's clock is the log's last time (118.0), no bus.
    assert one(got, "jetrl_worker_heartbeat_age_seconds", worker="w0", kind="inference") == 7.0
    assert one(got, "jetrl_worker_heartbeat_age_seconds", worker="w1", kind="inference") == 14.0
    assert one(got, "jetrl_worker_loaded_version", worker="w0", kind="inference") == 2
    assert (("kind", "inference"), ("worker", "w1")) not in got["jetrl_worker_loaded_version"]
    assert one(got, "jetrl_worker_inflight", worker="w0", kind="inference") == 3
    assert one(got, "jetrl_queue_pending_messages", consumer="trainer") == 5
    assert one(got, "jetrl_queue_ack_pending_messages", consumer="inference-run") == 1
    assert one(got, "jetrl_pending_samples") == 6  # 12 asked, 6 generated
    assert one(got, "jetrl_pending_rollouts") == 0
    assert one(got, "jetrl_dead_letters_total", reason="undecodable") == 2
    assert one(got, "jetrl_dead_letters_total", reason="max_deliver") == 1
    assert sum(got["jetrl_dead_letters_total"].values()) == 3
    assert one(got, "jetrl_withheld_rollouts_total", reason="too_stale") == 1
    assert one(got, "jetrl_alerts_firing", rule="heartbeat_lost") == 1
    assert one(got, "jetrl_alerts_firing", rule="mismatch_kl") == 0
    assert one(got, "jetrl_alerts_raised_total", rule="mismatch_kl") == 1
    assert one(got, "jetrl_events_total") == len(records()) - 1
    assert one(got, "jetrl_run_finished") == 0

    # Snapshot series follow the state at each render: a worker gone, no stale series.
    del monitor.state.workers["w1"]
    monitor.queues = []
    got = samples(exporter.render()[0])
    assert set(got["jetrl_worker_heartbeat_age_seconds"]) == {(("kind", "inference"), ("worker", "w0"))}
    assert "jetrl_queue_pending_messages" not in got

    # A step folded into the state later shows at the next render.
    monitor.state.apply(records()[-1])
    assert one(samples(exporter.render()[0]), "jetrl_step") == 9

    # Its own registry: nothing of jetrl in the global one.
    assert not [m for m in REGISTRY.collect() if m.name.startswith("jetrl_")]


def test_render_before_any_step(store: Store) -> None:
    exporter = Exporter(Monitor(RUN, store=store))
    got = samples(exporter.render()[0])
    assert "jetrl_step" not in got
    assert one(got, "jetrl_pending_samples") == 0
    assert one(got, "jetrl_events_total") == 0


async def test_serve(store: Store) -> None:
    monitor = Monitor(RUN, store=store)
    exporter = Exporter(monitor)
    state = MonitorState(RUN)
    monitor.state = state
    for r in records()[:-1]:
        state.apply(r)

    stop = asyncio.Event()
    task = asyncio.create_task(exporter.serve("127.0.0.1", 0, stop))
    await asyncio.wait_for(exporter.serving.wait(), 10)
    assert exporter.port and exporter.port > 0
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{exporter.port}/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            got = samples(await resp.read())
        assert one(got, "jetrl_step") == 1
        assert one(got, "jetrl_worker_loaded_version", worker="w0", kind="inference") == 2
        async with http.get(f"http://127.0.0.1:{exporter.port}/") as resp:
            assert resp.status == 404
    port = exporter.port
    stop.set()
    await asyncio.wait_for(task, 10)
    assert not exporter.serving.is_set()
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientConnectionError):
            await http.get(f"http://127.0.0.1:{port}/metrics")
