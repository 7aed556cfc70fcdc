"""The invariants every finished run keeps, checked from its log (the end-to-end tests share
them: one machine, parts started anywhere, hosts in network namespaces)."""

from __future__ import annotations

from collections import Counter

from jetrl.bus import events as ev
from jetrl.bus import ids
from tests.support.runlog import bodies, scored_rollouts


def assert_run_invariants(log: list[ev.Event], *, steps: int, rollouts_per_step: int, max_off: int) -> None:
    # Versions are monotone, one per step, each with a checksum.
    published = bodies(log, ev.PolicyVersionPublished)
    assert [p.version for p in published] == list(range(steps + 1))
    assert all(len(p.weights_checksum) == 64 for p in published)
    done = bodies(log, ev.StepCompleted)
    assert [s.step for s in done] == list(range(steps))
    assert [s.policy_version for s in done] == list(range(1, steps + 1))
    assert [s.final for s in done] == [False] * (steps - 1) + [True], "the last step, and only it, is final"

    # One generation per task and one scored event per generation, each whole: a task's
    # samples (every index once) in one CompletionsGenerated, a group's rollouts (an episode's
    # alone) in one RolloutsScored.
    tasks = {t.task_id: t for t in bodies(log, ev.TaskSubmitted)}
    generated = Counter(g.task_id for g in bodies(log, ev.CompletionsGenerated))
    assert all(n == 1 for n in generated.values()), "a task was generated twice"
    for g in bodies(log, ev.CompletionsGenerated):
        asked = tasks[g.task_id].group_size
        assert sorted(s.sample_index for s in g.samples) == list(range(asked)), "a task's samples"
    groups = bodies(log, ev.RolloutsScored)
    assert all(n == 1 for n in Counter(b.generation_event_id for b in groups).values()), "scored twice"
    for b in groups:
        indexes = [r.sample_index for r in b.rollouts]
        assert (
            b.rollouts
            and len(set(indexes)) == len(indexes)
            and all(0 <= i < b.group_size + len(b.late_samples) for i in indexes)
            and not set(indexes) & set(b.late_samples)
        )
        assert all(r.rollout_id == ids.rollout_id(b.group_id, r.sample_index) for r in b.rollouts)

    # Every trained rollout was scored exactly once and trained in exactly one step.
    scored = Counter(r.rollout_id for _, r in scored_rollouts(log))
    assert all(n == 1 for n in scored.values()), "a rollout was scored twice"
    trained = Counter(rid for s in done for rid in s.rollout_ids)
    assert all(n == 1 for n in trained.values()), "a rollout was trained twice"
    assert set(trained) <= set(scored)
    withheld = {w.rollout_id for w in bodies(log, ev.RolloutWithheld)}
    assert not (withheld & set(trained)), "a withheld rollout was trained"
    # A finished run accounts for every rollout: trained, or withheld with its reason.
    assert set(scored) == set(trained) | withheld, "a scored rollout is neither trained nor withheld"
    assert all(w.trainer_step == steps for w in bodies(log, ev.RolloutWithheld) if w.reason == "run_finished")
    assert sum(len(s.rollout_ids) for s in done) == steps * rollouts_per_step
    # A step trains whole groups, the sequence of each rollout's event recorded.
    sizes = {b.group_id: b.group_size for b in groups}
    for s in done:
        assert len(s.rollout_seqs) == len(s.rollout_ids)
        by_group = Counter(ids.group_of(rid) for rid in s.rollout_ids)
        assert all(n == sizes[g] for g, n in by_group.items()), "a step trained part of a group"

    # Staleness is within the bound for every trained rollout.
    start_version = {r.rollout_id: r.policy_version_start for _, r in scored_rollouts(log)}
    for s in done:
        for rid in s.rollout_ids:
            assert 0 <= s.step - start_version[rid] <= max_off

    # Workers loaded the weights they announced; the run is framed by RunStarted/RunFinished.
    assert bodies(log, ev.WeightsLoaded), "no worker reported loading weights"
    assert bodies(log, ev.RunStarted)[0].config["trainer"]["max_steps"] == steps
    assert bodies(log, ev.RunFinished)[-1].status == "completed"
    assert not bodies(log, ev.DeadLettered)
