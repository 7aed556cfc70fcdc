"""An environment producer: hands out tasks and scores the completions that come back.

Tasks out: it keeps at most ``groups_per_step * (1 + max_off_policy_steps)`` groups of its
environment outstanding (submitted, neither trained nor withheld), and asks each new task for a
policy at least as new as the trainer's latest version. With ``max_off_policy_steps = 0`` that is
the synchronous on-policy loop; above, inference runs ahead of the trainer by that many steps.

Scores in: a durable consumer on the environment's generation subject scores each
CompletionsGenerated (a task's samples) into one RolloutsScored (event id derived from the
generation's, so a redelivered generation is scored once): a group's rollouts in one event, or,
in a multi-turn environment, each episode's rollout as the episode ends. An optional simulated
latency (lognormal) stands in for slow environments such as sandboxes and tool calls; scoring
runs concurrently.

Evaluation (producers/evaluation.py): every ``eval_every`` policy versions, the environment's
held-out split, scored into one EvaluationReported instead of rollouts.

Restart: what was submitted, trained and withheld is re-read from the log.

A tenant's producer (connected with a tenant's credentials, on any machine) reads the run only
through its view (bus/streams.py), the only stream its identity may read, and carries every
array inline: the run's payload store is jetrl's. Tasks refused by inference (a quota, a bad
value) come back as dead letters on the tenant's own subject; their groups are counted as
resolved, so that the window does not wait for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import numpy as np
import structlog

from jetrl.bus import events as ev
from jetrl.bus import ids, subjects
from jetrl.bus.client import Bus, TailItem
from jetrl.bus.consumer import ConsumerSpec, Delivery, Reject
from jetrl.bus.identity import unless_set
from jetrl.bus.log import get_logger
from jetrl.bus.payloads import NoPayloadStore, ObjectStorePayloads, PayloadError, Payloads, log_array
from jetrl.bus.publisher import Publisher
from jetrl.bus.streams import StreamLimits, view_stream_name
from jetrl.policy.tokenizer import tokenizer_for
from jetrl.producers.environments import Environment, FollowUp, Score, make_environment
from jetrl.producers.evaluation import Evaluator
from jetrl.producers.settings import ProducerPart


class EnvProducer:
    def __init__(self, bus: Bus, run_id: str, part: ProducerPart) -> None:
        self.bus = bus
        self.run_id = run_id
        self.part = part
        self.s = settings = part.env
        self.env: Environment = make_environment(
            settings.env_kind, tokenizer_for(part.model), **settings.params
        )
        self.prefix = ids.task_prefix(settings.name, settings.tenant)
        self.tasks: dict[str, ev.TaskSubmitted] = {}  # what a generation answers (for scoring)
        self.submitted = 0
        self.resolved: set[str] = set()  # group ids trained or withheld
        self.trainer_version = 0
        self.changed = asyncio.Event()
        self.payloads: Payloads | None = None
        self.scored = 0
        self.latency_rng = random.Random(part.seed + 17)
        self.log = get_logger(__name__, run_id=run_id, tenant=settings.tenant, env=settings.name)
        ident = bus.identity
        if ident is not None and ident.tenant is not None and ident.tenant != settings.tenant:
            raise ValueError(
                f"identity {ident.name!r} cannot feed env {settings.name!r} of tenant {settings.tenant!r}"
            )
        # A tenant reads the run through its view; jetrl's own producers read the log.
        self.view = view_stream_name(run_id, settings.tenant) if ident and ident.tenant else None
        self.refused = 0
        self.evaluator = Evaluator(self)

    @property
    def window(self) -> int:
        if self.s.inflight_groups is not None:
            return self.s.inflight_groups
        return self.part.groups_per_step * (1 + self.part.max_off_policy_steps)

    @property
    def outstanding(self) -> int:
        return self.submitted - len(self.resolved)

    # ---------------------------------------------------------------- log watchers

    def tail(
        self,
        subject: str,
        *,
        from_seq: int | None = None,
        to_head: bool = False,
        types: frozenset[str] | None = None,
    ) -> AsyncIterator[TailItem]:
        """Read ``subject`` of the run in order: from the log, or from the tenant's view (whose
        sequences are its own: items carry the log's, so ``from_seq`` is not used there)."""
        if self.view is not None:
            return self.bus.tail(
                self.run_id, filter_subject=subject, to_head=to_head, stream=self.view, types=types
            )
        return self.bus.tail(
            self.run_id, filter_subject=subject, from_seq=from_seq, to_head=to_head, types=types
        )

    async def wait_for_view(self, stop: asyncio.Event) -> bool:
        """A tenant's view is made by jetrl (the run's supervisor, or `jetrl tenants join
        --nats-url`); a producer started first waits for it, saying what it waits for."""
        if self.view is None:
            return True
        said = False
        while not stop.is_set():
            try:
                await self.bus.js.stream_info(self.view)
                return True
            except Exception as exc:
                if not said:
                    self.log.warning(
                        "waiting_for_view",
                        view=self.view,
                        hint="the run has not started, or this tenant has not joined it "
                        "(`jetrl tenants join TENANT RUN`)",
                        error=repr(exc)[:200],
                    )
                    said = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)
        return False

    async def catch_up(self) -> None:
        """Tasks this producer submitted before a restart (their answers are needed to score)."""
        subj = subjects.task_subject(self.run_id, self.s.tenant, self.s.name)
        async for item in self.tail(subj, to_head=True):
            b = item.event.body if item.event else None
            if isinstance(b, ev.TaskSubmitted):
                self.tasks[b.task_id] = b
                if ids.is_eval_task(b.task_id):  # not in the window: the evaluator's
                    self.evaluator.note_task(item.seq, b)
                elif b.turn == 0:  # later turns belong to a group already counted
                    self.submitted = max(self.submitted, int(ids.task_number(b.task_id)) + 1)

    async def watch_steps(self) -> None:
        async for item in self.tail(subjects.step_subject(self.run_id)):
            b = item.event.body if item.event else None
            if isinstance(b, ev.StepCompleted):
                self.trainer_version = max(self.trainer_version, b.policy_version)
                for rid in b.rollout_ids:
                    g = ids.group_of(rid)
                    if g.startswith(self.prefix):
                        self.resolved.add(g)
                self.changed.set()

    async def watch_withheld(self) -> None:
        subj = subjects.rollout_subject(self.run_id, self.s.tenant, self.s.name)
        # The subject carries this env's scored groups too: those are not read.
        async for item in self.tail(subj, types=frozenset({ev.RolloutWithheld.TYPE})):
            b = item.event.body if item.event else None
            if isinstance(b, ev.RolloutWithheld) and b.group_id.startswith(self.prefix):
                self.resolved.add(b.group_id)
                self.changed.set()

    async def watch_refusals(self) -> None:
        """Tasks of this environment that inference refused (dead letters on the tenant's own
        subject): their groups will never be answered, so they leave the window, and the
        reason is logged for the team to read."""
        own = subjects.task_subject(self.run_id, self.s.tenant, self.s.name)
        async for item in self.tail(subjects.dlq_subject(self.run_id, self.s.tenant)):
            b = item.event.body if item.event else None
            if not isinstance(b, ev.DeadLettered) or b.original_subject != own:
                continue
            try:
                task = ev.decode_event(b.original_data).body
            except ev.EventDecodeError:
                continue
            if not isinstance(task, ev.TaskSubmitted) or ids.is_eval_task(task.task_id):
                continue
            group = task.episode.group_id if task.episode else task.task_id
            if group.startswith(self.prefix) and group not in self.resolved:
                self.resolved.add(group)
                self.refused += 1
                self.changed.set()
                self.log.warning("task_refused", task_id=task.task_id, reason=b.reason, detail=b.detail[:300])

    # ---------------------------------------------------------------- tasks out

    async def submit_loop(self, stop: asyncio.Event) -> None:
        rng = random.Random(self.part.seed * 7919 + self.submitted)
        while not stop.is_set():
            await self.evaluator.maybe_start(self.trainer_version)
            # The window's free slots in one go, pipelined: a worker finds them together and
            # generates them as one batch rather than as they trickle in.
            pub = self.bus.publisher(max_inflight=256)
            while self.outstanding < self.window and not stop.is_set():
                task = self.env.make_task(rng)
                await self.hand_out(
                    ids.task_id(self.s.name, self.s.tenant, self.submitted),
                    group_size=self.s.group_size,
                    prompt_tokens=task.prompt_tokens,
                    prompt_text=task.prompt_text,
                    max_tokens=task.max_tokens,
                    info={**task.info, "max_tokens": task.max_tokens},
                    pub=pub,
                )
                self.submitted += 1
            await pub.flush()
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):  # a stop ends the wait, too
                await unless_set(stop, asyncio.wait_for(self.changed.wait(), timeout=1.0))

    async def hand_out(
        self,
        task_id: str,
        *,
        cause: ev.Event | None = None,
        min_policy_version: int | None = None,
        temperature: float | None = None,
        pub: Publisher | None = None,
        **fields: Any,
    ) -> None:
        """Publish one model turn as a TaskSubmitted (its id derived from the task's, so a
        restarted producer that hands it out again is deduplicated) and keep it to score the
        answers. By default it asks for the trainer's latest version at the env's temperature.
        With ``pub``, the publish is pipelined: durable once ``pub`` is flushed."""
        body = ev.TaskSubmitted(
            task_id=task_id,
            env=self.s.name,
            min_policy_version=self.trainer_version if min_policy_version is None else min_policy_version,
            temperature=self.s.temperature if temperature is None else temperature,
            **fields,
        )
        self.tasks[task_id] = body
        event = ev.new_event(
            body,
            run_id=self.run_id,
            tenant=cause.tenant if cause else self.s.tenant,
            causation_id=cause.event_id if cause else None,
            event_id=ids.task_event_id(self.run_id, task_id),
        )
        if pub is None:
            await self.bus.publish(event)
        else:
            await pub.publish(event)

    # ---------------------------------------------------------------- scores in

    def latency(self) -> float:
        if self.s.latency_median_s <= 0:
            return 0.0
        return self.latency_rng.lognormvariate(math.log(self.s.latency_median_s), self.s.latency_sigma)

    async def score(self, d: Delivery[ev.CompletionsGenerated]) -> None:
        """Score a task's samples: each one's score, or its episode's next turn; the scores of
        a group in one RolloutsScored (an evaluation's into its report instead)."""
        g = d.body
        task = self.tasks.get(g.task_id)
        if task is None:
            raise Reject(f"generation for unknown task {g.task_id!r}", reason="invalid")
        if sorted(s.sample_index for s in g.samples) != list(range(task.group_size)):
            raise Reject(
                f"generation of task {g.task_id!r}: samples {[s.sample_index for s in g.samples]} "
                f"for a task of {task.group_size}",
                reason="invalid",
            )
        assert self.payloads is not None
        try:
            completions = [
                (await self.payloads.get_array(s.completion_tokens)).astype(np.int64).tolist()
                for s in g.samples
            ]
        except PayloadError as exc:  # never readable here: a dead letter, not retries
            raise Reject(f"generation of task {g.task_id}: {exc}", reason="unreadable") from None
        # Each sample's environment may take its time (a sandbox, a tool): side by side.
        delay = max((self.latency() for _ in g.samples), default=0.0)
        if delay:
            async with d.keep_alive(every=10.0):
                await asyncio.sleep(delay)
        if type(self.env).areact is Environment.areact:  # scored in place: no task a sample
            results = [self.env.react(task.info, g.turn, c) for c in completions]
        else:  # an environment whose scoring awaits: the samples side by side
            results = list(
                await asyncio.gather(*(self.env.areact(task.info, g.turn, c) for c in completions))
            )
        scores: list[tuple[ev.Completion, list[int], Score]] = []
        for sample, completion, result in zip(g.samples, completions, results, strict=True):
            if isinstance(result, FollowUp):
                await self.next_turn(d, g, sample, task, completion, result)
            else:
                scores.append((sample, completion, result))
        if not scores:
            return
        if ids.is_eval_task(g.task_id):  # held out: into the evaluation, never a rollout
            await self.evaluator.scored(d, task, [(smp, score) for smp, _, score in scores])
            return
        if task.episode is None:
            body = ev.RolloutsScored(
                generation_event_id=d.event.event_id,
                task_id=g.task_id,
                env=g.env,
                group_id=g.task_id,
                group_size=task.group_size,
                # The generation's arrays, not a second copy of them (bus/payloads.py).
                prompt_tokens=g.prompt_tokens,
                rollouts=[self.rollout_of(d.seq, g, smp, score) for smp, _, score in scores],
            )
        else:
            ((smp, completion, score),) = scores  # a later turn has one sample
            body = await self.episode_rollout(d, g, smp, task.episode, completion, score)
        await self.bus.publish(
            ev.new_event(
                body,
                run_id=self.run_id,
                tenant=d.event.tenant,
                causation_id=d.event.event_id,
                event_id=ids.scored_event_id(self.run_id, d.event.event_id),
            )
        )
        self.scored += len(body.rollouts)

    @staticmethod
    def rollout_of(
        seq: int, g: ev.CompletionsGenerated, smp: ev.Completion, score: Score
    ) -> ev.ScoredRollout:
        """A single-turn sample's rollout: its arrays where they lie in the generation (``seq``)."""
        at = f"samples.{g.samples.index(smp)}"
        trace = smp.routing_trace
        return ev.ScoredRollout(
            rollout_id=ids.rollout_id(g.task_id, smp.sample_index),
            sample_index=smp.sample_index,
            reward=float(score.reward),
            reward_parts=score.parts,
            completion_tokens=log_array(seq, f"{at}.completion_tokens", smp.completion_tokens),
            logprobs=log_array(seq, f"{at}.logprobs", smp.logprobs),
            routing_trace=None if trace is None else log_array(seq, f"{at}.routing_trace", trace),
            policy_version_start=g.policy_version_start,
            policy_version_end=g.policy_version_end,
        )

    async def next_turn(
        self,
        d: Delivery[ev.CompletionsGenerated],
        g: ev.CompletionsGenerated,
        smp: ev.Completion,
        task: ev.TaskSubmitted,
        completion: list[int],
        reply: FollowUp,
    ) -> None:
        """The environment's turn: the episode so far rides in the next task (so a restarted
        producer finds it in the log), and the next model turn is handed out. Token in, token
        out: the next prompt is this one's tokens plus the completion and the reply's tokens."""
        assert self.payloads is not None
        episode = task.episode
        if episode is None:
            episode = ev.EpisodeState(
                group_id=g.task_id,
                sample_index=smp.sample_index,
                group_size=task.group_size,
                task_id=g.task_id,
                prompt=list(task.prompt_tokens),
                completion=[],
                mask=[],
                logprobs=[],
                version_start=g.policy_version_start,
                max_tokens=int(task.info.get("max_tokens", 0)),
            )
        logprobs = (await self.payloads.get_array(smp.logprobs)).astype(np.float64).tolist()
        follow = self.env.tok.encode_reply(reply.text, role=reply.role)
        if not completion or completion[-1] not in self.env.tok.stop_ids:
            # The turn ran out of tokens: close it as the template would (its end-of-turn
            # token, masked out with the reply), so the next prompt keeps the template's shape.
            follow = [self.env.tok.eos_id, *follow]
        episode = msgspec.structs.replace(
            episode,
            completion=[*episode.completion, *completion, *follow],
            mask=[*episode.mask, *([1] * len(completion)), *([0] * len(follow))],
            logprobs=[*episode.logprobs, *logprobs, *([0.0] * len(follow))],
            version_start=min(episode.version_start, g.policy_version_start),
        )
        await self.hand_out(
            ids.turn_task_id(smp.generation_id, g.turn + 1),
            group_size=1,
            prompt_tokens=[*episode.prompt, *episode.completion],
            prompt_text=reply.text,
            max_tokens=episode.max_tokens or 8,
            info={**task.info, **reply.info},
            episode=episode,
            episode_id=episode.task_id,
            turn=g.turn + 1,
            worker_hint=g.worker_id,  # its prefix cache holds this history (prefix-aware routing)
            cause=d.event,
            temperature=task.temperature,  # an episode keeps its first turn's (evaluations' own)
        )

    async def episode_rollout(
        self,
        d: Delivery[ev.CompletionsGenerated],
        g: ev.CompletionsGenerated,
        smp: ev.Completion,
        episode: ev.EpisodeState,
        completion: list[int],
        score: Score,
    ) -> ev.RolloutsScored:
        """The whole episode as one rollout: the first prompt, then every turn, with a mask that
        keeps the environment's text out of the loss."""
        assert self.payloads is not None
        logprobs = (await self.payloads.get_array(smp.logprobs)).astype(np.float32).tolist()
        tokens = [*episode.completion, *completion]
        mask = [*episode.mask, *([1] * len(completion))]
        lps = [*episode.logprobs, *logprobs]
        rid = ids.rollout_id(episode.group_id, episode.sample_index)
        name = ids.episode_payload_id(self.run_id, rid)
        put = self.payloads.put_array
        prompt, tokens_ref, lps_ref, mask_ref = await asyncio.gather(
            put(f"prompt-{name}", np.asarray(episode.prompt, np.int32)),
            put(f"tokens-{name}", np.asarray(tokens, np.int32)),
            put(f"logprobs-{name}", np.asarray(lps, np.float32)),
            put(f"mask-{name}", np.asarray(mask, np.uint8)),
        )
        trace = smp.routing_trace
        return ev.RolloutsScored(
            generation_event_id=d.event.event_id,
            task_id=episode.task_id,
            env=g.env,
            group_id=episode.group_id,
            group_size=episode.group_size,
            prompt_tokens=prompt,
            rollouts=[
                ev.ScoredRollout(
                    rollout_id=rid,
                    sample_index=episode.sample_index,
                    reward=float(score.reward),
                    reward_parts=score.parts,
                    completion_tokens=tokens_ref,
                    logprobs=lps_ref,
                    completion_mask=mask_ref,
                    # The last turn's trace covers the whole conversation (its prompt is the history).
                    routing_trace=None
                    if trace is None
                    else log_array(d.seq, f"samples.{g.samples.index(smp)}.routing_trace", trace),
                    policy_version_start=episode.version_start,
                    policy_version_end=g.policy_version_end,
                    turns=g.turn + 1,
                )
            ],
        )

    async def score_loop(self, stop: asyncio.Event) -> None:
        consumer = await self.bus.consumer(
            ConsumerSpec(
                run_id=self.run_id,
                durable=f"scorer-{self.s.tenant}-{self.s.name}",
                filter_subjects=[subjects.generation_subject(self.run_id, self.s.tenant, self.s.name)],
                stream=self.view,
                ack_wait=self.s.ack_wait_s,
                max_deliver=5,
                max_ack_pending=100_000,
            ),
            ev.CompletionsGenerated,
        )
        await consumer.run(
            self.score,
            batch=128,
            fetch_timeout=0.3,
            stop=stop,
            concurrency=self.s.max_concurrent_scoring,  # slow environments score side by side
        )

    async def run(self, stop: asyncio.Event) -> None:
        if not await self.wait_for_view(stop):
            return
        if self.view is None:
            self.payloads = Payloads(await ObjectStorePayloads.for_run(self.bus.js, self.run_id))
        else:
            # Every array in the event itself, up to the log's message size.
            self.payloads = Payloads(NoPayloadStore(), inline_threshold=StreamLimits().max_msg_size // 2)
        structlog.contextvars.bind_contextvars(
            run_id=self.run_id, tenant=self.s.tenant, worker_id=f"env-{self.s.name}"
        )
        await self.catch_up()
        await asyncio.to_thread(self.env.prepare)
        await self.evaluator.restore()  # scores again: after prepare
        watchers = [
            asyncio.create_task(self.watch_steps()),
            asyncio.create_task(self.watch_withheld()),
            asyncio.create_task(self.watch_refusals()),
        ]
        self.log.info("producer_started", submitted=self.submitted, window=self.window)
        try:
            await asyncio.gather(self.submit_loop(stop), self.score_loop(stop))
        finally:
            for w in watchers:
                w.cancel()
            for w in watchers:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await w
            self.log.info(
                "producer_stopped", submitted=self.submitted, scored=self.scored, refused=self.refused
            )
