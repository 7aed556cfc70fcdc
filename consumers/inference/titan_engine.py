"""The embedded generation engine: jetrl's torchtitan model in this process, in the inference
precision (independent of the trainer's), batched generation with a KV cache and routing
capture (policy/sampling.py). Groups that share temperature and max tokens are generated
together in one batch."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

import numpy as np
import torch

from jetrl.bus import events as ev
from jetrl.bus.log import get_logger
from jetrl.bus.payloads import Payloads, ReceiveBuffer
from jetrl.consumers.inference.engine import GroupRequest, Limits, Sample
from jetrl.consumers.inference.settings import InferencePart
from jetrl.policy.models import build_model
from jetrl.policy.origin import model_config_of
from jetrl.policy.sampling import SamplingConfig, generate, inference_copy, resolve_precision
from jetrl.policy.weights import load_into, verified_tensors, weights_from_bytes


class TitanEngine:
    batches_in_flight = 1  # one generate call at a time: the next batch waits for it

    def __init__(self, part: InferencePart, worker_id: str) -> None:
        s = self.s = part.inference
        torch.set_num_threads(s.threads)
        mcfg = self.mcfg = model_config_of(part.model)
        self.limits: Limits | None = Limits(mcfg.vocab_size, mcfg.max_seq_len)
        # Weights come from WeightsReady events; the seed here only shapes the module.
        precision = resolve_precision(s.precision, torch.device("cpu"))  # where it runs
        get_logger("inference").info("inference_precision", setting=s.precision, resolved=precision)
        self.model = inference_copy(build_model(mcfg, seed=0), precision)
        # Each worker samples its own stream, reproducible from the run seed and its id.
        seed = (part.seed * 1_000_003 + (uuid.uuid5(uuid.NAMESPACE_URL, worker_id).int % 1_000_003)) % 2**63
        self.generator = torch.Generator().manual_seed(seed)
        self._version: int | None = None
        # The weights' bytes land here, version after version (views of it are loaded into the
        # model, which copies them): pages faulted in once, not once a version.
        self._received = ReceiveBuffer()

    @property
    def loaded_version(self) -> int | None:
        return self._version

    async def generate(self, groups: Sequence[GroupRequest]) -> list[list[Sample]]:
        by_cfg: dict[SamplingConfig, list[int]] = {}
        for i, g in enumerate(groups):
            cfg = SamplingConfig(
                max_tokens=max(1, g.max_tokens),
                temperature=g.temperature,
                top_p=g.top_p,
                stop_token_ids=g.stop_token_ids,
            )
            by_cfg.setdefault(cfg, []).append(i)
        out: list[list[Sample]] = [[] for _ in groups]
        for cfg, idx in by_cfg.items():
            prompts = [list(groups[i].prompt_tokens) for i in idx for _ in range(groups[i].n)]
            gens = await asyncio.to_thread(generate, self.model, prompts, cfg, generator=self.generator)
            k = 0
            for i in idx:
                for _ in range(groups[i].n):
                    gen = gens[k]
                    k += 1
                    out[i].append(
                        Sample(
                            completion_tokens=np.asarray(gen.completion_ids, dtype=np.int32),
                            logprobs=gen.logprobs.numpy().astype(np.float32),
                            finish_reason=gen.finish_reason,
                            routing_trace=None if gen.routing is None else gen.routing.numpy(),
                        )
                    )
        return out

    async def load_weights(self, ready: ev.WeightsReady, payloads: Payloads) -> None:
        # Received into one buffer and checked as the bytes land (payloads.get_weights); the
        # tensors are views of it, copied once more only into the model's own parameters.
        try:
            data = await payloads.get_weights(ready, into=self._received)
        except BaseException:
            self._received.drop()  # a read abandoned in it may still write there
            raise
        if ready.blake3 is None:  # an announcement of before the transfer digest
            tensors, _ = weights_from_bytes(
                data, expected_checksum=ready.weights_checksum, model_cfg=self.mcfg
            )
        else:
            tensors = verified_tensors(data, ready.weights_checksum, self.mcfg)
        load_into(self.model, tensors)
        self._version = ready.version

    async def close(self) -> None:
        """Nothing to release: the model is this process's memory."""
