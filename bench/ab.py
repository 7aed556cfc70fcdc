"""A change's effect on a step, paired: the working tree against another commit, round by round.

This machine's speed drifts by a quarter within minutes, so two figures taken apart compare the
hours as much as the code. Here each round runs the demo once on each side, back to back, in
alternating order (ABBA: the base first in odd rounds, the working tree first in even ones), and
a change is judged by its ratio within each round:

* the base: ``BASE`` (any commit) checked out in a temporary git worktree, imported through
  ``PYTHONPATH`` (its ``.typecheck/jetrl`` mirror of the package; the installed jetrl, an
  editable install of this tree, comes after it on the path);
* the working tree as it is, uncommitted changes included.

Both sides are measured by this tree's bench scripts (the same instrument: a base too old for
them fails and says so): by default ``bench/step_time.py --no-loop``, the wall time and the CPU
a step of every process, and the trainer's event loop's; with ``--to-target SEED ...``,
``bench/overhead.py --jetrl-only``, `jetrl run`'s time to the demo's reward target on each seed
and its time a step to it (the step counts may differ between the sides: asynchrony decides
which rollouts each step gets). The summary gives each figure's median on each side and the
median of the rounds' ratios, with how many rounds the working tree did better and the sign
test's two-sided p (4 of 4 rounds: p = 0.125; 6 of 6: 0.031).

    python bench/ab.py BASE [--rounds 4] [--steps 200] [--from-step 20] [--to-target 0 1 2]
                       [-- config overrides]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The headline figures, by their key, and how they are printed: step_time's, and the time to
# the reward target's (--to-target).
STEP_HEADLINES = {
    "wall_s": "step time",
    "cpu_s": "all processes' CPU",
    "trainer_loop_s": "trainer's event loop CPU",
}
TARGET_HEADLINES = {
    "time_to_target_s": "time to target, all seeds",
    "per_step_s": "time a step to target",
}
HEADLINES = {**STEP_HEADLINES, **TARGET_HEADLINES}


def sign_test_p(better: int, n: int) -> float:
    """Two-sided p of ``better`` wins in ``n`` paired rounds if neither side were faster."""
    k = max(better, n - better)
    tail: float = sum(math.comb(n, i) for i in range(k, n + 1)) / 2**n
    return min(1.0, 2 * tail)


def measure(tree: Path, args: argparse.Namespace, out: Path) -> dict[str, float] | None:
    """One measurement with ``tree``'s jetrl; its figures, flat (seconds), or None when the run
    failed (its output is shown). Both sides import jetrl alike: through the tree's
    ``.typecheck`` mirror, first on the path, the bench, the supervisor and the forked parts."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(tree / ".typecheck"), env.get("PYTHONPATH")] if p)
    if args.to_target:
        script = ["overhead.py", "--jetrl-only", "--seeds", *map(str, args.to_target)]
    else:
        script = ["step_time.py", "--no-loop", "--steps", str(args.steps), "--from-step", str(args.from_step)]
    cmd = [
        sys.executable,
        str(ROOT / "bench" / script[0]),
        *script[1:],
        "--json",
        str(out),
        *(["--", *args.over] if args.over else []),
    ]
    # Run from a folder with no jetrl in it: the parts' fork server, like `python -m`, puts its
    # working folder first on its path (Python 3.11's fork server does not take its parent's),
    # so run from the repository it would import the repository's jetrl on both sides.
    got = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, cwd=out.parent)
    if got.returncode != 0 or not out.exists():
        print(f"  the run failed ({got.returncode}):\n{got.stdout[-2000:]}{got.stderr[-2000:]}", flush=True)
        return None
    data = json.loads(out.read_text())
    return to_target_figures(data) if args.to_target else step_figures(data)


def step_figures(data: dict[str, Any]) -> dict[str, float]:
    """bench/step_time.py's one round, flat."""
    (fig,) = data["rounds"]
    flat = {k: float(fig[k]) for k in STEP_HEADLINES if fig.get(k) is not None}
    flat.update({f"cpu of {name}": float(s) for name, s in fig["parts"].items()})
    return flat


def to_target_figures(data: dict[str, Any]) -> dict[str, float] | None:
    """bench/overhead.py --jetrl-only's seeds (one round each), flat: each seed's time to the
    target, all of them, and their time a step; None where a seed did not reach it."""
    flat: dict[str, float] = {}
    steps = 0
    for seed, (run,) in data.items():
        if run["jet_s"] is None:
            print(f"  seed {seed} did not reach the target in {run['jet_n']} steps", flush=True)
            return None
        flat[f"seed {seed} to target"] = float(run["jet_s"])
        steps += int(run["jet_n"])
    flat["time_to_target_s"] = sum(flat.values())
    flat["per_step_s"] = flat["time_to_target_s"] / max(steps, 1)
    return flat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="the commit to compare the working tree with")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--from-step", type=int, default=20)
    ap.add_argument(
        "--to-target",
        type=int,
        nargs="+",
        metavar="SEED",
        help="compare `jetrl run`'s time to the demo's reward target on these seeds instead",
    )
    ap.add_argument("over", nargs="*", help="config overrides for both sides, after --")
    args = ap.parse_args()
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.base],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    pairs: list[tuple[dict[str, float], dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(base_tree), rev],
            check=True,
        )
        try:
            for r in range(args.rounds):
                order = [("base", base_tree), ("this tree", ROOT)]
                if r % 2:
                    order.reverse()
                got: dict[str, dict[str, float] | None] = {}
                for side, tree in order:
                    label = rev if tree == base_tree else "working tree"
                    print(f"round {r + 1} of {args.rounds}: {side} ({label})...", flush=True)
                    got[side] = measure(tree, args, Path(tmp) / f"r{r}-{side.replace(' ', '-')}.json")
                base, this = got["base"], got["this tree"]
                if base is None or this is None:
                    continue
                pairs.append((base, this))
                print(
                    "  "
                    + ", ".join(
                        f"{HEADLINES[k]} {_fmt(base[k])} -> {_fmt(this[k])}"
                        for k in HEADLINES
                        if k in base and k in this
                    ),
                    flush=True,
                )
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)], check=False
            )
    summarise(pairs, rev)


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def summarise(pairs: list[tuple[dict[str, float], dict[str, float]]], rev: str) -> None:
    print()
    if not pairs:
        print(f"ab this tree/{rev}: no round ran on both sides")
        return
    keys = [k for k in pairs[0][0] if all(k in b and k in t for b, t in pairs)]
    n = len(pairs)
    print(f"{'figure':<34} {rev:>10} {'this tree':>10} {'ratio':>7}  better in")
    for k in keys:
        base = statistics.median(b[k] for b, _ in pairs)
        this = statistics.median(t[k] for _, t in pairs)
        ratio = statistics.median(t[k] / b[k] for b, t in pairs if b[k] > 0) if base > 0 else float("nan")
        better = sum(t[k] < b[k] for b, t in pairs)
        name = HEADLINES.get(k, k)
        print(f"{name:<34} {_fmt(base):>10} {_fmt(this):>10} {ratio:6.3f}x  {better} of {n}")
    print()
    for k in HEADLINES:
        if k not in keys:
            continue
        ratio = statistics.median(t[k] / b[k] for b, t in pairs)
        better = sum(t[k] < b[k] for b, t in pairs)
        print(
            f"ab {HEADLINES[k]} this tree/{rev} {ratio:.3f}x (median of {n} paired rounds; lower in "
            f"{better} of {n}, sign test p = {sign_test_p(better, n):.3f})"
        )


if __name__ == "__main__":
    main()
