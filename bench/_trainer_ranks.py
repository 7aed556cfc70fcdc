"""One layout of bench/trainer.py, in processes of its own (one per rank), so that each rank's
memory high-water mark is its own and the bench's process never joins a process group.

    python bench/_trainer_ranks.py SPEC_JSON OUT_JSON

``local``: the single-process engine. ``parallel`` of world 1: the parallel engine itself,
through TrainCore (no launcher: rank 0 starts no other rank). ``parallel`` of a larger world:
bench/trainer.py starts every rank with the launcher's variables, and each rank builds the
engine's per-rank part (ShardedPolicy) through group.join, rank 0 handing every step's rollouts
over as the engine does; so rank 1's shard and memory figures are measured on rank 1. Rank 0
writes OUT_JSON: the step times and every rank's figures, or the error that stopped it.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

os.environ.setdefault("JETRL_LOG_LEVEL", "warning")

import torch
from torch.distributed.tensor import DTensor

from jetrl.consumers.trainer.core import TrainCore
from jetrl.consumers.trainer.local_engine import LocalTrainEngine
from jetrl.consumers.trainer.parallel import group as rank_group
from jetrl.consumers.trainer.parallel.sharded import ShardedPolicy
from jetrl.consumers.trainer.settings import TrainerPart
from jetrl.policy.models import ModelConfig
from jetrl.policy.origin import model_config_of
from jetrl.policy.train import Rollout

ERROR_PREFIX = "bench rank error: "  # the last stderr line of a rank that failed


def proc_status_kib(field: str) -> int:
    """A ``/proc/self/status`` figure in KiB (VmHWM: the RSS high-water mark); off Linux,
    getrusage's peak for VmHWM and 0 for others."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) if field == "VmHWM" else 0


def local_bytes(tensors: Iterable[Any]) -> int:
    """Bytes this rank holds of these tensors: a DTensor's local shard only."""
    total = 0
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    return {
        "param_bytes": local_bytes(params),
        "grad_bytes": local_bytes(p.grad for p in params if p.grad is not None),
        "optim_bytes": local_bytes(v for st in optimizer.state.values() for v in st.values()),
    }


def make_rollouts(cfg: ModelConfig, spec: dict[str, Any]) -> list[Rollout]:
    """Seeded rollouts of mixed lengths with random routing traces (as inference records them:
    one top-k row per MoE layer per forward position); the same in every layout."""
    g = torch.Generator().manual_seed(int(spec["seed"]))
    (p_lo, p_hi), (c_lo, c_hi) = spec["prompt"], spec["completion"]
    out = []
    for _ in range(int(spec["n"])):
        p = int(torch.randint(p_lo, p_hi + 1, (1,), generator=g))
        c = int(torch.randint(c_lo, c_hi + 1, (1,), generator=g))
        ids = torch.randint(0, cfg.vocab_size, (p + c,), generator=g).tolist()
        trace = None
        if cfg.is_moe:
            rows = (p + c - 1) * cfg.num_moe_layers
            picks = [torch.randperm(cfg.num_experts, generator=g)[: cfg.top_k] for _ in range(rows)]
            trace = torch.stack(picks).view(p + c - 1, cfg.num_moe_layers, cfg.top_k)
        adv = float(torch.randn(1, generator=g))
        out.append(Rollout(ids[:p], ids[p:], torch.zeros(c), adv, routing=trace))
    return out


def near(rollouts: list[Rollout], logprobs: list[torch.Tensor]) -> None:
    """Inference log-probs a little off the trainer's, as inference's are: few tokens fall
    outside the ratio bounds, so every step trains on nearly all of them."""
    g = torch.Generator().manual_seed(1)
    for r, lp in zip(rollouts, logprobs, strict=True):
        r.inference_logprobs = lp + 0.02 * torch.randn(lp.shape, generator=g)


