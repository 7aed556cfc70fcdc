"""Table specs of the projection: each table's key and the groups of columns that one kind of
event writes, with the sequence column that guards each group (docs/store.md, "How the recorder
stays exact"). The fold (store/projection.py) and the SQL upserts are both built from these.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa

from jetrl.store import schema as sc
from jetrl.store.derived import Coalesce, Col, Derived, Minus

__all__ = [
    "ALERTS",
    "DEAD_LETTERS",
    "EVALUATIONS",
    "GENERATIONS",
    "POLICY_VERSIONS",
    "ROLLOUTS",
    "RUNS",
    "SPECS",
    "STALENESS",
    "STEPS",
    "STEP_ROLLOUTS",
    "TASKS",
    "WORKERS",
    "Group",
    "Spec",
]


@dataclass(frozen=True)
class Group:
    """Columns written together by one kind of event, guarded by ``seq_col``. ``follows``: the
    event comes after the one that makes the row (a rollout is trained or withheld after it
    was scored), so on SQLite the group is written as an UPDATE of the row, with the upsert
    only where there is none yet (store/projection.py, :class:`TableWriter`)."""

    seq_col: str
    cols: tuple[str, ...]
    mode: Literal["first", "last"]
    follows: bool = False


@dataclass(frozen=True, eq=False)  # one module-level object per table: hashed by identity
class Spec:
    table: sa.Table
    key: tuple[str, ...]
    groups: tuple[Group, ...] = ()  # none: the row is one fact, first one wins (DO NOTHING)
    # Columns computed from other columns after the groups are merged (Python and SQL alike).
    derived: tuple[Derived, ...] = ()

    @functools.cached_property
    def columns(self) -> tuple[str, ...]:  # read for every new row folded: built once
        return tuple(c.name for c in self.table.columns)

    @functools.cached_property
    def groups_by_seq(self) -> dict[str, Group]:
        return {g.seq_col: g for g in self.groups}

    @functools.cached_property
    def _empty(self) -> dict[str, Any]:
        return dict.fromkeys(self.columns)

    def empty_row(self, key: tuple[Any, ...]) -> dict[str, Any]:
        """A row of this table with only its key set."""
        row = self._empty.copy()
        row.update(zip(self.key, key, strict=True))
        return row


_T = sc.Base.metadata.tables

# How far behind the trainer a rollout's policy was: the step that trained it minus the version
# it started from, else (never trained) the staleness its withheld event gave.
STALENESS = Derived(
    "staleness",
    Coalesce(Minus(Col("trained_step"), Col("policy_version_start")), Col("withheld_staleness")),
)
RUNS = Spec(
    _T["runs"],
    ("run_id",),
    (
        Group(
            "started_seq",
            (
                "tenant",
                "config",
                "code_version",
                "host",
                "library_versions",
                "started_at",
                "started_event_id",
            ),
            "first",
        ),
        Group("finished_seq", ("status", "steps", "finish_reason", "finished_at"), "last"),
    ),
)
TASKS = Spec(_T["tasks"], ("run_id", "task_id"))
GENERATIONS = Spec(_T["generations"], ("run_id", "generation_id"))
ROLLOUTS = Spec(
    _T["rollouts"],
    ("run_id", "rollout_id"),
    (
        Group(
            "scored_seq",
            (
                "tenant",
                "env",
                "group_id",
                "task_id",
                "generation_event_id",
                "sample_index",
                "group_size",
                "group_late",
                "reward",
                "reward_parts",
                "policy_version_start",
                "policy_version_end",
                "prompt_tokens",
                "completion_tokens",
                "payloads",
                "scored_at",
                "scored_event_id",
            ),
            "first",
        ),
        Group(
            "withheld_seq",
            (
                "withheld_reason",
                "withheld_detail",
                "withheld_step",
                "withheld_policy_version",
                "withheld_staleness",
                "withheld_at",
            ),
            "first",
            follows=True,
        ),
        Group("trained_seq", ("trained_step", "train_position"), "first", follows=True),
    ),
    derived=(STALENESS,),
)
STEP_ROLLOUTS = Spec(_T["step_rollouts"], ("run_id", "step", "position"))
STEPS = Spec(_T["steps"], ("run_id", "step"))
POLICY_VERSIONS = Spec(
    _T["policy_versions"],
    ("run_id", "version"),
    (
        Group("published_seq", ("step", "weights_checksum", "parent_version", "published_at"), "first"),
        Group(
            "ready_seq",
            (
                "location",
                "location_store",
                "location_uri",
                "size",
                "sha256",
                "format",
                "ready_checksum",
                "blake3",
                "ready_at",
            ),
            "first",
        ),
    ),
)
WORKERS = Spec(
    _T["workers"],
    ("run_id", "worker_id"),
    (
        Group("heartbeat_seq", ("kind", "status", "inflight", "stats", "last_heartbeat_at"), "last"),
        Group("loaded_seq", ("loaded_version", "loaded_at"), "last"),
        Group("load_seq", ("last_load_s", "checksum_verified"), "last"),
    ),
)
DEAD_LETTERS = Spec(_T["dead_letters"], ("run_id", "event_id"))
EVALUATIONS = Spec(_T["evaluations"], ("run_id", "tenant", "env", "policy_version"))
ALERTS = Spec(_T["alerts"], ("run_id", "event_id"))

# Write order of a batch; any order gives the same rows, a fixed one keeps lock order stable.
SPECS: tuple[Spec, ...] = (
    RUNS,
    TASKS,
    GENERATIONS,
    ROLLOUTS,
    STEP_ROLLOUTS,
    STEPS,
    POLICY_VERSIONS,
    WORKERS,
    DEAD_LETTERS,
    EVALUATIONS,
    ALERTS,
)
