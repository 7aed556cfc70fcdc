"""Subject layout of a run's log (docs/events.md).

    jetrl.<run>.run                          RunStarted, RunResumed, RunFinished
    jetrl.<run>.task.<tenant>.<env>          TaskSubmitted
    jetrl.<run>.generation.<tenant>.<env>    CompletionsGenerated
    jetrl.<run>.rollout.<tenant>.<env>       RolloutsScored, RolloutWithheld
    jetrl.<run>.step                         StepCompleted
    jetrl.<run>.policy                       PolicyVersionPublished
    jetrl.<run>.weights                      WeightsReady
    jetrl.<run>.worker.<kind>.<id>           WeightsLoaded, WorkerHeartbeat
    jetrl.<run>.dlq.<tenant>.<reason>        DeadLettered (tenant "jetrl": of a run-wide event)
    jetrl.<run>.eval.<tenant>.<env>          EvaluationReported
    jetrl.<run>.alert.<rule>                 AlertRaised

Run, tenant, environment, worker kind and id are single subject tokens, so NATS wildcards and
permissions (``jetrl.<run>.*.<tenant>.>``) can filter and isolate them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Protocol, cast

from jetrl.bus import events as ev

ROOT = "jetrl"
RUN_TENANT = "jetrl"  # the tenant token of dead letters of run-wide events (never a tenant's name)
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class InvalidName(ValueError):
    pass


_valid: set[str] = set()


def check_token(value: str, what: str) -> str:
    if value in _valid:  # hot path: the same few tokens are checked for every event
        return value
    if not _TOKEN.match(value):
        raise InvalidName(f"{what} {value!r} is not a valid subject token: use 1-64 of A-Z a-z 0-9 _ -")
    if len(_valid) < 4096:  # bounded: a process that sees many run ids must not grow forever
        _valid.add(value)
    return value


def is_token(value: str) -> bool:
    return value in _valid or bool(_TOKEN.match(value))


def run_prefix(run_id: str) -> str:
    return f"{ROOT}.{check_token(run_id, 'run id')}"


def all_subjects(run_id: str) -> str:
    return f"{run_prefix(run_id)}.>"


def run_subject(run_id: str) -> str:
    return f"{run_prefix(run_id)}.run"


def task_subject(run_id: str, tenant: str = "*", env: str = "*") -> str:
    return _scoped(run_id, "task", tenant, env)


def generation_subject(run_id: str, tenant: str = "*", env: str = "*") -> str:
    return _scoped(run_id, "generation", tenant, env)


def rollout_subject(run_id: str, tenant: str = "*", env: str = "*") -> str:
    return _scoped(run_id, "rollout", tenant, env)


def eval_subject(run_id: str, tenant: str = "*", env: str = "*") -> str:
    return _scoped(run_id, "eval", tenant, env)


def step_subject(run_id: str) -> str:
    return f"{run_prefix(run_id)}.step"


def policy_subject(run_id: str) -> str:
    return f"{run_prefix(run_id)}.policy"


def weights_subject(run_id: str) -> str:
    return f"{run_prefix(run_id)}.weights"


def worker_subject(run_id: str, kind: str = "*", worker_id: str = "*") -> str:
    kind_tok = _tok_or_wild(kind, "worker kind")
    return f"{run_prefix(run_id)}.worker.{kind_tok}.{_tok_or_wild(worker_id, 'worker id')}"


def dlq_subject(run_id: str, tenant: str = "*", reason: str = "*") -> str:
    """Dead letters under the tenant whose subject the original came on, so that a tenant reads
    its own rejections (and only those); ``jetrl`` for run-wide subjects."""
    return _scoped(run_id, "dlq", tenant, reason, second="dead-letter reason")


def all_dlq_subjects(run_id: str) -> str:
    """Every dead letter of the run, including those of logs written before dead letters had a
    tenant token (``jetrl.<run>.dlq.<reason>``)."""
    return f"{run_prefix(run_id)}.dlq.>"


def alert_subject(run_id: str, rule: str = "*") -> str:
    return f"{run_prefix(run_id)}.alert.{_tok_or_wild(rule, 'alert rule')}"


def _tok_or_wild(value: str, what: str) -> str:
    return value if value in ("*", ">") else check_token(value, what)


def _scoped(run_id: str, kind: str, tenant: str, env: str, second: str = "env") -> str:
    return f"{run_prefix(run_id)}.{kind}.{_tok_or_wild(tenant, 'tenant')}.{_tok_or_wild(env, second)}"


class _OfEnv(Protocol):
    """A body published under its tenant and environment (TaskSubmitted, ... RolloutWithheld)."""

    @property
    def env(self) -> str: ...


class _OfWorker(Protocol):
    """A body a worker publishes under its id (WeightsLoaded, WorkerHeartbeat)."""

    @property
    def worker_id(self) -> str: ...


def _scoped_event(kind: str) -> Callable[[ev.Event], str]:
    def subject(e: ev.Event) -> str:
        env = cast(_OfEnv, e.body).env  # _SUBJECT_OF maps only such bodies here
        return _scoped(e.run_id, kind, check_token(e.tenant, "tenant"), check_token(env, "env"))

    return subject


def _worker_event(e: ev.Event) -> str:
    b = e.body
    kind = b.kind if isinstance(b, ev.WorkerHeartbeat) else "inference"
    worker_id = cast(_OfWorker, b).worker_id
    return worker_subject(e.run_id, check_token(kind, "worker kind"), check_token(worker_id, "worker id"))


# A dict lookup by body class: this runs once per published event.
_SUBJECT_OF: dict[type[ev.EventBody], Callable[[ev.Event], str]] = {
    ev.RunStarted: lambda e: run_subject(e.run_id),
    ev.RunResumed: lambda e: run_subject(e.run_id),
    ev.RunFinished: lambda e: run_subject(e.run_id),
    ev.TaskSubmitted: _scoped_event("task"),
    ev.CompletionsGenerated: _scoped_event("generation"),
    ev.RolloutsScored: _scoped_event("rollout"),
    ev.RolloutWithheld: _scoped_event("rollout"),
    ev.EvaluationReported: _scoped_event("eval"),
    ev.StepCompleted: lambda e: step_subject(e.run_id),
    ev.PolicyVersionPublished: lambda e: policy_subject(e.run_id),
    ev.WeightsReady: lambda e: weights_subject(e.run_id),
    ev.AlertRaised: lambda e: alert_subject(e.run_id, cast(ev.AlertRaised, e.body).rule),
    ev.WeightsLoaded: _worker_event,
    ev.WorkerHeartbeat: _worker_event,
    ev.DeadLettered: lambda e: dlq_subject(
        e.run_id,
        check_token(e.tenant, "tenant"),
        check_token(cast(ev.DeadLettered, e.body).reason, "dead-letter reason"),
    ),
}

# The tenant-scoped kinds: the fourth token of their subjects is the tenant.
TENANT_KINDS = ("task", "generation", "rollout", "eval", "dlq")


def subject_for(event: ev.Event) -> str:
    """The one subject an event is published on, derived from its envelope and body."""
    fn = _SUBJECT_OF.get(type(event.body))
    if fn is None:
        raise TypeError(f"no subject for event type {event.type}")
    return fn(event)


def tenant_of(subject: str) -> str | None:
    """The tenant token of a tenant-scoped subject, else None (used to catch spoofed events)."""
    parts = subject.split(".")
    if len(parts) == 5 and parts[2] in TENANT_KINDS:
        return parts[3]
    return None


def is_legacy_dead_letter(subject: str) -> bool:
    """A dead letter of a log written before they carried a tenant (``jetrl.<run>.dlq.<reason>``)."""
    parts = subject.split(".")
    return len(parts) == 4 and parts[2] == "dlq"
