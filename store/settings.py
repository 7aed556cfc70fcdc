"""Settings of the step-history store (``[store]``)."""

from __future__ import annotations

from pydantic import Field

from jetrl.bus.settings import Section


class StoreSettings(Section):
    db: str | None = None  # SQLAlchemy URL; default: SQLite file <run dir>/store.db
    recorder: bool = True
    # Keeping up with the log, how long the recorder's batch gathers what comes before it is
    # committed as one transaction (docs/store.md); none: the recorder's own default
    recorder_gather_s: float | None = Field(None, ge=0)
