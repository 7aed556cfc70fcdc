"""Trainer-side pieces: batches of rollouts, logprobs with Router Replay, the train step, and
deterministic CPU settings.

Layout of a :class:`TrainBatch` of ``B`` rollouts, longest ``P + C = L`` tokens, right-padded:
the forward reads ``input_ids[:, :-1]`` (``L - 1`` positions) and position ``i`` predicts
``input_ids[:, i + 1]``. Completion token ``j`` of a rollout with prompt length ``P`` is thus
predicted at position ``P - 1 + j``; those positions form ``loss_mask``. The routing trace of a
rollout has ``P + C - 1`` rows, one per forward position, so it lines up with no shifting.

A packed batch (policy/packing.py, :func:`~jetrl.policy.packing.collate_packed`) holds several
rollouts per row, each at an offset ``s``: the same rules hold with ``P - 1`` read as
``s + P - 1``. It adds ``positions`` (RoPE positions, restarting at 0 per rollout) and
``doc_ids`` (which rollout each forward position belongs to), and its advantages are per token.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import nn

from jetrl.policy.loss import DEFAULT_LOSS, LossConfig, rl_loss
from jetrl.policy.models import ModelConfig, PackedMask, model_config
from jetrl.policy.routing import TraceError, check_trace_for, replay_routing
from jetrl.policy.schedule import LrSchedule


@dataclass(slots=True)
class Rollout:
    """One scored sample as the trainer receives it."""

    prompt_ids: Sequence[int] | np.ndarray
    completion_ids: Sequence[int] | np.ndarray
    inference_logprobs: torch.Tensor  # [C]
    advantage: float
    routing: torch.Tensor | None = None  # [P + C - 1, moe_layers, top_k]
    # Multi-turn episodes: the completion interleaves model turns (True, trained) with the
    # environment's text (False, context only). None = every completion token is the model's.
    completion_mask: Sequence[bool] | np.ndarray | None = None


@dataclass(slots=True)
class TrainBatch:
    input_ids: torch.Tensor  # [B, L] long
    loss_mask: torch.Tensor  # [B, L-1] bool
    inference_logprobs: torch.Tensor  # [B, L-1] float32, 0 off the mask
    advantages: torch.Tensor  # [B] float32; packed: [B, L-1], 0 on padding
    routing: torch.Tensor | None = None  # [B, L-1, moe_layers, top_k] long
    # Packed batches only (both set or both None): per forward position, its RoPE position
    # within its rollout and the rollout's index (-1 on padding), both [B, L-1] long.
    positions: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def packed(self) -> bool:
        if (self.positions is None) != (self.doc_ids is None):
            raise ValueError("a packed TrainBatch needs both positions and doc_ids")
        return self.doc_ids is not None


def check_rollouts(rollouts: Sequence[Rollout], model_cfg: ModelConfig) -> bool:
    """Check every length, log-prob, mask and trace against ``model_cfg`` (token ids are checked
    by the collating function). Returns whether the rollouts carry routing traces."""
    if not rollouts:
        raise ValueError("no rollouts to collate")
    with_trace = [r.routing is not None for r in rollouts]
    if any(with_trace) and not all(with_trace):
        raise TraceError(
            f"rollouts {[i for i, t in enumerate(with_trace) if not t]} lack routing traces "
            "while others have them; replay needs all or none"
        )
    traces: list[torch.Tensor] = []
    for i, r in enumerate(rollouts):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        if p < 1 or c < 1:
            raise ValueError(f"rollout {i}: needs >= 1 prompt and >= 1 completion token, got {p}+{c}")
        if r.inference_logprobs.shape != (c,):
            raise ValueError(
                f"rollout {i}: {c} completion tokens but inference_logprobs has shape "
                f"{tuple(r.inference_logprobs.shape)}"
            )
        if r.completion_mask is not None and len(r.completion_mask) != c:
            raise ValueError(
                f"rollout {i}: completion_mask has {len(r.completion_mask)} entries for {c} tokens"
            )
        if r.routing is not None:
            if not model_cfg.is_moe:
                raise TraceError(f"rollout {i}: has a routing trace but {model_cfg.name} is dense")
            traces.append(r.routing)
    if traces and not _traces_fit(traces, rollouts, model_cfg):
        # Something is wrong with one of them: find it, and say exactly what.
        for i, r in enumerate(rollouts):
            assert r.routing is not None
            p, c = len(r.prompt_ids), len(r.completion_ids)
            check_trace_for(
                model_cfg, r.routing, p, c, what=f"rollout {i} ({p} prompt + {c} completion tokens) trace"
            )
    return all(with_trace)


def _traces_fit(traces: list[torch.Tensor], rollouts: Sequence[Rollout], cfg: ModelConfig) -> bool:
    """Whether every trace is ``[P + C - 1, moe_layers, top_k]`` of distinct expert ids below
    ``num_experts``: all of them at once (a step's hundreds of traces checked one by one cost
    as much as its forward)."""
    for t, r in zip(traces, rollouts, strict=True):
        rows = len(r.prompt_ids) + len(r.completion_ids) - 1
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            return False
        if tuple(t.shape) != (rows, cfg.num_moe_layers, cfg.top_k):
            return False
    return experts_fit(torch.cat([t.long() for t in traces]), cfg)


def experts_fit(ids: torch.Tensor, cfg: ModelConfig) -> bool:
    """Whether each row of ``ids`` (``[..., top_k]``, integers) names distinct experts below
    ``num_experts``."""
    if not ids.numel():
        return True
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.num_experts:
        return False
    srt = ids.sort(dim=-1).values
    return not bool((srt[..., 1:] == srt[..., :-1]).any())


def collate(rollouts: Sequence[Rollout], model_cfg: ModelConfig, *, pad_id: int = 0) -> TrainBatch:
    """Pad rollouts into a batch, checking every length and trace against ``model_cfg``. Built
    with one scatter per tensor, not per rollout: a step holds hundreds of short rollouts."""
    has_traces = check_rollouts(rollouts, model_cfg)
    b = len(rollouts)
    return padded_batch(
        np.fromiter((len(r.prompt_ids) for r in rollouts), np.int64, b),
        np.fromiter((len(r.completion_ids) for r in rollouts), np.int64, b),
        np.concatenate([np.asarray(r.prompt_ids, dtype=np.int64).reshape(-1) for r in rollouts]),
        np.concatenate([np.asarray(r.completion_ids, dtype=np.int64).reshape(-1) for r in rollouts]),
        np.concatenate([_model_tokens(r) for r in rollouts]),
        # One conversion of the joined tensors, not one per rollout (each op costs a dispatch).
        torch.cat([r.inference_logprobs.detach() for r in rollouts]),
        [r.advantage for r in rollouts],
        torch.cat([r.routing for r in rollouts if r.routing is not None]) if has_traces else None,
        model_cfg,
        pad_id=pad_id,
    )


def padded_batch(
    prompt_lens: np.ndarray,
    completion_lens: np.ndarray,
    prompts: np.ndarray,
    completions: np.ndarray,
    model_tokens: np.ndarray | bool,
    logprobs: torch.Tensor,
    advantages: Sequence[float],
    routing: torch.Tensor | None,
    model_cfg: ModelConfig,
    *,
    pad_id: int = 0,
) -> TrainBatch:
    """The right-padded batch of rollouts given as joined columns (each field of every rollout
    end to end, cut by the lengths; ``model_tokens``, ``logprobs``: each completion token's,
    True for all; ``routing``: each rollout's ``P + C - 1`` trace rows), lengths and traces
    already checked. The token ids are checked here."""
    for tokens in (prompts, completions):
        if int(tokens.max()) >= model_cfg.vocab_size or int(tokens.min()) < 0:
            raise ValueError(f"token ids must lie in [0, {model_cfg.vocab_size})")
    b = len(prompt_lens)
    plen, clen = prompt_lens, completion_lens
    lens = plen + clen
    width = int(lens.max())
    ids = np.full((b, width), pad_id, dtype=np.int64)
    ids[_rows(plen), _offsets(plen)] = prompts
    ids[_rows(clen), _offsets(clen) + np.repeat(plen, clen)] = completions
    # Completion token j of a rollout with P prompt tokens is predicted at position P - 1 + j.
    crow, ccol = _rows(clen), _offsets(clen) + np.repeat(plen - 1, clen)
    mask = np.zeros((b, width - 1), dtype=bool)
    mask[crow, ccol] = model_tokens
    inf_lp = np.zeros((b, width - 1), dtype=np.float32)
    inf_lp[crow, ccol] = logprobs.detach().float().cpu().numpy()
    adv = torch.tensor([float(a) for a in advantages], dtype=torch.float32)
    full = None
    if routing is not None:
        k = model_cfg.top_k
        # Padding rows route to experts 0..top_k-1, as pad_traces does (policy/routing.py).
        full = torch.arange(k, dtype=torch.long).expand(b, width - 1, model_cfg.num_moe_layers, k).clone()
        full[torch.from_numpy(_rows(lens - 1)), torch.from_numpy(_offsets(lens - 1))] = routing.long()
    return TrainBatch(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(inf_lp), adv, full)


def _model_tokens(r: Rollout) -> np.ndarray:
    """Which completion tokens are the model's (all but an episode's environment text)."""
    if r.completion_mask is None:
        return np.ones(len(r.completion_ids), dtype=bool)
    return np.asarray(r.completion_mask, dtype=bool)


def _rows(lens: np.ndarray) -> np.ndarray:
    """The row of each element when row ``i`` holds ``lens[i]`` of them, in order."""
    return np.repeat(np.arange(len(lens)), lens)


def _offsets(lens: np.ndarray) -> np.ndarray:
    """Each element's place within its row (0, 1, ... per row)."""
    starts: np.ndarray = np.cumsum(lens) - lens
    offsets: np.ndarray = np.arange(int(lens.sum())) - np.repeat(starts, lens)
    return offsets


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 log-probs of ``targets`` under ``softmax(logits / temperature)`` (+ entropy).
    Without ``entropy_grad`` the entropy is a metric only: computed outside autograd, so no
    full-vocabulary tensor is kept for the backward pass."""
    logp = torch.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)
    lp = logp.gather(-1, targets[..., None]).squeeze(-1)
    ent = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _packed_inputs(model: nn.Module, cfg: ModelConfig, batch: TrainBatch) -> dict[str, object]:
    """The model's ``positions`` and ``attention_masks`` for a packed batch: jetrl's SDPA takes a
    :class:`PackedMask`; torchtitan's flex/varlen build their document masks from the positions
    (a document starts where its position is 0, which holds for every packed rollout)."""
    assert batch.positions is not None and batch.doc_ids is not None
    n = batch.input_ids.shape[1] - 1
    if batch.positions.shape != (batch.input_ids.shape[0], n) or batch.doc_ids.shape != batch.positions.shape:
        raise ValueError(
            f"positions {tuple(batch.positions.shape)} and doc_ids {tuple(batch.doc_ids.shape)} must both "
            f"be [B, L-1] = {(batch.input_ids.shape[0], n)}"
        )
    if cfg.attention == "sdpa":
        masks: object = PackedMask(batch.doc_ids)
    else:  # torchtitan's Decoder.get_attention_masks (untyped)
        masks = cast(Callable[[torch.Tensor], object], model.get_attention_masks)(batch.positions)
    return {"positions": batch.positions, "attention_masks": masks}


def compute_logprobs(
    model: nn.Module,
    batch: TrainBatch,
    *,
    temperature: float = 1.0,
    replay: bool = True,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    route_differs: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Trainer log-probs ``[B, L-1]`` of each next token, replaying the batch's routing when
    ``replay`` (an MoE batch without traces is an error then). ``route_differs``: see
    :func:`replay_routing`."""
    cfg = model_config(model)
    inputs, targets = batch.input_ids[:, :-1], batch.input_ids[:, 1:]
    # An unpacked batch calls the model exactly as before (bit-identical steps).
    packed = _packed_inputs(model, cfg, batch) if batch.packed else {}
    if replay and cfg.is_moe:
        if batch.routing is None:
            raise TraceError("replay=True but the batch carries no routing traces")
        with replay_routing(model, batch.routing, route_differs):
            logits = model(inputs, **packed)
    else:
        logits = model(inputs, **packed)
    return token_logprobs(logits, targets, temperature, with_entropy=with_entropy, entropy_grad=entropy_grad)


