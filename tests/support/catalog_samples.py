"""One realistic instance of every event body, shared by the catalog and bus tests."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jetrl.bus import events as ev
from jetrl.bus.payloads import inline_array as inline
from jetrl.bus.payloads import log_array, token_list_ref


def forged_generation(
    task_id: str,
    env: str,
    tokens: np.ndarray,
    *,
    indexes: Sequence[int] = (0,),
    worker_id: str = "inf-0",
) -> ev.CompletionsGenerated:
    """A well-formed answer to ``task_id`` that no worker generated: samples ``indexes``, each
    with ``tokens`` as completion (and as the prompt) and zero logprobs, for tests that publish
    what a misbehaving client would."""
    ref = inline(np.asarray(tokens, np.int32))
    return ev.CompletionsGenerated(
        task_id=task_id,
        env=env,
        prompt_tokens=ref,
        samples=[
            ev.Completion(
                generation_id=f"{task_id}-{i}",
                sample_index=i,
                completion_tokens=ref,
                logprobs=inline(np.zeros(len(tokens), np.float32)),
            )
            for i in indexes
        ],
        policy_version_start=0,
        policy_version_end=0,
        worker_id=worker_id,
    )


def sample_bodies() -> list[ev.EventBody]:
    rng = np.random.default_rng(0)
    completion = inline(rng.integers(0, 64, 20, dtype=np.int32))
    logprobs = inline(-rng.random(20, dtype=np.float32))
    trace_ref = ev.PayloadRef(
        store="objstore",
        bucket="jetrl_r_payloads",
        name="trace-g1-0",
        size=23 * 4 * 2,  # 4 prompt + 20 completion tokens, all but the last fed forward
        sha256="ab" * 32,
        dtype="uint8",
        shape=(23, 4, 2),
    )
    return [
        ev.RunStarted(
            config={"trainer": {"lr": 1e-3}, "seed": 7},
            code_version="0.1.0",
            host="h",
            library_versions={"torch": "2.13.0"},
        ),
        ev.RunResumed(
            config={"trainer": {"lr": 1e-3, "max_steps": 80}, "seed": 7},
            code_version="0.1.0",
            host="h2",
            overrides=["--trainer.max_steps", "80"],
        ),
        ev.RunFinished(status="completed", steps=40, reason=""),
        ev.TaskSubmitted(
            task_id="reverse.acme.1",
            env="reverse",
            group_size=8,
            prompt_tokens=[1, 5, 6, 7],
            prompt_text="abc",
            max_tokens=16,
            info={"answer": "cba"},
        ),
        ev.CompletionsGenerated(
            task_id="reverse.acme.1",
            env="reverse",
            # The task's prompt where it lies: its TaskSubmitted (a list of token ids).
            prompt_tokens=token_list_ref(11, "prompt_tokens", [1, 5, 6, 7]),
            samples=[
                ev.Completion(
                    generation_id="reverse.acme.1-0",
                    sample_index=0,
                    completion_tokens=completion,
                    logprobs=logprobs,
                    routing_trace=trace_ref,
                ),
                ev.Completion(
                    generation_id="reverse.acme.1-1",
                    sample_index=1,
                    completion_tokens=completion,
                    logprobs=logprobs,
                    finish_reason="length",
                ),
            ],
            policy_version_start=3,
            policy_version_end=4,
            worker_id="inf-0",
            timings=ev.GenerationTimings(queued_s=0.1, generate_s=0.5),
        ),
        ev.RolloutsScored(
            generation_event_id="e1",
            task_id="reverse.acme.1",
            env="reverse",
            group_id="reverse.acme.1",
            group_size=8,
            prompt_tokens=token_list_ref(11, "prompt_tokens", [1, 5, 6, 7]),
            rollouts=[
                ev.ScoredRollout(
                    rollout_id=f"reverse.acme.1-{i}",
                    sample_index=i,
                    reward=0.75 - i / 4,
                    reward_parts={"exact": 0.5, "format": 0.25 - i / 4},
                    # The generation's arrays where they lie in the log (sequence 12).
                    completion_tokens=log_array(12, f"samples.{i}.completion_tokens", completion),
                    logprobs=log_array(12, f"samples.{i}.logprobs", logprobs),
                    routing_trace=trace_ref if i == 0 else None,
                    policy_version_start=3,
                    policy_version_end=4,
                )
                for i in range(2)
            ],
        ),
        ev.RolloutWithheld(
            rollout_id="reverse.acme.1-0",
            group_id="reverse.acme.1",
            env="reverse",
            reason="stale",
            trainer_step=9,
            policy_version=9,
            staleness=6,
            detail="6 > max_off_policy_steps=2",
        ),
        ev.StepCompleted(
            step=9,
            policy_version=10,
            rollout_ids=["g1-0", "g1-1"],
            rollout_seqs=[41, 42],
            metrics={"loss": 0.1, "reward_mean": 0.5},
            tokens=640,
            duration_s=0.2,
        ),
        ev.PolicyVersionPublished(version=10, step=9, weights_checksum="cd" * 32, parent_version=9),
        ev.WeightsReady(version=10, location=trace_ref, weights_checksum="cd" * 32, blake3="ef" * 32),
        ev.WeightsLoaded(version=10, worker_id="inf-0", load_s=0.05),
        ev.WorkerHeartbeat(
            worker_id="inf-0",
            kind="inference",
            status="busy",
            loaded_version=10,
            inflight=3,
            stats={"tokens_per_s": 1234.0},
        ),
        ev.DeadLettered(
            reason="malformed",
            detail="not msgpack",
            consumer="trainer",
            original_subject="jetrl.r.rollout.default.reverse",
            original_stream_seq=17,
            original_data=b"\xff\x00garbage",
            original_headers={"Nats-Msg-Id": "x"},
        ),
        ev.EvaluationReported(
            env="reverse",
            policy_version=10,
            n_tasks=3,
            samples=4,
            pass_at_1=0.5,
            pass_at_k=2 / 3,
            reward_mean=0.625,
            version_min=10,
            version_max=11,
            temperature=0.7,
            successes=[4, 2, 0],
        ),
        ev.AlertRaised(
            rule="staleness",
            key="staleness",
            state="firing",
            severity="warning",
            message="mean staleness 3.5 above 2.0",
            step=12,
            value=3.5,
            threshold=2.0,
        ),
    ]
