"""The deterministic core of the trainer, shared by the live trainer and by replay.

It turns logged rollouts into training inputs (payloads read, group advantages) and keeps the
checkpoint files; the computation is its train engine's (consumers/trainer/engine.py). Given
the same starting weights and optimizer state, the same rollouts in the same order and the same
settings (and torch thread count), :meth:`TrainCore.train` produces bit-identical weights on
CPU. That is what lets a restarted trainer re-take logged steps, and `jetrl replay --verify`
check every recorded checksum.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from jetrl.bus import events as ev
from jetrl.bus.payloads import Payloads
from jetrl.consumers.trainer.engine import StreamingEngine, TrainEngine, make_train_engine
from jetrl.consumers.trainer.settings import TrainerPart
from jetrl.policy.columns import RolloutColumns
from jetrl.policy.loss import group_advantages
from jetrl.policy.train import Rollout

CHECKPOINT_FORMAT = 2  # 2: a directory (engine files + meta.json); 1 was one torch file
META_FILE = "meta.json"


class RolloutArrays(NamedTuple):
    """A rollout's arrays as read from the log or the payload store (a named tuple: a step
    makes 256 of them, and a frozen dataclass's __init__ costs four times as much)."""

    prompt: np.ndarray
    completion: np.ndarray
    logprobs: np.ndarray
    mask: np.ndarray | None = None
    trace: np.ndarray | None = None  # None also when traces are not replayed


@dataclass(frozen=True, slots=True)
class ScoredView:
    """One scored rollout as the trainer reads it: the rollout, the group's event it came in,
    and the event id its prompt must lie in when it is referred to in the log (its first
    task's: :func:`~jetrl.bus.ids.task_event_id`)."""

    body: ev.RolloutsScored
    rollout: ev.ScoredRollout
    prompt_owner: str

    @property
    def rollout_id(self) -> str:
        return self.rollout.rollout_id

    @property
    def group_id(self) -> str:
        return self.body.group_id

    @property
    def reward(self) -> float:
        return self.rollout.reward


@dataclass(frozen=True)
class Checkpoint:
    version: int
    weights_checksum: str
    log_seq: int  # stream sequence of the StepCompleted (or WeightsReady) that made `version`
    path: Path


