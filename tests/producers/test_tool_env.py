"""The calculator tool environment: calls found in a turn, tool replies as follow-ups, the
final answer graded, with the char tokenizer and with a real chat template."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import pytest

from jetrl.policy.tokenizer import CharTokenizer
from jetrl.producers.arithmetic import is_eval_fact
from jetrl.producers.environments import FollowUp, Score, Task, make_environment
from jetrl.producers.tool_env import CalculatorToolEnv, find_calls, strip_calls
from tests.producers.test_arithmetic_env import bpe

CHAR = CharTokenizer()


def reply(text: str, tok: Any = CHAR) -> list[int]:
    return list(tok.encode(text, bos=False, eos=True))


@pytest.fixture(scope="module")
def env() -> Iterator[CalculatorToolEnv]:
    e = make_environment("calculator", CHAR, style="plain")
    assert isinstance(e, CalculatorToolEnv)
    yield e
    e.close()


def task(env: CalculatorToolEnv, seed: int = 0) -> Task:
    return env.make_task(random.Random(seed))


@pytest.mark.parametrize(
    ("text", "exprs"),
    [
        ("calc(12*7)", ["12*7"]),
        ("<calc>12 * 7</calc> and calc(1+2)", ["12 * 7", "1+2"]),
        ("calc((1+2)*(3+4)) then 5", ["(1+2)*(3+4)"]),
        ("<calc>calc(3)</calc>", ["calc(3)"]),  # one call: the tag's
        ("first <calc>2+2", ["2+2"]),  # left open: a stop sequence ate the closing tag
        ("calc(1+(2", ["1+(2"]),
        ("no calls, 19", []),
    ],
)
def test_calls_are_found_in_order(text: str, exprs: list[str]) -> None:
    assert [e for _, _, e in find_calls(text)] == exprs


def test_the_answer_is_read_outside_the_calls() -> None:
    assert strip_calls("calc(12*7) so 84").split() == ["so", "84"]
    assert "7" not in strip_calls("<calc>12*7</calc>")


def test_an_episode_with_the_char_tokenizer(env: CalculatorToolEnv) -> None:
    t = task(env)
    assert t.prompt_text.startswith("tool: calc(12*7) gives =84. ") and t.info["split"] == "train"
    assert t.prompt_tokens == CHAR.encode(t.prompt_text, bos=False) and t.max_tokens == 16
    call = f"calc({t.info['fact']})"  # "584+869": the problem's own sum, difference or product
    assert len(reply(call)) <= t.max_tokens
    follow = env.react(t.info, 0, reply(call))
    assert isinstance(follow, FollowUp) and follow.role == "tool"
    assert follow.text == f"={t.info['answer']}" and follow.info == {"tool_calls": 1, "tool_errors": 0}
    CHAR.encode_reply(follow.text, role="tool")  # writable
    info = {**t.info, **follow.info}  # as the producer carries it to the next turn
    final = env.react(info, 1, reply(str(t.info["answer"])))
    assert final == Score(1.0, {"exact": 1.0, "parsed": 1.0, "tool_calls": 1.0, "tool_errors": 0.0})
    wrong = env.react(info, 1, reply(str(t.info["answer"] + 1)))
    assert isinstance(wrong, Score) and wrong.reward == 0.0 and wrong.parts["parsed"] == 1.0


def test_answering_at_once_needs_no_tool(env: CalculatorToolEnv) -> None:
    t = task(env, 1)
    s = env.react(t.info, 0, reply(f"answer: {t.info['answer']}"))
    assert s == Score(1.0, {"exact": 1.0, "parsed": 1.0, "tool_calls": 0.0, "tool_errors": 0.0})
    assert env.score(t.info, reply(str(t.info["answer"]))).reward == 1.0


def test_tool_turns_are_bounded(env: CalculatorToolEnv) -> None:
    t = task(env, 2)
    info: dict[str, Any] = dict(t.info)
    for turn in range(env.max_tool_calls):
        r = env.react(info, turn, reply("calc(2+2)"))
        assert isinstance(r, FollowUp) and r.text == "=4"
        info |= r.info
    # Out of tool turns: this turn is the final answer, read without its call.
    last = env.react(info, env.max_tool_calls, reply(f"calc(2+2){t.info['answer']}"))
    assert isinstance(last, Score) and last.reward == 1.0 and last.parts["tool_calls"] == 2.0
    no_tools = CalculatorToolEnv(CHAR, style="plain", max_tool_calls=0)
    s = no_tools.react(t.info, 0, reply("calc(2+2)"))
    assert isinstance(s, Score) and s.parts == {
        "exact": 0.0,
        "parsed": 0.0,
        "tool_calls": 0.0,
        "tool_errors": 0.0,
    }


def test_failing_calls_answer_with_an_error_the_tokenizer_can_write(env: CalculatorToolEnv) -> None:
    t = task(env, 3)
    r = env.react(t.info, 0, reply("calc(os.x)calc(1/0)calc(2*3)"))
    assert isinstance(r, FollowUp)
    assert r.text == "=error: not allowed: name os;=error: division by zero;=6"  # the quotes dropped
    assert r.info == {"tool_calls": 1, "tool_errors": 2}
    CHAR.encode_reply(r.text, role="tool")
    many = env.react(t.info, 0, reply("calc(1)calc(2)calc(3)calc(4)calc(5)calc(6)"))
    assert isinstance(many, FollowUp) and many.text.split(";")[3:] == [
        "=4",
        "=error: too many calls in one turn",
        "=error: too many calls in one turn",
    ]
    assert many.info["tool_errors"] == 2
    final = env.react({**t.info, **r.info}, 1, reply(str(t.info["answer"])))
    assert isinstance(final, Score) and final.parts["tool_errors"] == 2.0


def test_areact_answers_as_react(env: CalculatorToolEnv) -> None:
    t = task(env, 4)
    r = asyncio.run(env.areact(t.info, 0, reply("calc(6*7)")))
    assert isinstance(r, FollowUp) and r.text == "=42"


def test_the_held_out_split(env: CalculatorToolEnv) -> None:
    held_out = env.eval_tasks(50)
    assert len(held_out) == 50 and held_out == env.eval_tasks(50)
    assert all(is_eval_fact(t.info["fact"]) and t.info["split"] == "eval" for t in held_out)
    rng = random.Random(5)
    train = {env.make_task(rng).info["fact"] for _ in range(1000)}
    assert not any(is_eval_fact(f) for f in train)
    assert max(t.info["answer"] for t in held_out) > 200  # larger numbers than arithmetic's


def test_words_style_needs_a_tokenizer_that_writes_it() -> None:
    with pytest.raises(ValueError, match="calculator: the tokenizer cannot write the 'words' prompts"):
        CalculatorToolEnv(CHAR)
    with pytest.raises(ValueError, match="max_tool_calls"):
        CalculatorToolEnv(CHAR, style="plain", max_tool_calls=-1)


def test_an_episode_through_a_chat_template() -> None:
    """Token in, token out: the prompt, the model's turn and the tool's reply as the producer
    joins them are the template's rendering of the whole conversation."""
    tok = bpe()
    env = CalculatorToolEnv(tok)
    try:
        t = env.make_task(random.Random(6))
        assert t.prompt_text.startswith("<|im_start|>system\nYou have a calculator.")
        assert "<calc>EXPRESSION</calc>" in t.prompt_text and t.max_tokens == 256
        call = f"Let me compute. <calc>{t.info['fact']}</calc>"
        turn0 = reply(call, tok)  # ends on <|im_end|>, the template's end of turn
        follow = env.react(t.info, 0, turn0)
        assert isinstance(follow, FollowUp) and follow.role == "tool" and follow.text == str(t.info["answer"])
        tokens = [*t.prompt_tokens, *turn0, *tok.encode_reply(follow.text, role=follow.role)]
        question = t.prompt_text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        system = t.prompt_text.split("<|im_start|>system\n")[1].split("<|im_end|>")[0]
        convo = [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
            {"role": "assistant", "content": call},
            {"role": "tool", "content": follow.text},
        ]
        assert tok.decode(tokens, skip_special=False, stop_at_eos=False) == tok.render_chat(convo)
        final = env.react({**t.info, **follow.info}, 1, reply(f"Answer: {t.info['answer']}", tok))
        assert isinstance(final, Score) and final.reward == 1.0 and final.parts["tool_calls"] == 1.0
    finally:
        env.close()
