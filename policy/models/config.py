"""The architecture of a decoder, whatever its family: :class:`ModelConfig`. Torch-free."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

AttentionKind = Literal["sdpa", "flex", "varlen"]
Family = Literal["qwen3", "llama"]  # policy/models/<family>/


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of a decoder of one family: Qwen3 (``num_experts == 0`` gives a dense model)
    or Llama (dense only)."""

    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_seq_len: int
    num_experts: int = 0
    top_k: int = 0
    moe_hidden_dim: int = 0
    dense_hidden_dim: int = 0
    rope_theta: float = 1_000_000.0
    tie_embeddings: bool = False
    # "sdpa" is jetrl's CachedSDPA (CPU, generation with KV cache); flex/varlen are torchtitan's.
    attention: AttentionKind = "sdpa"
    # torchtitan's auxiliary-loss-free balancing bias; None keeps routing a pure function of
    # the weights, which replay and bit-exact recovery rely on.
    load_balance_coeff: float | None = None
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_norm: bool = True
    init_std: float = 0.02
    norm_eps: float = 1e-6  # RMSNorm epsilon (HF: rms_norm_eps)
    family: Family = "qwen3"
    # Llama 3's RoPE frequency scaling (HF rope_type "llama3"): factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings. None: plain RoPE.
    llama_rope_scaling: tuple[float, float, float, int] | None = None

    def __post_init__(self) -> None:
        if self.family == "llama" and self.num_experts:
            raise ValueError("the Llama family is dense: num_experts must be 0")
        if self.llama_rope_scaling is not None and self.family != "llama":
            raise ValueError("llama_rope_scaling is Llama 3's RoPE scaling: family must be 'llama'")
        if self.num_experts and not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in 1..{self.num_experts}, got {self.top_k}")
        if self.num_experts and self.moe_hidden_dim <= 0:
            raise ValueError("an MoE config needs moe_hidden_dim > 0")
        if not self.num_experts and self.dense_hidden_dim <= 0:
            raise ValueError("a dense config needs dense_hidden_dim > 0")
        if self.n_heads % self.n_kv_heads:
            raise ValueError("n_heads must be a multiple of n_kv_heads")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return self.n_layers if self.is_moe else 0

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)
