"""Built-in environments: tasks are well formed and rewards are exact and dense."""

from __future__ import annotations

import random

import pytest

from jetrl.policy.tokenizer import CharTokenizer
from jetrl.producers.environments import ENVIRONMENTS, ReverseEnv, make_environment

TOK = CharTokenizer()


def answer_ids(text: str) -> list[int]:
    return TOK.encode(text, bos=False, eos=True)


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_exact_answer_scores_one_and_tasks_fit(name: str) -> None:
    env = make_environment(name, TOK)
    rng = random.Random(0)
    for _ in range(50):
        t = env.make_task(rng)
        assert t.prompt_tokens[0] == TOK.bos_id and TOK.decode(t.prompt_tokens) == t.prompt_text
        assert len(answer_ids(t.info["answer"])) <= t.max_tokens
        s = env.score(t.info, answer_ids(t.info["answer"]))
        assert s.reward == 1.0 and s.parts["exact"] == 1.0
        assert env.score(t.info, [TOK.pad_id] * t.max_tokens).reward == 0.0


def test_rewards_are_dense_and_positional() -> None:
    env = make_environment("reverse", TOK)
    info = {"answer": "cba"}
    assert env.score(info, answer_ids("cba")).reward == 1.0
    assert env.score(info, answer_ids("cbb")).reward == 0.75  # 3 of 4 target positions (with <eos>)
    assert env.score(info, TOK.encode("cba", bos=False)).reward == 0.75  # no <eos>: not exact
    assert env.score(info, TOK.encode("cba", bos=False)).parts["exact"] == 0.0
    assert env.score(info, []).reward == 0.0


def test_answers_are_right() -> None:
    rng = random.Random(1)
    for name, check in (
        ("reverse", lambda p, a: a == p[:-1][::-1]),
        ("sort", lambda p, a: a == "".join(sorted(p[:-1]))),
        ("modsum", lambda p, a: int(a) == (int(p[0]) + int(p[2])) % 5),
    ):
        env = make_environment(name, TOK)
        for _ in range(20):
            t = env.make_task(rng)
            assert check(t.prompt_text, t.info["answer"]), (name, t)


def test_unknown_environment_and_bad_params() -> None:
    with pytest.raises(KeyError, match="unknown environment"):
        make_environment("chess", TOK)
    with pytest.raises(ValueError, match="modulus"):
        make_environment("modsum", TOK, modulus=11)
    with pytest.raises(TypeError, match="modulos"):  # a misspelled parameter is not ignored
        make_environment("modsum", TOK, modulos=5)
    with pytest.raises(ValueError, match="min_len"):
        make_environment("reverse", TOK, min_len=3, max_len=2)


def test_chainsum_is_two_turns() -> None:
    from jetrl.producers.environments import FollowUp, Score

    env = make_environment("chainsum", TOK, modulus=5)
    t = env.make_task(random.Random(3))
    a, b = int(t.prompt_text[0]), int(t.prompt_text[2])
    reply = env.react(t.info, 0, answer_ids(str((a + b) % 5)))
    assert isinstance(reply, FollowUp) and reply.text == f"+{t.info['c']}="
    info = {**t.info, **reply.info}
    final = env.react(info, 1, answer_ids(str((a + b + t.info["c"]) % 5)))
    assert isinstance(final, Score) and final.reward == 1.0 and final.parts["exact"] == 1.0
    wrong = env.react(info, 1, answer_ids(str((a + b + t.info["c"] + 1) % 5)))
    assert isinstance(wrong, Score) and wrong.reward == 0.75 and wrong.parts["exact"] == 0.0


class Countdown(ReverseEnv):
    """An environment of the user's code: the reverse task under another name."""

    name = "countdown"


def test_an_environment_of_the_users_own_code_is_named_by_its_path() -> None:
    env = make_environment(f"{__name__}:Countdown", TOK)
    assert isinstance(env, Countdown)
    task = env.make_task(random.Random(0))
    assert env.score(task.info, answer_ids(task.info["answer"])).reward == 1.0
    with pytest.raises(ValueError, match="not a subclass of Environment"):
        make_environment(f"{__name__}:answer_ids", TOK)
    with pytest.raises(ValueError, match="cannot load environment"):
        make_environment(f"{__name__}:Missing", TOK)
