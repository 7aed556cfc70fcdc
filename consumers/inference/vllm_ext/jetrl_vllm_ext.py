"""A vLLM worker extension, loaded by the vLLM server that jetrl's vLLM engine starts
(``--worker-extension-cls jetrl_vllm_ext.WorkerExtension``) and reached through the server's
``/collective_rpc``. It runs inside vLLM's worker processes, in vLLM's own environment: it imports
vLLM's dependencies only (torch, safetensors), never jetrl.

``jetrl_load_weights(path)`` replaces the model's weights in place from one safetensors file in
Hugging Face layout (as jetrl's trainer publishes with ``weights_layout = "hf"``), through vLLM's
own in-place reload, which re-runs each layer's weight processing. vLLM builds a fused-MoE
layer's expert kernel once, though, and on CPU that kernel keeps its own prepacked copy of the
expert weights: after a reload it would go on computing with the old experts, so each one is
packed again from the new weights.
"""

from __future__ import annotations

from typing import Any


class WorkerExtension:
    model_runner: Any  # set by vLLM on the worker this class extends

    def jetrl_load_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        tensors = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        for module in self.model_runner.get_model().modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is not None:
                kernel.fused_experts.process_weights_after_loading(module)
        return len(tensors)
