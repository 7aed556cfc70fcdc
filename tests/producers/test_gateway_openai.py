"""The gateway through the official ``openai`` client: streaming, API keys of tenants and of
users, per-key rate limits and OpenAI's error shapes, against a real inference worker on the
session's nats-server (tests/support/served_policy.py), one served run for the whole module."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import openai
import pytest
from openai import AsyncOpenAI

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.payloads import Payloads
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.settings import EnvRoute, TenantSettings
from jetrl.consumers.inference.settings import InferencePart
from jetrl.producers.gateway import ChatGateway, GatewaySettings
from tests.support.served_policy import Served, served_policy, write_keys

TENANT_KEY = f"sk-acme-{secrets.token_hex(8)}"
USER_KEY = f"sk-alice-{secrets.token_hex(8)}"
SLOW_KEY = f"sk-bob-{secrets.token_hex(8)}"  # one request a minute
STRAY_KEY = f"sk-carol-{secrets.token_hex(8)}"  # a user put on a tenant the run does not have
ASK: list[Any] = [{"role": "user", "content": "3+4="}]
# The run's tenants: acme (with a training env) and the gateway's own, default.
PART = InferencePart(
    tenants=[TenantSettings(name="acme")], envs=[EnvRoute(tenant="acme", env="modsum", group_size=2)]
)


@pytest.fixture(scope="module")
async def served(nats_server: EmbeddedServer) -> AsyncIterator[Served]:
    async with served_policy(nats_server.url, PART) as s:
        yield s


@pytest.fixture(scope="module")
async def gateway(served: Served, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ChatGateway]:
    keys = tmp_path_factory.mktemp("keys") / "gateway_keys.json"
    write_keys(
        keys,
        {
            TENANT_KEY: {"tenant": "acme", "max_in_flight": None},
            USER_KEY: {"tenant": "default", "user": "alice", "max_in_flight": 4, "rpm": 600},
            SLOW_KEY: {"tenant": "default", "user": "bob", "max_in_flight": None, "rpm": 1},
            STRAY_KEY: {"tenant": "globex", "user": "carol", "max_in_flight": None},
        },
    )
    settings = GatewaySettings(port=0, max_tokens=6, timeout_s=60, keys=str(keys))
    gw = ChatGateway(served.bus, served.run_id, settings)
    await gw.start()
    try:
        yield gw
    finally:
        await gw.stop()


def jetrl_of(obj: Any) -> dict[str, Any]:
    """The ``jetrl`` field the gateway adds to OpenAI's objects (extra to the client's models)."""
    assert obj.model_extra is not None
    out: dict[str, Any] = obj.model_extra["jetrl"]
    return out


def client(gw: ChatGateway, key: str = USER_KEY) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.url, api_key=key, max_retries=0)


async def log_completion(served: Served, generation_id: str) -> list[int]:
    """The tokens a worker sampled for ``generation_id``, read from the log."""
    payloads = await Payloads.for_run(served.bus.js, served.run_id)
    for item in await served.bus.read_log(
        served.run_id, filter_subject=subjects.generation_subject(served.run_id)
    ):
        g = item.event.body if item.event else None
        if not isinstance(g, ev.CompletionsGenerated):
            continue
        for smp in g.samples:
            if smp.generation_id == generation_id:
                return list((await payloads.get_array(smp.completion_tokens)).astype(np.int64).tolist())
    raise AssertionError(f"no generation {generation_id} in the log")


async def test_a_stream_carries_the_sampled_completions_then_the_usage(
    gateway: ChatGateway, served: Served
) -> None:
    c = client(gateway)
    kw: dict[str, Any] = {"model": "jetrl", "messages": ASK, "max_tokens": 6}
    whole = await c.chat.completions.create(n=2, temperature=0, **kw)
    stream = await c.chat.completions.create(
        n=2, temperature=0, stream=True, stream_options={"include_usage": True}, **kw
    )
    chunks = [chunk async for chunk in stream]
    by_choice: dict[int, list[Any]] = {}
    for chunk in chunks[:-1]:
        assert chunk.object == "chat.completion.chunk" and chunk.usage is None and len(chunk.choices) == 1
        by_choice.setdefault(chunk.choices[0].index, []).append(chunk.choices[0])
    assert sorted(by_choice) == [0, 1]
    for index, parts in by_choice.items():
        assert parts[0].delta.role == "assistant"  # the role comes first
        assert all(p.finish_reason is None for p in parts[:-1]) and parts[-1].finish_reason in (
            "stop",
            "length",
        )
        text = "".join(p.delta.content or "" for p in parts)
        # Greedy, one policy version: the streamed text is the whole answer's, sample for sample.
        assert text == whole.choices[index].message.content
        # ... and the tokens the worker sampled for it, as the log keeps them.
        generation = jetrl_of(parts[-1])["generation_id"]
        assert text == gateway.tok.decode(await log_completion(served, generation))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert whole.usage is not None
    assert last.usage.prompt_tokens == len(gateway.tok.encode("3+4=")) == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens

    # Sampled (temperature 1), three samples: each streamed text is its generation's tokens.
    stream = await c.chat.completions.create(n=3, temperature=1.0, stream=True, **kw)
    texts: dict[int, str] = {}
    generations: dict[int, str] = {}
    async for chunk in stream:
        assert chunk.usage is None  # not asked for
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                generations[choice.index] = jetrl_of(choice)["generation_id"]
    assert sorted(texts) == sorted(generations) == [0, 1, 2]
    for i, text in texts.items():
        assert text == gateway.tok.decode(await log_completion(served, generations[i]))
    await c.close()


async def test_streamed_logprobs_are_one_per_sampled_token(gateway: ChatGateway, served: Served) -> None:
    c = client(gateway)
    stream = await c.chat.completions.create(
        model="jetrl", messages=ASK, max_tokens=6, logprobs=True, stream=True
    )
    entries, generation = [], ""
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                entries += choice.logprobs.content
            if choice.finish_reason:
                generation = jetrl_of(choice)["generation_id"]
    tokens = await log_completion(served, generation)
    assert len(entries) == len(tokens) >= 1 and all(e.logprob <= 0.0 for e in entries)
    await c.close()


async def test_keys_of_tenants_and_of_users(gateway: ChatGateway, served: Served) -> None:
    for key, tenant in ((TENANT_KEY, "acme"), (USER_KEY, "default")):
        c = client(gateway, key)
        out = await c.chat.completions.create(model="jetrl", messages=ASK, max_tokens=2)
        assert out.choices[0].message.role == "assistant"
        task_id = jetrl_of(out)["task_id"]
        assert task_id.startswith(f"gateway.{tenant}.")
        await c.close()
    log = await served.bus.read_log(served.run_id, filter_subject=subjects.task_subject(served.run_id))
    mine = [
        i
        for i in log
        if i.event and isinstance(i.event.body, ev.TaskSubmitted) and i.event.body.info.get("user") == "alice"
    ]
    assert mine and all(i.subject == f"jetrl.{served.run_id}.task.default.gateway" for i in mine)
    assert all(i.event and i.event.tenant == "default" for i in mine)

    for key in ("sk-wrong", TENANT_KEY + "x"):
        c = client(gateway, key)
        with pytest.raises(openai.AuthenticationError) as err:
            await c.chat.completions.create(model="jetrl", messages=ASK)
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
        assert err.value.body["type"] == "authentication_error"  # type: ignore[index]
        with pytest.raises(openai.AuthenticationError):
            await c.models.list()
        await c.close()
    c = client(gateway, USER_KEY)
    assert [m.id for m in (await c.models.list()).data] == ["jetrl"]
    assert (await c.models.retrieve("jetrl")).id == "jetrl"
    with pytest.raises(openai.NotFoundError):
        await c.models.retrieve("gpt-4")
    await c.close()

    # A user put on a tenant the run does not have: the workers refuse it, and so the gateway (403).
    c = client(gateway, STRAY_KEY)
    with pytest.raises(openai.PermissionDeniedError) as denied:
        await c.chat.completions.create(model="jetrl", messages=ASK)
    assert denied.value.code == "tenant_not_in_run"
    await c.close()


async def test_a_key_past_its_rate_limit_gets_429_with_retry_after(gateway: ChatGateway) -> None:
    c = client(gateway, SLOW_KEY)  # one request a minute, no retries by the client
    out = await c.chat.completions.create(model="jetrl", messages=ASK, max_tokens=2)
    assert out.choices
    with pytest.raises(openai.RateLimitError) as err:  # the bucket refills one request a minute
        await c.chat.completions.create(model="jetrl", messages=ASK, max_tokens=2)
    assert err.value.code == "rate_limit_exceeded"
    assert 1 <= int(err.value.response.headers["retry-after"]) <= 60
    assert "user 'bob'" in err.value.message and "1 requests a minute" in err.value.message
    # Another key is not held back by bob's limit.
    other = client(gateway, USER_KEY)
    assert (await other.chat.completions.create(model="jetrl", messages=ASK, max_tokens=2)).choices
    await asyncio.gather(c.close(), other.close())


async def test_refusals_are_openai_errors(gateway: ChatGateway) -> None:
    c = client(gateway)
    for bad, param in (
        ({"n": 0}, "n"),
        ({"n": True}, "n"),
        ({"max_tokens": 7}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "1"}]}, "messages"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ):
        kw: dict[str, Any] = {"model": "jetrl", "messages": ASK, **bad}
        with pytest.raises(openai.BadRequestError) as err:
            await c.chat.completions.create(**kw)
        assert err.value.status_code == 400 and err.value.param == param, bad
        assert err.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:  # past the model's context: the workers refuse it
        await c.chat.completions.create(model="jetrl", messages=[{"role": "user", "content": "1+1=" * 80}])
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as missing:
        await c.chat.completions.create(model="gpt-4o", messages=ASK)
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    await c.close()

    # What the client cannot send: not JSON, unknown routes, a wrong method, too large a body.
    headers = {"Authorization": f"Bearer {USER_KEY}"}
    url = f"{gateway.url}/chat/completions"
    async with aiohttp.ClientSession(headers=headers) as http:
        cases = [
            ("POST", url, b"{not json", 400, None),
            ("POST", url, b"[" * 100_000, 400, None),  # past the JSON parser's depth
            ("POST", url, b"\xff\xfe\x00", 400, None),
            ("POST", f"{gateway.url}/completions", b"{}", 404, "unknown_url"),
            ("GET", url, b"", 405, "method_not_allowed"),
            ("POST", url, b" " * (gateway.s.max_body_bytes + 1), 413, "request_too_large"),
        ]
        for method, where, data, status, code in cases:
            async with http.request(method, where, data=data) as r:
                assert r.status == status, (where, data[:20])
                err = (await r.json())["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
                assert isinstance(err["message"], str) and err["message"]


async def test_a_client_gone_mid_stream_leaves_nothing_behind(gateway: ChatGateway) -> None:
    before = gateway.tasks.copy()
    headers = {"Authorization": f"Bearer {USER_KEY}"}
    body = {"messages": ASK, "max_tokens": 6, "n": 4, "stream": True}
    async with aiohttp.ClientSession(headers=headers) as http:
        r = await http.post(f"{gateway.url}/chat/completions", json=body)
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        assert (await r.content.readline()).startswith(b"data: {")
        r.close()  # gone after the first chunk
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (gateway.pending or any(gateway.in_flight.values())):
        await asyncio.sleep(0.05)
    assert not gateway.pending and not any(gateway.in_flight.values())
    ended = gateway.tasks - before
    assert ended["published"] == 1 and ended["answered"] + ended["abandoned"] == 1
    c = client(gateway)  # and the gateway serves on
    assert (await c.chat.completions.create(model="jetrl", messages=ASK, max_tokens=2)).choices
    await c.close()


async def test_a_request_nobody_answers_times_out_and_a_client_that_leaves_is_released(
    nats_server: EmbeddedServer,
) -> None:
    async with served_policy(nats_server.url, worker=False) as idle:
        gw = ChatGateway(idle.bus, idle.run_id, GatewaySettings(port=0, max_tokens=4, timeout_s=1))
        await gw.start()
        try:
            c = AsyncOpenAI(base_url=gw.url, api_key="unused", max_retries=0)
            for stream in (False, True):  # a stream that has sent nothing yet is still an HTTP error
                with pytest.raises(openai.InternalServerError) as err:
                    await c.chat.completions.create(model="jetrl", messages=ASK, stream=stream)
                assert err.value.status_code == 504 and err.value.code == "timeout"
            await c.close()
            assert gw.tasks["timed_out"] == 2

            # A client that goes away while it waits: its request is released at once.
            gw.s.timeout_s = 600
            async with aiohttp.ClientSession() as http:
                task = asyncio.create_task(
                    http.post(f"{gw.url}/chat/completions", json={"messages": ASK, "stream": True})
                )
                deadline = time.monotonic() + 30
                while not gw.pending and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert gw.pending
                task.cancel()
            deadline = time.monotonic() + 30
            while gw.pending and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert not gw.pending and gw.tasks["abandoned"] == 1 and not any(gw.in_flight.values())
        finally:
            await gw.stop()


async def test_a_bus_that_is_gone_is_a_503_and_leaves_nothing_behind(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "nats").start()  # a server of its own, to stop
    async with served_policy(server.url, worker=False) as s:
        gw = ChatGateway(s.bus, s.run_id, GatewaySettings(port=0, max_tokens=4, timeout_s=2))
        await gw.start()
        try:
            server.stop()
            c = AsyncOpenAI(base_url=gw.url, api_key="unused", max_retries=0)
            with pytest.raises(openai.InternalServerError) as err:
                await c.chat.completions.create(model="jetrl", messages=ASK)
            assert err.value.status_code == 503 and err.value.code == "bus_unavailable"
            await c.close()
            assert not gw.pending and not any(gw.in_flight.values()) and not gw.tasks["published"]
        finally:
            await gw.stop()
