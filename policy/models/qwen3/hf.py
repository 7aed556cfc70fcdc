"""Qwen3's side of a Hugging Face config.json: ``Qwen3ForCausalLM`` (dense) and
``Qwen3MoeForCausalLM`` read and written, with what a Qwen3-MoE has that jetrl does not compute."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jetrl.policy.models.config import ModelConfig
from jetrl.policy.models.family import hf_get

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
MOE = "Qwen3MoeForCausalLM"


def refusals(cfg: Mapping[str, Any], arch: str) -> dict[str, bool]:
    if arch != MOE:
        return {}
    return {
        "mlp_only_layers (dense layers among MoE ones)": bool(cfg.get("mlp_only_layers")),
        "decoder_sparse_step != 1": int(cfg.get("decoder_sparse_step", 1)) != 1,
    }


def from_hf(cfg: Mapping[str, Any], arch: str, common: dict[str, Any]) -> ModelConfig:
    if arch == MOE:
        return ModelConfig(
            **common,
            num_experts=int(hf_get(cfg, "num_experts", "num_local_experts")),
            top_k=int(cfg["num_experts_per_tok"]),
            moe_hidden_dim=int(cfg["moe_intermediate_size"]),
            route_norm=bool(cfg.get("norm_topk_prob", True)),
        )
    return ModelConfig(**common, dense_hidden_dim=int(cfg["intermediate_size"]))


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    if not cfg.is_moe:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "intermediate_size": cfg.dense_hidden_dim,
        }
    return {
        "architectures": [MOE],
        "model_type": "qwen3_moe",
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k,
        "moe_intermediate_size": cfg.moe_hidden_dim,
        "intermediate_size": cfg.moe_hidden_dim,
        "norm_topk_prob": cfg.route_norm,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
