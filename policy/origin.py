"""Where a run's model comes from: a named config (policy/models/), initialised from a seed,
or a Hugging Face checkpoint directory (``[model] hf_path``, policy/hf.py). The trainer and every
inference engine take the architecture from here; the trainer also its initial weights, which it
publishes as version 0 for the engines.
"""

from __future__ import annotations

from typing import Any

import torch

from jetrl.policy.models import ModelConfig, build_model, get_config
from jetrl.policy.settings import ModelSettings
from jetrl.policy.titan import Llama3Model, Qwen3Model


def model_config_of(model: ModelSettings) -> ModelConfig:
    """The architecture of ``[model]``, overrides applied (for a checkpoint: read from its
    config.json; overrides change jetrl-side choices such as the attention kernel)."""
    if model.hf_path:
        from jetrl.policy.hf import read_config

        return read_config(model.hf_path, **model.overrides)
    return get_config(model.name, **model.overrides)


def check_model(model: ModelSettings) -> ModelConfig:
    """Everything about ``[model]`` that can be refused before a process starts: the config,
    and for a checkpoint its tensors' names and shapes and its tokenizer (policy/hf.py)."""
    if model.hf_path:
        from jetrl.policy.hf import check_checkpoint

        return check_checkpoint(model.hf_path, tokenizer=model.tokenizer_kind == "hf", **model.overrides)
    return get_config(model.name, **model.overrides)


def initial_model(
    model: ModelSettings, *, seed: int | None = 0, dtype: torch.dtype = torch.float32, parallelism: Any = None
) -> Qwen3Model | Llama3Model:
    """The policy at version 0: a checkpoint's weights, or a seeded initialisation.
    ``parallelism``: see :func:`~jetrl.policy.models.build_model`."""
    cfg = model_config_of(model)
    net = build_model(cfg, seed=seed, dtype=dtype, parallelism=parallelism)
    if model.hf_path:
        from jetrl.policy.hf import load_state
        from jetrl.policy.weights import load_into

        load_into(net, load_state(model.hf_path, cfg))
    return net
