"""``jetrl gateway RUN``: an OpenAI-compatible endpoint serving a live run's current policy.

    jetrl gateway demo-20261130-045528 --port 8000
    curl -s localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "3+4="}]}'

Prompts go through the run's own tokenizer and chat template (read from its RunStarted event).
The run's NATS URL is read from ``<runs-dir>/<RUN>/nats_url`` (the supervisor writes it) unless
``--nats-url`` names it. The run's inference workers answer; Ctrl-C stops the gateway only.

``--keys FILE`` makes every request authenticate with ``Authorization: Bearer <key>``; the key
names the tenant the request runs under and its limits (producers/gateway_keys.py). Without
``--keys`` the deployment's keys file (``<tenants-dir>/gateway_keys.json``) is taken when the
deployment has tenants or the file holds any key.

``jetrl gateway keys add USER [--tenant T] [--rpm N] [--max-in-flight N]`` makes an API key for a
user who is not a tenant: the user's requests go on tenant T's subjects (default: the gateway's
own tenant, ``default``). ``jetrl gateway keys list`` and ``jetrl gateway keys remove USER``
manage them; the same ``--keys`` / ``--tenants-dir`` name the file. Tenants' own keys are made by
``jetrl tenants add --api-key`` and ``jetrl tenants key``.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.runtime import run_process
from jetrl.deploy.config import RunConfig
from jetrl.deploy.tenants import KeysFile, TenantError, TenantRegistry
from jetrl.deploy.tenants_cmd import tenants_dir
from jetrl.policy.tokenizer import Tokenizer, tokenizer_for
from jetrl.producers.gateway import ChatGateway, GatewaySettings

KEYS_OPS = ("add USER", "list", "remove USER")


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "gateway",
        help="serve a live run's policy over an OpenAI-compatible API; `gateway keys ...`: users' API keys",
        description="`jetrl gateway RUN [options]` serves RUN; "
        f"`jetrl gateway keys {{{' | '.join(KEYS_OPS)}}} [options]` manages users' API keys.",
    )
    p.add_argument("run", metavar="RUN", help="the run to serve (or `keys`)")
    p.add_argument("keys_args", nargs="*", metavar="ARG", help=f"after `keys`: {', '.join(KEYS_OPS)}")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--nats-url", default=None, help="default: the one the run's supervisor recorded")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--tenant",
        default="default",
        help="every request's tenant when there are no keys; `keys add`: the tenant the user's "
        "requests go on",
    )
    p.add_argument(
        "--keys",
        default=None,
        metavar="FILE",
        help="API keys file (default: the deployment's, see --tenants-dir): each request's bearer key "
        "names its tenant (and user) and its limits; re-read when it changes",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="without keys: the most requests in flight at once; `keys add`: the user's",
    )
    p.add_argument(
        "--rpm", type=int, default=None, help="without keys: requests a minute; `keys add`: the user's key's"
    )
    p.add_argument(
        "--tenants-dir",
        default=None,
        help="the deployment's tenants (default $JETRL_TENANTS_DIR or runs/tenants): when it has any, "
        "the gateway connects as jetrl's gateway identity and takes its API keys file",
    )
    p.add_argument("--creds", default=None, help="connect with this credentials file instead")
    p.add_argument("--max-tokens", type=int, default=16, help="default and most per request")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.set_defaults(func=main)


async def run_tokenizer(bus: Bus, run_id: str) -> Tokenizer:
    """The run's own tokenizer and chat template, from the config its RunStarted recorded."""
    for item in await bus.read_log(run_id, filter_subject=subjects.run_subject(run_id)):
        body = item.event.body if item.event else None
        if isinstance(body, ev.RunStarted):
            return tokenizer_for(RunConfig.model_validate(body.config).model)
    raise SystemExit(f"jetrl gateway: run {run_id} has no RunStarted event in its log")


