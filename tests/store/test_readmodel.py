"""The read model (store/readmodel): every event of the catalog is read as the fact that names
it, and a run's store gives back the facts its log gives, on both backends."""

from __future__ import annotations

import msgspec

from jetrl.bus import events as ev
from jetrl.store import readmodel as rm
from jetrl.store.db import Store
from jetrl.store.readmodel.stored import facts_of_store
from tests.store.test_store_projection import project
from tests.support.synthetic import log_items, synthetic_run


def _more(run_id: str, t: float) -> list[ev.Event]:
    """What a synthetic run lacks: an evaluation, an alert, a dead letter and a resume."""
    evaluation = ev.EvaluationReported(
        env="math",
        policy_version=2,
        n_tasks=3,
        samples=4,
        pass_at_1=0.25,
        pass_at_k=0.5,
        reward_mean=0.3,
        version_min=2,
        version_max=3,
        temperature=0.7,
        successes=[1, 0, 2],
    )
    alert = ev.AlertRaised(
        rule="mismatch_kl",
        key="trainer",
        state="firing",
        severity="warning",
        message="kl 0.2",
        step=3,
        value=0.2,
        threshold=0.05,
    )
    dead = ev.DeadLettered(
        reason="malformed",
        detail="not msgpack",
        consumer="trainer",
        original_subject=f"jetrl.{run_id}.rollout.acme.math",
        original_stream_seq=17,
        delivery_count=2,
        original_data=b"\x00garbage",
    )
    withheld = ev.RolloutWithheld(
        rollout_id="math.acme.99-0",
        group_id="math.acme.99",
        env="math",
        reason="stale",
        trainer_step=4,
        policy_version=4,
        staleness=2,
        detail="staleness 2 > max_off_policy_steps 1",
    )
    return [
        ev.new_event(withheld, run_id=run_id, tenant="acme", time=t + 0.5),
        ev.new_event(evaluation, run_id=run_id, tenant="acme", time=t + 1),
        ev.new_event(alert, run_id=run_id, time=t + 2),
        ev.new_event(dead, run_id=run_id, tenant="acme", time=t + 3),
    ]


def _facts(items: list[rm.Fact | None]) -> list[rm.Fact]:
    return [f for f in items if f is not None]


def test_every_event_is_read_as_the_fact_that_names_it() -> None:
    run = synthetic_run("rm-each", steps=2, tasks_per_step=2, group_size=2)
    resumed = ev.RunResumed(config={"trainer": {"max_steps": 9}}, code_version="0")
    events = [*run.events, *_more("rm-each", run.events[-1].time), ev.new_event(resumed, run_id="rm-each")]
    assert {type(e.body) for e in events} == set(ev.CATALOG.values()) == set(rm.FACT_OF)
    for item in log_items(events):
        fact = rm.fact_of(item.seq, item.subject, item.event)
        assert fact is not None and fact.OF is type(item.event.body)
        assert (fact.seq, fact.t) == (item.seq, item.event.time)
    # What some of them state, beyond copying fields.
    item = next(i for i in log_items(run.events) if isinstance(i.event.body, ev.StepCompleted))
    step = rm.fact_of(item.seq, item.subject, item.event)
    assert isinstance(step, rm.Stepped) and isinstance(item.event.body, ev.StepCompleted)
    assert (
        step.rollout_ids == tuple(item.event.body.rollout_ids)
        and step.version == item.event.body.policy_version
    )
    item = next(i for i in log_items(run.events) if isinstance(i.event.body, ev.RolloutsScored))
    scored = rm.fact_of(item.seq, item.subject, item.event)
    body = item.event.body
    assert isinstance(scored, rm.Scored) and isinstance(body, ev.RolloutsScored)
    first = min(body.rollouts, key=lambda r: r.sample_index)
    assert [r.rollout_id for r in scored.rollouts] == sorted(
        (r.rollout_id for r in body.rollouts), key=lambda rid: int(rid.rsplit("-", 1)[1])
    )
    assert scored.rollouts[0].length == first.completion_tokens.shape[0]  # type: ignore[index]
    assert scored.rollouts[0].payloads["completion_tokens"] == rm.array_json(first.completion_tokens)
    assert scored.rollouts[0].payloads["prompt_tokens"] == rm.array_json(body.prompt_tokens)
    # Without payloads (the monitor's read): the same fact, where the arrays lie left out.
    bare = rm.fact_of(item.seq, item.subject, item.event, payloads=False)
    assert isinstance(bare, rm.Scored) and all(r.payloads == {} for r in bare.rollouts)
    assert bare.rollouts == tuple(msgspec.structs.replace(r, payloads={}) for r in scored.rollouts)
    assert msgspec.structs.replace(bare, rollouts=scored.rollouts) == scored
    loaded = ev.new_event(ev.WeightsLoaded(version=3, worker_id="w"), run_id="rm-each")
    fact = rm.fact_of(1, "jetrl.rm-each.worker.vllm.w", loaded)
    assert isinstance(fact, rm.Loaded) and fact.kind == "vllm"  # the kind is the subject's


def test_the_store_gives_back_the_facts_of_the_log(store: Store) -> None:
    run = synthetic_run("rm-store", steps=5, tasks_per_step=3, group_size=3, seed=11)
    items = log_items([*run.events, *_more("rm-store", run.events[-1].time)])
    project(store, items, "rm-store", [1, 90, 400])
    from_log = _facts([rm.fact_of(i.seq, i.subject, i.event) for i in items])
    with store.read() as conn:
        from_db = list(facts_of_store(conn, "rm-store"))

    # A worker's state is kept as its last heartbeat and its last load; every other fact whole.
    def whole(f: rm.Fact) -> bool:
        return not isinstance(f, rm.Beat | rm.Loaded)

    assert [f for f in from_db if whole(f)] == [f for f in from_log if whole(f)]
    assert {type(f) for f in from_db if whole(f)} == {
        rm.Started,
        rm.Finished,
        rm.Tasked,
        rm.Generated,
        rm.Scored,
        rm.Withheld,
        rm.Stepped,
        rm.Versioned,
        rm.Ready,
        rm.Dead,
        rm.Evaluated,
        rm.Alerted,
    }
    logged = {f.seq: f for f in from_log}
    beats = [f for f in from_db if isinstance(f, rm.Beat)]
    assert sorted(b.worker_id for b in beats) == sorted(run.truth.workers)
    for b in beats:
        last = max(f.seq for f in from_log if isinstance(f, rm.Beat) and f.worker_id == b.worker_id)
        assert b.seq == last
        # Its loaded version, unless a later WeightsLoaded holds the worker's loaded state.
        assert b == msgspec.structs.replace(logged[last], loaded_version=b.loaded_version)
    for f in from_db:
        if isinstance(f, rm.Loaded):
            assert f == logged[f.seq]
