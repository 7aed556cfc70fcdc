"""The trainer's edge: hostile scored rollouts are dead-lettered with a specific reason (their
group's other members withheld), never crash the trainer, and the good groups are trained;
the pure checks of consumers/trainer/admission.py one by one."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from jetrl.bus import events as ev
from jetrl.bus import ids
from jetrl.bus.client import Bus
from jetrl.bus.payloads import Payloads, array_from_bytes, inline_array, log_array, token_list_ref
from jetrl.bus.settings import EnvRoute
from jetrl.consumers.trainer.admission import (
    ModelLimits,
    check_member,
    check_read,
    check_rollouts,
    routes_by_key,
)
from jetrl.consumers.trainer.core import RolloutArrays, ScoredView, TrainCore
from jetrl.consumers.trainer.replay import Replayer, read_rollouts, read_run_log, trained_seqs
from jetrl.consumers.trainer.settings import TrainerPart, TrainerSettings
from jetrl.consumers.trainer.trainer import Trainer

# tiny-moe: vocabulary 64, context 256, 2 MoE layers of 8 experts, top 2.
LIMITS = ModelLimits(max_seq_len=256, vocab_size=64, trace=(2, 2, 8))
ROUTES = [
    EnvRoute(tenant="acme", env="math", group_size=2),
    EnvRoute(tenant="globex", env="code", group_size=2),
]


def arr(values: Any, dtype: str) -> ev.InlineArray:
    return inline_array(np.asarray(values, dtype=dtype))


def trace(rows: int, pair: tuple[int, int] = (0, 1)) -> ev.InlineArray:
    return arr(np.broadcast_to(np.asarray(pair, np.uint8), (rows, 2, 2)), "uint8")


def rollout(
    group: str, i: int, *, prompt_len: int = 3, reward: float = 0.0, **changes: Any
) -> ev.ScoredRollout:
    """Sample ``i`` of ``group``, valid for tiny-moe under a prompt of ``prompt_len`` tokens,
    then ``changes``."""
    completion = [4 + i, 5]
    r = ev.ScoredRollout(
        rollout_id=ids.rollout_id(group, i),
        sample_index=i,
        reward=reward,
        reward_parts={"correct": float(i)},
        completion_tokens=arr(completion, "int32"),
        logprobs=arr([-0.5] * len(completion), "float32"),
        routing_trace=trace(prompt_len + len(completion) - 1),
        policy_version_start=0,
        policy_version_end=0,
    )
    if not changes:
        return r
    r = msgspec.structs.replace(r, **changes)
    if "rollout_id" not in changes:  # kept <group_id>-<sample_index>, unless that is the point
        r = msgspec.structs.replace(r, rollout_id=ids.rollout_id(group, r.sample_index))
    return r


def body(
    tenant: str = "acme",
    env: str = "math",
    n: int = 0,
    indexes: tuple[int, ...] = (0, 1),
    *,
    group_size: int = 2,
    prompt: list[int] | None = None,
    member: dict[str, Any] | None = None,
    at: int = -1,
    **changes: Any,
) -> ev.RolloutsScored:
    """Valid rollouts ``indexes`` of tiny-moe of the tenant's ``n``-th group (its whole group by
    default, one event as a single-turn task's), then ``changes`` to the event and ``member``
    changes to its rollout at position ``at`` (the rest of the group stays good)."""
    prompt = prompt or [1, 2, 3]
    group = changes.get("group_id", f"{env}.{tenant}.{n}")
    rollouts = [rollout(group, i, prompt_len=len(prompt), reward=float(i + n % 3)) for i in indexes]
    if member is not None:
        rollouts[at] = rollout(
            group, indexes[at], prompt_len=len(prompt), **{"reward": rollouts[at].reward, **member}
        )
    b = ev.RolloutsScored(
        generation_event_id=f"gen-{group}-{'-'.join(map(str, indexes))}",
        task_id=f"{env}.{tenant}.{n}",
        env=env,
        group_id=group,
        group_size=group_size,
        prompt_tokens=arr(prompt, "int32"),
        rollouts=rollouts,
    )
    return msgspec.structs.replace(b, **changes) if changes else b


def event(run_id: str, b: ev.RolloutsScored, tenant: str | None = None, **kw: Any) -> ev.Event:
    return ev.new_event(b, run_id=run_id, tenant=tenant or b.group_id.split(".")[1], **kw)


def trainer_part(
    *, max_steps: int = 2, envs: list[EnvRoute] | None = None, batch_groups: int = 2
) -> TrainerPart:
    return TrainerPart(
        trainer=TrainerSettings(batch_groups=batch_groups, max_steps=max_steps, checkpoint_every=0),
        envs=ROUTES if envs is None else envs,
    )


# ------------------------------------------------------------------------ pure checks


def rejection(
    b: ev.RolloutsScored, tenant: str = "acme", *, version: int = 0, **kw: Any
) -> tuple[str, str] | None:
    routes = routes_by_key(kw.pop("routes", ROUTES))
    return check_rollouts(b, tenant, routes=routes, limits=kw.pop("limits", LIMITS), version=version, **kw)


def reason(b: ev.RolloutsScored, tenant: str = "acme", **kw: Any) -> str | None:
    got = rejection(b, tenant, **kw)
    return None if got is None else got[0]


def test_a_valid_group_passes() -> None:
    assert reason(body()) is None
    assert reason(body("globex", "code", 3), "globex") is None
    assert reason(body(indexes=(1,))) is None  # an episode's rollout comes on its own
    assert reason(body(indexes=(1, 0))) is None  # in any order
    assert reason(body(env="poker"), routes=[]) is None  # no [[envs]] given: any env
    versions = {"policy_version_start": 2, "policy_version_end": 3}
    assert reason(body(member=versions, at=0), version=3) is None


# Changes to the event: they spoil every rollout of it.
GROUP_CASES: list[tuple[dict[str, Any], str]] = [
    ({"env": "poker"}, "unknown_env"),
    ({"group_id": "code.globex.0"}, "bad_ids"),
    ({"task_id": "math.globex.0"}, "bad_ids"),
    ({"group_size": 1}, "invalid_group"),
    ({"group_size": 3}, "invalid_group"),
    ({"group_size": -2}, "invalid_group"),
    ({"rollouts": []}, "invalid_group"),
    ({"prompt_tokens": arr([1.0, 2.0, 3.0], "float32")}, "bad_arrays"),
    ({"prompt_tokens": arr([[1, 2, 3]], "int32")}, "bad_arrays"),
    ({"prompt_tokens": arr([], "int32")}, "bad_arrays"),
    ({"prompt_tokens": ev.InlineArray(dtype="int32", shape=(3,), data=b"\0" * 8)}, "bad_arrays"),
    ({"prompt_tokens": ev.InlineArray(dtype="object", shape=(3,), data=b"\0" * 24)}, "bad_arrays"),
    (
        {
            "prompt_tokens": ev.PayloadRef(
                store="objstore", bucket="b", name="n", size=12, sha256="0" * 64, dtype="int32", shape=(3,)
            )
        },
        "bad_arrays",  # another bucket than the run's
    ),
    (
        {"prompt_tokens": ev.PayloadRef(store="objstore", bucket="b", name="n", size=12, sha256="0" * 64)},
        "bad_arrays",  # a blob, no dtype/shape
    ),
    ({"prompt_tokens": ev.LogArray(seq=1, field="prompt_tokens", dtype="float32", shape=(3,))}, "bad_arrays"),
    ({"prompt": [1] * 255}, "too_long"),
]

# Changes to one rollout of an otherwise good group: the whole event is refused.
MEMBER_CASES: list[tuple[dict[str, Any], str]] = [
    ({"rollout_id": "math.acme.0-7"}, "bad_ids"),
    ({"rollout_id": "math.globex.0-1"}, "bad_ids"),
    ({"sample_index": 2}, "invalid_group"),
    ({"sample_index": -1}, "invalid_group"),
    ({"reward": math.nan}, "non_finite"),
    ({"reward": -math.inf}, "non_finite"),
    ({"reward_parts": {"x": math.inf}}, "non_finite"),
    ({"reward_parts": {"ok": 1.0, "x": math.nan}}, "non_finite"),
    ({"reward": 1e12}, "reward_range"),
    ({"reward": -1e12}, "reward_range"),
    ({"policy_version_start": 1, "policy_version_end": 0}, "bad_version"),
    ({"policy_version_start": -1}, "bad_version"),
    ({"policy_version_end": 1}, "future_version"),
    ({"completion_tokens": arr([], "int32"), "logprobs": arr([], "float32")}, "bad_arrays"),
    ({"completion_tokens": arr([4.0, 5.0], "float32")}, "bad_arrays"),
    ({"logprobs": arr([-0.5] * 3, "float32")}, "bad_arrays"),
    ({"logprobs": arr([-1, -1], "int32")}, "bad_arrays"),
    ({"completion_mask": arr([1, 1], "int32")}, "bad_arrays"),
    ({"completion_mask": arr([1], "uint8")}, "bad_arrays"),
    ({"routing_trace": trace(5)}, "bad_arrays"),
    ({"routing_trace": None}, "bad_arrays"),
    ({"routing_trace": arr(np.zeros((4, 2, 2)), "float32")}, "bad_arrays"),
    ({"logprobs": ev.LogArray(seq=3, field="samples.0.logprobs", dtype="float32", shape=(3,))}, "bad_arrays"),
]


@pytest.mark.parametrize(("changes", "expected"), GROUP_CASES)
def test_each_impossible_group_has_its_reason(changes: dict[str, Any], expected: str) -> None:
    assert reason(body(**changes), bucket="jetrl_r_payloads") == expected


@pytest.mark.parametrize("at", [0, 1])
@pytest.mark.parametrize(("changes", "expected"), MEMBER_CASES)
def test_one_impossible_rollout_refuses_its_whole_event(
    changes: dict[str, Any], expected: str, at: int
) -> None:
    b = body(member=changes, at=at)
    bad = b.rollouts[at]
    got = rejection(b, bucket="jetrl_r_payloads")
    assert got is not None and got[0] == expected
    assert got[1].startswith(f"rollout {bad.rollout_id}: "), got  # the detail names the rollout
    # The same rollout alone (an episode's event) is refused for the same reason.
    alone = msgspec.structs.replace(b, rollouts=[bad])
    assert reason(alone, bucket="jetrl_r_payloads") == expected


def test_a_group_event_with_repeated_or_too_many_samples_is_refused() -> None:
    for indexes in ((0, 0), (1, 1), (0, 1, 1), (0, 1, 0)):
        got = rejection(body(indexes=indexes))
        assert got is not None and got[0] == "invalid_group", indexes
        assert "repeat" in got[1]
    # Two rollouts of one sample under two ids: the indexes repeat, whatever the ids say.
    b = body()
    twin = msgspec.structs.replace(b.rollouts[1], sample_index=0)
    assert reason(msgspec.structs.replace(b, rollouts=[b.rollouts[0], twin])) == "invalid_group"
    assert reason(body(indexes=(0, 1, 2))) == "invalid_group"  # more samples than the group has
    got = rejection(body(indexes=()))
    assert got is not None and got == ("invalid_group", "no rollouts")


def test_a_group_closed_on_its_quorum_counts_its_late_samples() -> None:
    routes = [EnvRoute(tenant="acme", env="math", group_size=4)]
    # Samples 0 and 2 scored in time, 1 and 3 late: a group of 2 of the env's 4.
    b = body(indexes=(0, 2), late_samples=[1, 3])
    assert reason(b, routes=routes) is None
    assert reason(body(indexes=(0, 2, 3), group_size=3, late_samples=[1]), routes=routes) is None
    bad = [
        body(indexes=(0, 2), late_samples=[1]),  # 2 + 1 of the env's 4
        body(indexes=(0, 2), late_samples=[1, 1]),  # a late sample twice
        body(indexes=(0, 2), late_samples=[2, 3]),  # a rollout's sample late too
        body(indexes=(0, 2), late_samples=[1, 4]),  # no such sample
        body(indexes=(0,), late_samples=[1, 3]),  # the event does not hold its whole group
        body(indexes=(0, 3), late_samples=[1, 2], group_size=1),  # a group of one
    ]
    for b in bad:
        got = rejection(b, routes=routes)
        assert got is not None and got[0] == "invalid_group", b.late_samples
    # Without late samples, the group is the env's whole group, as before.
    assert reason(body(indexes=(0, 2)), routes=routes) == "invalid_group"


def test_traces_follow_the_model_and_replay() -> None:
    dense = ModelLimits(max_seq_len=256, vocab_size=64, trace=None)
    assert reason(body(), limits=dense) == "bad_arrays"  # a dense model refuses a trace it would read
    no_traces = body()
    no_traces = msgspec.structs.replace(
        no_traces, rollouts=[msgspec.structs.replace(r, routing_trace=None) for r in no_traces.rollouts]
    )
    assert reason(no_traces, limits=dense) is None
    assert reason(body(member={"routing_trace": None}), limits=dense) == "bad_arrays"  # one has one
    off = ModelLimits(max_seq_len=256, vocab_size=64, trace=None, replay=False)
    assert reason(body(member={"routing_trace": trace(9)}), limits=off) is None  # never read


def test_events_of_one_group_agree_on_its_size() -> None:
    first = body(indexes=(0,))  # an episode's rollout: its group's others come in events of their own
    assert check_member(first, body(indexes=(1,))) is None
    got = check_member(first, body(indexes=(1,), group_size=3))
    assert got is not None and got[0] == "invalid_group"


def test_arrays_as_read() -> None:
    ok = (np.array([1, 2]), np.array([3]), np.array([-0.1], np.float32), None, np.array([[[0, 1]] * 2] * 2))
    assert check_read(*ok, LIMITS) is None
    cases: list[tuple[tuple[Any, ...], str]] = [
        ((np.array([1, 64]), *ok[1:]), "bad_tokens"),
        ((ok[0], np.array([-1]), *ok[2:]), "bad_tokens"),
        ((*ok[:2], np.array([math.nan], np.float32), *ok[3:]), "non_finite"),
        ((*ok[:3], np.array([2], np.uint8), ok[4]), "bad_arrays"),
        ((*ok[:4], np.array([[[0, 8]] * 2] * 2)), "bad_arrays"),
        ((*ok[:4], np.array([[[3, 3]] * 2] * 2)), "bad_arrays"),
    ]
    for args, expected in cases:
        prompt, completion, logprobs, mask, routing = args
        got = check_read(prompt, completion, logprobs, mask, routing, LIMITS)
        assert got is not None and got[0] == expected, (args, got)


async def test_training_inputs_are_writable_copies_of_the_arrays_as_read() -> None:
    """A step's arrays become its rollouts' tensors in a few copies where they are alike, one
    each where they are not (traces of uint8 and uint16, say): the same values either way, as
    int64 routing, never a view of the log's read-only bytes."""
    core = TrainCore(trainer_part())
    b = body(indexes=(0, 1))
    views = [ScoredView(b, r, "owner") for r in b.rollouts]
    for trace_dtypes in [(np.uint8, np.uint8), (np.uint8, np.uint16)]:
        read: dict[str, RolloutArrays] = {}
        for (r, dt), rows in zip(zip(b.rollouts, trace_dtypes, strict=True), (4, 6), strict=True):
            frozen = [np.arange(n, dtype=t) for n, t in ((3, np.int32), (rows - 2, np.int32))]
            logprobs = np.full(rows - 2, -0.5, np.float32)
            trace = np.broadcast_to(np.asarray([0, 1], dt), (rows, 2, 2)).copy()
            for x in (*frozen, logprobs, trace):
                x.setflags(write=False)
            read[r.rollout_id] = RolloutArrays(frozen[0], frozen[1], logprobs, None, trace)
        got = await core.rollouts(views, payloads=None, read=read)  # type: ignore[arg-type]
        for v, g in zip(views, got, strict=True):
            a = read[v.rollout_id]
            assert g.routing is not None and a.trace is not None and g.routing.dtype == torch.int64
            assert g.routing.tolist() == a.trace.astype(np.int64).tolist()
            assert g.inference_logprobs.dtype == torch.float32
            assert g.inference_logprobs.tolist() == a.logprobs.tolist()
            g.inference_logprobs.add_(1.0)  # writable, and not the read array
            assert a.logprobs.tolist() == [-0.5] * len(a.logprobs)