def forward_backward(
    model: nn.Module,
    batch: TrainBatch,
    loss_cfg: LossConfig = DEFAULT_LOSS,
    *,
    temperature: float = 1.0,
    replay: bool = True,
    num_tokens: int | None = None,
    token_stats: list[torch.Tensor] | None = None,
) -> dict[str, float]:
    """Forward (with replay), loss, backward; gradients accumulate. ``num_tokens`` is the loss
    normaliser of the whole step when it spans several micro-batches. With ``token_stats``,
    appends the batch's float32 ``[B, L-1, 2]``: each next token's trainer log-prob and the
    number of MoE layers whose own routing differed from the replayed one."""
    differs: list[torch.Tensor] | None = [] if token_stats is not None else None
    lp, ent = compute_logprobs(
        model,
        batch,
        temperature=temperature,
        replay=replay,
        with_entropy=True,  # always a metric; in the loss (with its gradient) only when weighted
        entropy_grad=loss_cfg.entropy_coef > 0,
        route_differs=differs,
    )
    if token_stats is not None:
        n_diff = torch.stack(differs).sum(0).float() if differs else torch.zeros_like(lp)
        token_stats.append(torch.stack([lp.detach().float(), n_diff.to(lp.device)], dim=-1))
    loss, metrics = rl_loss(
        lp,
        batch.inference_logprobs,
        batch.advantages,
        batch.loss_mask,
        loss_cfg,
        entropy=ent,
        num_tokens=num_tokens,
        segments=batch.doc_ids,  # a packed row holds several rollouts: mismatch_kl_max per rollout
    )
    loss.backward()
    return metrics


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch | Sequence[TrainBatch],
    loss_cfg: LossConfig = DEFAULT_LOSS,
    *,
    temperature: float = 1.0,
    replay: bool = True,
    max_grad_norm: float | None = 1.0,
    token_stats: list[torch.Tensor] | None = None,
    lr_schedule: LrSchedule | None = None,
) -> dict[str, float]:
    """One optimizer step over a batch (or micro-batches, normalised by their total token
    count), at ``lr_schedule``'s learning rate (None: the optimizer's). Returns the metrics
    (token-weighted over micro-batches) plus ``grad_norm`` and ``lr``; ``token_stats``
    collects each micro-batch's (see :func:`forward_backward`)."""
    batches = [batch] if isinstance(batch, TrainBatch) else list(batch)
    total = max(sum(b.num_tokens for b in batches), 1)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    metrics: dict[str, float] = {}
    for b in batches:
        m = forward_backward(
            model,
            b,
            loss_cfg,
            temperature=temperature,
            replay=replay,
            num_tokens=total,
            token_stats=token_stats,
        )
        add_metrics(metrics, m, b.num_tokens / total)
    metrics.update(clip_and_step(model, optimizer, max_grad_norm, lr_schedule))
    return metrics


