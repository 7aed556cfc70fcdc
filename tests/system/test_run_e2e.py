"""A short `jetrl run`: every part its own process, a real nats-server, SQLite, then the
invariants checked from the log and the store."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest

from jetrl.bus import events as ev
from jetrl.bus import ids
from jetrl.bus.client import Bus
from jetrl.bus.payloads import PayloadMissing, Payloads
from jetrl.bus.server import EmbeddedServer
from jetrl.consumers.monitor.reader import follow, from_store
from jetrl.consumers.monitor.service import Monitor
from jetrl.deploy.config import load_config
from jetrl.deploy.supervisor import Supervisor
from jetrl.store import queries
from jetrl.store.db import open_store
from tests.support.invariants import assert_run_invariants
from tests.support.runlog import bodies, read_log

pytestmark = pytest.mark.slow

MAX_OFF = 1
STEPS = 6


@pytest.mark.parametrize(
    "ranks",
    [1, 2],  # 2: the trainer is 2 ranks under torchrun, FSDP2 (tests/system/test_run_parallel.py)
)
async def test_short_async_run_keeps_the_invariants(
    ranks: int, nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    cfg = load_config(
        None,
        [
            *("--trainer.parallelism.dp_shard", str(ranks)),
            "--trainer.max_steps",
            str(STEPS),
            "--trainer.batch_groups",
            "2",
            "--trainer.max_off_policy_steps",
            str(MAX_OFF),
            "--trainer.checkpoint_every",
            "2",
            "--inference.workers",
            "2",
            "--inference.max_batch_tasks",
            "2",
            "--envs.0.name",
            "reverse",
            "--envs.0.group_size",
            "4",
            "--bus.max_gib",
            "0.25",
            "--bus.payload_max_gib",
            "0.5",
        ],
    )
    run_id = f"e2e{ranks}"
    sup = Supervisor(cfg, run_id, tmp_path / run_id, nats_url=nats_server.url, quiet=True)
    assert await sup.run() == 0

    log = await read_log(nats_server.url, run_id)

    assert_run_invariants(log, steps=STEPS, rollouts_per_step=2 * 4, max_off=MAX_OFF)
    steps = bodies(log, ev.StepCompleted)
    # A rollout's arrays are its generation's: referred to where they lie in the log, not copied,
    # each at its own sample's place; the group's prompt is its task's, as the generation's is.
    bus = await Bus.connect(nats_server.url)
    at = {i.seq: i.event for i in await bus.read_log(run_id) if i.event is not None}
    for b in bodies(log, ev.RolloutsScored):
        gens = {
            a.seq for r in b.rollouts for a in (r.completion_tokens, r.logprobs) if isinstance(a, ev.LogArray)
        }
        assert len(gens) == 1, "a group's arrays lie in one generation"
        gen = at[gens.pop()]
        assert gen.event_id == b.generation_event_id and isinstance(gen.body, ev.CompletionsGenerated)
        assert b.prompt_tokens == gen.body.prompt_tokens
        assert isinstance(b.prompt_tokens, ev.LogArray) and b.prompt_tokens.field == "prompt_tokens"
        assert at[b.prompt_tokens.seq].event_id == ids.task_event_id(run_id, b.task_id)
        assert len(b.rollouts) == b.group_size == 4
        for r in b.rollouts:
            for name, a in (("completion_tokens", r.completion_tokens), ("logprobs", r.logprobs)):
                assert isinstance(a, ev.LogArray)
                where, k, field = a.field.split(".")
                assert (where, field) == ("samples", name)
                assert gen.body.samples[int(k)].generation_id == r.rollout_id
    # Weights past retention are discarded: version 0 and the newest `weights_keep` remain.
    keep = cfg.trainer.weights_keep
    assert keep is not None and keep < STEPS
    payloads = await Payloads.for_run(bus.js, run_id)
    held = set()
    for w in bodies(log, ev.WeightsReady):
        with contextlib.suppress(PayloadMissing):
            await payloads.get_weights(w)
            held.add(w.version)
    assert held == {0, *range(STEPS - keep + 1, STEPS + 1)}
    await bus.close()
    at_end = [w for w in bodies(log, ev.RolloutWithheld) if w.reason == "run_finished"]
    assert json.loads((tmp_path / run_id / "summary.json").read_text())["withheld_at_end"] == len(at_end)

    # The store holds every step, and the run directory its artefacts.
    store = open_store(sup.db_url)
    try:
        history = queries.step_history(store, run_id)
        assert [h.step for h in history] == list(range(STEPS))
        assert all(h.num_rollouts == 8 for h in history)
        # The monitor shows the same series from the log as from the store.
        bus = await Bus.connect(nats_server.url)
        watched = Monitor(run_id, bus=bus)
        await follow(bus, watched.state, to_head=True)
        with store.read() as conn:
            stored = from_store(conn, run_id)
        assert [p.step for p in watched.state.steps] == list(range(STEPS))
        assert [p.as_json() for p in watched.state.steps] == [p.as_json() for p in stored.steps]
        assert watched.state.steps[-1].reward_mean == pytest.approx(history[-1].reward_mean)
        # Its inspector shows a step's rollouts token by token, with the trainer's log-probs.
        view = await watched.inspect(2)
        await bus.close()
    finally:
        store.close()
    assert view is not None and view["recorded"] and len(view["rollouts"]) == 8
    for r in view["rollouts"]:
        tokens = r["tokens"]
        assert tokens and r["completion_text"] and r["staleness"] <= MAX_OFF
        # The tiny MoE has 2 MoE layers: a token's routing can differ in 0, 1 or 2 of them.
        assert all(t["train_lp"] <= 0 and 0 <= t["route_diff"] <= 2 for t in tokens)
        assert all(t["gap"] == pytest.approx(t["train_lp"] - t["inference_lp"], abs=1e-4) for t in tokens)
    assert steps[2].metrics["mismatch_kl_max"] >= steps[2].metrics["mismatch_kl"]
    assert "monitor_exit" in (tmp_path / run_id / "logs" / "monitor.log").read_text()
    run_dir = tmp_path / run_id
    assert (run_dir / "reward.png").stat().st_size > 1000
    assert (run_dir / "summary.json").exists()
    assert list((run_dir / "trainer").glob("ckpt-v*/meta.json")), "no checkpoint written"


async def test_a_run_whose_trainer_is_hosted_beside_other_parts_ends(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """The supervisor ends a run when the trainer's process exits on its own: hosted with the
    producer and the worker ([run] host_together), that process is theirs too, and ends when
    the trainer is done."""
    args = "--trainer.max_steps 3 --trainer.batch_groups 2 --inference.workers 1 --envs.0.group_size 4 "
    args += "--store.recorder false --bus.weights_store file --bus.max_gib 0.25 --bus.payload_max_gib 0.5"
    cfg = load_config(None, [*args.split(), "--run.host_together", '["producer","inference","trainer"]'])
    run_id = "e2ehost"
    sup = Supervisor(cfg, run_id, tmp_path / run_id, nats_url=nats_server.url, quiet=True)
    assert await asyncio.wait_for(sup.run(), 180) == 0
    assert [p.name for p in sup.parts if p.ends_run] == ["host-producer-inference-trainer"]
    assert [s["step"] for s in sup.progress.steps] == [0, 1, 2]
    assert json.loads((tmp_path / run_id / "summary.json").read_text())["status"] == "completed"


async def test_multi_turn_episodes_train_as_one_masked_rollout(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    cfg = load_config(
        None,
        [
            "--trainer.max_steps",
            "3",
            "--trainer.batch_groups",
            "2",
            "--trainer.max_off_policy_steps",
            "1",
            "--inference.workers",
            "1",
            "--envs.0.name",
            "chainsum",
            "--envs.0.group_size",
            "4",
            "--store.recorder",
            "false",
            "--bus.weights_store",
            "file",
            "--bus.max_gib",
            "0.25",
            "--bus.payload_max_gib",
            "0.5",
        ],
    )
    run_id = "e2emt"
    sup = Supervisor(cfg, run_id, tmp_path / run_id, nats_url=nats_server.url, quiet=True)
    assert await sup.run() == 0
    log = await read_log(nats_server.url, run_id)
    tasks = [e.body for e in log if isinstance(e.body, ev.TaskSubmitted)]
    first, second = [t for t in tasks if t.turn == 0], [t for t in tasks if t.turn == 1]
    assert first and second and not [t for t in tasks if t.turn > 1]
    # Each second turn continues one sample of a first-turn task, with the history as its prompt.
    for t in second:
        assert t.group_size == 1 and t.prompt_text.startswith("+") and t.prompt_text.endswith("=")
        origin = next(f for f in first if f.task_id == t.episode_id)
        assert t.prompt_tokens[: len(origin.prompt_tokens)] == origin.prompt_tokens
        # The episode so far rides typed in the task: the prompt is its history, token for token.
        assert first[0].episode is None and t.episode is not None and "_episode" not in t.info
        assert t.prompt_tokens == [*t.episode.prompt, *t.episode.completion]
        assert len(t.episode.mask) == len(t.episode.completion) == len(t.episode.logprobs)
    groups = [e.body for e in log if isinstance(e.body, ev.RolloutsScored)]
    # An episode's rollout comes on its own, as it ends: one rollout an event.
    assert groups and all(len(b.rollouts) == 1 and b.group_size == 4 for b in groups)
    scored = [r for b in groups for r in b.rollouts]
    assert all(r.turns == 2 and r.completion_mask is not None for r in scored)
    group_of = {r.rollout_id: b.group_id for b in groups for r in b.rollouts}
    # The environment's reply is in the completion but masked out; logprobs are 0 there.
    from jetrl.bus.payloads import ObjectStorePayloads, Payloads

    bus = await Bus.connect(nats_server.url)
    pay = Payloads(await ObjectStorePayloads.for_run(bus.js, run_id))
    for r in scored[:8]:
        assert r.completion_mask is not None
        mask = (await pay.get_array(r.completion_mask)).tolist()
        lps = (await pay.get_array(r.logprobs)).tolist()
        tokens = (await pay.get_array(r.completion_tokens)).tolist()
        assert 0 in mask and mask[0] == 1 and mask[-1] == 1 and len(mask) == len(tokens) == len(lps)
        assert all(lp == 0.0 for lp, m in zip(lps, mask, strict=True) if m == 0)
        assert r.rollout_id == f"{group_of[r.rollout_id]}-{r.sample_index}"
    await bus.close()
    steps = [e.body for e in log if isinstance(e.body, ev.StepCompleted)]
    assert [s.step for s in steps] == [0, 1, 2]
    # Weights went through the run directory, and the workers loaded them from there.
    ready = [e.body for e in log if isinstance(e.body, ev.WeightsReady)]
    assert ready and all(r.location.store == "file" for r in ready)
    assert (tmp_path / run_id / "payloads").is_dir()
    assert [e for e in log if isinstance(e.body, ev.WeightsLoaded)]
    assert all(len(s.rollout_ids) == 8 for s in steps)
