"""Multi-turn rollouts: the environment's tokens are context, never trained on."""

from __future__ import annotations

import pytest
import torch

from jetrl.policy.models import get_config
from jetrl.policy.train import Rollout, collate


def test_completion_mask_selects_the_loss_tokens() -> None:
    cfg = get_config("tiny-dense")
    r = Rollout(
        prompt_ids=[1, 5, 6],
        completion_ids=[7, 8, 9, 10, 2],
        inference_logprobs=torch.full((5,), -0.5),
        advantage=1.0,
        completion_mask=[True, True, False, False, True],
    )
    plain = Rollout(
        prompt_ids=[1, 5], completion_ids=[7, 2], inference_logprobs=torch.full((2,), -0.1), advantage=-1.0
    )
    b = collate([r, plain], cfg)
    # Position P - 1 + j predicts completion token j.
    assert b.loss_mask[0].tolist() == [False, False, True, True, False, False, True]
    assert b.loss_mask[1].tolist() == [False, True, True, False, False, False, False]
    assert b.num_tokens == 3 + 2
    with pytest.raises(ValueError, match="completion_mask has 2 entries for 5 tokens"):
        collate([Rollout([1], [3, 4, 5, 6, 2], torch.zeros(5), 0.0, completion_mask=[True, False])], cfg)