def clip_and_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float | None,
    schedule: LrSchedule | None = None,
) -> dict[str, float]:
    """Clip the gradients to ``max_grad_norm`` (None or 0: no clip) and take the optimizer
    step at the learning rate ``schedule`` gives it (None: the optimizer's as it is); returns
    the step's ``grad_norm`` (before the clip) and ``lr``."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm else float("inf"))
    lr = scheduled_lr(optimizer, schedule) if schedule is not None else optimizer.param_groups[0]["lr"]
    optimizer.step()
    return {"grad_norm": float(norm), "lr": lr}


def scheduled_lr(optimizer: torch.optim.Optimizer, schedule: LrSchedule) -> float:
    """Set every parameter group's learning rate to the schedule's for the next step, and
    return it. The step count is AdamW's own (``step`` in each parameter's state, saved with
    every checkpoint and restored with it), so a resumed or replayed engine continues the
    schedule where the run was."""
    if schedule.constant:
        lr = schedule.lr
    else:
        taken = max((int(st["step"]) for st in optimizer.state.values() if "step" in st), default=0)
        lr = schedule.at(taken)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


class StepAccumulator:
    """One optimizer step over micro-batches that come one at a time, before the step's token
    count is known (a streaming trainer's groups as they arrive): each backward sums its tokens'
    terms (normaliser 1); :meth:`finish` divides the gradients and the summed loss terms by the
    step's total, then clips and steps as :func:`train_step` does. The same maths as one
    :func:`train_step` over the same micro-batches, with the division after the sums rather
    than inside each: equal up to float round-off, and bit-for-bit reproducible given the same
    micro-batches (which StepCompleted records)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_cfg: LossConfig = DEFAULT_LOSS,
        *,
        temperature: float = 1.0,
        replay: bool = True,
        max_grad_norm: float | None = 1.0,
        lr_schedule: LrSchedule | None = None,
    ) -> None:
        self.model, self.optimizer, self.loss_cfg = model, optimizer, loss_cfg
        self.temperature, self.replay, self.max_grad_norm = temperature, replay, max_grad_norm
        self.lr_schedule = lr_schedule
        self._parts: list[tuple[dict[str, float], int]] = []

    def add(self, batch: TrainBatch, token_stats: list[torch.Tensor] | None = None) -> None:
        """Forward and backward of one micro-batch; its gradients add to the step's."""
        if not self._parts:
            self.model.train()
            self.optimizer.zero_grad(set_to_none=True)
        m = forward_backward(
            self.model,
            batch,
            self.loss_cfg,
            temperature=self.temperature,
            replay=self.replay,
            num_tokens=1,
            token_stats=token_stats,
        )
        self._parts.append((m, batch.num_tokens))

    def finish(self) -> dict[str, float]:
        """The optimizer step over every micro-batch added; the accumulator is empty again."""
        if not self._parts:
            raise RuntimeError("no micro-batch was added to the step")
        parts, self._parts = self._parts, []
        total = max(sum(n for _, n in parts), 1)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(total)
        metrics: dict[str, float] = {}
        for m, n in parts:
            # Loss terms were summed over the tokens (normaliser 1): the step's share of each.
            scaled = {k: v / total if k in ("loss", "pg_loss", "kl") else v for k, v in m.items()}
            add_metrics(metrics, scaled, n / total)
        metrics.update(clip_and_step(self.model, self.optimizer, self.max_grad_norm, self.lr_schedule))
        return metrics


