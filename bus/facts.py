"""What is a fact of a run: the rules every consumer and every reader of the log apply before
they believe an event (docs/events.md, "Subjects")."""

from __future__ import annotations

from jetrl.bus import events as ev
from jetrl.bus import ids, subjects


def spoofed(run_id: str, subject: str, event: ev.Event) -> str | None:
    """Why ``event``, read on ``subject`` of run ``run_id``'s log, is not a fact of that run,
    else None. Every event has one subject, derived from its envelope and body
    (:func:`subjects.subject_for`); NATS permissions bind a tenant's credential to its subjects,
    so an event on another subject than its own names another run, tenant, environment, worker
    or kind than the one that published it (a tenant's StepCompleted on its rollout subject).
    Consumers dead-letter such events; a reader of the log that does not consume skips them."""
    if event.run_id != run_id:
        return f"envelope run {event.run_id!r} on run {run_id!r}"
    sub_tenant = subjects.tenant_of(subject)
    if sub_tenant is not None and sub_tenant != event.tenant:
        return f"envelope tenant {event.tenant!r} published under tenant {sub_tenant!r}"
    try:
        own = subjects.subject_for(event)
    except (subjects.InvalidName, TypeError) as exc:
        return f"{event.type} has no valid subject: {exc}"
    legacy = isinstance(event.body, ev.DeadLettered) and subjects.is_legacy_dead_letter(subject)
    if own != subject and not legacy:
        return f"a {event.type} belongs on {own}, not {subject}"
    return foreign_id(event)


_ENTITY_IDS = ("task_id", "group_id", "generation_id", "rollout_id")


def foreign_id(event: ev.Event) -> str | None:
    """Entity ids name their environment and tenant (bus/ids.py): a tenant's event that names
    another's task or rollout (to have it counted as trained, say) is refused."""
    b = event.body
    env = getattr(b, "env", None)
    if env is None or isinstance(b, ev.EvaluationReported):
        return None
    prefix = ids.task_prefix(env, event.tenant)
    # The ids of a generation's samples and of a group's rollouts are entity ids too.
    members: tuple[object, ...] = ()
    if isinstance(b, ev.CompletionsGenerated):
        members = tuple(b.samples)
    elif isinstance(b, ev.RolloutsScored):
        members = tuple(b.rollouts)
    for holder in (b, *members):
        for name in _ENTITY_IDS:
            value = getattr(holder, name, None)
            if isinstance(value, str) and not value.startswith(prefix):
                return f"{name} {value!r} is not of environment {env!r} of tenant {event.tenant!r}"
    return None


def rejecting_tenant(subject: str) -> str:
    """The tenant a dead letter of a message on ``subject`` goes to: the subject's (whose
    credential published it), or jetrl's for run-wide subjects."""
    t = subjects.tenant_of(subject)
    return t if t is not None and subjects.is_token(t) else subjects.RUN_TENANT
