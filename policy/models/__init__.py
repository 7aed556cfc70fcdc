"""Models: a :class:`ModelConfig` of a family, built by torchtitan. Each family lives in a folder of
its own, as torchtitan keeps them (``qwen3/``: Qwen3 dense and MoE; ``llama/``: Llama 3.x, SmolLM2),
with its torchtitan config, its state-dict adapter, its side of a checkpoint's config.json and
what it refuses there (policy/models/family.py says what a family is). This module is the one
registry of them: named configs, builds, and a config.json read or made through its family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from jetrl.policy.models import llama, qwen3
from jetrl.policy.models.config import AttentionKind, Family, ModelConfig
from jetrl.policy.models.family import CheckpointError, ModelFamily, hf_get, rope_theta
from jetrl.policy.models.layers import CachedSDPA, ExpertsInWeightDtype, KVCache, PackedMask, RealPairRoPE
from jetrl.policy.titan import Llama3Model, MoE, Qwen3Model, TokenChoiceTopKRouter

__all__ = [
    "ARCHITECTURES",
    "CONFIGS",
    "FAMILIES",
    "AttentionKind",
    "CachedSDPA",
    "CheckpointError",
    "ExpertsInWeightDtype",
    "Family",
    "KVCache",
    "ModelConfig",
    "ModelFamily",
    "PackedMask",
    "RealPairRoPE",
    "build_model",
    "config_from_hf",
    "family_of",
    "get_config",
    "hf_config_of",
    "model_config",
    "moe_layers",
    "moe_routers",
    "state_dict_adapter",
    "to_titan_config",
]

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (qwen3.FAMILY, llama.FAMILY)}
CONFIGS: dict[str, ModelConfig] = {name: c for f in FAMILIES.values() for name, c in f.configs.items()}
# Hugging Face architecture -> the family that reads it.
ARCHITECTURES: dict[str, ModelFamily] = {a: f for f in FAMILIES.values() for a in f.architectures}


def get_config(name: str, **overrides: object) -> ModelConfig:
    try:
        base = CONFIGS[name]
    except KeyError:
        raise KeyError(f"unknown model config {name!r}; known: {sorted(CONFIGS)}") from None
    return base.replace(**overrides) if overrides else base


def family_of(cfg: ModelConfig) -> ModelFamily:
    return FAMILIES[cfg.family]


def state_dict_adapter(cfg: ModelConfig) -> Any:
    """torchtitan's adapter between the family's canonical names and Hugging Face's."""
    return family_of(cfg).adapter(cfg)


def to_titan_config(cfg: ModelConfig) -> Any:
    """Translate a jetrl config into its family's torchtitan config (nothing is built)."""
    return family_of(cfg).titan_config(cfg)


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


# ------------------------------------------------------------------ a checkpoint's config.json

# What no family computes, whatever it is asked in.
_REFUSED: dict[str, Callable[[Mapping[str, Any]], bool]] = {
    "attention_bias": lambda c: bool(c.get("attention_bias")),
    "use_sliding_window": lambda c: bool(c.get("use_sliding_window")),
    "hidden_act != silu": lambda c: c.get("hidden_act", "silu") != "silu",
    "mlp_bias": lambda c: bool(c.get("mlp_bias")),
    "pretraining_tp > 1": lambda c: int(c.get("pretraining_tp") or 1) > 1,
}


def config_from_hf(cfg: Mapping[str, Any], where: Path, name: str = "") -> ModelConfig:
    """The jetrl config of an HF ``config.json``'s contents, read by the family of its
    architecture; what the family does not compute is refused, all of it named at once."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else ""
    family = ARCHITECTURES.get(arch)
    if family is None:
        raise CheckpointError(
            f"{where}: architecture {arch or '(none)'!r} is not supported; "
            f"jetrl loads {sorted(ARCHITECTURES)}"
        )
    refuse = {k: check(cfg) for k, check in _REFUSED.items()} | family.refusals(cfg, arch)
    bad = [k for k, v in refuse.items() if v]
    if bad:
        raise CheckpointError(f"{where}: not supported in a {arch}: {', '.join(bad)}")
    dim = int(cfg["hidden_size"])
    n_heads = int(cfg["num_attention_heads"])
    common: dict[str, Any] = {
        "name": name or str(cfg.get("_name_or_path") or where.name),
        "vocab_size": int(cfg["vocab_size"]),
        "dim": dim,
        "n_layers": int(cfg["num_hidden_layers"]),
        "n_heads": n_heads,
        "n_kv_heads": int(hf_get(cfg, "num_key_value_heads", default=n_heads)),
        "head_dim": int(hf_get(cfg, "head_dim", default=dim // n_heads)),
        "max_seq_len": int(hf_get(cfg, "max_position_embeddings", default=4096)),
        "rope_theta": rope_theta(cfg, where, family.rope_kinds),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "norm_eps": float(hf_get(cfg, "rms_norm_eps", default=1e-6)),
    }
    return family.from_hf(cfg, arch, common)


def hf_config_of(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """A config.json for a model of ``cfg`` saved in ``dtype`` (when there is no source's)."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        **family_of(cfg).to_hf(cfg),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
