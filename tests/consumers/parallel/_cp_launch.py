"""Run a function as the ranks of a CPU (gloo) process group, each rank its own process.

``launch("pkg.module:fn", world, out_dir)`` starts ``world`` interpreters running this file; each
joins the group through a file store under ``out_dir`` (no TCP port to pick, so no
race for a free one) and calls ``fn(rank, world, out_dir)``, which leaves its results in
``out_dir`` for the test to read. The first rank to fail stops the others (a peer blocked in a
collective would otherwise wait for the group's timeout), and past ``timeout_s`` every rank is
stopped, after dumping its stack to its log, so a hang fails the test instead of blocking it.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
GROUP_TIMEOUT_S = 120.0  # a collective waiting longer than this raises in the rank


def _log(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank{rank}.log"


def _tails(out_dir: Path, world: int, chars: int = 4000) -> str:
    return "\n".join(
        f"--- rank {r} ---\n{_log(out_dir, r).read_text(errors='replace')[-chars:]}" for r in range(world)
    )


def launch(target: str, world: int, out_dir: Path, *, timeout_s: float = 240.0) -> None:
    """Run ``target`` ("module:function") on ``world`` gloo ranks; raise if any rank fails or
    they are not all done within ``timeout_s``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    store = out_dir / "pg_store"
    store.unlink(missing_ok=True)  # the file store must start empty
    env = dict(os.environ)
    # The ranks share the machine's cores: one thread each, and no pool of inductor compile
    # workers per rank (torch.compile'd code, e.g. flex attention, would start one each).
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(world):
            with _log(out_dir, rank).open("wb") as log:
                cmd = [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    target,
                    str(rank),
                    str(world),
                    str(store),
                    str(out_dir),
                ]
                procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                raise RuntimeError(
                    f"rank {failed[0]} exited with {codes[failed[0]]}\n{_tails(out_dir, world)}"
                )
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                _stop(procs)
                raise TimeoutError(f"ranks not done after {timeout_s:.0f} s\n{_tails(out_dir, world)}")
            time.sleep(0.1)
    finally:
        _stop(procs)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.terminate()  # SIGTERM: faulthandler writes the rank's stacks to its log first
    for p in live:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _main(argv: list[str]) -> None:
    target, rank, world, store, out_dir = argv
    faulthandler.register(signal.SIGTERM, chain=True)
    import torch.distributed as dist

    module, _, name = target.partition(":")
    fn: Callable[[int, int, Path], None] = getattr(importlib.import_module(module), name)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=int(rank),
        world_size=int(world),
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    try:
        fn(int(rank), int(world), Path(out_dir))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1:])
