"""Environments: tasks out, scores in.

An :class:`Environment` makes tasks (a prompt plus whatever it needs to score the answer, kept
in ``info`` so that scoring needs no state beyond the TaskSubmitted event) and scores
completions. A multi-turn environment answers a model turn with a :class:`FollowUp` (its own
turn: text appended to the conversation) until it gives the episode's :class:`Score`; the
producer hands out each model turn as its own TaskSubmitted event and trains the whole episode
as one rollout, the environment's text masked out of the loss.

The built-ins are toy tasks with dense, exact rewards that a randomly initialised tiny MoE can
learn by RL alone on a CPU in minutes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from jetrl import plugins
from jetrl.policy.tokenizer import Tokenizer, make_tokenizer


@dataclass(frozen=True)
class Task:
    prompt_text: str
    prompt_tokens: list[int]
    max_tokens: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Score:
    reward: float
    parts: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class FollowUp:
    """The environment's turn: ``text``, as a ``role`` message of the chat template
    (``Tokenizer.encode_reply``), follows the model's turn, and ``info`` is merged into the
    episode's info for the next turn."""

    text: str
    info: dict[str, Any] = field(default_factory=dict)
    role: str = "user"  # whose message the chat template renders it as ("user", "tool")


class Environment:
    """Base class. Subclasses set ``name`` and implement :meth:`make_task` and :meth:`score`."""

    name: ClassVar[str] = "env"

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        # No catch-all **params: a misspelled parameter is an error at config time.
        self.tok = tokenizer or make_tokenizer()

    def prepare(self) -> None:
        """Slow set-up (loading a dataset, say), run once in a worker thread before the first
        task so that the producer's event loop keeps serving meanwhile."""

    def make_task(self, rng: random.Random) -> Task:
        raise NotImplementedError

    def score(self, info: dict[str, Any], completion_tokens: list[int]) -> Score:
        raise NotImplementedError

    def eval_tasks(self, n: int) -> list[Task]:
        """The first ``n`` tasks of the environment's held-out evaluation split, the same on
        every call (no overlap with what :meth:`make_task` draws); empty when it has none."""
        return []

    def react(self, info: dict[str, Any], turn: int, completion_tokens: list[int]) -> Score | FollowUp:
        """One model turn done: the episode's score, or the environment's reply. Single-turn
        environments score at once."""
        return self.score(info, completion_tokens)

    async def areact(self, info: dict[str, Any], turn: int, completion_tokens: list[int]) -> Score | FollowUp:
        """What the producer calls: :meth:`react`, unless scoring itself awaits (an adapter
        to a library whose rewards are coroutines)."""
        return self.react(info, turn, completion_tokens)


def _positional_reward(target: list[int], completion: list[int]) -> Score:
    """Share of target positions (answer tokens, then <eos>) the completion got right: dense,
    exact, 1.0 only for the exact answer followed by <eos>."""
    hits = sum(1 for i, t in enumerate(target) if i < len(completion) and completion[i] == t)
    exact = float(completion[: len(target)] == target)
    return Score(reward=hits / len(target), parts={"positions": hits / len(target), "exact": exact})


class _AnswerEnv(Environment):
    """Tasks whose ``info["answer"]`` is the one right text, scored position by position."""

    def score(self, info: dict[str, Any], completion_tokens: list[int]) -> Score:
        return _positional_reward(self.tok.encode(info["answer"], bos=False, eos=True), completion_tokens)


class _StringTask(_AnswerEnv):
    """Shared by reverse and sort: a short string over a small alphabet, then ``=``."""

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        alphabet: str = "abcd",
        min_len: int = 2,
        max_len: int = 4,
    ) -> None:
        super().__init__(tokenizer)
        if not 1 <= min_len <= max_len:
            raise ValueError("need 1 <= min_len <= max_len")
        self.alphabet, self.min_len, self.max_len = alphabet, min_len, max_len

    def answer(self, s: str) -> str:
        raise NotImplementedError

    def make_task(self, rng: random.Random) -> Task:
        n = rng.randint(self.min_len, self.max_len)
        s = "".join(rng.choice(self.alphabet) for _ in range(n))
        prompt = f"{s}="
        return Task(
            prompt, self.tok.encode(prompt), max_tokens=self.max_len + 1, info={"answer": self.answer(s)}
        )


class ReverseEnv(_StringTask):
    name = "reverse"

    def answer(self, s: str) -> str:
        return s[::-1]


class SortEnv(_StringTask):
    name = "sort"

    def answer(self, s: str) -> str:
        return "".join(sorted(s))


class ModSumEnv(_AnswerEnv):
    """``a+b=`` → ``(a+b) mod m`` as one digit: a contextual bandit of m² prompts."""

    name = "modsum"

    def __init__(self, tokenizer: Tokenizer | None = None, *, modulus: int = 5) -> None:
        super().__init__(tokenizer)
        if not 2 <= modulus <= 10:
            raise ValueError("modulus must be in 2..10 (one digit answers)")
        self.m = modulus

    def make_task(self, rng: random.Random) -> Task:
        a, b = rng.randrange(self.m), rng.randrange(self.m)
        prompt = f"{a}+{b}="
        return Task(prompt, self.tok.encode(prompt), max_tokens=2, info={"answer": str((a + b) % self.m)})


class ChainSumEnv(ModSumEnv):
    """Two turns of modular addition: ``a+b=`` → the model answers ``s``; the environment replies
    ``+c=`` and the model must answer ``(a + b + c) mod m``. The episode's reward is the mean of
    both turns' positional rewards."""

    name = "chainsum"

    def make_task(self, rng: random.Random) -> Task:
        t = super().make_task(rng)
        return Task(t.prompt_text, t.prompt_tokens, t.max_tokens, {**t.info, "c": rng.randrange(self.m)})

    def react(self, info: dict[str, Any], turn: int, completion_tokens: list[int]) -> Score | FollowUp:
        if turn == 0:
            first = self.score(info, completion_tokens).reward
            c = int(info["c"])
            nxt = str((int(info["answer"]) + c) % self.m)
            return FollowUp(text=f"+{c}=", info={"turn0_reward": first, "answer": nxt})
        second = self.score(info, completion_tokens).reward
        first = float(info["turn0_reward"])
        return Score(
            reward=(first + second) / 2,
            parts={"turn0": first, "turn1": second, "exact": float(first == 1.0 and second == 1.0)},
        )


# This module's environments by name (each registered in jetrl/plugins.py, with the others).
ENVIRONMENTS: dict[str, type[Environment]] = {
    cls.name: cls for cls in (ReverseEnv, SortEnv, ModSumEnv, ChainSumEnv)
}


def make_environment(name: str, tokenizer: Tokenizer | None = None, **params: Any) -> Environment:
    """The environment ``name`` names in the plugin registry (jetrl/plugins.py, ``ENVIRONMENTS``:
    a built-in, an installed package's, or any ``package.module:Class``, a subclass of
    Environment in the user's own code), imported when asked for."""
    try:
        cls = plugins.ENVIRONMENTS.load(name)
    except plugins.UnknownPlugin as exc:
        raise KeyError(str(exc)) from None
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"environment {name!r} is {cls!r}, not a subclass of Environment")
    return cls(tokenizer, **params)
