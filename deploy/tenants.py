"""Tenants as NATS identities: the registry, credentials, and the nats-server authorization.

Every identity is a NATS user with an nkey (the server holds only public keys; the seed stays in
the identity's credentials file, written 0600, never logged). jetrl's own parts get identities
of their own (``trainer``, ``inference``, ``recorder``, ``producer``, ``gateway``, ``admin``) so
that none may publish another's events; a tenant's user may:

* publish its own task, rollout, evaluation and dead-letter subjects of the runs it joined (with
  JetStream acks: the ack comes to its inbox, and it needs no JetStream API for that);
* read the run only through its **view** (bus/streams.py): a stream sourcing its own subjects and
  the steps, on which it may create and use consumers (never on the run's stream);
* subscribe only under its own inbox prefix (``_INBOX_<name>``), so it never sees a reply or a
  delivery meant for another client.

Why users with permissions in one account rather than an account per tenant: a tenant's producer
needs JetStream consumers (a durable one for its generations, ordered ones to re-read its tasks
after a restart). Across accounts every such consumer would have to be made and exported by
jetrl one by one, while per-user permissions can grant the JetStream API on the tenant's own
view stream only, subject by subject (docs/tenants.md).

The registry is ``<dir>/tenants.json``; ``<dir>/nats-auth.conf`` is generated from it and
included by the server's configuration; a change is applied to running servers (their pid files
are under ``<dir>/servers``) by a configuration reload, without a restart: a removed or rotated
identity's connections are closed at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys

from jetrl.bus.log import get_logger
from jetrl.bus.settings import RESERVED_TENANTS
from jetrl.bus.streams import view_stream_name
from jetrl.bus.subjects import check_token

log = get_logger(__name__)

# jetrl's parts: what each may publish, on any run (they are trusted with the JetStream API).
_RUN = "jetrl.*"
PART_PUBLISH: dict[str, list[str]] = {
    "trainer": [f"{_RUN}.step", f"{_RUN}.policy", f"{_RUN}.weights", f"{_RUN}.rollout.*.*"],
    "inference": [f"{_RUN}.generation.*.*", f"{_RUN}.worker.*.*"],
    "recorder": [],
    "producer": [f"{_RUN}.task.*.*", f"{_RUN}.rollout.*.*", f"{_RUN}.eval.*.*"],
    "gateway": [f"{_RUN}.task.*.*"],
    "monitor": [f"{_RUN}.alert.*"],
}
ADMIN = "admin"  # the supervisor and the operator's commands: every permission
JETRL_IDENTITIES = (ADMIN, *PART_PUBLISH)


class TenantError(ValueError):
    pass


@dataclass
class Identity:
    name: str
    kind: str  # "tenant" or "jetrl"
    public_key: str
    runs: list[str]
    created: float
    rotated: float


def _new_keypair() -> tuple[str, str]:
    seed = nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER)
    kp = nkeys.from_seed(bytearray(seed))
    return seed.decode(), kp.public_key.decode()


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600 from the start: never a
    moment with wider permissions), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def inbox_prefix(name: str) -> str:
    return f"_INBOX_{name}"


class KeysFile:
    """The gateway's API keys file (producers/gateway_keys.py reads it): ``{"keys": {sha256 of a
    key: grant}}``. A key is made here and shown once; only its hash is written, 0600, replaced
    whole by rename (the gateway re-reads it on change)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.keys: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            self.keys = json.loads(self.path.read_text()).get("keys", {})

    def add(
        self,
        tenant: str,
        *,
        user: str | None = None,
        max_in_flight: int | None = None,
        rpm: int | None = None,
    ) -> str:
        """A new key for ``tenant``'s own requests, or (``user``) for a user's, which go on
        ``tenant``'s subjects. Returns the key; nothing else ever holds it."""
        check_token(tenant, "tenant")
        if tenant in RESERVED_TENANTS:
            raise TenantError(f"{tenant!r} is reserved for jetrl's own parts")
        if user is not None:
            check_token(user, "user name")
        for name, value in (("max in flight", max_in_flight), ("rpm", rpm)):
            if value is not None and value < 1:
                raise TenantError(f"{name} must be at least 1")
        key = "jrl-" + secrets.token_urlsafe(32)
        grant: dict[str, Any] = {"tenant": tenant, "max_in_flight": max_in_flight}
        if user is not None:
            grant["user"] = user
        if rpm is not None:
            grant["rpm"] = rpm
        self.keys[hashlib.sha256(key.encode()).hexdigest()] = grant
        return key

    def remove(self, *, tenant: str | None = None, user: str | None = None) -> int:
        """Drop every key of ``user``, or every key on ``tenant``'s subjects; how many."""

        def drop(g: dict[str, Any]) -> bool:
            return (user is not None and g.get("user") == user) or (
                tenant is not None and g.get("tenant") == tenant
            )

        before = len(self.keys)
        self.keys = {h: g for h, g in self.keys.items() if not drop(g)}
        return before - len(self.keys)

    def save(self) -> None:
        write_private(self.path, json.dumps({"keys": self.keys}, indent=2) + "\n")


