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
from jetrl.bus import ids, subjects
from jetrl.bus.client import Bus
from jetrl.bus.facts import spoofed
from jetrl.bus.payloads import Payloads
from jetrl.consumers.trainer.core import Checkpoint, ScoredView, TrainCore, checkpoint_path
from jetrl.consumers.trainer.settings import TrainerSettings
from jetrl.policy.origin import model_config_of
from jetrl.policy.weights import weights_from_bytes
from jetrl.store import readmodel as rm


class ReplayError(RuntimeError):
    pass


@dataclass
class RunLog:
    """The facts replay needs, read from the log up to its head at reading time: the first of
    each step, policy version and weights (as the store keeps them; a recovered trainer may
    log one again)."""

    head: int = 0
    started: rm.Started | None = None
    steps: dict[int, rm.Stepped] = field(default_factory=dict)
    policies: dict[int, rm.Versioned] = field(default_factory=dict)
    weights: dict[int, rm.Ready] = field(default_factory=dict)

    def add(self, fact: rm.Fact) -> None:
        match fact:
            case rm.Started() if self.started is None:
                self.started = fact
            case rm.Stepped():
                self.steps.setdefault(fact.step, fact)
            case rm.Versioned():
                self.policies.setdefault(fact.version, fact)
            case rm.Ready():
                self.weights.setdefault(fact.version, fact)

    @property
    def config(self) -> dict[str, Any] | None:
        return self.started.config if self.started is not None else None

    @property
    def library_versions(self) -> dict[str, str]:
        return self.started.library_versions if self.started is not None else {}

    @property
    def last_step(self) -> int:
        return max(self.steps, default=-1)

    def trained_ids(self) -> set[str]:
        return {rid for s in self.steps.values() for rid in s.rollout_ids}


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
            fact = rm.fact_of(item.seq, item.subject, item.event) if item.event is not None else None
            if fact is not None:
                log.add(fact)
    return log


def trained_seqs(log: RunLog, from_step: int = 0) -> dict[str, int]:
    """Where each rollout trained at ``from_step`` or later lies in the log, as its
    StepCompleted recorded (steps logged before rollout_seqs existed record none)."""
    out: dict[str, int] = {}
    for step, s in log.steps.items():
        if step >= from_step and len(s.rollout_seqs) == len(s.rollout_ids):
            out.update(zip(s.rollout_ids, s.rollout_seqs, strict=True))
    return out


async def read_rollouts(
    bus: Bus, run_id: str, wanted: set[str], seqs: dict[str, int] | None = None
) -> tuple[dict[str, ScoredView], set[str]]:
    """In one pass over the rollout subjects: the rollouts of ``wanted`` (each with the
    RolloutsScored it came in), and every rollout the trainer withheld (never to be trained,
    even if delivered again).

    A rollout is the one in the event at the sequence its step recorded (``seqs``): a rollout id
    is only a name, and a hostile tenant may publish another event under it first (the trainer
    refuses that one, but it is in the log). Without a recorded sequence, the first event of
    the id that is a fact of the run (``spoofed``)."""
    seqs = seqs or {}
    scored: dict[str, ScoredView] = {}
    withheld: set[str] = set()
    async for item in bus.tail(run_id, filter_subject=subjects.rollout_subject(run_id), to_head=True):
        if item.event is None or spoofed(run_id, item.subject, item.event) is not None:
            continue
        b = item.event.body
        if isinstance(b, ev.RolloutsScored):
            owner = ids.task_event_id(run_id, b.task_id)  # the task event holding the prompt
            for r in b.rollouts:
                if r.rollout_id not in wanted:
                    continue
                view = ScoredView(b, r, owner)
                want = seqs.get(r.rollout_id)
                if want is None:
                    scored.setdefault(r.rollout_id, view)
                elif item.seq == want:
                    scored[r.rollout_id] = view
        elif isinstance(b, ev.RolloutWithheld):
            withheld.add(b.rollout_id)
    missing = wanted - set(scored)
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
        data = await self.payloads.get_weights(ready)  # checked as it lands; the checksum again below
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
        rollouts: dict[str, ScoredView],
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
            logged = self.log.steps[step]
            batch = [rollouts[rid] for rid in logged.rollout_ids]
            metrics = self.core.train(await self.core.rollouts(batch, self.payloads), logged.micro_batches)
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
