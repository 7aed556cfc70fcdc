"""An OpenAI-compatible chat-completions endpoint on a run's bus: the run's current policy,
served to anything that speaks the OpenAI API (a verifiers harness or eval, an agent, curl).

A request is one TaskSubmitted (``n`` samples as its group, on the gateway's own env subject,
so no producer scores it and the trainer never sees it) that the run's inference workers take
like any other; the answer is built from the GenerationCompleted events that come back. Nothing
calls a worker directly: the gateway is one more producer of tasks, and the log keeps every
request and answer (the recorder projects them like the rest).

Routes: ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``. Bad requests get a
400 with the OpenAI error shape; a request that no worker answers in time gets a 504.

With an API keys file (``keys``; ``jetrl tenants add --api-key`` writes it) every request but
``/health`` needs ``Authorization: Bearer <key>`` (401 otherwise): the key names its tenant, whose
subject the request's TaskSubmitted goes on and whose limit on requests in flight at the gateway
it counts against (429 past it). The file holds only SHA-256 hashes of the keys and is read again
when it changes, so a key added or removed applies without a restart. Keys are never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import stat
import time
import uuid
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
from jetrl.bus.settings import RESERVED_TENANTS
from jetrl.policy.tokenizer import ChatMessage, Tokenizer, make_tokenizer


class GatewaySettings(BaseModel):
    env: str = "gateway"  # the env token of the gateway's subjects
    tenant: str = "default"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)  # 0: any free port
    max_tokens: int = Field(16, ge=1)  # the default, and the most a request may ask for
    max_n: int = Field(64, ge=1)
    timeout_s: float = Field(120.0, gt=0)  # how long a request waits for the workers
    model: str = "jetrl"  # the model name the endpoint answers to
    # The API keys file ({"keys": {sha256 hex: {"tenant", "max_in_flight"}}}); None: no keys,
    # every request is the tenant above's.
    keys: str | None = None
    # Without keys: the most requests of that tenant in flight at once (None: no limit).
    max_in_flight: int | None = Field(None, ge=1)


class RequestError(ValueError):
    """A request the gateway refuses (HTTP 400), with the reason for the caller."""


@dataclass(frozen=True)
class KeyGrant:
    """What one API key gives: its tenant and that tenant's limit on requests in flight."""

    tenant: str
    max_in_flight: int | None


def key_hash(key: str) -> str:
    """How a key is stored in the keys file: its SHA-256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def parse_keys(data: Any) -> dict[str, KeyGrant]:
    """The keys file's content, checked. Errors name the tenant, never a hash or a key."""
    keys = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(keys, dict):
        raise ValueError('the keys file must be a JSON object {"keys": {...}}')
    out: dict[str, KeyGrant] = {}
    for digest, grant in keys.items():
        if not isinstance(grant, dict) or not isinstance(grant.get("tenant"), str):
            raise ValueError("each key needs a 'tenant'")
        tenant = subjects.check_token(grant["tenant"], "tenant")
        if tenant in RESERVED_TENANTS:
            raise ValueError(f"tenant {tenant!r} is reserved for jetrl's own parts")
        limit = grant.get("max_in_flight")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"tenant {tenant!r}: max_in_flight must be a positive integer or null")
        if (
            not isinstance(digest, str)
            or len(digest) != 64
            or any(c not in "0123456789abcdef" for c in digest)
        ):
            raise ValueError(f"tenant {tenant!r}: a key must be stored as its SHA-256 in lowercase hex")
        out[digest] = KeyGrant(tenant, limit)
    return out


