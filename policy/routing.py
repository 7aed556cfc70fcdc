"""Router Replay (R3): record the experts inference chose, make the trainer use exactly those.

Trace format (one per sequence): an integer tensor ``[tokens, moe_layers, top_k]``, uint8 (uint16
when the model has more than 256 experts). Row ``i`` holds, for every MoE layer in forward order,
the ``top_k`` expert ids that input position ``i`` was routed to. A sequence of ``P`` prompt and
``C`` completion tokens has ``P + C - 1`` rows: every token that was fed through the model; the
last completion token never is. That is exactly the training forward's input
(``tokens[:-1]`` predicting ``tokens[1:]``), so row ``i`` of the trace is position ``i`` of the
training forward.

Both directions work through forward hooks on torchtitan's ``TokenChoiceTopKRouter`` (which
returns ``(topk_scores, topk_ids, all_scores)``), so torchtitan's code runs unmodified:

* capture copies ``topk_ids`` out;
* replay swaps in the recorded ids and recomputes the gate weights from the trainer's own
  router scores, ``scores.gather(-1, ids)`` (then torchtitan's ``route_norm``/``route_scale``),
  so the router still receives gradients.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from jetrl.policy.models import ModelConfig, model_config, moe_routers
from jetrl.policy.titan import TokenChoiceTopKRouter

# What a torchtitan router's forward returns: gate weights, expert ids, scores.
RouterOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class TraceError(ValueError):
    """A routing trace does not fit the model or the sequence it claims to describe."""


def trace_dtype(num_experts: int) -> torch.dtype:
    if num_experts <= 0:
        raise ValueError("routing traces exist only for MoE models")
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 65536:
        return torch.uint16
    raise ValueError(f"{num_experts} experts do not fit a uint16 trace")


def trace_length(prompt_len: int, completion_len: int) -> int:
    """Rows in the trace of a sequence: every token fed forward (all but the last)."""
    if prompt_len < 1 or completion_len < 1:
        raise TraceError(
            f"need at least one prompt and one completion token, got {prompt_len}+{completion_len}"
        )
    return prompt_len + completion_len - 1


def check_trace(
    trace: torch.Tensor,
    *,
    num_tokens: int,
    num_moe_layers: int,
    top_k: int,
    num_experts: int,
    what: str = "trace",
) -> None:
    """Raise :class:`TraceError` with a precise message unless ``trace`` is ``[num_tokens,
    num_moe_layers, top_k]`` of distinct expert ids below ``num_experts``."""
    if not isinstance(trace, torch.Tensor):
        raise TraceError(f"{what}: expected a torch.Tensor, got {type(trace).__name__}")
    if trace.dtype.is_floating_point or trace.dtype.is_complex or trace.dtype == torch.bool:
        raise TraceError(f"{what}: expert ids must be integers, got dtype {trace.dtype}")
    if trace.ndim != 3:
        raise TraceError(f"{what}: expected shape [tokens, moe_layers, top_k], got {tuple(trace.shape)}")
    rows, layers, k = trace.shape
    if rows != num_tokens:
        raise TraceError(
            f"{what}: has {rows} token rows but {num_tokens} are needed "
            "(prompt + completion - 1: every token fed forward, the last completion token never is)"
        )
    if layers != num_moe_layers:
        raise TraceError(f"{what}: covers {layers} MoE layers, the model has {num_moe_layers}")
    if k != top_k:
        raise TraceError(f"{what}: has top_k={k}, the model routes each token to {top_k} experts")
    if trace.numel():
        ids = trace.long()
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            raise TraceError(
                f"{what}: expert ids span [{lo}, {hi}], the model has experts 0..{num_experts - 1}"
            )
        srt = ids.sort(dim=-1).values
        dup = (srt[..., 1:] == srt[..., :-1]).any(dim=-1)
        if bool(dup.any()):
            row, layer = (int(x) for x in dup.nonzero()[0])
            raise TraceError(
                f"{what}: token {row}, MoE layer {layer} lists expert {int(srt[row, layer, 0])}"
                " twice; top-k ids must be distinct"
            )


def check_trace_for(
    cfg: ModelConfig, trace: torch.Tensor, prompt_len: int, completion_len: int, what: str = "trace"
) -> None:
    """``trace`` checked against the model config for a prompt and completion of these lengths."""
    check_trace(
        trace,
        num_tokens=trace_length(prompt_len, completion_len),
        num_moe_layers=cfg.num_moe_layers,
        top_k=cfg.top_k,
        num_experts=cfg.num_experts,
        what=what,
    )


def pad_traces(traces: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """Stack per-sequence traces into ``[B, length, moe_layers, top_k]`` (int64).

    Padding rows route to experts ``0..top_k-1``: valid, distinct ids whose outputs only reach
    padded positions, which causal attention hides from real tokens and the loss masks out.
    """
    if not traces:
        raise TraceError("no traces to pad")
    _, layers, k = traces[0].shape
    out = torch.arange(k, dtype=torch.long).expand(len(traces), length, layers, k).clone()
    for i, t in enumerate(traces):
        if t.shape[1:] != (layers, k):
            raise TraceError(f"trace {i}: shape {tuple(t.shape)} differs from trace 0's [*, {layers}, {k}]")
        if t.shape[0] > length:
            raise TraceError(f"trace {i}: {t.shape[0]} rows do not fit a batch of {length} positions")
        out[i, : t.shape[0]] = t.long()
    return out


class RoutingCapture:
    """Collects the routers' top-k choices of the forwards run inside :func:`capture_routing`."""

    def __init__(self, num_layers: int, dtype: torch.dtype) -> None:
        self._pending: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.dtype = dtype

    def _record(self, layer: int, ids: torch.Tensor) -> None:
        self._pending[layer].append(ids.detach().to(self.dtype))

    def take(self) -> torch.Tensor:
        """The last forward's choices as ``[B, L, moe_layers, top_k]``; clears the buffer."""
        counts = {len(p) for p in self._pending}
        if counts != {1}:
            raise RuntimeError(
                f"take() expects exactly one forward since the last take, saw {sorted(counts)}"
            )
        out = torch.stack([p[0] for p in self._pending], dim=2)
        for p in self._pending:
            p.clear()
        return out


