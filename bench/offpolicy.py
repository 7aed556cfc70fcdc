"""Off-policy steps: the demo's steps to its reward target when every rollout is a version or
more stale, with and without the ratio clip, against on-policy training; with ``--hold``, also
whether the reward holds once the target is reached.

One process, no bus, so that only the maths differs (bench/overhead.py's loop: the demo's
task, model, seeds and hyper-parameters, the embedded sampler in the inference precision, the
single-process train engine). With ``lag`` k, the batch of step s is sampled by version
max(0, s - k): the worst case of ``max_off_policy_steps = k``, where a live run mixes
staleness 0 and k. Each mode trains every seed to the demo's target (a 10-step mean reward of
0.92) or to ``--max-steps``:

* lag 0: on-policy, the baseline (the demo's settings);
* lag k without the clip (``ratio_clip = 0``: only the train/inference mismatch mask);
* lag k with dual-clip PPO's bound at 3 (``dual_clip = 3``; the trainer's default is 8);
* lag k at a constant learning rate (the demo decays it to a tenth over ``--max-steps``);
* lag k with the demo's settings (the ratio clip, the decaying rate).

``--hold`` trains each to ``--max-steps`` whatever the target and reports, after the step that
reached it, the mean reward and the worst 100-step mean: a policy that reaches the target and
then loses it (prompts collapsing onto wrong answers) fails there, not in the steps to target.
It prints each seed's figures and the median over seeds, ends with one line per headline
figure, and draws the reward curves of one seed (``--plot``, default bench/out/offpolicy.png).

    python bench/offpolicy.py [--seeds 0 1 2 3 4] [--lag 1] [--max-steps 1500] [--hold]
                              [--modes on-policy,no-clip,dual-3,constant-lr,default]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from overhead import LOOP_THREADS, one_process

from jetrl.bus.log import configure
from jetrl.deploy.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 1.2  # steps to target under asynchrony, against on-policy
HOLD_WINDOW = 100  # steps of the worst mean after the target
HOLD_TARGET = 0.9  # the worst 100-step mean after the target, median of seeds


@dataclass
class Curve:
    """One training: the mean reward of each step, and the step that reached the target."""

    rewards: list[float] = field(default_factory=list)
    reached: int | None = None

    def after(self) -> list[float]:
        """The rewards of the steps after the target's (empty if not reached)."""
        return self.rewards[self.reached :] if self.reached is not None else []

    def held_mean(self) -> float | None:
        after = self.after()
        return sum(after) / len(after) if after else None

    def held_worst(self) -> float | None:
        """The lowest mean of HOLD_WINDOW consecutive steps after the target."""
        after = self.after()
        if len(after) < HOLD_WINDOW:
            return None
        total = sum(after[:HOLD_WINDOW])
        worst = total
        for i in range(HOLD_WINDOW, len(after)):
            total += after[i] - after[i - HOLD_WINDOW]
            worst = min(worst, total)
        return worst / HOLD_WINDOW


class Mode(NamedTuple):
    lagged: bool  # sampled ``--lag`` versions old, else on-policy
    over: list[str]  # config overrides
    label: str  # ``{lag}`` filled in


# The learning rate held at the demo's lr all along, not decayed over --max-steps.
CONSTANT = ["--trainer.lr_decay", '"constant"', "--trainer.lr_min_ratio", "0"]
MODES: dict[str, Mode] = {
    "on-policy": Mode(False, [], "lag 0"),
    "no-clip": Mode(True, ["--trainer.ratio_clip", "0"], "lag {lag}, no clip"),
    "dual-3": Mode(True, ["--trainer.dual_clip", "3"], "lag {lag}, dual clip 3"),
    "constant-lr": Mode(True, CONSTANT, "lag {lag}, constant lr"),
    "default": Mode(True, [], "lag {lag}"),
}


def train(seed: int, lag: int, over: list[str], max_steps: int, threads: int, hold: bool) -> Curve:
    run = ["--run.seed", str(seed), "--trainer.max_steps", str(max_steps), "--store.recorder", "false"]
    cfg = load_config(ROOT / "configs" / "demo.toml", [*run, *over])
    curve = Curve()
    with tempfile.TemporaryDirectory() as tmp:
        seconds, steps = one_process(cfg, Path(tmp), threads, lag=lag, curve=curve.rewards, hold=hold)
    curve.reached = steps if seconds is not None else None
    return curve