def add_metrics(into: dict[str, float], part: dict[str, float], weight: float) -> None:
    """Fold one micro-batch's metrics (or one rank's) into the step's: loss terms are already
    divided by the step's token total (summed), extremes stay extremes, the rest are token
    means (weighted by the part's share ``weight`` of the step's tokens)."""
    for k, v in part.items():
        if k in ("loss", "pg_loss", "kl", "num_tokens"):
            into[k] = into.get(k, 0.0) + v
        elif k == "ratio_min":
            into[k] = min(into.get(k, v), v)
        elif k in ("ratio_max", "mismatch_kl_max"):
            into[k] = max(into.get(k, v), v)
        else:
            into[k] = into.get(k, 0.0) + weight * v


def make_optimizer(model: nn.Module, lr: float = 1e-3, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    # foreach=False: the single-tensor loop has one fixed reduction order on every build.
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)


def set_deterministic(seed: int | None = 0, *, num_threads: int | None = None) -> None:
    """Bit-reproducible CPU training: deterministic kernels, seeded RNGs and, where results must
    match across machines, a fixed intra-op thread count (CPU reductions may split work by
    thread count)."""
    torch.use_deterministic_algorithms(True, warn_only=False)
    # Deterministic mode also fills every new uninitialised tensor with NaN, a debugging aid that
    # changes no result (kernels overwrite all they return): ~700 fills a step of the demo's
    # train call, ~5% of it (docs/running.md, "Where a step's time goes").
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    if seed is not None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
