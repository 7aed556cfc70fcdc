"""`jetrl tenants add|list|remove|rotate|join|leave|key`: the teams that feed runs, as NATS
identities (deploy/tenants.py). Each change rewrites the server's authorization and reloads the
running servers that use it; nothing restarts."""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from jetrl.bus.client import Bus
from jetrl.bus.streams import ensure_tenant_view, stream_name
from jetrl.deploy.tenants import ADMIN, TenantError, TenantRegistry

DEFAULT_DIR = "runs/tenants"


def tenants_dir(value: str | None) -> str:
    return value or os.environ.get("JETRL_TENANTS_DIR") or DEFAULT_DIR


def add_command(sub: Any) -> None:
    p = sub.add_parser("tenants", help="the teams that feed runs: NATS identities, views, API keys")
    p.add_argument("--dir", default=None, help=f"the deployment's tenants directory (default {DEFAULT_DIR})")
    p.set_defaults(func=main)
    ops = p.add_subparsers(dest="op", required=True)
    add = ops.add_parser("add", help="a new tenant (or more runs for one)")
    add.add_argument("name")
    add.add_argument("--run", action="append", default=[], help="a run it joins (repeatable)")
    add.add_argument("--api-key", action="store_true", help="also make a gateway API key (shown once)")
    add.add_argument("--max-in-flight", type=int, default=None, help="the key's gateway requests at once")
    add.add_argument("--rpm", type=int, default=None, help="the key's gateway requests per minute")
    add.add_argument("--nats-url", default=None, help="create its views of the runs on this server now")
    ops.add_parser("list", help="every identity, its runs and key")
    rm = ops.add_parser("remove", help="revoke a tenant: its connections close at the reload")
    rm.add_argument("name")
    rot = ops.add_parser("rotate", help="new credentials for an identity; the old stop working")
    rot.add_argument("name")
    join = ops.add_parser("join", help="let a tenant feed a run")
    join.add_argument("name")
    join.add_argument("run")
    join.add_argument("--nats-url", default=None, help="create its view of the run on this server now")
    leave = ops.add_parser("leave", help="a tenant no longer feeds a run")
    leave.add_argument("name")
    leave.add_argument("run")
    key = ops.add_parser("key", help="a new gateway API key for a tenant (shown once)")
    key.add_argument("name")
    key.add_argument("--max-in-flight", type=int, default=None, help="its gateway requests at once")
    key.add_argument("--rpm", type=int, default=None, help="its gateway requests per minute")


async def create_views(reg: TenantRegistry, url: str, pairs: list[tuple[str, str]]) -> list[str]:
    """The tenants' views of runs that exist on the server at ``url`` (as the admin identity)."""
    bus = await Bus.connect(url, name="jetrl-tenants", creds=str(reg.creds_path(ADMIN)))
    made = []
    try:
        for run, tenant in pairs:
            try:
                await bus.js.stream_info(stream_name(run))
            except Exception:
                continue  # the run is not there yet: its supervisor makes the view at start
            made.append((await ensure_tenant_view(bus.js, run, tenant)).config.name or "")
    finally:
        await bus.close()
    return made


def main(args: argparse.Namespace) -> int:
    reg = TenantRegistry(tenants_dir(args.dir))
    try:
        return _run(reg, args)
    except TenantError as exc:
        print(f"jetrl tenants: {exc}")
        return 2


def _run(reg: TenantRegistry, args: argparse.Namespace) -> int:
    if args.op == "list":
        idents = sorted(reg.identities.values(), key=lambda i: (i.kind, i.name))
        if not idents:
            print(f"no identities in {reg.dir}")
        for i in idents:
            keys = sum(1 for k in reg.api_keys.values() if k.get("tenant") == i.name and not k.get("user"))
            runs = ",".join(i.runs) or "-"
            print(f"{i.kind:<7} {i.name:<20} runs {runs:<30} api keys {keys}  key {i.public_key[:12]}...")
        users = sorted({(k["user"], k.get("tenant")) for k in reg.api_keys.values() if k.get("user")})
        for user, tenant in users:  # gateway users (`jetrl gateway keys`), not NATS identities
            print(f"{'user':<7} {user:<20} gateway API keys on tenant {tenant}")
        return 0
    url = getattr(args, "nats_url", None)
    if args.op == "add":
        ident = reg.add(args.name, args.run)
        key = reg.new_api_key(ident.name, args.max_in_flight, args.rpm) if args.api_key else None
        reg.save()
        runs = ",".join(ident.runs) or "-"
        print(f"tenant {ident.name}: runs {runs}; credentials {reg.creds_path(ident.name)}")
        if key:
            print(f"gateway API key (shown once): {key}")
        if url and ident.runs:
            views = asyncio.run(create_views(reg, url, [(r, ident.name) for r in ident.runs]))
            print(f"views: {', '.join(views) or 'none yet (runs not started)'}")
    elif args.op == "remove":
        reg.remove(args.name)
        reg.save()
        print(f"tenant {args.name} removed; its connections are closed")
    elif args.op == "rotate":
        reg.rotate(args.name)
        reg.save()
        print(f"{args.name}: new credentials {reg.creds_path(args.name)}; the old ones no longer connect")
    elif args.op == "join":
        reg.add(args.name, [args.run])
        reg.save()
        print(f"tenant {args.name} joined run {args.run}")
        if url:
            asyncio.run(create_views(reg, url, [(args.run, args.name)]))
    elif args.op == "leave":
        reg.leave(args.name, args.run)
        reg.save()
        print(f"tenant {args.name} left run {args.run}")
    elif args.op == "key":
        key = reg.new_api_key(args.name, args.max_in_flight, args.rpm)
        reg.save()
        print(f"gateway API key for {args.name} (shown once): {key}")
    return 0
