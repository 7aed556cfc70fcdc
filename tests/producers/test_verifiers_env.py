"""The verifiers adapter: a verifiers taskset's tasks go out, its own rewards score the replies."""

from __future__ import annotations

import asyncio
import random
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verifiers.v1", reason="needs the verifiers extra: pip install 'jetrl[verifiers]'")

from jetrl.policy.tokenizer import CharTokenizer
from jetrl.producers.environments import make_environment
from jetrl.producers.verifiers_env import TASK_KEY, VerifiersEnv

TOK = CharTokenizer()


def reply(text: str) -> list[int]:
    return TOK.encode(text, bos=False, eos=True)


def verifiers_env(**params: Any) -> VerifiersEnv:
    """The environment as a producer builds it: by name."""
    env = make_environment("verifiers", TOK, **params)
    assert isinstance(env, VerifiersEnv)
    return env


def score(env: VerifiersEnv, info: dict[str, Any], completion: list[int]):
    return asyncio.run(env.areact(info, 0, completion))


def test_tasks_come_from_the_taskset_and_its_rewards_score_them() -> None:
    env = verifiers_env()
    assert isinstance(env, VerifiersEnv)
    rng = random.Random(0)
    seen = set()
    for _ in range(40):
        t = env.make_task(rng)
        seen.add(t.prompt_text)
        letters = t.prompt_text[:-1]
        assert t.prompt_text.endswith("=") and 2 <= len(letters) <= 4 and set(letters) <= set("abcd")
        assert TOK.decode(t.prompt_tokens) == t.prompt_text and t.max_tokens == 8
        assert t.info[TASK_KEY]["answer"] == letters[::-1]
        exact = score(env, t.info, reply(letters[::-1]))
        assert exact.reward == 1.0 and exact.parts == {"positions": 1.0, "exact": 1.0}
        assert score(env, t.info, [TOK.eos_id]).reward == 0.0
    assert len(seen) > 20  # sampled across the 336 tasks, not one task over and over
    # A wrong letter and an extra letter each cost their share.
    info = {TASK_KEY: {"prompt": "abc=", "answer": "cba"}}
    assert score(env, info, reply("cbb")).reward == pytest.approx(2 / 3)
    assert score(env, info, reply("cbaa")).reward == pytest.approx(3 / 4)
    assert score(env, info, reply("cbaa")).parts["exact"] == 0.0


def test_message_prompts_render_in_order_after_the_system_prompt() -> None:
    import verifiers.v1 as vf

    env = verifiers_env()
    msgs = [vf.SystemMessage(content="be brief"), vf.UserMessage(content="ab=")]
    assert env.render(vf.TaskData(prompt=msgs, system_prompt="sys")) == "sys be brief ab="
    assert env.render(vf.TaskData(prompt="ab=")) == "ab="


def test_scoring_needs_only_the_event_info() -> None:
    """A restarted producer (a new environment object) scores what the old one handed out."""
    t = verifiers_env().make_task(random.Random(3))
    fresh = verifiers_env()
    assert score(fresh, t.info, reply(t.info[TASK_KEY]["answer"])).reward == 1.0


def test_bad_task_info_is_a_clear_error() -> None:
    env = verifiers_env()
    with pytest.raises(ValueError, match="ReverseData"):
        score(env, {TASK_KEY: {"prompt": "ab="}}, reply("ba"))  # no answer
    with pytest.raises(ValueError, match="ReverseData"):
        score(env, {"answer": "ba"}, reply("ba"))


def write_taskset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_prompts_the_tokenizer_cannot_write_are_skipped_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ts = write_taskset(
        tmp_path,
        monkeypatch,
        "vf_mixed_case",
        """
        import verifiers.v1 as vf

        class Upper(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
            @vf.reward
            async def nonempty(self, trace: vf.Trace) -> float:
                return float(bool(trace.last_reply))

        class Mixed(vf.Taskset[Upper, vf.TasksetConfig]):
            def load(self):
                for p in ["ab=", "AB=", "cd=", "\\u00e9="]:
                    yield Upper(vf.TaskData(prompt=p, system_prompt="say"), self.config.task)

        __all__ = ["Mixed"]
        """,
    )
    env = verifiers_env(taskset=ts, max_tokens=3)
    prompts = {env.make_task(random.Random(i)).prompt_text for i in range(30)}
    assert prompts == {"say ab=", "say cd="}  # the system prompt, then the prompt
    assert env.skipped == 2
    t = env.make_task(random.Random(0))
    assert score(env, t.info, reply("x")).parts == {"nonempty": 1.0}


def test_an_endless_taskset_is_read_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ts = write_taskset(
        tmp_path,
        monkeypatch,
        "vf_endless",
        """
        import itertools
        import verifiers.v1 as vf

        class Count(vf.Taskset[vf.Task, vf.TasksetConfig]):
            INFINITE = True

            def load(self):
                for i in itertools.count():
                    # every third prompt is one the tokenizer cannot write
                    yield vf.Task(vf.TaskData(prompt=f"{i}=" if i % 3 else f"N{i}"), self.config.task)

        __all__ = ["Count"]
        """,
    )
    env = verifiers_env(taskset=ts)
    rng = random.Random(0)
    assert [env.make_task(rng).prompt_text for _ in range(4)] == ["1=", "2=", "4=", "5="]
    assert env.skipped == 2


