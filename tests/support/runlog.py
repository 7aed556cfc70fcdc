"""Reading a run's log in tests, and the trainer's side of a version where no trainer runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import TypeVar

from jetrl.bus import events as ev
from jetrl.bus import ids
from jetrl.bus.client import Bus

B = TypeVar("B", bound=ev.EventBody)


async def read_log(url: str, run_id: str) -> list[ev.Event]:
    bus = await Bus.connect(url)
    try:
        items = await bus.read_log(run_id)
    finally:
        await bus.close()
    for item in items:
        assert item.event is not None, f"undecodable event at seq {item.seq}: {item.error}"
    return [item.event for item in items if item.event is not None]


def bodies(log: Iterable[ev.Event], cls: type[B]) -> list[B]:
    """The bodies of one type in a log, in log order."""
    return [e.body for e in log if isinstance(e.body, cls)]


def samples(log: Iterable[ev.Event]) -> list[tuple[ev.CompletionsGenerated, ev.Completion]]:
    """Every generated sample in a log, with the CompletionsGenerated it came in, in log order."""
    return [(g, s) for g in bodies(log, ev.CompletionsGenerated) for s in g.samples]


def scored_rollouts(log: Iterable[ev.Event]) -> list[tuple[ev.RolloutsScored, ev.ScoredRollout]]:
    """Every scored rollout in a log, with the RolloutsScored it came in, in log order."""
    return [(b, r) for b in bodies(log, ev.RolloutsScored) for r in b.rollouts]


async def publish_version(bus: Bus, run_id: str, version: int) -> None:
    """The trainer's side of a version, without a trainer: its step and its weights."""
    if version > 0:
        step = ev.StepCompleted(step=version - 1, policy_version=version, rollout_ids=[])
        await bus.publish(ev.new_event(step, run_id=run_id, event_id=ids.step_event_id(run_id, version - 1)))
    loc = ev.PayloadRef(store="objstore", bucket="none", name=f"w{version}", size=0, sha256="0" * 64)
    ready = ev.WeightsReady(version=version, location=loc, weights_checksum=f"c{version}")
    await bus.publish(ev.new_event(ready, run_id=run_id, event_id=ids.weights_event_id(run_id, version)))


async def wait_for(
    bus: Bus, run_id: str, subject: str, done: Callable[[list[ev.Event]], bool], timeout: float = 60.0
) -> list[ev.Event]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        log = [i.event for i in await bus.read_log(run_id, filter_subject=subject) if i.event is not None]
        if done(log):
            return log
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting on {subject}"
        await asyncio.sleep(0.2)
