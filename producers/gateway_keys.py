"""The gateway's API keys and per-key limits: who a bearer key is, which tenant's subjects its
requests go on, and how many requests it may make.

The keys file (``jetrl tenants add --api-key``, ``jetrl tenants key`` and ``jetrl gateway keys
add`` write it) is ``{"keys": {sha256 hex of the key: grant}}`` with a grant
``{"tenant", "user", "max_in_flight", "rpm"}``: a tenant's key has no ``user``; a user's key names
the user and the tenant whose subjects the operator chose for them (the gateway's own tenant,
``default``, or a tenant of the run). Only hashes are stored, and neither a key nor its hash is
ever logged or put in an error.

Limits, each optional: ``max_in_flight`` (requests being answered at once, counted per tenant for
tenants' keys and per user for users' keys) and ``rpm`` (requests per minute, a token bucket per
key: it holds up to ``rpm`` requests and refills at ``rpm`` a minute, so a burst of ``rpm`` then a
steady ``rpm`` a minute).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jetrl.bus import subjects
from jetrl.bus.log import get_logger
from jetrl.bus.settings import RESERVED_TENANTS


@dataclass(frozen=True)
class KeyGrant:
    """What one API key gives: the tenant its requests run under, the user it names (None: the
    tenant's own key), and its limits."""

    tenant: str
    max_in_flight: int | None
    user: str | None = None
    rpm: int | None = None
    key_id: str = ""  # which bucket it draws from (the stored hash): never shown

    @property
    def principal(self) -> str:
        """Whose requests in flight it counts against: the tenant's, or the user's own."""
        return f"user:{self.user}" if self.user else self.tenant


def key_hash(key: str) -> str:
    """How a key is stored in the keys file: its SHA-256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def _limit(grant: dict[str, Any], name: str, who: str) -> int | None:
    value = grant.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{who}: {name} must be a positive integer or null")
    return value


def parse_keys(data: Any) -> dict[str, KeyGrant]:
    """The keys file's content, checked. Errors name the tenant or user, never a hash or a key."""
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
        user = grant.get("user")
        if user is not None and not isinstance(user, str):
            raise ValueError(f"tenant {tenant!r}: a key's 'user' must be a string")
        if user is not None:
            subjects.check_token(user, "user")
        who = f"user {user!r}" if user else f"tenant {tenant!r}"
        limit, rpm = _limit(grant, "max_in_flight", who), _limit(grant, "rpm", who)
        if (
            not isinstance(digest, str)
            or len(digest) != 64
            or any(c not in "0123456789abcdef" for c in digest)
        ):
            raise ValueError(f"{who}: a key must be stored as its SHA-256 in lowercase hex")
        out[digest] = KeyGrant(tenant, limit, user, rpm, digest)
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
            "gateway_keys_loaded",
            path=self.path,
            tenants=sorted({g.tenant for g in grants.values()}),
            users=sorted({g.user for g in grants.values() if g.user}),
        )

    @property
    def grants(self) -> dict[str, KeyGrant]:
        return self._grants

    def lookup(self, key: str) -> KeyGrant | None:
        """The grant of ``key``, or None. Every stored hash is compared in constant time."""
        self.refresh()
        digest = key_hash(key)
        found = None
        for stored, grant in self._grants.items():
            if hmac.compare_digest(stored, digest):
                found = grant
        return found


class TokenBucket:
    """``rpm`` requests a minute: holds up to ``rpm`` and refills continuously."""

    def __init__(self, rpm: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.rpm = rpm
        self.tokens = float(rpm)
        self.at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(float(self.rpm), self.tokens + (now - self.at) * self.rpm / 60.0)
        self.at = now

    def take(self) -> float:
        """Take one request: 0.0 when allowed, else the seconds until one is."""
        self._refill()
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) * 60.0 / self.rpm

    def set_rate(self, rpm: int) -> None:
        self._refill()
        self.rpm = rpm
        self.tokens = min(self.tokens, float(rpm))


class RateLimits:
    """One token bucket per key with an ``rpm``; a key removed from the file loses its bucket,
    a changed ``rpm`` applies to the bucket as it stands (no fresh burst)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.buckets: dict[str, TokenBucket] = {}

    def take(self, key_id: str, rpm: int | None) -> float:
        """0.0 when the key may make a request now, else the seconds to wait."""
        if rpm is None:
            self.buckets.pop(key_id, None)
            return 0.0
        bucket = self.buckets.get(key_id)
        if bucket is None:
            bucket = self.buckets[key_id] = TokenBucket(rpm, self.clock)
        elif bucket.rpm != rpm:
            bucket.set_rate(rpm)
        return bucket.take()

    def keep(self, key_ids: set[str]) -> None:
        """Forget the buckets of keys no longer in the file (bounded by the file's size)."""
        for k in [k for k in self.buckets if k not in key_ids]:
            del self.buckets[k]


def retry_after(seconds: float) -> str:
    """The ``Retry-After`` header's value: whole seconds, at least one."""
    return str(max(1, math.ceil(seconds)))
