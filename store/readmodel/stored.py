"""The facts of a recorded run, read back from its store: what store/projectors.py wrote, undone.

A run's store gives the facts its log gives (tests/store/test_readmodel.py holds the two
equal), so a fold never knows which one it reads. Where the store keeps only the latest state,
it gives only that: a worker's last heartbeat and loaded version, the run's last start or
finish (a resume leaves no fact of its own).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import sqlalchemy as sa

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.store import schema as sc
from jetrl.store.readmodel.facts import (
    Alerted,
    Beat,
    Dead,
    Evaluated,
    Fact,
    Finished,
    Generated,
    GeneratedSample,
    Loaded,
    Ready,
    Scored,
    ScoredOne,
    Started,
    Stepped,
    Tasked,
    Versioned,
    Withheld,
)

__all__ = ["facts_of_store"]


def _float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan  # the store keeps NaN and infinities as strings (JSON has none)


def _floats(d: Mapping[str, Any] | None) -> dict[str, float]:
    return {k: _float(v) for k, v in (d or {}).items()}


def _number(v: float | None) -> float:
    return math.nan if v is None else v  # a NaN is stored as NULL


def _payload_ref(loc: Mapping[str, Any]) -> ev.PayloadRef:
    shape = loc.get("shape")
    return ev.PayloadRef(
        store=loc["store"],
        bucket=loc["bucket"],
        name=loc["name"],
        size=loc["size"],
        sha256=loc["sha256"],
        dtype=loc.get("dtype"),
        shape=None if shape is None else tuple(shape),
    )


def facts_of_store(conn: sa.Connection, run_id: str) -> Iterator[Fact]:
    """The facts of a recorded run, in log order, from its rows."""

    def rows(model: type[sc.Base], *where: sa.ColumnElement[bool]) -> Any:
        t = sc.table_of(model)
        return conn.execute(sa.select(t).where(t.c.run_id == run_id, *where)).mappings()

    out: list[Fact] = []
    for r in rows(sc.Run):
        if r["started_seq"] is not None:
            out.append(
                Started(
                    r["started_seq"],
                    r["started_at"],
                    dict(r["config"] or {}),
                    dict(r["library_versions"] or {}),
                    tenant=r["tenant"] or "",
                    event_id=r["started_event_id"] or "",
                    code_version=r["code_version"] or "",
                    host=r["host"] or "",
                )
            )
        if r["finished_seq"] is not None and r["status"] != "running":  # not resumed since
            out.append(
                Finished(
                    r["finished_seq"],
                    r["finished_at"],
                    r["status"],
                    r["steps"] or 0,
                    reason=r["finish_reason"] or "",
                    tenant=r["tenant"] or "",
                )
            )
    for r in rows(sc.Task):
        out.append(
            Tasked(
                r["seq"],
                r["submitted_at"],
                r["tenant"],
                r["env"],
                r["group_size"],
                task_id=r["task_id"],
                event_id=r["event_id"],
                prompt_len=r["prompt_len"],
                prompt_text=r["prompt_text"],
                max_tokens=r["max_tokens"],
                episode_id=r["episode_id"],
                turn=r["turn"],
                info=r["info"],
            )
        )
    # A generation's rows are its samples, a scored group's its rollouts: one fact each.
    gens: dict[int, list[Any]] = {}
    for r in rows(sc.Generation):
        gens.setdefault(r["seq"], []).append(r)
    for seq, samples in gens.items():
        samples.sort(key=lambda x: x["sample_index"])
        r = samples[0]
        out.append(
            Generated(
                seq,
                r["completed_at"],
                r["event_id"],
                r["worker_id"],
                tuple(
                    GeneratedSample(
                        x["generation_id"], x["sample_index"], x["finish_reason"], x["completion_tokens"]
                    )
                    for x in samples
                ),
                r["load_wait_s"],
                r["generate_s"],
                task_id=r["task_id"],
                tenant=r["tenant"],
                env=r["env"],
                version_start=r["policy_version_start"],
                version_end=r["policy_version_end"],
                prompt_length=r["prompt_tokens"],
                queued_s=r["queued_s"],
                episode_id=r["episode_id"],
                turn=r["turn"],
            )
        )
    rt = sc.table_of(sc.Rollout)
    groups: dict[int, list[Any]] = {}
    for r in rows(sc.Rollout, rt.c.scored_seq.is_not(None)):
        groups.setdefault(r["scored_seq"], []).append(r)
    for seq, members in groups.items():
        members.sort(key=lambda x: x["sample_index"])
        r = members[0]
        out.append(
            Scored(
                seq,
                r["scored_at"],
                r["tenant"],
                r["env"],
                r["generation_event_id"],
                tuple(
                    ScoredOne(
                        x["rollout_id"],
                        x["reward"],
                        x["policy_version_start"],
                        x["completion_tokens"],
                        sample_index=x["sample_index"],
                        version_end=x["policy_version_end"],
                        reward_parts=_floats(x["reward_parts"]),
                        payloads=dict(x["payloads"] or {}),
                    )
                    for x in members
                ),
                event_id=r["scored_event_id"],
                task_id=r["task_id"],
                group_id=r["group_id"],
                group_size=r["group_size"],
                prompt_length=r["prompt_tokens"],
                late=r["group_late"] or 0,
            )
        )
    for r in rows(sc.Rollout, rt.c.withheld_seq.is_not(None)):
        out.append(
            Withheld(
                r["withheld_seq"],
                r["withheld_at"],
                r["rollout_id"],
                r["withheld_reason"],
                tenant=r["tenant"] or "",
                env=r["env"] or "",
                group_id=r["group_id"] or "",
                step=r["withheld_step"],
                policy_version=r["withheld_policy_version"],
                staleness=r["withheld_staleness"],
                detail=r["withheld_detail"],
            )
        )
    srt = sc.table_of(sc.StepRollout)
    placed: dict[int, list[tuple[str, int | None]]] = {}
    for r in conn.execute(
        sa.select(srt.c.step, srt.c.rollout_id, srt.c.rollout_seq)
        .where(srt.c.run_id == run_id)
        .order_by(srt.c.position)
    ):
        placed.setdefault(r.step, []).append((r.rollout_id, r.rollout_seq))
    for r in rows(sc.Step):
        step = placed.get(r["step"], [])
        out.append(
            Stepped(
                r["seq"],
                r["completed_at"],
                r["step"],
                r["policy_version"],
                r["tokens"],
                _floats(r["metrics"]),
                tuple(rid for rid, _ in step),
                tuple(s for _, s in step if s is not None),  # the positions the step gave
                duration_s=r["duration_s"],
                event_id=r["event_id"],
                micro_batches=tuple(r["micro_batches"] or ()),
            )
        )
    pvt = sc.table_of(sc.PolicyVersion)
    for r in rows(sc.PolicyVersion, pvt.c.published_seq.is_not(None)):
        out.append(
            Versioned(
                r["published_seq"],
                r["published_at"],
                r["version"],
                r["step"],
                r["weights_checksum"],
                r["parent_version"],
            )
        )
    for r in rows(sc.PolicyVersion, pvt.c.ready_seq.is_not(None)):
        loc = _payload_ref(r["location"])
        out.append(
            Ready(
                r["ready_seq"],
                r["ready_at"],
                r["version"],
                loc,
                r["ready_checksum"],
                r["format"],
                r["blake3"],
            )
        )
    for r in rows(sc.Worker):
        # One heartbeat that reported the loaded version is one fact (one log position).
        same = r["loaded_seq"] is not None and r["loaded_seq"] == r["heartbeat_seq"]
        if r["heartbeat_seq"] is not None:
            out.append(
                Beat(
                    r["heartbeat_seq"],
                    r["last_heartbeat_at"],
                    r["worker_id"],
                    r["kind"],
                    r["status"] or "ready",
                    r["loaded_version"] if same else None,
                    r["inflight"] or 0,
                    dict(r["stats"] or {}),
                )
            )
        if not same and r["loaded_seq"] is not None and r["loaded_version"] is not None:
            loaded = r["load_seq"] == r["loaded_seq"]  # that WeightsLoaded's own figures
            out.append(
                Loaded(
                    r["loaded_seq"],
                    r["loaded_at"],
                    r["worker_id"],
                    r["loaded_version"],
                    r["kind"],
                    r["last_load_s"] if loaded else 0.0,
                    r["checksum_verified"] if loaded else True,
                )
            )
    for r in rows(sc.DeadLetter):
        out.append(
            Dead(
                r["seq"],
                r["dead_lettered_at"],
                subjects.tenant_of(r["original_subject"]) or subjects.RUN_TENANT,
                r["reason"],
                event_id=r["event_id"],
                detail=r["detail"],
                consumer=r["consumer"],
                original_subject=r["original_subject"],
                original_seq=r["original_seq"],
                original_type=r["original_type"],
                original_event_id=r["original_event_id"],
                delivery_count=r["delivery_count"],
                original_data=bytes(r["original_data"]),
            )
        )
    for r in rows(sc.Evaluation):
        out.append(
            Evaluated(
                r["seq"],
                r["reported_at"],
                r["tenant"],
                r["env"],
                r["policy_version"],
                r["samples"],
                r["pass_at_1"],
                r["pass_at_k"],
                n_tasks=r["n_tasks"],
                reward_mean=r["reward_mean"],
                version_min=r["version_min"],
                version_max=r["version_max"],
                temperature=r["temperature"],
                successes=tuple(r["successes"]),
                event_id=r["event_id"],
            )
        )
    for r in rows(sc.Alert):
        out.append(
            Alerted(
                r["seq"],
                r["raised_at"],
                r["rule"],
                r["key"],
                r["state"],
                r["severity"],
                r["message"],
                r["step"],
                value=_number(r["value"]),
                threshold=_number(r["threshold"]),
                event_id=r["event_id"],
            )
        )
    out.sort(key=lambda f: f.seq)
    yield from out