def test_a_reward_that_hangs_fails_the_scoring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ts = write_taskset(
        tmp_path,
        monkeypatch,
        "vf_hangs",
        """
        import asyncio
        import verifiers.v1 as vf

        class Slow(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
            @vf.reward
            async def judge(self, trace: vf.Trace) -> float:
                await asyncio.sleep(3600)
                return 1.0

        class Hangs(vf.Taskset[Slow, vf.TasksetConfig]):
            def load(self):
                yield Slow(vf.TaskData(prompt="ab="), self.config.task)

        __all__ = ["Hangs"]
        """,
    )
    env = verifiers_env(taskset=ts, score_timeout_s=0.2)
    t = env.make_task(random.Random(0))
    with pytest.raises(TimeoutError):
        score(env, t.info, reply("ba"))


def test_untrainable_tasksets_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModuleNotFoundError, match="no_such_taskset"):
        verifiers_env(taskset="no_such_taskset")
    needs_box = write_taskset(
        tmp_path,
        monkeypatch,
        "vf_needs_box",
        """
        import verifiers.v1 as vf

        class Boxed(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
            @vf.reward
            async def tests_pass(self, trace: vf.Trace, runtime) -> float:
                return 1.0

        class NeedsBox(vf.Taskset[Boxed, vf.TasksetConfig]):
            def load(self):
                yield Boxed(vf.TaskData(prompt="ab="), self.config.task)

        __all__ = ["NeedsBox"]
        """,
    )
    with pytest.raises(ValueError, match="runtime"):
        verifiers_env(taskset=needs_box)
    unwritable = write_taskset(
        tmp_path,
        monkeypatch,
        "vf_unwritable",
        """
        import verifiers.v1 as vf

        class Shout(vf.Taskset[vf.Task, vf.TasksetConfig]):
            def load(self):
                yield vf.Task(vf.TaskData(prompt="HELLO"), self.config.task)

        __all__ = ["Shout"]
        """,
    )
    env = verifiers_env(taskset=unwritable)
    with pytest.raises(ValueError, match="no task of taskset"):
        env.make_task(random.Random(0))


@pytest.mark.slow
async def test_a_short_run_trains_on_a_verifiers_taskset(nats_server, tmp_path: Path) -> None:
    """All processes, a real nats-server: the verifiers taskset's rewards reach the trainer."""
    from jetrl.bus import events as ev
    from jetrl.deploy.config import load_config
    from jetrl.deploy.supervisor import Supervisor
    from jetrl.store import queries
    from jetrl.store.db import open_store
    from tests.support.runlog import read_log

    steps = 3
    cfg = load_config(
        Path(__file__).parents[2] / "configs" / "verifiers.toml",
        [
            *("--trainer.max_steps", str(steps), "--trainer.batch_groups", "2"),
            *("--inference.workers", "1", "--envs.0.group_size", "4"),
            *("--bus.max_gib", "0.25", "--bus.payload_max_gib", "0.5"),
        ],
    )
    run_id = "e2evf"
    sup = Supervisor(cfg, run_id, tmp_path / run_id, nats_url=nats_server.url, quiet=True)
    assert await sup.run() == 0

    log = await read_log(nats_server.url, run_id)
    tasks = {e.body.task_id: e.body for e in log if isinstance(e.body, ev.TaskSubmitted)}
    assert tasks and all(t.env == "vf-reverse" and TASK_KEY in t.info for t in tasks.values())
    groups = [e.body for e in log if isinstance(e.body, ev.RolloutsScored)]
    assert groups and all(len(g.rollouts) == g.group_size == 4 for g in groups)  # a group an event
    scored = [r for g in groups for r in g.rollouts]
    assert all({"positions", "exact"} <= set(r.reward_parts) for r in scored)
    for r in scored:  # the reward is the taskset's positions reward, in [0, 1]
        assert r.reward == r.reward_parts["positions"] and 0.0 <= r.reward <= 1.0
    trained = [rid for e in log if isinstance(e.body, ev.StepCompleted) for rid in e.body.rollout_ids]
    assert len(trained) == steps * 2 * 4 and not [e for e in log if isinstance(e.body, ev.DeadLettered)]
    store = open_store(sup.db_url)
    try:
        assert [h.step for h in queries.step_history(store, run_id)] == list(range(steps))
    finally:
        store.close()


def test_a_config_naming_an_unusable_taskset_is_refused() -> None:
    from jetrl.deploy.config import ConfigError, load_config

    with pytest.raises((ConfigError, ValueError), match="no_such_taskset"):
        load_config(
            None,
            [
                "--envs.0.name",
                "vf",
                "--envs.0.kind",
                "verifiers",
                "--envs.0.params",
                '{ taskset = "no_such_taskset" }',
            ],
        )
    cfg = load_config(None, ["--envs.0.name", "vf", "--envs.0.kind", "verifiers"])
    assert cfg.producer_parts()[0].env.kind == "verifiers" and cfg.producer_parts()[0].env.name == "vf"
