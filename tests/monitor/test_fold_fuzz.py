"""Whatever the log holds, the fold never fails: records with odd values (unknown ids, steps out
of order, negative lengths, NaN and infinities, repeated positions, generations and groups of
no sample or of repeated ones) in any order, then the
snapshot, the series and the alert rules, which must stay JSON-ready."""

from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from jetrl.consumers.monitor.alerts import Alerts
from jetrl.consumers.monitor.series import MonitorState
from jetrl.consumers.monitor.settings import AlertSettings
from jetrl.store import readmodel as rec

ids = st.sampled_from(["a", "b", "c", "r1", "g1", ""])
small = st.integers(min_value=-3, max_value=6)
num = st.floats(allow_nan=True, allow_infinity=True)
seq = st.integers(min_value=0, max_value=60)
t = st.floats(min_value=0, max_value=1e6)
metrics = st.dictionaries(
    st.sampled_from(["loss", "mismatch_kl", "grad_norm", "entropy", "x"]), num, max_size=4
)

record = st.one_of(
    st.builds(rec.Started, seq, t, st.just({"trainer": {"max_off_policy_steps": "two"}})),
    st.builds(rec.Resumed, seq, t, st.just({"trainer": {"max_steps": -1}})),
    st.builds(rec.Finished, seq, t, st.sampled_from(["completed", "failed"]), small),
    st.builds(rec.Tasked, seq, t, ids, ids, small),
    st.builds(
        rec.Generated,
        seq,
        t,
        ids,
        ids,
        st.lists(
            st.builds(
                rec.GeneratedSample,
                ids,
                small,
                st.sampled_from(["stop", "length", "error", ""]),
                st.none() | small,
            ),
            max_size=4,
        ).map(tuple),
        num,
        num,
    ),
    st.builds(
        rec.Scored,
        seq,
        t,
        ids,
        ids,
        ids,
        st.lists(st.builds(rec.ScoredOne, ids, num, small, small), max_size=4).map(tuple),
    ),
    st.builds(rec.Withheld, seq, t, ids, ids),
    st.builds(rec.Stepped, seq, t, small, small, small, metrics, st.lists(ids, max_size=4).map(tuple)),
    st.builds(rec.Dead, seq, t, ids, ids),
    st.builds(rec.Beat, seq, t, ids, ids, st.sampled_from(["ready", "stopping"]), st.none() | small, small),
    st.builds(rec.Loaded, seq, t, ids, small),
    st.builds(rec.Alerted, seq, t, ids, ids, st.sampled_from(["firing", "resolved"]), ids, ids, small),
)


def _finite_json(x: object) -> object:
    return None if isinstance(x, float) and not math.isfinite(x) else x


@settings(max_examples=300, deadline=None)
@given(st.lists(record, max_size=40), t)
def test_the_fold_takes_any_records(records: list[rec.Fact], now: float) -> None:
    state = MonitorState("fuzz")
    alerts = Alerts(AlertSettings(reward_window=2))
    for r in sorted(records, key=lambda r: r.seq):
        state.apply(r)
        alerts.check(state, now)
    snap = state.snapshot(now)
    json.dumps(snap, default=_finite_json)
    for p in state.steps:
        assert set(p.scalars()) >= {"reward/mean", "trainer/loss", "staleness/mean"}
        json.dumps(p.as_json())
