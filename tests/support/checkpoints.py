"""Checkpoints that several tests serve unchanged, made once per test session: the first pytest
process to ask makes it, the others (pytest-xdist workers) wait on a lock and read it."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from jetrl.deploy.tiny_hf_cmd import make_checkpoint, warm_start


def shared_dir(base: Path) -> Path:
    """A folder every worker of this test session sees: pytest-xdist gives each its own temp
    folder under a common one."""
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


def warm_tiny_moe(base: Path, steps: int = 150) -> Path:
    """The tiny Qwen3-MoE checkpoint (seed 0) warm-started `steps` steps, so that its answers
    score: a run on it has signal from its first step. Made once (15 s on two cores), read-only
    after."""
    path = shared_dir(base) / f"tiny-moe-warm{steps}"
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not path.is_dir():
            part = path.with_name(path.name + ".part")
            shutil.rmtree(part, ignore_errors=True)
            make_checkpoint(part, "moe", seed=0)
            warm_start(part, steps, seed=0)
            part.rename(path)  # whole or absent, for the workers that wait
    return path
