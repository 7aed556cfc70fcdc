"""Process plumbing: what a part's process sets up for itself (bus/runtime.py)."""

from __future__ import annotations

import subprocess
import sys

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