class TrainCore:
    def __init__(self, part: TrainerPart) -> None:
        self.part = part
        self.s = part.trainer
        self.engine: TrainEngine = make_train_engine(part)
        if self.s.stream_groups is True:
            self.streaming()  # refused now, not at the first group

    # ------------------------------------------------------------------ one step

    async def read_arrays(self, v: ScoredView, payloads: Payloads) -> RolloutArrays:
        """One rollout's arrays as the step uses them (a trace only when it is replayed)."""
        (got,) = await self.read_many([v], payloads)
        return got

    async def read_many(self, views: Sequence[ScoredView], payloads: Payloads) -> list[RolloutArrays]:
        """The arrays of several rollouts (a group's, a step's): each rollout's own, and the
        prompt its group's members share once. Arrays in the log must lie in the rollout's own
        generation (its prompt in its own task): a tenant's rollout may not train on another's
        tokens by pointing at them."""
        refs: list[tuple[ev.ArrayRef, str]] = []
        prompts: dict[tuple[ev.ArrayRef, str], int] = {}
        slots: list[tuple[int, int, int | None, int | None]] = []
        replay = self.s.replay
        for v in views:
            own, r = v.body.generation_event_id, v.rollout
            key = (v.body.prompt_tokens, v.prompt_owner)
            p = prompts.get(key)
            if p is None:
                p = prompts[key] = len(refs)
                refs.append(key)
            c = len(refs)
            refs += ((r.completion_tokens, own), (r.logprobs, own))
            m = t = None
            if r.completion_mask is not None:
                m = len(refs)
                refs.append((r.completion_mask, own))
            if replay and r.routing_trace is not None:
                t = len(refs)
                refs.append((r.routing_trace, own))
            slots.append((p, c, m, t))
        got = await payloads.get_arrays(refs)
        return [
            RolloutArrays(
                got[p], got[c], got[c + 1], None if m is None else got[m], None if t is None else got[t]
            )
            for p, c, m, t in slots
        ]

    async def rollouts(
        self,
        views: Sequence[ScoredView],
        payloads: Payloads,
        read: Mapping[str, RolloutArrays] | None = None,
    ) -> Sequence[Rollout]:
        """Training inputs in the given order; advantages are relative to each group, groups
        being the runs of equal ``group_id`` (they may differ in size). ``read``: arrays already
        read (and checked) by rollout id; the others are read here. As joined columns
        (policy/columns.py) where every rollout's arrays fit their lengths; else one by one, so
        that the engine's checks name the rollout that does not."""
        read = read or {}
        ids: dict[str, int] = {}
        group_idx = torch.tensor([ids.setdefault(v.group_id, len(ids)) for v in views])
        rewards = torch.tensor([v.reward for v in views], dtype=torch.float32)
        adv = group_advantages(rewards, group_idx, std_scale=self.s.std_scale_advantages).tolist()
        unread = [v for v in views if v.rollout_id not in read]
        if unread:
            fresh = await self.read_many(unread, payloads)
            read = {**read, **dict(zip([v.rollout_id for v in unread], fresh, strict=True))}
        got = [read[v.rollout_id] for v in views]
        cols = RolloutColumns.joined(
            [a.prompt for a in got],
            [a.completion for a in got],
            [a.logprobs for a in got],
            [a.mask for a in got],
            [a.trace for a in got],
            adv,
        )
        if cols is not None:
            return cols
        logprobs = _tensors([a.logprobs for a in got])
        traced = iter(_tensors([a.trace for a in got if a.trace is not None], np.int64))
        traces = [None if a.trace is None else next(traced) for a in got]
        return [
            Rollout(
                prompt_ids=a.prompt,
                completion_ids=a.completion,
                inference_logprobs=logprobs[i],
                advantage=adv[i],
                routing=traces[i],
                completion_mask=None if a.mask is None else a.mask.astype(bool),
            )
            for i, a in enumerate(got)
        ]

    def train(self, rollouts: Sequence[Rollout], micro_batches: Sequence[int] = ()) -> dict[str, float]:
        """One step on ``rollouts``: at once, or as a streaming step took them (``micro_batches``:
        each one's count, in order; StepCompleted records them)."""
        if len(micro_batches) <= 1:
            return self.engine.step(rollouts)
        if sum(micro_batches) != len(rollouts) or min(micro_batches) < 1:
            raise ValueError(
                f"micro-batches {list(micro_batches)} do not split the step's {len(rollouts)} rollouts"
            )
        start = 0
        for n in micro_batches[:-1]:
            self.accumulate(rollouts[start : start + n])
            start += n
        return self.finish_step(rollouts[start:])

    def accumulate(self, rollouts: Sequence[Rollout]) -> None:
        """Forward and backward of one micro-batch of the step under way (``stream_groups``)."""
        self.streaming().accumulate(rollouts)

    def finish_step(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        """The streaming step's last micro-batch, then its optimizer step."""
        engine = self.streaming()
        engine.accumulate(rollouts)
        return engine.finish_step()

    @property
    def can_stream(self) -> bool:
        return isinstance(self.engine, StreamingEngine)

    def streaming(self) -> StreamingEngine:
        if not isinstance(self.engine, StreamingEngine):
            raise ValueError(
                f"the {self.s.engine_name!r} train engine cannot take a step's groups as they come "
                "([trainer] stream_groups, or a logged step's micro_batches): the local engine can"
            )
        return self.engine

    def checksum(self) -> str:
        return self.engine.checksum()

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: Path, version: int, log_seq: int, keep: int = 3) -> Checkpoint:
        """Weights and optimizer state at ``version``: a directory the engine fills (one file,
        or every rank's shards), then ``meta.json``, each fsynced, then renamed into place: a
        crash mid-write leaves only a temp directory, which is never resumed from."""
        directory.mkdir(parents=True, exist_ok=True)
        digest = self.checksum()
        path = checkpoint_path(directory, version)
        tmp = directory / f".{path.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        self.engine.save_state(tmp)
        meta = {
            "format": CHECKPOINT_FORMAT,
            "version": version,
            "weights_checksum": digest,
            "log_seq": log_seq,
            "layout": self.engine.layout(),
        }
        _write_synced(tmp / META_FILE, json.dumps(meta, indent=2).encode())
        _fsync_dir(tmp)
        if path.exists():  # the same version again (a recovered trainer re-took it)
            shutil.rmtree(path)
        os.replace(tmp, path)
        _fsync_dir(directory)
        for old in list_checkpoints(directory)[keep:]:
            shutil.rmtree(old, ignore_errors=True)
        return Checkpoint(version, digest, log_seq, path)

    def load_checkpoint(self, path: Path) -> Checkpoint:
        meta = json.loads((path / META_FILE).read_text())
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: unknown checkpoint format {meta.get('format')!r}")
        if meta.get("layout") != (want := self.engine.layout()):
            raise ValueError(
                f"{path}: written by a trainer laid out as {meta.get('layout')}, this one is {want}; "
                "resume with the same [trainer.parallelism], or rebuild from the log"
            )
        self.engine.load_state(path)
        digest = self.checksum()
        if digest != meta["weights_checksum"]:
            raise ValueError(
                f"{path}: weights checksum {digest} does not match the recorded {meta['weights_checksum']}"
            )
        return Checkpoint(int(meta["version"]), digest, int(meta["log_seq"]), path)


def _tensors(arrays: Sequence[np.ndarray], dtype: type[np.generic] | None = None) -> list[torch.Tensor]:
    """Writable tensors of ``arrays`` (read-only views of the log's bytes), as ``dtype`` when
    given: one copy of them all where they are alike (a step's 256 arrays in a few calls, not a
    few each), one each otherwise."""
    if arrays and len({(a.dtype, a.shape[1:]) for a in arrays}) == 1:
        joined = np.concatenate(arrays).astype(dtype or arrays[0].dtype, copy=False)
        return list(torch.from_numpy(joined).split([len(a) for a in arrays]))
    return [torch.from_numpy(a.astype(dtype or a.dtype)) for a in arrays]


def array_refs(v: ScoredView) -> tuple[ev.ArrayRef | None, ...]:
    """The arrays a rollout's training reads."""
    r = v.rollout
    return (v.body.prompt_tokens, r.completion_tokens, r.logprobs, r.routing_trace, r.completion_mask)


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_path(directory: Path, version: int) -> Path:
    return directory / f"ckpt-v{version:08d}"


def checkpoint_version(path: Path) -> int:
    return int(path.name.removeprefix("ckpt-v"))


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, newest first (temp directories of an interrupted write, and the
    single files of format 1, are ignored: the log rebuilds what they held)."""
    return sorted((p for p in directory.glob("ckpt-v*") if (p / META_FILE).is_file()), reverse=True)
