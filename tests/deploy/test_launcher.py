"""deploy/launcher.py: a part forked from the fork server is a process like one started fresh:
its own pid and session, its log, its environment and thread count, its exit code, killable."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import jetrl
from jetrl.deploy.config import load_config
from jetrl.deploy.launcher import (
    ForkedPart,
    ShadowedPackage,
    check_working_folder,
    process_start_time,
    start_part,
)
from jetrl.deploy.supervisor import Supervisor

CHILD = [sys.executable, "-m", "tests.support.forked_child"]


def wait_for(proc: object, timeout: float = 60.0) -> int:
    assert hasattr(proc, "wait")
    return int(proc.wait(timeout))


@pytest.mark.parametrize("fork", [True, False])
def test_a_part_reports_what_it_was_started_with(fork: bool, tmp_path: Path) -> None:
    log = tmp_path / "part.log"
    env = dict(os.environ, JETRL_TEST_VALUE="seen", OMP_NUM_THREADS="1")
    proc = start_part([*CHILD, "report", "3"], env, log, fork=fork)
    assert isinstance(proc, ForkedPart) is fork
    assert wait_for(proc) == 3 and proc.returncode == 3 and proc.poll() == 3
    out = log.read_text().splitlines()
    seen = json.loads(out[0])
    assert seen["argv"] == ["report", "3"] and seen["env"] == "seen" and seen["threads"] == 1
    assert seen["pid"] == proc.pid and seen["sid"] == proc.pid  # a session of its own
    assert seen["cwd"] == os.getcwd() and seen["main"] == "__main__"
    assert seen["cmdline"] == " ".join([*CHILD, "report", "3"])  # what ps shows, forked or not
    assert out[1] == "to stderr"  # both streams in the part's log


@pytest.mark.parametrize("fork", [True, False])
def test_a_part_given_cores_runs_on_those_only(fork: bool, tmp_path: Path) -> None:
    log = tmp_path / "part.log"
    one = frozenset([max(os.sched_getaffinity(0))])  # one of the cores this test may use
    proc = start_part([*CHILD, "report", "0"], dict(os.environ), log, fork=fork, cpus=one)
    assert wait_for(proc) == 0
    assert json.loads(log.read_text().splitlines()[0])["cpus"] == sorted(one)


@pytest.mark.parametrize("fork", [True, False])
def test_a_part_started_nicer_runs_at_that_priority(fork: bool, tmp_path: Path) -> None:
    log = tmp_path / "part.log"
    proc = start_part([*CHILD, "report", "0"], dict(os.environ), log, fork=fork, nice=7)
    assert wait_for(proc) == 0
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert json.loads(log.read_text().splitlines()[0])["nice"] == min(19, mine + 7)


def test_a_forked_part_is_killed_and_waited_for_like_a_process(tmp_path: Path) -> None:
    proc = start_part([*CHILD, "sleep", "60"], dict(os.environ), tmp_path / "p.log")
    assert isinstance(proc, ForkedPart) and proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # how the supervisor ends a stuck part's session
    assert wait_for(proc) == -signal.SIGKILL
    proc.send_signal(signal.SIGTERM)  # a signal to a finished part is a no-op, as for Popen


def test_a_forked_part_that_raises_exits_1_with_its_traceback_in_its_log(tmp_path: Path) -> None:
    log = tmp_path / "p.log"
    proc = start_part([*CHILD, "raise"], dict(os.environ), log)
    assert wait_for(proc) == 1
    assert "RuntimeError: the part failed" in log.read_text()


@pytest.mark.parametrize("fork", [True, False])
def test_what_a_part_registers_to_run_at_exit_runs(fork: bool, tmp_path: Path) -> None:
    log = tmp_path / "p.log"
    assert wait_for(start_part([*CHILD, "atexit"], dict(os.environ), log, fork=fork)) == 0
    assert log.read_text() == "left at exit\n"


def test_commands_other_than_python_m_start_fresh(tmp_path: Path) -> None:
    log = tmp_path / "p.log"
    proc = start_part(["/bin/sh", "-c", "echo fresh; exit 4"], dict(os.environ), log)
    assert isinstance(proc, subprocess.Popen)
    assert wait_for(proc) == 4 and log.read_text() == "fresh\n"


def test_parts_started_together_each_finish_either_way(tmp_path: Path) -> None:
    # Speed lives in bench/ (no timing here): several parts at once, forked and fresh.
    for fork in (True, False):
        procs = [
            start_part([*CHILD, "report", "0"], dict(os.environ), tmp_path / f"{fork}-{i}.log", fork=fork)
            for i in range(3)
        ]
        deadline = time.monotonic() + 120
        assert [wait_for(p, max(1.0, deadline - time.monotonic())) for p in procs] == [0, 0, 0]


# A supervisor in miniature, in a session of its own: it starts a forked part, then waits for
# SIGTERM and reports how its part looks from there. Its fork server preloads only the module
# under test (the parts' heavy imports are not what this is about).
SUPERVISOR = """
import os, signal, sys, threading, time
from pathlib import Path
from jetrl.deploy import launcher
launcher.PRELOAD = launcher.PRELOAD[:1]
part = launcher.start_part(
    [sys.executable, "-m", "tests.support.forked_child", "sleep", "60"], dict(os.environ), Path(sys.argv[1])
)
got = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: got.set())
while os.getsid(part.pid) != part.pid:  # the part is in a session of its own
    time.sleep(0.01)
