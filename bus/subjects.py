"""Subject layout of a run's log (docs/events.md).

    jetrl.<run>.run                          RunStarted, RunFinished
    jetrl.<run>.task.<tenant>.<env>          TaskSubmitted
    jetrl.<run>.generation.<tenant>.<env>    GenerationCompleted
    jetrl.<run>.rollout.<tenant>.<env>       RolloutScored, RolloutWithheld
    jetrl.<run>.step                         StepCompleted
    jetrl.<run>.policy                       PolicyVersionPublished
    jetrl.<run>.weights                      WeightsReady
    jetrl.<run>.worker.<kind>.<id>           WeightsLoaded, WorkerHeartbeat
    jetrl.<run>.dlq.<reason>                 DeadLettered

Run, tenant, environment, worker kind and id are single subject tokens, so NATS wildcards and
permissions (``jetrl.<run>.*.<tenant>.>``) can filter and isolate them.
"""

from __future__ import annotations

import re

from jetrl.bus import events as ev

ROOT = "jetrl"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class InvalidName(ValueError):
    pass


def check_token(value: str, what: str) -> str:
    if not _TOKEN.match(value):
        raise InvalidName(f"{what} {value!r} is not a valid subject token: use 1-64 of A-Z a-z 0-9 _ -")
    return value


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


def step_subject(run_id: str) -> str:
    return f"{run_prefix(run_id)}.step"


def policy_subject(run_id: str) -> str:
    return f"{run_prefix(run_id)}.policy"


def weights_subject(run_id: str) -> str:
    return f"{run_prefix(run_id)}.weights"


def worker_subject(run_id: str, kind: str = "*", worker_id: str = "*") -> str:
    kind_tok = _tok_or_wild(kind, "worker kind")
    return f"{run_prefix(run_id)}.worker.{kind_tok}.{_tok_or_wild(worker_id, 'worker id')}"


def dlq_subject(run_id: str, reason: str = "*") -> str:
    return f"{run_prefix(run_id)}.dlq.{_tok_or_wild(reason, 'dead-letter reason')}"


def _tok_or_wild(value: str, what: str) -> str:
    return value if value in ("*", ">") else check_token(value, what)


def _scoped(run_id: str, kind: str, tenant: str, env: str) -> str:
    return f"{run_prefix(run_id)}.{kind}.{_tok_or_wild(tenant, 'tenant')}.{_tok_or_wild(env, 'env')}"


def subject_for(event: ev.Event) -> str:
    """The one subject an event is published on, derived from its envelope and body."""
    b = event.body
    run, tenant = event.run_id, event.tenant
    match b:
        case ev.RunStarted() | ev.RunFinished():
            return run_subject(run)
        case ev.TaskSubmitted():
            return task_subject(run, check_token(tenant, "tenant"), check_token(b.env, "env"))
        case ev.GenerationCompleted():
            return generation_subject(run, check_token(tenant, "tenant"), check_token(b.env, "env"))
        case ev.RolloutScored() | ev.RolloutWithheld():
            return rollout_subject(run, check_token(tenant, "tenant"), check_token(b.env, "env"))
        case ev.StepCompleted():
            return step_subject(run)
        case ev.PolicyVersionPublished():
            return policy_subject(run)
        case ev.WeightsReady():
            return weights_subject(run)
        case ev.WeightsLoaded():
            return worker_subject(run, "inference", check_token(b.worker_id, "worker id"))
        case ev.WorkerHeartbeat():
            return worker_subject(
                run, check_token(b.kind, "worker kind"), check_token(b.worker_id, "worker id")
            )
        case ev.DeadLettered():
            return dlq_subject(run, check_token(b.reason, "dead-letter reason"))
    raise TypeError(f"no subject for event type {event.type}")


def tenant_of(subject: str) -> str | None:
    """The tenant token of a tenant-scoped subject, else None (used to catch spoofed events)."""
    parts = subject.split(".")
    if len(parts) == 5 and parts[2] in ("task", "generation", "rollout"):
        return parts[3]
    return None
