"""Arithmetic with a calculator tool: a multi-turn tool-use environment.

``CalculatorToolEnv`` (name ``calculator``) asks arithmetic word problems (arithmetic.py's
generator and held-out split, over larger numbers by default, 999 and 99, so that the tool is
worth calling). The model may call the calculator inside its turn:

* ``<calc>EXPR</calc>`` (the syntax the ``words`` prompt teaches), or
* ``calc(EXPR)`` (the ``plain``/``symbols`` prompts': writable with the char tokenizer).

Either form is understood in every style; a call left open at the end of the turn (a stop
sequence ate the closing tag) runs what follows it. ``EXPR`` is evaluated by producers/sandbox.py
(a limited worker process: arithmetic, comparisons, a few math functions, nothing else).

A turn with calls, while the episode has tool turns left (``max_tool_calls``, default 2: the
number of tool replies an episode may get), is answered with a ``FollowUp`` of role ``tool``:
each call's value (or ``error: ...``) in order, a line each in ``words``, ``=V`` joined by ``;``
otherwise. At most ``MAX_CALLS_PER_TURN`` calls of a turn run. Any other turn, or any turn once
the tool turns are spent, is the final answer: graded as arithmetic.py grades (exact match of
the parsed number), on the turn's text with its calls removed. Score parts: ``exact``,
``parsed``, ``tool_calls`` (tool replies the episode got) and ``tool_errors`` (calls that
failed).

Tool calls wait on a process: :meth:`areact` runs them in a thread, so the producer's event
loop keeps serving. One sandbox worker serves the environment; calls queue on it.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from jetrl.policy.tokenizer import ChatMessage, Tokenizer
from jetrl.producers.arithmetic import OPS, ArithmeticEnv, grade
from jetrl.producers.environments import FollowUp, Score
from jetrl.producers.sandbox import Sandbox

MAX_CALLS_PER_TURN = 4
TOOL_INSTRUCTIONS = {
    "words": (
        "You have a calculator. To use it, write <calc>EXPRESSION</calc>, for example "
        "<calc>(12 + 7) * 3</calc>, and end your turn; the result comes back in the next message. "
        "It knows numbers, + - * / // % **, parentheses, abs, min, max, round, sqrt. "
        "When you know the result, end with 'Answer: N', N the number."
    ),
    "plain": "tool: calc(12*7) gives =84.",
    "symbols": "tool: calc(12*7) gives =84.",
}
DEFAULT_MAX_TOKENS = {"words": 256, "plain": 16, "symbols": 16}
_TAG_RE = re.compile(r"<calc>(.*?)(?:</calc>|$)", re.DOTALL)


def find_calls(text: str) -> list[tuple[int, int, str]]:
    """The tool calls in ``text``, in order: (start, end, expression)."""
    calls = [(m.start(), m.end(), m.group(1)) for m in _TAG_RE.finditer(text)]
    at = 0
    while (start := text.find("calc(", at)) >= 0:
        i, depth = start + len("calc("), 1
        while i < len(text) and depth:  # to the matching parenthesis, or the end
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        end = i
        inner = text[start + len("calc(") : end - 1 if depth == 0 else end]
        if not any(s <= start < e for s, e, _ in calls):  # not inside a <calc> tag
            calls.append((start, end, inner))
        at = end
    return sorted(calls)


def strip_calls(text: str) -> str:
    """``text`` without its tool calls: what the final answer is parsed from."""
    out, at = [], 0
    for start, end, _ in find_calls(text):
        out.append(text[at:start])
        at = max(at, end)
    return " ".join([*out, text[at:]])


class CalculatorToolEnv(ArithmeticEnv):
    name = "calculator"

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        style: str = "words",
        ops: str = OPS,
        max_value: int = 999,
        max_factor: int = 99,
        max_tokens: int | None = None,
        max_tool_calls: int = 2,
        timeout_s: float = 2.0,
        memory_mb: int = 256,
    ) -> None:
        if style in DEFAULT_MAX_TOKENS and max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS[style]
        super().__init__(
            tokenizer, style=style, ops=ops, max_value=max_value, max_factor=max_factor, max_tokens=max_tokens
        )
        if max_tool_calls < 0:
            raise ValueError("max_tool_calls must be >= 0")
        self.max_tool_calls = max_tool_calls
        self.sandbox = Sandbox(timeout_s=timeout_s, memory_mb=memory_mb)

    def prompt_messages(self, question: str) -> list[ChatMessage]:
        return [
            {"role": "system", "content": TOOL_INSTRUCTIONS[self.style]},
            *super().prompt_messages(question),
        ]

    def prepare(self) -> None:
        self.sandbox.evaluate("1+1")  # the worker process is up before the first call

    def close(self) -> None:
        self.sandbox.close()

    # ------------------------------------------------------------------ turns

    def react(self, info: dict[str, Any], turn: int, completion_tokens: list[int]) -> Score | FollowUp:
        text = self.tok.decode(completion_tokens)
        calls = find_calls(text)
        used, errors = int(info.get("tool_calls", 0)), int(info.get("tool_errors", 0))
        if calls and used < self.max_tool_calls:
            results = [self.sandbox.evaluate(expr) for _, _, expr in calls[:MAX_CALLS_PER_TURN]]
            shown = [r.text for r in results]
            shown += ["error: too many calls in one turn"] * (len(calls) - len(results))
            errors += sum(not r.ok for r in results) + len(calls) - len(results)
            reply = "\n".join(shown) if self.style == "words" else ";".join(f"={s}" for s in shown)
            return FollowUp(
                text=self.writable(reply), role="tool", info={"tool_calls": used + 1, "tool_errors": errors}
            )
        s = grade(int(info["answer"]), strip_calls(text))
        return Score(s.reward, {**s.parts, "tool_calls": float(used), "tool_errors": float(errors)})

    async def areact(self, info: dict[str, Any], turn: int, completion_tokens: list[int]) -> Score | FollowUp:
        return await asyncio.to_thread(self.react, info, turn, completion_tokens)

    def score(self, info: dict[str, Any], completion_tokens: list[int]) -> Score:
        """A single turn's final answer (calls in it are ignored)."""
        s = grade(int(info["answer"]), strip_calls(self.tok.decode(completion_tokens)))
        return Score(s.reward, {**s.parts, "tool_calls": 0.0, "tool_errors": 0.0})

    def writable(self, text: str) -> str:
        """``text`` as the tokenizer can write it as a tool message: as it is, else lowercased
        without the characters it cannot write (error messages quote names, ``'os'``)."""
        try:
            self.tok.encode_reply(text, role="tool")
            return text
        except ValueError:
            pass
        out = []
        for c in text.lower():
            try:
                self.tok.encode(c, bos=False)
            except ValueError:
                continue
            out.append(c)
        return "".join(out)
