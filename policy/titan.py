"""The one door to torchtitan: every policy module imports torchtitan names from here.

torchtitan 0.3.0 imports its MinimalAsyncEP Triton kernels at import time, through
``models.common.moe -> token_dispatcher -> distributed.minimal_async_ep``, even though those
kernels only run for multi-GPU expert parallelism. On a machine without ``triton`` (CPU builds
of torch) that makes every torchtitan model unimportable. When ``triton`` is missing we
register a stand-in for exactly that kernel module (not for ``triton`` itself, so torch's own
``has_triton()`` checks stay truthful); its functions raise if the GPU-only EP path is ever
selected. With ``triton`` installed (every CUDA build of torch brings it) nothing is patched.
"""

from __future__ import annotations

import importlib.util
import sys
import types
import warnings
from collections.abc import Callable
from typing import NoReturn

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _install_kernel_stub() -> bool:
    if importlib.util.find_spec("triton") is not None or _KERNELS in sys.modules:
        return False
    stub = types.ModuleType(_KERNELS)
    stub.__doc__ = "jetrl stand-in: MinimalAsyncEP needs triton and a GPU."

    def __getattr__(name: str) -> Callable[..., NoReturn]:
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*_args: object, **_kwargs: object) -> NoReturn:
            raise RuntimeError(
                f"torchtitan MinimalAsyncEP kernel {name!r} needs triton and a CUDA GPU; "
                "use the 'standard' MoE comm backend on this machine"
            )

        return unavailable

    vars(stub)["__getattr__"] = __getattr__  # a module-level __getattr__ (PEP 562)
    sys.modules[_KERNELS] = stub
    return True


KERNEL_STUB_INSTALLED = _install_kernel_stub()

# torchtitan's router asks for a float32 autocast region; CPU autocast only knows
# bf16/fp16, warns, and runs the gate in the input dtype, which is what we want.
warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")

from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.config_utils import (  # noqa: E402
    get_attention_config,
    make_ffn_config,
    make_gqa_config,
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)
from torchtitan.models.common.moe import GroupedExperts, MoE, TokenChoiceTopKRouter  # noqa: E402
from torchtitan.models.common.nn_modules import RMSNorm  # noqa: E402
from torchtitan.models.common.rope import (  # noqa: E402
    _maybe_check_max_pos as rope_check_positions,
)
from torchtitan.models.common.rope import (  # noqa: E402
    _maybe_wrap_positions as rope_wrap_positions,
)
from torchtitan.models.common.rope import (  # noqa: E402
    _reshape_for_broadcast as rope_broadcast,
)
from torchtitan.models.llama3 import Llama3Model  # noqa: E402
from torchtitan.models.llama3.model import Llama3TransformerBlock  # noqa: E402
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter  # noqa: E402
from torchtitan.models.qwen3 import Qwen3Model, qwen3_configs  # noqa: E402
from torchtitan.models.qwen3.model import Qwen3TransformerBlock  # noqa: E402
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter  # noqa: E402
from torchtitan.protocols.module import Module  # noqa: E402

__all__ = [
    "KERNEL_STUB_INSTALLED",
    "ComplexRoPE",
    "CosSinRoPE",
    "Embedding",
    "GroupedExperts",
    "Linear",
    "Llama3Model",
    "Llama3StateDictAdapter",
    "Llama3TransformerBlock",
    "MoE",
    "Module",
    "Qwen3Model",
    "Qwen3StateDictAdapter",
    "Qwen3TransformerBlock",
    "RMSNorm",
    "ScaledDotProductAttention",
    "TokenChoiceTopKRouter",
    "get_attention_config",
    "make_ffn_config",
    "make_gqa_config",
    "make_moe_config",
    "make_routed_experts_config",
    "make_router_config",
    "qwen3_configs",
    "rope_broadcast",
    "rope_check_positions",
    "rope_wrap_positions",
]
