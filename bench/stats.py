"""Figures the benches share."""

from __future__ import annotations

from collections.abc import Sequence


def pct(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank), NaN for none."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]
