"""What the trainer refuses at its edge, and why (torch-free).

A RolloutsScored comes from a tenant's producer, which may run anywhere and be hostile. The
bus already dead-letters events that are undecodable or not on their own subject; these checks
cover what only the trainer knows: the run's environments, its model's context, vocabulary and
routing layout, and its current version. Each returns None or a ``(reason, detail)`` pair whose
reason is the dead-letter slug the producer reads on its own dead-letter subject.

Two stages: :func:`check_rollouts` needs only the event (admission, before the rollout is held);
:func:`check_read` looks at the arrays, which are read at step time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from jetrl.bus import events as ev
from jetrl.bus import ids
from jetrl.bus.settings import EnvRoute

Rejection = tuple[str, str]  # (reason slug, detail)

TOKEN_DTYPES = frozenset({"uint8", "uint16", "int32", "int64"})
FLOAT_DTYPES = frozenset({"float16", "float32", "float64"})  # bfloat16: numpy cannot read it
TRACE_DTYPES = TOKEN_DTYPES
MASK_DTYPES = frozenset({"uint8"})
# Rewards become float32 advantages (squared when std-scaled): far below float32's overflow.
MAX_ABS_REWARD = 1e9

# Reasons that condemn the rollout's whole group (its ids are the tenant's own, so the group is
# too); the other members are withheld as incomplete. Not "unknown_env"/"bad_ids": those name
# a group that is not the tenant's to spoil.
GROUP_REASONS = frozenset(
    {
        "invalid_group",
        "non_finite",
        "reward_range",
        "bad_version",
        "future_version",
        "bad_arrays",
        "bad_tokens",
        "too_long",
    }
)


@dataclass(frozen=True)
class ModelLimits:
    """What the trainer's model accepts."""

    max_seq_len: int  # prompt + completion tokens
    vocab_size: int  # token ids lie in [0, vocab_size)
    # (moe_layers, top_k, num_experts) when routing traces are read and replayed (an MoE model
    # with [trainer] replay on): every rollout needs one. None: traces are never read, except
    # that a dense model with replay on still reads one and refuses it.
    trace: tuple[int, int, int] | None = None
    replay: bool = True


RouteKey = tuple[str, str]  # (tenant, env)


def routes_by_key(routes: list[EnvRoute]) -> dict[RouteKey, EnvRoute]:
    return {(r.tenant, r.env): r for r in routes}


def check_rollouts(
    b: ev.RolloutsScored,
    tenant: str,
    *,
    routes: Mapping[RouteKey, EnvRoute],
    limits: ModelLimits,
    version: int,
    bucket: str | None = None,
) -> Rejection | None:
    """Why the rollouts of ``b`` (of ``tenant``: the envelope's, which the bus checked against
    the subject) cannot be trained at trainer version ``version``, else None: the event is
    refused whole. ``routes`` empty: any environment. ``bucket``: the run's payload bucket, the
    only one a reference may name."""
    route = routes.get((tenant, b.env))
    if routes and route is None:
        return "unknown_env", f"tenant {tenant!r} has no environment {b.env!r} in this run"
    # A tenant's ids are in its own namespace, so it cannot squat another's rollout or group ids
    # (the trainer's dedup sets and groups are keyed by them).
    prefix = ids.task_prefix(b.env, tenant)
    if not b.group_id.startswith(prefix) or not b.task_id.startswith(prefix):
        return "bad_ids", f"group {b.group_id!r} / task {b.task_id!r} outside the tenant's {prefix!r}"
    if b.group_size < 2:
        return "invalid_group", f"group_size {b.group_size} < 2: no group-relative advantage"
    # A group closed on its quorum: the generation's samples are its rollouts and the late ones.
    samples = b.group_size + len(b.late_samples)
    if route is not None and samples != route.group_size:
        late = f" and {len(b.late_samples)} late" if b.late_samples else ""
        return "invalid_group", f"group_size {b.group_size}{late}, the env's is {route.group_size}"
    if not b.rollouts:
        return "invalid_group", "no rollouts"
    indexes = [r.sample_index for r in b.rollouts]
    if len(set(indexes)) != len(indexes):
        return "invalid_group", f"sample indexes {indexes} repeat"
    # Its rollouts and late samples are then the generation's samples, each once.
    if b.late_samples and sorted([*indexes, *b.late_samples]) != list(range(samples)):
        return "invalid_group", f"late samples {b.late_samples[:16]} beside rollouts {indexes[:16]}"
    # The prompt is the event's, the same for each rollout: checked once.
    try:
        prompt: int | _Refused = _vector(b.prompt_tokens, "prompt_tokens", TOKEN_DTYPES, bucket)
    except _Refused as exc:
        prompt = exc
    for r in b.rollouts:
        rejection = _check_one(b, r, limits, version, bucket, prompt, samples)
        if rejection is not None:
            reason, detail = rejection
            return reason, f"rollout {r.rollout_id}: {detail}"
    return None


