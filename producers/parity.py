"""``parity`` ("Is 417 even? Answer yes or no."): a yes/no task for a small pretrained chat model,
which starts above chance without being good at it (SmolLM2-135M-Instruct: docs/policy.md).

The prompt is one user message through the tokenizer's chat template. Reward: 1.0 when the
completion's first word is the right answer; ``lenient_credit`` (default 0.5) when the right
word appears and the wrong one does not (an answer after an explanation); else 0. Parts:
``strict``, ``lenient``, ``answered`` (a yes or a no is anywhere in it).

The held-out split is keyed by the number: one number in ``EVAL_BUCKETS`` (by a hash, stable
across processes) belongs to evaluation and is never drawn for training.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any

from jetrl.policy.tokenizer import Tokenizer
from jetrl.producers.arithmetic import chat_prompt
from jetrl.producers.environments import Environment, Score, Task

EVAL_BUCKETS = 10
EVAL_SEED = 0x9A_217
QUESTIONS = ("Is {n} even? Answer yes or no.", "Is {n} an odd number? Answer yes or no.")
_WORD = re.compile(r"[a-z]+")


def is_eval_number(n: int) -> bool:
    digest = hashlib.blake2b(str(n).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % EVAL_BUCKETS == 0


def grade(answer: str, text: str, lenient_credit: float) -> Score:
    words = _WORD.findall(text.lower())
    wrong = "no" if answer == "yes" else "yes"
    strict = float(bool(words) and words[0] == answer)
    lenient = float(answer in words and wrong not in words)
    answered = float("yes" in words or "no" in words)
    reward = 1.0 if strict else lenient_credit * lenient
    return Score(reward=reward, parts={"strict": strict, "lenient": lenient, "answered": answered})


class ParityEnv(Environment):
    name = "parity"

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        max_value: int = 999,
        max_tokens: int = 8,
        lenient_credit: float = 0.5,
    ) -> None:
        super().__init__(tokenizer)
        if max_value < 20:
            raise ValueError("max_value must be >= 20 (the held-out split takes one number in ten)")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not 0.0 <= lenient_credit <= 1.0:
            raise ValueError("lenient_credit must be in [0, 1]")
        self.max_value, self.max_tokens, self.lenient_credit = max_value, max_tokens, lenient_credit

    def _task(self, n: int, q: int, split: str) -> Task:
        question = QUESTIONS[q].format(n=n)
        text, tokens = chat_prompt(self.tok, [{"role": "user", "content": question}])
        odd_asked = q == 1
        answer = "yes" if (n % 2 == 1) == odd_asked else "no"
        return Task(text, tokens, self.max_tokens, {"n": n, "answer": answer, "split": split})

    def make_task(self, rng: random.Random) -> Task:
        while True:
            n = rng.randint(0, self.max_value)
            if not is_eval_number(n):
                return self._task(n, rng.randrange(len(QUESTIONS)), "train")

    def eval_tasks(self, n: int) -> list[Task]:
        rng = random.Random(EVAL_SEED)
        held = [k for k in range(self.max_value + 1) if is_eval_number(k)]
        rng.shuffle(held)
        return [self._task(k, i % len(QUESTIONS), "eval") for i, k in enumerate(held[:n])]

    def score(self, info: dict[str, Any], completion_tokens: list[int]) -> Score:
        return grade(str(info["answer"]), self.tok.decode(completion_tokens), self.lenient_credit)
