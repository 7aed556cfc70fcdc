"""What jetrl puts into torchtitan's model configs, shared by the families.

jetrl does not define its own transformer: each family (policy/models/<family>/) turns a
:class:`~jetrl.policy.models.config.ModelConfig` into its torchtitan config with torchtitan's
public config helpers, and torchtitan builds it. Three jetrl modules take slots of those configs:

* :class:`CachedSDPA`, the inner attention on CPU, a subclass of torchtitan's
  ``ScaledDotProductAttention``. torchtitan 0.3.0 only offers flex/varlen for language models;
  flex has no backward on CPU and varlen is CUDA-only. An unpacked training batch holds one
  rollout per row, right-padded, so plain causal SDPA is exact there: right padding never
  influences earlier positions. For generation it also accepts a :class:`KVCache` through the
  model's ``attention_masks`` argument, so each position is computed exactly once. That makes the
  routing trace well defined (a token's experts are chosen once, in the forward that produced the
  next token). For a packed training batch (several rollouts per row, policy/packing.py) it
  accepts a :class:`PackedMask` the same way: SDPA then attends causally within each rollout only.
  RoPE positions need no help from us: torchtitan's ``Decoder.forward(tokens, positions, ...)``
  hands per-token ``positions [B, L]`` to every layer's RoPE, which gathers its table there.
* :class:`ExpertsInWeightDtype`: torchtitan's ``GroupedExperts`` casts tokens and expert weights
  to bf16 for its grouped GEMMs whatever the model's dtype, so an fp32 trainer would compute its
  experts in bf16 (on CPUs without bf16 instructions also 13x slower). This one computes them in
  the dtype of the weights: fp32 in the trainer, the inference precision in an inference copy.
* :class:`RealPairRoPE`: torchtitan's ``ComplexRoPE`` (the Llama family's) with its table kept as
  real pairs, so that casting the model (``model.to(dtype)``) keeps it whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from jetrl.policy.models.config import AttentionKind, ModelConfig
from jetrl.policy.titan import (
    ComplexRoPE,
    Embedding,
    GroupedExperts,
    Linear,
    RMSNorm,
    ScaledDotProductAttention,
    get_attention_config,
    rope_broadcast,
    rope_check_positions,
    rope_wrap_positions,
)


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


def normal_init(std: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return partial(nn.init.normal_, mean=0.0, std=std)


def linear_init(std: float) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    return {"weight": normal_init(std), "bias": nn.init.zeros_}


def rms_norm(dim: int, eps: float) -> RMSNorm.Config:
    return RMSNorm.Config(normalized_shape=dim, eps=eps, param_init={"weight": nn.init.ones_})


def decoder_parts(cfg: ModelConfig) -> dict[str, Any]:
    """What every family's torchtitan decoder config takes besides its layers."""
    return {
        "vocab_size": cfg.vocab_size,
        "dim": cfg.dim,
        "norm": rms_norm(cfg.dim, cfg.norm_eps),
        "enable_weight_tying": cfg.tie_embeddings,
        "tok_embeddings": Embedding.Config(
            num_embeddings=cfg.vocab_size,
            embedding_dim=cfg.dim,
            # A tied embedding is initialised through lm_head.
            param_init={"weight": (lambda _t: None) if cfg.tie_embeddings else normal_init(cfg.init_std)},
        ),
        "lm_head": Linear.Config(
            in_features=cfg.dim, out_features=cfg.vocab_size, param_init=linear_init(cfg.init_std)
        ),
    }


def inner_attention(kind: AttentionKind) -> Any:
    """The attention kernel of a config: jetrl's CachedSDPA, or torchtitan's flex/varlen."""
    return CachedSDPA.Config() if kind == "sdpa" else get_attention_config(kind)
