"""The model a run trains and serves: its settings, torch-free so that any config can be read
and validated without importing torch or torchtitan."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ModelSettings(BaseModel):
    """``[model]``: a config of ``jetrl.policy.models.CONFIGS`` and its overrides."""

    model_config = ConfigDict(extra="forbid")

    name: str = "tiny-moe"
    overrides: dict[str, Any] = Field(default_factory=dict)
    tokenizer: str = "char"  # a name of jetrl.policy.tokenizer.TOKENIZERS
