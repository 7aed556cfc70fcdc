"""Sequence packing: several rollouts per row of a :class:`~jetrl.policy.train.TrainBatch`,
each seeing only itself, so that a packed batch gives the padded batch's per-token logprobs,
loss and gradients (up to float rounding) with far less padding.

Layout. Rollout ``k`` (``P`` prompt + ``C`` completion tokens, ``n = P + C``) placed in row ``r``
at offset ``s`` fills ``input_ids[r, s : s + n]``. The forward reads ``input_ids[:, :-1]`` and
position ``i`` predicts ``input_ids[:, i + 1]``, as in an unpacked batch, so:

* completion token ``j`` is predicted at position ``s + P - 1 + j``; those ``C`` positions are
  the rollout's ``loss_mask`` (minus its environment tokens), inference logprobs and per-token
  advantages. Its last token, position ``s + n - 1``, predicts the next rollout's first token
  (or padding): it is outside the mask, so nothing is trained across the boundary;
* ``positions`` restart at 0 at ``s``: the forward hands them to torchtitan 0.3.0's
  ``Decoder.forward(tokens, positions, attention_masks)``, which passes them to every layer's
  RoPE (it gathers its cos/sin table at each token's position, ``models/common/rope.py``), so no
  hook is needed. Padding gets position 0 throughout: always inside the RoPE table;
* ``doc_ids`` is ``k`` on the rollout's positions and -1 on padding. jetrl's CPU attention
  (:class:`~jetrl.policy.models.CachedSDPA`) receives it as a
  :class:`~jetrl.policy.models.PackedMask`: causal and same-document. torchtitan's flex/varlen
  attention derive their document masks from ``positions`` instead (a document starts where its
  position is 0), which agrees on every real token; padding may then be split into one-token
  documents, harmless since no real token reads it;
* the routing trace's ``P + C - 1`` rows go to positions ``s .. s + n - 2``; every other position
  (a rollout's last token, padding) routes to experts ``0 .. top_k - 1``, as
  :func:`~jetrl.policy.routing.pad_traces` does for padding: valid, distinct ids whose outputs
  reach no loss token.

Rows are built by first-fit decreasing on rollout length: deterministic for a given sequence of
rollouts, never splitting one; a rollout longer than ``row_len`` gets a row of its own. The batch
is as wide as its fullest row.

Packed and padded results are equal only up to float rounding, not bit for bit: the matmuls see
other shapes and SDPA a boolean mask instead of its causal kernel, which changes the order of
float summation. Unpacked batches are untouched by all of this.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from jetrl.policy.columns import RolloutColumns, collate_columns
from jetrl.policy.models import ModelConfig
from jetrl.policy.train import Rollout, TrainBatch, check_rollouts, collate


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one rollout lies in a packed batch: row, offset of its first token, lengths."""

    row: int
    start: int
    prompt_len: int
    completion_len: int

    @property
    def length(self) -> int:
        return self.prompt_len + self.completion_len

    @property
    def completion_pos(self) -> int:
        """Forward position that predicts the first completion token."""
        return self.start + self.prompt_len - 1


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """How :func:`collate_packed` placed the rollouts: ``placements[k]`` is rollout ``k``'s (in
    the order given), ``rows[r]`` the rollouts of row ``r`` left to right."""

    placements: tuple[Placement, ...]
    rows: tuple[tuple[int, ...], ...]
    width: int  # L: tokens per row of input_ids

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def padding_tokens(self) -> int:
        return self.num_rows * self.width - sum(p.length for p in self.placements)

    def _check(self, values: torch.Tensor) -> tuple[int, int]:
        """``[B, L-1]``, which the forward's outputs ``values`` must begin with."""
        want = (self.num_rows, self.width - 1)
        if tuple(values.shape[:2]) != want:
            raise ValueError(
                f"values {tuple(values.shape)} do not match the packed layout's [B, L-1] = {want}"
            )
        return want

    def per_rollout(self, values: torch.Tensor, mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Each rollout's completion-token slice of ``values`` ``[B, L-1, ...]`` (the forward's
        outputs: logprobs, token stats), in the original rollout order: ``C`` rows each, the
        slice an unpacked batch gives as ``values[i, P-1 : P-1+C]``. With ``mask`` (the batch's
        ``loss_mask``) only the masked tokens of each slice, as ``lp[i][loss_mask[i]]``."""
        want = self._check(values)
        if mask is not None and tuple(mask.shape) != want:
            raise ValueError(f"mask {tuple(mask.shape)} does not match the packed layout's [B, L-1] = {want}")
        out = []
        for p in self.placements:
            sl = values[p.row, p.completion_pos : p.completion_pos + p.completion_len]
            if mask is not None:
                sl = sl[mask[p.row, p.completion_pos : p.completion_pos + p.completion_len].bool()]
            out.append(sl)
        return out

    def completions(self, values: torch.Tensor) -> torch.Tensor:
        """:meth:`per_rollout`'s slices joined, in the same order, by one gather: a step holds
        hundreds of rollouts, and a slice each is a dispatch each."""
        want = self._check(values)
        n = len(self.placements)
        clen = np.fromiter((p.completion_len for p in self.placements), np.int64, n)
        first = np.fromiter((p.row * want[1] + p.completion_pos for p in self.placements), np.int64, n)
        # Token j of placement k lies at first[k] + j of the flattened [B * (L-1)] positions.
        ends = np.cumsum(clen)
        flat = np.arange(int(ends[-1]) if n else 0, dtype=np.int64) + np.repeat(first - (ends - clen), clen)
        return values.reshape(-1, *values.shape[2:])[torch.from_numpy(flat)]


def pack_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """First-fit decreasing: indices of ``lengths`` grouped into rows of at most ``row_len``
    tokens (a longer item alone in its row). Ties are broken by index, so the result is a
    function of the input alone."""
    if isinstance(row_len, bool) or not isinstance(row_len, int):
        raise ValueError(f"row_len must be an int, got {type(row_len).__name__}")
    if row_len < 2:
        raise ValueError(
            f"row_len must be >= 2 (a rollout has >= 1 prompt and 1 completion token), got {row_len}"
        )
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"length {i} must be a positive int, got {n!r}")
    rows: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        # A rollout over row_len fits no row and opens its own, which, being over, takes no other.
        for r, u in enumerate(used):
            if u + n <= row_len:
                rows[r].append(i)
                used[r] += n
                break
        else:
            rows.append([i])
            used.append(n)
    return rows


def collate_packed(
    rollouts: Sequence[Rollout], model_cfg: ModelConfig, row_len: int, pad_id: int = 0
) -> tuple[TrainBatch, PackedLayout]:
    """Pack rollouts into rows of at most ``row_len`` tokens (see the module docstring), checking
    them as :func:`~jetrl.policy.train.collate` does. Returns the batch, to pass to
    ``compute_logprobs`` / ``train_step`` like any other, and its layout, to take each rollout's
    values back out of the ``[B, L-1]`` outputs (:meth:`PackedLayout.per_rollout`)."""
    has_traces = check_rollouts(rollouts, model_cfg)
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
    rows = pack_rows(lengths, row_len)

    placements: list[Placement | None] = [None] * len(rollouts)
    width = 0
    for row, members in enumerate(rows):
        start = 0
        for k in members:
            placements[k] = Placement(
                row, start, len(rollouts[k].prompt_ids), len(rollouts[k].completion_ids)
            )
            start += lengths[k]
        width = max(width, start)
    placed = tuple(p for p in placements if p is not None)
    layout = PackedLayout(placed, tuple(tuple(m) for m in rows), width)

    b, n_pos = len(rows), width - 1
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, n_pos), dtype=torch.bool)
    inf_lp = torch.zeros((b, n_pos), dtype=torch.float32)
    adv = torch.zeros((b, n_pos), dtype=torch.float32)
    positions = torch.zeros((b, n_pos), dtype=torch.long)
    doc_ids = torch.full((b, n_pos), -1, dtype=torch.long)
    routing = None
    if has_traces:
        top_k = model_cfg.top_k
        routing = (
            torch.arange(top_k, dtype=torch.long).expand(b, n_pos, model_cfg.num_moe_layers, top_k).clone()
        )

    for k, (ro, p) in enumerate(zip(rollouts, placed, strict=True)):
        s, n, c = p.start, p.length, p.completion_len
        ids[p.row, s : s + p.prompt_len] = torch.as_tensor(list(ro.prompt_ids), dtype=torch.long)
        ids[p.row, s + p.prompt_len : s + n] = torch.as_tensor(list(ro.completion_ids), dtype=torch.long)
        # The rollout's forward positions: all n tokens, but the last one only if a position
        # follows it in the row (a rollout ending the widest row has just n - 1).
        end = min(s + n, n_pos)
        positions[p.row, s:end] = torch.arange(end - s)
        doc_ids[p.row, s:end] = k
        adv[p.row, s:end] = float(ro.advantage)
        cp = p.completion_pos
        if ro.completion_mask is None:
            mask[p.row, cp : cp + c] = True
        else:
            mask[p.row, cp : cp + c] = torch.as_tensor(list(ro.completion_mask), dtype=torch.bool)
        inf_lp[p.row, cp : cp + c] = ro.inference_logprobs.float()
        if routing is not None:
            assert ro.routing is not None  # check_rollouts: all or none
            routing[p.row, s : s + n - 1] = ro.routing.long()

    if int(ids.max()) >= model_cfg.vocab_size or int(ids.min()) < 0:
        raise ValueError(f"token ids must lie in [0, {model_cfg.vocab_size})")
    if int(positions.max()) >= model_cfg.max_seq_len:
        far = int(doc_ids[positions == positions.max()][0])
        raise ValueError(
            f"rollout {far}: {lengths[far]} tokens reach RoPE position {int(positions.max())}, beyond "
            f"{model_cfg.name}'s max_seq_len {model_cfg.max_seq_len}"
        )
    batch = TrainBatch(ids, mask, inf_lp, adv, routing, positions=positions, doc_ids=doc_ids)
    return batch, layout


def padded_layout(rollouts: Sequence[Rollout]) -> PackedLayout:
    """The layout of :func:`~jetrl.policy.train.collate`'s batch: rollout ``i`` alone in row
    ``i``, from position 0."""
    lens: Iterable[tuple[int, int]]
    if isinstance(rollouts, RolloutColumns):
        lens = zip(rollouts.prompt_lens.tolist(), rollouts.completion_lens.tolist(), strict=True)
    else:
        lens = ((len(r.prompt_ids), len(r.completion_ids)) for r in rollouts)
    placements = tuple(Placement(i, 0, p, c) for i, (p, c) in enumerate(lens))
    return PackedLayout(
        placements, tuple((i,) for i in range(len(rollouts))), max(p.length for p in placements)
    )


def collate_for(
    rollouts: Sequence[Rollout], model_cfg: ModelConfig, pack_tokens: int = 0
) -> tuple[TrainBatch, PackedLayout]:
    """The engines' one way in: rows of up to ``pack_tokens`` tokens holding several rollouts,
    or (0) one rollout per right-padded row, bit for bit the batch trained before packing."""
    if pack_tokens:
        return collate_packed(rollouts, model_cfg, pack_tokens)
    if isinstance(rollouts, RolloutColumns):
        return collate_columns(rollouts, model_cfg), padded_layout(rollouts)
    return collate(rollouts, model_cfg), padded_layout(rollouts)
