"""An environment: ``a-b=`` with digits ``a >= b``, answered by the difference, scored 1 for the
exact answer followed by EOS and 0 otherwise."""

from __future__ import annotations

import random
from typing import Any

from jetrl.policy.tokenizer import Tokenizer
from jetrl.producers.environments import Environment, Score, Task


class DifferenceEnv(Environment):
    name = "difference"

    def __init__(self, tokenizer: Tokenizer | None = None, *, largest: int = 9) -> None:
        super().__init__(tokenizer)
        if not 1 <= largest <= 9:
            raise ValueError("largest must be a digit, 1..9")
        self.largest = largest

    def make_task(self, rng: random.Random) -> Task:
        a = rng.randint(0, self.largest)
        b = rng.randint(0, a)
        prompt = f"{a}-{b}="
        return Task(prompt, self.tok.encode(prompt), max_tokens=2, info={"answer": str(a - b)})

    def score(self, info: dict[str, Any], completion_tokens: list[int]) -> Score:
        exact = completion_tokens == self.tok.encode(info["answer"], bos=False, eos=True)
        return Score(reward=float(exact), parts={"exact": float(exact)})
