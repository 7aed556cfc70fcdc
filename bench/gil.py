"""The demo's train call beside other Python work: in the same process, or in another.

    python bench/gil.py [--calls 30] [--rounds 2] [--busy-ms 5] [--period-ms 14]

About 30 seconds on 2 cores. The demo's trainer (configs/demo.toml: its model, its engine on
one torch thread) trains on one batch of the demo's rollouts (sampled once from the fresh
model), ``--calls`` times in a row, and the median call is timed in three settings, round after
round (the machine's speed drifts):

* alone;
* beside a thread of the same process busy in Python ``--busy-ms`` of every ``--period-ms``
  (the trainer's event loop does about this much: ~15 ms of CPU in a ~60 ms step), then the
  same with the interpreter's switch interval at 0.2 ms instead of 5;
* beside a process doing the same (on a second core, if the machine has one).

The train call of a small model is many small ops, each giving the interpreter lock up and
waiting to take it back: beside a busy thread it waits behind that thread's Python, so work put
beside the train call in the trainer's process slows it by more than the work itself; in
another process it does not. Why the trainer takes its steps' events and its next groups
between train calls, not during them (docs/running.md, "The train call in a process of its
own, tried"). Ends with one summary line per setting, its ratio to the train call alone.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from overhead import ROOT, loop_parts, sample_batch

from jetrl.deploy.config import load_config

SETTINGS = ("alone", "busy thread", "busy thread, switch 0.2 ms", "busy process")


def busy(stop: Any, busy_s: float, period_s: float) -> None:
    """Python work (dict stores of new strings) ``busy_s`` of every ``period_s`` until ``stop``."""
    scratch: dict[int, str] = {}
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < busy_s:
            for i in range(200):
                scratch[i] = str(i) + "a"
        time.sleep(max(period_s - busy_s, 0.0))


def demo_batch(root: Path) -> tuple[Callable[[], object], int]:
    """The demo trainer's train call on one batch of its rollouts (sampled as bench/overhead.py's
    loop samples a step), and the batch's size."""
    cfg = load_config(ROOT / "configs" / "demo.toml", ["--store.recorder", "false"])
    loop = loop_parts(cfg, root, threads=1)
    rng = random.Random(cfg.run.seed)
    batch, _, _ = sample_batch(cfg, loop, rng, torch.Generator().manual_seed(cfg.run.seed))
    return (lambda: loop.engine.step(batch)), len(batch)


def median_call_ms(call: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def measure(call: Callable[[], object], setting: str, args: argparse.Namespace) -> float:
    """The median train call in ``setting``."""
    if setting == "alone":
        return median_call_ms(call, args.calls)
    stop: Any
    runner: Any  # a process or a thread, started and joined alike
    work = (args.busy_ms / 1000, args.period_ms / 1000)
    if setting == "busy process":
        ctx = mp.get_context("fork")
        stop = ctx.Event()
        runner = ctx.Process(target=busy, args=(stop, *work), daemon=True)
    else:
        stop = threading.Event()
        runner = threading.Thread(target=busy, args=(stop, *work), daemon=True)
    old = sys.getswitchinterval()
    if setting.endswith("0.2 ms"):
        sys.setswitchinterval(0.0002)
    runner.start()
    try:
        return median_call_ms(call, args.calls)
    finally:
        stop.set()
        runner.join()
        sys.setswitchinterval(old)


def summary_lines(rounds: list[dict[str, float]], cores: int) -> list[str]:
    """One line a setting: the median over rounds of its ratio to the train call alone in the
    same round."""
    if not rounds:
        return ["train call: too few rounds to measure (none completed)"]
    alone = statistics.median(r["alone"] for r in rounds)
    out = [f"train call alone {alone:.1f} ms (median of {len(rounds)} rounds)"]
    why = {
        "busy thread": "the interpreter lock: work beside the train call belongs in another process",
        "busy thread, switch 0.2 ms": "a shorter switch interval does not give the lock back soon enough",
        "busy process": "another process costs the train call only a core"
        + ("" if cores > 1 else " (this machine has one: the process takes it)"),
    }
    for setting in SETTINGS[1:]:
        ratios = [r[setting] / r["alone"] for r in rounds if setting in r and r.get("alone")]
        if not ratios:
            out.append(f"train call beside a {setting}: too few rounds to measure")
            continue
        out.append(
            f"train call beside a {setting}/alone {statistics.median(ratios):.2f}x "
            f"(median of {len(ratios)} rounds; {why[setting]})"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--busy-ms", type=float, default=5.0)
    ap.add_argument("--period-ms", type=float, default=14.0)
    args = ap.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        call, size = demo_batch(Path(tmp))
        call()  # the first call allocates what later ones reuse
        print(
            f"the demo's train call on one torch thread, {size} rollouts, {args.calls} calls a setting; "
            f"the busy work {args.busy_ms:g} ms of every {args.period_ms:g}; {cores} cores",
            flush=True,
        )
        rounds: list[dict[str, float]] = []
        for r in range(args.rounds):
            got = {}
            for setting in SETTINGS:
                got[setting] = measure(call, setting, args)
                print(f"round {r + 1}: {setting:<28} {got[setting]:6.1f} ms", flush=True)
            rounds.append(got)
    print()
    print("\n".join(summary_lines(rounds, cores)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
