"""The trainer's buffer of scored rollouts by group: members held until their group is whole,
groups condemned by a dead-lettered member, and the arrays read for a batch (vetted) until the
batch is trained or the group settled. No bus I/O here: the trainer acks, withholds and
dead-letters; the buffer keeps account of what it holds.

A delivery (one RolloutsScored) brings one or more rollouts of one group: a single-turn task's
whole group at once, a multi-turn episode's rollout on its own. A group is whole when it holds
``group_size`` rollouts, whatever the deliveries that brought them."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from jetrl.bus import events as ev
from jetrl.consumers.trainer.core import RolloutArrays, ScoredView
from jetrl.consumers.trainer.withholding import ScoredDelivery


@dataclass(frozen=True, slots=True)
class Member:
    """One rollout held, and the delivery that brought it."""

    delivery: ScoredDelivery
    rollout: ev.ScoredRollout

    @property
    def rollout_id(self) -> str:
        return self.rollout.rollout_id

    @property
    def seq(self) -> int:
        return self.delivery.seq

    def view(self, prompt_owner: str) -> ScoredView:
        return ScoredView(self.delivery.body, self.rollout, prompt_owner)


@dataclass
class Group:
    group_id: str
    members: list[Member] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.members[0].delivery.body.group_size

    @property
    def first_seq(self) -> int:
        return min(m.seq for m in self.members)

    @property
    def route(self) -> tuple[str, str]:
        """(tenant, env): the environment whose batch share it fills."""
        d = self.members[0].delivery
        return d.event.tenant, d.body.env

    @property
    def deliveries(self) -> list[ScoredDelivery]:
        """The deliveries that brought its members, each once."""
        seen: dict[int, ScoredDelivery] = {}
        for m in self.members:
            seen.setdefault(id(m.delivery), m.delivery)
        return list(seen.values())

    def oldest_version(self) -> int:
        return min(m.rollout.policy_version_start for m in self.members)

    def rewards(self) -> list[float]:
        return [m.rollout.reward for m in self.members]


@dataclass
class StepUnderWay:
    """A streaming step's groups so far (``[trainer] stream_groups``): taken out of the buffer,
    their forward and backward done, their deliveries unacked until the step is logged."""

    groups: list[Group] = field(default_factory=list)
    micro_batches: list[int] = field(default_factory=list)  # rollouts in each, in order
    tokens: int = 0  # completion tokens
    wait_s: float = 0.0  # waiting for fresh groups before each
    read_s: float = 0.0  # reading and checking their arrays
    busy_s: float = 0.0  # their inputs built, forward and backward

    def add(self, groups: list[Group], tokens: int, wait_s: float, read_s: float, busy_s: float) -> None:
        self.groups += groups
        self.micro_batches.append(sum(len(g.members) for g in groups))
        self.tokens += tokens
        self.wait_s += wait_s
        self.read_s += read_s
        self.busy_s += busy_s

    def holds(self, rollouts: list[ev.ScoredRollout]) -> bool:
        """Whether every one of ``rollouts`` is in the step already (a redelivery)."""
        if not self.groups or not rollouts:
            return False
        held = {m.rollout_id for g in self.groups for m in g.members}
        return all(r.rollout_id in held for r in rollouts)

    def deliveries(self) -> Iterator[ScoredDelivery]:
        for g in self.groups:
            yield from g.deliveries


class StreamChoice:
    """Whether a trainer with ``stream_groups = "auto"`` streams its next step: while, over its
    last ``window`` steps, a step's batch was still not whole ``threshold`` or more of the way
    into the step's cycle (from the trainer being free for it to its step logged). That part of
    the cycle is where streaming computes instead of waiting (environments slower than the
    trainer); a batch whole at once, or nearly (the trainer sets the pace), gains nothing from
    it and pays a micro-batch's fixed cost a split (docs/running.md, "Streaming groups")."""

    def __init__(self, window: int = 8, threshold: float = 0.1) -> None:
        self.threshold = threshold
        self.shares: deque[float] = deque(maxlen=window)

    def note(self, incomplete_s: float, cycle_s: float) -> None:
        """A step: its batch last seen incomplete ``incomplete_s`` into a cycle of ``cycle_s``."""
        if cycle_s > 0:
            self.shares.append(min(max(incomplete_s / cycle_s, 0.0), 1.0))

    def streams(self) -> bool:
        return bool(self.shares) and sum(self.shares) / len(self.shares) >= self.threshold


class GroupBuffer:
    def __init__(self, shares: Mapping[tuple[str, str], float]) -> None:
        self.shares = dict(shares)  # (tenant, env) -> its share of a batch
        self.groups: dict[str, Group] = {}
        # Groups with a dead-lettered member: the rest are withheld (incomplete_group).
        self.rejected: set[str] = set()
        # Arrays of groups read and checked for a batch, until they are trained or settled.
        self.vetted: dict[str, dict[str, RolloutArrays]] = {}

    def get(self, group_id: str) -> Group | None:
        return self.groups.get(group_id)

    def add(self, d: ScoredDelivery) -> bool:
        """Hold ``d``'s rollouts in their group; False when every one of them is held already
        (a redelivery)."""
        g = self.groups.setdefault(d.body.group_id, Group(d.body.group_id))
        held = {m.rollout_id for m in g.members}
        new = [Member(d, r) for r in d.body.rollouts if r.rollout_id not in held]
        g.members.extend(new)
        return bool(new)

    def drop(self, group_id: str) -> Group | None:
        """Stop holding the group (trained, withheld or condemned), and its read arrays."""
        self.vetted.pop(group_id, None)
        return self.groups.pop(group_id, None)

    def take(self, groups: list[Group]) -> None:
        """The groups go into a step: no longer held; their vetted arrays stay for
        :meth:`arrays_of`."""
        for g in groups:
            del self.groups[g.group_id]

    def arrays_of(self, groups: list[Group]) -> dict[str, RolloutArrays]:
        """The vetted arrays of ``groups`` by rollout id, handed over once."""
        return {rid: a for g in groups for rid, a in self.vetted.pop(g.group_id, {}).items()}

    def condemn(self, group_id: str) -> list[Member]:
        """The group has a dead-lettered member: its members held, which are no longer held, and
        those still to come are refused (:attr:`rejected`)."""
        self.rejected.add(group_id)
        g = self.drop(group_id)
        return g.members if g else []

    def ready(self) -> list[Group]:
        """Whole groups, oldest first."""
        return sorted(
            (g for g in self.groups.values() if len(g.members) >= g.size), key=lambda g: g.first_seq
        )

    def held(self) -> Iterator[ScoredDelivery]:
        """Every delivery held, each once."""
        for g in self.groups.values():
            yield from g.deliveries

    def route_metrics(self, groups: list[Group]) -> dict[str, float]:
        """Groups of each environment in a step, when the run has several."""
        if len(self.shares) < 2:
            return {}
        out = {f"groups.{t}.{e}": 0.0 for t, e in self.shares}
        for g in groups:
            t, e = g.route
            out[f"groups.{t}.{e}"] = out.get(f"groups.{t}.{e}", 0.0) + 1.0
        return out


def share_without_signal(rewards_by_group: list[list[float]]) -> float:
    """The share of groups whose rewards are all equal: their group-relative advantages are all
    zero, so they teach the step nothing (a policy whose samples have collapsed onto one answer,
    or a task too easy or too hard for it)."""
    if not rewards_by_group:
        return 0.0
    flat = sum(1 for rs in rewards_by_group if max(rs) - min(rs) == 0.0)
    return flat / len(rewards_by_group)
