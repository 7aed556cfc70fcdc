"""The catalog and its codec, without a server."""

from __future__ import annotations

import msgspec
import pytest

from jetrl.bus import events as ev
from jetrl.bus import subjects
from tests.support.catalog_samples import sample_bodies


def test_catalog_is_covered_by_samples() -> None:
    assert {type(b).TYPE for b in sample_bodies()} == set(ev.CATALOG)


@pytest.mark.parametrize("body", sample_bodies(), ids=lambda b: type(b).TYPE)
def test_round_trip_every_type(body: ev.EventBody) -> None:
    e = ev.new_event(body, run_id="r1", tenant="acme", causation_id="c0")
    back = ev.decode_event(ev.encode_event(e), ev.event_headers(e))
    assert back == e
    assert type(back.body) is type(body)
    assert back.schema_version == type(body).SCHEMA_VERSION


def _raw(**overrides: object) -> bytes:
    e = ev.new_event(ev.RunFinished(status="completed", steps=1), run_id="r1")
    d = msgspec.to_builtins(e)
    d.update(overrides)
    return msgspec.msgpack.encode(d)


def test_unknown_type_is_rejected_clearly() -> None:
    with pytest.raises(ev.UnknownEventType, match="unknown event type 'RunPaused'"):
        ev.decode_event(_raw(type="RunPaused"))


def test_newer_schema_version_is_rejected() -> None:
    with pytest.raises(ev.UnsupportedSchemaVersion, match="schema_version 2 is not supported"):
        ev.decode_event(_raw(schema_version=2))
    with pytest.raises(ev.UnsupportedSchemaVersion):
        ev.decode_event(_raw(schema_version=0))


def test_garbage_and_bad_bodies_are_malformed() -> None:
    with pytest.raises(ev.MalformedEvent, match="not a jetrl event envelope"):
        ev.decode_event(b"\xff\x00garbage")
    with pytest.raises(ev.MalformedEvent, match="invalid RunFinished body"):
        ev.decode_event(_raw(body={"status": "exploded", "steps": 1}))
    with pytest.raises(ev.MalformedEvent, match="invalid RunFinished body"):
        ev.decode_event(_raw(body={"status": "completed"}))


def test_header_type_must_agree_with_envelope() -> None:
    with pytest.raises(ev.MalformedEvent, match="disagrees"):
        ev.decode_event(_raw(), {ev.HEADER_TYPE: "StepCompleted"})


def test_older_body_without_new_optional_fields_still_decodes() -> None:
    # Evolving a body adds fields with defaults; an event written before them must read fine.
    e = ev.new_event(ev.WorkerHeartbeat(worker_id="w", kind="inference"), run_id="r1")
    d = msgspec.to_builtins(e)
    d["body"] = {"worker_id": "w", "kind": "inference"}
    back = ev.decode_event(msgspec.msgpack.encode(d))
    assert isinstance(back.body, ev.WorkerHeartbeat)
    assert back.body.stats == {} and back.body.loaded_version is None


def test_event_ids_are_unique_and_explicit_ids_kept() -> None:
    a = ev.new_event(ev.RunFinished(status="completed", steps=1), run_id="r")
    b = ev.new_event(ev.RunFinished(status="completed", steps=1), run_id="r")
    assert a.event_id != b.event_id
    c = ev.new_event(ev.RunFinished(status="completed", steps=1), run_id="r", event_id="fixed")
    assert ev.event_headers(c)["Nats-Msg-Id"] == "fixed"


@pytest.mark.parametrize("body", sample_bodies(), ids=lambda b: type(b).TYPE)
def test_every_type_has_a_subject_under_its_run(body: ev.EventBody) -> None:
    e = ev.new_event(body, run_id="r1", tenant="acme")
    s = subjects.subject_for(e)
    assert s.startswith("jetrl.r1.")
    if isinstance(body, ev.TaskSubmitted | ev.CompletionsGenerated | ev.RolloutsScored | ev.RolloutWithheld):
        assert subjects.tenant_of(s) == "acme"
        assert s.endswith(f".acme.{body.env}")


def test_subject_tokens_are_validated() -> None:
    with pytest.raises(subjects.InvalidName, match="tenant"):
        task = next(b for b in sample_bodies() if isinstance(b, ev.TaskSubmitted))
        subjects.subject_for(ev.new_event(task, run_id="r1", tenant="a.b"))
    with pytest.raises(subjects.InvalidName, match="run id"):
        subjects.all_subjects("run>1")
    assert subjects.task_subject("r1") == "jetrl.r1.task.*.*"
    assert subjects.rollout_subject("r1", "acme") == "jetrl.r1.rollout.acme.*"


