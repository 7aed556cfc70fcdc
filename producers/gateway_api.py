"""The OpenAI chat-completions wire format, as the gateway speaks it: requests checked into a
:class:`ChatRequest`, errors in OpenAI's shape, and the objects of an answer (whole or streamed
as ``chat.completion.chunk`` server-sent events)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from jetrl.policy.tokenizer import ChatMessage, Tokenizer, make_tokenizer


class ApiError(Exception):
    """A refusal, answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


class RequestError(ApiError, ValueError):
    """A request the gateway refuses as invalid (HTTP 400), with the reason for the caller."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(400, message, "invalid_request_error", code, param)


def http_error(exc: web.HTTPException, method: str, path: str) -> ApiError:
    """aiohttp's own refusals (no such route, wrong method, body too large) in OpenAI's shape."""
    headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    if exc.status == 404:
        return ApiError(404, f"unknown request URL: {method} {path}", "invalid_request_error", "unknown_url")
    if exc.status == 405:
        msg = f"{method} is not allowed on {path}"
        return ApiError(405, msg, "invalid_request_error", "method_not_allowed", headers=headers)
    if exc.status == 413:
        msg = f"the request body is too large: {exc.text or ''}".strip()
        return ApiError(413, msg, "invalid_request_error", "request_too_large")
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return ApiError(exc.status, exc.reason or "refused", kind, exc.reason.lower().replace(" ", "_") or None)


ROLES = ("system", "developer", "user", "assistant", "tool")
# Below this a temperature is greedy (0): the logits divided by a smaller one overflow the
# inference precision (below ~1e-38 the divisor itself underflows to 0), and the sampler fails.
MIN_TEMPERATURE = 1e-6


def chat_messages(messages: Any) -> list[ChatMessage]:
    """The request's conversation, checked, as plain-text messages (content parts: only text
    is understood)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    out: list[ChatMessage] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise RequestError(f"each message needs a known 'role': {m!r}"[:300], "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if not all(isinstance(p, str) for p in parts):
                raise RequestError("a text part's 'text' must be a string", "messages")
            content = " ".join(str(p) for p in parts)
        if content is not None and not isinstance(content, str):
            raise RequestError("message 'content' must be a string or a list of text parts", "messages")
        out.append({"role": m["role"], "content": content or ""})
    return out


def render(messages: Any, tokenizer: Tokenizer | None = None) -> str:
    """The conversation as the model sees it: rendered by its tokenizer's chat template."""
    return (tokenizer or make_tokenizer()).render_chat(chat_messages(messages))


@dataclass(frozen=True)
class ChatRequest:
    """A checked request: the prompt as text and tokens, and the sampling asked for."""

    text: str
    tokens: list[int]
    n: int
    max_tokens: int
    temperature: float
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    model: str = ""


def _integer(body: dict[str, Any], name: str, default: int, top: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
        raise RequestError(f"'{name}' must be an integer in 1..{top}", name)
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"'{name}' must be a boolean", name)
    return bool(value)


def parse_request(body: Any, tok: Tokenizer, *, model: str, max_tokens: int, max_n: int) -> ChatRequest:
    """Check ``body`` against what the gateway serves; raises :class:`ApiError` (400, or 404 for
    another model)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    asked = body.get("model")
    if asked is not None and not isinstance(asked, str):
        raise RequestError("'model' must be a string", "model")
    if asked is not None and asked != model:
        msg = f"the model {asked[:100]!r} does not exist: this gateway serves {model!r}"
        raise ApiError(404, msg, "invalid_request_error", "model_not_found", "model")
    text = render(body.get("messages"), tok)
    try:
        tokens = tok.encode(text)
    except ValueError as e:
        raise RequestError(f"the model's tokenizer cannot write the prompt: {e}", "messages") from None
    n = _integer(body, "n", 1, max_n)
    if body.get("max_completion_tokens") is not None:
        limit = _integer(body, "max_completion_tokens", max_tokens, max_tokens)
    else:
        limit = _integer(body, "max_tokens", max_tokens, max_tokens)
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not math.isfinite(temperature)
        or not 0 <= temperature <= 2
    ):
        raise RequestError("'temperature' must be a number in 0..2", "temperature")
    if temperature < MIN_TEMPERATURE:  # what sampling would divide the logits by underflows
        temperature = 0.0
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise RequestError("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    include_usage = _flag(options or {}, "include_usage")
    return ChatRequest(
        text=text,
        tokens=tokens,
        n=n,
        max_tokens=limit,
        temperature=float(temperature),
        logprobs=_flag(body, "logprobs"),
        stream=stream,
        include_usage=include_usage,
        model=model,
    )


# ---------------------------------------------------------------------- answers


def finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's accounting: the prompt once, however many samples were asked for."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def logprobs_content(tokens: list[str], logprobs: list[float]) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs, strict=False)
        ]
    }


@dataclass
class ChunkWriter:
    """The ``chat.completion.chunk`` objects of one streamed answer, as SSE ``data:`` lines."""

    completion_id: str
    model: str
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def _obj(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.include_usage:
            obj["usage"] = None  # as OpenAI: null on every chunk but the last
        obj.update(extra)
        return obj

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse(self._obj(choices, **extra))

    def choice(self, index: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        c: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        c.update(extra)
        return self.chunk([c])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, **extra: Any) -> bytes:
        obj = self._obj([], **extra)
        obj["usage"] = usage(prompt_tokens, completion_tokens)
        return sse(obj)


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