def _check_one(
    b: ev.RolloutsScored,
    r: ev.ScoredRollout,
    limits: ModelLimits,
    version: int,
    bucket: str | None,
    prompt: int | _Refused,
    samples: int,  # the generation's: the group's rollouts and its late samples
) -> Rejection | None:
    if r.rollout_id != ids.rollout_id(b.group_id, r.sample_index):
        return "bad_ids", f"rollout id {r.rollout_id!r} is not <group_id>-<sample_index>"
    if not 0 <= r.sample_index < samples:
        return "invalid_group", f"sample_index {r.sample_index} outside [0, {samples})"
    bad = [k for k, v in r.reward_parts.items() if not math.isfinite(v)]
    if not math.isfinite(r.reward) or bad:
        return "non_finite", f"reward {r.reward!r}, non-finite parts {bad}"
    if abs(r.reward) > MAX_ABS_REWARD:
        return "reward_range", f"|reward| {r.reward!r} > {MAX_ABS_REWARD:g}"
    start, end = r.policy_version_start, r.policy_version_end
    if start < 0 or start > end:
        return "bad_version", f"policy versions {start}..{end}"
    if end > version:
        return "future_version", f"policy version {end} does not exist yet (the trainer is at {version})"
    if isinstance(prompt, _Refused):
        return prompt.rejection
    try:
        _shapes(prompt, r, limits, bucket)
    except _Refused as exc:
        return exc.rejection
    return None


def check_member(group: ev.RolloutsScored, b: ev.RolloutsScored) -> Rejection | None:
    """``b`` against an event ``group`` already held of the same group."""
    if b.group_size != group.group_size:
        return "invalid_group", f"group_size {b.group_size}, its group's members say {group.group_size}"
    return None


