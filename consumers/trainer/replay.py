"""Replay: re-take logged training steps from the log and check every weights checksum.

StepCompleted lists the exact rollouts of each step in training order, the rollouts are in the
log (their arrays in the payload store), and PolicyVersionPublished records the checksum each
step produced. From a starting state (version 0's weights, or a checkpoint), re-taking the
steps must reproduce every checksum bit for bit. The trainer uses this to recover after a crash;
`jetrl replay --verify` uses it to audit a run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.facts import spoofed
from jetrl.bus.payloads import Payloads
from jetrl.consumers.trainer.core import Checkpoint, TrainCore, checkpoint_path
from jetrl.consumers.trainer.settings import TrainerSettings
from jetrl.policy.origin import model_config_of
from jetrl.policy.weights import weights_from_bytes


class ReplayError(RuntimeError):
    pass


@dataclass
class RunLog:
    """The facts replay needs, read from the log up to its head at reading time."""

    head: int = 0
    config: dict[str, Any] | None = None
    library_versions: dict[str, str] = field(default_factory=dict)
    steps: dict[int, tuple[ev.StepCompleted, int]] = field(default_factory=dict)  # step -> (body, seq)
    policies: dict[int, ev.PolicyVersionPublished] = field(default_factory=dict)
    weights: dict[int, ev.WeightsReady] = field(default_factory=dict)

    @property
    def last_step(self) -> int:
        return max(self.steps, default=-1)

    def trained_ids(self) -> set[str]:
        return {rid for body, _ in self.steps.values() for rid in body.rollout_ids}


async def read_run_log(bus: Bus, run_id: str) -> RunLog:
    log = RunLog(head=await bus.last_seq(run_id))
    if not log.head:
        return log
    for subject in (
        subjects.run_subject(run_id),
        subjects.step_subject(run_id),
        subjects.policy_subject(run_id),
        subjects.weights_subject(run_id),
    ):
        async for item in bus.tail(run_id, filter_subject=subject, to_head=True):
            b = item.event.body if item.event else None
            if isinstance(b, ev.RunStarted) and log.config is None:
                log.config, log.library_versions = b.config, b.library_versions
            elif isinstance(b, ev.StepCompleted):
                log.steps.setdefault(b.step, (b, item.seq))
            elif isinstance(b, ev.PolicyVersionPublished):
                log.policies.setdefault(b.version, b)
            elif isinstance(b, ev.WeightsReady):
                log.weights.setdefault(b.version, b)
    return log


def trained_seqs(log: RunLog, from_step: int = 0) -> dict[str, int]:
    """Where each rollout trained at ``from_step`` or later lies in the log, as its
    StepCompleted recorded (steps logged before rollout_seqs existed record none)."""
    out: dict[str, int] = {}
    for step, (body, _) in log.steps.items():
        if step >= from_step and len(body.rollout_seqs) == len(body.rollout_ids):
            out.update(zip(body.rollout_ids, body.rollout_seqs, strict=True))
    return out


async def read_rollouts(
    bus: Bus, run_id: str, ids: set[str], seqs: dict[str, int] | None = None
) -> tuple[dict[str, ev.RolloutScored], set[str]]:
    """In one pass over the rollout subjects: the RolloutScored events of ``ids``, and every
    rollout the trainer withheld (never to be trained, even if delivered again).

    A rollout is the event at the sequence its step recorded (``seqs``): a rollout id is only
    a name, and a hostile tenant may publish another event under it first (the trainer
    refuses that one, but it is in the log). Without a recorded sequence, the first event of
    the id that is a fact of the run (``spoofed``)."""
    seqs = seqs or {}
    scored: dict[str, ev.RolloutScored] = {}
    withheld: set[str] = set()
    async for item in bus.tail(run_id, filter_subject=subjects.rollout_subject(run_id), to_head=True):
        if item.event is None or spoofed(run_id, item.subject, item.event) is not None:
            continue
        b = item.event.body
        if isinstance(b, ev.RolloutScored) and b.rollout_id in ids:
            want = seqs.get(b.rollout_id)
            if want is None:
                scored.setdefault(b.rollout_id, b)
            elif item.seq == want:
                scored[b.rollout_id] = b
        elif isinstance(b, ev.RolloutWithheld):
            withheld.add(b.rollout_id)
    missing = ids - set(scored)
    if missing:
        raise ReplayError(f"{len(missing)} trained rollouts are not in the log, e.g. {sorted(missing)[:3]}")
    return scored, withheld


@dataclass(frozen=True)
class StepCheck:
    step: int
    expected: str | None  # the checksum in the log (None: the version was never announced)
    got: str

    @property
    def ok(self) -> bool:
        return self.expected is None or self.expected == self.got


class Replayer:
    def __init__(self, core: TrainCore, payloads: Payloads, log: RunLog) -> None:
        self.core = core
        self.payloads = payloads
        self.log = log
        self.version = 0

    async def start_at(self, version: int, checkpoint_dir: Path | None = None) -> Checkpoint | None:
        """Put the core at ``version``: from a checkpoint at exactly that version when one is
        given and found, else (version 0 only) from the logged initial weights and a fresh
        optimizer, which is how the live trainer began."""
        if checkpoint_dir is not None and (path := checkpoint_path(checkpoint_dir, version)).exists():
            ck = self.core.load_checkpoint(path)
            self._check_version(version, ck.weights_checksum, f"checkpoint {path.name}")
            self.version = version
            return ck
        if version != 0:
            raise ReplayError(
                f"no checkpoint at version {version}; replay from step 0 or from a checkpointed step"
            )
        ready = self.log.weights.get(0)
        if ready is None:
            raise ReplayError("the log has no initial weights (WeightsReady version 0)")
        data = await self.payloads.get_bytes(ready.location)
        cfg = model_config_of(self.core.part.model)
        tensors, _ = weights_from_bytes(data, expected_checksum=ready.weights_checksum, model_cfg=cfg)
        self.core.engine.load_weights(tensors)
        self.version = 0
        return None

    def _check_version(self, version: int, digest: str, what: str) -> None:
        pv = self.log.policies.get(version)
        if pv is not None and pv.weights_checksum != digest:
            raise ReplayError(
                f"{what}: weights checksum {digest[:16]}... differs from the log's "
                f"{pv.weights_checksum[:16]}... for version {version}"
            )

    async def run(
        self,
        rollouts: dict[str, ev.RolloutScored],
        *,
        to_step: int | None = None,
        stop_on_mismatch: bool = True,
        on_step: Callable[[StepCheck, dict[str, float]], None] | None = None,
    ) -> list[StepCheck]:
        """Re-take steps ``self.version .. to_step`` (default: the last logged step)."""
        last = self.log.last_step if to_step is None else to_step
        checks: list[StepCheck] = []
        for step in range(self.version, last + 1):
            if step not in self.log.steps:
                raise ReplayError(f"step {step} is missing from the log (steps must be contiguous)")
            body, _ = self.log.steps[step]
            batch = [rollouts[rid] for rid in body.rollout_ids]
            metrics = self.core.train(await self.core.rollouts(batch, self.payloads))
            self.version = step + 1
            pv = self.log.policies.get(step + 1)
            check = StepCheck(step, pv.weights_checksum if pv else None, self.core.checksum())
            checks.append(check)
            if on_step:
                on_step(check, metrics)
            if not check.ok and stop_on_mismatch:
                break
        return checks


def divergence_hints(log: RunLog, settings: TrainerSettings, current_versions: dict[str, str]) -> list[str]:
    """Why a replay may diverge: what differs between the recorded run and this process."""
    hints = []
    for pkg, v in sorted(log.library_versions.items()):
        now = current_versions.get(pkg)
        if now is not None and now != v:
            hints.append(f"{pkg} {now} here, {v} in the run")
    if log.config is not None:
        recorded = log.config.get("trainer", {})
        for key, value in recorded.items():
            mine = getattr(settings, key, None)
            if mine is not None and mine != value:
                hints.append(f"trainer.{key} = {mine!r} here, {value!r} in the run")
    hints.append("torch thread count or CPU kind (CPU reductions depend on both)")
    return hints
