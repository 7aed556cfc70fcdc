"""An OpenAI-compatible chat-completions endpoint on a run's bus: the run's current policy,
served to anything that speaks the OpenAI API (a verifiers harness or eval, an agent, curl, the
``openai`` client).

A request is one TaskSubmitted (``n`` samples as its group, on the gateway's own env subject,
so no producer scores it and the trainer never sees it) that the run's inference workers take
like any other; the answer is built from the CompletionsGenerated event that comes back. Nothing
calls a worker directly: the gateway is one more producer of tasks, and the log keeps every
request and answer (the recorder projects them like the rest). A task the workers refuse (its
dead letter: a prompt past the context, a tenant the run does not have, a tenant over its
quota) is answered with that refusal at once rather than by a timeout.

Routes: ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /v1/models/{model}``,
``GET /health``. Every refusal, unknown routes and bodies that are not JSON included, is an
OpenAI error object ``{"error": {"message", "type", "param", "code"}}``: 400
``invalid_request_error``, 401 ``invalid_api_key``, 404 ``model_not_found`` / ``unknown_url``, 429
``rate_limit_exceeded`` (with ``Retry-After``), 504 when no worker answers within ``timeout_s``,
500 only for a bug (logged with its traceback).

``stream: true`` answers with server-sent events of ``chat.completion.chunk`` objects. The
workers publish a task's samples whole (one CompletionsGenerated), so the stream's granularity
is one sample, not one token: each of the ``n`` samples' choice gets a chunk with the role, one
with its whole text (and logprobs when asked), and one with its ``finish_reason``; then, with
``stream_options.include_usage``, a chunk with empty ``choices`` and the ``usage``; then
``data: [DONE]``. A client that goes away mid-stream cancels nothing in the run (the task is
generated anyway, and kept in the log) and leaves nothing behind in the gateway.

API keys (gateway_keys.py): with a keys file every request but ``/health`` needs
``Authorization: Bearer <key>``. A tenant's key runs its requests under that tenant; a user's key
under the tenant the operator chose for that user. Each key may limit requests in flight and
requests per minute; the file holds only SHA-256 hashes and is read again when it changes. Keys
are never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web
from pydantic import BaseModel, Field

from jetrl.bus import events as ev
from jetrl.bus import ids, subjects
from jetrl.bus.client import Bus
from jetrl.bus.log import get_logger
from jetrl.bus.payloads import ObjectStorePayloads, Payloads
from jetrl.policy.tokenizer import Tokenizer, make_tokenizer
from jetrl.producers.gateway_api import (
    DONE,
    ApiError,
    ChatRequest,
    ChunkWriter,
    RequestError,
    chat_messages,
    finish_reason,
    http_error,
    logprobs_content,
    parse_request,
    render,
    sse,
    usage,
)
from jetrl.producers.gateway_keys import ApiKeys, KeyGrant, RateLimits, key_hash, parse_keys, retry_after

__all__ = [
    "ApiError",
    "ApiKeys",
    "ChatGateway",
    "GatewaySettings",
    "KeyGrant",
    "RequestError",
    "chat_messages",
    "key_hash",
    "parse_keys",
    "render",
]


class GatewaySettings(BaseModel):
    env: str = "gateway"  # the env token of the gateway's subjects
    tenant: str = "default"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)  # 0: any free port
    max_tokens: int = Field(16, ge=1)  # the default, and the most a request may ask for
    max_n: int = Field(64, ge=1)
    timeout_s: float = Field(120.0, gt=0)  # how long a request waits for the workers
    model: str = "jetrl"  # the model name the endpoint answers to
    # The API keys file (gateway_keys.py); None: no keys, every request is the tenant above's.
    keys: str | None = None
    # Without keys: the most requests in flight at once, and per minute (None: no limit).
    max_in_flight: int | None = Field(None, ge=1)
    rpm: int | None = Field(None, ge=1)
    max_body_bytes: int = Field(1024**2, ge=1024)  # past it: 413


class _Stopping:
    """Put in a pending request's queue when the gateway stops."""


@dataclass(frozen=True)
class _Sample:
    """One sample of a gateway task's CompletionsGenerated, as the answer uses it."""

    completion: ev.Completion
    policy_version_end: int

    @property
    def sample_index(self) -> int:
        return self.completion.sample_index

    @property
    def generation_id(self) -> str:
        return self.completion.generation_id


Arrival = _Sample | ev.DeadLettered | _Stopping


