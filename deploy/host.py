"""``python -m jetrl.deploy.host --parts @FILE``: several parts in one process.

Each part runs as a task of one event loop, exactly the part its own process would be
(``PART.task`` of its module, bus/runtime.py): its own command line, settings, bus connection
and identity, so the parts still meet only through the log. What they share is the process:
its interpreter, its CPU time and its life. A machine of two cores runs five or more parts
(a producer, inference workers, the trainer, the recorder, the monitor) beside the
nats-server; as tasks of fewer processes they stop contending for the cores as processes do
(``[run] host_together`` says which kinds share one, deploy/parts.py).

FILE is JSON: a list of ``{"module": "jetrl.producers", "args": [...]}``, each ``args`` the
part's own command line after ``python -m MODULE``. SIGTERM or SIGINT stops every part
cleanly. A part that raises stops the others and the process exits 1, so the supervisor
restarts the whole process and each part rebuilds itself from the log, as it would alone; a
part that returns leaves the others running, but for one marked ``"ends_process": true`` (the
trainer: the supervisor reads its process's clean exit as the run's end), whose return stops
the others. The exit code is the largest of the parts'.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import sys
from pathlib import Path
from typing import Any

from jetrl.bus.log import get_logger
from jetrl.bus.runtime import PartEntry, PartTask, run_process

log = get_logger(__name__)

STOP_S = 30.0  # how long the other parts have to stop when one failed


def load_parts(spec: list[dict[str, Any]]) -> list[tuple[str, PartTask, bool]]:
    """Each entry's part, parsed from its own command line: (module, task, whether its return
    ends the process)."""
    out = []
    for entry in spec:
        module = str(entry["module"])
        # What `python -m` runs: a package's __main__, or the module itself.
        mod = importlib.import_module(module)
        if hasattr(mod, "__path__"):
            mod = importlib.import_module(f"{module}.__main__")
        part = getattr(mod, "PART", None)
        if not isinstance(part, PartEntry):
            raise SystemExit(f"{module} is not a part (it has no PART entry)")
        out.append((module, part.task([str(a) for a in entry["args"]]), bool(entry.get("ends_process"))))
    return out


async def run_parts(parts: list[tuple[str, PartTask, bool]], stop: asyncio.Event) -> int:
    """Every part until it returns; the first that raises stops the rest and ends with 1, one
    that ends the process stops the rest once it returns."""

    async def one(task: PartTask) -> int | None:
        return await task(stop)

    tasks: dict[asyncio.Task[int | None], str] = {
        asyncio.create_task(one(task), name=module): module for module, task, _ in parts
    }
    ends = {t for t, (_, _, last) in zip(tasks, parts, strict=True) if last}
    codes: list[int] = []
    failed = False
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            exc = t.exception()
            if exc is not None:
                failed = True
                log.error("hosted_part_failed", part=tasks[t], error=repr(exc), exc_info=exc)
            else:
                codes.append(int(t.result() or 0))
        if failed or done & ends:
            # A part failed (the supervisor restarts the process), or the one the process lives
            # for is done: the others stop cleanly, within STOP_S.
            stop.set()
            with contextlib.suppress(TimeoutError):
                rest = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), STOP_S)
                codes += [1 if isinstance(c, BaseException) else int(c or 0) for c in rest]
            return 1 if failed else max(codes)
    return max(codes, default=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jetrl-host")
    ap.add_argument("--parts", required=True, help="@path to a JSON list of {module, args}, or the JSON")
    args = ap.parse_args(argv)
    raw = args.parts
    spec = json.loads(Path(raw[1:]).read_text() if raw.startswith("@") else raw)
    parts = load_parts(spec)
    return run_process(lambda stop: run_parts(parts, stop))


if __name__ == "__main__":
    sys.exit(main())