print("ready", part.pid, flush=True)
got.wait(60)
print("after", part.poll(), flush=True)
part.kill()
print("ended", part.wait(30), flush=True)
"""


def test_a_signal_to_the_supervisor_s_process_group_leaves_its_parts_in_its_hands(tmp_path: Path) -> None:
    """`timeout`, `kill -TERM -PGID`: the signal reaches the supervisor, not the fork server
    (deploy/fork_server_group.py), so the supervisor still sees its part running and stops it."""
    from jetrl.deploy.launcher import PRELOAD

    assert PRELOAD[0] == "jetrl.deploy.fork_server_group"  # before the imports that take seconds
    sup = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(tmp_path / "part.log")],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a job's
    )
    part = None
    try:
        assert sup.stdout is not None
        ready = sup.stdout.readline().split()
        assert ready[0] == "ready"
        part = int(ready[1])
        os.killpg(sup.pid, signal.SIGTERM)
        out = [*sup.stdout.readline().split(), *sup.stdout.readline().split()]
    finally:
        _end(sup, part)
    assert out == ["after", "None", "ended", str(-signal.SIGKILL)], out  # alive until it was stopped


# The fork server killed alone (out of memory, say) while the part it forked runs on.
SERVER_KILLED = """
import os, signal, subprocess, sys, time
from multiprocessing import forkserver
from pathlib import Path
from jetrl.deploy import launcher
launcher.PRELOAD = launcher.PRELOAD[:1]
part = launcher.start_part(
    [sys.executable, "-m", "tests.support.forked_child", "sleep", "60"], dict(os.environ), Path(sys.argv[1])
)
print("part", part.pid, flush=True)
os.kill(forkserver._forkserver._forkserver_pid, signal.SIGKILL)
while part._proc.exitcode is None:  # multiprocessing's view: the part ended (255)
    time.sleep(0.01)
print("seen", part._proc.exitcode, part.poll(), flush=True)
try:
    part.wait(0.2)
    print("waited", flush=True)
except subprocess.TimeoutExpired:
    print("running", flush=True)
part.send_signal(signal.SIGTERM)
print("ended", part.wait(30), part.poll(), flush=True)
"""


def test_a_part_whose_fork_server_is_killed_is_still_seen_running_and_stopped(tmp_path: Path) -> None:
    """Not restarted while it runs (a second trainer beside the first): it is running until its
    pid ends, signalled by its pid; its exit code is lost with the server (255)."""
    run = subprocess.Popen(
        [sys.executable, "-c", SERVER_KILLED, str(tmp_path / "part.log")],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    part = None
    try:
        assert run.stdout is not None
        part = int(run.stdout.readline().split()[1])
        out = [run.stdout.readline().split() for _ in range(3)]
    finally:
        _end(run, part)
    assert out == [["seen", "255", "None"], ["running"], ["ended", "255", "255"]], out
    assert process_start_time(part) is None  # the SIGTERM by pid ended it (gone, or a zombie of init's)


def _end(script: subprocess.Popen[str], part: int | None) -> None:
    """The script's session and its part's, whatever the test found: the part outlives a
    script that lost track of it."""
    for group in (script.pid, part):
        if group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
    script.wait()


def test_parts_are_not_started_from_a_folder_holding_another_jetrl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part imports the working folder's jetrl first (the fork server's path and `python -m`'s
    begin with it): started from another checkout's folder, the parts would run its code while the
    supervisor runs its own. `jetrl run` says so and exits 2; a supervisor starting no parts here,
    or run from the package's own folder, is let be."""
    shadow = tmp_path / "checkout"
    (shadow / "jetrl").mkdir(parents=True)
    (shadow / "jetrl" / "__init__.py").write_text("")
    cli = Path(sys.executable).parent / "jetrl"
    got = subprocess.run([str(cli), "run"], cwd=shadow, capture_output=True, text=True, timeout=120)
    assert got.returncode == 2, got.stdout + got.stderr
    assert "another jetrl package" in got.stdout and str(shadow / "jetrl") in got.stdout
    monkeypatch.chdir(shadow)
    with pytest.raises(ShadowedPackage):
        Supervisor(load_config(None, []), "shadowed", tmp_path / "run")
    Supervisor(load_config(None, []), "remote", tmp_path / "run", local=frozenset())
    check_working_folder(tmp_path)  # no jetrl there
    check_working_folder(Path(jetrl.__file__).resolve().parents[1])  # this package's own folder
