"""Held-out evaluation (producers/evaluation.py): the pass@k estimator, and producers that
evaluate a toy environment's held-out split through a real inference worker and nats-server,
across a crash mid-evaluation and through multi-turn episodes, without a single rollout of it."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from jetrl.bus import events as ev
from jetrl.bus import ids, subjects
from jetrl.bus.client import Bus
from jetrl.bus.payloads import Payloads
from jetrl.bus.server import EmbeddedServer
from jetrl.consumers.inference.engine import GroupRequest, Limits, Sample
from jetrl.consumers.inference.settings import InferencePart, InferenceSettings
from jetrl.consumers.inference.worker import InferenceWorker
from jetrl.policy.tokenizer import CharTokenizer
from jetrl.producers.environments import ChainSumEnv, FollowUp, ModSumEnv, Score, Task
from jetrl.producers.evaluation import Evaluation, pass_at_k, success
from jetrl.producers.evaluation import Sample as EvalSample
from jetrl.producers.producer import EnvProducer
from jetrl.producers.settings import EnvSettings, ProducerPart
from tests.support.runlog import publish_version, wait_for

TOK = CharTokenizer()
M = 5  # modulus
K = 3  # eval samples per task
N_TASKS = 6


# ----------------------------------------------------------------------------- the estimator


@pytest.mark.parametrize(
    ("n", "c", "k", "want"),
    [
        (4, 0, 1, 0.0),
        (4, 1, 1, 0.25),  # pass@1 is c / n
        (4, 3, 1, 0.75),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (4, 3, 2, 1.0),  # n - c < k: every pair holds a success
        (4, 0, 4, 0.0),
        (4, 1, 4, 1.0),
        (10, 3, 5, 11 / 12),  # 1 - C(7,5)/C(10,5) = 1 - 21/252
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_by_hand(n: int, c: int, k: int, want: float) -> None:
    assert math.isclose(pass_at_k(n, c, k), want, rel_tol=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_refuses_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(n, c, k)


def test_success_is_the_exact_part_else_a_full_reward() -> None:
    assert success(Score(0.5, {"exact": 1.0}))  # the part decides when there is one
    assert not success(Score(1.0, {"exact": 0.0}))
    assert success(Score(1.0)) and not success(Score(0.99))


def test_report_of_an_evaluation_by_hand() -> None:
    e = Evaluation(version=4, n_tasks=3, samples=2, temperature=0.7)
    tids = e.task_ids("env", "t")
    outcomes = {
        tids[0]: [(1.0, True), (1.0, True)],
        tids[1]: [(1.0, True), (0.5, False)],
        tids[2]: [(0.0, False)] * 2,
    }
    for tid, samples in outcomes.items():
        for i, (reward, ok) in enumerate(samples):
            e.results[(tid, i)] = EvalSample(reward, ok, 4 + i, 5 + i)
    assert e.complete
    r = e.report("env", "t")
    assert r.successes == [2, 1, 0]
    assert r.pass_at_1 == 0.5  # 3 of 6 samples
    assert math.isclose(r.pass_at_k, 2 / 3)  # tasks 0 and 1 have a success among their 2
    assert math.isclose(r.reward_mean, 3.5 / 6)
    assert (r.version_min, r.version_max, r.n_tasks, r.samples, r.temperature) == (4, 6, 3, 2, 0.7)


# ----------------------------------------------------------------------------- a toy split


def held_out(n: int) -> list[tuple[int, int]]:
    return [(i % M, (i // M + 2) % M) for i in range(n)]


def want_successes(n: int) -> list[int]:
    """What RuleEngine gets right: the first ``a % (K + 1)`` samples of task ``a+b=``."""
    return [a % (K + 1) for a, _ in held_out(n)]


class HeldOutModSum(ModSumEnv):
    """modsum with a held-out split; a gate can hold the scoring of tasks 3.. (a crash there)."""

    def __init__(self, gate: asyncio.Event | None = None) -> None:
        super().__init__(TOK, modulus=M)
        self.gate = gate
        self.blocked: list[asyncio.Task[Any]] = []

    def eval_tasks(self, n: int) -> list[Task]:
        out = []
        for i, (a, b) in enumerate(held_out(n)):
            prompt = f"{a}+{b}="
            out.append(Task(prompt, TOK.encode(prompt), 2, {"answer": str((a + b) % M), "i": i}))
        return out

    async def areact(self, info: dict[str, Any], turn: int, completion_tokens: list[int]) -> Score | FollowUp:
        if self.gate is not None and info.get("i", -1) >= 3:
            task = asyncio.current_task()
            assert task is not None
            self.blocked.append(task)
            await self.gate.wait()
        return self.react(info, turn, completion_tokens)


class HeldOutChainSum(ChainSumEnv):
    def __init__(self) -> None:
        super().__init__(TOK, modulus=M)

    def eval_tasks(self, n: int) -> list[Task]:
        out = []
        for a, b in held_out(n):
            prompt = f"{a}+{b}="
            out.append(Task(prompt, TOK.encode(prompt), 2, {"answer": str((a + b) % M), "c": (a + 1) % M}))
        return out


class RuleEngine:
    """A model-free engine with a known success rate: on a first turn ``a+b=`` sample j of n is
    right iff j < a % (n + 1); a later turn (``a+b=s+c=``) is always answered right."""

    batches_in_flight = 1
    limits: Limits | None = None

    def __init__(self) -> None:
        self._version: int | None = None
        self.temperatures: set[float] = set()

    @property
    def loaded_version(self) -> int | None:
        return self._version

    async def generate(self, groups: Sequence[GroupRequest]) -> list[list[Sample]]:
        out = []
        for g in groups:
            self.temperatures.add(g.temperature)
            segs = TOK.decode(g.prompt_tokens, stop_at_eos=False).split("=")[:-1]
            a, b = (int(x) for x in segs[0].split("+"))
            right = (a + b + sum(int(s.split("+")[1]) for s in segs[1:])) % M
            good = a % (g.n + 1) if len(segs) == 1 else g.n
            samples = []
            for j in range(g.n):
                ids_ = TOK.encode(str(right if j < good else (right + 1) % M), bos=False, eos=True)
                samples.append(Sample(np.asarray(ids_, np.int32), np.zeros(len(ids_), np.float32), "stop"))
            out.append(samples)
        return out

    async def load_weights(self, ready: ev.WeightsReady, payloads: Payloads) -> None:
        self._version = ready.version

    async def close(self) -> None:
        pass


# ----------------------------------------------------------------------------- the run around


WORKER = InferencePart(inference=InferenceSettings(engine="tests.support.engines:OracleEngine"))


def part(name: str, kind: str) -> ProducerPart:
    env = EnvSettings(
        name=name,
        kind=kind,
        group_size=2,
        eval_every=2,
        eval_tasks=N_TASKS,
        eval_samples=K,
        eval_temperature=0.5,
        ack_wait_s=2.0,
    )
    return ProducerPart(env=env, groups_per_step=2, max_off_policy_steps=0)


def reports(log: list[ev.Event]) -> dict[int, ev.Event]:
    return {e.body.policy_version: e for e in log if isinstance(e.body, ev.EvaluationReported)}


async def start_worker(bus: Bus, run_id: str, stop: asyncio.Event) -> tuple[RuleEngine, asyncio.Task[None]]:
    worker = InferenceWorker(bus, run_id, "inf-0", WORKER)
    engine = RuleEngine()
    worker.engine = engine
    return engine, asyncio.create_task(worker.run(stop))


def check_report(r: ev.EvaluationReported, env: str, version: int) -> None:
    want = want_successes(N_TASKS)
    assert (r.env, r.policy_version, r.n_tasks, r.samples, r.temperature) == (env, version, N_TASKS, K, 0.5)
    assert r.successes == want  # no sample lost or counted twice
    assert math.isclose(r.pass_at_1, sum(want) / (N_TASKS * K))
    assert math.isclose(r.pass_at_k, sum(pass_at_k(K, c, K) for c in want) / N_TASKS)
    assert r.version_min >= version and r.version_max >= r.version_min


def check_never_trained(log: list[ev.Event]) -> None:
    scored = [e.body for e in log if isinstance(e.body, ev.RolloutsScored)]
    assert scored and all(b.rollouts for b in scored), "the training tasks go on beside the evaluations"
    assert not [b for b in scored if ids.is_eval_task(b.task_id) or ids.is_eval_task(b.group_id)]
    assert not [r for b in scored for r in b.rollouts if ids.is_eval_task(r.rollout_id)]
    for e in log:
        if isinstance(e.body, ev.TaskSubmitted) and ids.is_eval_task(e.body.task_id):
            assert "eval" in e.body.info and e.body.temperature == 0.5
        elif isinstance(e.body, ev.TaskSubmitted):
            assert "eval" not in e.body.info and e.body.temperature == 1.0


# ----------------------------------------------------------------------------- the tests


async def test_evaluation_survives_a_producer_crash_and_is_never_trained_on(
    nats_server: EmbeddedServer, bus: Bus, run_id: str
) -> None:
    await publish_version(bus, run_id, 0)
    stop = asyncio.Event()
    engine, worker = await start_worker(bus, run_id, stop)
    evals = subjects.eval_subject(run_id)
    try:
        # Producer A scores tasks 0-2 of the evaluation of version 0 (acked: never delivered
        # again) and dies while it holds the rest.
        bus_a = await Bus.connect(nats_server.url, name="producer-a")
        a = EnvProducer(bus_a, run_id, part("heldout", "modsum"))
        env_a = a.env = HeldOutModSum(gate=asyncio.Event())
        task_a = asyncio.create_task(a.run(asyncio.Event()))
        gens = subjects.generation_subject(run_id, "default", "heldout")

        def all_generated(log: list[ev.Event]) -> bool:
            samples = [
                s.sample_index
                for e in log
                if isinstance(e.body, ev.CompletionsGenerated) and ids.is_eval_task(e.body.task_id)
                for s in e.body.samples
            ]
            return len(samples) == N_TASKS * K

        await wait_for(bus, run_id, gens, all_generated)
        for _ in range(100):
            if len(a.evaluator.evals[0].results) == 3 * K and len(env_a.blocked) == (N_TASKS - 3) * K:
                break
            await asyncio.sleep(0.1)
        assert len(a.evaluator.evals[0].results) == 3 * K
        await asyncio.sleep(0.5)  # the acks of what it scored
        task_a.cancel()
        for t in env_a.blocked:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task_a
        await bus_a.close()
        assert reports(await wait_for(bus, run_id, evals, lambda _: True)) == {}

        # Producer B finds the evaluation in the log, scores again what A had acked, and reports it.
        bus_b = await Bus.connect(nats_server.url, name="producer-b")
        b = EnvProducer(bus_b, run_id, part("heldout", "modsum"))
        b.env = HeldOutModSum()
        stop_b = asyncio.Event()
        task_b = asyncio.create_task(b.run(stop_b))
        try:
            log = await wait_for(bus, run_id, evals, lambda log: 0 in reports(log))
            first = reports(log)[0]
            assert first.causation_id is None  # reported from the log at B's start, not a redelivery
            assert first.event_id == ids.evaluation_event_id(run_id, "default", "heldout", 0)
            assert isinstance(first.body, ev.EvaluationReported)
            check_report(first.body, "heldout", 0)

            # Versions 1 and 2: one more evaluation (eval_every 2), of version 2 only.
            await publish_version(bus, run_id, 1)
            await publish_version(bus, run_id, 2)
            log = await wait_for(bus, run_id, evals, lambda log: 2 in reports(log))
            await asyncio.sleep(3.0)  # A's held generations come back to B (ack wait 2 s)
        finally:
            stop_b.set()
            await task_b
            await bus_b.close()
        log = await wait_for(bus, run_id, evals, lambda _: True)
        assert sorted(reports(log)) == [0, 2] and len(log) == 2
        second = reports(log)[2].body
        assert isinstance(second, ev.EvaluationReported)
        check_report(second, "heldout", 2)
        whole = [i.event for i in await bus.read_log(run_id) if i.event is not None]
        check_never_trained(whole)
        eval_tasks = [
            e.body for e in whole if isinstance(e.body, ev.TaskSubmitted) and ids.is_eval_task(e.body.task_id)
        ]
        assert sorted((t.min_policy_version, t.task_id) for t in eval_tasks) == sorted(
            (v, ids.eval_task_id("heldout", "default", v, i)) for v in (0, 2) for i in range(N_TASKS)
        )
        assert engine.temperatures == {0.5, 1.0}
    finally:
        stop.set()
        await worker


async def test_a_multi_turn_environment_is_evaluated_by_its_episodes(bus: Bus, run_id: str) -> None:
    await publish_version(bus, run_id, 0)
    stop = asyncio.Event()
    _, worker = await start_worker(bus, run_id, stop)
    p = EnvProducer(bus, run_id, part("chainheld", "chainsum"))
    p.env = HeldOutChainSum()
    stop_p = asyncio.Event()
    task = asyncio.create_task(p.run(stop_p))
    try:
        log = await wait_for(bus, run_id, subjects.eval_subject(run_id), lambda log: 0 in reports(log))
    finally:
        stop_p.set()
        await task
        stop.set()
        await worker
    r = reports(log)[0].body
    assert isinstance(r, ev.EvaluationReported)
    check_report(r, "chainheld", 0)  # an episode succeeds when both its turns do
    whole = [i.event for i in await bus.read_log(run_id) if i.event is not None]
    check_never_trained(whole)
    later = [
        e.body
        for e in whole
        if isinstance(e.body, ev.TaskSubmitted) and ids.is_eval_task(e.body.task_id) and e.body.turn == 1
    ]
    assert len(later) == N_TASKS * K  # every episode had its second turn, as an evaluation task
    assert all(t.episode is not None and t.episode.group_size == K for t in later)


def test_eval_settings_are_validated() -> None:
    from pydantic import ValidationError

    assert EnvSettings().eval_every == 0  # off unless asked for
    for bad in ({"eval_every": -1}, {"eval_tasks": 0}, {"eval_samples": 0}, {"eval_temperature": -0.1}):
        with pytest.raises(ValidationError):
            EnvSettings(**bad)
