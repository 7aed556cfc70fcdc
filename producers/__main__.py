"""python -m jetrl.producers --nats-url URL --run RUN [--settings JSON]"""

from __future__ import annotations

import sys

from jetrl.bus.runtime import part_main
from jetrl.producers.producer import EnvProducer
from jetrl.producers.settings import ProducerPart


def main(argv: list[str] | None = None) -> int:
    return part_main(
        argv,
        prog="jetrl-producer",
        settings_model=ProducerPart,
        client_name=lambda args, s: f"env-{s.env.name}",
        body=lambda bus, args, s, stop: EnvProducer(bus, args.run, s).run(stop),
    )


if __name__ == "__main__":
    sys.exit(main())
