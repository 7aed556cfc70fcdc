"""Rollouts as joined columns (policy/columns.py): the same batch as the list, bit for bit, and
the same errors, each one named."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from jetrl.policy.columns import RolloutColumns, completion_length
from jetrl.policy.models import ModelConfig, get_config
from jetrl.policy.packing import collate_for
from jetrl.policy.routing import TraceError
from jetrl.policy.train import Rollout, TrainBatch, collate
from tests.support.parallel_run import make_rollouts


def _same(a: TrainBatch, b: TrainBatch) -> None:
    for f in dataclasses.fields(TrainBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert (x is None) == (y is None), f.name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), f.name


def _rollouts(cfg: ModelConfig, seed: int, *, masks: str) -> list[Rollout]:
    """make_rollouts' mixed lengths and traces; masks on every rollout, on some, or none."""
    rolls = make_rollouts(cfg, n=9, seed=seed)
    if masks == "none":
        return [dataclasses.replace(r, completion_mask=None) for r in rolls]
    if masks == "some":
        return [
            r if i % 3 == 1 else dataclasses.replace(r, completion_mask=None) for i, r in enumerate(rolls)
        ]
    return rolls


@pytest.mark.parametrize("model", ["tiny-moe", "tiny-dense"])
@pytest.mark.parametrize("masks", ["every", "some", "none"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_columns_collate_to_the_lists_batch_and_index_to_its_rollouts(
    model: str, masks: str, seed: int
) -> None:
    cfg = get_config(model)
    rolls = _rollouts(cfg, seed, masks=masks)
    cols = RolloutColumns.of(rolls)
    batch, layout = collate_for(cols, cfg)
    want, want_layout = collate_for(rolls, cfg)
    _same(batch, want)
    assert layout == want_layout
    assert completion_length(cols) == completion_length(rolls) == sum(len(r.completion_ids) for r in rolls)
    assert len(cols) == len(rolls)
    for got, r in zip(cols, rolls, strict=True):
        assert list(got.prompt_ids) == list(r.prompt_ids)
        assert list(got.completion_ids) == list(r.completion_ids)
        assert torch.equal(got.inference_logprobs, r.inference_logprobs)
        assert got.advantage == r.advantage
        assert (got.routing is None) == (r.routing is None)
        if r.routing is not None:
            assert got.routing is not None and torch.equal(got.routing, r.routing)
        mask = [True] * len(r.completion_ids) if r.completion_mask is None else list(r.completion_mask)
        if got.completion_mask is None:
            assert masks == "none"
        else:
            assert list(got.completion_mask) == mask
    # A streaming step's micro-batches: runs of consecutive rollouts, as columns.
    for lo, hi in [(0, 4), (4, 9), (3, 3), (8, 20)]:
        part = cols[lo:hi]
        assert isinstance(part, RolloutColumns) and len(part) == len(rolls[lo:hi])
        if len(part):
            _same(collate_for(part, cfg)[0], collate(rolls[lo:hi], cfg))
    assert [r.advantage for r in cols[::2]] == [r.advantage for r in rolls[::2]]


def test_what_collate_refuses_it_refuses_naming_the_rollout() -> None:
    cfg = get_config("tiny-moe")
    rolls = make_rollouts(cfg, n=5, seed=4)
    bad_trace = rolls[3].routing
    assert bad_trace is not None
    twice = bad_trace.clone()
    twice[0, 0, 1] = twice[0, 0, 0]  # one expert twice in a row of the trace
    out_of_vocab = [cfg.vocab_size, *list(rolls[2].completion_ids)[1:]]
    cases: list[tuple[list[Rollout], type[Exception]]] = [
        ([*rolls[:3], dataclasses.replace(rolls[3], routing=twice), rolls[4]], TraceError),
        ([*rolls[:2], dataclasses.replace(rolls[2], completion_ids=out_of_vocab), *rolls[3:]], ValueError),
    ]
    for rs, err in cases:
        with pytest.raises(err) as want:
            collate(rs, cfg)
        with pytest.raises(err) as got:
            collate_for(RolloutColumns.of(rs), cfg)
        assert str(got.value) == str(want.value)
    with pytest.raises(TraceError):  # traces on an MoE model that was given a dense one's
        collate_for(RolloutColumns.of(rolls), get_config("tiny-dense"))


def test_columns_that_do_not_fit_their_lengths_are_refused() -> None:
    cfg = get_config("tiny-moe")
    cols = RolloutColumns.of(make_rollouts(cfg, n=3, seed=0))
    with pytest.raises(ValueError, match="inference_logprobs"):
        RolloutColumns(
            prompt_lens=cols.prompt_lens,
            completion_lens=cols.completion_lens,
            prompts=cols.prompts,
            completions=cols.completions,
            inference_logprobs=cols.inference_logprobs[1:],
            advantages=cols.advantages,
            routing=cols.routing,
        )
    with pytest.raises(ValueError, match="every rollout's or none's"):
        RolloutColumns.of(
            [*make_rollouts(cfg, n=2), dataclasses.replace(make_rollouts(cfg, n=1)[0], routing=None)]
        )
    assert np.array_equal(cols.prompt_lens, [len(r.prompt_ids) for r in cols])
