"""Context parallelism (CP): one batch's sequence split across the ranks of a ``cp`` mesh.

Nothing of CP is implemented here: :func:`apply_context_parallel` hands the model's inner
attention modules to torchtitan's ``apply_cp_to_forward``, :func:`shard_batch` cuts the inputs
with torchtitan's ``cp_shard`` (head-tail load balancing, torchtitan's default: of ``2 * cp``
equal chunks rank ``r`` holds chunk ``r`` and chunk ``2 * cp - 1 - r``, so causal attention
costs every rank the same), and :func:`gather_sequence` undoes that cut with torch's
``context_parallel_unshard``.

Measured on CPU (torch 2.13 CPU build, torchtitan 0.3.0, 2 gloo ranks;
tests/consumers/parallel/test_context_parallel.py):

* Works: the forward with ``attention="flex"``. torchtitan all-gathers keys and values, and
  each rank's queries attend to them through the causal BlockMask that torch cut along its query
  axis for that rank. tiny-dense and tiny-moe logits (fp32) are within 1.8e-7 of a
  single-process forward of the same weights. So on CPU, CP can score (log-probs under
  ``torch.no_grad()``), not train.
* Training does not: flex attention has no backward on CPU, with or without CP. Any forward
  that records autograd raises, in flex's device check, ``NotImplementedError: FlexAttention
  does not support backward on CPU. Please set the input requires_grad to False or use another
  device.``
* ``attention="sdpa"`` (jetrl's CachedSDPA, the CPU training attention) does not run at all:
  torchtitan passes q/k/v on as sequence-sharded DTensors, and torch's CP dispatcher has ring
  attention rules only for the CUDA SDPA kernels (flash, memory-efficient, cuDNN), so the CPU
  kernel raises ``NotImplementedError: Operator
  aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
  registered.``
* ``attention="varlen"``: ``apply_cp_to_forward`` itself raises ``NotImplementedError:
  Variable-length attention CP is not yet supported`` (and varlen is CUDA-only anyway).

CP training (flex or SDPA) is therefore for a GPU. On CPU the flex forward is torch.compile'd
(inductor, C++): the first call in a fresh inductor cache compiles for 30-45 s on 2 cores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer, context_parallel_unshard
from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE, BlockMask

from jetrl.policy.models import model_config
from jetrl.policy.titan_dist import apply_cp_to_forward, cp_shard


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Wrap every layer's inner attention with torchtitan's CP forward, in place, as
    torchtitan's Qwen3 ``parallelize`` does (so: before any other parallelism)."""
    layers: Any = model.layers
    apply_cp_to_forward([block.attention.inner_attention for block in layers.values()], cp_mesh)


@dataclass(frozen=True, slots=True)
class CPBatch:
    """This rank's part of a batch: the model's inputs, and ``extras`` cut the same way."""

    tokens: torch.Tensor  # [B, L / cp]
    positions: torch.Tensor  # [B, L / cp], each token's place in the full sequence
    attention_masks: BlockMask | None  # flex: this rank's queries against all keys; sdpa: None
    extras: tuple[torch.Tensor, ...]

    def model_kwargs(self) -> dict[str, Any]:
        """What the model's forward takes besides the tokens."""
        return {"positions": self.positions, "attention_masks": self.attention_masks}


def _check_seq_len(seq_len: int, cp: int, flex: bool) -> None:
    # torch checks these deep inside, with a bare AssertionError for head-tail.
    if seq_len % (2 * cp):
        raise ValueError(f"head-tail CP needs the sequence length ({seq_len}) divisible by 2 * cp = {2 * cp}")
    if flex and seq_len % (cp * _DEFAULT_SPARSE_BLOCK_SIZE):
        raise ValueError(
            f"flex CP needs the sequence length ({seq_len}) divisible by "
            f"cp * {_DEFAULT_SPARSE_BLOCK_SIZE} = {cp * _DEFAULT_SPARSE_BLOCK_SIZE}"
        )


def shard_batch(
    model: nn.Module,
    tokens: torch.Tensor,
    cp_mesh: DeviceMesh,
    *,
    positions: torch.Tensor | None = None,
    extras: Sequence[torch.Tensor] = (),
) -> CPBatch:
    """This rank's part of ``tokens`` [B, L], of their positions (default ``0..L-1``) and of
    any per-token ``extras`` [B, L, ...] (labels, loss masks, ...), cut by torchtitan's ``cp_shard``.

    The positions always go to the model: after the cut a rank's tokens are neither
    ``0..L/cp-1`` nor contiguous, and RoPE must know where they are. With flex attention the
    full-sequence mask is built here by the model (torchtitan's ``get_attention_masks``) and
    cut along its query axis, as the all-gathered keys expect; a full mask would be wrong.
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    seq_len = tokens.shape[1]
    flex = model_config(model).attention == "flex"
    _check_seq_len(seq_len, cp_mesh.size(), flex)
    if positions is None:
        positions = torch.arange(seq_len, device=tokens.device).expand_as(tokens)
    masks: BlockMask | None = None
    if flex:
        masks = model.get_attention_masks(positions=positions)  # type: ignore[operator]
    sharded, masks = cp_shard(cp_mesh, (tokens, positions, *extras), masks, "headtail")
    return CPBatch(tokens=sharded[0], positions=sharded[1], attention_masks=masks, extras=tuple(sharded[2:]))


def gather_sequence(local: torch.Tensor, cp_mesh: DeviceMesh, *, seq_dim: int = 1) -> torch.Tensor:
    """The full-sequence tensor, in the original token order, from every rank's ``local`` part
    (an output of a forward on a :func:`shard_batch` batch, batch first); every rank gets it.
    Not differentiable: for outputs (logits, log-probs), not for a loss."""
    cp = cp_mesh.size()
    balancer = _HeadTailLoadBalancer(local.shape[seq_dim] * cp, cp, local.device)
    (full,) = context_parallel_unshard(cp_mesh, [local], [seq_dim], load_balancer=balancer)
    return full
