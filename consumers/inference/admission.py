"""What an inference worker refuses at the edge, before anything is generated, per task.

A task that can never be generated is dead-lettered with a specific reason, on its tenant's
dead-letter subject (``jetrl.<run>.dlq.<tenant>.<reason>``: the tenant's rejection notice), so one
bad task neither crashes a worker nor fails the batch it would have joined:

* ``unknown_env``: its (tenant, env) pair is not one of the run's ``[[envs]]`` (when the run names
  them); env ``gateway`` is allowed for every tenant of the run and for ``default``;
* ``invalid_group``: group size below 1 or above :data:`MAX_GROUP`, or below 2 for the first turn
  of one of the run's training envs (a group of one has no group-relative advantage). Later turns
  of an episode, evaluations and the gateway's tasks have group size 1 legitimately;
* ``bad_tokens``: an empty prompt, or token ids outside the model's vocabulary (the embedding
  would index past its table);
* ``too_long``: prompt plus ``max(max_tokens, 1)`` past the model's context (the engine's
  ``limits``: vLLM's ``max_model_len`` when set);
* ``bad_params``: a non-finite or negative temperature, negative max tokens;
* ``future_version``: a ``min_policy_version`` more than :data:`FUTURE_VERSIONS` ahead of the newest
  WeightsReady seen. Waiting for it would hold a worker's batch for as long as the trainer takes
  (forever for a typo), so it is handed back with a delay instead, and dead-lettered once it has
  been delivered ``max_deliver`` times. Tasks asking for the next version or two still wait in
  their batch, as the synchronous mode needs.

Quotas (``[[tenants]] max_tasks_in_flight``): a delivery carries how many of its tenant's tasks
were still pending behind it on the tenant's consumer. A task is refused (``quota``) when that
count plus the tenant's tasks this worker already holds (buffered or generating) reaches the
quota: the tenant has more than its quota queued or generating. The refused are the oldest, so
that what is served is the freshest (a flood's head is stale by the time it would be reached, and
its producer reads each refusal at once instead of waiting on a silent queue). What other workers
hold is not seen, so with W workers a tenant may reach its quota plus what the W - 1 others hold
(at most a buffer and the batches in flight each) before the first refusal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jetrl.bus import events as ev
from jetrl.bus import ids
from jetrl.bus.log import get_logger
from jetrl.consumers.inference.engine import GenerationEngine, Limits
from jetrl.consumers.inference.settings import InferencePart
from jetrl.policy.tokenizer import tokenizer_for

log = get_logger(__name__)

MAX_GROUP = 4096
FUTURE_VERSIONS = 2  # versions ahead of the newest announced that a task may ask for
GATEWAY_ENV = "gateway"
DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Refusal:
    reason: str
    detail: str


def limits_for(part: InferencePart, engine: GenerationEngine) -> Limits:
    """The model's vocabulary and context: the engine's own (titan and vLLM know their model),
    else ``[model]``'s (importing torch, once), else the tokenizer's vocabulary and no context
    check."""
    if engine.limits is not None:
        return engine.limits
    vocab: int | None = None
    context: int | None = None
    try:
        from jetrl.policy.origin import model_config_of

        mcfg = model_config_of(part.model)
        vocab, context = mcfg.vocab_size, mcfg.max_seq_len
    except Exception as exc:  # an engine with its own model (a plugin) may name none we know
        log.warning("model_limits_unknown", error=repr(exc))
    if vocab is None:
        vocab = tokenizer_for(part.model).vocab_size
    return Limits(int(vocab), int(context) if context else None)


class Admission:
    def __init__(self, part: InferencePart, limits: Limits) -> None:
        self.limits = limits
        self.routes = {(r.tenant, r.env) for r in part.envs}
        self.tenants = {t.name for t in part.tenants} | {DEFAULT_TENANT}
        self.quotas = {t.name: t.max_tasks_in_flight for t in part.tenants if t.max_tasks_in_flight}

    def check(self, tenant: str, t: ev.TaskSubmitted) -> Refusal | None:
        """Why task ``t`` of ``tenant`` can never be generated, else None (cheapest checks first)."""
        gateway = t.env == GATEWAY_ENV and tenant in self.tenants
        training = (tenant, t.env) in self.routes
        if self.routes and not (training or gateway):
            return Refusal(
                "unknown_env", f"task {t.task_id}: env {t.env!r} of tenant {tenant!r} is not one of the run's"
            )
        if not 1 <= t.group_size <= MAX_GROUP:
            return Refusal(
                "invalid_group", f"task {t.task_id}: group_size {t.group_size} not in 1..{MAX_GROUP}"
            )
        first_turn = t.turn == 0 and t.episode is None and not ids.is_eval_task(t.task_id)
        if training and first_turn and t.group_size < 2:
            return Refusal("invalid_group", f"task {t.task_id}: a group of {t.group_size} has no advantage")
        if not math.isfinite(t.temperature) or t.temperature < 0:
            return Refusal("bad_params", f"task {t.task_id}: temperature {t.temperature}")
        if t.max_tokens < 0:
            return Refusal("bad_params", f"task {t.task_id}: max_tokens {t.max_tokens}")
        if not t.prompt_tokens:
            return Refusal("bad_tokens", f"task {t.task_id}: empty prompt")
        vocab = self.limits.vocab_size
        lo, hi = min(t.prompt_tokens), max(t.prompt_tokens)
        if lo < 0 or (vocab is not None and hi >= vocab):
            bad = lo if lo < 0 else hi
            return Refusal(
                "bad_tokens", f"task {t.task_id}: token id {bad} outside the vocabulary of {vocab}"
            )
        ctx = self.limits.max_context
        if ctx is not None and len(t.prompt_tokens) + max(t.max_tokens, 1) > ctx:
            return Refusal(
                "too_long",
                f"task {t.task_id}: {len(t.prompt_tokens)} prompt + {t.max_tokens} new tokens "
                f"past the context of {ctx}",
            )
        return None

    @staticmethod
    def too_far_ahead(t: ev.TaskSubmitted, latest: int | None) -> bool:
        """Whether ``t`` asks for a version so far past the newest announced (``latest``, None
        before any) that waiting on it would hold a batch indefinitely."""
        return t.min_policy_version > (-1 if latest is None else latest) + FUTURE_VERSIONS

    def over_quota(self, tenant: str, pending_behind: int, held: int) -> Refusal | None:
        quota = self.quotas.get(tenant)
        if quota is None or pending_behind + held < quota:
            return None
        return Refusal(
            "quota",
            f"tenant {tenant!r} has {pending_behind + held + 1} tasks queued or generating; "
            f"its quota is {quota}",
        )
