"""Model configs and builders: Qwen3 (MoE and dense) and Llama decoders built from torchtitan's
model code.

jetrl does not define its own transformer. A :class:`ModelConfig` is turned into a torchtitan
``Qwen3Model.Config`` with torchtitan's public config helpers (``make_gqa_config``,
``make_moe_config``, ...) and built by torchtitan. Two jetrl modules take slots of torchtitan's
config: the experts, :class:`ExpertsInWeightDtype` (below), and the inner attention on CPU,
:class:`CachedSDPA`, a subclass of torchtitan's ``ScaledDotProductAttention``:

* torchtitan 0.3.0 only offers flex/varlen for language models; flex has no backward on CPU and
  varlen is CUDA-only. An unpacked training batch holds one rollout per row, right-padded, so
  plain causal SDPA is exact there: right padding never influences earlier positions.
* For generation it also accepts a :class:`KVCache` through the model's ``attention_masks``
  argument, so each position is computed exactly once. That makes the routing trace well defined
  (a token's experts are chosen once, in the forward that produced the next token).
* For a packed training batch (several rollouts per row, policy/packing.py) it accepts a
  :class:`PackedMask` the same way: SDPA then attends causally within each rollout only. RoPE
  positions need no help from us: torchtitan's ``Decoder.forward(tokens, positions, ...)``
  hands per-token ``positions [B, L]`` to every layer's RoPE, which gathers its table there.

torchtitan's ``GroupedExperts`` casts tokens and expert weights to bf16 for its grouped GEMMs
whatever the model's dtype, so an fp32 trainer would compute its experts in bf16 (on CPUs
without bf16 instructions also 13x slower). :class:`ExpertsInWeightDtype` computes them in the
dtype of the weights: fp32 in the trainer, the inference precision in an inference copy.

The Llama family (Llama 3.x, SmolLM2 and other ``LlamaForCausalLM`` checkpoints) is torchtitan's
``Llama3Model``: Qwen3's dense block without QK norm, unfused Q/K/V, and RoPE on adjacent pairs
(torchtitan's ``ComplexRoPE``, with Llama 3's frequency scaling) whose Q/K layout torchtitan's
``Llama3StateDictAdapter`` permutes to and from Hugging Face's. :class:`RealPairRoPE` keeps that
RoPE's table as real pairs, so that casting the model (``model.to(dtype)``) keeps it whole.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from jetrl.policy.titan import (
    ComplexRoPE,
    CosSinRoPE,
    Embedding,
    GroupedExperts,
    Linear,
    Llama3Model,
    Llama3StateDictAdapter,
    Llama3TransformerBlock,
    MoE,
    Qwen3Model,
    Qwen3StateDictAdapter,
    Qwen3TransformerBlock,
    RMSNorm,
    ScaledDotProductAttention,
    TokenChoiceTopKRouter,
    get_attention_config,
    make_ffn_config,
    make_gqa_config,
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
    rope_broadcast,
    rope_check_positions,
    rope_wrap_positions,
)

AttentionKind = Literal["sdpa", "flex", "varlen"]
Family = Literal["qwen3", "llama"]


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

CONFIGS: dict[str, ModelConfig] = {
    "tiny-moe": _TINY_MOE,
    "tiny-moe-4l": _TINY_MOE.replace(name="tiny-moe-4l", n_layers=4),
    "tiny-dense": _TINY_MOE.replace(
        name="tiny-dense", num_experts=0, top_k=0, moe_hidden_dim=0, dense_hidden_dim=128
    ),
    "qwen3-30b-a3b": ModelConfig(
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
    ),
}
CONFIGS["tiny-llama"] = CONFIGS["tiny-dense"].replace(name="tiny-llama", family="llama", tie_embeddings=True)
CONFIGS["qwen3-235b-a22b"] = CONFIGS["qwen3-30b-a3b"].replace(
    name="qwen3-235b-a22b", dim=4096, n_layers=94, n_heads=64, moe_hidden_dim=1536, rope_theta=5_000_000.0
)


def get_config(name: str, **overrides: object) -> ModelConfig:
    try:
        base = CONFIGS[name]
    except KeyError:
        raise KeyError(f"unknown model config {name!r}; known: {sorted(CONFIGS)}") from None
    return base.replace(**overrides) if overrides else base


class KVCache:
    """Keys/values of one batched generation, handed to the model as ``attention_masks``.

    Call :meth:`begin` before each forward with the validity of the new positions (False for
    padding); every attention layer then appends its keys/values and reads the shared mask.
    """

    def __init__(self) -> None:
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.key_valid: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.key_valid is None else self.key_valid.shape[1]

    def begin(self, valid: torch.Tensor) -> None:
        prev = self.length
        self.key_valid = valid if self.key_valid is None else torch.cat([self.key_valid, valid], 1)
        n_new, total = valid.shape[1], self.key_valid.shape[1]
        q_pos = torch.arange(prev, prev + n_new, device=valid.device)[:, None]
        k_pos = torch.arange(total, device=valid.device)[None, :]
        allowed = (k_pos <= q_pos)[None] & self.key_valid[:, None, :]
        # A padding query still sees itself: an all-masked row would turn into NaNs that then
        # leak through 0 * NaN in later layers.
        allowed = allowed | (k_pos == q_pos)[None]
        self.mask = allowed[:, None]  # [B, 1, new, total]

    def extend(self, owner: nn.Module, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(owner)
        if key in self._kv:
            k = torch.cat([self._kv[key][0], k], dim=1)
            v = torch.cat([self._kv[key][1], v], dim=1)
        self._kv[key] = (k, v)
        return k, v


class PackedMask:
    """Document ids of a packed batch's forward positions, handed to the model as
    ``attention_masks``: position ``q`` may attend to ``k`` iff ``k <= q`` and both carry the
    same id. Padding shares one id of its own, so it sees only padding (never an empty row, which
    would turn into NaNs) and no real position sees it."""

    def __init__(self, doc_ids: torch.Tensor) -> None:
        if doc_ids.ndim != 2 or doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
            raise ValueError(
                f"doc_ids must be an integer [B, L] tensor, got {doc_ids.dtype} {tuple(doc_ids.shape)}"
            )
        self.doc_ids = doc_ids
        n = doc_ids.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=doc_ids.device).tril()
        # Built once per forward and shared by every layer: [B, 1, L, L], broadcast over heads.
        self.mask = ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


class CachedSDPA(ScaledDotProductAttention):  # type: ignore[misc]  # torchtitan ships no types
    """torchtitan's causal SDPA for training; masked SDPA over a :class:`KVCache` for generation
    and within documents for a :class:`PackedMask` (packed training batches)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):  # type: ignore[misc]  # torchtitan ships no types
        pass

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: object = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
        **kwargs: object,
    ) -> torch.Tensor:
        if attention_masks is None:
            causal: torch.Tensor = super().forward(
                q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa, is_causal=is_causal
            )
            return causal
        if isinstance(attention_masks, PackedMask):
            mask = attention_masks.mask
            if mask.shape[0] != q_BLNH.shape[0] or mask.shape[-1] != q_BLNH.shape[1]:
                raise ValueError(
                    f"PackedMask covers [B, L] = {tuple(attention_masks.doc_ids.shape)} but attention "
                    f"sees {tuple(q_BLNH.shape[:2])}"
                )
            packed = F.scaled_dot_product_attention(
                q_BLNH.transpose(1, 2),
                k_BLNH.transpose(1, 2),
                v_BLNH.transpose(1, 2),
                attn_mask=mask.to(q_BLNH.device),
                scale=scale,
                enable_gqa=enable_gqa,
            )
            return packed.transpose(1, 2)
        if not isinstance(attention_masks, KVCache) or attention_masks.mask is None:
            raise TypeError("CachedSDPA takes attention_masks=None, a PackedMask or a KVCache after begin()")
        k_all, v_all = attention_masks.extend(self, k_BLNH, v_BLNH)
        out = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2),
            k_all.transpose(1, 2),
            v_all.transpose(1, 2),
            attn_mask=attention_masks.mask,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out.transpose(1, 2)


