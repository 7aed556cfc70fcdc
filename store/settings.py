"""Settings of the step-history store (``[store]``)."""

from __future__ import annotations

from jetrl.bus.settings import Section


class StoreSettings(Section):
    db: str | None = None  # SQLAlchemy URL; default: SQLite file <run dir>/store.db
    recorder: bool = True
