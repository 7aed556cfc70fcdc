"""Ranks that rank 0 started itself (no launcher: `jetrl replay`, a script) never outlive it:
a clean exit stops them, and so does rank 0 dying without a word."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each case starts a group of ranks
ROOT = Path(__file__).resolve().parents[3]

SCRIPT = """
import os, sys
from jetrl.consumers.trainer.engine import make_train_engine
from jetrl.consumers.trainer.settings import TrainerPart
engine = make_train_engine(TrainerPart.model_validate(
    {"trainer": {"parallelism": {"dp_shard": 2}}, "model": {"name": "tiny-dense"}}))
print("CHECKSUM", engine.checksum(), flush=True)
if sys.argv[1] == "die":
    os._exit(9)  # no atexit, no stop command: the other rank must notice by itself
"""


def children_of(pid: int) -> list[int]:
    """Live processes started by rank 0 for its group (they carry its pid)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(") ", 1)[1][:1]
        except (OSError, IndexError):
            continue
        if state != "Z" and f"JETRL_PARENT_PID={pid}".encode() in environ:
            out.append(int(proc.name))
    return out


@pytest.mark.parametrize("end", ["exit", "die"])
def test_started_ranks_end_with_rank_0(end: str) -> None:
    argv = [sys.executable, "-c", SCRIPT, end]
    proc = subprocess.Popen(argv, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=180)
    assert "CHECKSUM" in out, err[-3000:]
    assert proc.returncode == (0 if end == "exit" else 9)
    deadline = time.monotonic() + 20
    while children_of(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert children_of(proc.pid) == [], f"rank 1 outlived rank 0 ({end})"
    if end == "exit":
        assert '"rank_stopped"' in err  # told to stop, not left to time out
