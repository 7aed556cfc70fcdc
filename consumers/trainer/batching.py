"""How a training batch is filled from the ready groups of several environments (pure).

Each environment of the run (a ``(tenant, env)`` pair of ``[[envs]]``) has a share of every
batch: :func:`split_slots` splits the batch's slots by share with largest-remainder rounding,
in exact arithmetic. :func:`fill_batch` fills each environment's slots with its ready groups in
arrival order, then gives the slots an environment cannot fill to the other ready groups in
arrival order: work-conserving, so a slow tenant never holds a step up, and a flooding one
never takes more than its share while the others have work. :func:`more_groups` fills a step
the same way a few groups at a time, as a streaming trainer takes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from fractions import Fraction
from typing import TypeVar

G = TypeVar("G")
K = TypeVar("K", bound=Hashable)


def split_slots(slots: int, shares: Mapping[K, float], rotate: int = 0) -> dict[K, int]:
    """``slots`` split in proportion to ``shares`` (largest remainder). Ties in the remainder
    go to keys in ``shares`` order starting at ``rotate`` (mod the number of keys), so that
    over successive batches equal remainders take turns."""
    keys = list(shares)
    if not keys or slots <= 0:
        return dict.fromkeys(keys, 0)
    total = sum(Fraction(shares[k]) for k in keys)
    exact = {k: Fraction(shares[k]) * slots / total for k in keys}
    out = {k: math.floor(exact[k]) for k in keys}
    n = len(keys)
    order = sorted(range(n), key=lambda i: (-(exact[keys[i]] - out[keys[i]]), (i - rotate) % n))
    for i in order[: slots - sum(out.values())]:
        out[keys[i]] += 1
    return out


def fill_batch(
    ready: Sequence[G],
    slots: int,
    shares: Mapping[K, float],
    key: Callable[[G], K],
    rotate: int = 0,
) -> list[G]:
    """Up to ``slots`` of ``ready`` (in arrival order), in arrival order. Without ``shares``:
    the first ``slots``. Groups whose key has no share only take slots left over."""
    if not shares:
        return list(ready[:slots])
    return _filled(ready, slots, split_slots(slots, shares, rotate), key, leftover=True)


def more_groups(
    ready: Sequence[G],
    taken: Sequence[G],
    slots: int,
    shares: Mapping[K, float],
    key: Callable[[G], K],
    rotate: int = 0,
) -> list[G]:
    """What a step of ``slots`` groups that holds ``taken`` already takes of ``ready`` now (a
    streaming trainer's step, filled as groups arrive): each group within what ``taken`` left
    of its environment's share; once ``ready`` can complete the step, its remaining slots as
    :func:`fill_batch` fills them (work-conserving). With ``taken`` empty and enough ready, the
    batch :func:`fill_batch` would give."""
    need = slots - len(taken)
    if need <= 0:
        return []
    if not shares:
        return list(ready[:need])
    quota = split_slots(slots, shares, rotate)
    for g in taken:
        k = key(g)
        if k in quota:
            quota[k] -= 1
    return _filled(ready, need, quota, key, leftover=len(ready) >= need)


def _filled(
    ready: Sequence[G], slots: int, quota: dict[K, int], key: Callable[[G], K], *, leftover: bool
) -> list[G]:
    """Up to ``slots`` of ``ready`` in arrival order: each key's up to its ``quota``, then (with
    ``leftover``) the first others until the slots are full."""
    taken: set[int] = set()
    for i, g in enumerate(ready):
        if len(taken) >= slots:
            break
        k = key(g)
        if quota.get(k, 0) > 0:
            quota[k] -= 1
            taken.add(i)
    for i in range(len(ready)):
        if not leftover or len(taken) >= slots:
            break
        taken.add(i)
    return [ready[i] for i in sorted(taken)]
