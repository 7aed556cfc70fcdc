"""The invariants every finished run keeps, checked from its log (the end-to-end tests share
them: one machine, parts started anywhere, hosts in network namespaces)."""

from __future__ import annotations

from collections import Counter

from jetrl.bus import events as ev
from tests.support.runlog import bodies


def assert_run_invariants(log: list[ev.Event], *, steps: int, rollouts_per_step: int, max_off: int) -> None:
    # Versions are monotone, one per step, each with a checksum.
    published = bodies(log, ev.PolicyVersionPublished)
    assert [p.version for p in published] == list(range(steps + 1))
    assert all(len(p.weights_checksum) == 64 for p in published)
    done = bodies(log, ev.StepCompleted)
    assert [s.step for s in done] == list(range(steps))
    assert [s.policy_version for s in done] == list(range(1, steps + 1))
    assert [s.final for s in done] == [False] * (steps - 1) + [True], "the last step, and only it, is final"

    # Every trained rollout was scored exactly once and trained in exactly one step.
    scored = Counter(r.rollout_id for r in bodies(log, ev.RolloutScored))
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

    # Staleness is within the bound for every trained rollout.
    start_version = {r.rollout_id: r.policy_version_start for r in bodies(log, ev.RolloutScored)}
    for s in done:
        for rid in s.rollout_ids:
            assert 0 <= s.step - start_version[rid] <= max_off

    # Workers loaded the weights they announced; the run is framed by RunStarted/RunFinished.
    assert bodies(log, ev.WeightsLoaded), "no worker reported loading weights"
    assert bodies(log, ev.RunStarted)[0].config["trainer"]["max_steps"] == steps
    assert bodies(log, ev.RunFinished)[-1].status == "completed"
    assert not bodies(log, ev.DeadLettered)
