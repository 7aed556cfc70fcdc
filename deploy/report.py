"""A run's steps for people: the progress line, the end-of-run summary and the reward curve.

A `RunReport` is fed StepCompleted bodies, each with its time in seconds since the run started,
and EvaluationReported bodies (held-out pass@1/pass@k), and knows nothing of processes or buses:
the supervisor feeds it from its live tails of the step and eval subjects, and a finished run's
log can feed it the same way (times from the events' `time`).
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

from jetrl.bus import events as ev
from jetrl.store.readmodel import summarize

# The trainer writes its own aggregates of the reward as `reward_mean` and `reward_max`, and the
# mean of each environment reward part `<part>` as `reward_<part>`. StepCompleted carries no list
# of parts, so the prefix is what marks one; the two aggregates are the only other keys with it (a
# part named `mean` or `max` cannot exist: its key would clash with them in the trainer).
PART_PREFIX = "reward_"
TRAINER_REWARD_KEYS = frozenset({"reward_mean", "reward_max"})
WINDOW = 10  # steps averaged in the progress line and the summary's `*_last10`


def _mean(steps: list[dict[str, float]], key: str) -> float:
    return sum(s.get(key, 0.0) for s in steps) / len(steps)


def _scope(tenant: str, env: str) -> str:
    return env if tenant == "default" else f"{tenant}/{env}"


class RunReport:
    def __init__(self) -> None:
        # One dict per step: its metrics plus `step`, `tokens` and `t` (seconds since the start).
        self.steps: list[dict[str, float]] = []
        # Part -> whether it differed from the step's mean reward at some step, in first-seen order.
        self._differs: dict[str, bool] = {}
        # (tenant, env) -> its evaluations by version.
        self._evaluations: dict[tuple[str, str], dict[int, ev.EvaluationReported]] = {}

    def add_evaluation(self, body: ev.EvaluationReported, tenant: str = "default") -> None:
        by_version = self._evaluations.setdefault((tenant, body.env), {})
        by_version.setdefault(body.policy_version, body)  # first fact wins

    @property
    def evaluations(self) -> dict[str, dict[int, ev.EvaluationReported]]:
        """By "<env>" (or "<tenant>/<env>" off the default tenant), each env's evaluations by version."""
        return {_scope(tenant, env): by_version for (tenant, env), by_version in self._evaluations.items()}

    def evaluation_line(self, body: ev.EvaluationReported) -> str:
        return (
            f"eval {body.env} v{body.policy_version} | pass@1 {body.pass_at_1:.3f} | "
            f"pass@{body.samples} {body.pass_at_k:.3f} | reward {body.reward_mean:.3f} | {body.n_tasks} tasks"
        )

    def evaluation_summary(self) -> dict[str, dict[str, Any]]:
        """Per env: the latest evaluation's pass@1 and pass@k, and the best of each with its
        version (the earliest on a tie): the store's summary (store/readmodel), rounded."""
        out: dict[str, dict[str, Any]] = {}
        for (tenant, env), by_version in self._evaluations.items():
            s = summarize(tenant, env, [by_version[v] for v in sorted(by_version)])
            out[_scope(tenant, env)] = {
                "evaluations": s.evaluations,
                "k": s.samples,
                "latest_version": s.latest_version,
                "pass_at_1": round(s.latest_pass_at_1, 4),
                "pass_at_k": round(s.latest_pass_at_k, 4),
                "best_pass_at_1": round(s.best_pass_at_1, 4),
                "best_pass_at_1_version": s.best_pass_at_1_version,
                "best_pass_at_k": round(s.best_pass_at_k, 4),
                "best_pass_at_k_version": s.best_pass_at_k_version,
            }
        return out

    def add(self, step: ev.StepCompleted, t: float) -> None:
        # streamed: 1.0 for a step the trainer took as its groups came (``stream_groups``).
        streamed = 1.0 if step.micro_batches else 0.0
        self.steps.append(dict(step.metrics, step=step.step, tokens=step.tokens, t=t, streamed=streamed))
        reward = step.metrics.get("reward_mean", 0.0)
        for key, value in step.metrics.items():
            if key.startswith(PART_PREFIX) and key not in TRAINER_REWARD_KEYS:
                part = key.removeprefix(PART_PREFIX)
                differs = not math.isclose(value, reward, rel_tol=1e-9, abs_tol=1e-12)
                self._differs[part] = self._differs.get(part, False) or differs

    @property
    def parts(self) -> list[str]:
        """The reward parts worth showing beside the reward. A part equal to the mean reward at
        every step is the reward itself (the demo's `positions`), so it would only repeat it."""
        return [part for part, differs in self._differs.items() if differs]

    def line(self) -> str:
        if not self.steps:
            return "no steps yet"
        m = self.steps[-1]
        recent = self.steps[-WINDOW:]
        parts = ", ".join(f"{p} {_mean(recent, PART_PREFIX + p):.2f}" for p in self.parts)
        span = recent[-1]["t"] - recent[0]["t"] if len(recent) > 1 else 0.0
        rate = (len(recent) - 1) / span * 60 if span > 0 else 0.0
        toks = sum(s["tokens"] for s in recent[1:]) / span if span > 0 else 0.0
        return (
            f"step {int(m['step']):>4} | reward {_mean(recent, 'reward_mean'):.3f}"
            f"{f' ({parts})' if parts else ''} | staleness {m.get('staleness_mean', 0):.2f} | "
            f"{rate:5.1f} steps/min | {toks:6.0f} tok/s | trainer idle "
            f"{100 * m.get('trainer_idle_frac', 0):.0f}% | withheld {int(m.get('withheld_total', 0))} | "
            f"{m['t']:.0f}s"
        )

    def summary(self) -> dict[str, Any]:
        steps = self.steps
        out: dict[str, Any] = {"steps": len(steps)}
        if self.evaluations:
            out["evaluations"] = self.evaluation_summary()
        if not steps:
            return out
        last = steps[-WINDOW:]
        out["reward_first"] = round(steps[0].get("reward_mean", 0.0), 4)
        out[f"reward_last{WINDOW}"] = round(_mean(last, "reward_mean"), 4)
        for p in self.parts:
            # A part named `reward` keeps its prefix rather than overwrite the mean reward's key.
            name = p if p != "reward" else PART_PREFIX + p
            out[f"{name}_last{WINDOW}"] = round(_mean(last, PART_PREFIX + p), 4)
        wall = steps[-1]["t"]
        out.update(
            wall_s=round(wall, 1),
            steps_per_min=round(len(steps) / wall * 60, 1) if wall > 0 else 0.0,
            staleness_mean=round(_mean(steps, "staleness_mean"), 3),
            trainer_idle_frac=round(steps[-1].get("trainer_idle_frac", 0.0), 3),
            withheld=int(steps[-1].get("withheld_total", 0)),
            streamed_steps=int(sum(s["streamed"] for s in steps)),
        )
        return out

    def plot(self, path: Path, title: str) -> Path:
        """The reward curve (:meth:`figure`) as a PNG at `path`."""
        fig = self.figure(title)
        fig.savefig(path)
        _pyplot().close(fig)
        return path

    @staticmethod
    def warm_up_plot() -> None:
        """Import matplotlib's pyplot in the background now, for :meth:`plot` at the run's end:
        its import is most of a plot's time (0.7 s of a run's end on a 2-core VM)."""
        threading.Thread(target=_pyplot, name="plot-warm-up", daemon=True).start()

    def figure(self, title: str) -> Any:
        """The reward per step, its running mean, the shown parts and each env's held-out pass@1
        and pass@k by policy version (version v is the policy after v steps), as a matplotlib
        figure."""
        plt = _pyplot()
        steps = self.steps
        x = [s["step"] for s in steps]
        rewards = [s.get("reward_mean", 0.0) for s in steps]
        smooth = [
            sum(rewards[max(0, i - WINDOW + 1) : i + 1]) / min(WINDOW, i + 1) for i in range(len(rewards))
        ]
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
        ax.plot(x, rewards, lw=0.8, alpha=0.5, label="mean reward (step)")
        ax.plot(x, smooth, lw=2, label=f"mean reward ({WINDOW}-step average)")
        shown = [*rewards]
        for p in self.parts:
            values = [s.get(PART_PREFIX + p, 0.0) for s in steps]
            shown += values
            ax.plot(x, values, lw=0.8, alpha=0.6, label=f"reward part {p!r} (step)")
        for scope, by_version in self.evaluations.items():
            versions = sorted(by_version)
            rows = [by_version[v] for v in versions]
            at_1 = [r.pass_at_1 for r in rows]
            at_k = [r.pass_at_k for r in rows]
            shown += at_1 + at_k
            ax.plot(versions, at_1, "o-", lw=1.5, label=f"held-out pass@1 ({scope})")
            ax.plot(
                versions, at_k, "s--", lw=1, alpha=0.7, label=f"held-out pass@{rows[-1].samples} ({scope})"
            )
        if all(0.0 <= v <= 1.0 for v in shown):  # a part need not be a share (a count, a length)
            ax.set_ylim(0, 1.02)
        ax.set_xlabel("trainer step (policy version for evaluations)")
        ax.set_ylabel("reward")
        ax.grid(alpha=0.3)
        ax.legend(loc="best")  # a short run's curve lies along the bottom
        ax.set_title(f"jetrl run {title}")
        fig.tight_layout()
        return fig


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files, no display), chosen before it is imported."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
