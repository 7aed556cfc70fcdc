"""Which data-parallel rank trains which rollouts of a step.

Longest first, each to the rank with the fewest tokens so far (ties: the lowest rank), so a
step's ranks finish together; the same rollouts in the same order always split the same way,
which replay relies on. Within a rank, rollouts keep the step's order.
"""

from __future__ import annotations

from collections.abc import Sequence


def split_by_tokens(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """Indices of ``lengths`` per rank (each list ascending); a rank may get none when there
    are fewer rollouts than ranks."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    load = [0] * ranks
    out: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        load[r] += lengths[i]
        out[r].append(i)
    return [sorted(ix) for ix in out]
