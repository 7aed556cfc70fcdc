"""The monitor's web server (consumers/monitor/web.py) through aiohttp's test client: every route,
over a Monitor that folds a real SQLite store (a synthetic run projected into it) and records
fed to its state here."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from jetrl.consumers.monitor.service import Monitor
from jetrl.consumers.monitor.web import STATIC, make_app, serve
from jetrl.store import queries
from jetrl.store import readmodel as rec
from jetrl.store.db import Store, open_store
from jetrl.store.projection import apply_batch
from tests.support.synthetic import log_items, synthetic_run

RUN = "webrun"
STEPS = 5


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    run = synthetic_run(RUN, steps=STEPS, seed=7)
    s = open_store(f"sqlite:///{tmp_path / 'store.db'}")
    with s.write() as conn:
        apply_batch(conn, run_id=RUN, stream="S", consumer="c", items=log_items(run.events))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def monitor(store: Store) -> Monitor:
    m = Monitor(RUN, store=store)
    m.load_store()
    # What the store of that run does not hold: a firing alert and a dead letter.
    seq = m.state.last_seq
    m.state.apply(
        rec.Alerted(seq + 1, m.state.last_t, "mismatch_kl", "trainer", "firing", "warning", "KL", 3)
    )
    m.state.apply(rec.Dead(seq + 2, m.state.last_t, "acme", "schema"))
    return m


@pytest.fixture
async def client(monitor: Monitor) -> AsyncIterator[TestClient[Any, Any]]:
    def metrics() -> tuple[bytes, str]:
        return b"jetrl_steps_total 5\n", "text/plain; version=0.0.4; charset=utf-8"

    async with TestClient(TestServer(make_app(monitor, metrics))) as c:
        yield c


def next_step(m: Monitor, step: int) -> None:
    """A StepCompleted folded in after the store's: a new point."""
    m.state.apply(rec.Stepped(m.state.last_seq + 1, m.state.last_t + 1, step, step, 10, {"loss": 0.5}, ()))


async def test_the_page_script_and_style_are_ours_and_load_nothing_from_elsewhere(
    client: TestClient[Any, Any],
) -> None:
    r = await client.get("/")
    assert r.status == 200 and r.content_type == "text/html"
    page = await r.text()
    for ref in ("static/plotly.min.js", "static/app.js", "static/style.css"):
        assert ref in page
    for element in ('id="tiles"', 'id="chart-reward"', 'id="inspector"', 'id="workers"', 'id="alerts"'):
        assert element in page
    for name, ctype in (("app.js", "text/javascript"), ("style.css", "text/css")):
        r = await client.get(f"/static/{name}")
        assert r.status == 200
        assert r.content_type in (ctype, "application/javascript")
        assert await r.text() == (STATIC / name).read_text()
    # Nothing from a CDN, nor any other host: every reference is relative.
    for text in (page, (STATIC / "app.js").read_text(), (STATIC / "style.css").read_text()):
        low = text.lower()
        assert "cdn" not in low
        assert "http://" not in low and "https://" not in low and "//cdn" not in low
    assert (await client.get("/static/nothing.js")).status == 404
    assert (await client.get("/static/..%2Fweb.py")).status == 404


async def test_plotly_is_the_installed_packages_own_bundle(client: TestClient[Any, Any]) -> None:
    import importlib.resources

    bundled = importlib.resources.files("plotly").joinpath("package_data", "plotly.min.js").read_bytes()
    r = await client.get("/static/plotly.min.js", headers={"Accept-Encoding": "identity"})
    assert r.status == 200 and r.content_type == "application/javascript"
    body = await r.read()
    assert len(body) > 1_000_000 and body == bundled
    # Gzipped for a browser that asks (a remote dashboard loads 4.6 MB otherwise).
    r = await client.get("/static/plotly.min.js", headers={"Accept-Encoding": "gzip, deflate"})
    assert r.status == 200 and r.headers.get("Content-Encoding") == "gzip"
    assert await r.read() == bundled  # the client unpacks it


async def test_snapshot_is_the_monitors(client: TestClient[Any, Any], monitor: Monitor) -> None:
    r = await client.get("/api/snapshot")
    assert r.status == 200 and r.content_type == "application/json"
    snap = await r.json()
    assert snap["run_id"] == RUN
    assert snap["status"] == "completed" and snap["live"] is False
    assert snap["latest"]["step"] == STEPS
    assert snap["latest"]["reward/mean"] == pytest.approx(monitor.snapshot()["latest"]["reward/mean"])
    assert {w["worker_id"] for w in snap["workers"]} >= {"trainer-0", "inf-0"}
    assert all("heartbeat_age_s" in w and "loaded_version" in w for w in snap["workers"])
    assert snap["dead_letters"] == {"schema": 1}
    assert [a["rule"] for a in snap["alerts"] if a["state"] == "firing"] == ["mismatch_kl"]
    assert snap["alert_counts"] == {"mismatch_kl": 1}
    assert snap["queues"] == []


