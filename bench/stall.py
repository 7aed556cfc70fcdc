"""How often the demo's training stalls, and what a stalled run looks like.

One process, no bus (bench/overhead.py's loop: the demo's task, model and hyper-parameters, the
embedded sampler in the inference precision, the single-process train engine), so that only the
randomness differs: each model seed (its init) is trained with ``--samples`` sampling seeds (the
tasks drawn and the tokens sampled) to the demo's target, a 10-step mean reward of 0.92, or to
``--max-steps``. A run that does not reach it is stalled; for it the bench prints the last 100
steps' mean reward, the share of groups whose rewards were all alike (``groups_no_signal``: no
advantage to learn from) and the policy's entropy, which tell a collapse (alike groups, entropy
near 0) from slow learning.

``--set KEY VALUE`` overrides the demo's config (``--set trainer.lr 1e-3`` trains faster and
stalls more often: a stress test of a remedy). ``--jobs`` runs that many trainings side by side,
each on ``--threads`` torch threads.

    python bench/stall.py [--seeds 0 1 2 3 4] [--samples 2] [--lag 1] [--set KEY VALUE ...]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
from overhead import one_process

from jetrl.bus.log import configure
from jetrl.consumers.trainer.groups import share_without_signal
from jetrl.deploy.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TAIL = 100  # the steps a stalled run is described by


@dataclass(frozen=True)
class Outcome:
    seed: int
    sample: int
    reached: int | None  # steps to the target; None: stalled
    seconds: float
    reward: float  # the last TAIL steps' means
    no_signal: float
    entropy: float


def train(job: tuple[int, int, int, int, int, list[str]]) -> Outcome:
    seed, sample, lag, max_steps, threads, sets = job
    configure("warning")
    over = ["--run.seed", str(seed), "--trainer.max_steps", str(max_steps), "--store.recorder", "false"]
    for key, value in zip(sets[::2], sets[1::2], strict=True):
        over += [f"--{key}", value]
    cfg = load_config(ROOT / "configs" / "demo.toml", over)
    rewards: deque[float] = deque(maxlen=TAIL)
    alike: deque[float] = deque(maxlen=TAIL)
    entropy: deque[float] = deque(maxlen=TAIL)

    def on_step(r: torch.Tensor, metrics: dict[str, float]) -> None:
        rewards.append(float(r.mean()))
        alike.append(share_without_signal(r.tolist()))  # the trainer's groups_no_signal
        entropy.append(float(metrics.get("entropy", float("nan"))))

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        seconds, steps = one_process(cfg, Path(tmp), threads, lag=lag, sample_seed=sample, on_step=on_step)
    mean = statistics.fmean
    return Outcome(
        seed,
        sample,
        steps if seconds is not None else None,
        time.perf_counter() - t0,
        mean(rewards) if rewards else float("nan"),
        mean(alike) if alike else float("nan"),
        mean(entropy) if entropy else float("nan"),
    )


def describe(o: Outcome, max_steps: int) -> str:
    head = f"seed {o.seed} sample {o.sample:>4}: "
    if o.reached is not None:
        return head + f"reached in {o.reached} steps ({o.seconds:.0f} s)"
    return head + (
        f"stalled: not reached in {max_steps} steps ({o.seconds:.0f} s); last {TAIL} steps: reward "
        f"{o.reward:.3f}, groups alike {100 * o.no_signal:.0f}%, entropy {o.entropy:.3f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--samples", type=int, default=2, help="sampling seeds per model seed")
    ap.add_argument("--lag", type=int, default=1, help="steps between the sampling and the training version")
    ap.add_argument("--max-steps", type=int, default=1500)
    ap.add_argument("--set", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    cpus = os.cpu_count() or 1
    ap.add_argument("--jobs", type=int, default=min(2, cpus))
    ap.add_argument("--threads", type=int, default=None, help="torch threads a training (default cores/jobs)")
    args = ap.parse_args()
    threads = args.threads or max(1, cpus // args.jobs)
    sets = [x for pair in args.set for x in pair]
    jobs = [
        (seed, 1000 + 100 * i + seed, args.lag, args.max_steps, threads, sets)
        for i in range(args.samples)
        for seed in args.seeds
    ]
    shown = " ".join(f"{k}={v}" for k, v in args.set) or "the demo's"
    print(f"{len(jobs)} trainings, lag {args.lag}, settings: {shown}; {args.jobs} at a time", flush=True)
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        outcomes = []
        for o in pool.imap_unordered(train, jobs):
            print(describe(o, args.max_steps), flush=True)
            outcomes.append(o)
    reached = sorted(o.reached for o in outcomes if o.reached is not None)
    stalled = [o for o in outcomes if o.reached is None]
    print()
    print(f"stalled runs {len(stalled)} of {len(outcomes)} ({shown}) (target 0)")
    if reached:
        print(
            f"steps to target median {statistics.median(reached):.0f}, slowest {reached[-1]} "
            f"({len(reached)} runs that reached it)"
        )
    else:
        print("steps to target: no run reached it")


if __name__ == "__main__":
    main()
