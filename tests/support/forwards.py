"""Forwards the model tests compare: transformers' on a checkpoint's files (the reference), and
jetrl's through a KV cache, a prefill and then one token at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from jetrl.policy.models import KVCache


def random_tokens(seed: int, shape: tuple[int, int], vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits of ``ids`` from the checkpoint at ``path``."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        out: torch.Tensor = ref(ids).logits
    return out


def cached_logits(model: torch.nn.Module, x: torch.Tensor, prefill: int) -> torch.Tensor:
    """The logits of ``x`` [B, L] computed through one KV cache: ``prefill`` positions at once,
    then one position a forward."""
    b, n = x.shape
    with torch.no_grad():
        cache = KVCache()
        cache.begin(torch.ones(b, prefill, dtype=torch.bool))
        parts = [model(x[:, :prefill], torch.arange(prefill).expand(b, prefill), cache)]
        for i in range(prefill, n):
            cache.begin(torch.ones(b, 1, dtype=torch.bool))
            parts.append(model(x[:, i : i + 1], torch.full((b, 1), i), cache))
    return torch.cat(parts, 1)


def logprob_gap(model: torch.nn.Module, prompt: list[int], completion: list[int], logprobs: Any) -> float:
    """The largest |model's log-prob - ``logprobs``| over a completion's sampled tokens, the model
    run once on prompt + completion (``logprobs``: an engine's, one per completion token)."""
    with torch.no_grad():
        logp = model(torch.tensor([prompt + completion]))[0].log_softmax(-1)
    ours = logp[len(prompt) - 1 + torch.arange(len(completion)), torch.tensor(completion)]
    return float((ours - torch.as_tensor(np.array(logprobs))).abs().max())
