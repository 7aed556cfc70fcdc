"""Property-based fuzzing of the gateway: its HTTP handler, and its edge on the bus.

* HTTP: hypothesis throws arbitrary JSON bodies (and bytes that are not JSON), near-valid chat
  requests with any field replaced by anything, arbitrary headers, API keys and routes at a
  gateway serving a real inference worker (tests/support/served_policy.py), one to three
  requests at once. Every answer must be a valid answer (a ``chat.completion``, a well-formed
  stream of ``chat.completion.chunk`` events ending in ``[DONE]``, a model list) or an OpenAI
  error object, never a 500, and once it is in, the gateway holds nothing for it. Every task the
  gateway published must end answered, timed out or refused by the workers; at the end the log
  is checked against that: each task published is in it, each answered one has its completions.
* The bus: answers that do not belong to a request (another tenant's envelope or subject, a dead
  letter for another message, samples past the group or none, garbage) are thrown at a pending
  request before its real refusal; the request must end with that refusal and nothing else.

Examples are derandomized, the example database is off; each test prints how many inputs it
tried (and ``--hypothesis-show-statistics`` hypothesis' own figures).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import secrets
import string
import threading
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from jetrl.bus import events as ev
from jetrl.bus import ids, subjects
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.settings import EnvRoute, TenantSettings
from jetrl.consumers.inference.settings import InferencePart
from jetrl.policy.tokenizer import CharTokenizer
from jetrl.producers.gateway import ChatGateway, GatewaySettings, parse_keys
from jetrl.producers.gateway_api import ROLES
from tests.support.catalog_samples import forged_generation
from tests.support.served_policy import Served, served_policy, write_keys

pytestmark = pytest.mark.slow

T = TypeVar("T")
TOK = CharTokenizer()
KEYS = {
    "acme": f"sk-acme-{secrets.token_hex(8)}",  # a tenant's key
    "alice": f"sk-alice-{secrets.token_hex(8)}",  # a user on the gateway's tenant, 2 in flight
    "bob": f"sk-bob-{secrets.token_hex(8)}",  # a user with one request a minute
    "carol": f"sk-carol-{secrets.token_hex(8)}",  # a user on a tenant the run does not have
}
GRANTS: dict[str, dict[str, object]] = {
    KEYS["acme"]: {"tenant": "acme", "max_in_flight": None},
    KEYS["alice"]: {"tenant": "default", "user": "alice", "max_in_flight": 2, "rpm": 100_000},
    KEYS["bob"]: {"tenant": "default", "user": "bob", "max_in_flight": None, "rpm": 1},
    KEYS["carol"]: {"tenant": "globex", "user": "carol", "max_in_flight": None},
}
PART = InferencePart(
    tenants=[TenantSettings(name="acme")], envs=[EnvRoute(tenant="acme", env="modsum", group_size=2)]
)
MAX_TOKENS = 4


def fuzz_settings(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: each example is a round trip
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


class LoopThread:
    """The served run and the gateway on an event loop of their own, alive across examples."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


# ----------------------------------------------------------------------------- inputs

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(["jetrl", "user", "assistant", "3+4=", ""]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
prompt_text = (
    st.text(alphabet=TOK.alphabet, max_size=12)
    | st.text(max_size=12)  # characters the tokenizer does not have
    | st.text(alphabet="0123456789+=", min_size=250, max_size=400)  # past the model's context
)
content = (
    prompt_text
    | st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url"]) | json_values, "text": prompt_text}
        ),
        max_size=3,
    )
    | json_values
)
message = (
    st.fixed_dictionaries({"role": st.sampled_from(ROLES) | json_values, "content": content}) | json_values
)


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of the strategies, each as often as its weight says."""
    return st.sampled_from([s for w, s in choices for _ in range(w)]).flatmap(lambda s: s)


def field_or_anything(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a value of the field's kind (not always a valid one), sometimes anything."""
    return weighted((5, good), (1, json_values))


# A message the model's tokenizer can write: the requests that reach the workers.
plain_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant"]),
        "content": weighted(
            (8, st.text(alphabet=TOK.alphabet, max_size=12)),
            (1, st.text(alphabet="0123456789+=", min_size=250, max_size=300)),  # past the context
        ),
    }
)


