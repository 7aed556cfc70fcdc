"""Every id of a run, built and parsed here and nowhere else (docs/events.md, "Ids").

Entity ids are readable strings that say what they belong to:

=================  ===================================  =====================================
id                 format                               example
=================  ===================================  =====================================
task (turn 0)      ``<env>.<tenant>.<n>``               ``modsum.default.41``
task (gateway)     ``<env>.<tenant>.<hex>``             ``gateway.default.9f2c...``
task (turn k > 0)  ``<generation id>.t<k>``             ``chat.default.3-1.t1``
task (evaluation)  ``<env>.<tenant>.eval.v<version>.n<i>``  ``modsum.default.eval.v4.n2``
group              the turn-0 task's id
generation         ``<task id>-<sample index>``         ``modsum.default.41-7``
rollout            ``<group id>-<sample index>``        ``modsum.default.41-7``
=================  ===================================  =====================================

Event ids of facts are *derived* (:func:`derived_id`): a fact published twice, by a retry or a
restarted process, gets the same id, and the stream's duplicate window stores it once.
"""

from __future__ import annotations

import uuid

# ---------------------------------------------------------------------- entity ids


def task_prefix(env: str, tenant: str) -> str:
    """What every task, group and rollout id of one environment producer starts with."""
    return f"{env}.{tenant}."


def task_id(env: str, tenant: str, n: int | str) -> str:
    """A producer's ``n``-th task (a group's first turn), or a gateway request's (``n`` hex)."""
    return f"{task_prefix(env, tenant)}{n}"


def task_number(task: str) -> str:
    """The last part of a turn-0 task id: the producer's counter, or the gateway's hex."""
    return task.rsplit(".", 1)[1]


def eval_task_id(env: str, tenant: str, version: int, n: int) -> str:
    """The ``n``-th held-out task of the evaluation of ``version``: its own namespace, never a
    producer's counter, so it is never counted in the producer's window or trained on."""
    return f"{task_prefix(env, tenant)}eval.v{version}.n{n}"


def is_eval_task(task: str) -> bool:
    """Whether a task id (any turn) belongs to an evaluation. Env and tenant are single tokens,
    so the third dotted part is ``eval`` for evaluations only (a counter, hex or ``<n>-<i>``
    elsewhere)."""
    return task.split(".")[2:3] == ["eval"]


def turn_task_id(generation: str, turn: int) -> str:
    """The task of an episode's turn ``turn``, following the generation of the turn before."""
    return f"{generation}.t{turn}"


def generation_id(task: str, sample_index: int) -> str:
    return f"{task}-{sample_index}"


def rollout_id(group: str, sample_index: int) -> str:
    return f"{group}-{sample_index}"


def group_of(rollout: str) -> str:
    return rollout.rsplit("-", 1)[0]


# ---------------------------------------------------------------------- event ids


def derived_id(run_id: str, what: str) -> str:
    """The event id of a fact named by what it is about (``step/12``, ``task/<id>``):
    ``uuid5(NAMESPACE_URL, "<run>/<what>").hex``."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{run_id}/{what}").hex


def run_started_id(run_id: str) -> str:
    return derived_id(run_id, "started")


def run_resumed_id(run_id: str, after_seq: int) -> str:
    """One resume per position in the log: a retried publish is stored once."""
    return derived_id(run_id, f"resumed/{after_seq}")


def run_finished_id(run_id: str, status: str, steps: int, since: int) -> str:
    """``since``: the log position of the RunStarted or RunResumed it ends (a resumed run that
    ends as before ends anew)."""
    return derived_id(run_id, f"finished/{status}/{steps}/{since}")


def task_event_id(run_id: str, task: str) -> str:
    return derived_id(run_id, f"task/{task}")


def generation_event_id(run_id: str, task_event_id: str) -> str:
    """From the task's event id: a task redelivered to another worker yields the same id."""
    return derived_id(run_id, f"gen/{task_event_id}")


def scored_event_id(run_id: str, generation_event_id: str) -> str:
    return derived_id(run_id, f"scored/{generation_event_id}")


def withheld_event_id(run_id: str, rollout: str) -> str:
    return derived_id(run_id, f"withheld/{rollout}")


def step_event_id(run_id: str, step: int) -> str:
    return derived_id(run_id, f"step/{step}")


def policy_event_id(run_id: str, version: int) -> str:
    return derived_id(run_id, f"policy/{version}")


def weights_event_id(run_id: str, version: int, *, again: str | None = None) -> str:
    """``again``: the weights announced anew (a restarted writer's), named by where they lie."""
    return derived_id(run_id, f"weights/{version}" if again is None else f"weights/{version}/again/{again}")


def loaded_event_id(run_id: str, worker_id: str, version: int) -> str:
    return derived_id(run_id, f"loaded/{worker_id}/{version}")


def evaluation_event_id(run_id: str, tenant: str, env: str, version: int) -> str:
    """One report per environment producer and evaluated version: a restart re-sends the same."""
    return derived_id(run_id, f"eval/{tenant}/{env}/{version}")


def episode_payload_id(run_id: str, rollout: str) -> str:
    """Names the payload objects of a multi-turn episode's rollout."""
    return derived_id(run_id, f"episode/{rollout}")


def dead_letter_id(run_id: str, consumer: str, stream_seq: int) -> str:
    """One per consumer and poisoned message: a dead letter re-sent after a crash is stored once."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"dlq/{run_id}/{consumer}/{stream_seq}").hex


def alert_event_id(run_id: str, rule: str, key: str, state: str, step: int) -> str:
    """One per alert transition and trainer step: monitors watching the same run raise it once."""
    return derived_id(run_id, f"alert/{rule}/{key}/{state}/{step}")
