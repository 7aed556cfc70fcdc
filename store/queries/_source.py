"""What every read model of the store shares: where it reads (a Store or an open Connection) and
the tables it reads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from jetrl.store import schema as sc
from jetrl.store.db import Store

Source = Store | sa.Connection

R = sc.Rollout.__table__
T = sc.Task.__table__
G = sc.Generation.__table__
S = sc.Step.__table__
SR = sc.StepRollout.__table__
PV = sc.PolicyVersion.__table__
W = sc.Worker.__table__
DL = sc.DeadLetter.__table__
EV = sc.Evaluation.__table__
AL = sc.Alert.__table__
RUNS = sc.Run.__table__
OFF = sc.OFFSETS


@contextmanager
def connection(src: Source) -> Iterator[sa.Connection]:
    if isinstance(src, sa.Connection):
        yield src
    else:
        with src.read() as conn:
            yield conn


def as_float(v: Any) -> float | None:
    return None if v is None else float(v)
