"""The trainer's edge: hostile scored rollouts are dead-lettered with a specific reason (their
group's other members withheld), never crash the trainer, and the good groups are trained;
the pure checks of consumers/trainer/admission.py one by one."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.payloads import Payloads, inline_array
from jetrl.bus.settings import EnvRoute
from jetrl.consumers.trainer.admission import (
    ModelLimits,
    check_member,
    check_read,
    check_rollout,
    routes_by_key,
)
from jetrl.consumers.trainer.core import TrainCore
from jetrl.consumers.trainer.replay import Replayer, read_rollouts, read_run_log
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


def body(
    tenant: str = "acme",
    env: str = "math",
    n: int = 0,
    i: int = 0,
    *,
    group_size: int = 2,
    prompt: list[int] | None = None,
    completion: list[int] | None = None,
    **changes: Any,
) -> ev.RolloutScored:
    """A valid rollout of tiny-moe (sample ``i`` of the tenant's ``n``-th group), then ``changes``."""
    prompt = prompt or [1, 2, 3]
    completion = completion or [4 + i, 5]
    group = f"{env}.{tenant}.{n}"
    b = ev.RolloutScored(
        rollout_id=f"{group}-{i}",
        generation_event_id=f"gen-{group}-{i}",
        task_id=group,
        env=env,
        group_id=group,
        sample_index=i,
        group_size=group_size,
        reward=float(i + n % 3),
        reward_parts={"correct": float(i)},
        prompt_tokens=arr(prompt, "int32"),
        completion_tokens=arr(completion, "int32"),
        logprobs=arr([-0.5] * len(completion), "float32"),
        routing_trace=trace(len(prompt) + len(completion) - 1),
        policy_version_start=0,
        policy_version_end=0,
    )
    if not changes:
        return b
    b = msgspec.structs.replace(b, **changes)
    if "rollout_id" not in changes:  # kept <group_id>-<sample_index>, unless that is the point
        b = msgspec.structs.replace(b, rollout_id=f"{b.group_id}-{b.sample_index}")
    return b


def event(run_id: str, b: ev.RolloutScored, tenant: str | None = None) -> ev.Event:
    return ev.new_event(b, run_id=run_id, tenant=tenant or b.group_id.split(".")[1])


def trainer_part(
    *, max_steps: int = 2, envs: list[EnvRoute] | None = None, batch_groups: int = 2
) -> TrainerPart:
    return TrainerPart(
        trainer=TrainerSettings(batch_groups=batch_groups, max_steps=max_steps, checkpoint_every=0),
        envs=ROUTES if envs is None else envs,
    )


# ------------------------------------------------------------------------ pure checks


def reason(b: ev.RolloutScored, tenant: str = "acme", *, version: int = 0, **kw: Any) -> str | None:
    routes = routes_by_key(kw.pop("routes", ROUTES))
    got = check_rollout(b, tenant, routes=routes, limits=kw.pop("limits", LIMITS), version=version, **kw)
    return None if got is None else got[0]


def test_a_valid_rollout_passes() -> None:
    assert reason(body()) is None
    assert reason(body("globex", "code", 3, 1), "globex") is None
    assert reason(body(env="poker"), routes=[]) is None  # no [[envs]] given: any env
    assert reason(body(policy_version_start=2, policy_version_end=3), version=3) is None


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"env": "poker"}, "unknown_env"),
        ({"group_id": "code.globex.0"}, "bad_ids"),
        ({"task_id": "math.globex.0"}, "bad_ids"),
        ({"rollout_id": "math.acme.0-7"}, "bad_ids"),
        ({"group_size": 1}, "invalid_group"),
        ({"group_size": 3}, "invalid_group"),
        ({"sample_index": 2}, "invalid_group"),
        ({"sample_index": -1}, "invalid_group"),
        ({"reward": math.nan}, "non_finite"),
        ({"reward": -math.inf}, "non_finite"),
        ({"reward_parts": {"x": math.inf}}, "non_finite"),
        ({"reward": 1e12}, "reward_range"),
        ({"policy_version_start": 1, "policy_version_end": 0}, "bad_version"),
        ({"policy_version_start": -1}, "bad_version"),
        ({"policy_version_end": 1}, "future_version"),
        ({"prompt_tokens": arr([1.0, 2.0, 3.0], "float32")}, "bad_arrays"),
        ({"prompt_tokens": arr([[1, 2, 3]], "int32")}, "bad_arrays"),
        ({"prompt_tokens": ev.InlineArray(dtype="int32", shape=(3,), data=b"\0" * 8)}, "bad_arrays"),
        ({"prompt_tokens": ev.InlineArray(dtype="object", shape=(3,), data=b"\0" * 24)}, "bad_arrays"),
        ({"completion_tokens": arr([], "int32"), "logprobs": arr([], "float32")}, "bad_arrays"),
        ({"logprobs": arr([-0.5] * 3, "float32")}, "bad_arrays"),
        ({"logprobs": arr([-1, -1], "int32")}, "bad_arrays"),
        ({"completion_mask": arr([1, 1], "int32")}, "bad_arrays"),
        ({"completion_mask": arr([1], "uint8")}, "bad_arrays"),
        ({"routing_trace": trace(5)}, "bad_arrays"),
        ({"routing_trace": None}, "bad_arrays"),
        ({"routing_trace": arr(np.zeros((4, 2, 2)), "float32")}, "bad_arrays"),
        (
            {
                "prompt_tokens": ev.PayloadRef(
                    store="objstore",
                    bucket="b",
                    name="n",
                    size=12,
                    sha256="0" * 64,
                    dtype="int32",
                    shape=(3,),
                )
            },
            "bad_arrays",  # another bucket than the run's
        ),
        (
            {
                "prompt_tokens": ev.PayloadRef(
                    store="objstore", bucket="b", name="n", size=12, sha256="0" * 64
                )
            },
            "bad_arrays",  # a blob, no dtype/shape
        ),
        ({"prompt_tokens": arr([1] * 255, "int32"), "routing_trace": trace(256)}, "too_long"),
    ],
)
def test_each_impossible_rollout_has_its_reason(changes: dict[str, Any], expected: str) -> None:
    assert reason(body(**changes), bucket="jetrl_r_payloads") == expected


