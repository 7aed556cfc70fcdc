"""Who a client is: an identity's credentials file, and what the server says about it.

The server authenticates identities by nkey (deploy/tenants.py writes the files) and enforces
their permissions; its refusals arrive asynchronously, as errors, and are turned here into
errors a caller can act on."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import nats
import nats.errors
from nats.aio.client import Client as NATS


class CredentialsError(ValueError):
    """A credentials file that cannot be read."""


T = TypeVar("T")


async def unless_set(event: asyncio.Event, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None when ``event`` is set first (``work`` is then cancelled).
    nats-py retries a first connection forever, whatever the error: this bounds it."""
    doing = asyncio.ensure_future(work)
    waiting = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((doing, waiting), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        doing.cancel()
        raise
    finally:
        waiting.cancel()
    if doing.done():
        return doing.result()
    await cancel_and_wait(doing)
    return None


async def cancel_and_wait(task: asyncio.Future[Any], every: float = 0.5) -> None:
    """Cancel ``task`` and wait until it is done, cancelling again while it is not: nats-py
    swallows a cancellation that lands while it hands a message to its flusher, and the task
    then carries on (seen with an ordered consumer being set up)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=every)
    with contextlib.suppress(BaseException):
        task.result()


async def connect_unless(refused: asyncio.Event, **options: Any) -> NATS:
    """nats.connect, given up (as an authorization error) once the server refuses the
    credentials."""
    nc = await unless_set(refused, nats.connect(**options))
    if nc is None:
        raise nats.errors.Error("nats: 'Authorization Violation'")
    return nc


class PermissionDenied(RuntimeError):
    """The server refused this identity the subject (NATS permissions): never retried."""


VIOLATION = re.compile(r'permissions violation for (?:publish|subscription) to "([^"]+)"', re.IGNORECASE)


@dataclass(frozen=True)
class Credentials:
    """An identity's credentials file (JSON, mode 0600): its name, its nkey seed, and the inbox
    prefix its permissions allow it to subscribe under (replies to it arrive there, and another
    identity cannot read them)."""

    name: str
    seed: str
    inbox_prefix: str
    is_tenant: bool = False  # a tenant's identity (its name is the tenant), not one of jetrl's parts

    @classmethod
    def load(cls, path: str) -> Credentials:
        try:
            raw = json.loads(Path(path).read_text())
            return cls(
                name=str(raw["name"]),
                seed=str(raw["seed"]),
                inbox_prefix=str(raw["inbox_prefix"]),
                is_tenant=raw.get("tenant") == raw["name"],
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CredentialsError(f"cannot read credentials {path}: {exc!r}") from None

    def connect_options(self) -> dict[str, Any]:
        return {"nkeys_seed_str": self.seed, "inbox_prefix": self.inbox_prefix}

    @property
    def tenant(self) -> str | None:
        """The tenant this identity is, when it is one (its name); None for jetrl's parts."""
        return self.name if self.is_tenant else None

    def msg_id_key(self) -> bytes | None:
        """A tenant's message ids are keyed with a secret of its own: the stream deduplicates by
        message id across all publishers, and derived event ids are predictable, so another
        tenant could otherwise take an id first and make this one's event vanish. jetrl's parts
        check a duplicate against the stored message instead (Bus.claim_duplicate), which a
        tenant, unable to read the run's log, cannot."""
        return hashlib.sha256(b"jetrl-msg-id:" + self.seed.encode()).digest() if self.is_tenant else None