class TenantRegistry:
    """The identities of one deployment (a directory), and the server configuration they give."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.path = self.dir / "tenants.json"
        self.identities: dict[str, Identity] = {}
        if self.path.exists():
            raw = json.loads(self.path.read_text())
            self.identities = {n: Identity(**i) for n, i in raw.get("identities", {}).items()}
        self.keys = KeysFile(self.keys_path)

    @property
    def api_keys(self) -> dict[str, dict[str, Any]]:
        """sha256 of a key -> its grant (gateway_keys.py): tenants' keys and users'."""
        return self.keys.keys

    # ------------------------------------------------------------------ paths

    @property
    def auth_conf(self) -> Path:
        return self.dir / "nats-auth.conf"

    @property
    def keys_path(self) -> Path:
        """The gateway's API keys (hashes only), for ``jetrl gateway --keys``."""
        return self.dir / "gateway_keys.json"

    def creds_path(self, name: str) -> Path:
        return self.dir / "creds" / f"{name}.creds"

    @property
    def servers_dir(self) -> Path:
        return self.dir / "servers"

    # ------------------------------------------------------------------ queries

    def tenants(self) -> list[Identity]:
        return [i for i in self.identities.values() if i.kind == "tenant"]

    def has_tenants(self) -> bool:
        return bool(self.tenants())

    def tenants_of(self, run_id: str) -> list[str]:
        return [i.name for i in self.tenants() if run_id in i.runs]

    # ------------------------------------------------------------------ changes

    def _issue(self, name: str, kind: str, runs: list[str]) -> Identity:
        seed, public = _new_keypair()
        now = time.time()
        old = self.identities.get(name)
        ident = Identity(name, kind, public, runs, old.created if old else now, now)
        self.identities[name] = ident
        creds = {"name": name, "seed": seed, "inbox_prefix": inbox_prefix(name)}
        if kind == "tenant":
            creds["tenant"] = name
        write_private(self.creds_path(name), json.dumps(creds, indent=2) + "\n")
        return ident

    def ensure_jetrl_identities(self) -> None:
        for name in JETRL_IDENTITIES:
            if name not in self.identities or not self.creds_path(name).exists():
                self._issue(name, "jetrl", ["*"])

    def add(self, name: str, runs: list[str]) -> Identity:
        check_token(name, "tenant name")
        if name in RESERVED_TENANTS:
            raise TenantError(f"{name!r} is reserved for jetrl's own parts")
        for r in runs:
            check_token(r, "run id")
        if name in self.identities:
            ident = self.identities[name]
            ident.runs = sorted({*ident.runs, *runs})
            return ident
        self.ensure_jetrl_identities()
        return self._issue(name, "tenant", sorted(set(runs)))

    def remove(self, name: str) -> None:
        ident = self._tenant(name)
        del self.identities[ident.name]
        with contextlib.suppress(FileNotFoundError):
            self.creds_path(name).unlink()
        self.keys.remove(tenant=name)  # its own keys and those of users served on its subjects

    def rotate(self, name: str) -> Identity:
        """A new key pair: the old credentials stop working at the next reload."""
        ident = self.identities.get(name)
        if ident is None:
            raise TenantError(f"no identity {name!r}")
        return self._issue(name, ident.kind, ident.runs)

    def leave(self, name: str, run_id: str) -> Identity:
        ident = self._tenant(name)
        ident.runs = [r for r in ident.runs if r != run_id]
        return ident

    def new_api_key(self, tenant: str, max_in_flight: int | None = None, rpm: int | None = None) -> str:
        """A gateway API key for ``tenant``; only its hash is kept, the key is shown once."""
        self._tenant(tenant)
        return self.keys.add(tenant, max_in_flight=max_in_flight, rpm=rpm)

    def _tenant(self, name: str) -> Identity:
        ident = self.identities.get(name)
        if ident is None or ident.kind != "tenant":
            raise TenantError(f"no tenant {name!r} (see `jetrl tenants list`)")
        return ident

    # ------------------------------------------------------------------ saving and applying

    def save(self) -> None:
        """Write the registry and the server configuration; reload the running servers."""
        self.dir.mkdir(parents=True, exist_ok=True)
        raw = {"identities": {n: vars(i) for n, i in sorted(self.identities.items())}}
        write_private(self.path, json.dumps(raw, indent=2) + "\n")
        self.keys.save()
        write_private(self.auth_conf, self.authorization())
        reloaded = reload_servers(self.servers_dir)
        log.debug(  # `jetrl tenants` prints what it did; a supervisor's saves are routine
            "tenants_saved",
            tenants=[i.name for i in self.tenants()],
            servers_reloaded=reloaded,
        )

    def authorization(self) -> str:
        """The nats-server ``authorization`` block (JSON is valid nats-server configuration)."""
        users = []
        for ident in sorted(self.identities.values(), key=lambda i: i.name):
            user: dict[str, Any] = {"nkey": ident.public_key}
            if ident.name != ADMIN:
                user["permissions"] = permissions(ident)
            users.append(user)
        return (
            "# generated by `jetrl tenants`; edits are overwritten\nauthorization: "
            + json.dumps({"users": users}, indent=2)
            + "\n"
        )


