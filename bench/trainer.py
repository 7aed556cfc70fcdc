"""The train engines on CPU: step time and memory per rank, 1 rank against 2.

    python bench/trainer.py [--quick] [--steps N] [--warmup N] [--timeout S] [--json PATH]

About 1 minute on 2 (shared) cores, ``--quick`` under one (a smaller model, fewer steps).

An MoE model big enough for sharding to show (by default tiny-moe widened to dim 256, 4
layers, 16 experts top 2, vocab 2048: 14.4 M parameters, 58 MB in fp32) trains on the same
seeded synthetic rollouts (mixed lengths, random routing traces replayed by Router Replay) in
each layout, each layout in fresh processes of its own (bench/_trainer_ranks.py), one after
the other:

* local, 1 rank: LocalTrainEngine, the reference "1 rank";
* local, 1 rank with a thread per CPU (not with --quick): the cores 2 ranks use, in 1 rank;
* parallel, 1 rank: ParallelTrainEngine itself (``engine = "parallel"``, the default
  parallelism: world 1, so it starts no other rank);
* fsdp, 2 ranks: ``dp_shard = 2`` (FSDP2);
* fsdp+ep, 2 ranks: ``dp_shard = 2, ep = 2`` (the experts split over the ranks too).

The 2-rank layouts start every rank as a launcher would, and each builds the engine's per-rank
part (ShardedPolicy) through group.join and runs its collective step, rank 0 holding the
rollouts and scattering them as under the engine (which only adds one command broadcast a
step); so each rank measures itself. Per layout: the median step time over the timed steps after
the warm-up (rank 0's wall time: a step ends when every rank has reported to it); per rank the
RSS high-water mark (``VmHWM``, what the process ever held, torch's own ~370 MB included) and
the bytes of parameters and optimizer state it holds (a DTensor's local shard), whose ratio to
the whole model's (the local engine's) FSDP2 should bring to 1/N. Torch runs one thread per
rank (``[trainer] threads = 1``) so that 2 ranks do not oversubscribe 2 cores. A layout that
fails or runs past its time limit is reported "not measured (why)"; a slow machine takes fewer
timed steps rather than running past it. The summary ends with one line per headline figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jetrl.bus.server import free_port

HERE = Path(__file__).resolve().parent
RANKS_SCRIPT = HERE / "_trainer_ranks.py"
ERROR_PREFIX = "bench rank error: "  # as _trainer_ranks.py writes it (not imported: it imports torch)
CPU_COUNT = os.cpu_count() or 1
MiB = 1024 * 1024

# The model (overrides of tiny-moe) and each step's rollouts (how many, prompt and completion
# length ranges). The default keeps a 2-rank step under a second on 2 cores.
MODELS: dict[str, tuple[dict[str, int], dict[str, Any]]] = {
    "default": (
        dict(vocab_size=2048, dim=256, n_layers=4, head_dim=64, num_experts=16, top_k=2, moe_hidden_dim=256),
        {"n": 16, "prompt": [16, 32], "completion": [32, 96], "seed": 0},
    ),
    "quick": (
        dict(vocab_size=1024, dim=128, n_layers=2, head_dim=32, num_experts=8, top_k=2, moe_hidden_dim=128),
        {"n": 8, "prompt": [8, 16], "completion": [16, 48], "seed": 0},
    ),
}


@dataclass(frozen=True)
class Layout:
    key: str
    title: str
    mode: str  # "local" or "parallel"
    parallelism: dict[str, int] = field(default_factory=dict)
    threads: int = 1

    @property
    def world(self) -> int:
        p = self.parallelism
        return p.get("dp_shard", 1) * p.get("dp_replicate", 1) * p.get("cp", 1) * p.get("tp", 1)


REFERENCE = Layout("local", "local engine, 1 rank", "local")
LAYOUTS = [
    REFERENCE,
    Layout("local-threads", f"local engine, 1 rank, {CPU_COUNT} threads", "local", threads=CPU_COUNT),
    Layout("parallel-1", "parallel engine, 1 rank (default parallelism)", "parallel"),
    Layout("fsdp", "fsdp, 2 ranks (dp_shard 2)", "parallel", {"dp_shard": 2}),
    Layout("fsdp+ep", "fsdp+ep, 2 ranks (dp_shard 2, ep 2)", "parallel", {"dp_shard": 2, "ep": 2}),
]


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.strip().lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def _rank_error(path: Path) -> str:
    """What a failed rank said: its own summary line, else its last line of output."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    own = [ln.removeprefix(ERROR_PREFIX) for ln in lines if ln.startswith(ERROR_PREFIX)]
    return (own or lines or [""])[-1][:400]


