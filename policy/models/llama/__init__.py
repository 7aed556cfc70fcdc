"""The Llama family: Llama 3.x, SmolLM2 and other ``LlamaForCausalLM`` checkpoints (torchtitan's
``llama3``), dense only."""

from __future__ import annotations

from jetrl.policy.models.config import ModelConfig
from jetrl.policy.models.family import ModelFamily
from jetrl.policy.models.llama import hf, model
from jetrl.policy.models.qwen3 import CONFIGS as QWEN3_CONFIGS

CONFIGS: dict[str, ModelConfig] = {
    # tiny-dense's shape as a Llama, with tied embeddings (as SmolLM2 has them).
    "tiny-llama": QWEN3_CONFIGS["tiny-dense"].replace(name="tiny-llama", family="llama", tie_embeddings=True),
}

FAMILY = ModelFamily(
    name="llama",
    architectures=hf.ARCHITECTURES,
    configs=CONFIGS,
    titan_config=model.titan_config,
    adapter=model.adapter,
    rope_kinds=("default", "llama3"),
    refusals=hf.refusals,
    from_hf=hf.from_hf,
    to_hf=hf.to_hf,
)
