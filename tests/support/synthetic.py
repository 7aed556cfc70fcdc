"""A synthetic run: a realistic, deterministic sequence of a run's events plus the truth they
encode, for the store's tests and bench/store.py.

The shape follows an async off-policy run: inference workers generate groups with the policy
version they have loaded (which lags the trainer by a few versions), one CompletionsGenerated a
task, the environment scores each group into one RolloutsScored (arrays referred to where they
lie in the log), the trainer trains on what is fresh enough in a shuffled order and withholds
what is too stale (or invalid), then publishes a new policy version whose weights the workers
load. Heartbeats of every worker are sprinkled throughout.
"""

from __future__ import annotations

import hashlib
import random
import struct
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import sqlalchemy as sa

from jetrl.bus import events as ev
from jetrl.bus import ids, subjects
from jetrl.bus.client import Bus
from jetrl.bus.payloads import log_array, token_list_ref
from jetrl.bus.streams import payload_bucket
from jetrl.store import schema as sc
from jetrl.store.projection import LogItem

__all__ = ["SyntheticRun", "Truth", "check_projection", "log_items", "publish_events", "synthetic_run"]


@dataclass
class Truth:
    """What a correct projection of the events must show."""

    steps: dict[int, dict[str, Any]] = field(
        default_factory=dict
    )  # step -> policy_version, rollout_ids, tokens
    trained: dict[str, tuple[int, int]] = field(default_factory=dict)  # rollout -> (step, position)
    withheld: dict[str, str] = field(default_factory=dict)  # rollout -> reason
    rewards: dict[str, float] = field(default_factory=dict)
    rollout_scope: dict[str, tuple[str, str]] = field(default_factory=dict)  # rollout -> (tenant, env)
    staleness: dict[str, int] = field(default_factory=dict)
    tasks: int = 0
    generations: int = 0  # samples generated (a row each)
    samples: dict[str, tuple[str, int, str]] = field(
        default_factory=dict
    )  # generation id -> (its event's id, sample_index, finish_reason)
    generation_of: dict[str, str] = field(default_factory=dict)  # rollout -> its generation's event id
    versions: dict[int, str] = field(default_factory=dict)  # version -> weights checksum
    weights_uri: dict[int, str] = field(default_factory=dict)
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> kind, status, loaded_version
    status: str = "completed"


@dataclass
class SyntheticRun:
    run_id: str
    events: list[ev.Event]
    truth: Truth

    def __len__(self) -> int:
        return len(self.events)


def _ids(rng: random.Random) -> str:
    return uuid.UUID(int=rng.getrandbits(128), version=4).hex


def _inline(values: list[int] | list[float], dtype: str) -> ev.InlineArray:
    fmt = {"int32": "i", "float32": "f"}[dtype]
    return ev.InlineArray(
        dtype=dtype, shape=(len(values),), data=struct.pack(f"<{len(values)}{fmt}", *values)
    )