request_body = st.fixed_dictionaries(
    {
        "messages": weighted(
            (4, st.lists(plain_message, min_size=1, max_size=3)),
            (1, st.lists(message, max_size=3)),
            (1, json_values),
        )
    },
    optional={
        "model": field_or_anything(weighted((4, st.just("jetrl")), (1, st.text(max_size=8)))),
        "n": field_or_anything(st.integers(0, 4)),
        "max_tokens": field_or_anything(st.integers(0, MAX_TOKENS + 1)),
        "max_completion_tokens": field_or_anything(st.integers(0, MAX_TOKENS + 1)),
        "temperature": field_or_anything(
            st.sampled_from([0, 0.7, 1, 2, 2.5, -1]) | st.floats(0, 2) | st.floats()
        ),
        "stream": field_or_anything(weighted((2, st.just(True)), (1, st.just(False)))),
        "stream_options": field_or_anything(
            st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})
        ),
        "logprobs": field_or_anything(st.booleans()),
        "stop": json_values,
        "tools": json_values,
        "user": json_values,
    },
)


# A request the gateway takes, streamed or not: the answers (whole and streamed) get checked.
good_body = st.fixed_dictionaries(
    {"messages": st.lists(plain_message, min_size=1, max_size=2), "stream": st.booleans()},
    optional={
        "model": st.just("jetrl"),
        "n": st.integers(1, 3),
        "max_tokens": st.integers(1, MAX_TOKENS),
        "temperature": st.floats(0, 2),
        "logprobs": st.booleans(),
    },
).flatmap(
    lambda b: (
        st.just(b)
        if not b["stream"]
        else st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}).map(
            lambda o: {**b, "stream_options": o}
        )
    )
)


def encode(value: Any) -> bytes:
    return json.dumps(value).encode()  # NaN and Infinity as Python writes them


body_bytes = weighted(
    (6, request_body.map(encode)),
    (3, request_body.map(lambda b: encode({**b, "stream": True}))),
    (4, good_body.map(encode)),
    (1, request_body.map(lambda b: json.dumps(b).encode("utf-16"))),
    (1, json_values.map(encode)),
    (1, st.tuples(request_body.map(encode), st.floats(0, 1)).map(lambda t: t[0][: int(len(t[0]) * t[1])])),
    (1, st.binary(max_size=64)),
)
header_text = st.text(
    alphabet=string.printable.replace("\r", "").replace("\n", "").replace("\x0b", "").replace("\x0c", ""),
    max_size=40,
)
authorization = weighted(
    (8, st.just(f"Bearer {KEYS['alice']}")),
    (3, st.sampled_from([f"Bearer {k}" for k in KEYS.values()])),
    (1, st.sampled_from([f"bearer  {KEYS['acme']}", f"Basic {KEYS['alice']}", "Bearer", "Bearer ", ""])),
    (1, header_text),
    (1, header_text.map(lambda t: f"Bearer {t}")),
)
header_name = st.text(alphabet=string.ascii_letters + string.digits + "-_", min_size=1, max_size=16).filter(
    lambda h: h.lower() not in ("content-length", "transfer-encoding", "host", "authorization", "connection")
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "Content-Type": st.sampled_from(
            [
                "application/json",
                "text/plain",
                "application/json; charset=latin-1",
                "application/json; charset=nope",
            ]
        )
        | header_text,
        # Bodies are encoded as the header says: one that does not decode (or br and zstd,
        # without their libraries) is refused by aiohttp's HTTP parser as plain text, often
        # before the request reaches the gateway's handler, so not the handler's to answer.
        "Content-Encoding": st.sampled_from(["gzip", "deflate", "identity", "x-nope"]),
        "Accept": st.sampled_from(["text/event-stream", "*/*"]) | header_text,
    },
).flatmap(
    lambda h: st.tuples(
        weighted((12, authorization.map(lambda a: {"Authorization": a})), (1, st.just({}))),
        st.dictionaries(header_name, header_text, max_size=3),
    ).map(lambda t: {**t[1], **h, **t[0]})
)
route = weighted(
    (14, st.just(("POST", "/v1/chat/completions"))),
    (2, st.sampled_from([("GET", "/v1/models"), ("GET", "/v1/models/jetrl"), ("GET", "/health")])),
    (
        2,
        st.tuples(
            st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
            st.sampled_from(["/v1/chat/completions", "/v1/models/", "/v1/", "/", "/v1/chat/completions/x"])
            | st.text(alphabet=string.ascii_letters + string.digits + "/-_.~", max_size=20).map(
                lambda p: "/" + p
            ),
        ),
    ),
)
http_request = st.tuples(route, headers, body_bytes)


