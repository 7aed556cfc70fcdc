"""A part-shaped module for tests/deploy/test_launcher.py: ``python -m tests.support.forked_child
MODE``, run forked or as a fresh interpreter, reports what it was started with."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "report":
        import torch

        print(
            json.dumps(
                {
                    "argv": argv,
                    "env": os.environ.get("JETRL_TEST_VALUE"),
                    "threads": torch.get_num_threads(),
                    "pid": os.getpid(),
                    "sid": os.getsid(0),
                    "cwd": os.getcwd(),
                    "main": __name__,
                    "cmdline": Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode().strip(),
                    "nice": os.getpriority(os.PRIO_PROCESS, 0),
                    "cpus": sorted(os.sched_getaffinity(0)),
                }
            ),
            flush=True,
        )
        print("to stderr", file=sys.stderr, flush=True)
        return int(argv[1])
    if mode == "sleep":
        time.sleep(float(argv[1]))
        return 0
    if mode == "atexit":
        import atexit

        atexit.register(lambda: print("left at exit", flush=True))
        return 0
    if mode == "raise":
        raise RuntimeError("the part failed")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
