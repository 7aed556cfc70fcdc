"""Settings of the event log and its payloads (``[bus]``), and the base of every settings
section: unknown keys are refused, never ignored."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jetrl.bus.streams import GiB, StreamLimits
from jetrl.bus.subjects import check_token
from jetrl.plugins import PAYLOAD_STORES

# [trainer] max_off_policy_steps when a config does not say: the staleness a run accepts. The
# trainer enforces it, the producers size their groups in flight by it, the monitor alerts by it.
MAX_OFF_POLICY_STEPS = 1


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MooncakeSettings(Section):
    """``[bus.mooncake]``: payloads held by their writer and pulled by readers over Mooncake's
    transfer engine (bus/mooncake.py)."""

    protocol: Literal["tcp", "rdma"] = "tcp"
    device: str = ""  # RDMA devices ("" on TCP)
    # The address this process's engine advertises in its references; None: $JETRL_HOST in
    # the process that writes, else 127.0.0.1 (one machine).
    host: str | None = None
    # What a writer keeps, the oldest evicted first: past either limit, except that the newest
    # two objects (a trainer's last two weight versions) are always kept.
    keep_objects: int = Field(64, ge=2)
    keep_mib: float = Field(4096.0, gt=0)
    # A read that takes longer fails (PayloadMissing).
    timeout_s: float = Field(60.0, gt=0)


class BusSettings(Section):
    max_gib: float = Field(8.0, gt=0)  # the run's log
    payload_max_gib: float = Field(32.0, gt=0)  # the run's payload bucket
    # Where weights travel, a payload store of jetrl/plugins.py: the run's object store (any
    # machine), or "file": files in the run directory (every process on one filesystem; far
    # faster for weights of tens of MB and more), or "mooncake": held in the trainer's memory,
    # pulled by each worker (bus/mooncake.py).
    weights_store: str = "objstore"
    # Where routing traces go: the object store, or held by their inference worker (mooncake).
    traces_store: str = "objstore"
    mooncake: MooncakeSettings = MooncakeSettings()
    # Copies of the run's log and payload bucket on a JetStream cluster: "auto" takes 3 (or
    # every node of a smaller cluster), 1 on a single server.
    replicas: int | Literal["auto"] = Field("auto")

    @field_validator("weights_store", "traces_store")
    @classmethod
    def _store(cls, v: str) -> str:
        return PAYLOAD_STORES.check(v)

    @model_validator(mode="after")
    def _stores_check(self) -> BusSettings:
        # Each store's own checks of [bus] (bus/payloads.py: the file store keeps no traces).
        for kind in sorted({self.weights_store, self.traces_store}):
            checks = PAYLOAD_STORES.checks(kind)
            if checks is not None:
                checks.check(self)
        return self

    @field_validator("replicas")
    @classmethod
    def _replicas(cls, v: int | str) -> int | str:
        if v != "auto" and not 1 <= int(v) <= 5:
            raise ValueError("replicas is 1 to 5 (JetStream's limit), or 'auto'")
        return v

    def limits(self) -> StreamLimits:
        return StreamLimits(
            max_bytes=int(self.max_gib * GiB),
            payload_max_bytes=int(self.payload_max_gib * GiB),
            replicas=0 if self.replicas == "auto" else int(self.replicas),
        )


# Names jetrl keeps for itself: dead letters of run-wide events go under tenant "jetrl", and a
# tenant may not take the name of one of jetrl's own identities.
RESERVED_TENANTS = frozenset({"jetrl", "admin", "trainer", "inference", "recorder", "producer", "gateway"})


class TenantSettings(Section):
    """``[[tenants]]``: one team feeding the run. Tenants named only by an ``[[envs]]`` entry
    get these defaults."""

    name: str
    # Its weight in fair scheduling: the share of inference it gets when every tenant has work.
    weight: float = Field(1.0, gt=0)
    # Tasks of the tenant queued or generating at once; past it, the oldest queued are refused
    # (dead-lettered with reason "quota", on the tenant's own dead-letter subject). None: no limit.
    max_tasks_in_flight: int | None = Field(None, ge=1)

    @field_validator("name")
    @classmethod
    def _token(cls, v: str) -> str:
        check_token(v, "tenant name")
        if v in RESERVED_TENANTS:
            raise ValueError(f"tenant name {v!r} is reserved for jetrl's own parts")
        return v


class EnvRoute(Section):
    """What the consumers know of one environment of the run (from its ``[[envs]]`` entry):
    events of a (tenant, env) pair that is not one of the run's are refused as unknown."""

    tenant: str
    env: str
    group_size: int = Field(ge=1)
    share: float = Field(1.0, gt=0)  # its relative share of each trainer batch
