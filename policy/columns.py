"""A step's rollouts as joined columns, and their batch built from the columns.

The trainer reads a step's few hundred rollouts as arrays (policy/train.py's :class:`Rollout`
holds one rollout's); cutting the joined arrays into one tensor per rollout, then joining them
again in :func:`~jetrl.policy.train.collate`, costs a dispatch or two per rollout each way.
:class:`RolloutColumns` keeps each field of all the rollouts in one array, cut by their
lengths. It is a ``Sequence[Rollout]``, so every engine takes it as it takes a list (indexing
makes each rollout's view); :func:`collate_columns` builds the same :class:`TrainBatch` as
``collate`` does from the list, bit for bit, in a few whole-array operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import numpy as np
import torch

from jetrl.policy.models import ModelConfig
from jetrl.policy.train import Rollout, TrainBatch, collate, experts_fit, padded_batch


class RolloutColumns(Sequence[Rollout]):
    """Rollout ``i`` is ``prompts[sum(prompt_lens[:i]) :][: prompt_lens[i]]``, and likewise
    its completion, logprobs and mask (by ``completion_lens``) and its routing trace (by
    ``prompt_lens + completion_lens - 1`` rows). ``routing`` and ``completion_mask`` are each
    every rollout's or none's."""

    __slots__ = (
        "_c0",
        "_p0",
        "_r0",
        "advantages",
        "completion_lens",
        "completion_mask",
        "completions",
        "inference_logprobs",
        "prompt_lens",
        "prompts",
        "routing",
    )

    def __init__(
        self,
        *,
        prompt_lens: np.ndarray,
        completion_lens: np.ndarray,
        prompts: np.ndarray,
        completions: np.ndarray,
        inference_logprobs: torch.Tensor,
        advantages: Sequence[float],
        routing: torch.Tensor | None = None,
        completion_mask: np.ndarray | None = None,
    ) -> None:
        self.prompt_lens = np.asarray(prompt_lens, dtype=np.int64)
        self.completion_lens = np.asarray(completion_lens, dtype=np.int64)
        self.prompts, self.completions = prompts, completions
        self.inference_logprobs = inference_logprobs
        self.routing, self.completion_mask = routing, completion_mask
        self.advantages = list(advantages)
        n = len(self.prompt_lens)
        p_total, c_total = int(self.prompt_lens.sum()), int(self.completion_lens.sum())
        sizes = {
            "completion_lens": (len(self.completion_lens), n),
            "advantages": (len(self.advantages), n),
            "prompts": (len(prompts), p_total),
            "completions": (len(completions), c_total),
            "inference_logprobs": (len(inference_logprobs), c_total),
        }
        if completion_mask is not None:
            sizes["completion_mask"] = (len(completion_mask), c_total)
        if routing is not None:
            sizes["routing"] = (len(routing), p_total + c_total - n)
        wrong = {k: v for k, v in sizes.items() if v[0] != v[1]}
        if wrong:
            raise ValueError(f"columns of {n} rollouts do not match their lengths (got, want): {wrong}")
        self._p0 = _starts(self.prompt_lens)
        self._c0 = _starts(self.completion_lens)
        self._r0 = _starts(self.prompt_lens + self.completion_lens - 1)

    @classmethod
    def joined(
        cls,
        prompts: Sequence[np.ndarray],
        completions: Sequence[np.ndarray],
        logprobs: Sequence[np.ndarray],
        masks: Sequence[np.ndarray | None],
        traces: Sequence[np.ndarray | None],
        advantages: Sequence[float],
    ) -> RolloutColumns | None:
        """Rollout ``i``'s arrays (``prompts[i]``, ...) joined into columns; None where one of
        them disagrees with its lengths (a logprob, mask value or trace row too many or too few,
        an array not 1-D, routing traces some rollouts' only, traces of unlike shapes): those go
        to ``collate`` one by one, whose checks name the rollout. A rollout without a mask has
        every completion token the model's."""
        n = len(prompts)
        if not n or any(a.ndim != 1 for arrays in (prompts, completions, logprobs) for a in arrays):
            return None
        plen = np.fromiter((len(a) for a in prompts), np.int64, n)
        clen = np.fromiter((len(a) for a in completions), np.int64, n)
        if (np.fromiter((len(a) for a in logprobs), np.int64, n) != clen).any():
            return None
        lens = clen.tolist()
        if any(m is not None and (m.ndim != 1 or len(m) != c) for m, c in zip(masks, lens, strict=True)):
            return None
        traced = [t for t in traces if t is not None]  # not `None in`: it compares arrays
        routing = None
        if traced:
            if len(traced) < n or len({t.shape[1:] for t in traced}) != 1:
                return None
            if (np.fromiter((len(t) for t in traced), np.int64, n) != plen + clen - 1).any():
                return None
            routing = torch.from_numpy(np.concatenate(traced).astype(np.int64, copy=False))
        mask = None
        if any(m is not None for m in masks):
            mask = np.concatenate(
                [
                    np.ones(c, dtype=bool) if m is None else m.astype(bool)
                    for m, c in zip(masks, lens, strict=True)
                ]
            )
        return cls(
            prompt_lens=plen,
            completion_lens=clen,
            prompts=np.concatenate(prompts).astype(np.int64, copy=False),
            completions=np.concatenate(completions).astype(np.int64, copy=False),
            inference_logprobs=torch.from_numpy(np.concatenate(logprobs)),
            advantages=advantages,
            routing=routing,
            completion_mask=mask,
        )

    @classmethod
    def of(cls, rollouts: Sequence[Rollout]) -> RolloutColumns:
        """The columns of ``rollouts`` (:meth:`joined`; a ValueError where it gives none)."""
        cols = cls.joined(
            [np.asarray(r.prompt_ids, dtype=np.int64) for r in rollouts],
            [np.asarray(r.completion_ids, dtype=np.int64) for r in rollouts],
            [r.inference_logprobs.detach().cpu().numpy() for r in rollouts],
            [None if r.completion_mask is None else np.asarray(r.completion_mask) for r in rollouts],
            [None if r.routing is None else r.routing.cpu().numpy() for r in rollouts],
            [r.advantage for r in rollouts],
        )
        if cols is None:
            raise ValueError(
                "rollouts whose arrays disagree with their lengths, or routing traces that are not "
                "every rollout's or none's"
            )
        return cols

    def __len__(self) -> int:
        return len(self.prompt_lens)

    @overload
    def __getitem__(self, i: int) -> Rollout: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[Rollout]: ...

    def __getitem__(self, i: int | slice) -> Rollout | Sequence[Rollout]:
        if isinstance(i, slice):
            return self._slice(i)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"rollout {i} of {n}")
        i %= n
        p0, p = int(self._p0[i]), int(self.prompt_lens[i])
        c0, c = int(self._c0[i]), int(self.completion_lens[i])
        r0 = int(self._r0[i])
        return Rollout(
            prompt_ids=self.prompts[p0 : p0 + p],
            completion_ids=self.completions[c0 : c0 + c],
            inference_logprobs=self.inference_logprobs[c0 : c0 + c],
            advantage=self.advantages[i],
            routing=None if self.routing is None else self.routing[r0 : r0 + p + c - 1],
            completion_mask=None if self.completion_mask is None else self.completion_mask[c0 : c0 + c],
        )

    def _slice(self, s: slice) -> Sequence[Rollout]:
        """A run of consecutive rollouts as columns (a streaming step's micro-batch); any other
        selection as a list."""
        start, stop, step = s.indices(len(self))
        if step != 1:
            return [self[j] for j in range(start, stop, step)]
        stop = max(start, stop)
        n = len(self)

        def cut(starts: np.ndarray, total: int) -> slice:
            lo = int(starts[start]) if start < n else total
            hi = int(starts[stop]) if stop < n else total
            return slice(lo, hi)

        p = cut(self._p0, len(self.prompts))
        c = cut(self._c0, len(self.completions))
        r = cut(self._r0, 0 if self.routing is None else len(self.routing))
        return RolloutColumns(
            prompt_lens=self.prompt_lens[start:stop],
            completion_lens=self.completion_lens[start:stop],
            prompts=self.prompts[p],
            completions=self.completions[c],
            inference_logprobs=self.inference_logprobs[c],
            advantages=self.advantages[start:stop],
            routing=None if self.routing is None else self.routing[r],
            completion_mask=None if self.completion_mask is None else self.completion_mask[c],
        )


