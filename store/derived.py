"""Columns computed from other columns of the same row, each stated once as a small expression
that is both evaluated in Python (the fold, over a row dict) and rendered as SQL (the upsert,
over the row's columns as they will be after the update).

The Python side follows SQL's NULL rules, so a row folded in Python equals the same row
updated in the database: arithmetic with a NULL operand is NULL, COALESCE takes the first
non-NULL operand.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import sqlalchemy as sa

__all__ = ["Coalesce", "Col", "Derived", "Expr", "Minus"]

Value = int | float | None
SqlCols = Mapping[str, sa.ColumnElement[Any]]


class Expr(Protocol):
    def value(self, row: Mapping[str, Any]) -> Value: ...

    def sql(self, cols: SqlCols) -> sa.ColumnElement[Any]: ...


@dataclass(frozen=True, slots=True)
class Col:
    name: str

    def value(self, row: Mapping[str, Any]) -> Value:
        v: Value = row[self.name]
        return v

    def sql(self, cols: SqlCols) -> sa.ColumnElement[Any]:
        return cols[self.name]


@dataclass(frozen=True, slots=True)
class Minus:
    left: Expr
    right: Expr

    def value(self, row: Mapping[str, Any]) -> Value:
        a, b = self.left.value(row), self.right.value(row)
        return None if a is None or b is None else a - b

    def sql(self, cols: SqlCols) -> sa.ColumnElement[Any]:
        return self.left.sql(cols) - self.right.sql(cols)


@dataclass(frozen=True, slots=True)
class Coalesce:
    first: Expr
    otherwise: Expr

    def value(self, row: Mapping[str, Any]) -> Value:
        v = self.first.value(row)
        return self.otherwise.value(row) if v is None else v

    def sql(self, cols: SqlCols) -> sa.ColumnElement[Any]:
        return sa.func.coalesce(self.first.sql(cols), self.otherwise.sql(cols))


@dataclass(frozen=True, slots=True)
class Derived:
    """``column`` holds ``expr`` of the row's other columns, recomputed whenever the row is written."""

    column: str
    expr: Expr
