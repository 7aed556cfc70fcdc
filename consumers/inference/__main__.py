"""python -m jetrl.consumers.inference --nats-url URL --run RUN --worker-id ID [--settings JSON]"""

from __future__ import annotations

import sys

from jetrl.bus.runtime import PartEntry
from jetrl.consumers.inference.settings import InferencePart
from jetrl.consumers.inference.worker import InferenceWorker

PART = PartEntry(
    prog="jetrl-inference",
    settings_model=InferencePart,
    client_name=lambda args, s: f"inference-{args.worker_id}",
    body=lambda bus, args, s, stop: InferenceWorker(bus, args.run, args.worker_id, s).run(stop),
    options=lambda ap: ap.add_argument("--worker-id", required=True),
)


def main(argv: list[str] | None = None) -> int:
    return PART.main(argv)


if __name__ == "__main__":
    sys.exit(main())