def timed_steps(
    step: Callable[[], None], warmup: int, steps: int, deadline: float, go: Callable[[bool], bool]
) -> tuple[list[float], list[float]]:
    """Warm-up then timed steps; after the first timed one, a step that would end past
    ``deadline`` (wall clock) is not started (``go``: every rank follows rank 0's decision)."""
    warm: list[float] = []
    timed: list[float] = []
    for _ in range(warmup):
        t0 = time.perf_counter()
        step()
        warm.append(time.perf_counter() - t0)
    for i in range(steps):
        if not go(i == 0 or time.time() + max(timed) < deadline):
            break
        t0 = time.perf_counter()
        step()
        timed.append(time.perf_counter() - t0)
    return warm, timed


def run(spec: dict[str, Any]) -> dict[str, Any] | None:
    rss_start = proc_status_kib("VmRSS")  # torch and jetrl imported, nothing built
    part = TrainerPart.model_validate(spec["part"])
    cfg = model_config_of(part.model)
    world = part.trainer.parallelism.world_size
    rollouts = make_rollouts(cfg, spec["rollouts"])
    t0 = time.perf_counter()
    group: rank_group.RankGroup | None = None
    if spec["mode"] == "local":
        eng = LocalTrainEngine(part)
        model, optimizer, engine = eng.model, eng.optimizer, "LocalTrainEngine"

        def logprobs() -> list[torch.Tensor] | None:
            return eng.logprobs(rollouts)

        def step() -> None:
            eng.step(rollouts)

    elif world == 1:
        core = TrainCore(part)  # [trainer] engine = "parallel": no launcher, no other rank
        sharded: ShardedPolicy = core.engine.local  # type: ignore[attr-defined]
        model, optimizer, engine = sharded.model, sharded.optimizer, type(core.engine).__name__

        def logprobs() -> list[torch.Tensor] | None:
            return core.engine.logprobs(rollouts)

        def step() -> None:
            core.train(rollouts)

    else:
        group = rank_group.join(part.trainer.parallelism if int(os.environ["RANK"]) == 0 else None)
        policy = ShardedPolicy(part, group)
        model, optimizer, engine = policy.model, policy.optimizer, "ShardedPolicy on every rank"
        mine = rollouts if group.rank == 0 else None

        def logprobs() -> list[torch.Tensor] | None:
            return policy.logprobs(mine)

        def step() -> None:
            policy.step(mine)

    build_s = time.perf_counter() - t0

    def go(ok: bool) -> bool:  # every rank takes rank 0's decision
        return ok if group is None else bool(group.broadcast(ok))

    hwm_built = proc_status_kib("VmHWM")  # the model and optimizer built, nothing run yet
    lp = logprobs()
    if lp is not None:  # rank 0
        near(rollouts, lp)
    warm, timed = timed_steps(step, int(spec["warmup"]), int(spec["steps"]), float(spec["deadline"]), go)
    mine_report = {
        "rank": 0 if group is None else group.rank,
        "pid": os.getpid(),
        "rss_start_kib": rss_start,
        "hwm_built_kib": hwm_built,
        "hwm_kib": proc_status_kib("VmHWM"),
        "rss_end_kib": proc_status_kib("VmRSS"),
        "threads": torch.get_num_threads(),
        **state_bytes(model, optimizer),
    }
    reports = [mine_report] if group is None else group.gather(mine_report)
    if group is not None and group.rank != 0:
        group.broadcast()  # rank 0's stop, as the engine's ranks wait for it
        rank_group.leave()
        return None
    rank_group.leave()
    return {
        "ok": True,
        "engine": engine,
        "world": world,
        "build_s": build_s,
        "warmup_s": warm,
        "step_s": timed,
        "tokens": sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts),
        "completion_tokens": sum(len(r.completion_ids) for r in rollouts),
        "params": sum(p.numel() for p in model.parameters()) if world == 1 else None,
        "ranks": reports,
    }


def main() -> int:
    spec, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = run(spec)
    except Exception as exc:  # reported by the bench as "not measured (why)"
        traceback.print_exc()
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:400]
        print(ERROR_PREFIX + why, file=sys.stderr, flush=True)
        if rank == 0:
            out.write_text(json.dumps({"ok": False, "error": why}))
        return 1
    if result is not None:
        out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
