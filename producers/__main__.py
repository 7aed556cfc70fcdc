"""python -m jetrl.producers --nats-url URL --run RUN [--settings JSON]"""

from __future__ import annotations

import sys

from jetrl.bus.runtime import PartEntry
from jetrl.producers.producer import EnvProducer
from jetrl.producers.settings import ProducerPart

PART = PartEntry(
    prog="jetrl-producer",
    settings_model=ProducerPart,
    client_name=lambda args, s: f"env-{s.env.name}",
    body=lambda bus, args, s, stop: EnvProducer(bus, args.run, s).run(stop),
)


def main(argv: list[str] | None = None) -> int:
    return PART.main(argv)


if __name__ == "__main__":
    sys.exit(main())
