"""Event bodies the report's tests feed it: a step with its reward, a held-out evaluation."""

from __future__ import annotations

from jetrl.bus import events as ev


def evaluation(
    env: str, version: int, at_1: float, at_k: float, *, samples: int = 4
) -> ev.EvaluationReported:
    return ev.EvaluationReported(
        env=env,
        policy_version=version,
        n_tasks=32,
        samples=samples,
        pass_at_1=at_1,
        pass_at_k=at_k,
        reward_mean=at_1,
        version_min=version,
        version_max=version,
    )
