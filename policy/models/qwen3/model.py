"""Qwen3 (dense, and MoE with ``num_experts > 0``) as torchtitan's ``Qwen3Model``: fused Q/K/V
with QK norm, cos/sin RoPE, and for MoE torchtitan's token-choice router with jetrl's experts in
the weights' dtype (policy/models/layers.py)."""

from __future__ import annotations

import dataclasses
import math

from jetrl.policy.models.config import ModelConfig
from jetrl.policy.models.layers import (
    ExpertsInWeightDtype,
    decoder_parts,
    inner_attention,
    linear_init,
    normal_init,
    rms_norm,
)
from jetrl.policy.titan import (
    CosSinRoPE,
    Qwen3Model,
    Qwen3StateDictAdapter,
    Qwen3TransformerBlock,
    make_ffn_config,
    make_gqa_config,
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)


def adapter(cfg: ModelConfig) -> Qwen3StateDictAdapter:
    """torchtitan's adapter between Qwen3's canonical names and Hugging Face's."""
    return Qwen3StateDictAdapter(titan_config(cfg), None)


def titan_config(cfg: ModelConfig) -> Qwen3Model.Config:
    """The torchtitan config of a Qwen3 (nothing is built)."""
    std = cfg.init_std
    # Residual-branch outputs get depth-scaled init, as in Qwen3/Megatron practice.
    out_std = std / math.sqrt(2 * cfg.n_layers)
    inner = inner_attention(cfg.attention)
    rope = CosSinRoPE.Config(dim=cfg.head_dim, max_seq_len=cfg.max_seq_len, theta=cfg.rope_theta)
    layers = []
    for _ in range(cfg.n_layers):
        attention = make_gqa_config(
            dim=cfg.dim,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            wqkv_param_init=linear_init(std),
            wo_param_init=linear_init(out_std),
            inner_attention=inner,
            fuse_qkv=True,
            rope=rope,
            qk_norm=rms_norm(cfg.head_dim, cfg.norm_eps),
        )
        moe = ffn = None
        if cfg.is_moe:
            moe = make_moe_config(
                num_experts=cfg.num_experts,
                load_balance_coeff=cfg.load_balance_coeff,
                router=make_router_config(
                    dim=cfg.dim,
                    num_experts=cfg.num_experts,
                    gate_param_init=linear_init(std),
                    top_k=cfg.top_k,
                    score_func=cfg.score_func,
                    route_norm=cfg.route_norm,
                ),
                routed_experts=make_routed_experts_config(
                    dim=cfg.dim,
                    hidden_dim=cfg.moe_hidden_dim,
                    num_experts=cfg.num_experts,
                    top_k=cfg.top_k,
                    param_init={
                        "w1_EFD": normal_init(std),
                        "w3_EFD": normal_init(std),
                        "w2_EDF": normal_init(out_std),
                    },
                    comm_backend="standard",
                ),
            )
            routed = moe.routed_experts
            grouped = routed.inner_experts
            moe = dataclasses.replace(
                moe,
                routed_experts=dataclasses.replace(
                    routed,
                    inner_experts=ExpertsInWeightDtype.Config(
                        dim=grouped.dim,
                        hidden_dim=grouped.hidden_dim,
                        num_experts=grouped.num_experts,
                        param_init=grouped.param_init,
                    ),
                ),
            )
        else:
            ffn = make_ffn_config(
                dim=cfg.dim,
                hidden_dim=cfg.dense_hidden_dim,
                w1_param_init=linear_init(std),
                w2w3_param_init=linear_init(std),
            )
        layers.append(
            Qwen3TransformerBlock.Config(
                attention_norm=rms_norm(cfg.dim, cfg.norm_eps),
                ffn_norm=rms_norm(cfg.dim, cfg.norm_eps),
                attention=attention,
                moe=moe,
                feed_forward=ffn,
            )
        )
    return Qwen3Model.Config(**decoder_parts(cfg), layers=layers)
