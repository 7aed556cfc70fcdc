"""Read side of the store, for the rest of jetrl (CLI, replay, supervisor, monitor): one module per
read model (runs, steps, scopes, fleet, evaluations, alerts, tenants), all of them here.

Every function takes a :class:`~jetrl.store.db.Store` or an open ``Connection`` and returns
plain frozen dataclasses, so callers never depend on the schema's columns directly.
"""

from __future__ import annotations

from jetrl.store.queries.alerts import AlertRow, alert_counts, alerts
from jetrl.store.queries.evaluations import EvaluationRow, evaluation_summary, evaluations
from jetrl.store.queries.fleet import (
    DeadLetterRow,
    PolicyVersionRow,
    WorkerRow,
    dead_letters,
    latest_policy_version,
    policy_versions,
    workers,
)
from jetrl.store.queries.runs import RunSummary, list_runs, recorded_seq, run_summary
from jetrl.store.queries.scopes import ScopeStats, env_stats, scope_stats, tenant_stats
from jetrl.store.queries.steps import StepRolloutRow, StepRow, step_history, step_rollouts
from jetrl.store.queries.tenants import TenantSummary, tenant_summaries, tenant_summary
from jetrl.store.readmodel.evaluations import EvaluationSummary, summarize_evaluations

__all__ = [
    "AlertRow",
    "DeadLetterRow",
    "EvaluationRow",
    "EvaluationSummary",
    "PolicyVersionRow",
    "RunSummary",
    "ScopeStats",
    "StepRolloutRow",
    "StepRow",
    "TenantSummary",
    "WorkerRow",
    "alert_counts",
    "alerts",
    "dead_letters",
    "env_stats",
    "evaluation_summary",
    "evaluations",
    "latest_policy_version",
    "list_runs",
    "policy_versions",
    "recorded_seq",
    "run_summary",
    "scope_stats",
    "step_history",
    "step_rollouts",
    "summarize_evaluations",
    "tenant_stats",
    "tenant_summaries",
    "tenant_summary",
    "workers",
]