def keys_file(given: str | None, reg: TenantRegistry) -> str | None:
    """The API keys file the gateway takes: the one given, else the deployment's when it has
    tenants (their keys, even none: a deployment with tenants is never served open) or any key."""
    if given is None and reg.keys_path.exists() and (reg.has_tenants() or reg.api_keys):
        return str(reg.keys_path)
    return given


def keys_main(args: argparse.Namespace) -> int:
    """``jetrl gateway keys add|list|remove``: users' API keys in the keys file."""
    reg = TenantRegistry(tenants_dir(args.tenants_dir))
    keys = KeysFile(args.keys) if args.keys else reg.keys
    op, *names = args.keys_args or [""]
    if (op, len(names)) not in (("add", 1), ("list", 0), ("remove", 1)):
        print(f"jetrl gateway keys: expected one of {', '.join(KEYS_OPS)}")
        return 2
    if op == "list":
        users = [g for g in keys.keys.values() if g.get("user")]
        if not users:
            print(f"no users' API keys in {keys.path}")
        for g in sorted(users, key=lambda g: (str(g["user"]), str(g["tenant"]))):
            limits = f"rpm {g.get('rpm') or '-'}, max in flight {g.get('max_in_flight') or '-'}"
            print(f"user {g['user']:<20} tenant {g['tenant']:<20} {limits}")
        return 0
    user = names[0]
    if op == "remove":
        gone = keys.remove(user=user)
        if not gone:
            print(f"jetrl gateway keys: no API key of user {user!r} in {keys.path}")
            return 2
        keys.save()
        print(f"user {user}: {gone} API key(s) removed; the gateway refuses them once it reads {keys.path}")
        return 0
    try:
        key = keys.add(args.tenant, user=user, max_in_flight=args.max_in_flight, rpm=args.rpm)
    except (TenantError, ValueError) as e:
        print(f"jetrl gateway keys: {e}")
        return 2
    keys.save()
    print(f"user {user}: requests on tenant {args.tenant}'s subjects; keys file {keys.path}")
    print(f"gateway API key (shown once): {key}")
    return 0


def main(args: argparse.Namespace) -> int:
    if args.run == "keys":
        return keys_main(args)
    if args.keys_args:
        print(f"jetrl gateway: unexpected arguments {' '.join(args.keys_args)}")
        return 2
    url = args.nats_url
    if url is None:
        recorded = Path(args.runs_dir) / args.run / "nats_url"
        if not recorded.exists():
            print(f"jetrl gateway: no {recorded}; is the run live? Name its server with --nats-url")
            return 2
        url = recorded.read_text().strip()
    creds = args.creds
    reg = TenantRegistry(tenants_dir(args.tenants_dir))
    if reg.has_tenants():  # the server authenticates: the gateway is one of jetrl's identities
        creds = creds or str(reg.creds_path("gateway"))
    args.keys = keys_file(args.keys, reg)
    if args.keys is not None and not Path(args.keys).is_file():
        print(f"jetrl gateway: no API keys file {args.keys}")
        return 2
    settings = GatewaySettings(
        host=args.host,
        port=args.port,
        tenant=args.tenant,
        max_tokens=args.max_tokens,
        timeout_s=args.timeout_s,
        keys=args.keys,
        max_in_flight=args.max_in_flight,
        rpm=args.rpm,
    )

    async def go(stop: asyncio.Event) -> int:
        bus = await Bus.connect(url, name="gateway", creds=creds)
        gateway = ChatGateway(bus, args.run, settings, await run_tokenizer(bus, args.run))
        try:
            await gateway.start()
            who = f"API keys of {args.keys}" if args.keys else f"tenant {args.tenant}, no API keys"
            print(
                f"jetrl gateway: run {args.run}'s policy at {gateway.url} (OpenAI chat API; {who})",
                flush=True,
            )
            await stop.wait()
        finally:
            await gateway.stop()
            await bus.close()
        return 0

    return run_process(go)