# ----------------------------------------------------------------------------- checks


def check_error(status: int, obj: Any, where: str) -> str:
    assert isinstance(obj, dict) and set(obj) == {"error"}, where
    err = obj["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, where
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), where
    assert err["param"] is None or isinstance(err["param"], str), where
    assert err["code"] is None or isinstance(err["code"], str), where
    return f"{status} {err['code'] or err['type']}"


def check_completion(obj: Any, where: str) -> tuple[str, int]:
    assert obj["object"] == "chat.completion", where
    n = len(obj["choices"])
    assert n >= 1 and [c["index"] for c in obj["choices"]] == list(range(n)), where
    for c in obj["choices"]:
        assert c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str), where
        assert c["finish_reason"] in ("stop", "length"), where
    u = obj["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], where
    return obj["jetrl"]["task_id"], n


def check_stream(raw: bytes, where: str) -> tuple[str, int] | None:
    """A well-formed stream; its task and group size, or None for one that ended in an error."""
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events and all(e.startswith("data: ") for e in events), where
    datas = [e[len("data: ") :] for e in events]
    if datas[-1] != "[DONE]":
        check_error(200, json.loads(datas[-1]), where)  # a failure after the first sample
        return None
    chunks = [json.loads(d) for d in datas[:-1]]
    assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks), where
    finished: dict[int, str] = {}
    roles: set[int] = set()
    task = ""
    for c in chunks:
        for choice in c["choices"]:
            i = choice["index"]
            if choice["delta"].get("role"):
                assert i not in roles and i not in finished, where
                roles.add(i)
            assert i in roles, where  # the role comes first
            if choice["finish_reason"]:
                assert i not in finished, where
                finished[i] = choice["finish_reason"]
                task = choice["jetrl"]["task_id"]
    n = len(finished)
    assert sorted(finished) == list(range(n)) and roles == set(finished), where
    if chunks[-1]["choices"] == []:  # the usage chunk, asked for
        u = chunks[-1]["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], where
    return task, n


class HttpFuzz:
    def __init__(self, gw: ChatGateway, served: Served) -> None:
        self.gw, self.served = gw, served
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90))
        self.outcomes: Counter[str] = Counter()
        self.answered: dict[str, int] = {}  # task id -> samples, from the answers themselves
        self.examples = self.requests = 0

    async def one(self, req: tuple[tuple[str, str], dict[str, str], bytes]) -> None:
        (method, path), hdrs, data = req
        encoding = hdrs.get("Content-Encoding")
        data = (
            gzip.compress(data)
            if encoding == "gzip"
            else zlib.compress(data)
            if encoding == "deflate"
            else data
        )
        where = f"{method} {path} {hdrs} {data[:300]!r}"
        url = f"http://{self.gw.s.host}:{self.gw.port}{path}"
        async with self.http.request(method, url, headers=hdrs, data=data) as r:
            raw = await r.read()
            status, ctype = r.status, r.headers.get("Content-Type", "")
        self.requests += 1
        assert status != 500 and status < 600, f"{status} {raw[:500]!r} for {where}"
        if method == "HEAD":
            return
        if ctype.startswith("text/event-stream"):
            assert status == 200, where
            got = check_stream(raw, where)
            self.outcomes["200 stream" if got else "200 stream error"] += 1
            if got:
                self.answered[got[0]] = got[1]
            return
        assert ctype.startswith("application/json"), f"{status} {ctype} {raw[:300]!r} for {where}"
        obj = json.loads(raw)
        if status != 200:
            self.outcomes[check_error(status, obj, where)] += 1
        elif path == "/v1/chat/completions":
            task, n = check_completion(obj, where)
            self.answered[task] = n
            self.outcomes["200 completion"] += 1
        else:
            assert isinstance(obj, dict), where
            self.outcomes[f"200 {path}"] += 1

    async def case(self, reqs: list[tuple[tuple[str, str], dict[str, str], bytes]]) -> None:
        self.examples += 1
        await asyncio.gather(*(self.one(r) for r in reqs))
        gw = self.gw
        deadline = time.monotonic() + 30  # handlers finish just after their last byte is sent
        while (gw.pending or any(gw.in_flight.values())) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not gw.pending and not any(gw.in_flight.values()), "the gateway holds a request it answered"
        ended = sum(v for k, v in gw.tasks.items() if k != "published")
        assert gw.tasks["published"] == ended, f"a task with no end: {gw.tasks}"