class _Refused(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.rejection: Rejection = (reason, detail)


# The dtypes a rollout's arrays may have, with their sizes (looked up: ~1,000 arrays a step).
_ITEMSIZE = {d: np.dtype(d).itemsize for d in TOKEN_DTYPES | FLOAT_DTYPES}


def _declared(ref: ev.ArrayRef, what: str, bucket: str | None) -> tuple[str, tuple[int, ...]]:
    """The dtype and shape a reference declares (what get_array will return)."""
    dtype, shape = ref.dtype, ref.shape
    if dtype is None or shape is None:  # only a payload reference may lack them
        raise _Refused("bad_arrays", f"{what}: a blob reference without dtype/shape")
    itemsize = _ITEMSIZE.get(dtype)
    if itemsize is None or (shape and min(shape) < 0):
        raise _Refused("bad_arrays", f"{what}: {dtype}{list(shape)} cannot be read")
    if type(ref) is ev.LogArray:  # its bytes are where it points: checked when read
        return dtype, shape
    nbytes = math.prod(shape) * itemsize
    if isinstance(ref, ev.InlineArray) and len(ref.data) != nbytes:
        raise _Refused(
            "bad_arrays", f"{what}: {dtype}{list(shape)} needs {nbytes} bytes, carries {len(ref.data)}"
        )
    if isinstance(ref, ev.PayloadRef):
        if ref.size != nbytes:
            raise _Refused(
                "bad_arrays", f"{what}: {dtype}{list(shape)} needs {nbytes} bytes, refers to {ref.size}"
            )
        if bucket is not None and ref.bucket != bucket:
            raise _Refused("bad_arrays", f"{what}: refers to bucket {ref.bucket!r}, not the run's")
    return dtype, shape


def _vector(
    ref: ev.ArrayRef, what: str, dtypes: frozenset[str], bucket: str | None, length: int | None = None
) -> int:
    """The length of a 1-D array of one of ``dtypes`` (of ``length`` entries when given)."""
    dtype, shape = _declared(ref, what, bucket)
    if dtype not in dtypes or len(shape) != 1:
        raise _Refused("bad_arrays", f"{what}: {dtype}{list(shape)}, expected 1-D of {sorted(dtypes)}")
    if length is not None and shape[0] != length:
        raise _Refused("bad_arrays", f"{what}: {shape[0]} entries for {length} completion tokens")
    return shape[0]


def _shapes(p: int, r: ev.ScoredRollout, limits: ModelLimits, bucket: str | None) -> None:
    """``p``: the prompt's length (its declaration checked once an event)."""
    c = _vector(r.completion_tokens, "completion_tokens", TOKEN_DTYPES, bucket)
    if p < 1 or c < 1:
        raise _Refused("bad_arrays", f"needs >= 1 prompt and >= 1 completion token, got {p}+{c}")
    _vector(r.logprobs, "logprobs", FLOAT_DTYPES, bucket, c)
    if r.completion_mask is not None:
        _vector(r.completion_mask, "completion_mask", MASK_DTYPES, bucket, c)
    if p + c > limits.max_seq_len:
        raise _Refused(
            "too_long", f"{p} prompt + {c} completion tokens > the model's context of {limits.max_seq_len}"
        )
    if not limits.replay:
        return  # traces are never read
    if r.routing_trace is None:
        if limits.trace is not None:
            raise _Refused(
                "bad_arrays", "no routing_trace: this MoE run replays routing (every rollout needs one)"
            )
        return
    if limits.trace is None:
        raise _Refused("bad_arrays", "a routing_trace for a dense model")
    dtype, shape = _declared(r.routing_trace, "routing_trace", bucket)
    layers, top_k, _ = limits.trace
    want = (p + c - 1, layers, top_k)  # every token fed forward: all but the last
    if dtype not in TRACE_DTYPES or shape != want:
        raise _Refused(
            "bad_arrays", f"routing_trace: {dtype}{list(shape)}, expected integers of shape {list(want)}"
        )


def check_read(
    prompt: np.ndarray,
    completion: np.ndarray,
    logprobs: np.ndarray,
    mask: np.ndarray | None,
    trace: np.ndarray | None,
    limits: ModelLimits,
) -> Rejection | None:
    """The arrays as read (their shapes are the declared ones, checked at admission)."""
    for what, arr in (("prompt", prompt), ("completion", completion)):
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= limits.vocab_size):
            return "bad_tokens", f"{what} token ids outside [0, {limits.vocab_size})"
    if not np.isfinite(logprobs).all():
        return "non_finite", "non-finite inference logprobs"
    if mask is not None and not np.isin(mask, (0, 1)).all():
        return "bad_arrays", "completion_mask values other than 0 and 1"
    if trace is not None and limits.trace is not None and trace.size:
        experts = limits.trace[2]
        if int(trace.min()) < 0 or int(trace.max()) >= experts:
            return "bad_arrays", f"routing_trace expert ids outside [0, {experts})"
        ordered = np.sort(trace.astype(np.int64), axis=-1)
        if (np.diff(ordered, axis=-1) == 0).any():
            return "bad_arrays", "routing_trace repeats an expert within a token's top-k"
    return None
