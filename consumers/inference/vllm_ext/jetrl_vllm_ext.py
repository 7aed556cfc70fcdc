"""A vLLM worker extension, loaded by the vLLM server that jetrl's vLLM engine starts
(``--worker-extension-cls jetrl_vllm_ext.WorkerExtension``) and reached through the server's
``/collective_rpc``. It runs inside vLLM's worker processes, in vLLM's own environment: it imports
vLLM's dependencies only (torch, safetensors), never jetrl.

``jetrl_load_weights(path)`` replaces the model's weights in place from one safetensors file in
Hugging Face layout (as jetrl's trainer publishes with ``weights_layout = "hf"``; the engine
receives the bytes into it, in /dev/shm), through vLLM's own in-place reload, given views of
the mapped file (no copy of it before the reload's own into the parameters), which re-runs
each layer's weight processing. vLLM builds a fused-MoE
layer's expert kernel once, though, and on CPU that kernel keeps its own prepacked copy of the
expert weights: after a reload it would go on computing with the old experts, so each one is
packed again from the new weights. A tied output head (SmolLM2, the small Qwen3s) is the same:
it shares the embedding's parameter, so the reload, which skips the head's own name, never
re-runs its processing, and on CPU its prepacked GEMM copy would keep the first version's head
(logprobs off by 1e-3 and more after one step, found by tests/system/test_run_smollm2.py).
"""

from __future__ import annotations

import os
import struct
from typing import Any


class WorkerExtension:
    model_runner: Any  # set by vLLM on the worker this class extends

    def jetrl_load_weights(self, path: str) -> int:
        tensors = _mapped_tensors(path)
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        model = self.model_runner.get_model()
        for module in model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is not None:
                kernel.fused_experts.process_weights_after_loading(module)
        for module in _sharing_a_weight(model):
            module.quant_method.process_weights_after_loading(module)
        return len(tensors)


_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def _mapped_tensors(path: str) -> dict[str, Any]:
    """The tensors of a safetensors file as views of the file mapped copy-on-write (a file in
    /dev/shm is read where it lies; nothing writes to the views). One that would lie misaligned
    for its dtype is copied."""
    import json
    import mmap

    import torch

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    (n,) = struct.unpack("<Q", mapped[:8])
    header = json.loads(mapped[8 : 8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    out = {}
    for name, info in header.items():
        dtype = getattr(torch, _DTYPES[info["dtype"]])
        begin = info["data_offsets"][0]
        count = 1
        for d in info["shape"]:
            count *= int(d)
        if count == 0:
            out[name] = torch.empty(info["shape"], dtype=dtype)
            continue
        t = torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + begin).view(info["shape"])
        out[name] = t if t.data_ptr() % t.element_size() == 0 else t.clone()
    return out


def _sharing_a_weight(model: Any) -> list[Any]:
    """Modules whose ``weight`` is another module's too (a tied head and its embedding) and
    that process it after loading."""
    holders: dict[int, list[Any]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            holders.setdefault(id(weight), []).append(module)
    return [
        m
        for ms in holders.values()
        if len(ms) > 1
        for m in ms
        if getattr(m, "quant_method", None) is not None
    ]


class _RouteLog:
    """Router choices per request and position, from forward hooks on each MoE gate.

    vLLM runs many requests' tokens in one forward, flattened in the order of the input batch's
    requests; the scheduler output says how many tokens of each run, and the input batch how many
    each had computed before, so every gate output row lands at its request's absolute position
    (a recomputed position, after a preemption, is overwritten, not appended)."""

    def __init__(self, runner: Any, gates: list[Any], top_k: int) -> None:
        self.runner, self.top_k, self.layers = runner, top_k, len(gates)
        self.routes: dict[str, dict[int, list[list[int]]]] = {}
        self.sched: Any = None
        self.step: list[Any] = []
        for layer, gate in enumerate(gates):
            gate.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            logits = output[0] if isinstance(output, tuple) else output
            if layer == 0:
                self.step = []
            self.step.append(logits.topk(self.top_k, dim=-1).indices.cpu())
            if layer == self.layers - 1:
                self._place()

        return hook

    def _place(self) -> None:
        sched, batch = self.sched, self.runner.input_batch
        if sched is None or len(self.step) != self.layers:
            return  # a warm-up or profiling forward
        import torch

        chosen = torch.stack(self.step, dim=1)  # [tokens, layers, top_k]
        row = 0
        for idx, req in enumerate(batch.req_ids):
            count = sched.num_scheduled_tokens.get(req) if req is not None else None
            if not count:
                continue
            start = int(batch.num_computed_tokens_cpu[idx])
            per_pos = self.routes.setdefault(req, {})
            for j, layers in enumerate(chosen[row : row + count].tolist()):
                per_pos[start + j] = layers
            row += count


class RoutingExtension(WorkerExtension):
    """WorkerExtension plus Router Replay traces: ``jetrl_take_routes(tag)``."""

    _jetrl_routes: _RouteLog | None = None

    def _jetrl_route_log(self) -> _RouteLog:
        if self._jetrl_routes is None:
            model = self.model_runner.get_model()
            gates = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
            top_k = int(model.config.num_experts_per_tok)
            log = self._jetrl_routes = _RouteLog(self.model_runner, gates, top_k)
            execute = self.model_runner.execute_model

            def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
                log.sched = scheduler_output
                try:
                    return execute(scheduler_output, *args, **kwargs)
                finally:
                    log.sched = None

            self.model_runner.execute_model = execute_model
        return self._jetrl_routes

    def jetrl_start_routes(self) -> int:
        return self._jetrl_route_log().layers

    def jetrl_take_routes(self, tag: str) -> dict[str, list[list[list[int]]]]:
        """The routes of every request whose id holds ``tag``, by position, and forget them."""
        log = self._jetrl_route_log()
        out = {}
        for req in [r for r in log.routes if tag in r]:
            per_pos = log.routes.pop(req)
            out[req] = [per_pos.get(i, []) for i in range(max(per_pos, default=-1) + 1)]
        return out
