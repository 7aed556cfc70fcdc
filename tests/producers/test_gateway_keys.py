"""The gateway's API keys: a bearer key names the tenant a request runs under and counts
against, over a real nats-server with a stand-in inference worker that answers from the bus."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import stat
from collections.abc import AsyncIterator, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import structlog

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.payloads import token_list_ref
from jetrl.producers.gateway import ApiKeys, ChatGateway, GatewaySettings, key_hash, parse_keys, refusal
from jetrl.producers.gateway_keys import RateLimits, retry_after

KEY_A = f"sk-acme-{secrets.token_hex(16)}"
KEY_B = f"sk-globex-{secrets.token_hex(16)}"
KEY_C = f"sk-initech-{secrets.token_hex(16)}"
ASK = {"messages": [{"role": "user", "content": "3+4="}], "max_tokens": 2}


def write_keys(path: Path, grants: dict[str, tuple[str, int | None]], mtime: float | None = None) -> None:
    """The file as `jetrl tenants add --api-key` writes it: hashes only, 0600, replaced by rename."""
    data = {"keys": {key_hash(k): {"tenant": t, "max_in_flight": n} for k, (t, n) in grants.items()}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.chmod(0o600)
    if mtime is not None:  # a distinct modification time whatever the filesystem's resolution
        os.utime(tmp, (mtime, mtime))
    tmp.replace(path)


def _inline(values: list[int] | list[float], dtype: str) -> ev.InlineArray:
    arr = np.asarray(values, dtype=dtype)
    return ev.InlineArray(dtype=dtype, shape=(len(arr),), data=arr.tobytes())


class Worker:
    """Answers the gateway's tasks like an inference worker would (one CompletionsGenerated
    under the task's tenant); a tenant's tasks wait while its gate is closed."""

    def __init__(self, bus: Bus, run_id: str, answer: list[int]) -> None:
        self.bus, self.run_id, self.answer = bus, run_id, answer
        self.seen: asyncio.Queue[tuple[str, ev.Event]] = asyncio.Queue()
        self.gates: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        subject = subjects.task_subject(self.run_id, "*", "gateway")
        async for item in self.bus.tail(self.run_id, filter_subject=subject):
            assert item.event is not None and isinstance(item.event.body, ev.TaskSubmitted)
            await self.seen.put((item.subject, item.event))
            task = asyncio.create_task(self._generate(item.event, item.seq))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _generate(self, e: ev.Event, seq: int) -> None:
        t = e.body
        assert isinstance(t, ev.TaskSubmitted)
        gate = self.gates.get(e.tenant)
        if gate is not None:
            await gate.wait()
        body = ev.CompletionsGenerated(
            task_id=t.task_id,
            env=t.env,
            prompt_tokens=token_list_ref(seq, "prompt_tokens", t.prompt_tokens),
            samples=[
                ev.Completion(
                    generation_id=f"{t.task_id}-{i}",
                    sample_index=i,
                    completion_tokens=_inline(self.answer, "int32"),
                    logprobs=_inline([-0.5] * len(self.answer), "float32"),
                )
                for i in range(t.group_size)
            ],
            policy_version_start=0,
            policy_version_end=0,
            worker_id="fake-0",
        )
        await self.bus.publish(ev.new_event(body, run_id=e.run_id, tenant=e.tenant, causation_id=e.event_id))


@pytest.fixture
def logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Every log line of the test, as event dicts (whatever stream the process logs to)."""
    with structlog.testing.capture_logs() as captured:
        yield captured


@pytest.fixture
async def served(
    bus: Bus, run_id: str, tmp_path: Path, logs: list[MutableMapping[str, Any]]
) -> AsyncIterator[tuple[ChatGateway, Worker, Path]]:
    keys = tmp_path / "gateway-keys.json"
    write_keys(keys, {KEY_A: ("acme", 1), KEY_B: ("globex", None)})
    gw = ChatGateway(bus, run_id, GatewaySettings(port=0, max_tokens=4, timeout_s=60, keys=str(keys)))
    worker = Worker(bus, run_id, gw.tok.encode("7"))
    follow = asyncio.create_task(worker.run())
    await gw.start()
    try:
        yield gw, worker, keys
    finally:
        await gw.stop()
        follow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follow


