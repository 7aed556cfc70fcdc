"""The Llama family (Llama 3.x, SmolLM2 and other ``LlamaForCausalLM`` checkpoints) as torchtitan's
``Llama3Model``: Qwen3's dense block without QK norm, unfused Q/K/V, and RoPE on adjacent pairs
(torchtitan's ``ComplexRoPE``, with Llama 3's frequency scaling, held as real pairs by
:class:`~jetrl.policy.models.layers.RealPairRoPE`) whose Q/K layout torchtitan's
``Llama3StateDictAdapter`` permutes to and from Hugging Face's."""

from __future__ import annotations

import math
from typing import Any

from jetrl.policy.models.config import ModelConfig
from jetrl.policy.models.layers import RealPairRoPE, decoder_parts, inner_attention, linear_init, rms_norm
from jetrl.policy.titan import (
    Llama3Model,
    Llama3StateDictAdapter,
    Llama3TransformerBlock,
    make_ffn_config,
    make_gqa_config,
)


def adapter(cfg: ModelConfig) -> Llama3StateDictAdapter:
    """torchtitan's adapter between Llama's canonical names and Hugging Face's (Q/K permuted)."""
    return Llama3StateDictAdapter(titan_config(cfg), None)


def titan_config(cfg: ModelConfig) -> Llama3Model.Config:
    """The torchtitan config of a Llama (nothing is built)."""
    std = cfg.init_std
    out_std = std / math.sqrt(2 * cfg.n_layers)
    inner = inner_attention(cfg.attention)
    scaling: dict[str, Any] = {}
    if cfg.llama_rope_scaling is not None:
        factor, low, high, original = cfg.llama_rope_scaling
        scaling = {
            "scaling": "llama",
            "scaling_factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }
    rope = RealPairRoPE.Config(dim=cfg.head_dim, max_seq_len=cfg.max_seq_len, theta=cfg.rope_theta, **scaling)
    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=rms_norm(cfg.dim, cfg.norm_eps),
            ffn_norm=rms_norm(cfg.dim, cfg.norm_eps),
            attention=make_gqa_config(
                dim=cfg.dim,
                n_heads=cfg.n_heads,
                n_kv_heads=cfg.n_kv_heads,
                head_dim=cfg.head_dim,
                wqkv_param_init=linear_init(std),
                wo_param_init=linear_init(out_std),
                inner_attention=inner,
                fuse_qkv=False,  # the names Llama3StateDictAdapter maps
                rope=rope,
            ),
            feed_forward=make_ffn_config(
                dim=cfg.dim,
                hidden_dim=cfg.dense_hidden_dim,
                w1_param_init=linear_init(std),
                w2w3_param_init=linear_init(out_std),
            ),
        )
        for _ in range(cfg.n_layers)
    ]
    return Llama3Model.Config(**decoder_parts(cfg), layers=layers)