def synthetic_run(
    run_id: str,
    *,
    steps: int = 20,
    tasks_per_step: int = 8,
    group_size: int = 8,
    inference_workers: int = 4,
    tenants: tuple[str, ...] = ("acme", "globex"),
    envs: tuple[str, ...] = ("math", "code", "swe"),
    max_off_policy_steps: int = 2,
    seed: int = 0,
    t0: float = 1_760_000_000.0,
) -> SyntheticRun:
    """About ``steps * (3 * tasks_per_step + 18)`` events: per task its TaskSubmitted, its
    CompletionsGenerated and its group's RolloutsScored; per step the rollouts withheld, some
    heartbeats and the step's own events (42 a step with the defaults)."""
    rng = random.Random(seed)
    truth = Truth()
    out: list[ev.Event] = []
    clock = [t0]

    def emit(body: ev.EventBody, tenant: str = "default", causation: str | None = None) -> ev.Event:
        clock[0] += rng.uniform(0.0005, 0.004)
        e = ev.new_event(
            body, run_id=run_id, tenant=tenant, causation_id=causation, event_id=_ids(rng), time=clock[0]
        )
        out.append(e)
        return e

    workers = [f"inf-{i}" for i in range(inference_workers)]
    loaded = dict.fromkeys(workers, 0)

    def heartbeat(wid: str) -> None:
        kind = "trainer" if wid == "trainer-0" else "inference"
        statuses: tuple[Literal["ready", "busy"], ...] = ("ready", "busy", "busy")
        status = rng.choice(statuses)
        version = None if kind == "trainer" else loaded[wid]
        emit(
            ev.WorkerHeartbeat(
                worker_id=wid,
                kind=kind,
                status=status,
                loaded_version=version,
                inflight=rng.randint(0, 16),
                stats={"tokens_per_s": round(rng.uniform(100, 900), 3)},
            )
        )
        w = truth.workers.setdefault(wid, {})
        w.update(kind=kind, status=status)
        if version is not None:
            w["loaded_version"] = version

    emit(
        ev.RunStarted(
            config={
                "model": "tiny-moe",
                "rl": {"max_off_policy_steps": max_off_policy_steps, "group_size": group_size},
                "envs": list(envs),
                "tenants": list(tenants),
            },
            code_version="synthetic",
            host="bench",
            library_versions={"jetrl": "0.1.0"},
        )
    )
    for wid in ["trainer-0", *workers]:
        heartbeat(wid)

    version = 0
    for step in range(1, steps + 1):
        batch: list[str] = []
        tokens = 0
        for _ in range(tasks_per_step):
            tenant, env = rng.choice(tenants), rng.choice(envs)
            task_id = f"{env}.{tenant}.{_ids(rng)}"  # entity ids name env and tenant
            prompt = [rng.randrange(32000) for _ in range(rng.randint(8, 32))]
            task = emit(
                ev.TaskSubmitted(
                    task_id=task_id, env=env, group_size=group_size, prompt_tokens=prompt, max_tokens=256
                ),
                tenant,
            )
            truth.tasks += 1
            # The prompt where it lies: the task's list of token ids, at its position in a log
            # that starts at 1 (log_items' default).
            prompt_ref = token_list_ref(len(out), "prompt_tokens", prompt)
            # A task's samples are generated together by one worker, with the policy version it
            # has loaded, which lags the trainer (sometimes by more than the bound).
            wid = rng.choice(workers)
            pv_start = max(0, loaded[wid] - (rng.random() < 0.08) * rng.randint(2, 4))
            pv_end = loaded[wid]
            samples: list[ev.Completion] = []
            for i in range(group_size):
                n = rng.randint(4, 48)
                samples.append(
                    ev.Completion(
                        generation_id=ids.generation_id(task_id, i),
                        sample_index=i,
                        completion_tokens=_inline([rng.randrange(32000) for _ in range(n)], "int32"),
                        logprobs=_inline([round(-rng.random() * 3, 4) for _ in range(n)], "float32"),
                        finish_reason=rng.choice(("stop", "stop", "stop", "length")),
                        routing_trace=ev.PayloadRef(
                            store="objstore",
                            bucket=payload_bucket(run_id),
                            name=f"trace/{_ids(rng)}",
                            size=(len(prompt) + n - 1) * 4 * 2,
                            sha256=hashlib.sha256(rng.randbytes(8)).hexdigest(),
                            dtype="uint8",
                            shape=(len(prompt) + n - 1, 4, 2),
                        ),
                    )
                )
            gen = emit(
                ev.CompletionsGenerated(
                    task_id=task_id,
                    env=env,
                    prompt_tokens=prompt_ref,
                    samples=samples,
                    policy_version_start=pv_start,
                    policy_version_end=pv_end,
                    worker_id=wid,
                    timings=ev.GenerationTimings(queued_s=0.01, generate_s=round(rng.uniform(0.1, 2.0), 4)),
                ),
                tenant,
                task.event_id,
            )
            gen_seq = len(out)
            truth.generations += group_size  # a row per sample
            for smp in samples:
                truth.samples[smp.generation_id] = (gen.event_id, smp.sample_index, smp.finish_reason)
            # The group's rollouts, scored together; their arrays are the generation's.
            group_id = task_id  # a first turn's group is its task
            rollouts: list[ev.ScoredRollout] = []
            for i, smp in enumerate(samples):
                rid = ids.rollout_id(group_id, i)
                reward = round(rng.random(), 6)
                rollouts.append(
                    ev.ScoredRollout(
                        rollout_id=rid,
                        sample_index=i,
                        reward=reward,
                        reward_parts={"correct": reward, "format": 1.0},
                        completion_tokens=log_array(
                            gen_seq, f"samples.{i}.completion_tokens", smp.completion_tokens
                        ),
                        logprobs=log_array(gen_seq, f"samples.{i}.logprobs", smp.logprobs),
                        routing_trace=smp.routing_trace,
                        policy_version_start=pv_start,
                        policy_version_end=pv_end,
                    )
                )
                truth.rewards[rid] = reward
                truth.rollout_scope[rid] = (tenant, env)
                truth.generation_of[rid] = gen.event_id
            rng.shuffle(rollouts)  # a group's rollouts in any order (sample_index says which)
            emit(
                ev.RolloutsScored(
                    generation_event_id=gen.event_id,
                    task_id=task_id,
                    env=env,
                    group_id=group_id,
                    group_size=group_size,
                    prompt_tokens=prompt_ref,
                    rollouts=rollouts,
                ),
                tenant,
                gen.event_id,
            )
            stale = step - pv_start
            too_stale = stale > max_off_policy_steps
            for r in sorted(rollouts, key=lambda r: r.sample_index):
                rid = r.rollout_id
                truth.staleness[rid] = stale
                if too_stale or rng.random() < 0.02:
                    reason: Literal["stale", "invalid"] = "stale" if too_stale else "invalid"
                    emit(
                        ev.RolloutWithheld(
                            rollout_id=rid,
                            group_id=group_id,
                            env=env,
                            reason=reason,
                            trainer_step=step,
                            policy_version=version,
                            staleness=stale,
                            detail=f"{stale} steps behind" if reason == "stale" else "empty completion",
                        ),
                        tenant,
                    )
                    truth.withheld[rid] = reason
                else:
                    batch.append(rid)
                    shape = r.completion_tokens.shape
                    assert shape is not None
                    tokens += shape[0]
            if rng.random() < 0.3:
                heartbeat(rng.choice(["trainer-0", *workers]))
        rng.shuffle(batch)  # training order is not arrival order
        emit(
            ev.StepCompleted(
                step=step,
                policy_version=step,
                rollout_ids=batch,
                metrics={
                    "loss": round(rng.uniform(0.1, 2.0), 6),
                    "kl": round(rng.uniform(0, 0.05), 6),
                    "reward_mean": round(sum(truth.rewards[r] for r in batch) / max(1, len(batch)), 6),
                },
                tokens=tokens,
                duration_s=round(rng.uniform(0.5, 3.0), 4),
            )
        )
        for pos, rid in enumerate(batch):
            truth.trained[rid] = (step, pos)
        truth.steps[step] = {"policy_version": step, "rollout_ids": batch, "tokens": tokens}
        version = step
        checksum = hashlib.sha256(f"{run_id}/{version}".encode()).hexdigest()
        emit(
            ev.PolicyVersionPublished(
                version=version, step=step, weights_checksum=checksum, parent_version=version - 1
            )
        )
        name = f"weights/v{version:06d}.safetensors"
        emit(
            ev.WeightsReady(
                version=version,
                location=ev.PayloadRef(
                    store="objstore",
                    bucket=payload_bucket(run_id),
                    name=name,
                    size=4_000_000,
                    sha256=hashlib.sha256(checksum.encode()).hexdigest(),
                ),
                weights_checksum=checksum,
            )
        )
        truth.versions[version] = checksum
        truth.weights_uri[version] = f"objstore://{payload_bucket(run_id)}/{name}"
        for wid in workers:
            if rng.random() < 0.8:  # some workers skip a version (their rollouts grow stale)
                loaded[wid] = version
                emit(
                    ev.WeightsLoaded(version=version, worker_id=wid, load_s=round(rng.uniform(0.05, 0.5), 4))
                )
                truth.workers.setdefault(wid, {})["loaded_version"] = version
        heartbeat("trainer-0")
    emit(ev.RunFinished(status="completed", steps=steps))
    truth.status = "completed"
    return SyntheticRun(run_id=run_id, events=out, truth=truth)


