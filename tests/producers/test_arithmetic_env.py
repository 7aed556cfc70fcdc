"""Arithmetic word problems: prompts through the chat template, the answer rule, exact rewards,
and a held-out split that training never draws from."""

from __future__ import annotations

import atexit
import functools
import random
import tempfile
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from jetrl.deploy.tiny_hf_cmd import make_tokenizer_dir
from jetrl.policy.hf_tokenizer import HFTokenizer
from jetrl.policy.tokenizer import CharTokenizer
from jetrl.producers.arithmetic import (
    EVAL_BUCKETS,
    ArithmeticEnv,
    ProblemGenerator,
    is_eval_fact,
    parse_answer,
)
from jetrl.producers.environments import make_environment

CHAR = CharTokenizer()

# ---------------------------------------------------------------- a real tokenizer, made here


@functools.cache
def bpe() -> HFTokenizer:
    """jetrl's Hugging Face tokenizer over a byte-level BPE trained on the spot (no download),
    with a Qwen-style chat template (`jetrl make-hf-tiny`'s). No BOS, as Qwen's. Its folder is
    removed when the test process exits."""
    folder = tempfile.TemporaryDirectory(prefix="jetrl-bpe-")
    atexit.register(folder.cleanup)
    return HFTokenizer(make_tokenizer_dir(Path(folder.name)))


def reply(text: str, tok: Any = CHAR) -> list[int]:
    return list(tok.encode(text, bos=False, eos=True))


# ---------------------------------------------------------------- the answer rule


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("19", 19),
        ("12+7=19", 19),
        ("ann has 12, buys 7, so 19 in all", 19),
        ("I think 12 + 7 is 19. Let me check: 7 + 12 = 19. So 20 is wrong", 20),  # the last number
        ("The answer is 19, because 12 + 7 = 19 and not 21", 19),  # a marker beats the last number
        ("answer: 19. (12 and 7)", 19),
        ("**Answer:** 19 apples. Check: 8", 19),
        ("ANSWER = -3", -3),
        ("So \\boxed{19}. Answer: 20, or 21", 19),  # boxed beats both
        ("\\boxed{x = 19} then \\boxed{}", 19),  # the last box with a number in it
        ("1,234 apples", 1234),
        ("19.0", 19),
        ("2.5", Decimal("2.5")),
        ("12-7", 7),  # a minus after a digit is an operator
        ("x is -4", -4),
        ("no number here", None),
        ("", None),
    ],
)
def test_the_final_answer_rule(text: str, parsed: object) -> None:
    assert parse_answer(text) == parsed


def test_rewards_are_exact_match_of_the_parsed_answer() -> None:
    env = ArithmeticEnv(CHAR, style="plain")
    info = {"answer": 19}
    for text, reward, found in [
        ("19", 1.0, 1.0),
        ("answer: 19", 1.0, 1.0),
        ("12+7=19", 1.0, 1.0),
        ("18", 0.0, 1.0),
        ("190", 0.0, 1.0),
        ("19.5", 0.0, 1.0),
        ("none", 0.0, 0.0),
    ]:
        s = env.score(info, reply(text))
        assert (s.reward, s.parts) == (reward, {"exact": reward, "parsed": found}), text
    assert env.score(info, []).parts == {"exact": 0.0, "parsed": 0.0}
    # Text after <eos> is not the model's answer.
    assert env.score(info, [*reply("18"), *CHAR.encode("19", bos=False)]).reward == 0.0


# ---------------------------------------------------------------- tasks


@pytest.mark.parametrize("style", ["plain", "symbols"])
def test_char_tokenizer_tasks_are_right_and_fit(style: str) -> None:
    env = make_environment("arithmetic", CHAR, style=style)
    assert isinstance(env, ArithmeticEnv)
    rng = random.Random(0)
    ops = set()
    for _ in range(200):
        t = env.make_task(rng)
        assert t.prompt_tokens == CHAR.encode(t.prompt_text, bos=False)  # rendered, then encoded
        a, op, b = _split_fact(t.info["fact"])
        ops.add(op)
        assert t.info["answer"] == {"+": a + b, "-": a - b, "*": a * b}[op] > 0
        assert str(a) in t.prompt_text and str(b) in t.prompt_text
        assert t.info["split"] == "train" and len(reply(str(t.info["answer"]))) <= t.max_tokens
        assert env.score(t.info, reply(str(t.info["answer"]))).reward == 1.0
    assert ops == {"+", "-", "*"}


