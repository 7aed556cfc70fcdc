"""What a model family is to jetrl (policy/models/<family>/, as torchtitan keeps its models):
its torchtitan config, its state-dict adapter to Hugging Face's names, its side of a checkpoint's
config.json both ways with what it refuses, and its named configs. Torch-free."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jetrl.policy.models.config import Family, ModelConfig


class CheckpointError(ValueError):
    """A checkpoint directory jetrl cannot use; the message says what and where."""


@dataclass(frozen=True)
class ModelFamily:
    name: Family
    # Hugging Face architecture (config.json "architectures") -> transformers' model_type.
    architectures: Mapping[str, str]
    configs: Mapping[str, ModelConfig]  # named configs of this family
    titan_config: Callable[[ModelConfig], Any]  # the torchtitan model config (nothing built)
    adapter: Callable[[ModelConfig], Any]  # torchtitan's state-dict adapter to HF names
    rope_kinds: tuple[str, ...]  # HF rope_type values it computes
    # What a config.json of architecture ``arch`` asks for that the family does not compute.
    refusals: Callable[[Mapping[str, Any], str], dict[str, bool]]
    # The family's config from a config.json: (contents, architecture, the fields every family
    # reads alike) -> ModelConfig.
    from_hf: Callable[[Mapping[str, Any], str, dict[str, Any]], ModelConfig]
    # Its part of a config.json made for ``cfg`` (architectures and model_type included).
    to_hf: Callable[[ModelConfig], dict[str, Any]]


# ------------------------------------------------------------------ reading a config.json


def hf_get(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    """The first of ``names`` set (not null) in a config.json, else ``default``."""
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    return default


def rope_params(cfg: Mapping[str, Any]) -> dict[str, Any]:
    # transformers 5 writes rope_parameters; older checkpoints rope_scaling (null: plain RoPE).
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return params if isinstance(params, dict) else {}


def rope_kind(cfg: Mapping[str, Any]) -> str:
    params = rope_params(cfg)
    return str(params.get("rope_type", params.get("type", "default")))


def rope_theta(cfg: Mapping[str, Any], where: Path, served: tuple[str, ...] = ("default",)) -> float:
    kind = rope_kind(cfg)
    if kind not in served:
        raise CheckpointError(
            f"{where}: rope_type {kind!r} is not supported here (jetrl serves {', '.join(served)})"
        )
    theta = hf_get(cfg, "rope_theta") or rope_params(cfg).get("rope_theta")
    return float(theta or 10_000.0)
