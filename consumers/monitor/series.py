"""The monitor's fold: a run's log (or its store) in, the series people watch out.

:class:`MonitorState` folds the run's facts (store/readmodel: what each event of the log
states) in sequence order. A finished run's store gives the same facts from its rows, so its
dashboard shows exactly what the live one showed (tests/monitor checks that the two agree).

Per trainer step, a :class:`StepPoint` holds the step's figures: the trainer's own metrics
(loss, mismatch KL, entropy, masked share, gradient norm, idle share) and what only the log
knows: the reward per environment and tenant of the rollouts the step trained on, their
length and truncated share, the staleness of what was still queued, the tokens per second, the
share of inference time spent waiting for weights, and the backlog of tasks and rollouts.
Between steps, the state keeps the workers (heartbeat, loaded version), dead letters, withheld
rollouts and alerts.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from jetrl.store import readmodel as rm

# The trainer's metrics each StepPoint carries under its own name (0.0 where the engine
# reports none).
TRAINER_METRICS = (
    "loss",
    "mismatch_kl",
    "mismatch_kl_max",
    "entropy",
    "masked_frac",
    "grad_norm",
    "lr",  # the step's learning rate ([trainer] lr and its schedule)
    "trainer_idle_frac",
    "trainer_wait_s",  # waiting for a batch of fresh groups
    "trainer_read_s",  # reading and checking the batch's arrays
    "groups_no_signal",  # the share of the step's groups whose rewards are all alike
)
_GENERATIONS_KEPT = 200_000  # generations waiting for their rollout's step (a bound, not a target)
# The facts the series are made of; the others (policy versions, weights, evaluations) are
# neither folded nor counted.
FOLDED = (
    rm.Started,
    rm.Resumed,
    rm.Finished,
    rm.Tasked,
    rm.Generated,
    rm.Scored,
    rm.Withheld,
    rm.Stepped,
    rm.Dead,
    rm.Beat,
    rm.Loaded,
    rm.Alerted,
)
# What a fold of the steps alone takes (``MonitorState(rollouts=False)``): enough for every
# alert rule, without the tasks, generations and rollouts that are most of a run's log (the
# reader passes those over undecoded: ``STEP_EVENTS``). A step's reward and staleness are then
# the trainer's own metrics, the same means over the same rollouts.
STEP_FACTS = (rm.Started, rm.Resumed, rm.Finished, rm.Stepped, rm.Dead, rm.Beat, rm.Loaded, rm.Alerted)
STEP_EVENTS = frozenset(f.OF.TYPE for f in STEP_FACTS)


@dataclass(frozen=True, slots=True)
class Queued:
    """A rollout scored, neither trained nor withheld yet: itself and its group's event."""

    scored: rm.Scored
    one: rm.ScoredOne

    @property
    def rollout_id(self) -> str:
        return self.one.rollout_id

    @property
    def reward(self) -> float:
        return self.one.reward

    @property
    def version_start(self) -> int:
        return self.one.version_start

    @property
    def length(self) -> int | None:
        return self.one.length

    @property
    def env(self) -> str:
        return self.scored.env

    @property
    def tenant(self) -> str:
        return self.scored.tenant

    @property
    def generation_event_id(self) -> str:
        return self.scored.generation_event_id


