"""`jetrl producer --creds FILE --nats-url URL --run RUN CONFIG`: a tenant's environment
producers, on the tenant's own machine.

CONFIG is the run's configuration (as the operator shares it): the producers take their
``[[envs]]`` entries (those of the credentials' tenant, or the ones ``--env`` names), the model's
tokenizer and their share of each trainer batch from it, exactly as the run's own producers do.
They read the run through the tenant's view and publish only on the tenant's subjects; a
producer started before the run (or before the tenant joined it) waits, saying so.
"""

from __future__ import annotations

import argparse
import asyncio

from jetrl.bus.identity import Credentials, CredentialsError
from jetrl.bus.log import get_logger
from jetrl.bus.runtime import connect_until, run_process
from jetrl.deploy.config import ConfigError, load_config
from jetrl.producers.producer import EnvProducer
from jetrl.producers.settings import ProducerPart


def pick_parts(parts: list[ProducerPart], tenant: str | None, envs: list[str]) -> list[ProducerPart]:
    """The producers this process runs: the named envs, else every env of the tenant."""
    chosen = [p for p in parts if (p.env.name in envs if envs else tenant is None or p.env.tenant == tenant)]
    if tenant is not None:
        foreign = [p.env.name for p in chosen if p.env.tenant != tenant]
        if foreign:
            raise ConfigError(f"env(s) {', '.join(foreign)} belong to another tenant than {tenant!r}")
    if not chosen:
        raise ConfigError(f"the config has no env of tenant {tenant!r}" if tenant else "no env chosen")
    return chosen


def main(args: argparse.Namespace) -> int:
    try:
        ident = Credentials.load(args.creds) if args.creds else None
        cfg = load_config(args.config, args.overrides)
        parts = pick_parts(cfg.producer_parts(), ident.tenant if ident else None, args.env)
    except (ConfigError, CredentialsError) as exc:
        print(f"jetrl producer: {exc}")
        return 2
    log = get_logger(__name__, run_id=args.run)

    async def go(stop: asyncio.Event) -> int:
        urls = [u.strip() for u in args.nats_url.split(",") if u.strip()]
        bus = await connect_until(
            stop, urls, name=f"producer-{ident.name if ident else 'jetrl'}", creds=args.creds
        )
        if bus is None:
            return 0  # stopped before the server answered
        try:
            producers = [EnvProducer(bus, args.run, p) for p in parts]
            log.info(
                "producers_starting",
                envs=[p.s.name for p in producers],
                identity=ident.name if ident else None,
            )
            await asyncio.gather(*(p.run(stop) for p in producers))
        finally:
            await bus.close()
        return 0

    return run_process(go)


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("producer", help="a tenant's environment producers, on its own machine")
    p.add_argument("config", help="the run's TOML config (its [[envs]], [model] and [trainer])")
    p.add_argument("--creds", default=None, help="the tenant's credentials file (`jetrl tenants add`)")
    p.add_argument("--nats-url", required=True, help="the run's NATS server(s), comma-separated")
    p.add_argument("--run", required=True, help="the run id")
    p.add_argument("--env", action="append", default=[], help="run only this env (repeatable)")
    p.set_defaults(func=main, overrides=[])
