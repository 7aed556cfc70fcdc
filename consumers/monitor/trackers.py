"""The monitor's bridge from the run's log to experiment trackers: Weights & Biases, TensorBoard.

:class:`TrackerBridge` is a monitor listener: each new :class:`StepPoint` goes to every enabled
tracker as ``point.scalars()`` at ``step=point.step``. Both trackers' files live under the run's
monitor folder (``out_dir``): ``wandb/`` (W&B's own layout, made by ``wandb.init(dir=out_dir)``:
``wandb/offline-run-<time>-<run>/``, one folder per session, all of one W&B run whose id is the
jetrl run id, so ``wandb sync`` uploads them as one run) and ``tensorboard/`` (one event file per
session, named so that TensorBoard reads them in session order).

Restarts write each point once. The monitor re-folds the log from the start after a restart, so
every point comes again; each tracker skips the points it already holds:

* Flush policy: every point. TensorBoard's event file is flushed to the operating system after
  each point; W&B's ``log`` hands the point to wandb-core (``commit=True``), which writes its
  transaction log (the ``.wandb`` file) on its own clock, every ``WANDB_FLUSH_S`` seconds. Then
  ``position.json`` records the point's step and log seq (per tracker, replaced atomically).
* What a crash can cost. A process crash between a tracker's write and the position file would
  duplicate that point, and wandb-core, when its parent dies, drops what it has not flushed yet
  (up to ``WANDB_FLUSH_S`` of points that ``position.json`` already counts; measured on wandb
  0.31: a crash before the first flush leaves a ``.wandb`` file of 7 bytes). So on open each
  tracker resumes from what its own files hold, not from the position file: the last step in
  the event files (TensorBoard's reader) and in the run's ``.wandb`` transaction logs (wandb's
  own reader, ``wandb leet inspect``). A point past ``position.json`` that reached a tracker is not
  written again, and a point the position file counts but wandb-core lost is written again.
  The same holds after a power loss (no fsync: what the page cache lost is written again).
  ``position.json`` is the fallback when a tracker's files cannot be read (a new transaction
  log format, say: then a crash can duplicate the last point or lose W&B's unflushed ones).
  W&B online also keeps its own count: a resumed run starts at the server's next step, and
  the bridge skips what the server holds, whatever the local log says.
* Within one session W&B refuses a step lower than the last one; the monitor tells listeners
  points in step order, so nothing is refused.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from jetrl.bus.log import get_logger
from jetrl.consumers.monitor.series import StepPoint
from jetrl.consumers.monitor.settings import MonitorSettings

log = get_logger(__name__)

POSITION_FILE = "position.json"
WANDB_FLUSH_S = 1.0  # wandb-core's transaction-log flush interval (its default: 15 s)


class _Tracker(Protocol):
    name: str

    def last_step(self) -> int | None:
        """The last step the tracker's own files hold (-1: none), None when they cannot be read."""

    def write(self, point: StepPoint, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------- TensorBoard


class _TensorBoard:
    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self._tail = _tensorboard_last_step(log_dir)  # before this session's file exists
        self.path = log_dir / _event_file_name(log_dir)
        self._file = self.path.open("ab")
        self._records = RecordWriter(self._file)
        self._add(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def last_step(self) -> int | None:
        return self._tail

    def _add(self, event: Any) -> None:
        self._records.write(event.SerializeToString())
        self._records.flush()  # to the operating system: a process crash keeps it

    def write(self, point: StepPoint, scalars: dict[str, float]) -> None:
        values = [self._summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        summary = self._summary_pb2.Summary(value=values)
        self._add(self._event_pb2.Event(wall_time=point.t, step=point.step, summary=summary))

    def close(self) -> None:
        self._records.close()


def _event_file_name(log_dir: Path) -> str:
    """A new event file's name, after every other one in name order.

    TensorBoard reads a folder's event files in name order (``events.out.tfevents.<epoch
    seconds>.<host>...``) and never goes back to an earlier one, so two sessions within one
    second (a crash and a quick restart) would be read out of order: the epoch part is at least
    one more than the newest file's.
    """
    now = int(time.time())
    for p in log_dir.glob("events.out.tfevents.*"):
        field = p.name.split(".")[3]
        if field.isdigit():
            now = max(now, int(field) + 1)
    return f"events.out.tfevents.{now:010d}.{socket.gethostname()}.{os.getpid()}.jetrl"


def _tensorboard_last_step(log_dir: Path) -> int | None:
    """The highest step of a scalar in the event files (newest file with any first)."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    files = sorted(log_dir.glob("events.out.tfevents.*"), key=lambda p: (p.stat().st_mtime, p.name))
    try:
        for path in reversed(files):
            steps = [
                int(e.step)
                for e in LegacyEventFileLoader(str(path)).Load()
                if e.HasField("summary") and len(e.summary.value) > 0
            ]
            if steps:
                return max(steps)
    except Exception as exc:
        log.warning("tracker_tail_unreadable", tracker="tensorboard", dir=str(log_dir), error=str(exc))
        return None
    return -1


# ---------------------------------------------------------------------------------- W&B


def _wandb_last_step(wandb_dir: Path, run_id: str) -> int | None:
    """The highest history step in the run's transaction logs (newest file with any first),
    read by wandb's own reader (``wandb leet inspect --json``; about 0.7 s a file)."""
    exe = Path(sys.executable).parent / "wandb"
    files = sorted(
        wandb_dir.glob(f"*run-*-{run_id}*/run-{run_id}.wandb"), key=lambda p: (p.stat().st_mtime, p.name)
    )
    try:
        for path in reversed(files):
            out = subprocess.run(
                [str(exe), "leet", "inspect", "--json", str(path.resolve())],
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
            )
            steps = [
                int(r["history"]["step"]["num"])
                for r in map(json.loads, out.stdout.splitlines())
                if r.get("type") == "history"
            ]
            if steps:
                return max(steps)
    except Exception as exc:
        log.warning("tracker_tail_unreadable", tracker="wandb", dir=str(wandb_dir), error=str(exc))
        return None
    return -1


def _wandb_settings(mode: str) -> Any:
    import wandb

    wanted: dict[str, Any] = {
        "mode": mode,
        "console": "off",  # the monitor's own output stays its own
        "silent": True,
        "x_disable_stats": True,  # no system-metrics process
        "x_disable_meta": True,
        "x_disable_machine_info": True,
        "disable_git": True,
        "save_code": False,
        "x_save_requirements": False,  # no pip freeze at start
        "x_transaction_log_flush_interval": WANDB_FLUSH_S,
    }
    fields = getattr(wandb.Settings, "model_fields", None)
    if fields is not None:  # settings this wandb does not know are left out
        wanted = {k: v for k, v in wanted.items() if k in fields}
    return wandb.Settings(**wanted)


class _WandB:
    name = "wandb"

    def __init__(
        self, out_dir: Path, run_id: str, project: str, mode: str, config: dict[str, Any] | None
    ) -> None:
        if mode == "offline":
            # Offline never needs the network: no error reports to W&B's servers either.
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        import wandb

        out_dir.mkdir(parents=True, exist_ok=True)
        self.wandb_dir = out_dir / "wandb"  # W&B makes <dir>/wandb and puts its runs there
        self._tail = _wandb_last_step(self.wandb_dir, run_id) if self.wandb_dir.exists() else -1
        t0 = time.monotonic()
        self._run = wandb.init(
            project=project,
            id=run_id,
            name=run_id,
            resume="allow",
            dir=str(out_dir),
            config=config,
            reinit="create_new",
            settings=_wandb_settings(mode),
        )
        # A resumed online run starts at the server's next step.
        server_last = int(getattr(self._run, "step", 0) or 0) - 1
        if self._tail is not None:
            self._tail = max(self._tail, server_last)
        elif server_last >= 0:
            self._tail = server_last
        log.info(
            "tracker_opened",
            tracker="wandb",
            mode=mode,
            dir=str(self.wandb_dir),
            start_s=round(time.monotonic() - t0, 2),
        )

    def last_step(self) -> int | None:
        return self._tail

    def write(self, point: StepPoint, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=point.step, commit=True)

    def close(self) -> None:
        self._run.finish()


# ---------------------------------------------------------------------------------- the bridge


class TrackerBridge:
    """Writes step points to the trackers, each point once across restarts (module docstring)."""

    def __init__(self, run_id: str, out_dir: Path, trackers: list[_Tracker]) -> None:
        self.run_id = run_id
        self.out_dir = out_dir
        self.trackers = trackers
        self.position_path = out_dir / POSITION_FILE
        saved = _read_position(self.position_path)
        self.position: dict[str, Any] = {"step": saved.get("step", -1), "seq": saved.get("seq", 0)}
        saved_by = saved.get("trackers", {})
        self.done: dict[str, int] = {}  # tracker -> the last step it holds
        self.seqs: dict[str, int] = {}
        for t in trackers:
            fallback = saved_by.get(t.name, {})
            tail = t.last_step()
            step = tail if tail is not None else int(fallback.get("step", self.position["step"]))
            self.done[t.name] = step
            self.seqs[t.name] = int(fallback.get("seq", 0))
            if tail is not None and tail != int(fallback.get("step", -1)):
                log.info(
                    "tracker_resumed_from_its_files",
                    tracker=t.name,
                    run_id=run_id,
                    tracker_step=tail,
                    position_step=fallback.get("step"),
                )
        self.written = 0
        self.skipped = 0
        log.info("trackers_opened", run_id=run_id, trackers=[t.name for t in trackers], resume=self.done)

    def listener(self, point: StepPoint) -> None:
        scalars: dict[str, float] | None = None
        wrote = False
        for t in self.trackers:
            if point.step <= self.done[t.name]:
                continue
            if scalars is None:
                scalars = point.scalars()
            try:
                t.write(point, scalars)
            except Exception:  # one tracker failing leaves the others (and its position) as they are
                log.exception("tracker_write_failed", tracker=t.name, run_id=self.run_id, step=point.step)
                continue
            self.done[t.name], self.seqs[t.name] = point.step, point.seq
            wrote = True
        if not wrote:
            self.skipped += 1
            return
        self.written += 1
        self._save(point)

    def _save(self, point: StepPoint) -> None:
        behind = min(self.done, key=lambda n: self.done[n])  # the position all trackers passed
        self.position = {"step": self.done[behind], "seq": self.seqs[behind]}
        body = {
            "run_id": self.run_id,
            **self.position,
            "trackers": {n: {"step": s, "seq": self.seqs[n]} for n, s in self.done.items()},
        }
        tmp = self.position_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(body, sort_keys=True))
        os.replace(tmp, self.position_path)

    def close(self) -> None:
        for t in self.trackers:
            try:
                t.close()
            except Exception:
                log.exception("tracker_close_failed", tracker=t.name, run_id=self.run_id)
        log.info("trackers_closed", run_id=self.run_id, written=self.written, skipped=self.skipped)


def _read_position(path: Path) -> dict[str, Any]:
    try:
        out = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("tracker_position_unreadable", path=str(path), error=str(exc))
        return {}
    return out if isinstance(out, dict) else {}


def open_trackers(
    settings: MonitorSettings, run_id: str, out_dir: Path, *, config: dict[str, Any] | None = None
) -> TrackerBridge | None:
    """The bridge to the trackers ``[monitor]`` enables, or None when it enables none.

    ``config`` (the run's configuration) is given to W&B as the run's config.
    """
    if not (settings.wandb or settings.tensorboard):
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    trackers: list[_Tracker] = []
    if settings.tensorboard:
        trackers.append(_TensorBoard(out_dir / "tensorboard"))
    if settings.wandb:
        try:
            trackers.append(_WandB(out_dir, run_id, settings.wandb_project, settings.wandb_mode, config))
        except Exception:  # W&B unreachable (online) or broken: the rest of the monitor runs on
            log.exception("tracker_unavailable", tracker="wandb", run_id=run_id, mode=settings.wandb_mode)
    if not trackers:
        return None
    return TrackerBridge(run_id, out_dir, trackers)
