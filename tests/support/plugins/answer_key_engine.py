"""A generation engine with no model: it reads each ``a-b=`` prompt with the run's tokenizer and
answers it right, with probability one. Its checks refuse a checkpoint (it has no model to serve
one) and say it sends no routing traces."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jetrl.bus import events as ev
from jetrl.bus.payloads import Payloads
from jetrl.consumers.inference.engine import EngineChecks, FinishReason, GroupRequest, Limits, Sample
from jetrl.consumers.inference.settings import InferencePart, InferenceSettings
from jetrl.policy.settings import ModelSettings
from jetrl.policy.tokenizer import tokenizer_for


class AnswerKeyEngine:
    batches_in_flight = 1
    limits: Limits | None = None  # no model: the worker checks tasks against [model]

    def __init__(self, part: InferencePart, worker_id: str) -> None:
        self.tok = tokenizer_for(part.model)
        self._version: int | None = None

    @property
    def loaded_version(self) -> int | None:
        return self._version

    def answer(self, prompt: Sequence[int]) -> np.ndarray:
        a, b = self.tok.decode(prompt).removesuffix("=").split("-")
        return np.asarray(self.tok.encode(str(int(a) - int(b)), bos=False, eos=True), dtype=np.int32)

    async def generate(self, groups: Sequence[GroupRequest]) -> list[list[Sample]]:
        out = []
        for g in groups:
            ids = self.answer(g.prompt_tokens)[: g.max_tokens]
            reason: FinishReason = "stop" if ids[-1] in g.stop_token_ids else "length"
            out.append([Sample(ids, np.zeros(len(ids), np.float32), reason) for _ in range(g.n)])
        return out

    async def load_weights(self, ready: ev.WeightsReady, payloads: Payloads) -> None:
        await payloads.get_weights(ready)  # size and digest checked; no model to load into
        self._version = ready.version

    async def close(self) -> None:
        pass


class AnswerKeyChecks(EngineChecks):
    def check(self, inference: InferenceSettings, model: ModelSettings) -> None:
        if model.hf_path:
            raise ValueError("the answer-key engine has no model: it serves no checkpoint")

    def no_routing(self, inference: InferenceSettings) -> str | None:
        return "the answer-key engine has no model"


CHECKS = AnswerKeyChecks()
