"""Settings of the event log and its payloads (``[bus]``), and the base of every settings
section: unknown keys are refused, never ignored."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from jetrl.bus.streams import GiB, StreamLimits


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BusSettings(Section):
    max_gib: float = Field(8.0, gt=0)  # the run's log
    payload_max_gib: float = Field(32.0, gt=0)  # the run's payload bucket
    # Where weights travel: the run's object store (any machine), or files in the run directory
    # (every process on one filesystem; far faster for weights of tens of MB and more).
    weights_store: Literal["objstore", "file"] = "objstore"

    def limits(self) -> StreamLimits:
        return StreamLimits(
            max_bytes=int(self.max_gib * GiB), payload_max_bytes=int(self.payload_max_gib * GiB)
        )
