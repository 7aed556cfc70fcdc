"""The generation-engine seam is real: another engine, named in the run config alone, serves
a whole run (every part its own process, a real nats-server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.payloads import array_from_bytes
from jetrl.bus.server import EmbeddedServer
from jetrl.deploy.config import load_config
from jetrl.deploy.supervisor import Supervisor
from jetrl.policy.tokenizer import CharTokenizer

pytestmark = pytest.mark.slow

STEPS = 3


async def test_a_run_goes_through_an_engine_named_in_the_config(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    cfg = load_config(
        None,
        [
            "--inference.engine",
            "tests.support.engines:OracleEngine",
            "--model.name",
            "tiny-dense",  # the oracle records no routing: nothing to replay
            "--trainer.max_steps",
            str(STEPS),
            "--trainer.batch_groups",
            "2",
            "--envs.0.group_size",
            "4",
            "--store.recorder",
            "false",
        ],
    )
    run_id = "seam1"
    sup = Supervisor(cfg, run_id, tmp_path / run_id, nats_url=nats_server.url, quiet=True)
    assert await sup.run() == 0

    bus = await Bus.connect(nats_server.url)
    try:
        log = [i.event for i in await bus.read_log(run_id) if i.event is not None]
    finally:
        await bus.close()
    tok = CharTokenizer()
    gens = [e.body for e in log if isinstance(e.body, ev.CompletionsGenerated)]
    tasks = {e.body.task_id: e.body for e in log if isinstance(e.body, ev.TaskSubmitted)}
    assert gens
    # Every task's whole group in one event, each sample once.
    assert all(sorted(s.sample_index for s in g.samples) == list(range(4)) for g in gens)
    for g, smp in ((gen, s) for gen in gens for s in gen.samples):
        c = smp.completion_tokens
        assert isinstance(c, ev.InlineArray)  # two tokens: carried in the event
        a, b = tok.decode(tasks[g.task_id].prompt_tokens).removesuffix("=").split("+")
        completion = array_from_bytes(c.dtype, c.shape, c.data).tolist()
        assert completion == tok.encode(str((int(a) + int(b)) % 5), bos=False, eos=True)
    steps = [e.body for e in log if isinstance(e.body, ev.StepCompleted)]
    assert [s.step for s in steps] == list(range(STEPS))
    assert all(s.metrics["reward_mean"] == 1.0 for s in steps)
    # The worker announced each version the engine took, as with the embedded engine.
    loaded = {e.body.version for e in log if isinstance(e.body, ev.WeightsLoaded)}
    assert 0 in loaded and loaded <= set(range(STEPS + 1))