@dataclass(frozen=True, slots=True)
class StepPoint:
    step: int
    policy_version: int
    t: float  # the StepCompleted's time (epoch seconds)
    seq: int
    rollouts: int
    tokens: int
    reward_mean: float
    reward_by_env: dict[str, float]
    reward_by_tenant: dict[str, float]
    trainer: dict[str, float]  # TRAINER_METRICS
    staleness_mean: float  # of the rollouts trained (in flight when generated)
    staleness_max: float
    queue_staleness_mean: float  # of the scored rollouts still queued after the step
    seq_len_mean: float  # completion tokens per trained rollout
    truncated_frac: float  # share of trained rollouts cut at max_tokens
    tokens_per_s: float
    inference_weight_wait_frac: float  # of inference time since the last step, spent waiting for weights
    withheld: int  # rollouts withheld since the step before
    late_samples: int  # samples left out of their groups since the step before (group_quorum)
    dead_letters: int  # dead letters since the step before
    # Samples asked for by tasks and not generated yet, scored rollouts neither trained nor
    # withheld: counted from where the reader started (exact when it started at the log's start).
    pending_samples: int
    pending_rollouts: int

    def scalars(self) -> dict[str, float]:
        """The step's figures under the names trackers and the web page chart them by."""
        out = {
            "reward/mean": self.reward_mean,
            **{f"reward/env/{k}": v for k, v in self.reward_by_env.items()},
            **{f"reward/tenant/{k}": v for k, v in self.reward_by_tenant.items()},
            **{f"trainer/{k}": v for k, v in self.trainer.items()},
            "staleness/mean": self.staleness_mean,
            "staleness/max": self.staleness_max,
            "staleness/queued_mean": self.queue_staleness_mean,
            "rollouts/seq_len_mean": self.seq_len_mean,
            "rollouts/truncated_frac": self.truncated_frac,
            "rollouts/count": float(self.rollouts),
            "throughput/tokens_per_s": self.tokens_per_s,
            "inference/weight_wait_frac": self.inference_weight_wait_frac,
            "rollouts/withheld": float(self.withheld),
            "rollouts/late_samples": float(self.late_samples),
            "rollouts/dead_letters": float(self.dead_letters),
            "queue/pending_samples": float(self.pending_samples),
            "queue/pending_rollouts": float(self.pending_rollouts),
        }
        return out  # NaN and infinities kept: a NaN loss is what people need to see

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.policy_version, "t": self.t, **self.scalars()}


@dataclass(slots=True)
class WorkerState:
    worker_id: str
    kind: str
    status: str = "starting"
    loaded_version: int | None = None
    inflight: int = 0
    last_seen: float = 0.0  # the time of its last heartbeat
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AlertView:
    """An alert as dashboards list it: its last transition."""

    rule: str
    key: str
    state: str
    severity: str
    message: str
    step: int
    t: float


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _means_by(pairs: list[tuple[str, float]]) -> dict[str, float]:
    acc: dict[str, list[float]] = {}
    for k, v in pairs:
        acc.setdefault(k, []).append(v)
    return {k: _mean(v) for k, v in sorted(acc.items())}


