"""How the supervisor starts a part's process: forked from a server that imported the parts'
modules once, instead of a fresh interpreter per part.

A part is still its own process, with its own pid, session, log file, environment and exit
code, killed and restarted like any other (tests/system/test_faults.py kills them). Only its
start is cheaper: importing torch and torchtitan's model code takes 6-8 s of CPU a process
(torchtitan's attention module pulls in inductor and dynamo), and a run starts four such
processes on a machine that may have two cores, before any restart. The fork server
(multiprocessing's ``forkserver``) pays that once and each part is a fork of it, a fraction of
a second.

Only ``python -m MODULE ARGS`` commands are forked; anything else (torchrun's trainer of
several ranks) is started with :class:`subprocess.Popen` as before. ``[run] fork_parts =
false`` starts every part as a fresh interpreter.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.context
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import setproctitle

import jetrl

# What the fork server imports before it forks anything: every part's entry point and the
# model code behind the embedded engines (the costly imports), after the module that takes the
# fork server out of the process group a signal to the supervisor's job reaches.
PRELOAD = (
    "jetrl.deploy.fork_server_group",  # first: out of the supervisor's process group
    "jetrl.policy.models",
    "jetrl.consumers.inference.worker",
    "jetrl.consumers.inference.titan_engine",
    "jetrl.consumers.trainer.trainer",
    "jetrl.consumers.trainer.local_engine",
    "jetrl.consumers.recorder.recorder",
    "jetrl.consumers.monitor.service",
    "jetrl.producers.producer",
)

# Set to this process's pid before the fork server starts: how it knows itself.
FORK_SERVER_STARTER = "JETRL_FORK_SERVER_STARTER"

_lock = threading.Lock()
_context: multiprocessing.context.ForkServerContext | None = None


class PartProcess(Protocol):
    """What the supervisor (and a test) does with a part's process: :class:`subprocess.Popen`
    has all of it."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class ShadowedPackage(ValueError):
    """The working folder holds a ``jetrl`` package other than the one this process runs."""


def check_working_folder(cwd: Path | None = None) -> None:
    """Refuse to start parts from a folder holding another ``jetrl`` package (another checkout):
    a part imports the working folder's first (the fork server and ``python -m`` put it first on
    their path; Python 3.11's fork server ignores the path its parent hands it), so its parts
    would run that code while this process runs its own."""
    here = Path(jetrl.__file__).resolve().parent
    there = (cwd or Path.cwd()) / "jetrl" / "__init__.py"
    if there.is_file() and there.resolve().parent != here:
        raise ShadowedPackage(
            f"the working folder holds another jetrl package ({there.parent}), which the parts "
            f"would import instead of this one ({here}): start the run from another folder"
        )


def fork_server() -> multiprocessing.context.ForkServerContext:
    """The process-wide fork server, started (and its modules imported) on first use."""
    global _context
    with _lock:
        if _context is None:
            # The fork server, this process's child, leaves this process's group at its start
            # (deploy/fork_server_group.py): it knows itself by this.
            os.environ[FORK_SERVER_STARTER] = str(os.getpid())
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(list(PRELOAD))
            _context = ctx
        return _context


def warm_up() -> None:
    """Start the fork server now (in the background of whatever the caller does next), so the
    first part does not wait for its imports."""
    from multiprocessing import forkserver

    fork_server()
    threading.Thread(target=forkserver.ensure_running, name="forkserver-warm-up", daemon=True).start()


def process_start_time(pid: int) -> str | None:
    """When process ``pid`` started (``/proc/<pid>/stat``'s field 22): with the pid, which
    process it is; None once it has ended (a zombie has)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


class ForkedPart:
    """A part forked from the fork server, seen through :class:`PartProcess`.

    Its exit code comes from the fork server, which reaps it. Should the fork server end first
    (killed alone: out of memory, say), multiprocessing reports every part it forked as ended
    with 255; a part whose pid still runs the same process is taken as running, watched and
    signalled by its pid, and reports 255 when it ends (its own code is lost with the server).
    Without this the supervisor would restart parts that still run, a second trainer beside
    the first."""

    def __init__(self, proc: multiprocessing.process.BaseProcess, args: list[str]) -> None:
        self._proc = proc
        self.args = args
        self._born = process_start_time(self.pid)

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None  # started
        return self._proc.pid

    def _orphaned(self) -> bool:
        """The fork server is gone and the part still runs."""
        if self._proc.exitcode is None or self._born is None:
            return False
        return process_start_time(self.pid) == self._born

    @property
    def returncode(self) -> int | None:
        return None if self._orphaned() else self._proc.exitcode

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._proc.join(timeout)
        while self._orphaned():
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        code = self.returncode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _module_of(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(module, args)`` of ``[this python, -m, module, *args]``; None for any other command."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m":
        return argv[2], argv[3:]
    return None


def _placed(nice: int, cpus: frozenset[int] | None) -> Callable[[], None] | None:
    """What a fresh part's child does before it execs (two system calls: safe there)."""
    if not nice and cpus is None:
        return None

    def place() -> None:
        if nice:
            os.nice(nice)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    return place


def _run_forked(
    module: str,
    args: list[str],
    env: dict[str, str],
    log_path: str,
    cwd: str,
    nice: int = 0,
    cpus: frozenset[int] | None = None,
) -> None:
    """The part's life in the forked child: its own session, log, environment, threads, cores
    and priority, then its module as ``python -m`` runs it (its SystemExit is the exit code)."""
    if (place := _placed(nice, cpus)) is not None:
        place()  # first: every thread the part starts inherits its priority and cores
    # ps and /proc show the command a fresh process would have had, not the fork server's.
    setproctitle.setproctitle(" ".join([sys.executable, "-m", module, *args]))
    os.setsid()  # killed as a group, like a part started with start_new_session
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # The server imported torch before this process's OMP_NUM_THREADS existed: apply it here.
    torch = sys.modules.get("torch")
    if torch is not None and env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [module, *args]
    sys.modules.pop(module, None)  # run as __main__, not as the module the server may hold
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        # A forked child ends with os._exit: run what the part registered, as an interpreter's
        # exit would (a parallel engine's group leaves at exit).
        atexit._run_exitfuncs()


def start_part(
    argv: list[str],
    env: Mapping[str, str],
    log_path: Path,
    *,
    fork: bool = True,
    nice: int = 0,
    cpus: frozenset[int] | None = None,
) -> PartProcess:
    """Start one part, its output appended to ``log_path``: forked when it is a ``python -m``
    command and ``fork`` holds, else a fresh process; ``nice`` is added to its niceness and
    ``cpus`` (None: any) are the cores it may run on (deploy/cores.py)."""
    target = _module_of(argv) if fork else None
    if target is None:
        with log_path.open("ab") as out:
            return subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env),
                start_new_session=True,
                preexec_fn=_placed(nice, cpus),
            )
    module, args = target
    proc = fork_server().Process(
        target=_run_forked,
        args=(module, args, dict(env), str(log_path), os.getcwd(), nice, cpus),
        name=module,
        daemon=False,
    )
    proc.start()
    return ForkedPart(proc, argv)
