"""Settings of the run's monitor (``[monitor]``): its alerts and the trackers it feeds."""

from __future__ import annotations

from pydantic import Field

from jetrl.bus.settings import Section


class AlertSettings(Section):
    # No step for this long (and at least 10 times the median step interval) while running.
    trainer_stall_s: float = Field(120.0, gt=0)
    # A worker silent this long (heartbeats come every [inference] heartbeat_s, 2 s by default).
    heartbeat_lost_s: float = Field(20.0, gt=0)
    # A worker serving a version more than this many behind the newest; None: the run's
    # [trainer] max_off_policy_steps, the staleness the trainer still accepts.
    max_version_lag: int | None = Field(None, ge=0)
    # Dead letters within the last minute.
    dead_letters_per_min: int = Field(5, ge=1)
    # A step's train/inference mismatch KL (the k3 estimate) above this.
    mismatch_kl: float = Field(0.05, gt=0)
    # Reward collapse: the mean of the last `reward_window` steps fell this far (a share of
    # the best such mean) below the best, after at least two windows of steps.
    reward_drop: float = Field(0.5, gt=0, le=1)
    reward_window: int = Field(10, ge=2)
    # No signal: over the last `reward_window` steps, at least this share of the groups had
    # rewards all alike (a zero group-relative advantage: nothing to learn from), while the mean
    # reward is below the run's [trainer] stop_at_reward if it sets one. The mark of a policy
    # collapsed onto answers it no longer varies (docs/running.md, "When a run stalls").
    no_signal: float = Field(0.9, gt=0, le=1)


class MonitorSettings(Section):
    # The supervisor runs a headless monitor part that raises alerts as events on the run's log
    # (and feeds the trackers below); off: no monitor part unless a tracker asks for one.
    alerts: bool = True
    wandb: bool = False  # Weights & Biases, offline (files under <run dir>/monitor/wandb)
    wandb_project: str = "jetrl"
    wandb_mode: str = Field("offline", pattern="^(offline|online)$")
    tensorboard: bool = False  # event files under <run dir>/monitor/tensorboard
    prometheus_port: int | None = Field(None, ge=0, le=65535)  # /metrics of the monitor part
    rules: AlertSettings = AlertSettings()

    @property
    def wanted(self) -> bool:
        """Whether the run needs a monitor part."""
        return self.alerts or self.wandb or self.tensorboard or self.prometheus_port is not None

    @property
    def series_wanted(self) -> bool:
        """Whether the part's listeners take the series (trackers, Prometheus), not only the
        alerts, which read the steps alone."""
        return self.wandb or self.tensorboard or self.prometheus_port is not None


class MonitorPart(Section):
    """The monitor part's input (``python -m jetrl.consumers.monitor --settings``)."""

    monitor: MonitorSettings = MonitorSettings()
    out_dir: str  # <run dir>/monitor: the trackers' files and their position in the log