def plot(curves: dict[str, Curve], seed: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, c in curves.items():
        smooth = [
            sum(c.rewards[max(0, i - 9) : i + 1]) / len(c.rewards[max(0, i - 9) : i + 1])
            for i in range(len(c.rewards))
        ]
        ax.plot(range(len(smooth)), smooth, label=f"{name} ({c.reached or 'not reached'})", lw=0.9)
    ax.axhline(0.92, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (10-step mean)")
    ax.set_title(f"the demo, seed {seed}: on-policy and stale, steps to the target in brackets")
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def median(xs: list[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return statistics.median(got) if len(got) == len(xs) and got else None


def table(title: str, seeds: list[int], rows: dict[str, list[float | None]], fmt: str) -> None:
    print(f"{title:<28}" + "".join(f"{'seed ' + str(s):>10}" for s in seeds) + f"{'median':>10}")
    for name, xs in rows.items():
        cells = "".join(f"{format(x, fmt) if x is not None else '-':>10}" for x in xs)
        m = median(xs)
        print(f"{name:<28}{cells}{(format(m, fmt) if m is not None else '-'):>10}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--lag", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=1500)
    ap.add_argument("--threads", type=int, default=LOOP_THREADS)
    ap.add_argument("--hold", action="store_true", help="train to --max-steps past the target")
    ap.add_argument("--modes", default=",".join(MODES), help=f"a comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--plot", type=Path, default=ROOT / "bench" / "out" / "offpolicy.png")
    args = ap.parse_args()
    configure("warning")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in MODES]:
        ap.error(f"unknown modes {unknown}: choose among {list(MODES)}")
    names = {m: MODES[m].label.format(lag=args.lag) for m in modes}
    curves: dict[str, list[Curve]] = {m: [] for m in modes}
    for seed in args.seeds:
        for m in modes:
            lagged, over, _ = MODES[m]
            t0 = time.perf_counter()
            c = train(seed, args.lag if lagged else 0, over, args.max_steps, args.threads, args.hold)
            curves[m].append(c)
            shown = c.reached if c.reached is not None else f"not reached in {args.max_steps}"
            held = (
                f", held {c.held_mean():.3f}, worst {HOLD_WINDOW}-step mean {c.held_worst():.3f}"
                if (c.held_worst() is not None)
                else ""
            )
            print(
                f"seed {seed}: {names[m]:<22} {shown} steps{held} ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
        if seed == args.seeds[0]:
            plot({names[m]: curves[m][-1] for m in modes}, seed, args.plot)
    print()
    steps = {
        names[m]: [float(c.reached) if c.reached is not None else None for c in curves[m]] for m in modes
    }
    table("steps to target", args.seeds, steps, ".0f")
    if args.hold:
        print()
        table(
            f"worst {HOLD_WINDOW}-step mean after",
            args.seeds,
            {names[m]: [c.held_worst() for c in curves[m]] for m in modes},
            ".3f",
        )
        table(
            "mean reward after",
            args.seeds,
            {names[m]: [c.held_mean() for c in curves[m]] for m in modes},
            ".3f",
        )
    print(f"(reward curves of seed {args.seeds[0]}: {args.plot})")
    print()
    base = median(steps[names["on-policy"]]) if "on-policy" in modes else None
    for m in modes:
        if m == "on-policy":
            continue
        got = median(steps[names[m]])
        if base is None or got is None:
            why = "a seed did not reach the target" if "on-policy" in modes else "on-policy not run"
            print(f"steps to target {names[m]} / on-policy: not measured ({why})")
        else:
            print(f"steps to target {names[m]} / on-policy {got / base:.2f}x (target <= {TARGET_RATIO}x)")
    if args.hold:
        for m in modes:
            worst = median([c.held_worst() for c in curves[m]])
            shown = f"{worst:.3f}" if worst is not None else "not measured (a seed did not reach the target)"
            print(
                f"reward held after the target {names[m]}: worst {HOLD_WINDOW}-step mean {shown} "
                f"(median of seeds, target >= {HOLD_TARGET})"
            )


if __name__ == "__main__":
    main()
