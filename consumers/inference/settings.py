"""The inference workers' settings: ``[inference]`` as written in a run config, and what one
worker process is handed (that section, the model, and the run-wide values it needs). Torch-free."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from jetrl.bus.settings import Section
from jetrl.policy.settings import ModelSettings


class InferenceSettings(Section):
    engine: str = "titan"  # a name of consumers.inference.engine.ENGINES, or "module:attr"
    workers: int = Field(1, ge=1)
    precision: Literal["bf16", "fp32"] = "bf16"  # independent of the trainer's
    max_batch_tasks: int = Field(8, ge=1)  # tasks generated together (each is a whole group)
    top_p: float = Field(1.0, gt=0, le=1)
    threads: int = Field(1, ge=1)
    heartbeat_s: float = Field(2.0, gt=0)
    ack_wait_s: float = Field(30.0, gt=0)  # how soon tasks held by a dead worker go to another


class InferencePart(Section):
    """One worker process's input (``python -m jetrl.consumers.inference --settings``)."""

    inference: InferenceSettings = InferenceSettings()
    model: ModelSettings = ModelSettings()
    seed: int = 0
    weights_dir: str | None = None  # where the trainer writes weights, when not the object store