def test_fuzz_the_gateways_http_handler(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    lt = LoopThread()
    keys = tmp_path / "gateway_keys.json"
    write_keys(keys, GRANTS)

    async def setup() -> tuple[Any, HttpFuzz]:
        ctx = served_policy(nats_server.url, PART)
        served = await ctx.__aenter__()
        gw = ChatGateway(
            served.bus,
            served.run_id,
            GatewaySettings(port=0, max_tokens=MAX_TOKENS, timeout_s=30, keys=str(keys)),
        )
        await gw.start()
        return ctx, HttpFuzz(gw, served)

    ctx, fz = lt.run(setup())
    try:

        @fuzz_settings(200)
        @given(st.lists(http_request, min_size=1, max_size=3))
        def check(reqs: list[tuple[tuple[str, str], dict[str, str], bytes]]) -> None:
            lt.run(fz.case(reqs))

        check()

        async def against_the_log() -> None:
            served, gw = fz.served, fz.gw
            log = await served.bus.read_log(served.run_id)
            tasks = {
                i.event.body.task_id
                for i in log
                if i.event and isinstance(i.event.body, ev.TaskSubmitted) and i.event.body.env == "gateway"
            }
            gens: Counter[str] = Counter()  # samples generated, by task
            for i in log:
                g = i.event.body if i.event else None
                if isinstance(g, ev.CompletionsGenerated) and g.env == "gateway":
                    assert gens[g.task_id] == 0, f"task {g.task_id}: a second generation in the log"
                    assert sorted(s.sample_index for s in g.samples) == list(range(len(g.samples)))
                    gens[g.task_id] += len(g.samples)
            assert len(tasks) == gw.tasks["published"]
            assert set(fz.answered) <= tasks
            for task, n in fz.answered.items():
                assert gens[task] == n, f"task {task}: {gens[task]} completions in the log, {n} answered"

        lt.run(against_the_log())
    finally:
        print()
        print(
            f"fuzz gateway http: {fz.examples} examples, {fz.requests} requests; outcomes "
            f"{dict(sorted(fz.outcomes.items()))}; tasks {dict(fz.gw.tasks)}"
        )

        async def teardown() -> None:
            await fz.http.close()
            await fz.gw.stop()
            await ctx.__aexit__(None, None, None)

        lt.run(teardown())
        lt.close()


# ----------------------------------------------------------------------------- the bus edge

GLOBEX_KEY = f"sk-globex-{secrets.token_hex(8)}"
FORGERIES = (
    "dl_envelope_of_another_tenant",  # acme's dead letter under its own tenant for globex's task
    "dl_subject_of_another_tenant",  # on acme's dead-letter subject, the envelope saying globex
    "dl_other_message",  # globex's, for another stream sequence
    "dl_not_derived",  # globex's, with an id no consumer derives
    "dl_other_subject",  # globex's, naming another original subject
    "gen_envelope_of_another_tenant",
    "gen_subject_of_another_tenant",
    "gen_index_past_group",
    "gen_indexes_past_group",
    "gen_no_samples",
    "gen_other_task",
    "garbage",
)


class EdgeFuzz:
    def __init__(self, gw: ChatGateway, served: Served) -> None:
        self.gw, self.served = gw, served
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        self.counts: Counter[str] = Counter()
        self.examples = 0

    def dead_letter(self, tenant: str, task_id: str, seq: int, reason: str, **over: Any) -> ev.Event:
        run = self.served.run_id
        body = ev.DeadLettered(
            reason=reason,
            detail=f"task {task_id}: refused",
            consumer="inference",
            original_subject=over.pop("original_subject", subjects.task_subject(run, "globex", "gateway")),
            original_stream_seq=seq,
            original_event_id=ids.task_event_id(run, task_id),
            original_type="TaskSubmitted",
        )
        event_id = over.pop("event_id", ids.dead_letter_id(run, "inference", seq))
        return ev.new_event(body, run_id=run, tenant=tenant, event_id=event_id, **over)

    def generation(self, tenant: str, task_id: str, *indexes: int) -> ev.Event:
        tokens = np.asarray(TOK.encode("7", bos=False), np.int32)
        body = forged_generation(task_id, "gateway", tokens, indexes=indexes, worker_id="inf-forged")
        return ev.new_event(body, run_id=self.served.run_id, tenant=tenant)

    def forgery(self, kind: str, param: int, task_id: str, seq: int) -> tuple[str, bytes]:
        run = self.served.run_id
        dlq = subjects.dlq_subject
        if kind == "dl_envelope_of_another_tenant":
            e = self.dead_letter("acme", task_id, seq, "quota")
            return dlq(run, "acme", "quota"), ev.encode_event(e)
        if kind == "dl_subject_of_another_tenant":
            e = self.dead_letter("globex", task_id, seq, "quota")
            return dlq(run, "acme", "quota"), ev.encode_event(e)
        if kind == "dl_other_message":
            other = seq + (param % 50 + 1) * (1 if param % 2 else -1)
            return dlq(run, "globex", "quota"), ev.encode_event(
                self.dead_letter("globex", task_id, other, "quota")
            )
        if kind == "dl_not_derived":
            e = self.dead_letter("globex", task_id, seq, "quota", event_id=uuid.uuid4().hex)
            return dlq(run, "globex", "quota"), ev.encode_event(e)
        if kind == "dl_other_subject":
            e = self.dead_letter(
                "globex",
                task_id,
                seq,
                "quota",
                original_subject=subjects.task_subject(run, "acme", "gateway"),
            )
            return dlq(run, "globex", "quota"), ev.encode_event(e)
        gen = subjects.generation_subject
        if kind == "gen_envelope_of_another_tenant":
            return gen(run, "acme", "gateway"), ev.encode_event(self.generation("acme", task_id, 0))
        if kind == "gen_subject_of_another_tenant":
            return gen(run, "acme", "gateway"), ev.encode_event(self.generation("globex", task_id, 0))
        if kind == "gen_index_past_group":
            index = 1 + param if param % 2 else -1 - param
            return gen(run, "globex", "gateway"), ev.encode_event(self.generation("globex", task_id, index))
        if kind == "gen_indexes_past_group":  # several samples, repeated, none of the group's
            indexes = [1 + param % 3, -1 - param % 5, 1 + param % 3, 2**31 + param]
            return gen(run, "globex", "gateway"), ev.encode_event(
                self.generation("globex", task_id, *indexes)
            )
        if kind == "gen_no_samples":
            return gen(run, "globex", "gateway"), ev.encode_event(self.generation("globex", task_id))
        if kind == "gen_other_task":
            stranger = ids.task_id("gateway", "globex", uuid.uuid4().hex)
            return gen(run, "globex", "gateway"), ev.encode_event(self.generation("globex", stranger, 0))
        assert kind == "garbage"
        subject = [dlq(run, "globex", "quota"), gen(run, "globex", "gateway")][param % 2]
        return subject, secrets.token_bytes(param % 64)

    async def case(self, forgeries: list[tuple[str, int]]) -> None:
        self.examples += 1
        gw = self.gw
        url = f"{gw.url}/chat/completions"
        body = {"messages": [{"role": "user", "content": "3+4="}], "max_tokens": 2}
        ask = asyncio.create_task(
            self.http.post(url, json=body, headers={"Authorization": f"Bearer {GLOBEX_KEY}"})
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(p.seq for p in gw.pending.values()):
            await asyncio.sleep(0.005)
        [(task_id, pending)] = gw.pending.items()
        assert pending.seq is not None
        for kind, param in forgeries:
            subject, data = self.forgery(kind, param, task_id, pending.seq)
            await self.served.bus.js.publish(subject, data)
            self.counts[kind] += 1
        # The workers' refusal, as the inference consumer writes it: the only end it may have.
        real = self.dead_letter("globex", task_id, pending.seq, "bad_params")
        await self.served.bus.publish(real)
        r = await ask
        answer = await r.json()
        r.close()
        assert r.status == 400 and answer["error"]["code"] == "bad_params", (forgeries, answer)


def test_fuzz_answers_that_are_not_the_requests(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    lt = LoopThread()
    keys = tmp_path / "gateway_keys.json"
    write_keys(keys, {GLOBEX_KEY: {"tenant": "globex", "max_in_flight": None}})

    async def setup() -> tuple[Any, EdgeFuzz]:
        ctx = served_policy(nats_server.url, worker=False)  # nobody answers but the test
        served = await ctx.__aenter__()
        gw = ChatGateway(served.bus, served.run_id, GatewaySettings(port=0, timeout_s=20, keys=str(keys)))
        await gw.start()
        return ctx, EdgeFuzz(gw, served)

    ctx, fz = lt.run(setup())
    try:

        @fuzz_settings(150)
        @given(st.lists(st.tuples(st.sampled_from(FORGERIES), st.integers(0, 2**16)), min_size=1, max_size=6))
        def check(forgeries: list[tuple[str, int]]) -> None:
            lt.run(fz.case(forgeries))

        check()
    finally:
        print()
        print(f"fuzz gateway bus edge: {fz.examples} examples, forgeries {dict(sorted(fz.counts.items()))}")

        async def teardown() -> None:
            await fz.http.close()
            await fz.gw.stop()
            await ctx.__aexit__(None, None, None)

        lt.run(teardown())
        lt.close()


# ----------------------------------------------------------------------------- the keys file

grant_values = st.fixed_dictionaries(
    {
        "tenant": weighted(
            (4, st.sampled_from(["acme", "default"])),
            (1, st.sampled_from(["trainer", "a.b", ""])),
            (1, json_values),
        )
    },
    optional={
        "user": weighted((3, st.just("alice")), (1, st.just("x y")), (1, json_values)),
        "max_in_flight": weighted(
            (3, st.none() | st.integers(1, 3)), (1, st.integers(-1, 0)), (1, json_values)
        ),
        "rpm": weighted((3, st.none() | st.integers(1, 3)), (1, st.integers(-1, 0)), (1, json_values)),
    },
)
digests = weighted(
    (4, st.sampled_from(["0" * 64, "a" * 64])), (1, st.sampled_from(["A" * 64, "abc"]) | st.text(max_size=64))
)
keys_files = weighted(
    (
        4,
        st.fixed_dictionaries(
            {"keys": st.dictionaries(digests, weighted((5, grant_values), (1, json_values)), max_size=3)}
        ),
    ),
    (1, json_values),
)


def test_fuzz_the_keys_file() -> None:
    """Whatever the file holds, the gateway reads grants or refuses the file (ValueError,
    which keeps the keys in force): never another exception, never a hash in the error."""
    seen: Counter[str] = Counter()

    @settings(max_examples=500, deadline=None, derandomize=True, database=None)
    @given(keys_files)
    def check(data: Any) -> None:
        try:
            grants = parse_keys(data)
        except ValueError as e:
            assert "0" * 64 not in str(e) and "a" * 64 not in str(e)
            seen["refused"] += 1
            return
        seen["read"] += 1
        for digest, g in grants.items():
            assert len(digest) == 64 and subjects.is_token(g.tenant) and g.rpm in (None, 1, 2, 3)
            assert g.max_in_flight in (None, 1, 2, 3) and (g.user is None or subjects.is_token(g.user))

    check()
    print(f"\nfuzz gateway keys file: {sum(seen.values())} inputs, {dict(seen)}")
    assert seen["read"] and seen["refused"]
