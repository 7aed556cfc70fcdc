"""How a step's rollouts are shared among data-parallel ranks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jetrl.consumers.trainer.parallel.split import split_by_tokens


def test_longest_first_to_the_least_loaded_rank() -> None:
    assert split_by_tokens([5, 9, 1, 4, 8], 2) == [[1, 2, 3], [0, 4]]  # 14 and 13 tokens
    assert split_by_tokens([3], 2) == [[0], []]  # a rank may get nothing: it trains a masked token


@given(st.lists(st.integers(1, 500), max_size=40), st.integers(1, 6))
def test_every_rollout_once_balanced_and_the_same_every_time(lengths: list[int], ranks: int) -> None:
    shares = split_by_tokens(lengths, ranks)
    assert len(shares) == ranks
    assert sorted(i for s in shares for i in s) == list(range(len(lengths)))
    assert all(s == sorted(s) for s in shares)  # the step's order kept within a rank
    loads = [sum(lengths[i] for i in s) for s in shares]
    # Greedy longest-first: no rank exceeds another by more than the longest rollout.
    assert max(loads) - min(loads) <= max(lengths, default=0)
    assert split_by_tokens(lengths, ranks) == shares


def test_no_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        split_by_tokens([1], 0)
