"""Process plumbing: what a part's process sets up for itself (bus/runtime.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jetrl.bus.runtime import SUPERVISOR_PID_ENV

# A fresh interpreter each (the allocator's state is the process's): 64 blocks of 1 MiB made
# and freed, five times; the minor page faults of the last five rounds. glibc as it comes gives
# the freed top of its heap back to the kernel and faults it in again the next round.
_ROUNDS = """
import resource, sys
import numpy as np
from jetrl.bus.runtime import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def one_round():
    blocks = [np.ones(1 << 20, np.uint8) for _ in range(64)]
    del blocks
one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    one_round()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_a_part_keeps_what_it_frees_for_its_next_step() -> None:
    given_back, kept = _faults("default"), _faults("keep")
    # 320 MiB made in the five rounds: ~80,000 pages faulted in where the memory is given back.
    assert given_back > 40_000
    assert kept < given_back / 20


# A part (run_process) whose supervisor is a `sleep`: it says when it is stopped, and then ends
# (``clean``) or never does (``hangs``, as a part stuck in its shutdown would).
_PART = """
import asyncio, sys
from jetrl.bus import runtime
runtime.WATCH_EVERY_S, runtime.ORPHAN_GRACE_S = 0.1, 1.0
async def main(stop):
    await stop.wait()
    print("stopped", flush=True)
    if sys.argv[1] == "hangs":
        await asyncio.Event().wait()
    return 0
sys.exit(runtime.run_process(main))
"""


@pytest.mark.parametrize(("mode", "code"), [("clean", 0), ("hangs", 3)])
def test_a_part_whose_supervisor_is_gone_stops_itself(mode: str, code: int) -> None:
    supervisor = subprocess.Popen(["sleep", "60"])
    env = dict(os.environ, **{SUPERVISOR_PID_ENV: str(supervisor.pid)})
    part = subprocess.Popen(
        [sys.executable, "-c", _PART, mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            part.wait(1.0)  # its supervisor there: it runs on
        supervisor.kill()
        supervisor.wait()  # reaped: the pid is gone
        out, _ = part.communicate(timeout=30)
        assert (part.returncode, out.strip()) == (code, "stopped")
    finally:
        supervisor.kill()
        part.kill()
