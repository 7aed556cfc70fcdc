"""Off-policy steps: the demo's steps to its reward target when every rollout is a version or
more stale, with and without the ratio clip, against on-policy training.

One process, no bus, so that only the maths differs (bench/overhead.py's loop: the demo's
task, model, seeds and hyper-parameters, the embedded sampler in the inference precision, the
single-process train engine). With ``lag`` k, the batch of step s is sampled by version
max(0, s - k): the worst case of ``max_off_policy_steps = k``, where a live run mixes
staleness 0 and k. Each (lag, clip) trains every seed to the demo's target (a 10-step mean
reward of 0.92) or to ``--max-steps``:

* lag 0, the clip the demo trains with: on-policy, the baseline;
* lag k without the clip (``ratio_clip = 0``: only the train/inference mismatch mask);
* lag k with it (``ratio_clip``, default the trainer's 0.2).

It prints each seed's steps and the median over seeds, ends with one line per headline figure,
and draws the reward curves of one seed (``--plot``, default bench/out/offpolicy.png).

    python bench/offpolicy.py [--seeds 0 1 2 3 4] [--lag 1] [--clip 0.2] [--max-steps 1500]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from overhead import LOOP_THREADS, one_process

from jetrl.bus.log import configure
from jetrl.deploy.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 1.2  # steps to target under asynchrony, against on-policy


@dataclass
class Curve:
    """One training: the mean reward of each step, and the step that reached the target."""

    rewards: list[float] = field(default_factory=list)
    reached: int | None = None


def train(seed: int, lag: int, clip: float, max_steps: int, threads: int) -> Curve:
    over = ["--run.seed", str(seed), "--trainer.max_steps", str(max_steps), "--store.recorder", "false"]
    cfg = load_config(ROOT / "configs" / "demo.toml", [*over, "--trainer.ratio_clip", str(clip)])
    curve = Curve()
    with tempfile.TemporaryDirectory() as tmp:
        seconds, steps = one_process(cfg, Path(tmp), threads, lag=lag, curve=curve.rewards)
    curve.reached = steps if seconds is not None else None
    return curve


def plot(curves: dict[str, Curve], seed: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, c in curves.items():
        smooth = [
            sum(c.rewards[max(0, i - 9) : i + 1]) / len(c.rewards[max(0, i - 9) : i + 1])
            for i in range(len(c.rewards))
        ]
        ax.plot(range(len(smooth)), smooth, label=f"{label} ({c.reached or 'not reached'})")
    ax.axhline(0.92, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (10-step mean)")
    ax.set_title(f"the demo, seed {seed}: on-policy and one version stale, with and without the ratio clip")
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def median(xs: list[int | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return statistics.median(got) if len(got) == len(xs) and got else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--lag", type=int, default=1)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--max-steps", type=int, default=1500)
    ap.add_argument("--threads", type=int, default=LOOP_THREADS)
    ap.add_argument("--plot", type=Path, default=ROOT / "bench" / "out" / "offpolicy.png")
    args = ap.parse_args()
    configure("warning")
    modes = {
        f"lag 0, clip {args.clip:g}": (0, args.clip),
        f"lag {args.lag}, no clip": (args.lag, 0.0),
        f"lag {args.lag}, clip {args.clip:g}": (args.lag, args.clip),
    }
    steps: dict[str, list[int | None]] = {m: [] for m in modes}
    for seed in args.seeds:
        curves: dict[str, Curve] = {}
        for mode, (lag, clip) in modes.items():
            t0 = time.perf_counter()
            curves[mode] = c = train(seed, lag, clip, args.max_steps, args.threads)
            steps[mode].append(c.reached)
            shown = c.reached if c.reached is not None else f"not reached in {args.max_steps}"
            print(f"seed {seed}: {mode:<22} {shown} steps ({time.perf_counter() - t0:.0f} s)", flush=True)
        if seed == args.seeds[0]:
            plot(curves, seed, args.plot)
    print()
    print(f"{'mode':<24}" + "".join(f"{'seed ' + str(s):>10}" for s in args.seeds) + f"{'median':>10}")
    for mode, xs in steps.items():
        cells = "".join(f"{x if x is not None else '-':>10}" for x in xs)
        m = median(xs)
        print(f"{mode:<24}{cells}{(f'{m:.0f}' if m is not None else '-'):>10}")
    print(f"(reward curves of seed {args.seeds[0]}: {args.plot})")
    print()
    base = median(steps[f"lag 0, clip {args.clip:g}"])
    for mode in list(modes)[1:]:
        m = median(steps[mode])
        if base is None or m is None:
            print(f"steps to target {mode} / on-policy: not measured (a seed did not reach the target)")
        else:
            print(f"steps to target {mode} / on-policy {m / base:.2f}x (target <= {TARGET_RATIO}x)")


if __name__ == "__main__":
    main()
