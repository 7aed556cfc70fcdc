"""The pipeline's own cost: `jetrl run` against the same training in one process with no bus.

Both train the demo (configs/demo.toml: its task, model, seeds and hyper-parameters) to its
reward target (a 10-step mean of 0.92) and are timed from start to the step that reaches it:

* one process: generate (the same policy code and inference precision as the embedded engine),
  score (the same environment), train (the same train engine), the weights copied into the
  sampler after each step. Synchronous and on-policy: nothing waits on a bus, nothing overlaps.
* `jetrl run`: every part its own process on a private nats-server, asynchronous with the demo's
  ``max_off_policy_steps``.

Asynchrony must pay for the bus: the target is jetrl <= 1.0x of the one-process loop, the
floor 1.5x. ``--rounds N`` runs every seed's pair N times, round after round, and takes a seed's
ratio of its median times: on a machine whose speed drifts, one round's median seed moves the
headline by a tenth. Extra config overrides (both sides) may be given after ``--``.
``--jetrl-only`` runs `jetrl run` alone (its time to the target per seed, for bench/ab.py's
``--to-target``); ``--json PATH`` writes every seed's rounds.

    python bench/overhead.py [--seeds 0 1 2 3 4] [--rounds 2] [--max-steps 1500] [--jetrl-only]
                             [--json PATH]
                             [-- --inference.precision fp32]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from jetrl.bus.log import configure
from jetrl.bus.server import EmbeddedServer
from jetrl.consumers.trainer.engine import make_train_engine
from jetrl.consumers.trainer.local_engine import LocalTrainEngine
from jetrl.deploy.config import RunConfig, load_config
from jetrl.deploy.cores import others_cores
from jetrl.deploy.launcher import fork_server
from jetrl.deploy.supervisor import Supervisor
from jetrl.policy.loss import group_advantages
from jetrl.policy.sampling import SamplingConfig, generate, inference_copy
from jetrl.policy.tokenizer import Tokenizer, tokenizer_for
from jetrl.policy.train import Rollout
from jetrl.policy.weights import load_into
from jetrl.producers.environments import Environment, make_environment
from jetrl.producers.settings import ProducerPart

ROOT = Path(__file__).resolve().parents[1]


# The one-process loop's torch threads: both cores of the 2-core machines it is measured on.
LOOP_THREADS = min(2, os.cpu_count() or 1)


class Loop(NamedTuple):
    """What the one-process loop runs: the demo trainer's engine (its model is sampled from),
    the sampler's copy of the model, the producer's settings, its environment and tokenizer."""

    engine: LocalTrainEngine
    sampler: torch.nn.Module
    producer: ProducerPart
    env: Environment
    tok: Tokenizer


def loop_parts(cfg: RunConfig, root: Path, threads: int) -> Loop:
    part = cfg.trainer_part(root)
    part = part.model_copy(update={"trainer": part.trainer.model_copy(update={"threads": threads})})
    engine = make_train_engine(part)
    assert isinstance(engine, LocalTrainEngine)  # its model is sampled from here
    (producer,) = cfg.producer_parts()
    tok = tokenizer_for(cfg.model)
    env = make_environment(producer.env.env_kind, tok, **producer.env.params)
    return Loop(engine, inference_copy(engine.model, cfg.inference.precision), producer, env, tok)


def sample_batch(
    cfg: RunConfig, loop: Loop, rng: random.Random, generator: torch.Generator
) -> tuple[list[Rollout], torch.Tensor, float]:
    """One step's rollouts: ``batch_groups`` tasks, ``group_size`` samples each, scored, their
    advantages relative to their group; their rewards; the sampling's CPU seconds (this thread)."""
    env_cfg = loop.producer.env
    tasks = [loop.env.make_task(rng) for _ in range(cfg.trainer.batch_groups)]
    prompts = [t.prompt_tokens for t in tasks for _ in range(env_cfg.group_size)]
    sampling = SamplingConfig(
        max_tokens=max(t.max_tokens for t in tasks),
        temperature=env_cfg.temperature,
        top_p=cfg.inference.top_p,
        stop_token_ids=loop.tok.stop_ids,
    )
    c0 = time.thread_time()
    gens = generate(loop.sampler, prompts, sampling, generator=generator)
    sample_cpu = time.thread_time() - c0
    rewards = torch.tensor(
        [
            loop.env.score(tasks[i // env_cfg.group_size].info, g.completion_ids).reward
            for i, g in enumerate(gens)
        ],
        dtype=torch.float32,
    )
    groups = torch.arange(len(gens)) // env_cfg.group_size
    adv = group_advantages(rewards, groups, std_scale=cfg.trainer.std_scale_advantages)
    batch = [
        Rollout(g.prompt_ids, g.completion_ids, g.logprobs, float(adv[i]), routing=g.routing)
        for i, g in enumerate(gens)
    ]
    return batch, rewards, sample_cpu


def one_process(
    cfg: RunConfig,
    root: Path,
    threads: int,
    *,
    lag: int = 0,
    curve: list[float] | None = None,
    sample_seed: int | None = None,
    on_step: Callable[[torch.Tensor, dict[str, float]], None] | None = None,
    phase_cpu: dict[str, float] | None = None,
    hold: bool = False,
) -> tuple[float | None, int]:
    """Seconds to the reward target (None if not reached) and the steps taken. ``lag``: each
    batch sampled by the version ``lag`` steps old (bench/offpolicy.py), not the newest;
    ``curve`` collects each step's mean reward; ``sample_seed``: the tasks' and the sampler's
    seed, where it is not the run's (the model's init stays the run seed's: bench/stall.py);
    ``on_step``: called with each step's rewards ``[groups, group_size]`` and its metrics;
    ``phase_cpu``: this thread's CPU seconds in sampling and in the train call, added up under
    "sample" and "train" (all of a phase's CPU on one torch thread: bench/step_time.py);
    ``hold``: train on to ``max_steps`` past the target (the figures are still the target's)."""
    t0 = time.perf_counter()
    loop = loop_parts(cfg, root, threads)
    model = loop.engine.model
    rng = random.Random(loop.producer.seed * 7919 if sample_seed is None else sample_seed * 7919 + 1)
    generator = torch.Generator().manual_seed(cfg.run.seed if sample_seed is None else sample_seed)
    window: deque[float] = deque(maxlen=cfg.trainer.reward_window)
    target = cfg.trainer.stop_at_reward
    # The last lag + 1 versions' weights: version s - lag samples step s.
    versions: deque[dict[str, torch.Tensor]] = deque(maxlen=lag + 1)
    reached: tuple[float, int] | None = None
    for step in range(cfg.trainer.max_steps):
        if lag:
            versions.append(copy.deepcopy(model.state_dict()))
            load_into(loop.sampler, versions[0])
        batch, rewards, sample_cpu = sample_batch(cfg, loop, rng, generator)
        c0 = time.thread_time()
        metrics = loop.engine.step(batch)
        if phase_cpu is not None:
            phase_cpu["sample"] = phase_cpu.get("sample", 0.0) + sample_cpu
            phase_cpu["train"] = phase_cpu.get("train", 0.0) + time.thread_time() - c0
        if on_step is not None:
            on_step(rewards.view(-1, loop.producer.env.group_size), metrics)
        if not lag:
            load_into(loop.sampler, model.state_dict())
        window.append(float(rewards.mean()))
        if curve is not None:
            curve.append(window[-1])
        full = len(window) == window.maxlen
        if reached is None and target is not None and full and sum(window) / len(window) >= target:
            reached = time.perf_counter() - t0, step + 1
            if not hold:
                return reached
    return reached or (None, cfg.trainer.max_steps)


def with_jetrl(cfg: RunConfig, url: str, root: Path, run_id: str) -> tuple[float | None, int]:
    # The parts' imports (torch, torchtitan) are done once by the fork server they are forked
    # from; like the one-process loop's, done when this script imported them, they are not timed.
    fork_server_ready()
    sup = Supervisor(cfg, run_id, root / run_id, nats_url=url, quiet=True)
    t0 = time.monotonic()
    asyncio.run(sup.run())
    steps = sup.progress.steps
    report = sup.progress.report
    if not steps:
        return None, 0
    reached = report.summary().get("reward_last10", 0.0) >= (cfg.trainer.stop_at_reward or 2.0)
    # Step times count from the supervisor's start, like the one-process loop's from its own.
    elapsed = steps[-1]["t"] + (sup.progress.started - t0)
    return (elapsed if reached else None), len(steps)


def fork_server_ready() -> None:
    """The fork server started and its modules imported (it is this process's from then on):
    its first fork waits for them."""
    p = fork_server().Process(target=int)
    p.start()
    p.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--max-steps", type=int, default=1500)
    ap.add_argument("--threads", type=int, default=LOOP_THREADS)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="every seed's pair run this many times, round after round: a seed's ratio is of its "
        "median times (a machine whose speed drifts moves one round's median seed by a tenth)",
    )
    ap.add_argument(
        "--jetrl-only",
        action="store_true",
        help="run only `jetrl run`, not the loop: its time to the target per seed (bench/ab.py)",
    )
    ap.add_argument("--json", type=Path, help="also write each seed's rounds here (bench/ab.py reads them)")
    ap.add_argument("over", nargs="*", help="config overrides, after --")
    args = ap.parse_args()
    configure("warning")
    pairs: dict[int, list[Pair]] = {seed: [] for seed in args.seeds}
    # The server runs where `jetrl run` would run its own: off the trainer's cores (deploy/cores.py).
    server_cpus = others_cores(load_config(ROOT / "configs" / "demo.toml"))
    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer(Path(tmp) / "nats", cpus=server_cpus) as srv:
        for r in range(args.rounds):
            label = f"round {r + 1} " if args.rounds > 1 else ""
            for seed in args.seeds:
                over = ["--run.seed", str(seed), "--trainer.max_steps", str(args.max_steps), *args.over]
                cfg = load_config(ROOT / "configs" / "demo.toml", [*over, "--store.recorder", "false"])
                one: tuple[float | None, int] = (None, 0)
                if not args.jetrl_only:
                    one = one_process(cfg, Path(tmp), args.threads)
                    print(f"{label}seed {seed}: one process    {_t(one[0])} in {one[1]} steps", flush=True)
                jet = with_jetrl(cfg, srv.url, Path(tmp), f"overhead-{seed}-r{r}")
                print(f"{label}seed {seed}: jetrl run      {_t(jet[0])} in {jet[1]} steps", flush=True)
                pairs[seed].append(Pair(*one, *jet))
    if args.json is not None:
        args.json.write_text(
            json.dumps({str(seed): [p._asdict() for p in runs] for seed, runs in pairs.items()})
        )
    if args.jetrl_only:
        reached = [runs for runs in pairs.values() if all(p.jet_s is not None for p in runs)]
        print(f"jetrl run to the target: {len(reached)} of {len(pairs)} seeds reached it in every round")
        return
    print()
    print(f"{'seed':>4} {'one process':>14} {'jetrl run':>14} {'ratio':>7}")
    ratios, steps = [], []
    for seed, runs in pairs.items():
        one_s, one_n = _median_of(runs, lambda p: (p.one_s, p.one_n))
        jet_s, jet_n = _median_of(runs, lambda p: (p.jet_s, p.jet_n))
        ratio = jet_s / one_s if one_s and jet_s else None
        if ratio is not None:
            ratios.append(ratio)
            steps.append(jet_n / one_n)
        shown = f"{ratio:.2f}x" if ratio is not None else "-"
        print(f"{seed:>4} {_t(one_s):>8} ({one_n:>4.0f}) {_t(jet_s):>8} ({jet_n:>4.0f}) {shown:>7}")
    rounds = f"; each seed's median of {args.rounds} rounds" if args.rounds > 1 else ""
    print(
        f"(one process: {args.threads} torch threads; jetrl run: the demo's parts on the same cores; "
        f"overrides {args.over or 'none'}{rounds})"
    )
    print()
    if ratios:
        print(
            f"overhead jetrl/one-process {statistics.median(ratios):.2f}x median of {len(ratios)} seeds "
            "(target <= 1.0x, floor 1.5x)"
        )
        print(
            f"steps to target jetrl (max_off_policy_steps {cfg.trainer.max_off_policy_steps})/one process "
            f"(on-policy) {statistics.median(steps):.2f}x median of {len(steps)} seeds (target <= 1.2x)"
        )
    else:
        one_reached = sum(1 for runs in pairs.values() if any(p.one_s is not None for p in runs))
        jet_reached = sum(1 for runs in pairs.values() if any(p.jet_s is not None for p in runs))
        print(
            f"overhead jetrl/one-process: too few seeds to measure (none reached the reward target in "
            f"both within {args.max_steps} steps: one process {one_reached} of {len(pairs)}, jetrl run "
            f"{jet_reached} of {len(pairs)})"
        )


class Pair(NamedTuple):
    """One round of a seed: seconds to the target (None: not reached) and steps, each side."""

    one_s: float | None
    one_n: int
    jet_s: float | None
    jet_n: int


def _median_of(
    runs: list[Pair], side: Callable[[Pair], tuple[float | None, int]]
) -> tuple[float | None, float]:
    """A side's median seconds and steps over the rounds that reached the target (None and the
    median steps of all rounds where none did)."""
    got = [side(p) for p in runs]
    reached = [(s, n) for s, n in got if s is not None]
    if not reached:
        return None, statistics.median(n for _, n in got)
    return statistics.median(s for s, _ in reached), statistics.median(n for _, n in reached)


def _t(s: float | None) -> str:
    return f"{s:.1f} s" if s is not None else "not reached"


if __name__ == "__main__":
    main()
