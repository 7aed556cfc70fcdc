"""The parity environment: prompts through the chat template, the graded answer (strict and
lenient), and a held-out split of numbers that training never draws."""

from __future__ import annotations

import random

import pytest

from jetrl.deploy.tiny_hf_cmd import make_tokenizer_dir
from jetrl.policy.hf_tokenizer import HFTokenizer
from jetrl.producers.environments import make_environment
from jetrl.producers.parity import EVAL_BUCKETS, ParityEnv, grade, is_eval_number


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> ParityEnv:
    tok = HFTokenizer(make_tokenizer_dir(tmp_path_factory.mktemp("bpe")))
    made = make_environment("parity", tok)
    assert isinstance(made, ParityEnv)
    return made


@pytest.mark.parametrize(
    ("answer", "text", "reward", "strict", "lenient"),
    [
        ("yes", "Yes.", 1.0, 1.0, 1.0),
        ("yes", "yes, because 4 is even", 1.0, 1.0, 1.0),
        ("no", "No", 1.0, 1.0, 1.0),
        ("no", "The answer is no, 86", 0.5, 0.0, 1.0),  # right, after words
        ("yes", "The answer is no", 0.0, 0.0, 0.0),
        ("yes", "yes or no? no.", 1.0, 1.0, 0.0),  # strict wins: its first word
        ("no", "maybe yes, maybe no", 0.0, 0.0, 0.0),  # both words: no lenient credit
        ("yes", "", 0.0, 0.0, 0.0),
        ("no", "nothing", 0.0, 0.0, 0.0),  # "no" inside a word is no answer
    ],
)
def test_grading(answer: str, text: str, reward: float, strict: float, lenient: float) -> None:
    s = grade(answer, text, 0.5)
    assert (s.reward, s.parts["strict"], s.parts["lenient"]) == (reward, strict, lenient)


def test_tasks_ask_through_the_chat_template_and_know_their_answer(env: ParityEnv) -> None:
    rng = random.Random(0)
    tasks = [env.make_task(rng) for _ in range(200)]
    for t in tasks:
        assert t.prompt_text.endswith("<|im_start|>assistant\n") and f" {t.info['n']} " in t.prompt_text
        assert t.prompt_tokens == env.tok.encode(t.prompt_text, bos=False)
        odd = "odd" in t.prompt_text
        assert t.info["answer"] == ("yes" if (t.info["n"] % 2 == 1) == odd else "no")
        assert t.max_tokens == 8
    assert {t.info["answer"] for t in tasks} == {"yes", "no"}
    assert env.score(tasks[0].info, env.tok.encode(tasks[0].info["answer"], bos=False)).reward == 1.0


def test_the_held_out_numbers_are_never_drawn_for_training(env: ParityEnv) -> None:
    held = [k for k in range(1000) if is_eval_number(k)]
    assert 0.5 * 1000 / EVAL_BUCKETS < len(held) < 1.5 * 1000 / EVAL_BUCKETS
    rng = random.Random(1)
    drawn = {env.make_task(rng).info["n"] for _ in range(3000)}
    assert not drawn & set(held) and len(drawn) > 800
    evals = env.eval_tasks(40)
    assert [t.info["n"] for t in evals] == [t.info["n"] for t in env.eval_tasks(40)]  # the same every call
    assert all(t.info["split"] == "eval" and is_eval_number(t.info["n"]) for t in evals)
    assert len({t.info["n"] for t in evals}) == 40


def test_bad_parameters_are_refused(env: ParityEnv) -> None:
    for params, words in (
        ({"max_value": 5}, "max_value"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"lenient_credit": 2.0}, "lenient_credit"),
    ):
        with pytest.raises(ValueError, match=words):
            make_environment("parity", env.tok, **params)
