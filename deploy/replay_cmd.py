"""`jetrl replay RUN [--from-step N] [--to-step M] [--verify]`: re-run training from the log.

Reads the run's config from its RunStarted event, starts from version 0 (or from the trainer's
checkpoint at version N), re-takes every logged step from the logged rollouts and, with
``--verify``, checks each resulting weights checksum against the log. A mismatch names the first
step that diverged and what differs between the recorded run and this process. Without
``--nats-url`` the run's own log files (``<runs dir>/<run>/nats``) are served by a private
nats-server.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from jetrl.bus.client import Bus
from jetrl.bus.log import configure
from jetrl.bus.payloads import Payloads
from jetrl.deploy.config import RunConfig, library_versions
from jetrl.deploy.run_log import with_run_log

if TYPE_CHECKING:
    from jetrl.consumers.trainer.replay import StepCheck


async def replay(
    url: str,
    run_id: str,
    run_dir: Path,
    *,
    from_step: int,
    to_step: int | None,
    verify: bool,
    quiet: bool = False,
) -> int:
    # Imported here, not at the top: every jetrl command imports this module to list its
    # options, and the trainer's imports (torch, torchtitan) take seconds.
    from jetrl.consumers.trainer.core import TrainCore
    from jetrl.consumers.trainer.replay import (
        Replayer,
        ReplayError,
        divergence_hints,
        read_rollouts,
        read_run_log,
        trained_seqs,
    )

    def say(text: str) -> None:
        if not quiet:
            print(text, flush=True)

    bus = await Bus.connect(url, name="replay")
    try:
        log = await read_run_log(bus, run_id)
        if log.config is None:
            say(f"replay: run {run_id} has no RunStarted event in its log")
            return 2
        if not log.steps:
            say(f"replay: run {run_id} has no completed steps")
            return 2
        part = RunConfig.model_validate(log.config).trainer_part(run_dir)
        last = log.last_step if to_step is None else min(to_step, log.last_step)
        core = TrainCore(part)
        payloads = await Payloads.for_run(bus.js, run_id, weights_dir=run_dir / "payloads")
        replayer = Replayer(core, payloads, log)
        await replayer.start_at(from_step, run_dir / "trainer" if from_step else None)
        needed = {rid for s in range(from_step, last + 1) for rid in log.steps[s].rollout_ids}
        rollouts, _ = await read_rollouts(bus, run_id, needed, trained_seqs(log, from_step))
        ranks = part.trainer.parallelism.world_size
        on = f", {ranks} ranks as recorded" if ranks > 1 else ""
        what = f"steps {from_step}..{last} ({len(needed)} rollouts), {part.model.name}{on}"
        say(f"replaying run {run_id}: {what}")
        t0 = time.perf_counter()
        shown = [time.monotonic()]

        def on_step(check: StepCheck, metrics: dict[str, float]) -> None:
            if not check.ok or time.monotonic() - shown[0] > 2.0 or check.step == last:
                shown[0] = time.monotonic()
                mark = "ok" if check.ok else "MISMATCH"
                say(f"  step {check.step:>5}  {check.got[:16]}  {mark}  loss {metrics.get('loss', 0.0):+.5f}")

        checks = await replayer.run(rollouts, to_step=last, stop_on_mismatch=verify, on_step=on_step)
        elapsed = time.perf_counter() - t0
        bad = [c for c in checks if not c.ok]
        if verify and bad:
            c = bad[0]
            say(f"DIVERGED at step {c.step}: weights checksum {c.got} but the log recorded {c.expected}")
            say("what differs between the recorded run and this replay:")
            for hint in divergence_hints(log, part.trainer, library_versions()):
                say(f"  - {hint}")
            return 1
        unverified = sum(1 for c in checks if c.expected is None)
        say(
            f"replayed {len(checks)} steps in {elapsed:.1f}s; final weights checksum {checks[-1].got}"
            + (f"; verified {len(checks) - unverified} checksums, all equal" if verify else "")
            + (f" ({unverified} versions were never announced)" if unverified else "")
        )
        return 0
    except ReplayError as exc:
        say(f"replay: {exc}")
        return 2
    finally:
        await bus.close()


def main(args: argparse.Namespace) -> int:
    configure(level="warning")
    run_dir = Path(args.runs_dir) / args.run
    kw = {"from_step": args.from_step, "to_step": args.to_step, "verify": args.verify}
    return with_run_log("replay", run_dir, args.nats_url, lambda url: replay(url, args.run, run_dir, **kw))


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("replay", help="re-run training from the log and check every step's checksum")
    p.add_argument("run")
    p.add_argument(
        "--from-step", type=int, default=0, help="start at this step (needs its checkpoint unless 0)"
    )
    p.add_argument("--to-step", type=int, default=None)
    p.add_argument("--verify", action="store_true", help="fail at the first step whose checksum differs")
    p.add_argument("--nats-url", default=None)
    p.add_argument("--runs-dir", default="runs")
    p.set_defaults(func=main)