def test_words_prompts_go_through_the_chat_template() -> None:
    tok = bpe()
    env = ArithmeticEnv(tok)
    t = env.make_task(random.Random(1))
    assert t.prompt_text.startswith("<|im_start|>user\n") and t.prompt_text.endswith(
        "<|im_start|>assistant\n"
    )
    assert "Answer: N" in t.prompt_text and t.max_tokens == 256
    (im_start,) = tok.encode("<|im_start|>", bos=False)
    assert t.prompt_tokens[0] == im_start and t.prompt_tokens.count(im_start) == 2  # specials as such
    assert tok.decode(t.prompt_tokens, skip_special=False, stop_at_eos=False) == t.prompt_text
    right = reply(f"Let me add them. Answer: {t.info['answer']}", tok)
    assert env.score(t.info, right).reward == 1.0
    assert env.score(t.info, reply(f"Answer: {t.info['answer'] + 1}", tok)).reward == 0.0


def test_terse_prompts_ask_for_the_number_alone() -> None:
    tok = bpe()
    env = ArithmeticEnv(tok, style="terse", ops="+-*", max_value=20)
    rng = random.Random(3)
    for t in (env.make_task(rng) for _ in range(30)):
        a, op, b = _split_fact(t.info["fact"])
        question = t.prompt_text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        assert question in (
            f"Compute {a} {op} {b}. Reply with only the number.",
            f"Compute {b} {op} {a}. Reply with only the number.",
        )
        assert t.max_tokens == 10
        assert env.score(t.info, reply(f"{a} {op} {b} = {t.info['answer']}", tok)).reward == 1.0
        assert env.score(t.info, reply(str(t.info["answer"] + 1), tok)).reward == 0.0


def test_a_tokenizer_that_cannot_write_the_prompts_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match=r"cannot write the 'words' prompts.*style='plain'"):
        ArithmeticEnv(CHAR)
    with pytest.raises(ValueError, match="cannot write the 'plain' prompts"):
        ArithmeticEnv(CharTokenizer("0123456789+-*/=? ,."), style="plain")  # no letters
    ArithmeticEnv(CharTokenizer("0123456789+-*="), style="symbols")  # enough for "12+7="


def test_bad_parameters() -> None:
    with pytest.raises(ValueError, match="style"):
        ArithmeticEnv(CHAR, style="latin")
    with pytest.raises(ValueError, match="ops"):
        ArithmeticEnv(CHAR, style="plain", ops="+/")
    with pytest.raises(ValueError, match="max_value"):
        ArithmeticEnv(CHAR, style="plain", max_value=3)
    with pytest.raises(TypeError, match="max_vlaue"):
        make_environment("arithmetic", CHAR, style="plain", max_vlaue=9)


# ---------------------------------------------------------------- the held-out split


def _split_fact(fact: str) -> tuple[int, str, int]:
    op = next(c for c in "+*-" if c in fact)
    a, b = fact.split(op)
    return int(a), op, int(b)


@pytest.mark.parametrize("style", ["plain", "symbols"])
def test_training_never_draws_an_evaluation_fact(style: str) -> None:
    env = ArithmeticEnv(CHAR, style=style)
    held_out = env.eval_tasks(300)
    assert len(held_out) == 300 and all(t.info["split"] == "eval" for t in held_out)
    eval_facts = {t.info["fact"] for t in held_out}
    assert all(is_eval_fact(f) for f in eval_facts)
    rng = random.Random(2)
    train = [env.make_task(rng) for _ in range(3000)]
    train_facts = {t.info["fact"] for t in train}
    assert not train_facts & eval_facts and not any(is_eval_fact(f) for f in train_facts)
    assert not {t.prompt_text for t in train} & {t.prompt_text for t in held_out}
    # Both operand orders of a sum or product are one fact, so "7+12" is as held out as "12+7".
    for t in held_out:
        a, op, b = _split_fact(t.info["fact"])
        assert a <= b or op == "-"


def test_the_split_is_about_one_fact_in_ten_and_stable() -> None:
    gen = ProblemGenerator("symbols", "+-*", 50, 12)
    facts = {gen.draw(random.Random(i)).fact for i in range(3000)}
    share = sum(map(is_eval_fact, facts)) / len(facts)
    assert 0.5 / EVAL_BUCKETS < share < 1.5 / EVAL_BUCKETS
    # Keyed by a hash of the fact, fixed for good: these are what any run holds out.
    assert [f for f in ("3+4", "5+5", "12*12", "6*7", "40-2", "3*4") if is_eval_fact(f)] == [
        "5+5",
        "6*7",
        "3*4",
    ]


def test_eval_tasks_are_the_same_on_every_call_and_prefix_stable() -> None:
    env = ArithmeticEnv(CHAR, style="plain")
    first = env.eval_tasks(40)
    again = ArithmeticEnv(CHAR, style="plain").eval_tasks(40)
    assert first == again and env.eval_tasks(10) == first[:10]
    assert len({t.prompt_text for t in first}) == 40  # distinct problems
    assert env.eval_tasks(0) == []


def test_a_small_split_yields_what_it_holds() -> None:
    env = ArithmeticEnv(CHAR, style="symbols", ops="*", max_factor=5)  # 10 facts, 2 held out
    assert sorted(t.prompt_text for t in env.eval_tasks(100)) == ["2*4=", "3*4=", "4*2=", "4*3="]
