"""Periodic evaluation on an environment's held-out split, as events (docs/events.md).

Every ``eval_every`` policy versions (the trainer's latest, as the producer tracks it) the
producer hands out its environment's ``eval_tasks(n)`` as TaskSubmitted events of their own id
namespace (:func:`ids.eval_task_id`) marked ``info["eval"]``, ``eval_samples`` samples each, with
``min_policy_version`` the evaluated version. Their completions are scored as usual (a multi-turn
episode goes through its FollowUp turns), but into the evaluation, never into a RolloutsScored:
the trainer takes nothing else, so nothing of an evaluation is trained on. Once every sample is
scored, one EvaluationReported follows (event id from tenant, env and version).

Success of a sample: its score's ``exact`` part is 1.0 when it has one, else its reward is at
least 1.0. pass@1 is the share of successful samples, pass@k the unbiased estimator averaged
over tasks, with k = n = ``eval_samples``.

Restart: the log is the state. Every evaluation's tasks and the reports already made are read
back; for one not reported yet, its missing tasks are handed out and the generations already
scored (acked before the restart) are read from the generation subject, from its first task on,
and scored again. A sample is keyed by its first turn's task and sample index, so a generation
delivered twice (or read back and then redelivered) is counted once.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jetrl.bus import events as ev
from jetrl.bus import ids, subjects
from jetrl.bus.consumer import Delivery
from jetrl.bus.log import get_logger
from jetrl.bus.streams import stream_name
from jetrl.producers.environments import Score, Task

if TYPE_CHECKING:
    from jetrl.producers.producer import EnvProducer

EVAL_KEY = "eval"  # info key of an evaluation's tasks: {"version", "tasks", "samples"}
MAX_LISTED = 64  # per-task success counts ride in the report up to this many tasks


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one task with ``c`` successes among ``n`` samples:
    ``1 - C(n - c, k) / C(n, k)``, the chance that k of the n samples drawn without replacement
    hold at least one success."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:  # every draw of k holds a success
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def success(score: Score) -> bool:
    exact = score.parts.get("exact")
    return exact == 1.0 if exact is not None else score.reward >= 1.0


@dataclass(frozen=True)
class Sample:
    reward: float
    success: bool
    version_start: int
    version_end: int


@dataclass
class Evaluation:
    """One evaluated version: its tasks (first turns) in order and the samples scored so far."""

    version: int
    n_tasks: int
    samples: int
    temperature: float
    submitted: set[str] = field(default_factory=set)  # task ids already in the log
    first_seq: int | None = None  # stream sequence of its first task (a restart reads from it)
    results: dict[tuple[str, int], Sample] = field(default_factory=dict)
    reported: bool = False

    @property
    def complete(self) -> bool:
        return len(self.results) >= self.n_tasks * self.samples

    def report(self, env: str, tenant: str) -> ev.EvaluationReported:
        counts = dict.fromkeys(self.task_ids(env, tenant), 0)
        for (tid, _), smp in self.results.items():
            counts[tid] = counts.get(tid, 0) + smp.success
        per_task = list(counts.values())
        res = list(self.results.values())
        return ev.EvaluationReported(
            env=env,
            policy_version=self.version,
            n_tasks=self.n_tasks,
            samples=self.samples,
            pass_at_1=sum(per_task) / len(res),
            pass_at_k=sum(pass_at_k(self.samples, c, self.samples) for c in per_task) / self.n_tasks,
            reward_mean=sum(s.reward for s in res) / len(res),
            version_min=min(s.version_start for s in res),
            version_max=max(s.version_end for s in res),
            temperature=self.temperature,
            successes=per_task if self.n_tasks <= MAX_LISTED else [],
        )

    def task_ids(self, env: str, tenant: str) -> list[str]:
        return [ids.eval_task_id(env, tenant, self.version, i) for i in range(self.n_tasks)]


class Evaluator:
    """The producer's evaluations: when to start one, its samples as they are scored, its report."""

    def __init__(self, producer: EnvProducer) -> None:
        self.p = producer
        self.s = producer.s
        self.evals: dict[int, Evaluation] = {}
        self.floor = 0  # the trainer's newest multiple of eval_every when this producer started
        self.split: list[Task] | None = None  # the held-out tasks, asked of the environment once
        self.log = get_logger(__name__, run_id=producer.run_id, tenant=self.s.tenant, env=self.s.name)

    @property
    def enabled(self) -> bool:
        return self.s.eval_every > 0

    # ---------------------------------------------------------------- restart

    def note_task(self, seq: int, task: ev.TaskSubmitted) -> None:
        """An evaluation task read back from the log."""
        spec = task.info.get(EVAL_KEY)
        if task.turn != 0 or not isinstance(spec, dict):
            return
        e = self.evals.get(int(spec["version"]))
        if e is None:
            e = self.evals[int(spec["version"])] = Evaluation(
                int(spec["version"]), int(spec["tasks"]), int(spec["samples"]), task.temperature
            )
        e.submitted.add(task.task_id)
        e.first_seq = seq if e.first_seq is None else min(e.first_seq, seq)

    async def restore(self) -> None:
        """After the producer's tasks are read back: the reports made, the trainer's version
        now, and the samples of every unfinished evaluation scored again from the log."""
        if not self.evals and not self.enabled:
            return
        p = self.p
        subj = subjects.eval_subject(p.run_id, self.s.tenant, self.s.name)
        async for item in p.tail(subj, to_head=True):
            b = item.event.body if item.event else None
            if isinstance(b, ev.EvaluationReported) and b.policy_version in self.evals:
                self.evals[b.policy_version].reported = True
        latest = await self._trainer_version()
        if self.enabled:
            self.floor = latest // self.s.eval_every * self.s.eval_every
        open_ = [e for e in self.evals.values() if not e.reported]
        seqs = [e.first_seq for e in open_ if e.first_seq is not None]
        if seqs:
            gens = subjects.generation_subject(p.run_id, self.s.tenant, self.s.name)
            async for item in p.tail(gens, from_seq=min(seqs), to_head=True):
                g = item.event.body if item.event else None
                if not isinstance(g, ev.CompletionsGenerated) or not ids.is_eval_task(g.task_id):
                    continue
                task = p.tasks.get(g.task_id)
                if task is None:
                    continue
                for smp in g.samples:
                    result = await p.env.areact(task.info, g.turn, await self._completion(smp))
                    if isinstance(result, Score):  # a FollowUp's next turn is in the log already
                        self.record(task, g, smp, result)
        for e in open_:
            await self._hand_out(e)  # what a crash mid-submission left out
            if e.complete:
                await self._report(e, cause=None)
        if self.evals:
            self.log.info(
                "evaluations_restored",
                evaluations=len(self.evals),
                unfinished=sum(not e.reported for e in self.evals.values()),
            )

    async def _trainer_version(self) -> int:
        """The newest StepCompleted's version: one direct get, not a read of every step."""
        p = self.p
        with contextlib.suppress(Exception):  # no step yet (or a server without direct get)
            msg = await p.bus.js.get_last_msg(
                p.view or stream_name(p.run_id), subjects.step_subject(p.run_id)
            )
            b = ev.decode_event(msg.data or b"").body
            if isinstance(b, ev.StepCompleted):
                return b.policy_version
        return 0

    # ---------------------------------------------------------------- tasks out

    async def maybe_start(self, trainer_version: int) -> None:
        """Start the evaluation of the newest multiple of ``eval_every`` at or below the
        trainer's version, unless it (or a newer one) exists. Only the newest: multiples the
        trainer passed before this producer started (or between two looks) are skipped rather
        than all evaluated late by the same newer weights (``version_min`` says which)."""
        if not self.enabled:
            return
        version = trainer_version // self.s.eval_every * self.s.eval_every
        if version < self.floor or version in self.evals or any(v > version for v in self.evals):
            return
        if self.split is None:
            self.split = await asyncio.to_thread(self.p.env.eval_tasks, self.s.eval_tasks)
            if not self.split:
                self.log.warning(
                    "evaluation_off", reason=f"environment {self.s.env_kind!r} has no held-out split"
                )
        if not self.split:
            return
        e = self.evals[version] = Evaluation(
            version, len(self.split), self.s.eval_samples, self.s.eval_temperature
        )
        self.log.info("evaluation_started", policy_version=version, tasks=e.n_tasks, samples=e.samples)
        await self._hand_out(e)

    async def _hand_out(self, e: Evaluation) -> None:
        """Every task of ``e`` not in the log yet (all of them, unless a restart found some)."""
        tids = e.task_ids(self.s.name, self.s.tenant)
        if all(t in e.submitted for t in tids):
            return
        split = self.split
        if split is None or len(split) < e.n_tasks:  # a restart with other settings: the log's count
            split = await asyncio.to_thread(self.p.env.eval_tasks, e.n_tasks)
        spec = {"version": e.version, "tasks": e.n_tasks, "samples": e.samples}
        for tid, task in zip(tids, split, strict=False):  # a shorter split: what it has
            if tid in e.submitted:
                continue
            await self.p.hand_out(
                tid,
                group_size=e.samples,
                prompt_tokens=task.prompt_tokens,
                prompt_text=task.prompt_text,
                max_tokens=task.max_tokens,
                info={**task.info, "max_tokens": task.max_tokens, EVAL_KEY: spec},
                min_policy_version=e.version,
                temperature=e.temperature,
            )
            e.submitted.add(tid)

    # ---------------------------------------------------------------- scores in

    def record(
        self, task: ev.TaskSubmitted, g: ev.CompletionsGenerated, smp: ev.Completion, score: Score
    ) -> Evaluation | None:
        """One sample's final score (the first one counts); the evaluation it belongs to."""
        spec = task.info.get(EVAL_KEY)
        e = self.evals.get(int(spec["version"])) if isinstance(spec, dict) else None
        if e is None:
            return None
        episode = task.episode
        if episode is None:
            key, start = (g.task_id, smp.sample_index), g.policy_version_start
        else:
            key, start = (
                (episode.task_id, episode.sample_index),
                min(episode.version_start, g.policy_version_start),
            )
        e.results.setdefault(key, Sample(float(score.reward), success(score), start, g.policy_version_end))
        return e

    async def scored(
        self,
        d: Delivery[ev.CompletionsGenerated],
        task: ev.TaskSubmitted,
        scores: list[tuple[ev.Completion, Score]],
    ) -> None:
        """What the producer does with an evaluation's scores instead of a RolloutsScored."""
        for smp, score in scores:
            e = self.record(task, d.body, smp, score)
            if e is not None and e.complete and not e.reported:
                await self._report(e, cause=d.event)

    async def _report(self, e: Evaluation, cause: ev.Event | None) -> None:
        p = self.p
        body = e.report(self.s.name, self.s.tenant)
        e.reported = True  # before the await: concurrent scorers publish it once
        try:
            await p.bus.publish(
                ev.new_event(
                    body,
                    run_id=p.run_id,
                    tenant=self.s.tenant,
                    causation_id=cause.event_id if cause else None,
                    event_id=ids.evaluation_event_id(p.run_id, self.s.tenant, self.s.name, e.version),
                )
            )
        except BaseException:
            e.reported = False  # the delivery is retried and reports it then
            raise
        self.log.info(
            "evaluation_reported",
            policy_version=e.version,
            pass_at_1=round(body.pass_at_1, 4),
            pass_at_k=round(body.pass_at_k, 4),
            k=e.samples,
            reward_mean=round(body.reward_mean, 4),
        )

    async def _completion(self, smp: ev.Completion) -> list[int]:
        assert self.p.payloads is not None
        arr = await self.p.payloads.get_array(smp.completion_tokens)
        return [int(t) for t in np.asarray(arr, np.int64)]