def test_traces_follow_the_model_and_replay() -> None:
    dense = ModelLimits(max_seq_len=256, vocab_size=64, trace=None)
    assert reason(body(), limits=dense) == "bad_arrays"  # a dense model refuses a trace it would read
    assert reason(body(routing_trace=None), limits=dense) is None
    off = ModelLimits(max_seq_len=256, vocab_size=64, trace=None, replay=False)
    assert reason(body(routing_trace=trace(9)), limits=off) is None  # never read


def test_members_of_one_group_agree_on_its_size() -> None:
    first = body()
    assert check_member(first, body(i=1)) is None
    got = check_member(first, body(i=1, group_size=3))
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


# ------------------------------------------------------------------------ through a real server


async def dead_letters(bus: Bus, run_id: str) -> dict[str, tuple[str, str]]:
    """original event id -> (reason, dead-letter subject)"""
    out = {}
    for item in await bus.read_log(run_id):
        if item.event is not None and isinstance(item.event.body, ev.DeadLettered):
            b = item.event.body
            assert b.original_event_id is not None
            out[b.original_event_id] = (b.reason, item.subject)
    return out


async def run_trainer(bus: Bus, run_id: str, part: TrainerPart, run_dir: Path) -> Trainer:
    t = Trainer(bus, run_id, part, run_dir)
    # A guard against a hang, not a timing assertion.
    assert await asyncio.wait_for(t.run(asyncio.Event()), 300) == 0
    return t


