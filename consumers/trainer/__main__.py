"""python -m jetrl.consumers.trainer --nats-url URL --run RUN --run-dir DIR [--settings JSON]"""

from __future__ import annotations

import sys
from pathlib import Path

from jetrl.bus.runtime import PartEntry
from jetrl.consumers.trainer.settings import TrainerPart
from jetrl.consumers.trainer.trainer import Trainer

PART = PartEntry(
    prog="jetrl-trainer",
    settings_model=TrainerPart,
    client_name=lambda args, s: "trainer",
    body=lambda bus, args, s, stop: Trainer(bus, args.run, s, args.run_dir).run(stop),
    options=lambda ap: ap.add_argument("--run-dir", required=True, type=Path),
)


def main(argv: list[str] | None = None) -> int:
    return PART.main(argv)


if __name__ == "__main__":
    sys.exit(main())