async def test_points_match_the_store(client: TestClient[Any, Any], store: Store) -> None:
    r = await client.get("/api/points")
    assert r.status == 200
    points = await r.json()
    history = queries.step_history(store, RUN)
    assert [p["step"] for p in points] == [h.step for h in history] == list(range(1, STEPS + 1))
    for p, h in zip(points, history, strict=True):
        assert p["reward/mean"] == pytest.approx(h.reward_mean, abs=1e-9)
        assert p["trainer/loss"] == pytest.approx(h.metrics["loss"], abs=1e-12)
        assert p["version"] == h.policy_version
        assert "reward/env/math" in p or "reward/env/code" in p or "reward/env/swe" in p
    after = await (await client.get("/api/points?after=3")).json()
    assert [p["step"] for p in after] == [4, 5]
    assert await (await client.get(f"/api/points?after={STEPS}")).json() == []
    bad = await client.get("/api/points?after=x")
    assert bad.status == 400 and "integer" in (await bad.json())["error"]


async def test_rollouts_of_a_step_and_a_404_for_a_step_not_in_the_run(
    client: TestClient[Any, Any], store: Store
) -> None:
    r = await client.get("/api/steps/2/rollouts")
    assert r.status == 200
    body = await r.json()
    assert body["step"] == 2
    ids = [x.rollout_id for x in queries.step_rollouts(store, RUN, 2)]
    assert [x["rollout_id"] for x in body["rollouts"]] == ids and ids
    missing = await client.get("/api/steps/999/rollouts")
    assert missing.status == 404 and missing.content_type == "application/json"
    assert "999" in (await missing.json())["error"]
    assert (await client.get("/api/steps/two/rollouts")).status == 400


class FakeInspector:
    """An inspector answer as the log gives it (tokens with their numbers), NaN included."""

    def __init__(self) -> None:
        self.fail = False

    async def step(self, step: int, seq: int | None, config: dict[str, Any]) -> dict[str, Any] | None:
        if self.fail:
            raise RuntimeError("the payload store is gone")
        token = {"text": "7", "id": 9, "model": True, "inference_lp": -0.5, "train_lp": -0.25}
        return {
            "step": step,
            "recorded": True,
            "metrics": {"mismatch_kl": float("nan")},
            "rollouts": [
                {
                    "rollout_id": "r1",
                    "reward": 1.0,
                    "reward_parts": {"correct": 1.0},
                    "tokens": [
                        {**token, "gap": 0.25, "route_diff": 2},
                        {**token, "model": False, "train_lp": None, "gap": None, "route_diff": 0},
                        {**token, "gap": float("inf"), "route_diff": None},
                    ],
                }
            ],
        }


async def test_inspector_answers_are_json_without_nan_and_errors_are_json(
    client: TestClient[Any, Any], monitor: Monitor
) -> None:
    fake = FakeInspector()
    monitor.inspector = fake  # type: ignore[assignment]
    r = await client.get("/api/steps/3/rollouts")
    assert r.status == 200
    text = await r.text()
    assert "NaN" not in text and "Infinity" not in text
    body = json.loads(text)
    assert body["metrics"]["mismatch_kl"] is None
    tokens = body["rollouts"][0]["tokens"]
    assert [t["gap"] for t in tokens] == [0.25, None, None]
    assert [t["route_diff"] for t in tokens] == [2, 0, None]
    fake.fail = True
    r = await client.get("/api/steps/3/rollouts")
    assert r.status == 500 and "payload store is gone" in (await r.json())["error"]


async def test_metrics_only_with_a_callable(client: TestClient[Any, Any], monitor: Monitor) -> None:
    r = await client.get("/metrics")
    assert r.status == 200
    assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert await r.text() == "jetrl_steps_total 5\n"
    async with TestClient(TestServer(make_app(monitor))) as bare:
        assert (await bare.get("/metrics")).status == 404


