"""Finding processes by their command line (Linux /proc), for tests that check nothing is left
behind."""

from __future__ import annotations

from pathlib import Path


def vllm_processes() -> list[int]:
    """Pids of live vLLM processes: servers, and the engine cores and workers they start (which
    name themselves ``VLLM::...``)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
            state = (proc / "stat").read_text().split(") ", 1)[1][:1]
        except (OSError, IndexError):
            continue
        if state != "Z" and (cmd.startswith(b"VLLM::") or b"vllm.entrypoints" in cmd):
            out.append(int(proc.name))
    return out
