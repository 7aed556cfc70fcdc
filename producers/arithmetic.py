"""Arithmetic word problems with an exact, parsed answer: a task a real LLM can learn.

``ArithmeticEnv`` (name ``arithmetic``) draws short templated word problems (``+``, ``-``,
``*`` over small numbers; a few templates per operator, names and objects drawn too) and sends
the question as one user message through the tokenizer's chat template: the prompt is
``tok.encode(tok.render_chat([{"role": "user", "content": question}]), bos=False)``.

Styles (``style=``): ``words`` (the default: a sentence for a real tokenizer, with an
instruction to end on ``Answer: N``), ``terse`` (``"Compute 12 + 7. Reply with only the
number."``: for a small pretrained chat model, which explains at length when let), ``plain``
(short lowercase problems, ``"ann has 12 apples, buys 7. total?"``) and ``symbols``
(``"12+7="``); the last two are written in the character tokenizer's alphabet. An
environment whose tokenizer cannot write its prompts is refused when it is built (every
template, name and object is encoded once).

The final answer (:func:`parse_answer`), the first rule that finds a number wins:

1. the last ``\\boxed{...}`` holding a number: the last number in it;
2. the last ``answer`` marker: ``Answer: N``, ``answer is N``, ``answer = N`` (any case);
3. the last number in the text.

A number is ASCII digits with an optional minus sign (not after a letter, digit or ``)``, so
``12-7`` is two numbers), thousands separators (``1,234``) and decimals (``19.0`` equals 19).
Reward 1.0 when it equals the answer, else 0.0; parts ``exact`` and ``parsed`` (1.0 when a
number was found at all).

The held-out split is keyed by the *fact*, not the text: a problem's operator and operands
(sorted for ``+`` and ``*``, so ``7+12`` and ``12+7`` are one fact) are hashed, and one fact in
``EVAL_BUCKETS`` belongs to evaluation. Training never draws an evaluation fact in any template,
style or wording, so an evaluation score is not a memorised sum. :meth:`ArithmeticEnv.eval_tasks`
lists the evaluation split from a fixed seed: the same tasks, in the same order, on every call.
"""

from __future__ import annotations

import hashlib
import operator
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from jetrl.policy.tokenizer import ChatMessage, Tokenizer
from jetrl.producers.environments import Environment, Score, Task

EVAL_BUCKETS = 10  # one fact in ten is held out
EVAL_SEED = 0x5EED_E7A1
STYLES = ("words", "terse", "plain", "symbols")
OPS = "+-*"
MAX_DRAWS = 1000  # rejection sampling gives up here: the ranges hold (almost) no such fact

NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Mia", "Omar", "Zoe")
ITEMS = ("apples", "pears", "books", "coins", "cards", "marbles", "stamps", "shells")

# {n}: a name, {i}: the objects (plural), {a} {b}: the operands.
TEMPLATES: dict[str, dict[str, tuple[str, ...]]] = {
    "words": {
        "+": (
            "{n} has {a} {i} and buys {b} more. How many {i} does {n} have now?",
            "A box holds {a} {i}. {n} puts in {b} more. How many {i} are in the box?",
            "{n} found {a} {i} on Monday and {b} {i} on Tuesday. How many {i} did {n} find in all?",
        ),
        "-": (
            "{n} has {a} {i} and gives {b} away. How many {i} does {n} have left?",
            "There are {a} {i} on a table. {n} takes {b} of them. How many {i} are still there?",
        ),
        "*": (
            "{n} buys {a} bags with {b} {i} in each bag. How many {i} does {n} buy?",
            "A shelf has {a} rows of {b} {i}. How many {i} are on the shelf?",
        ),
    },
    "terse": {"+": ("Compute {a} + {b}.",), "-": ("Compute {a} - {b}.",), "*": ("Compute {a} * {b}.",)},
    "plain": {
        "+": ("{n} has {a} {i}, buys {b}. total?", "{a} {i} in a box, {n} adds {b}. how many?"),
        "-": ("{n} has {a} {i}, gives away {b}. left?", "{a} {i}, {n} takes {b}. left?"),
        "*": ("{n} buys {a} bags of {b} {i}. total?", "{a} rows of {b} {i}. how many?"),
    },
    "symbols": {"+": ("{a}+{b}=",), "-": ("{a}-{b}=",), "*": ("{a}*{b}=",)},
}
INSTRUCTION = {
    "words": "Solve it and end with 'Answer: N', where N is the number.",
    "terse": "Reply with only the number.",
    "plain": "",
    "symbols": "",
}
DEFAULT_MAX_TOKENS = {"words": 256, "terse": 10, "plain": 8, "symbols": 8}
_APPLY: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclass(frozen=True)
class Problem:
    op: str
    a: int
    b: int
    question: str

    @property
    def answer(self) -> int:
        return _APPLY[self.op](self.a, self.b)

    @property
    def fact(self) -> str:
        a, b = (min(self.a, self.b), max(self.a, self.b)) if self.op in "+*" else (self.a, self.b)
        return f"{a}{self.op}{b}"