class RealPairRoPE(ComplexRoPE):  # type: ignore[misc]  # torchtitan ships no types
    """torchtitan's ``ComplexRoPE`` with its table held as real (cos, sin) pairs: ``Module.to``
    casts a complex buffer to a real dtype by dropping its imaginary part."""

    @dataclass(kw_only=True, slots=True)
    class Config(ComplexRoPE.Config):  # type: ignore[misc]  # torchtitan ships no types
        pass

    def _precompute_cache(self) -> torch.Tensor:
        return torch.view_as_real(super()._precompute_cache())

    def _reshape_cache(self, query: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        table = torch.view_as_complex(self.cache.float().contiguous())
        positions = rope_wrap_positions(positions, query)
        if positions is not None:
            rope_check_positions(positions, max_valid_pos=table.shape[0] - 1)
        shape = (*query.shape[:-1], query.shape[-1] // 2)
        out: torch.Tensor = rope_broadcast(table, shape, positions)
        return out


def _dense_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad if all(grad.stride()) else grad.contiguous()


class ExpertsInWeightDtype(GroupedExperts):  # type: ignore[misc]  # torchtitan ships no types
    """torchtitan's grouped SwiGLU experts, their GEMMs (still ``_grouped_mm``, torchtitan's
    seam for other kernels) in the dtype of the expert weights instead of always bf16."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):  # type: ignore[misc]  # torchtitan ships no types
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        weights = [
            w.to_local() if hasattr(w, "to_local") else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
        ]
        w1, w2, w3 = (w.transpose(-2, -1) for w in weights)
        offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        x = x_RD.to(w1.dtype)
        gate = F.silu(self._gemm(x, w1, offsets))
        hidden = gate * self._gemm(x, w3, offsets)
        return self._gemm(hidden, w2, offsets).type_as(x_RD)

    def _gemm(self, a: torch.Tensor, b_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._grouped_mm(A=a, B_t=b_t, offs=offsets)
        if out.requires_grad:
            # The fp32 grouped GEMM's backward on CPU refuses a gradient with zero strides (an
            # expanded one, as from a sum): hand it a dense copy of such a gradient.
            out.register_hook(_dense_grad)
        return out


def _normal(std: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return partial(nn.init.normal_, mean=0.0, std=std)


def _linear_init(std: float) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    return {"weight": _normal(std), "bias": nn.init.zeros_}


def _norm(dim: int, eps: float) -> RMSNorm.Config:
    return RMSNorm.Config(normalized_shape=dim, eps=eps, param_init={"weight": nn.init.ones_})


def _decoder_parts(cfg: ModelConfig) -> dict[str, Any]:
    """What every family's torchtitan decoder config takes besides its layers."""
    return {
        "vocab_size": cfg.vocab_size,
        "dim": cfg.dim,
        "norm": _norm(cfg.dim, cfg.norm_eps),
        "enable_weight_tying": cfg.tie_embeddings,
        "tok_embeddings": Embedding.Config(
            num_embeddings=cfg.vocab_size,
            embedding_dim=cfg.dim,
            # A tied embedding is initialised through lm_head.
            param_init={"weight": (lambda _t: None) if cfg.tie_embeddings else _normal(cfg.init_std)},
        ),
        "lm_head": Linear.Config(
            in_features=cfg.dim, out_features=cfg.vocab_size, param_init=_linear_init(cfg.init_std)
        ),
    }


def _llama_titan_config(cfg: ModelConfig) -> Llama3Model.Config:
    std = cfg.init_std
    out_std = std / math.sqrt(2 * cfg.n_layers)
    inner = CachedSDPA.Config() if cfg.attention == "sdpa" else get_attention_config(cfg.attention)
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
            attention_norm=_norm(cfg.dim, cfg.norm_eps),
            ffn_norm=_norm(cfg.dim, cfg.norm_eps),
            attention=make_gqa_config(
                dim=cfg.dim,
                n_heads=cfg.n_heads,
                n_kv_heads=cfg.n_kv_heads,
                head_dim=cfg.head_dim,
                wqkv_param_init=_linear_init(std),
                wo_param_init=_linear_init(out_std),
                inner_attention=inner,
                fuse_qkv=False,  # the names Llama3StateDictAdapter maps
                rope=rope,
            ),
            feed_forward=make_ffn_config(
                dim=cfg.dim,
                hidden_dim=cfg.dense_hidden_dim,
                w1_param_init=_linear_init(std),
                w2w3_param_init=_linear_init(out_std),
            ),
        )
        for _ in range(cfg.n_layers)
    ]
    return Llama3Model.Config(**_decoder_parts(cfg), layers=layers)


