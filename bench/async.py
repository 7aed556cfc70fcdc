"""Synchronous vs asynchronous RL on an environment with long-tailed latency.

Same model (4 layers, dim 256, 8 experts top-2; weights shared through the run directory), same
batch, same environment (modular addition, whose scoring sleeps a lognormal
time per rollout: median ``--latency`` seconds, sigma 1.3, so about 1% of episodes take more
than 20x the median, like sandboxes and tool calls). Each mode is a real `jetrl run` (all
processes, one private nats-server) for the same wall-clock budget:

    max_off_policy_steps = 0 (synchronous on-policy), 1, 2, 4

and reports steps per minute, the trainer's idle fraction, mean staleness and the reward reached.
The recorder is off so that the two cores go to the loop itself.

    python bench/async.py [--seconds 45] [--latency 0.05]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from jetrl.bus.log import configure
from jetrl.bus.server import EmbeddedServer
from jetrl.deploy.config import load_config
from jetrl.deploy.supervisor import Supervisor


def run_mode(
    url: str,
    root: Path,
    k: int,
    seconds: float,
    latency: float,
    sigma: float,
    workers: int,
    model: list[str],
    inflight: int | None = None,
) -> dict[str, float]:
    args = (
        f"--run.max_wall_s {seconds} --run.seed 0 --trainer.max_off_policy_steps {k} "
        "--trainer.max_steps 100000 "
        "--trainer.batch_groups 8 --trainer.lr 5e-4 --trainer.entropy_coef 0.01 --trainer.checkpoint_every 0 "
        f"--inference.workers {workers} --inference.max_batch_tasks 8 "
        "--envs.0.name modsum --envs.0.group_size 16 "
        f"--envs.0.latency_median_s {latency} --envs.0.latency_sigma {sigma} --store.recorder false "
        "--bus.max_gib 1 --bus.payload_max_gib 1"
    ).split()
    if inflight is not None:
        args += ["--envs.0.inflight_groups", str(inflight * (1 + k) * 8)]
    cfg = load_config(None, [*args, *model])
    run_id = f"async-k{k}"
    sup = Supervisor(cfg, run_id, root / run_id, nats_url=url, quiet=True)
    asyncio.run(sup.run())
    steps = sup.progress.steps
    summary = json.loads((root / run_id / "summary.json").read_text())
    # Steady state: skip the first steps (process start-up, first weights) when timing.
    warm = [s for s in steps if s["step"] >= 3]
    span = warm[-1]["t"] - warm[0]["t"] if len(warm) > 1 else 0.0
    last = steps[-10:] if steps else []
    return {
        "steps": float(len(steps)),
        "steps_per_min": (len(warm) - 1) / span * 60 if span > 0 else 0.0,
        "idle": sum(s.get("trainer_wait_s", 0.0) for s in warm[1:])
        / max(sum(s.get("trainer_wait_s", 0.0) + s.get("step_s", 0.0) for s in warm[1:]), 1e-9),
        "staleness": sum(s.get("staleness_mean", 0.0) for s in steps) / max(len(steps), 1),
        "reward": sum(s.get("reward_mean", 0.0) for s in last) / max(len(last), 1),
        "withheld": float(summary.get("withheld", 0)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=45.0, help="wall-clock budget of each mode")
    ap.add_argument("--latency", type=float, default=0.05, help="median environment latency (s)")
    ap.add_argument("--sigma", type=float, default=1.3, help="lognormal sigma of the latency")
    ap.add_argument("--modes", default="0,1,2,4", help="max_off_policy_steps values; 0 is the baseline")
    ap.add_argument("--workers", type=int, default=1, help="inference workers")
    ap.add_argument(
        "--oversubscribe",
        type=int,
        default=None,
        help="groups in flight = this x (1 + k) x batch groups (default: 1, the producer's rule)",
    )
    # A trainer step that is not trivially cheap next to generation (about 0.25 s here), as on
    # real clusters; with the 2-layer dim-64 demo model the event path, not the trainer, is the
    # bottleneck on two cores (docs/running.md).
    ap.add_argument("--model", default="tiny-moe-4l")
    ap.add_argument("--weights-store", default="file", choices=["objstore", "file"])
    ap.add_argument(
        "--model-overrides",
        default="{ dim = 256, moe_hidden_dim = 512, head_dim = 64 }",
        help='TOML inline table, e.g. "{ dim = 256 }"',
    )
    args = ap.parse_args()
    configure(level="warning")
    modes = [int(m) for m in args.modes.split(",")]
    results: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer(Path(tmp) / "nats") as srv:
        for k in modes:
            model = [
                "--model.name",
                args.model,
                "--model.overrides",
                args.model_overrides,
                "--bus.weights_store",
                args.weights_store,
            ]
            results[k] = run_mode(
                srv.url,
                Path(tmp),
                k,
                args.seconds,
                args.latency,
                args.sigma,
                args.workers,
                model,
                args.oversubscribe,
            )
            r = results[k]
            print(
                f"max_off_policy_steps={k}: {r['steps']:.0f} steps, {r['steps_per_min']:.1f} steps/min, "
                f"trainer idle {100 * r['idle']:.1f}%, staleness {r['staleness']:.2f}, "
                f"reward {r['reward']:.3f}, withheld {r['withheld']:.0f}",
                flush=True,
            )
    print()
    print(f"{'mode':<12}{'steps/min':>10}{'x sync':>8}{'idle':>8}{'stale':>7}{'reward':>8}")
    base = results.get(0, {}).get("steps_per_min", 0.0)
    for k, r in results.items():
        ratio = r["steps_per_min"] / base if base else float("nan")
        name = "sync" if k == 0 else f"async k={k}"
        print(
            f"{name:<12}{r['steps_per_min']:>10.1f}{ratio:>8.2f}{100 * r['idle']:>7.1f}%"
            f"{r['staleness']:>7.2f}{r['reward']:>8.3f}"
        )
    print()
    for k, r in results.items():
        if k == 0:
            continue
        print(f"async/sync steps-per-minute k={k} {r['steps_per_min'] / base:.2f}x (target >= 2x)")
    for k, r in results.items():
        if k:
            print(f"trainer idle k={k} {100 * r['idle']:.1f}% (target < 10%)")


if __name__ == "__main__":
    main()