# ------------------------------------------------------------------------ through a real server


async def dead_letters(bus: Bus, run_id: str) -> dict[str, tuple[str, str, str]]:
    """original event id -> (reason, dead-letter subject, detail)"""
    out = {}
    for item in await bus.read_log(run_id):
        if item.event is not None and isinstance(item.event.body, ev.DeadLettered):
            b = item.event.body
            assert b.original_event_id is not None
            out[b.original_event_id] = (b.reason, item.subject, b.detail)
    return out


async def run_trainer(bus: Bus, run_id: str, part: TrainerPart, run_dir: Path) -> Trainer:
    t = Trainer(bus, run_id, part, run_dir)
    # A guard against a hang, not a timing assertion.
    assert await asyncio.wait_for(t.run(asyncio.Event()), 300) == 0
    return t


@dataclass
class Logged:
    """A group's task and generation in the log, as a worker leaves them."""

    body: ev.RolloutsScored  # its arrays referred to where they lie
    task_seq: int
    gen_seq: int


async def logged(bus: Bus, run_id: str, b: ev.RolloutsScored, prompt: list[int] | None = None) -> Logged:
    """Publish the task and the generation ``b``'s group came from (``prompt``: the task's, by
    default ``b``'s own) and return ``b`` with its arrays referred to in the log: the prompt in
    the task's list of token ids, each rollout's arrays in its sample of the generation."""
    tenant = b.group_id.split(".")[1]
    assert isinstance(b.prompt_tokens, ev.InlineArray)
    own = array_from_bytes(b.prompt_tokens.dtype, b.prompt_tokens.shape, b.prompt_tokens.data).tolist()
    prompt = own if prompt is None else prompt
    task = ev.new_event(
        ev.TaskSubmitted(task_id=b.task_id, env=b.env, group_size=b.group_size, prompt_tokens=prompt),
        run_id=run_id,
        tenant=tenant,
        event_id=ids.task_event_id(run_id, b.task_id),
    )
    task_seq = (await bus.publish(task)).seq
    gen = ev.CompletionsGenerated(
        task_id=b.task_id,
        env=b.env,
        prompt_tokens=token_list_ref(task_seq, "prompt_tokens", prompt),
        samples=[
            ev.Completion(
                generation_id=ids.generation_id(b.task_id, r.sample_index),
                sample_index=r.sample_index,
                completion_tokens=r.completion_tokens,
                logprobs=r.logprobs,
                routing_trace=r.routing_trace,
            )
            for r in b.rollouts
        ],
        policy_version_start=0,
        policy_version_end=0,
        worker_id="inf-0",
    )
    gen_event = ev.new_event(
        gen, run_id=run_id, tenant=tenant, event_id=ids.generation_event_id(run_id, task.event_id)
    )
    gen_seq = (await bus.publish(gen_event)).seq
    rollouts = []
    for k, r in enumerate(b.rollouts):
        trace = (
            None
            if r.routing_trace is None
            else log_array(gen_seq, f"samples.{k}.routing_trace", r.routing_trace)
        )
        rollouts.append(
            msgspec.structs.replace(
                r,
                completion_tokens=log_array(gen_seq, f"samples.{k}.completion_tokens", r.completion_tokens),
                logprobs=log_array(gen_seq, f"samples.{k}.logprobs", r.logprobs),
                routing_trace=trace,
            )
        )
    body = msgspec.structs.replace(
        b,
        generation_event_id=gen_event.event_id,
        prompt_tokens=token_list_ref(task_seq, "prompt_tokens", own),
        rollouts=rollouts,
    )
    return Logged(body, task_seq, gen_seq)


