"""The published Qwen3 checkpoints' config.json files read as torchtitan's own registry has
them: the configs shipped for real weights (configs/qwen3-*.toml) build the right model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jetrl.policy.hf import expected_hf_shapes, read_config
from jetrl.policy.models import to_titan_config
from jetrl.policy.titan import qwen3_configs

# The fields of the published config.json files that jetrl reads (values as published).
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
}


@pytest.mark.parametrize(("published", "theirs"), [(QWEN3_0_6B, "0.6B"), (QWEN3_30B_A3B, "30B-A3B")])
def test_published_config_reads_as_torchtitans(
    tmp_path: Path, published: dict[str, object], theirs: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(published))
    mine = to_titan_config(read_config(tmp_path))
    ref = qwen3_configs[theirs]("flex")
    assert (mine.vocab_size, mine.dim, len(mine.layers), mine.enable_weight_tying) == (
        ref.vocab_size,
        ref.dim,
        len(ref.layers),
        ref.enable_weight_tying,
    )
    a, b = mine.layers[0], ref.layers[0]
    assert (a.attention.n_heads, a.attention.n_kv_heads, a.attention.head_dim, a.attention.rope.theta) == (
        b.attention.n_heads,
        b.attention.n_kv_heads,
        b.attention.head_dim,
        b.attention.rope.theta,
    )
    if b.moe is None:
        assert a.moe is None and a.feed_forward.w1.out_features == b.feed_forward.w1.out_features
    else:
        assert (a.moe.num_experts, a.moe.router.top_k, a.moe.router.route_norm) == (
            b.moe.num_experts,
            b.moe.router.top_k,
            b.moe.router.route_norm,
        )
        assert a.moe.routed_experts.inner_experts.hidden_dim == b.moe.routed_experts.inner_experts.hidden_dim


def test_the_30b_checkpoint_is_checked_tensor_by_tensor(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    shapes = expected_hf_shapes(read_config(tmp_path))  # built on the meta device: no memory
    # Per layer: q, k, v, o, q_norm, k_norm and 2 layer norms, the router gate, 3 per expert.
    assert len(shapes) == 48 * (8 + 1 + 3 * 128) + 3  # + embeddings, final norm, lm_head
    assert shapes["model.layers.47.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert shapes["model.layers.0.mlp.gate.weight"] == (128, 2048)
