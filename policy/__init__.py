"""jetrl.policy: the model and RL mathematics shared by trainer and inference.

Names are imported lazily so that ``jetrl.policy.tokenizer`` (used by environments) does not pull
in torch and torchtitan.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "models": (
        "ModelConfig",
        "CONFIGS",
        "get_config",
        "build_model",
        "model_config",
        "moe_layers",
        "moe_routers",
        "KVCache",
        "CachedSDPA",
        "to_titan_config",
    ),
    "routing": (
        "TraceError",
        "trace_dtype",
        "trace_length",
        "check_trace",
        "check_trace_for",
        "pad_traces",
        "capture_routing",
        "replay_routing",
        "trace_to_bytes",
        "trace_from_bytes",
    ),
    "sampling": (
        "SamplingConfig",
        "Generation",
        "generate",
        "inference_copy",
        "sample_tokens",
        "sampling_logprobs",
        "PRECISIONS",
    ),
    "loss": ("LossConfig", "group_advantages", "rl_loss", "mismatch_stats"),
    "weights": (
        "checksum",
        "save_weights",
        "load_weights",
        "weights_to_bytes",
        "weights_from_bytes",
        "load_into",
        "state_dict_of",
        "ChecksumMismatch",
        "to_hf",
        "from_hf",
        "CHECKSUM_SCHEME",
    ),
    "tokenizer": ("CharTokenizer",),
    "train": (
        "Rollout",
        "TrainBatch",
        "collate",
        "compute_logprobs",
        "token_logprobs",
        "forward_backward",
        "train_step",
        "make_optimizer",
        "set_deterministic",
    ),
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'jetrl.policy' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"jetrl.policy.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