class MonitorState:
    """The fold. ``apply`` takes facts in log order; ``steps`` is the series so far."""

    def __init__(self, run_id: str, *, keep_steps: int | None = None, rollouts: bool = True) -> None:
        """``rollouts``: fold the tasks, generations and rollouts too (the series per
        environment and tenant, lengths, backlogs); without, only ``STEP_FACTS``."""
        self.run_id = run_id
        self.rollouts = rollouts
        self.folded = FOLDED if rollouts else STEP_FACTS
        self.steps: deque[StepPoint] = deque(maxlen=keep_steps)
        self.config: dict[str, Any] = {}
        self.started_at: float | None = None
        self.last_step_t: float | None = None
        self.finished: rm.Finished | None = None
        self.last_seq = 0
        self.last_t = 0.0  # the time of the newest fact: "now" when folding history
        self.workers: dict[str, WorkerState] = {}
        self.withheld_by_reason: dict[str, int] = {}
        self.dead_by_reason: dict[str, int] = {}
        self.dead_times: deque[float] = deque(maxlen=10_000)
        self.alerts: dict[tuple[str, str], AlertView] = {}
        self.alert_counts: dict[str, int] = {}
        self.latest_version = 0
        self.events = 0
        self.undecodable = 0  # messages of the log that are not events (counted, not folded)
        self.from_step: int | None = None  # steps before it are folded but not kept as points
        self._queued: dict[str, Queued] = {}  # scored, neither trained nor withheld
        self._generations: OrderedDict[str, rm.Generated] = OrderedDict()
        self._asked = 0  # samples asked for by tasks
        self._generated = 0
        self._wait_since_step = 0.0  # inference load_wait_s since the last step
        self._busy_since_step = 0.0  # inference generate_s since the last step
        self._withheld_since_step = 0
        self._late_since_step = 0
        self._dead_since_step = 0

    # ------------------------------------------------------------------ folding

    def apply(self, r: rm.Fact) -> StepPoint | None:
        """Fold one fact; returns the new StepPoint when it was a step."""
        if not isinstance(r, self.folded) or r.seq <= self.last_seq:
            return None  # not one of the series', or seen already (a reader resumed earlier)
        self.last_seq = r.seq
        self.last_t = max(self.last_t, r.t)
        self.events += 1
        match r:
            case rm.Tasked():
                self._asked += r.samples
            case rm.Generated():
                self._generated += len(r.samples)
                self._wait_since_step += r.load_wait_s
                self._busy_since_step += r.generate_s
                self._generations[r.event_id] = r
                if len(self._generations) > _GENERATIONS_KEPT:
                    self._generations.popitem(last=False)
            case rm.Scored():
                for one in r.rollouts:
                    self._queued[one.rollout_id] = Queued(r, one)
                self._late_since_step += r.late
            case rm.Withheld():
                self._queued.pop(r.rollout_id, None)
                self.withheld_by_reason[r.reason] = self.withheld_by_reason.get(r.reason, 0) + 1
                self._withheld_since_step += 1
            case rm.Stepped():
                return self._step(r)
            case rm.Dead():
                self.dead_by_reason[r.reason] = self.dead_by_reason.get(r.reason, 0) + 1
                self.dead_times.append(r.t)
                self._dead_since_step += 1
            case rm.Beat():
                w = self._worker(r.worker_id, r.kind)
                w.status, w.inflight, w.last_seen, w.stats = r.status, r.inflight, r.t, dict(r.stats)
                if r.loaded_version is not None:
                    w.loaded_version = r.loaded_version
            case rm.Loaded():
                w = self._worker(r.worker_id, r.kind)
                w.loaded_version = r.version
                w.last_seen = max(w.last_seen, r.t)
            case rm.Alerted():
                self.note_alert(AlertView(r.rule, r.key, r.state, r.severity, r.message, r.step, r.t))
            case rm.Started():
                self.config = dict(r.config)
                self.started_at = r.t
            case rm.Resumed():
                self.config = dict(r.config)
                self.finished = None
            case rm.Finished():
                self.finished = r
        return None

    def note_alert(self, a: AlertView) -> None:
        """An alert transition, from the log or evaluated here (whose event, if published,
        folds in later: the same transition is counted once)."""
        prev = self.alerts.get((a.rule, a.key))
        self.alerts[(a.rule, a.key)] = a
        if prev is not None and (prev.state, prev.step) == (a.state, a.step):
            return
        if a.state == "firing":
            self.alert_counts[a.rule] = self.alert_counts.get(a.rule, 0) + 1

    def _worker(self, worker_id: str, kind: str) -> WorkerState:
        w = self.workers.get(worker_id)
        if w is None:
            w = self.workers[worker_id] = WorkerState(worker_id, kind)
        return w

    def _step(self, r: rm.Stepped) -> StepPoint | None:
        trained = [self._queued.pop(rid) for rid in r.rollout_ids if rid in self._queued]
        reasons = [
            g.finish_reason(x.rollout_id)
            for x in trained
            if (g := self._generations.get(x.generation_event_id)) is not None
        ]
        for x in trained:
            self._generations.pop(x.generation_event_id, None)
        since = self.last_step_t if self.last_step_t is not None else self.started_at
        span = r.t - since if since is not None else 0.0
        stale = [float(r.step - x.version_start) for x in trained]
        queued = [float(r.step + 1 - x.version_start) for x in self._queued.values()]
        inference_s = self._wait_since_step + self._busy_since_step
        if not self.rollouts:  # none folded: the trainer's figures of them
            reward = float(r.metrics.get("reward_mean", 0.0))
            stale_mean = float(r.metrics.get("staleness_mean", 0.0))
            stale_max = float(r.metrics.get("staleness_max", 0.0))
        else:
            reward = _mean([x.reward for x in trained])
            stale_mean, stale_max = _mean(stale), max(stale, default=0.0)
        point = StepPoint(
            step=r.step,
            policy_version=r.version,
            t=r.t,
            seq=r.seq,
            rollouts=len(r.rollout_ids),
            tokens=r.tokens,
            reward_mean=reward,
            reward_by_env=_means_by([(x.env, x.reward) for x in trained]),
            reward_by_tenant=_means_by([(x.tenant, x.reward) for x in trained]),
            trainer={k: float(r.metrics.get(k, 0.0)) for k in TRAINER_METRICS},
            staleness_mean=stale_mean,
            staleness_max=stale_max,
            queue_staleness_mean=_mean(queued),
            seq_len_mean=_mean([float(x.length or 0) for x in trained]),
            truncated_frac=_mean([1.0 if reason == "length" else 0.0 for reason in reasons if reason]),
            tokens_per_s=r.tokens / span if span > 0 else 0.0,
            inference_weight_wait_frac=self._wait_since_step / inference_s if inference_s > 0 else 0.0,
            withheld=self._withheld_since_step,
            late_samples=self._late_since_step,
            dead_letters=self._dead_since_step,
            pending_samples=self.pending_samples,
            pending_rollouts=self.pending_rollouts,
        )
        self._wait_since_step = self._busy_since_step = 0.0
        self._withheld_since_step = self._dead_since_step = self._late_since_step = 0
        self.latest_version = max(self.latest_version, r.version)
        self.last_step_t = r.t
        if self.from_step is not None and r.step < self.from_step:
            return None
        self.steps.append(point)
        return point

    # ------------------------------------------------------------------ views

    @property
    def pending_samples(self) -> int:
        return max(0, self._asked - self._generated)

    @property
    def pending_rollouts(self) -> int:
        return len(self._queued)

    def firing(self) -> set[tuple[str, str]]:
        """The (rule, key) of every alert firing now."""
        return {k for k, a in self.alerts.items() if a.state == "firing"}

    def dead_letters_since(self, t: float) -> int:
        return sum(1 for x in self.dead_times if x >= t)

    def snapshot(self, now: float) -> dict[str, Any]:
        """Everything a dashboard shows at ``now``, as JSON-ready values."""
        last = self.steps[-1] if self.steps else None
        return {
            "run_id": self.run_id,
            "status": self.finished.status if self.finished else "running",
            "events": self.events,
            "last_seq": self.last_seq,
            "now": now,
            "latest": last.as_json() if last else None,
            "workers": [
                {
                    "worker_id": w.worker_id,
                    "kind": w.kind,
                    "status": w.status,
                    "loaded_version": w.loaded_version,
                    "inflight": w.inflight,
                    "heartbeat_age_s": round(max(0.0, now - w.last_seen), 1),
                }
                for w in sorted(self.workers.values(), key=lambda w: w.worker_id)
            ],
            "withheld": dict(sorted(self.withheld_by_reason.items())),
            "dead_letters": dict(sorted(self.dead_by_reason.items())),
            "pending_samples": self.pending_samples,
            "pending_rollouts": self.pending_rollouts,
            "alerts": [dataclasses.asdict(a) for a in sorted(self.alerts.values(), key=lambda a: -a.t)],
            "alert_counts": dict(sorted(self.alert_counts.items())),
        }
