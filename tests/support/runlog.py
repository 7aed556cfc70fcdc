"""Reading a finished run's whole log in tests."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from jetrl.bus import events as ev
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
