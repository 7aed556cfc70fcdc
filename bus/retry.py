"""Which NATS errors may heal by themselves, and for how long a call is retried through them.

A JetStream cluster answers nothing for a stream while it elects a new leader (about 6 s after
a leader is lost, measured: tests/system/test_cluster_faults.py), and a client reconnecting to
another node fails its calls meanwhile. A part that gave up sooner would crash and restart for
a pause the cluster heals by itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors

from jetrl.bus.log import get_logger

log = get_logger(__name__)

T = TypeVar("T")

RETRY_S = 30.0  # a call that may heal is retried for at least this long

RETRYABLE = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,  # 503: "JetStream system temporarily unavailable"
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    asyncio.TimeoutError,
)


async def retrying(what: str, call: Callable[[], Awaitable[T]], *, retry_s: float = RETRY_S) -> T:
    """``call()`` until it succeeds, retrying errors that may heal for ``retry_s`` seconds
    (``call`` must be safe to repeat: it is made anew each time)."""
    give_up = time.monotonic() + retry_s
    delay, attempt = 0.2, 0
    while True:
        try:
            return await call()
        except RETRYABLE as exc:
            attempt += 1
            if time.monotonic() >= give_up:
                raise
            log.warning("call_retry", what=what, attempt=attempt, error=repr(exc))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
