"""The model a run trains and serves: its settings, torch-free so that any config can be read
and validated without importing torch or torchtitan."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from jetrl.plugins import TOKENIZERS


class ModelSettings(BaseModel):
    """``[model]``: a config of ``jetrl.policy.models.CONFIGS`` and its overrides."""

    model_config = ConfigDict(extra="forbid")

    name: str = "tiny-moe"
    # A local Hugging Face checkpoint directory (config.json, safetensors, tokenizer files): the
    # architecture and the initial weights come from it (policy/hf.py) and ``name`` is only a
    # label. Never a hub id: nothing is downloaded.
    hf_path: str | None = None
    overrides: dict[str, Any] = Field(default_factory=dict)
    # A tokenizer of jetrl/plugins.py ("char"; "hf": the checkpoint's own, with its chat
    # template) or "package.module:attr"; default: "hf" with hf_path, else "char".
    tokenizer: str | None = None

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, v: str | None) -> str | None:
        return v if v is None else TOKENIZERS.check(v)

    @property
    def tokenizer_kind(self) -> str:
        return self.tokenizer or ("hf" if self.hf_path else "char")
