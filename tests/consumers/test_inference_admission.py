"""Validation at the edge and quotas: every task that can never be generated is dead-lettered with
its reason on its tenant's dead-letter subject, while the good tasks of the same batch are
generated; a tenant past its quota has its oldest queued tasks refused (real nats-server)."""

from __future__ import annotations

import asyncio
import math

import pytest

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.payloads import Payloads
from jetrl.bus.settings import EnvRoute, TenantSettings
from jetrl.consumers.inference.admission import Admission, limits_for
from jetrl.consumers.inference.engine import Limits, make_generation_engine
from jetrl.consumers.inference.settings import InferencePart, InferenceSettings
from jetrl.consumers.inference.worker import InferenceWorker
from jetrl.policy.settings import ModelSettings
from jetrl.policy.tokenizer import CharTokenizer

TOK = CharTokenizer()
PROMPT = TOK.encode("3+4=")


def part_of(*tenants: TenantSettings, batch: int = 32) -> InferencePart:
    names = [t.name for t in tenants]
    return InferencePart(
        inference=InferenceSettings(engine="tests.support.engines:OracleEngine", max_batch_tasks=batch),
        model=ModelSettings(name="tiny-dense"),  # vocabulary 64, context 256
        tenants=list(tenants),
        envs=[EnvRoute(tenant=n, env="modsum", group_size=2) for n in names],
    )


def task(tid: str, **over: object) -> ev.TaskSubmitted:
    fields: dict[str, object] = {
        "task_id": tid,
        "env": "modsum",
        "group_size": 2,
        "prompt_tokens": PROMPT,
        "max_tokens": 2,
    }
    fields.update(over)
    return ev.TaskSubmitted(**fields)  # type: ignore[arg-type]


async def announce_v0(bus: Bus, run_id: str) -> None:
    payloads = await Payloads.for_run(bus.js, run_id)
    ref = await payloads.default.put("weights-v0", b"weights")
    await bus.publish(
        ev.new_event(ev.WeightsReady(version=0, location=ref, weights_checksum="0" * 64), run_id=run_id)
    )


async def outcomes(
    bus: Bus,
    run_id: str,
    part: InferencePart,
    tasks: list[tuple[str, ev.TaskSubmitted]],
) -> tuple[set[str], dict[str, tuple[str, str]], InferenceWorker]:
    """Publish ``tasks`` (tenant, body), then run one worker until each was either generated or
    dead-lettered: the task ids generated, and the dead-lettered ones' (reason, subject)."""
    by_event: dict[str, str] = {}
    bodies = {body.task_id: body for _, body in tasks}
    pub = bus.publisher()
    for tenant, body in tasks:
        e = ev.new_event(body, run_id=run_id, tenant=tenant)
        by_event[e.event_id] = body.task_id
        await pub.publish(e)
    await pub.flush()
    worker = InferenceWorker(bus, run_id, "w0", part)
    worker.future_delays = (0.05,)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    generated: set[str] = set()
    dead: dict[str, tuple[str, str]] = {}
    try:
        async for item in bus.tail(run_id, idle_timeout=30):
            b = item.event.body if item.event else None
            if isinstance(b, ev.CompletionsGenerated):
                # One event per task: all its samples, its prompt referred to in the task.
                asked = bodies[b.task_id]
                assert sorted(s.sample_index for s in b.samples) == list(range(asked.group_size))
                ref = b.prompt_tokens
                assert isinstance(ref, ev.LogArray)
                assert (ref.field, ref.dtype, ref.shape) == (
                    "prompt_tokens",
                    "int32",
                    (len(asked.prompt_tokens),),
                )
                assert b.task_id not in generated, "a task generated twice"
                generated.add(b.task_id)
            elif isinstance(b, ev.DeadLettered) and b.original_event_id in by_event:
                dead[by_event[b.original_event_id]] = (b.reason, item.subject)
            if len(generated) + len(dead) == len(tasks):
                break
    finally:
        stop.set()
        await asyncio.wait_for(running, 60)
    return generated, dead, worker