async def read_events(resp: aiohttp.ClientResponse, want: int) -> list[tuple[str, str | None, Any]]:
    """The next ``want`` server-sent events: (event, id, data)."""
    out: list[tuple[str, str | None, Any]] = []
    event, eid, data = "message", None, ""
    while len(out) < want:
        line = (await asyncio.wait_for(resp.content.readline(), 10)).decode()
        if line in ("\n", ""):
            if data:
                out.append((event, eid, json.loads(data)))
            event, eid, data = "message", None, ""
            if line == "":
                break
            continue
        field, _, value = line.rstrip("\n").partition(": ")
        if field == "event":
            event = value
        elif field == "id":
            eid = value
        elif field == "data":
            data += value
    return out


async def test_events_send_every_point_then_the_new_ones_and_the_snapshot(
    client: TestClient[Any, Any], monitor: Monitor
) -> None:
    resp = await client.get("/events")
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    first = await read_events(resp, 2)
    assert [e for e, _, _ in first] == ["points", "snapshot"]
    assert [p["step"] for p in first[0][2]] == list(range(1, STEPS + 1))
    assert first[0][1] == str(STEPS)  # the id a reconnecting EventSource sends back
    assert first[1][2]["run_id"] == RUN
    next_step(monitor, STEPS + 1)
    later = await read_events(resp, 2)  # at most a second later
    assert later[0][0] == "points" and [p["step"] for p in later[0][2]] == [STEPS + 1]
    assert later[0][2][0]["trainer/loss"] == 0.5
    assert later[1][0] == "snapshot" and later[1][2]["latest"]["step"] == STEPS + 1
    # Nothing new: a snapshot alone.
    quiet = await read_events(resp, 1)
    assert quiet[0][0] == "snapshot"
    resp.close()
    # A reconnect with Last-Event-ID: only the points after it.
    resp = await client.get("/events", headers={"Last-Event-ID": "4"})
    again = await read_events(resp, 1)
    assert [p["step"] for p in again[0][2]] == [5, STEPS + 1]
    resp.close()


async def test_a_page_that_goes_away_is_no_error_and_the_server_goes_on(
    client: TestClient[Any, Any], monitor: Monitor, caplog: pytest.LogCaptureFixture
) -> None:
    for _ in range(3):
        resp = await client.get("/events")
        await read_events(resp, 1)
        resp.close()
    next_step(monitor, STEPS + 1)
    await asyncio.sleep(1.5)  # the streams write into closed connections meanwhile
    assert (await client.get("/api/snapshot")).status == 200
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


async def test_serve_on_a_free_port_until_stopped(monitor: Monitor) -> None:
    stop = asyncio.Event()
    urls: list[str] = []
    task = asyncio.create_task(serve(monitor, host="127.0.0.1", port=0, stop=stop, on_ready=urls.append))
    for _ in range(100):
        if urls:
            break
        await asyncio.sleep(0.05)
    assert urls and urls[0].startswith("http://127.0.0.1:") and not urls[0].endswith(":0/")
    async with aiohttp.ClientSession() as http:
        async with http.get(urls[0] + "api/snapshot") as r:
            assert r.status == 200 and (await r.json())["run_id"] == RUN
        # An open event stream does not hold the server up when it stops.
        events = await http.get(urls[0] + "events")
        await read_events(events, 1)
        t0 = asyncio.get_running_loop().time()
        stop.set()
        await asyncio.wait_for(task, 10)
        assert asyncio.get_running_loop().time() - t0 < 4
        events.close()


async def test_serve_on_every_interface_gives_a_url_another_machine_can_use(monitor: Monitor) -> None:
    stop = asyncio.Event()
    urls: list[str] = []
    task = asyncio.create_task(serve(monitor, host="0.0.0.0", port=0, stop=stop, on_ready=urls.append))
    for _ in range(100):
        if urls:
            break
        await asyncio.sleep(0.05)
    assert urls and "0.0.0.0" not in urls[0]
    port = int(urls[0].rsplit(":", 1)[1].rstrip("/"))
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/api/snapshot") as r:
        assert r.status == 200
    stop.set()
    await asyncio.wait_for(task, 10)


def test_points_with_nan_figures_are_sent_as_numbers_or_null(monitor: Monitor) -> None:
    next_step(monitor, STEPS + 1)
    monitor.state.apply(
        rec.Stepped(monitor.state.last_seq + 1, monitor.state.last_t + 1, 7, 7, 1, {"loss": math.nan}, ())
    )
    from jetrl.consumers.monitor.web import _dumps

    text = _dumps(monitor.points(STEPS))
    assert "NaN" not in text
    assert json.loads(text)[-1]["trainer/loss"] in (0.0, None)