def with_member(b: ev.RolloutsScored, at: int, **changes: Any) -> ev.RolloutsScored:
    rollouts = list(b.rollouts)
    rollouts[at] = msgspec.structs.replace(rollouts[at], **changes)
    return msgspec.structs.replace(b, rollouts=rollouts)


async def test_hostile_groups_are_dead_lettered_and_the_good_groups_trained(
    bus: Bus, run_id: str, tmp_path: Path
) -> None:
    payloads = await Payloads.for_run(bus.js, run_id)
    good_blob = np.asarray([4, 5], np.int32).tobytes()
    ref = await payloads.default.put("tokens-corrupt", good_blob)
    corrupt = msgspec.structs.replace(ref, sha256="0" * 64, dtype="int32", shape=(2,))

    # Each hostile case is published in one of two shapes: a whole group in one event (a
    # single-turn task's) with the hostile value in one of its rollouts, or the hostile rollout
    # in an event of its own (an episode's) with its group mate in another, sent before or
    # after it; that mate is withheld as incomplete when the reason condemns the group.
    # Admission cases first, then groups whose arrays are refused only when read for a step.
    n = iter(range(100, 200))
    k = iter(range(1000))
    hostile: dict[str, str] = {}  # event id -> expected reason
    detail: dict[str, str] = {}  # event id -> how its dead letter's detail starts
    mates: set[str] = set()
    to_publish: list[ev.Event] = []

    def refused(b: ev.RolloutsScored, expected: str, at: int | None) -> ev.Event:
        e = event(run_id, b, tenant="acme")
        hostile[e.event_id] = expected
        detail[e.event_id] = f"rollouts of group {b.group_id}: " + (
            "" if at is None else f"rollout {b.rollouts[at].rollout_id}: "
        )
        return e

    def whole(
        expected: str, b: ev.RolloutsScored | None = None, *, member: bool = True, **changes: Any
    ) -> None:
        """The group in one event: ``changes`` to one rollout of it (``member``) or to the event."""
        at = next(k) % 2
        if b is None:
            g = next(n)
            b = body(n=g, member=changes, at=at) if member else body(n=g, **changes)
        elif changes:
            b = with_member(b, at, **changes) if member else msgspec.structs.replace(b, **changes)
        to_publish.append(refused(b, expected, at if member else None))

    def split(
        expected: str, b: ev.RolloutsScored | None = None, *, member: bool = True, **changes: Any
    ) -> None:
        """The hostile rollout (the second) and its mate (sample 0, good) in events of their
        own."""
        if b is None:
            g = next(n)
            good = body(n=g)
            b = body(n=g, member=changes, at=1) if member else body(n=g, **changes)
        else:
            good = b
            if changes:
                b = with_member(b, 1, **changes) if member else msgspec.structs.replace(b, **changes)
        mate = msgspec.structs.replace(good, rollouts=good.rollouts[:1])
        bad = msgspec.structs.replace(b, rollouts=b.rollouts[1:])
        order = [event(run_id, mate), refused(bad, expected, 0 if member else None)]
        if next(k) % 2:
            order.reverse()  # the bad member before or after its mate
        to_publish.extend(order)
        mates.add(mate.rollouts[0].rollout_id)

    whole("unknown_env", member=False, env="poker")
    # A foreign group id is refused by the bus (spoofed); a rollout id that is not its
    # group's sample would let two rollouts claim one sample.
    whole("bad_ids", rollout_id="math.acme.101-7")
    whole("invalid_group", member=False, group_size=1)
    whole("invalid_group", member=False, group_size=3)
    whole("invalid_group", member=False, rollouts=[])
    whole("invalid_group", body(n=next(n), indexes=(0, 0)), member=False)
    whole("invalid_group", body(n=next(n), indexes=(1, 0, 1)), member=False)
    whole("invalid_group", sample_index=2)
    split("invalid_group", sample_index=2)
    split("invalid_group", member=False, group_size=3)
    split("invalid_group", body(n=next(n), indexes=(0, 1, 1)), member=False)
    for shape in (whole, split):
        shape("non_finite", reward=math.nan)
        shape("non_finite", reward_parts={"x": math.inf})
        shape("reward_range", reward=-1e10)
        shape("bad_version", policy_version_start=1)
        shape("future_version", policy_version_end=5)
        shape("bad_arrays", logprobs=arr([-0.5] * 3, "float32"))
        shape("bad_arrays", completion_tokens=arr([[4, 5]], "int32"))
        shape("bad_arrays", completion_mask=arr([1, 1], "int32"))
        shape("bad_arrays", routing_trace=trace(7))
        shape("bad_arrays", routing_trace=None)
        shape("bad_arrays", member=False, prompt_tokens=arr([1.0, 2.0, 3.0], "float32"))
        shape(
            "bad_arrays",
            member=False,
            prompt_tokens=ev.InlineArray(dtype="int32", shape=(3,), data=b"\0" * 5),
        )
        shape("too_long", member=False, prompt=list(range(1, 60)) * 5)
        # Refused only when read.
        shape("bad_tokens", completion_tokens=arr([4, 64], "int32"))
        shape("bad_tokens", member=False, prompt_tokens=arr([1, -2, 3], "int32"))
        shape(
            "bad_arrays",
            completion_tokens=ev.LogArray(seq=10**9, field="completion_tokens", dtype="int32", shape=(2,)),
        )
        shape("bad_arrays", completion_tokens=corrupt)
        shape("bad_arrays", routing_trace=trace(4, (1, 1)))
        shape("non_finite", logprobs=arr([math.nan, -0.5], "float32"))

    # Arrays referred to in the log (as a producer refers to its generation's and its task's):
    # a path must lead to an array of the declared dtype and shape in the group's own
    # generation, a prompt to the group's own task.
    other = await logged(bus, run_id, body("globex", "code", 90))  # another tenant's task and generation
    for shape in (whole, split):

        async def mine(prompt: list[int] | None = None) -> Logged:
            return await logged(bus, run_id, body(n=next(n)), prompt)

        def at(lg: Logged, field: str, dtype: str = "int32", rows: int = 2) -> ev.LogArray:
            return ev.LogArray(seq=lg.gen_seq, field=field, dtype=dtype, shape=(rows,))

        for field in (
            "samples.99.completion_tokens",  # no such sample
            "samples.2.completion_tokens",  # one past the last
            "samples.-1.completion_tokens",  # no negative indexes
            "samples.0",  # a sample, not an array
            "samples",
            "__class__",
            "samples.0.__class__",
            "samples.0.completion_tokens.data",
            "prompt_tokens",  # the generation's is a reference, not an array
            "task_id",
        ):
            lg = await mine()
            shape("bad_arrays", lg.body, completion_tokens=at(lg, field))
        lg = await mine()
        shape("bad_arrays", lg.body, completion_tokens=at(lg, "samples.0.logprobs"))  # float32 there
        lg = await mine()
        shape("bad_arrays", lg.body, logprobs=at(lg, "samples.1.completion_tokens", "float32"))
        lg = await mine()  # a path into another tenant's generation
        shape("bad_arrays", lg.body, completion_tokens=at(other, "samples.1.completion_tokens"))
        lg = await mine()  # the prompt of another tenant's task
        forged = token_list_ref(other.task_seq, "prompt_tokens", [1, 2, 3])
        shape("bad_arrays", lg.body, member=False, prompt_tokens=forged)
        lg = await mine()  # its own task's prompt, at the generation's position instead
        shape(
            "bad_arrays",
            lg.body,
            member=False,
            prompt_tokens=token_list_ref(lg.gen_seq, "prompt_tokens", [1, 2, 3]),
        )
        if shape is whole:  # (a task's prompt is every event's of its group)
            lg = await mine([1, 2**40, 3])  # a task's token that does not fit int32
            shape("bad_arrays", lg.body, member=False)
            lg = await mine([1, 64, 3])  # a task's token outside the vocabulary
            shape("bad_tokens", lg.body, member=False)

    # An event of an unknown env has a second, unknown event of its group too.
    stray = event(run_id, body(env="poker", n=100, indexes=(1,)), tenant="acme")
    hostile[stray.event_id] = "unknown_env"
    detail[stray.event_id] = "rollouts of group poker.acme.100: "
    to_publish.append(stray)
    for e in to_publish:
        await bus.publish(e)

    # The good groups: whole in one event, with their arrays inline or in the log, or in two
    # events (as an episode environment's rollouts come).
    good = [
        body("acme", "math", 0),
        (await logged(bus, run_id, body("acme", "math", 1))).body,
        body("globex", "code", 0, (0,)),
        body("globex", "code", 0, (1,)),
        body("globex", "code", 1, (1, 0)),
    ]
    for b in good:
        await bus.publish(event(run_id, b))

    await run_trainer(bus, run_id, trainer_part(max_steps=2), tmp_path)

    log = await bus.read_log(run_id)
    steps = [i.event.body for i in log if i.event and isinstance(i.event.body, ev.StepCompleted)]
    assert sorted(s.step for s in steps) == [0, 1]
    trained = Counter(r for s in steps for r in s.rollout_ids)
    assert set(trained) == {r.rollout_id for b in good for r in b.rollouts} and set(trained.values()) == {1}
    assert sum(len(s.rollout_ids) for s in steps) == 8  # 4 groups of 2
    dls = await dead_letters(bus, run_id)
    assert {eid: dls[eid][0] for eid in hostile if eid in dls} == hostile
    # Each on the dead-letter subject of the tenant it came from, under its reason, saying
    # which group (and which rollout of it) was refused.
    assert all(dls[eid][1] == f"jetrl.{run_id}.dlq.acme.{r}" for eid, r in hostile.items())
    assert all(dls[eid][2].startswith(d) for eid, d in detail.items()), [
        (dls[eid][2], d) for eid, d in detail.items() if not dls[eid][2].startswith(d)
    ]
    # Only the hostile events are dead-lettered: no good group, task or generation.
    assert set(dls) == set(hostile)
    withheld = {
        i.event.body.rollout_id: i.event.body.reason
        for i in log
        if i.event and isinstance(i.event.body, ev.RolloutWithheld)
    }
    assert withheld == dict.fromkeys(mates, "incomplete_group")

    # The log still replays bit for bit: the refused rollouts are in no step.
    run_log = await read_run_log(bus, run_id)
    replayer = Replayer(TrainCore(trainer_part()), payloads, run_log)
    await replayer.start_at(0)
    rollouts, _ = await read_rollouts(bus, run_id, run_log.trained_ids(), trained_seqs(run_log))
    checks = await replayer.run(rollouts)
    assert len(checks) == 2 and all(c.ok for c in checks)