async def test_each_bad_task_is_refused_with_its_reason_and_the_good_are_generated(
    bus: Bus, run_id: str
) -> None:
    await announce_v0(bus, run_id)
    part = part_of(TenantSettings(name="acme"))
    good = [
        ("acme", task("modsum.acme.0")),
        ("acme", task("modsum.acme.1", min_policy_version=2)),  # two ahead: waits, not refused
        (
            "acme",
            task("modsum.acme.0-0.t1", group_size=1, turn=1, episode_id="modsum.acme.0"),
        ),  # a later turn
        ("acme", task("modsum.acme.eval.v0.n0", group_size=1)),  # an evaluation: pass@1
        ("acme", task("gateway.acme.aa", env="gateway", group_size=1)),
        ("default", task("gateway.default.bb", env="gateway", group_size=1)),
        ("acme", task("modsum.acme.2", temperature=0.0)),  # greedy
    ]
    bad = {
        "nope.acme.3": ("acme", task("nope.acme.3", env="nope"), "unknown_env"),
        "modsum.evil.4": ("evil", task("modsum.evil.4"), "unknown_env"),
        "modsum.acme.5": ("acme", task("modsum.acme.5", group_size=1), "invalid_group"),
        "modsum.acme.6": ("acme", task("modsum.acme.6", group_size=5000), "invalid_group"),
        "modsum.acme.7": ("acme", task("modsum.acme.7", prompt_tokens=[*PROMPT, 64]), "bad_tokens"),
        "modsum.acme.8": ("acme", task("modsum.acme.8", prompt_tokens=[-1, *PROMPT]), "bad_tokens"),
        "modsum.acme.9": ("acme", task("modsum.acme.9", prompt_tokens=[]), "bad_tokens"),
        "modsum.acme.10": ("acme", task("modsum.acme.10", prompt_tokens=[5] * 250, max_tokens=8), "too_long"),
        "modsum.acme.11": ("acme", task("modsum.acme.11", temperature=math.nan), "bad_params"),
        "modsum.acme.12": ("acme", task("modsum.acme.12", temperature=-1.0), "bad_params"),
        "modsum.acme.13": ("acme", task("modsum.acme.13", max_tokens=-1), "bad_params"),
        "modsum.acme.14": ("acme", task("modsum.acme.14", min_policy_version=100), "future_version"),
    }
    tasks = [*good, *((tenant, body) for tenant, body, _ in bad.values())]

    async def announce_v2_later() -> None:  # the task two versions ahead gets its weights
        await asyncio.sleep(0.5)
        payloads = await Payloads.for_run(bus.js, run_id)
        ref = await payloads.default.put("weights-v2", b"weights 2")
        body = ev.WeightsReady(version=2, location=ref, weights_checksum="0" * 64)
        await bus.publish(ev.new_event(body, run_id=run_id))

    later = asyncio.create_task(announce_v2_later())
    generated, dead, worker = await outcomes(bus, run_id, part, tasks)
    await later
    assert generated == {b.task_id for _, b in good}, dead
    assert {tid: reason for tid, (reason, _) in dead.items()} == {tid: r for tid, (_, _, r) in bad.items()}
    for tid, (reason, subject) in dead.items():
        assert subject == subjects.dlq_subject(run_id, bad[tid][0], reason)  # the tenant's own
    assert worker.stats["refused"] == len(bad)


async def test_a_tenant_past_its_quota_has_its_oldest_tasks_refused(bus: Bus, run_id: str) -> None:
    await announce_v0(bus, run_id)
    part = part_of(TenantSettings(name="a", max_tasks_in_flight=3), TenantSettings(name="b"), batch=4)
    flood = [("a", task(f"modsum.a.{i}")) for i in range(10)]
    others = [("b", task(f"modsum.b.{i}")) for i in range(4)]
    gateway = [("default", task("gateway.default.cc", env="gateway", group_size=1))]
    generated, dead, _ = await outcomes(bus, run_id, part, [*flood, *others, *gateway])
    # 10 queued against a quota of 3: the 7 oldest are refused, the 3 newest served.
    assert dead == {f"modsum.a.{i}": ("quota", subjects.dlq_subject(run_id, "a", "quota")) for i in range(7)}
    assert generated == {
        "modsum.a.7",
        "modsum.a.8",
        "modsum.a.9",
        *(b.task_id for _, b in others),
        "gateway.default.cc",
    }


def test_the_quota_rule() -> None:
    adm = Admission(part_of(TenantSettings(name="a", max_tasks_in_flight=3)), Limits(64, 256))
    assert adm.over_quota("a", pending_behind=2, held=0) is None  # 3 in flight: at the quota
    assert adm.over_quota("a", pending_behind=0, held=2) is None
    refusal = adm.over_quota("a", pending_behind=1, held=2)
    assert refusal is not None and refusal.reason == "quota"
    assert adm.over_quota("b", pending_behind=10**6, held=10**6) is None  # no quota


class BareEngine:
    """Generates nothing and says neither its capacity nor its limits."""

    def __init__(self, part: InferencePart, worker_id: str) -> None:
        pass


def test_the_limits_are_the_engines_own_else_the_models() -> None:
    from tests.support.engines import OracleEngine

    part = part_of(TenantSettings(name="a"))
    engine = make_generation_engine(part, "inf-0")
    assert isinstance(engine, OracleEngine)
    assert limits_for(part, engine) == Limits(64, 256)  # no model of its own: tiny-dense's
    engine.limits = Limits(100, 32)  # a model of its own (vLLM's max_model_len, say) wins
    assert limits_for(part, engine) == Limits(100, 32)


def test_an_engine_that_does_not_say_what_the_worker_reads_is_refused_by_name() -> None:
    part = part_of(TenantSettings(name="a"))
    part.inference.engine = f"{__name__}:BareEngine"
    with pytest.raises(TypeError, match=r"BareEngine' lacks \['batches_in_flight', 'close'.*'limits'"):
        make_generation_engine(part, "inf-0")