def log_items(events: Sequence[ev.Event], first_seq: int = 1) -> list[LogItem]:
    """The events as they sit in a log whose first sequence is ``first_seq``."""
    return [LogItem(first_seq + i, subjects.subject_for(e), e) for i, e in enumerate(events)]


async def publish_events(bus: Bus, events: Sequence[ev.Event], *, max_inflight: int = 512) -> None:
    """Publish events in order (pipelined, every ack awaited)."""
    async with bus.publisher(max_inflight=max_inflight) as pub:
        for e in events:
            await pub.publish(e)


def check_projection(conn: Any, run: SyntheticRun, *, dead_letters: int = 0) -> list[str]:
    """Compare a store's projection of ``run`` with the run's truth; returns the mismatches
    (empty when exact). Used by the tests and by bench/store.py to check what it measured."""
    t = sc.Base.metadata.tables
    rid = run.run_id
    truth = run.truth
    bad: list[str] = []

    def rows(name: str) -> list[Any]:
        tab = t[name]
        return list(conn.execute(sa.select(tab).where(tab.c.run_id == rid)).mappings())

    def expect(what: str, got: Any, want: Any) -> None:
        if got != want:
            bad.append(f"{what}: got {got!r}, want {want!r}")

    runs = rows("runs")
    expect("runs", len(runs), 1)
    if runs:
        r = runs[0]
        expect("run status", r["status"], truth.status)
        expect("run steps", r["steps"], len(truth.steps))
        first = run.events[0].body
        expect("run config", r["config"], first.config if isinstance(first, ev.RunStarted) else None)
    expect("tasks", len(rows("tasks")), truth.tasks)
    generations = {r["generation_id"]: r for r in rows("generations")}
    expect("generations", len(generations), truth.generations)
    for gid, (event_id, index, finish) in truth.samples.items():
        g = generations.get(gid)
        if g is None:
            bad.append(f"generation {gid} missing")
            continue
        expect(
            f"generation {gid}",
            (g["event_id"], g["sample_index"], g["finish_reason"]),
            (event_id, index, finish),
        )

    rollouts = {r["rollout_id"]: r for r in rows("rollouts")}
    expect("rollouts", len(rollouts), len(truth.rewards))
    for rid_, reward in truth.rewards.items():
        r = rollouts.get(rid_)
        if r is None:
            bad.append(f"rollout {rid_} missing")
            continue
        expect(f"rollout {rid_} reward", r["reward"], reward)
        expect(f"rollout {rid_} scope", (r["tenant"], r["env"]), truth.rollout_scope[rid_])
        if rid_ in truth.generation_of:
            expect(f"rollout {rid_} generation", r["generation_event_id"], truth.generation_of[rid_])
        trained = truth.trained.get(rid_)
        expect(f"rollout {rid_} trained", (r["trained_step"], r["train_position"]), trained or (None, None))
        expect(f"rollout {rid_} withheld", r["withheld_reason"], truth.withheld.get(rid_))
        expect(f"rollout {rid_} staleness", r["staleness"], truth.staleness[rid_])

    steps = {r["step"]: r for r in rows("steps")}
    expect("steps", sorted(steps), sorted(truth.steps))
    order: dict[int, list[tuple[int, str]]] = {}
    for r in rows("step_rollouts"):
        order.setdefault(r["step"], []).append((r["position"], r["rollout_id"]))
    for step, st in truth.steps.items():
        s = steps.get(step)
        if s is None:
            continue
        expect(f"step {step} version", s["policy_version"], st["policy_version"])
        expect(f"step {step} tokens", s["tokens"], st["tokens"])
        expect(f"step {step} rollouts", [r for _, r in sorted(order.get(step, []))], st["rollout_ids"])

    versions = {r["version"]: r for r in rows("policy_versions")}
    expect("policy versions", sorted(versions), sorted(truth.versions))
    for v, checksum in truth.versions.items():
        pv = versions.get(v)
        if pv is not None:
            expect(
                f"version {v} checksum", (pv["weights_checksum"], pv["ready_checksum"]), (checksum, checksum)
            )
            expect(f"version {v} location", pv["location_uri"], truth.weights_uri[v])

    workers = {r["worker_id"]: r for r in rows("workers")}
    expect("workers", sorted(workers), sorted(truth.workers))
    for wid, w in truth.workers.items():
        got = workers.get(wid)
        if got is not None:
            expect(
                f"worker {wid}",
                (got["kind"], got["status"], got["loaded_version"]),
                (w["kind"], w["status"], w.get("loaded_version")),
            )
    expect("dead letters", len(rows("dead_letters")), dead_letters)
    return bad