async def test_a_restarted_trainer_still_withholds_the_rest_of_a_refused_group(
    bus: Bus, run_id: str, tmp_path: Path
) -> None:
    bad = event(run_id, body(n=50, indexes=(1,), member={"reward": math.nan}))
    await bus.publish(bad)
    for g in range(2):
        await bus.publish(event(run_id, body("acme", "math", g)))
    await run_trainer(bus, run_id, trainer_part(max_steps=1), tmp_path)

    # The refused member's mate comes only now, to a new trainer (which knows of the refusal
    # from the dead letters alone), then two more good groups.
    mate = body(n=50, indexes=(0,))
    await bus.publish(event(run_id, mate))
    late = [body("globex", "code", g) for g in range(2)]
    for b in late:
        await bus.publish(event(run_id, b))
    await run_trainer(bus, run_id, trainer_part(max_steps=2), tmp_path)

    log = await bus.read_log(run_id)
    steps = {
        i.event.body.step: i.event.body for i in log if i.event and isinstance(i.event.body, ev.StepCompleted)
    }
    assert sorted(steps[1].rollout_ids) == sorted(r.rollout_id for b in late for r in b.rollouts)
    withheld = [i.event.body for i in log if i.event and isinstance(i.event.body, ev.RolloutWithheld)]
    assert [(w.rollout_id, w.reason) for w in withheld] == [(mate.rollouts[0].rollout_id, "incomplete_group")]
    assert (await dead_letters(bus, run_id))[bad.event_id][0] == "non_finite"


