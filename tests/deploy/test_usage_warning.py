"""The supervisor warns once when the run's log passes 80% of its limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.streams import StreamLimits, run_usage
from jetrl.deploy.config import load_config
from jetrl.deploy.supervisor import Supervisor


async def test_a_nearly_full_log_is_warned_about_once(
    nats_server: EmbeddedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = "nearlyfull"
    bus = await Bus.connect(nats_server.url)
    await bus.ensure_run(run_id, StreamLimits(max_bytes=1024 * 1024, payload_max_bytes=8 * 1024 * 1024))
    sup = Supervisor(load_config(None), run_id, tmp_path / run_id, nats_url=nats_server.url)
    body = ev.TaskSubmitted(task_id="e.default.0", env="e", group_size=2, prompt_tokens=list(range(2000)))
    for _ in range(60):  # ~6 KB each: well under 80% of 1 MiB
        await bus.publish(ev.new_event(body, run_id=run_id))
    await sup.check_usage(bus)
    assert "full" not in capsys.readouterr().out
    while (await run_usage(bus.js, run_id))[0].fraction < 0.85:
        await bus.publish(ev.new_event(body, run_id=run_id))
    await sup.check_usage(bus)
    await sup.check_usage(bus)
    out = capsys.readouterr().out
    assert out.count("% full") == 1 and "JETRL_nearlyfull" in out and "max_gib" in out
    await bus.close()