def test_an_event_is_a_fact_only_on_its_own_subject() -> None:
    """`spoofed`: the subject derived from an event is the only one it may come on, and its
    entity ids must name its own env and tenant."""
    from jetrl.bus import ids
    from jetrl.bus.facts import spoofed

    run = "r1"
    tid = ids.task_id("math", "acme", 3)
    task = ev.new_event(
        ev.TaskSubmitted(task_id=tid, env="math", group_size=2, prompt_tokens=[1]), run_id=run, tenant="acme"
    )
    own = subjects.subject_for(task)
    assert spoofed(run, own, task) is None
    assert spoofed("r2", own, task) is not None  # another run's
    assert spoofed(run, subjects.task_subject(run, "acme", "code"), task) is not None  # another env
    assert spoofed(run, subjects.rollout_subject(run, "acme", "math"), task) is not None  # another kind
    step = ev.new_event(ev.StepCompleted(step=0, policy_version=0, rollout_ids=[]), run_id=run, tenant="acme")
    assert "belongs on" in (spoofed(run, subjects.rollout_subject(run, "acme", "math"), step) or "")
    foreign = ev.new_event(
        ev.TaskSubmitted(
            task_id=ids.task_id("math", "globex", 3), env="math", group_size=2, prompt_tokens=[1]
        ),
        run_id=run,
        tenant="acme",
    )
    assert "not of environment" in (spoofed(run, subjects.subject_for(foreign), foreign) or "")
    dl = ev.new_event(
        ev.DeadLettered(
            reason="malformed", detail="x", consumer="c", original_subject="s", original_stream_seq=1
        ),
        run_id=run,
        tenant="acme",
    )
    assert subjects.subject_for(dl) == f"jetrl.{run}.dlq.acme.malformed"
    assert spoofed(run, subjects.subject_for(dl), dl) is None
    assert spoofed(run, f"jetrl.{run}.dlq.malformed", dl) is None  # a log from before the tenant token


def test_foreign_id_looks_into_every_sample_and_every_rollout() -> None:
    """A sample's generation id and a rollout's id are entity ids too: one of another tenant
    (or another environment) in an otherwise good event makes the whole event foreign, wherever
    it sits in the list."""
    import msgspec.structs as structs

    from jetrl.bus import ids
    from jetrl.bus.facts import foreign_id, spoofed

    run = "r1"
    gen = next(b for b in sample_bodies() if isinstance(b, ev.CompletionsGenerated))
    scored = next(b for b in sample_bodies() if isinstance(b, ev.RolloutsScored))
    assert len(gen.samples) >= 2 and len(scored.rollouts) >= 2

    def event(body: ev.EventBody) -> ev.Event:
        return ev.new_event(body, run_id=run, tenant="acme")

    assert foreign_id(event(gen)) is None and foreign_id(event(scored)) is None
    assert spoofed(run, subjects.subject_for(event(gen)), event(gen)) is None
    for last in (False, True):
        at = len(gen.samples) - 1 if last else 0
        for other in (ids.generation_id("reverse.globex.1", at), ids.generation_id("math.acme.1", at)):
            samples = list(gen.samples)
            samples[at] = structs.replace(samples[at], generation_id=other)
            e = event(structs.replace(gen, samples=samples))
            why = foreign_id(e)
            assert why is not None and "generation_id" in why and repr(other) in why
            assert spoofed(run, subjects.subject_for(e), e) == why
        for other in (ids.rollout_id("reverse.globex.1", at), ids.rollout_id("math.acme.1", at)):
            rollouts = list(scored.rollouts)
            rollouts[at] = structs.replace(rollouts[at], rollout_id=other)
            e = event(structs.replace(scored, rollouts=rollouts))
            why = foreign_id(e)
            assert why is not None and "rollout_id" in why and repr(other) in why
            assert spoofed(run, subjects.subject_for(e), e) == why
    # The event's own ids still count: a good group under another tenant's group id.
    e = event(structs.replace(scored, group_id="reverse.globex.1"))
    assert "group_id" in (foreign_id(e) or "")
    # The same bodies are the other tenant's facts when that tenant publishes them.
    theirs = ev.new_event(gen, run_id=run, tenant="globex")
    assert "task_id" in (foreign_id(theirs) or "")