def run_layout(layout: Layout, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The layout's figures from rank 0, or ``{"ok": False, "error": why}``."""
    overrides, rollouts = MODELS["quick" if args.quick else "default"]
    # Timed steps stop before the deadline; the hard limit leaves time to build and tear down.
    deadline = time.time() + args.timeout - 15
    spec = {
        "mode": layout.mode,
        "part": {
            "trainer": {
                "engine": layout.mode,
                "threads": layout.threads,
                "lr": 1e-4,
                "parallelism": layout.parallelism,
            },
            "model": {"name": "tiny-moe", "overrides": overrides},
            "seed": 0,
        },
        "rollouts": rollouts,
        "warmup": args.warmup,
        "steps": args.steps,
        "deadline": deadline,
    }
    out = tmp / f"{layout.key}.json"
    base = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    base.update(JETRL_LOG_LEVEL="warning", OMP_NUM_THREADS=str(layout.threads))
    envs = [base]
    if layout.world > 1:  # as a launcher starts ranks; world 1 is the engine's own, no launcher
        common = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(layout.world),
        }
        common["LOCAL_WORLD_SIZE"] = common["WORLD_SIZE"]
        envs = [{**base, **common, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(layout.world)]
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    t0 = time.monotonic()
    try:
        for r, env in enumerate(envs):
            err = tmp / f"{layout.key}.rank{r}.err"
            with err.open("wb") as f:
                cmd = [sys.executable, str(RANKS_SCRIPT), json.dumps(spec), str(out)]
                procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=f), err))
        for p, _ in procs:
            p.wait(timeout=max(1.0, args.timeout - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {args.timeout:.0f} s"}
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if out.exists():
        result: dict[str, Any] = json.loads(out.read_text())
        result["wall_s"] = time.monotonic() - t0
        if result.get("ok") or not any(p.returncode for p, _ in procs[1:]):
            return result
    # Another rank's own message first: rank 0 only sees its collectives fail.
    failed = [r for r, (p, _) in enumerate(procs) if p.returncode]
    if failed:
        r = max(failed, key=lambda r: r != 0)
        p, err = procs[r]
        return {"ok": False, "error": f"rank {r} exited {p.returncode}: {_rank_error(err) or 'no message'}"}
    return {"ok": False, "error": "rank 0 wrote no figures"}


# ----------------------------------------------------------------------------- report


def median_step(r: dict[str, Any]) -> float | None:
    return statistics.median(r["step_s"]) if r.get("ok") and r.get("step_s") else None


def state_of(rank: dict[str, Any]) -> int:
    return int(rank["param_bytes"]) + int(rank["optim_bytes"])


def layout_lines(layout: Layout, r: dict[str, Any], whole: int | None, args: argparse.Namespace) -> list[str]:
    out = [f"\n== {layout.title}"]
    if not r.get("ok"):
        return [*out, f"not measured ({r.get('error', 'no figures')})"]
    steps = r["step_s"]
    med = statistics.median(steps)
    short = (
        f", stopped at the time limit after {len(steps)} of {args.steps}" if len(steps) < args.steps else ""
    )
    params = f", {r['params'] / 1e6:.1f} M parameters" if r.get("params") else ""
    out.append(
        f"engine    {r['engine']}, {r['world']} rank(s), {r['ranks'][0]['threads']} torch thread(s)"
        f" per rank{params}"
    )
    warm = ", ".join(f"{w:.2f}" for w in r["warmup_s"])
    out.append(
        f"step      median {med:.3f} s (min {min(steps):.3f}, max {max(steps):.3f}) over {len(steps)} timed"
        f" steps{short}, after {len(r['warmup_s'])} warm-up ({warm} s);"
        f" {r['tokens'] / med:,.0f} tokens/s; built in {r['build_s']:.1f} s, {r['wall_s']:.1f} s in all"
    )
    for rank in r["ranks"]:
        st = state_of(rank)
        share = f" = {st / whole:.3f} of the whole model's {whole / MiB:.1f} MiB" if whole else ""
        hwm, start, built, end = (
            rank[k] / 1024 for k in ("hwm_kib", "rss_start_kib", "hwm_built_kib", "rss_end_kib")
        )
        out.append(
            f"rank {rank['rank']}    peak RSS {hwm:,.0f} MiB ({start:,.0f} MiB after imports,"
            f" {built:,.0f} MiB once built, {end:,.0f} MiB resident at the end); params"
            f" {rank['param_bytes'] / MiB:.1f} MiB + optimizer state {rank['optim_bytes'] / MiB:.1f} MiB ="
            f" {st / MiB:.1f} MiB{share}; grads {rank['grad_bytes'] / MiB:.1f} MiB"
        )
    return out


def summary_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    ref = results.get(REFERENCE.key, {})
    ref_step = median_step(ref)
    ref_hwm = ref["ranks"][0]["hwm_kib"] if ref.get("ok") else None
    whole = state_of(ref["ranks"][0]) if ref.get("ok") else None
    why_ref = ref.get("error", "not run")
    if ref_step is not None:
        out.append(f"trainer step time local engine 1 rank {ref_step:.3f} s median (target: reported)")
    else:
        out.append(f"trainer step time local engine 1 rank: not measured ({why_ref}) (target: reported)")
    both = median_step(results.get("local-threads", {}))
    for key, name in (
        ("parallel-1", "parallel engine 1 rank"),
        ("fsdp", "fsdp 2 ranks"),
        ("fsdp+ep", "fsdp+ep 2 ranks"),
    ):
        r = results.get(key, {})
        s = median_step(r)
        if s is None or ref_step is None:
            why = r.get("error", "not run") if s is None else f"1 rank: {why_ref}"
            out.append(f"trainer step time {name} / local 1 rank: not measured ({why}) (target: reported)")
        else:
            # 2 ranks use every core: beside the 1-thread rank, the 1 rank that uses them all.
            cores = (
                f", {s / both:.2f}x of local 1 rank on {CPU_COUNT} threads"
                if both and key != "parallel-1"
                else ""
            )
            out.append(
                f"trainer step time {name} {s / ref_step:.2f}x of local 1 rank"
                f" ({s:.3f} s vs {ref_step:.3f} s{cores}; target: reported)"
            )
    for key, name in (("fsdp", "fsdp 2 ranks"), ("fsdp+ep", "fsdp+ep 2 ranks")):
        r = results.get(key, {})
        if not r.get("ok") or ref_hwm is None or whole is None:
            why = r.get("error", "not run") if not r.get("ok") else f"1 rank: {why_ref}"
            out.append(f"trainer peak RSS per rank {name} / 1 rank: not measured ({why}) (target: reported)")
            out.append(
                f"trainer params+optimizer per rank {name} / whole: not measured ({why}) (target ~0.5)"
            )
            continue
        hwm = max(rank["hwm_kib"] for rank in r["ranks"])
        # The parallel engine on 1 rank has FSDP2's own buffers too: the like-for-like peak.
        p1 = results.get("parallel-1", {})
        p1_s = f", {p1['ranks'][0]['hwm_kib'] / 1024:,.0f} MiB parallel 1 rank" if p1.get("ok") else ""
        out.append(
            f"trainer peak RSS per rank {name} {hwm / ref_hwm:.2f}x of local 1 rank"
            f" (largest rank {hwm / 1024:,.0f} MiB vs {ref_hwm / 1024:,.0f} MiB{p1_s}; target: reported)"
        )
        shares = [state_of(rank) / whole for rank in r["ranks"]]
        each = ", ".join(f"rank {rank['rank']} {s:.3f}" for rank, s in zip(r["ranks"], shares, strict=True))
        out.append(
            f"trainer params+optimizer per rank {name} {max(shares):.3f} of whole"
            f" (largest rank; {each}; target ~{1 / len(shares):.1f})"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small model and few steps (under a minute)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per layout (default 8, quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2, quick 1)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per layout (default 150, quick 45)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (3 if args.quick else 8)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.timeout = args.timeout if args.timeout is not None else (45.0 if args.quick else 150.0)
    if args.steps < 1 or args.warmup < 0 or args.timeout < 20:
        p.error("--steps must be at least 1, --warmup at least 0, --timeout at least 20")
    overrides, rollouts = MODELS["quick" if args.quick else "default"]
    layouts = [lay for lay in LAYOUTS if not (lay.key == "local-threads" and (args.quick or CPU_COUNT == 1))]
    print(
        f"trainer bench: tiny-moe with {', '.join(f'{k} {v}' for k, v in overrides.items())};"
        f" {rollouts['n']} rollouts a step (prompts of {rollouts['prompt'][0]}-{rollouts['prompt'][1]}"
        f" tokens, completions of {rollouts['completion'][0]}-{rollouts['completion'][1]},"
        " random routing traces);"
        f" {args.warmup} warm-up + {args.steps} timed steps per layout, at most {args.timeout:.0f} s each"
    )
    cpu, load0 = machine(), load_average()
    print(
        f"machine: {cpu}, {CPU_COUNT} CPUs, load average {load0:.2f} at the start; torch threads: 1 per"
        f" rank ([trainer] threads = 1), so 2 ranks use 2 cores and 1 rank 1 core (the '{CPU_COUNT}"
        " threads' layout excepted)",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="jetrl-bench-trainer-") as tmp:
        for lay in layouts:
            try:
                results[lay.key] = run_layout(lay, args, Path(tmp))
            except Exception as exc:  # the bench's own side failed: reported, the rest still runs
                results[lay.key] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            ref = results.get(REFERENCE.key, {})
            whole = state_of(ref["ranks"][0]) if ref.get("ok") else None
            print("\n".join(layout_lines(lay, results[lay.key], whole, args)), flush=True)
    summary = summary_lines(results)
    load1 = load_average()
    print(f"\nload average {load1:.2f} at the end (1 minute; other work on the machine shows in the times)")
    print()
    print("\n".join(summary))
    if args.json is not None:
        doc = {
            "machine": cpu,
            "cpus": CPU_COUNT,
            "load_average": [load0, load1],
            "model": {"name": "tiny-moe", "overrides": overrides},
            "rollouts": rollouts,
            "warmup": args.warmup,
            "steps": args.steps,
            "layouts": {lay.key: {"title": lay.title, **results[lay.key]} for lay in layouts},
            "summary": summary,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