@contextmanager
def capture_routing(model: nn.Module) -> Iterator[RoutingCapture]:
    """Record every MoE layer's expert choice; use ``capture.take()`` after each forward."""
    cfg = model_config(model)
    routers = moe_routers(model)
    cap = RoutingCapture(len(routers), trace_dtype(cfg.num_experts))
    handles = []
    for layer, router in enumerate(routers):

        def hook(_mod: nn.Module, _args: object, out: RouterOutput, layer: int = layer) -> None:
            cap._record(layer, out[1])

        handles.append(router.register_forward_hook(hook))
    try:
        yield cap
    finally:
        for h in handles:
            h.remove()


@contextmanager
def replay_routing(
    model: nn.Module, trace: torch.Tensor, differs: list[torch.Tensor] | None = None
) -> Iterator[None]:
    """Inside this context every forward routes token ``[b, l]`` of MoE layer ``j`` to
    ``trace[b, l, j]`` (shape ``[B, L, moe_layers, top_k]``, L = the forward's input length).
    With ``differs``, each MoE layer appends a bool ``[B, L]``: where the model's own router
    would have chosen another set of experts than the replayed one."""
    routers = moe_routers(model)
    if trace.ndim != 4 or trace.shape[2] != len(routers):
        raise TraceError(f"replay trace must be [B, L, {len(routers)}, top_k], got {tuple(trace.shape)}")
    ids_all = trace.long()
    handles = []
    for layer, router in enumerate(routers):

        def hook(
            mod: TokenChoiceTopKRouter, _args: object, out: RouterOutput, layer: int = layer
        ) -> RouterOutput:
            _, own_ids, scores = out
            ids = ids_all[:, :, layer].to(own_ids.device).contiguous()
            if ids.shape != own_ids.shape:
                raise TraceError(
                    f"replay trace covers [batch, positions, top_k] = {tuple(ids.shape)} but MoE layer "
                    f"{layer} sees {tuple(own_ids.shape)}; the trace must match the forward's input tokens"
                )
            # Gate weights from the trainer's own scores at the replayed experts, normalised the
            # way torchtitan normalises its own top-k (route_norm, route_scale): with the same
            # weights this is bit-identical to the unreplayed forward.
            if differs is not None:
                with torch.no_grad():
                    own, replayed = own_ids.sort(dim=-1).values, ids.sort(dim=-1).values
                    differs.append((own != replayed).any(dim=-1))
            weights = scores.gather(-1, ids)
            if mod.route_norm:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            weights = weights * mod.route_scale
            return weights, ids, scores

        handles.append(router.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