async def test_a_group_event_brings_its_rollouts_together_and_a_copy_trains_nothing_twice(
    bus: Bus, run_id: str, tmp_path: Path
) -> None:
    """One RolloutsScored is one delivery for a whole group: its rollouts are trained in one
    step, side by side in training order (by sample index), each recording the sequence of the
    event that brought it; the same groups published again (other event ids) are never trained
    twice, neither those trained already nor those still held."""
    groups = [body("acme", "math", g, (1, 0)) for g in range(2)]
    groups += [body("globex", "code", g) for g in range(2)]
    seqs_of: dict[str, set[int]] = {}

    async def publish_all() -> None:
        for b in groups:
            seq = (await bus.publish(event(run_id, b))).seq
            for r in b.rollouts:
                seqs_of.setdefault(r.rollout_id, set()).add(seq)

    await publish_all()
    await run_trainer(bus, run_id, trainer_part(max_steps=1), tmp_path)
    await publish_all()  # a producer that scored them all again
    await run_trainer(bus, run_id, trainer_part(max_steps=2), tmp_path)

    log = await bus.read_log(run_id)
    steps = [i.event.body for i in log if i.event and isinstance(i.event.body, ev.StepCompleted)]
    assert [s.step for s in steps] == [0, 1]
    for s in steps:
        assert len(s.rollout_seqs) == len(s.rollout_ids) == 4
        assert all(seq in seqs_of[rid] for rid, seq in zip(s.rollout_ids, s.rollout_seqs, strict=True))
        order = [ids.group_of(r) for r in s.rollout_ids]
        # Whole groups, each one's rollouts next to each other, by sample index, from one event.
        assert order[0::2] == order[1::2] and len(set(order)) == 2
        assert all(s.rollout_ids[i].endswith("-0") and s.rollout_ids[i + 1].endswith("-1") for i in (0, 2))
        assert s.rollout_seqs[0::2] == s.rollout_seqs[1::2]
    trained = Counter(r for s in steps for r in s.rollout_ids)
    assert set(trained) == {r.rollout_id for b in groups for r in b.rollouts}
    assert set(trained.values()) == {1}
    assert not [i for i in log if i.event and isinstance(i.event.body, ev.DeadLettered | ev.RolloutWithheld)]


async def test_groups_closed_on_their_quorum_are_trained_whole(bus: Bus, run_id: str, tmp_path: Path) -> None:
    """A group of 2 of its environment's 4 samples (the other 2 late) is a whole group: trained
    at once, neither held for the late samples nor refused."""
    routes = [EnvRoute(tenant="acme", env="math", group_size=4)]
    groups = [body("acme", "math", g, (0, 2), late_samples=[1, 3]) for g in range(2)]
    for b in groups:
        await bus.publish(event(run_id, b))
    await run_trainer(bus, run_id, trainer_part(max_steps=1, envs=routes), tmp_path)
    log = await bus.read_log(run_id)
    steps = [i.event.body for i in log if i.event and isinstance(i.event.body, ev.StepCompleted)]
    assert len(steps) == 1
    assert sorted(steps[0].rollout_ids) == sorted(r.rollout_id for b in groups for r in b.rollouts)
    assert not [i for i in log if i.event and isinstance(i.event.body, ev.DeadLettered | ev.RolloutWithheld)]
