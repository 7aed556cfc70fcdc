"""A policy for the gateway to serve: a real inference worker (the embedded engine, tiny MoE) in
this process, on a fresh run of the session's nats-server, with version 0 of the weights
published as the trainer publishes them. No trainer runs, so the policy stays at version 0 and
greedy answers are the same for every request: what the gateway's tests compare against."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.payloads import Payloads
from jetrl.consumers.inference.settings import InferencePart
from jetrl.consumers.inference.worker import InferenceWorker
from jetrl.policy.models import build_model
from jetrl.policy.origin import model_config_of
from jetrl.policy.weights import weights_to_bytes
from jetrl.producers.gateway import key_hash
from tests.conftest import TEST_LIMITS


@dataclass
class Served:
    bus: Bus
    run_id: str
    worker: InferenceWorker | None


async def publish_initial_weights(bus: Bus, run_id: str, part: InferencePart) -> None:
    model = build_model(model_config_of(part.model), seed=part.seed)
    data, digest = weights_to_bytes(model, {"version": "0", "run": run_id})
    payloads = await Payloads.for_run(bus.js, run_id)
    ref = await payloads.default.put("weights-v0", data)
    ready = ev.WeightsReady(version=0, location=ref, weights_checksum=digest)
    await bus.publish(ev.new_event(ready, run_id=run_id))


@contextlib.asynccontextmanager
async def served_policy(
    nats_url: str, part: InferencePart | None = None, *, worker: bool = True
) -> AsyncIterator[Served]:
    """A run with one real worker serving it (``worker=False``: a run nobody answers)."""
    part = part or InferencePart()
    bus = await Bus.connect(nats_url, name="gateway-test")
    run_id = f"g{uuid.uuid4().hex[:12]}"
    await bus.ensure_run(run_id, TEST_LIMITS)
    stop = asyncio.Event()
    w, task = None, None
    if worker:
        await publish_initial_weights(bus, run_id, part)
        w = InferenceWorker(bus, run_id, "inf-0", part)
        task = asyncio.create_task(w.run(stop))
    try:
        yield Served(bus, run_id, w)
    finally:
        stop.set()
        if task is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(task, 30)
        await bus.close()


def write_keys(path: Path, grants: dict[str, dict[str, object]]) -> None:
    """A keys file as the commands write it (hashes only, 0600): key -> grant."""
    path.write_text(json.dumps({"keys": {key_hash(k): g for k, g in grants.items()}}))
    path.chmod(0o600)