class ApiKeys:
    """The gateway's keys file, read again whenever its modification time, size or inode change
    (a writer that replaces it by rename, or one that rewrites it in place)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.log = get_logger(__name__, worker_id="gateway")
        self._stamp: tuple[int, int, int] | None = None
        self._grants: dict[str, KeyGrant] = {}
        self.refresh(strict=True)

    def refresh(self, *, strict: bool = False) -> None:
        """Reload if the file changed. A file that cannot be read or parsed raises at start
        (``strict``); later, the keys already loaded stay in force and the error is logged."""
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._stamp:
                return
            with open(self.path, "rb") as f:
                grants = parse_keys(json.loads(f.read()))
        except (OSError, ValueError) as e:
            if strict:
                raise ValueError(f"API keys file {self.path}: {e}") from None
            self.log.error("gateway_keys_unreadable", path=self.path, error=str(e))
            return
        if stat.S_IMODE(st.st_mode) & 0o077:
            self.log.warning(
                "gateway_keys_file_not_private", path=self.path, mode=oct(stat.S_IMODE(st.st_mode))
            )
        self._stamp, self._grants = stamp, grants
        self.log.info(
            "gateway_keys_loaded", path=self.path, tenants=sorted({g.tenant for g in grants.values()})
        )

    def lookup(self, key: str) -> KeyGrant | None:
        """The grant of ``key``, or None. Every stored hash is compared in constant time."""
        self.refresh()
        digest = key_hash(key)
        found = None
        for stored, grant in self._grants.items():
            if hmac.compare_digest(stored, digest):
                found = grant
        return found


@dataclass
class _Pending:
    n: int
    tenant: str
    done: asyncio.Future[list[ev.GenerationCompleted]]
    got: dict[int, ev.GenerationCompleted] = field(default_factory=dict)


ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(messages: Any) -> list[ChatMessage]:
    """The request's conversation, checked, as plain-text messages (content parts: only text
    is understood)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    out: list[ChatMessage] = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"each message needs a known 'role': {m!r}"[:300])
        content = m.get("content")
        if isinstance(content, list):
            parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            content = " ".join(parts)
        if content is not None and not isinstance(content, str):
            raise RequestError("message 'content' must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content or ""})
    return out


def render(messages: Any, tokenizer: Tokenizer | None = None) -> str:
    """The conversation as the model sees it: rendered by its tokenizer's chat template."""
    return (tokenizer or make_tokenizer()).render_chat(chat_messages(messages))


class ChatGateway:
    def __init__(self, bus: Bus, run_id: str, settings: GatewaySettings, tokenizer: Tokenizer | None = None):
        self.bus = bus
        self.run_id = run_id
        self.s = settings
        subjects.check_token(settings.env, "env")
        subjects.check_token(settings.tenant, "tenant")
        self.tok = tokenizer or make_tokenizer()
        self.keys = ApiKeys(settings.keys) if settings.keys else None
        self.in_flight: dict[str, int] = {}  # per tenant, the requests being answered
        self.pending: dict[str, _Pending] = {}
        self.payloads: Payloads | None = None
        self.requests = 0
        self.refused = 0
        self._follower: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.port = settings.port
        # With keys every request names its own tenant (logged with it), not the settings' one.
        scope = {} if self.keys else {"tenant": settings.tenant}
        self.log = get_logger(__name__, run_id=run_id, worker_id="gateway", **scope)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.payloads = Payloads(await ObjectStorePayloads.for_run(self.bus.js, self.run_id))
        # Answers to requests made from now on: follow the generation subject from the head.
        head = await self.bus.last_seq(self.run_id)
        self._follower = asyncio.create_task(self._follow(head + 1))
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.s.host, self.s.port).start()
        self.port = self._runner.addresses[0][1]  # the bound port (settings may say 0: any)
        self.log.info("gateway_started", url=self.url)

    @property
    def url(self) -> str:
        return f"http://{self.s.host}:{self.port}/v1"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower
        for p in self.pending.values():
            if not p.done.done():
                p.done.cancel()

    async def _follow(self, from_seq: int) -> None:
        tenant = "*" if self.keys else self.s.tenant  # with keys, answers come under every tenant
        subject = subjects.generation_subject(self.run_id, tenant, self.s.env)
        async for item in self.bus.tail(self.run_id, filter_subject=subject, from_seq=from_seq):
            g = item.event.body if item.event else None
            if not isinstance(g, ev.GenerationCompleted):
                continue
            p = self.pending.get(g.task_id)
            if p is None or p.done.done() or item.event is None or item.event.tenant != p.tenant:
                continue  # another gateway's, one that timed out, or not under the asker's tenant
            p.got[g.sample_index] = g
            if len(p.got) == p.n:
                p.done.set_result([p.got[i] for i in sorted(p.got)])

    # ------------------------------------------------------------------ the request

    def _parse(self, body: Any) -> tuple[str, list[int], int, int, float, bool]:
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        if body.get("stream"):
            raise RequestError("streaming is not supported")
        text = render(body.get("messages"), self.tok)
        try:
            tokens = self.tok.encode(text)
        except ValueError as e:
            raise RequestError(f"the model's tokenizer cannot write the prompt: {e}") from None
        n = body.get("n") or 1
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or self.s.max_tokens
        temperature = body.get("temperature")
        temperature = 1.0 if temperature is None else temperature
        if not isinstance(n, int) or not 1 <= n <= self.s.max_n:
            raise RequestError(f"'n' must be an integer in 1..{self.s.max_n}")
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= self.s.max_tokens:
            raise RequestError(f"'max_tokens' must be an integer in 1..{self.s.max_tokens}")
        if not isinstance(temperature, int | float) or not 0 <= temperature <= 2:
            raise RequestError("'temperature' must be a number in 0..2")
        return text, tokens, n, max_tokens, float(temperature), bool(body.get("logprobs"))

    async def complete(self, body: Any, tenant: str | None = None) -> dict[str, Any]:
        """One chat completion for ``tenant`` (default: the settings'): the OpenAI response
        object, with a ``jetrl`` field naming the task, the policy version that answered and the
        generation ids."""
        self.requests += 1
        tenant = subjects.check_token(tenant or self.s.tenant, "tenant")
        text, tokens, n, max_tokens, temperature, want_logprobs = self._parse(body)
        task_id = ids.task_id(self.s.env, tenant, uuid.uuid4().hex)
        pending = _Pending(n, tenant, asyncio.get_running_loop().create_future())
        self.pending[task_id] = pending
        try:
            await self.bus.publish(
                ev.new_event(
                    ev.TaskSubmitted(
                        task_id=task_id,
                        env=self.s.env,
                        group_size=n,
                        prompt_tokens=tokens,
                        prompt_text=text,
                        max_tokens=max_tokens,
                        info={"source": "gateway"},
                        temperature=temperature,
                    ),
                    run_id=self.run_id,
                    tenant=tenant,
                    event_id=ids.task_event_id(self.run_id, task_id),
                )
            )
            gens = await asyncio.wait_for(pending.done, self.s.timeout_s)
        finally:
            self.pending.pop(task_id, None)
        return await self._response(task_id, len(tokens), gens, want_logprobs)

    async def _response(
        self, task_id: str, prompt_len: int, gens: list[ev.GenerationCompleted], want_logprobs: bool
    ) -> dict[str, Any]:
        assert self.payloads is not None
        choices, completion_tokens = [], 0
        for i, g in enumerate(gens):
            toks = (await self.payloads.get_array(g.completion_tokens)).astype(np.int64).tolist()
            completion_tokens += len(toks)
            choice: dict[str, Any] = {
                "index": i,
                "message": {"role": "assistant", "content": self.tok.decode(toks)},
                "finish_reason": "length" if g.finish_reason == "length" else "stop",
            }
            if want_logprobs:
                lps = (await self.payloads.get_array(g.logprobs)).astype(np.float64).tolist()
                choice["logprobs"] = {
                    "content": [
                        {"token": self.tok.decode([t], skip_special=False, stop_at_eos=False), "logprob": lp}
                        for t, lp in zip(toks, lps, strict=False)
                    ]
                }
            choices.append(choice)
        return {
            "id": f"chatcmpl-{ids.task_number(task_id)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.s.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_len,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_len * len(gens) + completion_tokens,
            },
            "jetrl": {
                "run_id": self.run_id,
                "task_id": task_id,
                "policy_version": max(g.policy_version_end for g in gens),
                "generation_ids": [g.generation_id for g in gens],
            },
        }

    # ------------------------------------------------------------------ HTTP

    @staticmethod
    def _error(
        status: int,
        message: str,
        kind: str,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> web.Response:
        return web.json_response(
            {"error": {"message": message, "type": kind, "param": None, "code": code or status}},
            status=status,
            headers=headers,
        )

    def _authenticate(self, request: web.Request) -> KeyGrant | web.Response:
        """The request's tenant and limit: from its bearer key with a keys file, else the
        settings'. A refusal (401) is logged without the key."""
        if self.keys is None:
            return KeyGrant(self.s.tenant, self.s.max_in_flight)
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        key = key.strip()
        grant = self.keys.lookup(key) if scheme.lower() == "bearer" and key else None
        if grant is not None:
            return grant
        self.refused += 1
        why = "unknown API key" if key else "missing API key: send 'Authorization: Bearer <key>'"
        self.log.info("gateway_unauthorized", reason=why.split(":")[0])
        return self._error(
            401, why, "invalid_request_error", "invalid_api_key", {"WWW-Authenticate": "Bearer"}
        )

    async def _chat(self, request: web.Request) -> web.Response:
        grant = self._authenticate(request)
        if isinstance(grant, web.Response):
            return grant
        tenant, limit = grant.tenant, grant.max_in_flight
        busy = self.in_flight.get(tenant, 0)
        if limit is not None and busy >= limit:
            # Admission at the edge: a clear refusal the caller can retry, not a queue that stalls.
            self.refused += 1
            self.log.info("gateway_quota_refused", tenant=tenant, in_flight=busy, limit=limit)
            return self._error(
                429,
                f"tenant {tenant!r} has {busy} requests in flight at the gateway, its limit is {limit}: "
                "retry when one has been answered",
                "rate_limit_error",
                "rate_limit_exceeded",
            )
        self.in_flight[tenant] = busy + 1
        try:
            return await self._answer(request, tenant)
        finally:
            self.in_flight[tenant] -= 1

    async def _answer(self, request: web.Request, tenant: str) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            self.refused += 1
            return self._error(400, "the request body is not JSON", "invalid_request_error")
        try:
            return web.json_response(await self.complete(body, tenant))
        except RequestError as e:
            self.refused += 1
            self.log.info("gateway_request_refused", tenant=tenant, reason=str(e))
            return self._error(400, str(e), "invalid_request_error")
        except TimeoutError:
            return self._error(504, f"no inference worker answered in {self.s.timeout_s:g}s", "timeout")

    async def _models(self, request: web.Request) -> web.Response:
        grant = self._authenticate(request)
        if isinstance(grant, web.Response):
            return grant
        return web.json_response(
            {"object": "list", "data": [{"id": self.s.model, "object": "model", "owned_by": "jetrl"}]}
        )

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"ok": True, "run_id": self.run_id, "requests": self.requests, "refused": self.refused}
        )