def is_eval_fact(fact: str) -> bool:
    """Whether a fact (``Problem.fact``) is held out; stable across processes and versions."""
    digest = hashlib.blake2b(fact.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % EVAL_BUCKETS == 0


class ProblemGenerator:
    """Problems of one style over ``+`` and ``-`` up to ``max_value`` and ``*`` up to
    ``max_factor``, drawn from either split."""

    def __init__(self, style: str, ops: str, max_value: int, max_factor: int) -> None:
        if style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, not {style!r}")
        if not ops or set(ops) - set(OPS) or len(set(ops)) != len(ops):
            raise ValueError(f"ops must be distinct characters of {OPS!r}, not {ops!r}")
        if max_value < 5 or max_factor < 3:
            raise ValueError("need max_value >= 5 and max_factor >= 3")
        self.style, self.ops, self.max_value, self.max_factor = style, ops, max_value, max_factor

    def draw(self, rng: random.Random) -> Problem:
        op = rng.choice(self.ops)
        if op == "+":
            a, b = rng.randint(2, self.max_value), rng.randint(2, self.max_value)
        elif op == "-":  # positive answers, at least 2 of everything (plural nouns)
            a = rng.randint(4, self.max_value)
            b = rng.randint(2, a - 2)
        else:
            a, b = rng.randint(2, self.max_factor), rng.randint(2, self.max_factor)
        return self.render(op, a, b, rng)

    def render(self, op: str, a: int, b: int, rng: random.Random) -> Problem:
        template = rng.choice(TEMPLATES[self.style][op])
        name = rng.choice(NAMES)
        text = template.format(
            n=name if self.style == "words" else name.lower(), i=rng.choice(ITEMS), a=a, b=b
        )
        return Problem(op, a, b, text)

    def draw_from(self, rng: random.Random, *, held_out: bool) -> Problem:
        for _ in range(MAX_DRAWS):
            p = self.draw(rng)
            if is_eval_fact(p.fact) == held_out:
                return p
        raise ValueError(f"no {'evaluation' if held_out else 'training'} fact in these ranges")

    def samples(self) -> list[str]:
        """Every template, name and object once: what a tokenizer must be able to write."""
        names = NAMES if self.style == "words" else tuple(n.lower() for n in NAMES)
        out = [
            t.format(n=names[0], i=ITEMS[0], a=12, b=7) for ts in TEMPLATES[self.style].values() for t in ts
        ]
        if self.style in ("words", "plain"):
            out.append(" ".join([*names, *ITEMS]))
        return out


_NUM = r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUM_RE = re.compile(_NUM, re.ASCII)
_BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}", re.ASCII)
_ANSWER_RE = re.compile(r"answer(?:\s*is)?[\s:=*$]*(" + _NUM + ")", re.ASCII | re.IGNORECASE)


def _number(s: str) -> Decimal:
    return Decimal(s.replace(",", ""))


def parse_answer(text: str) -> Decimal | None:
    """The completion's final answer by the rules of the module docstring, or None."""
    boxed = [nums[-1] for content in _BOXED_RE.findall(text) if (nums := _NUM_RE.findall(content))]
    if boxed:
        return _number(boxed[-1])
    marked = _ANSWER_RE.findall(text)
    if marked:
        return _number(marked[-1])
    nums = _NUM_RE.findall(text)
    return _number(nums[-1]) if nums else None


def grade(answer: int, text: str) -> Score:
    """Exact match of the parsed final answer."""
    parsed = parse_answer(text)
    exact = float(parsed is not None and parsed == answer)
    return Score(reward=exact, parts={"exact": exact, "parsed": float(parsed is not None)})


def chat_prompt(tok: Tokenizer, messages: Sequence[ChatMessage]) -> tuple[str, list[int]]:
    """The prompt text as the chat template renders it, and its ids (the template writes any
    BOS itself)."""
    text = tok.render_chat(messages)
    return text, tok.encode(text, bos=False)


class ArithmeticEnv(Environment):
    name = "arithmetic"

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        style: str = "words",
        ops: str = OPS,
        max_value: int = 50,
        max_factor: int = 12,
        max_tokens: int | None = None,
    ) -> None:
        super().__init__(tokenizer)
        self.gen = ProblemGenerator(style, ops, max_value, max_factor)
        self.style = style
        self.max_tokens = max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS[style]
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        for sample in self.gen.samples():
            try:
                chat_prompt(self.tok, self.prompt_messages(sample))
            except ValueError as e:
                raise ValueError(
                    f"{self.name}: the tokenizer cannot write the {style!r} prompts ({e}); "
                    "with the char tokenizer use style='plain' or 'symbols'"
                ) from None

    def prompt_messages(self, question: str) -> list[ChatMessage]:
        """The conversation a task opens with (the tool environment adds its instructions)."""
        instruction = INSTRUCTION[self.style]
        return [{"role": "user", "content": f"{question} {instruction}" if instruction else question}]

    def task(self, p: Problem, split: str) -> Task:
        text, tokens = chat_prompt(self.tok, self.prompt_messages(p.question))
        return Task(text, tokens, self.max_tokens, {"answer": p.answer, "fact": p.fact, "split": split})

    def make_task(self, rng: random.Random) -> Task:
        return self.task(self.gen.draw_from(rng, held_out=False), "train")

    def eval_tasks(self, n: int) -> list[Task]:
        """The first ``n`` problems of the held-out split, distinct by text, the same on every
        call; fewer when the ranges hold fewer (``symbols`` over small numbers)."""
        rng = random.Random(EVAL_SEED)
        seen: set[str] = set()
        out: list[Task] = []
        for _ in range(50 * n + 1000):  # ~1 draw in EVAL_BUCKETS is held out; duplicates aside
            if len(out) >= n:
                break
            p = self.gen.draw(rng)
            if is_eval_fact(p.fact) and p.question not in seen:
                seen.add(p.question)
                out.append(self.task(p, "eval"))
        return out

    def score(self, info: dict[str, Any], completion_tokens: list[int]) -> Score:
        return grade(int(info["answer"]), self.tok.decode(completion_tokens))