async def _post(
    http: aiohttp.ClientSession, gw: ChatGateway, key: str | None, **extra: Any
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with http.post(f"{gw.url}/chat/completions", json={**ASK, **extra}, headers=headers) as r:
        return r.status, await r.json()


async def test_keys_name_the_tenant_and_its_limit(
    served: tuple[ChatGateway, Worker, Path], run_id: str, logs: list[MutableMapping[str, Any]]
) -> None:
    gw, worker, keys = served
    assert stat.S_IMODE(keys.stat().st_mode) == 0o600
    async with aiohttp.ClientSession() as http:
        # No key, a wrong one, another scheme: 401 in the OpenAI error shape, and nothing published.
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {KEY_A}"}):
            async with http.post(f"{gw.url}/chat/completions", json=ASK, headers=headers) as r:
                assert r.status == 401
                err = (await r.json())["error"]
                assert err["code"] == "invalid_api_key" and "API key" in err["message"]
        async with http.get(f"{gw.url}/models") as r:
            assert r.status == 401
        async with http.get(f"{gw.url}/models", headers={"Authorization": f"Bearer {KEY_B}"}) as r:
            assert r.status == 200
        assert worker.seen.empty()

        # Tenant A's key: the task goes on A's subject, under A in the envelope.
        status, answer = await _post(http, gw, KEY_A, n=2)
        assert status == 200, answer
        subject, event = worker.seen.get_nowait()
        assert subject == f"jetrl.{run_id}.task.acme.gateway" and event.tenant == "acme"
        assert isinstance(event.body, ev.TaskSubmitted) and answer["jetrl"]["task_id"] == event.body.task_id
        assert len(answer["choices"]) == 2
        assert answer["choices"][0]["message"]["content"] == "7"

        # A's limit is one request in flight: while one is held, A's next is refused, B's served.
        worker.gates["acme"] = asyncio.Event()
        held = asyncio.create_task(_post(http, gw, KEY_A))
        subject, _ = await worker.seen.get()  # the held request is in flight at the gateway
        assert subject.endswith(".task.acme.gateway") and gw.in_flight["acme"] == 1
        status, refused = await _post(http, gw, KEY_A)
        assert status == 429
        err = refused["error"]
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
        assert "tenant 'acme'" in err["message"] and "limit is 1" in err["message"]
        status, answer = await _post(http, gw, KEY_B)
        assert status == 200, answer
        subject, event = worker.seen.get_nowait()
        assert subject == f"jetrl.{run_id}.task.globex.gateway" and event.tenant == "globex"
        assert worker.seen.empty()  # the refused request published nothing
        worker.gates["acme"].set()
        status, _ = await held
        assert status == 200 and gw.in_flight["acme"] == 0
        status, _ = await _post(http, gw, KEY_A)  # its slot is free again
        assert status == 200
        worker.seen.get_nowait()

        # A key added and one removed apply at once, without a restart.
        write_keys(keys, {KEY_A: ("acme", 1), KEY_C: ("initech", 2)}, mtime=keys.stat().st_mtime + 10)
        status, _ = await _post(http, gw, KEY_C)
        assert status == 200
        subject, event = worker.seen.get_nowait()
        assert subject.endswith(".task.initech.gateway") and event.tenant == "initech"
        status, _ = await _post(http, gw, KEY_B)
        assert status == 401

    # The log holds each answered request under its tenant; the logs name tenants, never keys.
    log = await gw.bus.read_log(run_id, filter_subject=subjects.task_subject(run_id))
    assert [i.event.tenant for i in log if i.event] == ["acme", "acme", "globex", "acme", "initech"]
    events = {line["event"] for line in logs}
    assert {"gateway_keys_loaded", "gateway_quota_refused", "gateway_unauthorized"} <= events
    assert {"tenant": "acme", "limit": 1}.items() <= next(
        line for line in logs if line["event"] == "gateway_quota_refused"
    ).items()
    logged = repr(logs)
    for key in (KEY_A, KEY_B, KEY_C, "sk-wrong"):
        assert key not in logged and key_hash(key) not in logged


def test_keys_file_is_checked_and_a_bad_rewrite_keeps_the_old_keys(tmp_path: Path) -> None:
    good = {key_hash(KEY_A): {"tenant": "acme", "max_in_flight": 3}}
    assert parse_keys({"keys": good})[key_hash(KEY_A)].max_in_flight == 3
    for bad, why in (
        ([], "JSON object"),
        ({"keys": {key_hash(KEY_A): {}}}, "'tenant'"),
        ({"keys": {key_hash(KEY_A): {"tenant": "a.b"}}}, "subject token"),
        ({"keys": {key_hash(KEY_A): {"tenant": "trainer"}}}, "reserved"),
        ({"keys": {key_hash(KEY_A): {"tenant": "acme", "max_in_flight": 0}}}, "positive"),
        ({"keys": {KEY_A: {"tenant": "acme"}}}, "SHA-256"),  # a key in clear is refused
    ):
        with pytest.raises(ValueError, match=why):
            parse_keys(bad)
    path = tmp_path / "keys.json"
    with pytest.raises(ValueError, match="keys file"):
        ApiKeys(path)  # missing at start: the gateway does not start open by mistake
    write_keys(path, {KEY_A: ("acme", None)})
    keys = ApiKeys(path)
    assert keys.lookup(KEY_A) is not None and keys.lookup(KEY_A).tenant == "acme"  # type: ignore[union-attr]
    assert keys.lookup(KEY_B) is None and keys.lookup("") is None
    path.write_text("{not json")  # a half-written file: the keys in force stay
    assert keys.lookup(KEY_A) is not None
    write_keys(path, {KEY_B: ("globex", 1)}, mtime=path.stat().st_mtime + 10)
    assert (
        keys.lookup(KEY_A) is None
        and keys.lookup(KEY_B)
        == parse_keys({"keys": {key_hash(KEY_B): {"tenant": "globex", "max_in_flight": 1}}})[key_hash(KEY_B)]
    )


def test_users_keys_and_rate_limits_are_read_from_the_file() -> None:
    user = {"tenant": "default", "user": "alice", "max_in_flight": 2, "rpm": 30}
    grants = parse_keys({"keys": {key_hash(KEY_A): user, key_hash(KEY_B): {"tenant": "acme"}}})
    alice, acme = grants[key_hash(KEY_A)], grants[key_hash(KEY_B)]
    assert (alice.tenant, alice.user, alice.max_in_flight, alice.rpm) == ("default", "alice", 2, 30)
    # In flight: a user counts on its own, a tenant's key on the tenant's.
    assert alice.principal == "user:alice" and acme.principal == "acme" and acme.rpm is None
    for bad, why in (
        ({**user, "rpm": 0}, "rpm"),
        ({**user, "rpm": True}, "rpm"),
        ({**user, "rpm": 1.5}, "rpm"),
        ({**user, "user": 3}, "'user'"),
        ({**user, "user": "a b"}, "subject token"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_keys({"keys": {key_hash(KEY_A): bad}})


def test_a_token_bucket_allows_a_burst_of_rpm_then_rpm_a_minute() -> None:
    now = [1000.0]
    limits = RateLimits(clock=lambda: now[0])
    assert [limits.take("k", 3) for _ in range(3)] == [0.0, 0.0, 0.0]  # a burst of rpm
    assert limits.take("k", 3) == pytest.approx(20.0)  # the next one in 60/3 s
    assert retry_after(limits.take("k", 3)) == "20"
    now[0] += 19.0
    assert limits.take("k", 3) == pytest.approx(1.0)
    assert retry_after(0.2) == "1"  # whole seconds, at least one
    now[0] += 1.0
    assert limits.take("k", 3) == 0.0 and limits.take("k", 3) > 0  # one refilled, taken
    assert limits.take("other", 3) == 0.0  # each key its own bucket
    assert limits.take("k", None) == 0.0 and "k" not in limits.buckets  # no rpm: no limit
    # A key whose rpm changes keeps its bucket's level (no fresh burst); one removed is forgotten.
    assert limits.take("k", 1) == 0.0 and limits.take("k", 1) == pytest.approx(60.0)
    assert limits.take("k", 60) == pytest.approx(1.0)  # 60 a minute now, from an empty bucket
    limits.keep({"other"})
    assert set(limits.buckets) == {"other"}


def test_the_workers_refusals_become_openai_errors() -> None:
    def dead(reason: str) -> ev.DeadLettered:
        return ev.DeadLettered(
            reason=reason, detail="why", consumer="inference", original_subject="s", original_stream_seq=1
        )

    for reason, status, code in (
        ("too_long", 400, "context_length_exceeded"),
        ("quota", 429, "rate_limit_exceeded"),
        ("unknown_env", 403, "tenant_not_in_run"),
        ("bad_tokens", 400, "bad_tokens"),
    ):
        err = refusal(dead(reason))
        assert (err.status, err.code) == (status, code) and "why" in err.message
        assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    assert refusal(dead("quota")).headers["Retry-After"] == "1"