@dataclass
class _Pending:
    n: int
    tenant: str
    subject: str
    arrived: asyncio.Queue[Arrival] = field(default_factory=asyncio.Queue)
    seq: int | None = None  # the task's position in the log, once published
    seen: set[int] = field(default_factory=set)  # sample indices arrived
    early: list[tuple[ev.Event, ev.DeadLettered]] = field(default_factory=list)


# What a worker's refusal of a gateway task becomes for the caller (others: 400, the reason).
_REFUSALS: dict[str, tuple[int, str, str]] = {
    "too_long": (400, "invalid_request_error", "context_length_exceeded"),
    "quota": (429, "rate_limit_error", "rate_limit_exceeded"),
    "unknown_env": (403, "permission_error", "tenant_not_in_run"),
}


def refusal(dl: ev.DeadLettered) -> ApiError:
    status, kind, code = _REFUSALS.get(dl.reason, (400, "invalid_request_error", dl.reason))
    msg = f"the run's inference workers refused the request ({dl.reason}): {dl.detail}"[:1000]
    headers = {"Retry-After": "1"} if status == 429 else None
    return ApiError(status, msg, kind, code, "messages" if dl.reason == "too_long" else None, headers)


def _who(grant: KeyGrant) -> dict[str, str]:
    """A request's tenant and user, for a log line (never its key)."""
    return {"tenant": grant.tenant, **({"user": grant.user} if grant.user else {})}


