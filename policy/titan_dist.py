"""The door to torchtitan's distributed side (parallel dims, its parallelize functions, context
parallelism, the parallel-aware gradient clipping), kept apart from policy/titan.py so that inference and the
single-process trainer never import it.

torchtitan picks its mesh device at import time (``tools.utils.device_type``: the accelerator
it finds, "cuda" when it finds none) and builds every ``ParallelDims`` mesh on it, and its
trainer sets a process-wide SPMD backend; :func:`configure` does both for jetrl's trainer.
"""

from __future__ import annotations

# isort: off
import jetrl.policy.titan  # noqa: F401  # the kernel stand-in must be in place first
# isort: on

from torchtitan.config import (
    CompileConfig,
    ParallelismConfig,
    TrainingConfig,
)
from torchtitan.distributed import parallel_dims as _parallel_dims
from torchtitan.distributed import utils as _dist_utils
from torchtitan.distributed.context_parallel import apply_cp_to_forward, cp_shard
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.models.qwen3.parallelize import parallelize_qwen3

clip_grad_norm_ = _dist_utils.clip_grad_norm_


SPMD_BACKEND = "partial_dtensor"  # FSDP2's fully_shard needs DTensors; spmd_types leaves plain tensors


def configure(device_type: str) -> None:
    """Process-wide torchtitan settings its own trainer makes at start: the mesh device and
    the SPMD backend (the token dispatcher reads it at every forward)."""
    _parallel_dims.device_type = device_type
    _dist_utils.set_spmd_backend(SPMD_BACKEND)


__all__ = [
    "SPMD_BACKEND",
    "CompileConfig",
    "ParallelDims",
    "ParallelismConfig",
    "TrainingConfig",
    "apply_cp_to_forward",
    "clip_grad_norm_",
    "configure",
    "cp_shard",
    "parallelize_llama",
    "parallelize_qwen3",
]
