"""The trainer consumer: scored rollouts in, policy versions out.

It pulls RolloutsScored events (a group's rollouts, or an episode's), gathers whole groups,
withholds groups staler than ``max_off_policy_steps`` (a RolloutWithheld event per rollout, never
a silent drop), and once it
holds ``batch_groups`` fresh groups takes one optimizer step on them with Router Replay. Then,
in this order, it publishes StepCompleted (the exact rollouts consumed, in training order),
writes the new weights to the payload store and announces them (PolicyVersionPublished,
WeightsReady), and only then acks the rollouts. Event ids derive from the step and
version, so a step re-published after a crash is stored once; rollouts the log says were trained
are acked and skipped if they are delivered again.

Scored rollouts come from tenants' producers and may be hostile: each is checked at admission
and its arrays again when its group is picked for a step (consumers/trainer/admission.py); a
refused rollout is dead-lettered with its reason and the rest of its group withheld
(``incomplete_group``), so it can neither crash the trainer nor enter a step. With several
``[[envs]]``, a batch's groups are split between them by share (consumers/trainer/batching.py).

On restart it rebuilds itself from the log (consumers/trainer/replay.py): the newest checkpoint,
then every logged step after it re-taken and checked against its recorded checksum.

Versions: version ``v`` is the policy after ``v`` steps; step ``k`` trains version ``k`` into
``k + 1``. A rollout's staleness at step ``k`` is ``k - policy_version_start``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import structlog

from jetrl.bus import events as ev
from jetrl.bus import ids, subjects
from jetrl.bus.client import Bus
from jetrl.bus.consumer import Batch, PullConsumer
from jetrl.bus.identity import cancel_and_wait
from jetrl.bus.log import get_logger
from jetrl.bus.payloads import PayloadError, Payloads, PayloadStore, WeightsAnnounced
from jetrl.bus.streams import payload_bucket
from jetrl.consumers.trainer.admission import (
    GROUP_REASONS,
    ModelLimits,
    check_member,
    check_read,
    check_rollouts,
    routes_by_key,
)
from jetrl.consumers.trainer.batching import fill_batch, more_groups
from jetrl.consumers.trainer.core import (
    RolloutArrays,
    ScoredView,
    TrainCore,
    array_refs,
    checkpoint_version,
    list_checkpoints,
)
from jetrl.consumers.trainer.groups import (
    Group,
    GroupBuffer,
    Member,
    StepUnderWay,
    StreamChoice,
    share_without_signal,
)
from jetrl.consumers.trainer.replay import Replayer, ReplayError, read_rollouts, read_run_log, trained_seqs
from jetrl.consumers.trainer.settings import TrainerPart
from jetrl.consumers.trainer.withholding import ScoredDelivery, rollout_consumer_spec, withheld_event
from jetrl.policy.columns import completion_length
from jetrl.policy.origin import model_config_of
from jetrl.policy.train import Rollout
from jetrl.policy.weights import ExportedWeights

# WeightsReady.format of each [trainer] weights_layout (docs/events.md).
WEIGHTS_FORMATS = {"jetrl": "safetensors", "hf": "safetensors-hf"}
FETCH_BATCH = 256  # scored-rollout events a fetch takes at most
# What reading a hostile rollout's arrays raises (a missing or corrupt payload, a LogArray to
# nothing or to another array, bytes that do not fit). Connection trouble is not among them: it
# propagates, and the trainer restarts, rather than refusing good rollouts.
READ_ERRORS = (PayloadError, ev.EventDecodeError, ValueError, TypeError)


class Trainer:
    def __init__(self, bus: Bus, run_id: str, part: TrainerPart, run_dir: Path) -> None:
        self.bus = bus
        self.run_id = run_id
        self.part = part
        self.s = settings = part.trainer
        self.ckpt_dir = run_dir / "trainer"
        self.core = TrainCore(part)
        self.version = 0
        self.trained: set[str] = set()
        self.withheld_ids: set[str] = set()
        self._task_events: dict[str, str] = {}  # task id -> its TaskSubmitted's event id
        self.buffer = GroupBuffer({(r.tenant, r.env): r.share for r in part.envs})
        self.under_way = StepUnderWay()  # a streaming step's groups so far
        self.stream_choice = StreamChoice()  # stream_groups = "auto"
        # When the last step ended, the start of the next step's cycle: None before this
        # process's first step, whose wait is the run's start-up, not the environments'.
        self.free_since: float | None = None
        # The last time this cycle the trainer found its next batch not yet whole.
        self.incomplete_at: float | None = None
        self.routes = routes_by_key(part.envs)
        mcfg = model_config_of(part.model)
        replay_traces = settings.replay and mcfg.is_moe
        self.limits = ModelLimits(
            max_seq_len=mcfg.max_seq_len,
            vocab_size=mcfg.vocab_size,
            trace=(mcfg.num_moe_layers, mcfg.top_k, mcfg.num_experts) if replay_traces else None,
            replay=settings.replay,
        )
        self.bucket = payload_bucket(run_id)
        self.payloads: Payloads | None = None
        self.weights_store: PayloadStore | None = None
        self.rewards: deque[float] = deque(maxlen=settings.reward_window)
        self.wait_s = 0.0
        # The last step's weights being put and announced, beside the next batch's reading.
        self.announcing: asyncio.Future[int] | None = None
        self.started = self.last_step_end = time.monotonic()
        self.log = get_logger(__name__, run_id=run_id, worker_id="trainer")

    # ---------------------------------------------------------------- start / recover

    async def recover(self) -> None:
        """Rebuild the trainer from the log: the newest usable checkpoint, then every logged
        step after it re-taken from the logged rollouts, each checked against the checksum the
        log recorded. A step logged without its weights (a crash in between) gets them now."""
        assert self.payloads is not None
        log = await read_run_log(self.bus, self.run_id)
        if 0 not in log.weights:
            await self.announce_version()
            self.log.info("initial_policy_published", version=0)
            return
        self.trained = log.trained_ids()
        self.buffer.rejected = await read_rejected_groups(self.bus, self.run_id)
        for step in sorted(log.steps)[-self.s.reward_window :]:
            self.rewards.append(log.steps[step].metrics.get("reward_mean", 0.0))
        replayer = Replayer(self.core, self.payloads, log)
        start: int | None = None
        for path in list_checkpoints(self.ckpt_dir):
            v = checkpoint_version(path)
            if v > log.last_step + 1:
                continue  # newer than the log (the log is the truth): unusable
            try:
                await replayer.start_at(v, self.ckpt_dir)
                start = v
                break
            except (ReplayError, ValueError, RuntimeError) as exc:
                self.log.warning("checkpoint_unusable", checkpoint=path.name, error=str(exc))
        if start is None:
            self.core = TrainCore(self.part)  # a refused checkpoint may have been half loaded
            replayer = Replayer(self.core, self.payloads, log)
            await replayer.start_at(0)
        needed = {rid for step, s in log.steps.items() if step >= replayer.version for rid in s.rollout_ids}
        t0 = time.perf_counter()
        rollouts, self.withheld_ids = await read_rollouts(
            self.bus, self.run_id, needed, trained_seqs(log, replayer.version)
        )
        checks = await replayer.run(rollouts)
        bad = [c for c in checks if not c.ok]
        if bad:
            raise ReplayError(
                f"recovery diverged at step {bad[0].step}: checksum {bad[0].got[:16]}... but the log has "
                f"{(bad[0].expected or '')[:16]}...; refusing to continue a run that cannot be reproduced"
            )
        self.version = replayer.version
        if self.version not in log.weights:
            await self.announce_version()  # the crash came between StepCompleted and WeightsReady
        elif self.version > 0 and self.weights_store is not None and self.weights_store.held_by_writer:
            # The announced bytes died with the trainer that held them: announce them again.
            await self.announce_version(again=True)
        elif self.version > 0:
            await self.restore_weights(log.weights[self.version])
        self.log.info(
            "trainer_recovered",
            version=self.version,
            from_checkpoint=start or 0,
            replayed_steps=len(checks),
            replay_s=round(time.perf_counter() - t0, 3),
            trained_rollouts=len(self.trained),
        )

    # ---------------------------------------------------------------- publishing

    async def export_weights(self) -> ExportedWeights:
        """The current weights, serialised. CPU work, off the event loop like training: one
        pass copies each tensor into the buffer the store sends from, hashing it into the
        checksum and the transfer digest on the way (policy/weights.py)."""
        meta = {"version": str(self.version), "run": self.run_id}
        return await asyncio.to_thread(self.core.engine.export_weights, meta)

    async def announce_version(self, exported: ExportedWeights | None = None, *, again: bool = False) -> int:
        """Make the current weights readable (``exported``, or exported here), then say so:
        PolicyVersionPublished and WeightsReady. Both event ids derive from the version, so a
        repeat is stored once; ``again``: a WeightsReady of its own for weights a restarted
        trainer holds anew."""
        assert self.weights_store is not None
        v = self.version
        if exported is None:
            exported = await self.export_weights()
        digest = exported.checksum
        # Version 0 is where a recovery without a checkpoint starts: where it outlives the trainer.
        store = self.weights_store
        if v == 0 and store.held_by_writer and self.payloads is not None:
            store = self.payloads.default
        # Readers check the bytes against the transfer digest: no SHA-256 pass of the store's.
        # Only version 0 must outlive a crash of the machine (a recovery without a checkpoint
        # starts from it); a later version's bytes lost with the machine are put again by the
        # recovered trainer (restore_weights).
        ref = await store.put(f"weights-v{v}", exported.data, sha256=False, durable=v == 0)
        if not again:
            await self.bus.publish(
                ev.new_event(
                    ev.PolicyVersionPublished(
                        version=v, step=v, weights_checksum=digest, parent_version=v - 1 if v else None
                    ),
                    run_id=self.run_id,
                    event_id=ids.policy_event_id(self.run_id, v),
                )
            )
        ack = await self.bus.publish(
            ev.new_event(
                ev.WeightsReady(
                    version=v,
                    location=ref,
                    weights_checksum=digest,
                    format=WEIGHTS_FORMATS[self.s.weights_layout],
                    blake3=exported.blake3,
                ),
                run_id=self.run_id,
                event_id=ids.weights_event_id(self.run_id, v, again=ref.name if again else None),
            )
        )
        keep = self.s.weights_keep
        if keep is not None and v - keep >= 1:  # announced first: a worker reads the newest
            await self.weights_store.discard(f"weights-v{v - keep}")
        return int(ack.seq)

    async def restore_weights(self, ready: WeightsAnnounced) -> None:
        """Weights after version 0 are put without a flush to disk, so a crash of the machine
        may have lost the announced bytes: where they no longer read back as announced, they
        are put again under the announced name (the same bytes: the recovered weights are the
        logged ones), or announced anew where the export differs."""
        assert self.payloads is not None
        try:
            await self.payloads.get_weights(ready)
            return
        except PayloadError as exc:
            self.log.warning("announced_weights_unreadable", version=self.version, error=str(exc))
        exported = await self.export_weights()
        if ready.blake3 is None or exported.blake3 != ready.blake3:
            await self.announce_version(again=True)
            return
        store = self.payloads.store(ready.location.store)
        await store.put(ready.location.name, exported.data, sha256=False, durable=False)
        self.log.info("announced_weights_restored", version=self.version)

    async def publish_step(
        self,
        *,
        step: int,
        rollout_ids: list[str],
        rollout_seqs: list[int],
        metrics: dict[str, float],
        tokens: int,
        duration_s: float,
        token_stats: ev.ArrayRef | None = None,
        micro_batches: list[int],
    ) -> int:
        """StepCompleted first: with the logged rollouts it determines the new weights, so a
        crash before they are announced is repaired by replay. The weights are exported while
        it is on its way (its round trip hidden behind the export's CPU work); once it is
        stored they are put and announced in the background (``announcing``), beside the next
        batch's reading: the next train call waits for them (:meth:`announced`), so the log's
        order is as if awaited here and the call runs alone. Returns its stream sequence."""
        publishing = asyncio.ensure_future(
            self.bus.publish(
                ev.new_event(
                    ev.StepCompleted(
                        step=step,
                        policy_version=self.version,
                        rollout_ids=rollout_ids,
                        rollout_seqs=rollout_seqs,
                        metrics=metrics,
                        tokens=tokens,
                        duration_s=duration_s,
                        token_stats=token_stats,
                        micro_batches=micro_batches,
                        final=self.done(),
                    ),
                    run_id=self.run_id,
                    event_id=ids.step_event_id(self.run_id, step),
                )
            )
        )
        try:
            exported = await self.export_weights()
        except BaseException:
            publishing.cancel()
            raise
        ack = await publishing
        self.announcing = asyncio.ensure_future(self.announce_version(exported))
        # Its error is raised where it is awaited (announced); a trainer torn down before that
        # (its connection closed under it) must not leave it to the garbage collector to report.
        self.announcing.add_done_callback(_retrieved)
        return int(ack.seq)

    async def announced(self) -> None:
        """The last step's weights put and announced (raising what their put raised): before
        the next train call, and before the trainer ends."""
        task, self.announcing = self.announcing, None
        if task is not None:
            await task

    async def withhold(self, group: Group, reason: ev.WithheldReason, detail: str) -> None:
        """Withhold every member of ``group`` (one RolloutWithheld each), then ack what brought
        them."""
        await self.withhold_members(group.members, reason, detail)
        self.log.info("group_withheld", group_id=group.group_id, reason=reason, detail=detail)

    async def withhold_members(self, members: list[Member], reason: ev.WithheldReason, detail: str) -> None:
        pub = self.bus.publisher(max_inflight=256)
        for m in members:
            await pub.publish(
                withheld_event(self.run_id, m.delivery, m.rollout, reason, detail, self.version)
            )
        await pub.flush()
        acked: set[int] = set()
        for m in members:
            if id(m.delivery) not in acked:
                acked.add(id(m.delivery))
                await m.delivery.ack()
        self.withheld_ids.update(m.rollout_id for m in members)

    def view(self, m: Member) -> ScoredView:
        task = m.delivery.body.task_id
        owner = self._task_events.get(task)
        if owner is None:  # a uuid5: computed once a group, not once a rollout and read
            owner = self._task_events[task] = ids.task_event_id(self.run_id, task)
            if len(self._task_events) > 100_000:
                self._task_events.clear()
        return m.view(owner)

    # ---------------------------------------------------------------- training

    async def step(
        self, consumer: PullConsumer[ev.RolloutsScored], groups: list[Group], wait_s: float, read_s: float
    ) -> None:
        """Train on ``groups`` (after a streaming step's groups under way) and publish the step.
        Unless it is the last, the groups the chain scored during the train call are fetched,
        admitted and read while StepCompleted goes out and the weights are exported (its round
        trip and the export's thread leave the loop idle); the weights' put and announcements
        follow in the background (:meth:`publish_step`)."""
        t0 = time.perf_counter()
        rollouts = await self.inputs(groups)
        await self.announced()
        u, self.under_way = self.under_way, StepUnderWay()
        if u.groups:
            metrics = await asyncio.to_thread(self.core.finish_step, rollouts)
            micro_batches = [*u.micro_batches, len(rollouts)]
        else:
            metrics = await asyncio.to_thread(self.core.train, rollouts)
            micro_batches = []
        groups = u.groups + groups
        members = [m for g in groups for m in g.members]
        rewards = [m.rollout.reward for m in members]
        stale = [self.version - m.rollout.policy_version_start for m in members]
        rollout_ids = [m.rollout_id for m in members]
        # Trained from here on: a redelivery of one of them admitted meanwhile is acked, not held.
        self.trained.update(rollout_ids)
        token_stats = await self.token_stats(self.version)
        step = self.version
        self.version += 1
        tokens = u.tokens + completion_length(rollouts)
        parts: dict[str, list[float]] = {}
        for m in members:
            for k, v in m.rollout.reward_parts.items():
                parts.setdefault(k, []).append(v)
        reward_mean = sum(rewards) / len(rewards)
        self.rewards.append(reward_mean)
        arrived = None if self.done() else asyncio.ensure_future(self.admit_arrived(consumer))
        elapsed = time.monotonic() - self.started
        metrics.update(
            reward_mean=reward_mean,
            reward_max=max(rewards),
            staleness_mean=sum(stale) / len(stale),
            staleness_max=float(max(stale)),
            trainer_wait_s=u.wait_s + wait_s,
            trainer_read_s=u.read_s + read_s,
            trainer_idle_frac=self.wait_s / elapsed if elapsed > 0 else 0.0,
            withheld_total=float(len(self.withheld_ids)),
            groups=float(len(groups)),
            groups_no_signal=share_without_signal([g.rewards() for g in groups]),
            **self.buffer.route_metrics(groups),
            **{f"reward_{k}": sum(v) / len(v) for k, v in parts.items()},
        )
        seqs = [m.seq for m in members]
        duration = u.busy_s + time.perf_counter() - t0
        metrics["step_s"] = duration
        try:
            step_seq = await self.publish_step(
                step=step,
                rollout_ids=rollout_ids,
                rollout_seqs=seqs,
                metrics=metrics,
                tokens=tokens,
                duration_s=duration,
                token_stats=token_stats,
                micro_batches=micro_batches,
            )
        except BaseException:
            if arrived is not None:
                await cancel_and_wait(arrived)
            raise
        if arrived is not None:
            await arrived
        # StepCompleted is durable: only now are the rollouts settled.
        for g in groups:
            for d in g.deliveries:
                await d.ack()
        if self.s.checkpoint_every and self.version % self.s.checkpoint_every == 0:
            await asyncio.to_thread(self.core.save_checkpoint, self.ckpt_dir, self.version, step_seq)
        structlog.contextvars.bind_contextvars(step=step)
        self.log.info(
            "step_completed",
            step=step,
            version=self.version,
            reward=round(reward_mean, 4),
            staleness=round(metrics["staleness_mean"], 2),
            loss=round(metrics.get("loss", 0.0), 5),
            step_s=round(duration, 3),
        )

    async def accumulate(self, groups: list[Group], wait_s: float, read_s: float) -> None:
        """A streaming step's groups that are not its last: their forward and backward now,
        while the rest are still on their way."""
        t0 = time.perf_counter()
        rollouts = await self.inputs(groups)
        await asyncio.to_thread(self.core.accumulate, rollouts)
        tokens = completion_length(rollouts)
        self.under_way.add(groups, tokens, wait_s, read_s, time.perf_counter() - t0)

    async def inputs(self, groups: list[Group]) -> Sequence[Rollout]:
        """The training inputs of vetted ``groups``, in training order: groups by arrival,
        samples by index (recorded in StepCompleted)."""
        for g in groups:
            g.members.sort(key=lambda m: m.rollout.sample_index)
        assert self.payloads is not None
        members = [m for g in groups for m in g.members]
        read = self.buffer.arrays_of(groups)
        return await self.core.rollouts([self.view(m) for m in members], self.payloads, read)

    async def token_stats(self, step: int) -> ev.ArrayRef | None:
        """The step's per-token trainer log-probs and routing differences as one array (in the
        payload store when large), when the engine records them and the run wants them."""
        stats = self.core.engine.step_token_stats()
        if stats is None or not len(stats) or not self.s.record_token_stats:
            return None
        assert self.payloads is not None
        return await self.payloads.put_array(f"token-stats-{step}", stats.numpy())

    def staleness(self, g: Group) -> int:
        """How many versions the trainer is past the group's oldest rollout's."""
        return self.version - g.oldest_version()

    def done(self) -> bool:
        if self.version >= self.s.max_steps:
            return True
        target = self.s.stop_at_reward
        return (
            target is not None
            and len(self.rewards) == self.rewards.maxlen
            and sum(self.rewards) / len(self.rewards) >= target
        )

    # ---------------------------------------------------------------- loop

    async def admit_arrived(self, consumer: PullConsumer[ev.RolloutsScored]) -> None:
        """Admit what the server already holds for this trainer, without waiting for more, and
        read and check the fresh groups that are whole: beside the weights' export, whose
        thread works through their reads' round trips."""
        await self.admit_all(consumer, await consumer.fetch_batch(FETCH_BATCH, wait=False))
        fresh = [g for g in self.buffer.ready() if self.staleness(g) <= self.s.max_off_policy_steps]
        if fresh:
            await self.vet(consumer, fresh)

    async def admit_all(
        self, consumer: PullConsumer[ev.RolloutsScored], got: Batch[ev.RolloutsScored]
    ) -> None:
        for d in got.deliveries:
            await self.admit(consumer, d)

    async def admit(self, consumer: PullConsumer[ev.RolloutsScored], d: ScoredDelivery) -> None:
        b = d.body
        # An event's rollouts share their fate: trained in one step, or withheld together. One
        # that mixes settled rollouts with new ones is no redelivery: it is refused.
        settled = [r.rollout_id in self.withheld_ids or r.rollout_id in self.trained for r in b.rollouts]
        if settled and all(settled):
            await d.ack()  # redelivered after a crash: already trained or withheld, never twice
            return
        if self.under_way.holds(b.rollouts):
            await d.ack()  # redelivered while its streaming step is under way: it is in there
            return
        if any(settled):
            await self.reject(
                consumer, d, "bad_ids", "rollouts already trained or withheld beside new ones in one event"
            )
            return
        tenant = d.event.tenant
        rejection = check_rollouts(
            b, tenant, routes=self.routes, limits=self.limits, version=self.version, bucket=self.bucket
        )
        g = self.buffer.get(b.group_id)
        if rejection is None and g is not None:
            rejection = check_member(g.members[0].delivery.body, b)
        if rejection is not None:
            await self.reject(consumer, d, *rejection)
            return
        if b.group_id in self.buffer.rejected:
            await self.withhold_members(
                [Member(d, r) for r in b.rollouts],
                "incomplete_group",
                f"group {b.group_id} has a dead-lettered member",
            )
            return
        if not self.buffer.add(d):
            await d.ack()  # the same rollouts twice in the buffer (redelivery): keep one

    async def reject(
        self, consumer: PullConsumer[ev.RolloutsScored], d: ScoredDelivery, reason: str, detail: str
    ) -> None:
        """Dead-letter ``d`` (on its tenant's dead-letter subject); when the reason condemns its
        group, withhold the members held and those still to come."""
        b = d.body
        await consumer.dead_letter(d, reason, f"rollouts of group {b.group_id}: {detail}")
        self.log.warning(
            "rollouts_rejected",
            tenant=d.event.tenant,
            env=b.env,
            group_id=b.group_id,
            rollout_ids=[r.rollout_id for r in b.rollouts][:16],
            reason=reason,
            detail=detail[:300],
        )
        if reason not in GROUP_REASONS:
            return
        rest = [m for m in self.buffer.condemn(b.group_id) if m.delivery is not d]
        if rest:
            await self.withhold(
                Group(b.group_id, rest),
                "incomplete_group",
                f"a member of group {b.group_id} was dead-lettered ({reason})",
            )

    async def vet(self, consumer: PullConsumer[ev.RolloutsScored], groups: list[Group]) -> bool:
        """Read and check the arrays of ``groups`` (each group once, kept for its step): a group
        whose arrays cannot be read or hold impossible values is rejected instead of failing
        the step. True when every group passed."""
        assert self.payloads is not None
        todo = [
            (g, [self.view(m) for m in g.members]) for g in groups if g.group_id not in self.buffer.vetted
        ]
        with contextlib.suppress(*READ_ERRORS):  # read ahead; a failure is pinned on its rollout below
            await self.payloads.prefetch([a for _, views in todo for v in views for a in array_refs(v)])
        ok = True
        for g, views in todo:
            read: dict[str, RolloutArrays] = {}
            refused: tuple[Member, tuple[str, str]] | None = None
            try:
                arrays = await self.core.read_many(views, self.payloads)
                read = {m.rollout_id: a for m, a in zip(g.members, arrays, strict=True)}
            except READ_ERRORS:
                # One of them cannot be read: find which, one by one, to refuse its event.
                for m, v in zip(g.members, views, strict=True):
                    try:
                        read[m.rollout_id] = await self.core.read_arrays(v, self.payloads)
                    except READ_ERRORS as exc:
                        refused = (m, ("bad_arrays", f"arrays cannot be read: {exc}"))
                        break
            if refused is None and _any_refused(read.values(), self.limits):
                # One of them holds an impossible value: find which, to refuse its event.
                for m in g.members:
                    a = read[m.rollout_id]
                    rejection = check_read(a.prompt, a.completion, a.logprobs, a.mask, a.trace, self.limits)
                    if rejection is not None:
                        refused = (m, rejection)
                        break
            if refused is not None:
                m, (reason, detail) = refused
                await self.reject(consumer, m.delivery, reason, f"rollout {m.rollout_id}: {detail}")
                ok = False
                continue
            self.buffer.vetted[g.group_id] = read
        return ok

    async def start(self) -> PullConsumer[ev.RolloutsScored]:
        """Stores, recovery from the log, and the consumer of scored rollouts."""
        self.payloads = await Payloads.for_run(
            self.bus.js, self.run_id, weights_dir=self.part.weights_dir, bus=self.part.bus
        )
        self.weights_store = self.payloads.store(self.part.bus.weights_store)
        structlog.contextvars.bind_contextvars(run_id=self.run_id, worker_id="trainer")
        await self.recover()
        consumer = await self.bus.consumer(rollout_consumer_spec(self.run_id, self.s), ev.RolloutsScored)
        self.started = self.last_step_end = time.monotonic()
        return consumer

    def streams(self) -> bool:
        """Whether the next groups go into a step under way (``stream_groups``; "auto": where
        the engine can and :class:`StreamChoice` says it pays). A step begun streaming is
        finished streaming."""
        mode = self.s.stream_groups
        if self.under_way.groups or mode is True:
            return True
        return mode == "auto" and self.core.can_stream and self.stream_choice.streams()

    async def train_ready(self, consumer: PullConsumer[ev.RolloutsScored]) -> bool:
        """Withhold the stale ready groups, then take one step if ``batch_groups`` fresh groups
        are ready, filled by the envs' shares; streaming (``stream_groups``), take those ready
        into the step under way, stepping once it is whole. Returns whether it trained."""
        ready_at: float | None = None
        while True:
            ready = []
            for g in self.buffer.ready():
                staleness = self.staleness(g)
                if staleness <= self.s.max_off_policy_steps:
                    ready.append(g)
                    continue
                self.buffer.drop(g.group_id)
                await self.withhold(
                    g, "stale", f"staleness {staleness} > max_off_policy_steps {self.s.max_off_policy_steps}"
                )
            batch: list[Group] = []
            if self.streams():
                taken = self.under_way.groups
                batch = more_groups(
                    ready, taken, self.s.batch_groups, self.buffer.shares, key=_route, rotate=self.version
                )
            elif len(ready) >= self.s.batch_groups:
                batch = fill_batch(
                    ready, self.s.batch_groups, self.buffer.shares, key=_route, rotate=self.version
                )
            if not batch:
                self.incomplete_at = time.monotonic()
                return False
            ready_at = ready_at or time.monotonic()
            if not await self.vet(consumer, batch):
                continue  # a group was rejected: fill the batch again from what is left
            self.buffer.take(batch)
            # Idle is the wait for a batch of fresh groups; reading and checking its arrays is
            # the trainer's own work, timed apart.
            wait, read = ready_at - self.last_step_end, time.monotonic() - ready_at
            self.wait_s += wait
            if len(self.under_way.groups) + len(batch) < self.s.batch_groups:
                self.incomplete_at = ready_at
                await self.accumulate(batch, wait, read)
            else:
                await self.step(consumer, batch, wait, read)
            self.last_step_end = time.monotonic()
            if not self.under_way.groups:  # a step was taken: its cycle is over
                self.note_cycle()
            return True

    def note_cycle(self) -> None:
        """The step just taken, for ``stream_groups = "auto"``: how far into its cycle the trainer
        last found its batch not yet whole. Not when the batch was found whole: a streaming
        trainer finds the last groups only after the micro-batch it was computing when they came,
        which would keep it streaming where whole batches would not have waited."""
        start, end = self.free_since, self.last_step_end
        if start is not None:
            late = self.incomplete_at - start if self.incomplete_at is not None else 0.0
            self.stream_choice.note(late, end - start)
        self.free_since, self.incomplete_at = end, None

    async def run(self, stop: asyncio.Event) -> int:
        consumer = await self.start()
        last_beat = time.monotonic()

        async def train_when_ready() -> bool:
            nonlocal last_beat
            # Every batch that is ready, not one per fetch: a fetch waits for the next event,
            # which may come only after the step that frees the producer's window.
            while not self.done() and await self.train_ready(consumer):
                pass
            if time.monotonic() - last_beat > self.s.ack_wait_s / 3:
                for d in [*self.buffer.held(), *self.under_way.deliveries()]:
                    with contextlib.suppress(Exception):
                        await d.in_progress()
                last_beat = time.monotonic()
            return self.done()

        if not self.done():
            # Handler errors propagate: a trainer that cannot take its step restarts and recovers.
            # A hostile rollout never gets there: it is refused at admission or when its group
            # is vetted for a step (consumers/trainer/admission.py).
            await consumer.run_batches(
                functools.partial(self.admit_all, consumer),
                batch=FETCH_BATCH,
                fetch_timeout=0.2,
                stop=stop,
                after=train_when_ready,
                settle_failures=False,
            )
        await self.announced()
        # Rollouts held for groups not yet complete go back at once (not after an ack wait): to
        # a resumed trainer, or to the close-out that withholds them when the run has finished.
        for d in self.buffer.held():
            with contextlib.suppress(Exception):
                await d.nak()
        self.log.info(
            "trainer_finished",
            version=self.version,
            withheld=len(self.withheld_ids),
            idle_frac=round(self.wait_s / max(time.monotonic() - self.started, 1e-9), 3),
        )
        return 0


def _retrieved(task: asyncio.Future[int]) -> None:
    """Mark a background task's error as seen (awaiting it still raises it)."""
    if not task.cancelled():
        task.exception()


def _any_refused(arrays: Iterable[RolloutArrays], limits: ModelLimits) -> bool:
    """Whether :func:`check_read` refuses any of ``arrays``, checked all at once (arrays that
    cannot be joined are looked at one by one)."""
    try:
        return check_read(*_joined(arrays), limits) is not None
    except ValueError:
        return True


def _joined(
    arrays: Iterable[RolloutArrays],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """A group's arrays end to end, for one check of them all: every check of
    :func:`check_read` is element by element (or row by row), so it holds for each rollout
    exactly when it holds for the whole."""
    got = list(arrays)
    masks = [a.mask for a in got if a.mask is not None]
    traces = [a.trace for a in got if a.trace is not None]
    return (
        np.concatenate([a.prompt for a in got]),
        np.concatenate([a.completion for a in got]),
        np.concatenate([a.logprobs for a in got]),
        np.concatenate(masks) if masks else None,
        np.concatenate(traces) if traces else None,
    )


async def read_rejected_groups(bus: Bus, run_id: str) -> set[str]:
    """The groups of rollouts this trainer dead-lettered for a reason that condemns the group
    (from the run's dead letters), so that a restarted trainer withholds their other members
    instead of holding them for a member that will never come."""
    out: set[str] = set()
    for item in await bus.read_log(run_id, filter_subject=subjects.all_dlq_subjects(run_id)):
        b = item.event.body if item.event else None
        if not isinstance(b, ev.DeadLettered) or b.consumer != "trainer" or b.reason not in GROUP_REASONS:
            continue
        try:
            original = ev.decode_event(b.original_data, b.original_headers)
        except ev.EventDecodeError:
            continue
        if isinstance(original.body, ev.RolloutsScored):
            out.add(original.body.group_id)
    return out


def _route(g: Group) -> tuple[str, str]:
    return g.route
