"""The recorder's settings: what its process is handed (``--settings``). Torch-free."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from jetrl.bus.settings import Section

DEFAULT_DURABLE = "recorder"
# Keeping up with the log, the seconds a batch gathers what comes (each a transaction: a few
# events each made ~5 a step of the demo, the writer then a third of a core; 0: no wait)
DEFAULT_GATHER_S = 0.25


class RecorderPart(Section):
    db: str  # store URL: sqlite:///path or postgresql+psycopg://...
    durable: str = DEFAULT_DURABLE  # its durable consumer on the run's log
    batch: int = Field(2000, ge=1)  # events fetched and committed together (at most)
    gather_s: float = Field(DEFAULT_GATHER_S, ge=0)  # see DEFAULT_GATHER_S
    # where its transactions run (consumers/recorder/writer.py): a child process of its own, so
    # that fetching and writing use two cores; "thread" or "inline" keep them in its process
    writer: Literal["process", "thread", "inline"] = "process"
