"""The Qwen3 family: dense and MoE (torchtitan's ``qwen3``), its named configs and checkpoints."""

from __future__ import annotations

from jetrl.policy.models.config import ModelConfig
from jetrl.policy.models.family import ModelFamily
from jetrl.policy.models.qwen3 import hf, model

# Small configs run on a laptop CPU; the published sizes are config entries for GPU trainers
# (tests check them against torchtitan's own registry).
_TINY_MOE = ModelConfig(
    name="tiny-moe",
    vocab_size=64,
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    max_seq_len=256,
    num_experts=8,
    top_k=2,
    moe_hidden_dim=64,
    rope_theta=10_000.0,
)
_QWEN3_30B = ModelConfig(
    name="qwen3-30b-a3b",
    vocab_size=151936,
    dim=2048,
    n_layers=48,
    n_heads=32,
    n_kv_heads=4,
    head_dim=128,
    max_seq_len=40960,
    num_experts=128,
    top_k=8,
    moe_hidden_dim=768,
    attention="flex",
    load_balance_coeff=1e-3,
)
CONFIGS: dict[str, ModelConfig] = {
    "tiny-moe": _TINY_MOE,
    "tiny-moe-4l": _TINY_MOE.replace(name="tiny-moe-4l", n_layers=4),
    "tiny-dense": _TINY_MOE.replace(
        name="tiny-dense", num_experts=0, top_k=0, moe_hidden_dim=0, dense_hidden_dim=128
    ),
    "qwen3-30b-a3b": _QWEN3_30B,
    "qwen3-235b-a22b": _QWEN3_30B.replace(
        name="qwen3-235b-a22b", dim=4096, n_layers=94, n_heads=64, moe_hidden_dim=1536, rope_theta=5_000_000.0
    ),
}

FAMILY = ModelFamily(
    name="qwen3",
    architectures=hf.ARCHITECTURES,
    configs=CONFIGS,
    titan_config=model.titan_config,
    adapter=model.adapter,
    rope_kinds=("default",),
    refusals=hf.refusals,
    from_hf=hf.from_hf,
    to_hf=hf.to_hf,
)
