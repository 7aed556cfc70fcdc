"""A generation engine with no model, plugged in by configuration alone
(``--inference.engine tests.support.engines:OracleEngine``): it reads each modsum prompt
("3+4=") and answers it correctly, with probability one. It proves that the inference worker
depends only on the seam: a run through it trains every step on a reward of exactly 1.
:class:`ZeroEngine` answers ``0`` to everything and takes any version announced without reading
its weights (for tests that announce versions with no trainer)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jetrl.bus import events as ev
from jetrl.bus.payloads import Payloads
from jetrl.consumers.inference.engine import FinishReason, GroupRequest, Limits, Sample
from jetrl.consumers.inference.settings import InferencePart
from jetrl.policy.tokenizer import CharTokenizer

MODULUS = 5  # modsum's default


class OracleEngine:
    batches_in_flight = 1
    limits: Limits | None = None  # no model: the worker checks tasks against [model]

    def __init__(self, part: InferencePart, worker_id: str) -> None:
        self.tok = CharTokenizer()
        self._version: int | None = None
        self.loads: list[int] = []

    @property
    def loaded_version(self) -> int | None:
        return self._version

    def answer(self, prompt: Sequence[int]) -> np.ndarray:
        a, b = self.tok.decode(prompt).removesuffix("=").split("+")
        ids = self.tok.encode(str((int(a) + int(b)) % MODULUS), bos=False, eos=True)
        return np.asarray(ids, dtype=np.int32)

    async def generate(self, groups: Sequence[GroupRequest]) -> list[list[Sample]]:
        out = []
        for g in groups:
            ids = self.answer(g.prompt_tokens)[: g.max_tokens]
            reason: FinishReason = "stop" if ids[-1] in g.stop_token_ids else "length"
            out.append([Sample(ids, np.zeros(len(ids), np.float32), reason) for _ in range(g.n)])
        return out

    async def load_weights(self, ready: ev.WeightsReady, payloads: Payloads) -> None:
        await payloads.get_weights(ready)  # the bytes checked as they land; no model to load into
        self._version = ready.version

    async def close(self) -> None:
        pass


class ConcurrentOracleEngine(OracleEngine):
    """The oracle, slowed down and taking several batches at once (as vLLM does), recording what
    the worker asks of it: how many batches were in flight together, and whether weights were
    ever loaded while one was."""

    batches_in_flight = 3

    def __init__(self, part: InferencePart, worker_id: str) -> None:
        super().__init__(part, worker_id)
        self.active = 0
        self.most_active = 0
        self.loads_while_generating = 0
        self.spans: list[tuple[int | None, int | None]] = []  # version at start, at end

    async def generate(self, groups: Sequence[GroupRequest]) -> list[list[Sample]]:
        import asyncio

        self.active += 1
        self.most_active = max(self.most_active, self.active)
        start = self._version
        try:
            await asyncio.sleep(0.3)
            return await super().generate(groups)
        finally:
            self.spans.append((start, self._version))
            self.active -= 1

    async def load_weights(self, ready: ev.WeightsReady, payloads: Payloads) -> None:
        if self.active:
            self.loads_while_generating += 1
        await super().load_weights(ready, payloads)


class ZeroEngine:
    """A model-free engine answering every sample ``0``, loading any version announced."""

    batches_in_flight = 1
    limits: Limits | None = None

    def __init__(self) -> None:
        self._version: int | None = None

    @property
    def loaded_version(self) -> int | None:
        return self._version

    async def generate(self, groups: Sequence[GroupRequest]) -> list[list[Sample]]:
        ids = np.asarray(CharTokenizer().encode("0", bos=False, eos=True), np.int32)
        return [[Sample(ids, np.zeros(len(ids), np.float32), "stop") for _ in range(g.n)] for g in groups]

    async def load_weights(self, ready: ev.WeightsReady, payloads: Payloads) -> None:
        self._version = ready.version

    async def close(self) -> None:
        pass