def state_dict_adapter(cfg: ModelConfig) -> Qwen3StateDictAdapter | Llama3StateDictAdapter:
    """torchtitan's adapter between the family's canonical names and Hugging Face's."""
    if cfg.family == "llama":
        return Llama3StateDictAdapter(to_titan_config(cfg), None)
    return Qwen3StateDictAdapter(to_titan_config(cfg), None)


def to_titan_config(cfg: ModelConfig) -> Qwen3Model.Config | Llama3Model.Config:
    """Translate a jetrl config into its family's torchtitan config (nothing is built)."""
    if cfg.family == "llama":
        return _llama_titan_config(cfg)
    std = cfg.init_std
    # Residual-branch outputs get depth-scaled init, as in Qwen3/Megatron practice.
    out_std = std / math.sqrt(2 * cfg.n_layers)
    inner = CachedSDPA.Config() if cfg.attention == "sdpa" else get_attention_config(cfg.attention)
    rope = CosSinRoPE.Config(dim=cfg.head_dim, max_seq_len=cfg.max_seq_len, theta=cfg.rope_theta)
    layers = []
    for _ in range(cfg.n_layers):
        attention = make_gqa_config(
            dim=cfg.dim,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            wqkv_param_init=_linear_init(std),
            wo_param_init=_linear_init(out_std),
            inner_attention=inner,
            fuse_qkv=True,
            rope=rope,
            qk_norm=_norm(cfg.head_dim, cfg.norm_eps),
        )
        moe = ffn = None
        if cfg.is_moe:
            moe = make_moe_config(
                num_experts=cfg.num_experts,
                load_balance_coeff=cfg.load_balance_coeff,
                router=make_router_config(
                    dim=cfg.dim,
                    num_experts=cfg.num_experts,
                    gate_param_init=_linear_init(std),
                    top_k=cfg.top_k,
                    score_func=cfg.score_func,
                    route_norm=cfg.route_norm,
                ),
                routed_experts=make_routed_experts_config(
                    dim=cfg.dim,
                    hidden_dim=cfg.moe_hidden_dim,
                    num_experts=cfg.num_experts,
                    top_k=cfg.top_k,
                    param_init={"w1_EFD": _normal(std), "w3_EFD": _normal(std), "w2_EDF": _normal(out_std)},
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
                w1_param_init=_linear_init(std),
                w2w3_param_init=_linear_init(std),
            )
        layers.append(
            Qwen3TransformerBlock.Config(
                attention_norm=_norm(cfg.dim, cfg.norm_eps),
                ffn_norm=_norm(cfg.dim, cfg.norm_eps),
                attention=attention,
                moe=moe,
                feed_forward=ffn,
            )
        )
    return Qwen3Model.Config(**_decoder_parts(cfg), layers=layers)


def build_model(
    cfg: ModelConfig | str,
    *,
    seed: int | None = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    parallelism: Any = None,
) -> Qwen3Model | Llama3Model:
    """Build and initialise a model. ``seed`` makes the init reproducible without touching the
    global RNG stream; ``seed=None`` draws from it. ``parallelism``: torchtitan's
    ``ParallelismConfig`` of a parallel trainer, from which torchtitan fills each module's
    sharding config (which its ``parallelize`` functions then apply); the weights are the same."""
    if isinstance(cfg, str):
        cfg = get_config(cfg)
    titan_cfg = to_titan_config(cfg)
    if parallelism is not None:
        titan_cfg.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        with torch.device(device):
            model = titan_cfg.build()
            model.init_states(buffer_device=torch.device(device))
    model.jetrl_config = cfg
    return model.to(dtype=dtype)


def model_config(model: nn.Module) -> ModelConfig:
    cfg = getattr(model, "jetrl_config", None)
    if not isinstance(cfg, ModelConfig):
        raise TypeError("model was not built by jetrl.policy.models.build_model")
    return cfg


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE blocks in forward order (the trace's layer axis)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_routers(model: nn.Module) -> list[TokenChoiceTopKRouter]:
    return [m.router for m in moe_layers(model)]