async def test_hostile_rollouts_are_dead_lettered_and_the_good_groups_trained(
    bus: Bus, run_id: str, tmp_path: Path
) -> None:
    payloads = await Payloads.for_run(bus.js, run_id)
    good_blob = np.asarray([4, 5], np.int32).tobytes()
    ref = await payloads.default.put("tokens-corrupt", good_blob)
    corrupt = msgspec.structs.replace(ref, sha256="0" * 64, dtype="int32", shape=(2,))

    # Each hostile case: its tenant's group n, the bad member, the reason, whether its group
    # mate (sample 0, sent first or after) is withheld as incomplete. Admission cases first,
    # then groups whose arrays are refused only when read for a step.
    n = iter(range(100, 200))
    cases: list[tuple[ev.RolloutScored, str, ev.RolloutScored | None]] = []

    def case(expected: str, *, mate: bool = True, i: int = 1, **changes: Any) -> None:
        g = next(n)
        cases.append((body(n=g, i=i, **changes), expected, body(n=g, i=0) if mate else None))

    cases.append((body(env="poker", n=next(n)), "unknown_env", None))
    # A foreign group id is refused by the bus (spoofed); a rollout id that is not its
    # group's sample would let two rollouts claim one sample.
    cases.append((body(n=next(n), rollout_id="math.acme.101-7"), "bad_ids", None))
    case("invalid_group", mate=False, group_size=1, i=0)
    case("invalid_group", sample_index=2)
    case("invalid_group", group_size=3)
    case("non_finite", reward=math.nan)
    case("non_finite", reward_parts={"x": math.inf})
    case("bad_version", policy_version_start=1)
    case("future_version", policy_version_end=5)
    case("bad_arrays", logprobs=arr([-0.5] * 3, "float32"))
    case("bad_arrays", prompt_tokens=arr([1.0, 2.0, 3.0], "float32"))
    case("bad_arrays", completion_tokens=arr([[4, 5]], "int32"))
    case("bad_arrays", completion_mask=arr([1, 1], "int32"))
    case("bad_arrays", routing_trace=trace(7))
    case("bad_arrays", routing_trace=None)
    case("bad_arrays", prompt_tokens=ev.InlineArray(dtype="int32", shape=(3,), data=b"\0" * 5))
    case("too_long", prompt=list(range(1, 60)) * 5)
    case("bad_tokens", completion=[4, 64])
    case(
        "bad_arrays",
        completion_tokens=ev.LogArray(seq=10**9, field="completion_tokens", dtype="int32", shape=(2,)),
    )
    case("bad_arrays", completion_tokens=corrupt)
    case("bad_arrays", routing_trace=trace(4, (1, 1)))
    case("non_finite", logprobs=arr([math.nan, -0.5], "float32"))

    hostile: dict[str, str] = {}  # event id -> expected reason
    mates: set[str] = set()
    for k, (bad, expected, mate) in enumerate(cases):
        bad_event = event(run_id, bad, tenant="acme")
        hostile[bad_event.event_id] = expected
        order = [bad_event] if mate is None else [event(run_id, mate), bad_event]
        if k % 2:
            order.reverse()  # the bad member before or after its mate
        for e in order:
            await bus.publish(e)
        if mate is not None:
            mates.add(mate.rollout_id)
    # An event of an unknown env has a second, unknown member too.
    stray = event(run_id, body(env="poker", n=100, i=1), tenant="acme")
    hostile[stray.event_id] = "unknown_env"
    await bus.publish(stray)

    good = [body("acme", "math", g, i) for g in range(2) for i in range(2)]
    good += [body("globex", "code", g, i) for g in range(2) for i in range(2)]
    for b in good:
        await bus.publish(event(run_id, b))

    await run_trainer(bus, run_id, trainer_part(max_steps=2), tmp_path)

    log = await bus.read_log(run_id)
    steps = [i.event.body for i in log if i.event and isinstance(i.event.body, ev.StepCompleted)]
    assert sorted(s.step for s in steps) == [0, 1]
    trained = Counter(r for s in steps for r in s.rollout_ids)
    assert set(trained) == {b.rollout_id for b in good} and set(trained.values()) == {1}
    dls = await dead_letters(bus, run_id)
    assert {eid: dls[eid][0] for eid in hostile if eid in dls} == hostile
    # Each on the dead-letter subject of the tenant it came from, under its reason.
    assert all(dls[eid][1] == f"jetrl.{run_id}.dlq.acme.{r}" for eid, r in hostile.items())
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
    rollouts, _ = await read_rollouts(bus, run_id, run_log.trained_ids())
    checks = await replayer.run(rollouts)
    assert len(checks) == 2 and all(c.ok for c in checks)


async def test_a_restarted_trainer_still_withholds_the_rest_of_a_refused_group(
    bus: Bus, run_id: str, tmp_path: Path
) -> None:
    bad = event(run_id, body(n=50, i=1, reward=math.nan))
    await bus.publish(bad)
    for g in range(2):
        for i in range(2):
            await bus.publish(event(run_id, body("acme", "math", g, i)))
    await run_trainer(bus, run_id, trainer_part(max_steps=1), tmp_path)

    # The refused member's mate comes only now, to a new trainer (which knows of the refusal
    # from the dead letters alone), then two more good groups.
    mate = body(n=50, i=0)
    await bus.publish(event(run_id, mate))
    late = [body("globex", "code", g, i) for g in range(2) for i in range(2)]
    for b in late:
        await bus.publish(event(run_id, b))
    await run_trainer(bus, run_id, trainer_part(max_steps=2), tmp_path)

    log = await bus.read_log(run_id)
    steps = {
        i.event.body.step: i.event.body for i in log if i.event and isinstance(i.event.body, ev.StepCompleted)
    }
    assert sorted(steps[1].rollout_ids) == sorted(b.rollout_id for b in late)
    withheld = [i.event.body for i in log if i.event and isinstance(i.event.body, ev.RolloutWithheld)]
    assert [(w.rollout_id, w.reason) for w in withheld] == [(mate.rollout_id, "incomplete_group")]
    assert (await dead_letters(bus, run_id))[bad.event_id][0] == "non_finite"
