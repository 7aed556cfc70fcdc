"""Llama's side of a Hugging Face config.json: ``LlamaForCausalLM`` read and written, Llama 3's
RoPE frequency scaling (rope_type "llama3") included."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jetrl.policy.models.config import ModelConfig
from jetrl.policy.models.family import rope_kind, rope_params

ARCHITECTURES = {"LlamaForCausalLM": "llama"}


def refusals(cfg: Mapping[str, Any], arch: str) -> dict[str, bool]:
    return {}  # what a Llama may ask that jetrl refuses is asked of every family (policy/models)


def rope_scaling(cfg: Mapping[str, Any]) -> tuple[float, float, float, int] | None:
    if rope_kind(cfg) != "llama3":
        return None
    p = rope_params(cfg)
    return (
        float(p["factor"]),
        float(p.get("low_freq_factor", 1.0)),
        float(p.get("high_freq_factor", 4.0)),
        int(p["original_max_position_embeddings"]),
    )


def from_hf(cfg: Mapping[str, Any], arch: str, common: dict[str, Any]) -> ModelConfig:
    return ModelConfig(
        **common,
        dense_hidden_dim=int(cfg["intermediate_size"]),
        family="llama",
        llama_rope_scaling=rope_scaling(cfg),
    )


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "intermediate_size": cfg.dense_hidden_dim,
    }
    if cfg.llama_rope_scaling is not None:
        factor, low, high, original = cfg.llama_rope_scaling
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }
    return out
