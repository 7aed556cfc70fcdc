"""The reaper every vLLM server runs under (consumers/inference/vllm_ext/jetrl_vllm_reaper.py),
on a plain command standing for the server and its engine processes: a part that does not
stop in time is SIGKILLed with its whole process group (deploy/supervisor.py), and the
server's group must go with it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from jetrl.consumers.inference.vllm_engine import start_reaped

# The "server": a child of its own (vLLM's engine core), both pids on stdout, then it waits.
SERVER = (
    "import os, subprocess, sys, time; "
    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "print(os.getpid(), c.pid, flush=True); time.sleep(600)"
)
# The "inference worker": starts the server as vllm_engine does, then waits.
PART = (
    "import sys, time; "
    "from jetrl.consumers.inference.vllm_engine import start_reaped; "
    f"start_reaped([sys.executable, '-c', {SERVER!r}]); time.sleep(600)"
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][:1]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_the_server_and_its_scratch_go_with_a_part_killed_as_a_group(tmp_path: Path) -> None:
    scratch = tmp_path / "jetrl-vllm-x"
    (scratch / "sub").mkdir(parents=True)
    (scratch / "vllm.log").write_text("the server's log")
    part = subprocess.Popen(
        [sys.executable, "-c", PART],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "JETRL_VLLM_SCRATCH": str(scratch)},
    )
    pids: list[int] = []
    try:
        assert part.stdout is not None
        pids = [int(x) for x in part.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids), pids
        os.killpg(part.pid, signal.SIGKILL)
        part.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "the server outlived its part"
        while time.monotonic() < deadline and scratch.exists():
            time.sleep(0.1)
        assert not scratch.exists(), "the killed part's scratch folder (the server's sockets) was left"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(part.pid, signal.SIGKILL)
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def test_a_server_that_exits_leaves_its_log_for_the_engine(tmp_path: Path) -> None:
    # Its engine is alive and reads the log's tail into its error: the reaper must not remove it.
    scratch = tmp_path / "jetrl-vllm-y"
    scratch.mkdir()
    (scratch / "vllm.log").write_text("why the server stopped")
    env = {**os.environ, "JETRL_VLLM_SCRATCH": str(scratch)}
    proc = start_reaped([sys.executable, "-c", "raise SystemExit(3)"], env)
    assert proc.wait(30) == 3
    assert (scratch / "vllm.log").read_text() == "why the server stopped"
