"""Runs a command (the vLLM server) in a process group of its own and takes the whole group down
with it: when this process is told to stop (SIGTERM, SIGINT), when its parent (the jetrl worker)
dies, even by SIGKILL (Linux's parent-death signal), or when the command exits. vLLM's engine
core and worker processes are the server's children: without this they would outlive a killed
worker. When its parent died, it also removes the engine's scratch folder
(``$JETRL_VLLM_SCRATCH``: the server's log and sockets), which the engine removes itself when
it closes; otherwise the folder stays for the engine to read the log's tail. Standard library
only: it runs with vLLM's Python.

    python jetrl_vllm_reaper.py COMMAND [ARGS...]
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    child = subprocess.Popen(argv, start_new_session=True)
    stopping = False

    def stop(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while not stopping and child.poll() is None and os.getppid() == parent:
            time.sleep(0.2)
        if child.poll() is None:  # ask politely, then take the group down
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # whatever of the group is left
        scratch = os.environ.get("JETRL_VLLM_SCRATCH")
        if scratch and os.getppid() != parent:  # orphaned: no engine is left to clean up
            shutil.rmtree(scratch, ignore_errors=True)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
