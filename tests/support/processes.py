"""Finding processes by their command line (Linux /proc), for tests that check nothing is left
behind. Only this test process's own count: every process it starts inherits OWNER_ENV (set
by tests/conftest.py, one value per pytest process), so a vLLM server that a test on another
pytest-xdist worker (or another suite on the machine) runs is not taken for a leftover here."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

OWNER_ENV = "JETRL_TEST_OWNER"


def mark_own_processes() -> None:
    """Every process started from here on (and their children) carries this process's mark."""
    os.environ[OWNER_ENV] = uuid.uuid4().hex


def vllm_processes() -> list[int]:
    """Pids of live vLLM processes this test process started: servers, and the engine cores and
    workers they start (which name themselves ``VLLM::...``)."""
    mark = f"{OWNER_ENV}={os.environ[OWNER_ENV]}".encode()
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
            state = (proc / "stat").read_text().split(") ", 1)[1][:1]
            if state == "Z" or not (cmd.startswith(b"VLLM::") or b"vllm.entrypoints" in cmd):
                continue
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if mark in environ:
            out.append(int(proc.name))
    return out