def permissions(ident: Identity) -> dict[str, Any]:
    inbox = f"{inbox_prefix(ident.name)}.>"
    if ident.kind == "jetrl":
        publish = [*PART_PUBLISH[ident.name], f"{_RUN}.dlq.*.*", "$JS.>", "$O.>"]
        return {"publish": {"allow": publish}, "subscribe": {"allow": [inbox]}}
    publish = []
    for run in ident.runs:
        t = ident.name
        publish += [f"jetrl.{run}.{kind}.{t}.*" for kind in ("task", "rollout", "eval", "dlq")]
        publish += view_api(view_stream_name(run, t))
    return {"publish": {"allow": publish}, "subscribe": {"allow": [inbox]}}


def view_api(view: str) -> list[str]:
    """The JetStream API a tenant has on its own view stream: consumers, reads, acks."""
    api = "$JS.API"
    return [
        f"{api}.STREAM.INFO.{view}",
        f"{api}.STREAM.MSG.GET.{view}",
        f"{api}.DIRECT.GET.{view}",
        f"{api}.DIRECT.GET.{view}.>",
        f"{api}.CONSUMER.CREATE.{view}",
        f"{api}.CONSUMER.CREATE.{view}.>",
        f"{api}.CONSUMER.DURABLE.CREATE.{view}.>",
        f"{api}.CONSUMER.INFO.{view}.>",
        f"{api}.CONSUMER.DELETE.{view}.>",
        f"{api}.CONSUMER.MSG.NEXT.{view}.>",
        f"$JS.ACK.{view}.>",
        f"$JS.FC.{view}.>",
    ]


def reload_servers(servers_dir: Path) -> list[int]:
    """Signal every live nats-server that registered a pid file here to reload its
    configuration (SIGHUP, as `nats-server --signal reload` does)."""
    done = []
    for pid_file in sorted(servers_dir.glob("*.pid")) if servers_dir.exists() else []:
        try:
            pid = int(pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            pid_file.unlink(missing_ok=True)  # that server is gone
            continue
        if b"nats-server" not in cmdline:
            pid_file.unlink(missing_ok=True)
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGHUP)
            done.append(pid)
    return done