class ChatGateway:
    def __init__(self, bus: Bus, run_id: str, settings: GatewaySettings, tokenizer: Tokenizer | None = None):
        self.bus = bus
        self.run_id = run_id
        self.s = settings
        subjects.check_token(settings.env, "env")
        subjects.check_token(settings.tenant, "tenant")
        self.tok = tokenizer or make_tokenizer()
        self.keys = ApiKeys(settings.keys) if settings.keys else None
        self.limits = RateLimits()
        self._grants_seen: object = None
        self.in_flight: dict[str, int] = {}  # per tenant (users: "user:<name>"), requests being answered
        self.pending: dict[str, _Pending] = {}  # by task id
        self._by_event: dict[str, str] = {}  # task event id -> task id
        self.payloads: Payloads | None = None
        self.requests = 0
        self.refused = 0
        # Tasks published, and how each ended: answered, timed out, refused by the workers, or
        # abandoned (the client went away, or the gateway stopped). No other end.
        self.tasks: Counter[str] = Counter()
        self._followers: list[asyncio.Task[None]] = []
        self._runner: web.AppRunner | None = None
        self.port = settings.port
        # With keys every request names its own tenant (logged with it), not the settings' one.
        scope = {} if self.keys else {"tenant": settings.tenant}
        self.log = get_logger(__name__, run_id=run_id, worker_id="gateway", **scope)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.payloads = Payloads(await ObjectStorePayloads.for_run(self.bus.js, self.run_id))
        # Answers to requests made from now on: follow the generations and dead letters from the head.
        head = await self.bus.last_seq(self.run_id)
        self._followers = [
            asyncio.create_task(self._follow_generations(head + 1)),
            asyncio.create_task(self._follow_dead_letters(head + 1)),
        ]
        app = web.Application(middlewares=[self._errors], client_max_size=self.s.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_get("/health", self._health)
        # A client that disconnects cancels its handler: its request is released at once.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=5)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.s.host, self.s.port).start()
        self.port = self._runner.addresses[0][1]  # the bound port (settings may say 0: any)
        self.log.info("gateway_started", url=self.url)

    @property
    def url(self) -> str:
        return f"http://{self.s.host}:{self.port}/v1"

    async def stop(self) -> None:
        for p in self.pending.values():  # requests waiting are answered (503) rather than cut
            p.arrived.put_nowait(_Stopping())
        if self._runner is not None:
            await self._runner.cleanup()
        for task in self._followers:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _tenant_filter(self) -> str:
        return "*" if self.keys else self.s.tenant  # with keys, answers come under every tenant

    async def _follow_generations(self, from_seq: int) -> None:
        subject = subjects.generation_subject(self.run_id, self._tenant_filter(), self.s.env)
        async for item in self.bus.tail(self.run_id, filter_subject=subject, from_seq=from_seq):
            e = item.event
            g = e.body if e else None
            if e is None or not isinstance(g, ev.CompletionsGenerated):
                continue
            p = self.pending.get(g.task_id)
            if (
                p is None  # another gateway's, or one released
                or e.tenant != p.tenant  # the envelope and the subject: both the asker's tenant
                or subjects.tenant_of(item.subject) != p.tenant
            ):
                continue
            for smp in g.samples:
                if not 0 <= smp.sample_index < p.n or smp.sample_index in p.seen:  # a repeat
                    continue
                p.seen.add(smp.sample_index)
                p.arrived.put_nowait(_Sample(smp, g.policy_version_end))

    async def _follow_dead_letters(self, from_seq: int) -> None:
        subject = subjects.dlq_subject(self.run_id, self._tenant_filter())
        async for item in self.bus.tail(self.run_id, filter_subject=subject, from_seq=from_seq):
            e = item.event
            dl = e.body if e else None
            if e is None or not isinstance(dl, ev.DeadLettered) or dl.original_event_id is None:
                continue
            p = self.pending.get(self._by_event.get(dl.original_event_id, ""))
            if p is None or subjects.tenant_of(item.subject) != p.tenant:
                continue  # not a pending task's, or not on the asker's dead-letter subjects
            if p.seq is None:  # read before the publish's ack came back
                p.early.append((e, dl))
            else:
                self._dead_letter(p, e, dl)

    def _dead_letter(self, p: _Pending, e: ev.Event, dl: ev.DeadLettered) -> None:
        """A worker's refusal of ``p``'s task: only the dead letter a consumer wrote for that
        very message of the log, under the asker's tenant (whose dead-letter subjects only that
        tenant and jetrl's parts may publish on: another tenant cannot end the request)."""
        if (
            dl.original_stream_seq == p.seq
            and dl.original_subject == p.subject
            and e.tenant == p.tenant
            and e.event_id == ids.dead_letter_id(self.run_id, dl.consumer, dl.original_stream_seq)
        ):
            p.arrived.put_nowait(dl)

    # ------------------------------------------------------------------ the request

    def _parse(self, body: Any) -> ChatRequest:
        return parse_request(
            body, self.tok, model=self.s.model, max_tokens=self.s.max_tokens, max_n=self.s.max_n
        )

    async def _submit(self, req: ChatRequest, grant: KeyGrant, deadline: float) -> tuple[str, _Pending]:
        """Publish the request's task; the caller releases it (:meth:`_release`)."""
        tenant = grant.tenant
        task_id = ids.task_id(self.s.env, tenant, uuid.uuid4().hex)
        event_id = ids.task_event_id(self.run_id, task_id)
        p = _Pending(req.n, tenant, subjects.task_subject(self.run_id, tenant, self.s.env))
        self.pending[task_id] = p
        self._by_event[event_id] = task_id
        info: dict[str, Any] = {"source": "gateway"}
        if grant.user:
            info["user"] = grant.user  # who asked, in the log (never the key)
        event = ev.new_event(
            ev.TaskSubmitted(
                task_id=task_id,
                env=self.s.env,
                group_size=req.n,
                prompt_tokens=req.tokens,
                prompt_text=req.text,
                max_tokens=req.max_tokens,
                info=info,
                temperature=req.temperature,
            ),
            run_id=self.run_id,
            tenant=tenant,
            event_id=event_id,
        )
        try:  # the bus retries a publish: bounded here by the request's own time
            left = max(0.1, deadline - asyncio.get_running_loop().time())
            ack = await asyncio.wait_for(self.bus.publish(event), left)
        except Exception as e:
            self._release(task_id)
            self.log.warning("gateway_publish_failed", **_who(grant), error=repr(e))
            raise ApiError(
                503, f"the run's bus did not take the request: {e!r}"[:300], "server_error", "bus_unavailable"
            ) from None
        except BaseException:  # cancelled (the client went away): nothing left behind either
            self._release(task_id)
            raise
        self.tasks["published"] += 1
        p.seq = ack.seq
        for early, dl in p.early:
            self._dead_letter(p, early, dl)
        p.early.clear()
        return task_id, p

    def _release(self, task_id: str) -> None:
        self.pending.pop(task_id, None)
        self._by_event.pop(ids.task_event_id(self.run_id, task_id), None)

    async def _arrivals(self, p: _Pending, deadline: float) -> AsyncGenerator[_Sample, None]:
        """The task's completions as they come, until all ``n``; a refusal or the deadline raises."""
        loop = asyncio.get_running_loop()
        for _ in range(p.n):
            try:
                got = await asyncio.wait_for(p.arrived.get(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                msg = f"no inference worker answered in {self.s.timeout_s:g}s"
                raise ApiError(504, msg, "server_error", "timeout") from None
            if isinstance(got, ev.DeadLettered):
                raise refusal(got)
            if isinstance(got, _Stopping):
                raise ApiError(503, "the gateway is stopping", "server_error", "unavailable")
            yield got

    async def _tokens(self, g: _Sample, want_logprobs: bool) -> tuple[list[int], list[float]]:
        assert self.payloads is not None
        c = g.completion
        toks = (await self.payloads.get_array(c.completion_tokens)).astype(np.int64).tolist()
        lps = (await self.payloads.get_array(c.logprobs)).astype(np.float64).tolist() if want_logprobs else []
        return toks, lps

    def _logprobs(self, toks: list[int], lps: list[float]) -> dict[str, Any]:
        pieces = [self.tok.decode([t], skip_special=False, stop_at_eos=False) for t in toks]
        return logprobs_content(pieces, lps)

    async def _serve(self, request: web.Request, req: ChatRequest, grant: KeyGrant) -> web.StreamResponse:
        """Publish, wait, answer; every published task ends counted under one outcome."""
        deadline = asyncio.get_running_loop().time() + self.s.timeout_s
        task_id, p = await self._submit(req, grant, deadline)
        outcome = "abandoned"
        try:
            if req.stream:
                resp, outcome = await self._stream(request, req, task_id, p, deadline)
                return resp
            async with contextlib.aclosing(self._arrivals(p, deadline)) as arrivals:
                gens = [g async for g in arrivals]
            answer = await self._response(task_id, req, gens)
            outcome = "answered"
            return web.json_response(answer)
        except ApiError as e:
            outcome = {504: "timed_out", 503: "abandoned"}.get(e.status, "refused_by_workers")
            raise
        finally:
            self._release(task_id)
            self.tasks[outcome] += 1

    async def _response(self, task_id: str, req: ChatRequest, gens: list[_Sample]) -> dict[str, Any]:
        gens = sorted(gens, key=lambda g: g.sample_index)
        choices, completion_tokens = [], 0
        for g in gens:
            toks, lps = await self._tokens(g, req.logprobs)
            completion_tokens += len(toks)
            choice: dict[str, Any] = {
                "index": g.sample_index,
                "message": {"role": "assistant", "content": self.tok.decode(toks)},
                "logprobs": self._logprobs(toks, lps) if req.logprobs else None,
                "finish_reason": finish_reason(g.completion.finish_reason),
            }
            choices.append(choice)
        return {
            "id": f"chatcmpl-{ids.task_number(task_id)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.s.model,
            "choices": choices,
            "usage": usage(len(req.tokens), completion_tokens),
            "jetrl": self._provenance(task_id, gens),
        }

    def _provenance(self, task_id: str, gens: list[_Sample]) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "task_id": task_id,
            "policy_version": max((g.policy_version_end for g in gens), default=None),
            "generation_ids": [g.generation_id for g in gens],
        }

    async def _stream(
        self, request: web.Request, req: ChatRequest, task_id: str, p: _Pending, deadline: float
    ) -> tuple[web.StreamResponse, str]:
        """The answer as server-sent events, one sample at a time. The response starts with the
        first sample: a refusal or a timeout before it is still an HTTP error; one after it is an
        ``{"error": ...}`` event (what OpenAI's clients raise on)."""
        w = ChunkWriter(f"chatcmpl-{ids.task_number(task_id)}", self.s.model, req.include_usage)
        resp: web.StreamResponse | None = None
        gens: list[_Sample] = []
        completion_tokens = 0
        try:
            async with contextlib.aclosing(self._arrivals(p, deadline)) as arrivals:
                async for g in arrivals:
                    toks, lps = await self._tokens(g, req.logprobs)
                    gens.append(g)
                    completion_tokens += len(toks)
                    if resp is None:
                        resp = web.StreamResponse(
                            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                        )
                        await resp.prepare(request)
                    i = g.sample_index
                    lp = self._logprobs(toks, lps) if req.logprobs else None
                    mine = {"task_id": task_id, "generation_id": g.generation_id}
                    await resp.write(
                        w.choice(i, {"role": "assistant", "content": ""})
                        + w.choice(i, {"content": self.tok.decode(toks)}, logprobs=lp)
                        + w.choice(
                            i,
                            {},
                            finish_reason(g.completion.finish_reason),
                            jetrl={**mine, "policy_version": g.policy_version_end},
                        )
                    )
            assert resp is not None  # n >= 1 completions came
            if req.include_usage:
                await resp.write(
                    w.usage_chunk(len(req.tokens), completion_tokens, jetrl=self._provenance(task_id, gens))
                )
            await resp.write(DONE)
            await resp.write_eof()
            return resp, "answered"
        except ApiError as e:
            if resp is None:
                raise
            outcome = {504: "timed_out", 503: "abandoned"}.get(e.status, "refused_by_workers")
            with contextlib.suppress(ConnectionResetError):
                await resp.write(sse(e.body()))
                await resp.write_eof()
            return resp, outcome
        except ConnectionResetError:  # the client went away between two samples
            self.log.info("gateway_client_gone", task_id=task_id, samples_sent=len(gens))
            return resp or web.Response(status=499), "abandoned"

    # ------------------------------------------------------------------ HTTP

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every refusal in OpenAI's error shape; a bug is a 500 in that shape, with its traceback logged."""
        try:
            return await handler(request)
        except ApiError as e:
            err = e
        except web.HTTPException as e:
            if e.status < 400:
                raise
            err = http_error(e, request.method, request.path)
        except Exception:
            self.log.exception("gateway_internal_error", method=request.method, path=request.path[:200])
            err = ApiError(500, "internal error of the gateway", "server_error", "internal_error")
        if err.status < 500:
            self.refused += 1
        return err.response()

    def _authenticate(self, request: web.Request) -> KeyGrant:
        """The request's tenant, user and limits: from its bearer key with a keys file, else the
        settings'. A refusal (401) is logged without the key."""
        if self.keys is None:
            return KeyGrant(self.s.tenant, self.s.max_in_flight, None, self.s.rpm, "*")
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        key = key.strip()
        grant = self.keys.lookup(key) if scheme.lower() == "bearer" and key else None
        if self.keys.grants is not self._grants_seen:  # the file was read again
            self._grants_seen = self.keys.grants
            self.limits.keep(set(self.keys.grants))
        if grant is not None:
            return grant
        why = "unknown API key" if key else "missing API key: send 'Authorization: Bearer <key>'"
        self.log.info("gateway_unauthorized", reason=why.split(":")[0])
        raise ApiError(
            401, why, "authentication_error", "invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )

    def _admit(self, grant: KeyGrant) -> None:
        """Admission at the edge: a clear refusal the caller can retry (429, ``Retry-After``),
        never a queue that stalls. In flight first, so a refused request costs no rate."""
        who = f"user {grant.user!r}" if grant.user else f"tenant {grant.tenant!r}"
        busy, limit = self.in_flight.get(grant.principal, 0), grant.max_in_flight
        if limit is not None and busy >= limit:
            self.log.info("gateway_quota_refused", **_who(grant), in_flight=busy, limit=limit)
            raise ApiError(
                429,
                f"{who} has {busy} requests in flight at the gateway, its limit is {limit}: "
                "retry when one has been answered",
                "rate_limit_error",
                "rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        wait = self.limits.take(grant.key_id, grant.rpm)
        if wait > 0:
            self.log.info("gateway_rate_limited", **_who(grant), rpm=grant.rpm)
            raise ApiError(
                429,
                f"{who} is past its rate limit of {grant.rpm} requests a minute: retry in {wait:.1f}s",
                "rate_limit_error",
                "rate_limit_exceeded",
                headers={"Retry-After": retry_after(wait)},
            )

    async def _body(self, request: web.Request) -> Any:
        try:
            raw = await request.read()  # past client_max_size: 413
        except web.RequestPayloadError as e:  # a body its Content-Encoding does not decode
            raise RequestError(f"the request body cannot be read: {e}"[:300], code="invalid_body") from None
        try:
            return json.loads(raw)  # UTF-8, -16 or -32, whatever the Content-Type says
        except (ValueError, RecursionError) as e:  # RecursionError: nested past the parser's depth
            raise RequestError(f"the request body is not valid JSON: {e}"[:300]) from None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        grant = self._authenticate(request)
        self._admit(grant)
        self.in_flight[grant.principal] = self.in_flight.get(grant.principal, 0) + 1
        try:
            req = self._parse(await self._body(request))
            return await self._serve(request, req, grant)
        except ApiError as e:
            if e.status < 500:
                self.log.info("gateway_request_refused", **_who(grant), reason=e.message)
            raise
        finally:
            self.in_flight[grant.principal] -= 1

    def _model_object(self) -> dict[str, Any]:
        return {"id": self.s.model, "object": "model", "created": 0, "owned_by": "jetrl"}

    async def _models(self, request: web.Request) -> web.Response:
        self._authenticate(request)
        return web.json_response({"object": "list", "data": [self._model_object()]})

    async def _model(self, request: web.Request) -> web.Response:
        self._authenticate(request)
        name = request.match_info["model"]
        if name != self.s.model:
            msg = f"the model {name[:100]!r} does not exist: this gateway serves {self.s.model!r}"
            raise ApiError(404, msg, "invalid_request_error", "model_not_found", "model")
        return web.json_response(self._model_object())

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "ok": True,
                "run_id": self.run_id,
                "requests": self.requests,
                "refused": self.refused,
                "tasks": dict(self.tasks),
                "pending": len(self.pending),
            }
        )