def _starts(lens: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.cumsum(lens) - lens
    return out


def completion_length(rollouts: Sequence[Rollout]) -> int:
    """The completion tokens of ``rollouts``, the environment's in a multi-turn episode
    included (columns: without a rollout's view each)."""
    if isinstance(rollouts, RolloutColumns):
        return int(rollouts.completion_lens.sum())
    return sum(len(r.completion_ids) for r in rollouts)


def collate_columns(cols: RolloutColumns, model_cfg: ModelConfig, *, pad_id: int = 0) -> TrainBatch:
    """:func:`~jetrl.policy.train.collate` of the rollouts ``cols`` holds: the same batch, the
    same checks. Whatever fails a check goes through ``collate`` rollout by rollout, so the
    error names the rollout and says what is wrong exactly as there."""
    if not len(cols) or not _fits(cols, model_cfg):
        return collate(list(cols), model_cfg, pad_id=pad_id)
    return padded_batch(
        cols.prompt_lens,
        cols.completion_lens,
        cols.prompts,
        cols.completions,
        True if cols.completion_mask is None else cols.completion_mask,
        cols.inference_logprobs,
        cols.advantages,
        cols.routing,
        model_cfg,
        pad_id=pad_id,
    )


def _fits(cols: RolloutColumns, cfg: ModelConfig) -> bool:
    """Whether ``collate`` would take these rollouts' lengths and traces: every rollout at least
    one prompt and one completion token, and routing traces (on an MoE model only) of
    ``[moe_layers, top_k]`` distinct expert ids below ``num_experts`` per row. The columns' own
    lengths are checked when they are made, the token ids by :func:`padded_batch`."""
    if int(cols.prompt_lens.min()) < 1 or int(cols.completion_lens.min()) < 1:
        return False
    t = cols.routing
    if t is None:
        return True
    if not cfg.is_moe or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        return False
    return tuple(t.shape[1:]) == (cfg.num_moe_layers, cfg.top_k) and experts_fit(t.long(), cfg)
