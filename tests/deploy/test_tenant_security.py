"""Tenants as NATS identities, against a real nats-server running the authorization that
`jetrl tenants` generates: what a tenant may do, what it may not, and that its attempts change
nothing in the run's log."""

from __future__ import annotations

import asyncio
import json
import stat
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats.errors
import pytest
from nats.js import api

from jetrl.bus import events as ev
from jetrl.bus import ids, subjects
from jetrl.bus.client import Bus
from jetrl.bus.identity import PermissionDenied
from jetrl.bus.publisher import BusError
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.streams import ensure_tenant_view, stream_name, view_stream_name
from jetrl.deploy.tenants import ADMIN, TenantRegistry
from tests.conftest import TEST_LIMITS

pytestmark = pytest.mark.slow  # every forbidden action tried against an authorizing server
RUN = f"sec{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> TenantRegistry:
    reg = TenantRegistry(tmp_path_factory.mktemp("tenants"))
    reg.add("acme", [RUN])
    reg.add("globex", [RUN])
    reg.save()
    return reg


@pytest.fixture(scope="module")
def server(registry: TenantRegistry, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    srv = EmbeddedServer(
        tmp_path_factory.mktemp("nats-auth"), auth_conf=registry.auth_conf, pid_dir=registry.servers_dir
    )
    srv.start()
    yield srv
    srv.stop()


async def connect(server: EmbeddedServer, registry: TenantRegistry, name: str) -> Bus:
    return await Bus.connect(server.url, name=name, creds=str(registry.creds_path(name)), request_timeout=2.0)


@pytest.fixture
async def admin(server: EmbeddedServer, registry: TenantRegistry) -> AsyncIterator[Bus]:
    bus = await connect(server, registry, ADMIN)
    await bus.ensure_run(RUN, TEST_LIMITS)
    for tenant in ("acme", "globex"):
        await ensure_tenant_view(bus.js, RUN, tenant, TEST_LIMITS)
    yield bus
    await bus.close()


@pytest.fixture
async def acme(server: EmbeddedServer, registry: TenantRegistry, admin: Bus) -> AsyncIterator[Bus]:
    bus = await connect(server, registry, "acme")
    yield bus
    await bus.close()


def write(path: Path, text: str) -> None:
    path.write_text(text)


def task(tenant: str, n: int, env: str = "math") -> ev.Event:
    tid = ids.task_id(env, tenant, n)
    return ev.new_event(
        ev.TaskSubmitted(task_id=tid, env=env, group_size=2, prompt_tokens=[1, 2]),
        run_id=RUN,
        tenant=tenant,
        event_id=ids.task_event_id(RUN, tid),
    )


async def snapshot(admin: Bus) -> list[tuple[int, str | None, bytes, dict[str, str]]]:
    """Every message of the run's log, byte for byte."""
    last = await admin.last_seq(RUN)
    out = []
    for seq in range(1, last + 1):
        m = await admin.js.get_msg(stream_name(RUN), seq, direct=True)
        out.append((seq, m.subject, bytes(m.data or b""), dict(m.headers or {})))
    return out


def test_credentials_are_private_and_the_config_holds_no_secret(registry: TenantRegistry) -> None:
    for name in ("acme", "globex", ADMIN, "trainer"):
        path = registry.creds_path(name)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        seed = json.loads(path.read_text())["seed"]
        assert seed.startswith("SU")
        assert seed not in registry.auth_conf.read_text()  # the server holds public keys only
    assert stat.S_IMODE(registry.keys_path.stat().st_mode) == 0o600


async def test_a_tenant_publishes_its_own_tasks_with_acks(acme: Bus, admin: Bus) -> None:
    ack = await acme.publish(task("acme", 1))
    assert ack.stream == stream_name(RUN) and not ack.duplicate
    items = await admin.read_log(RUN, filter_subject=subjects.task_subject(RUN, "acme"))
    assert [i.event.body.task_id for i in items if i.event] == [ids.task_id("math", "acme", 1)]  # type: ignore[attr-defined]


async def test_nothing_a_tenant_may_not_do_changes_the_log(acme: Bus, admin: Bus) -> None:
    await admin.publish(task("globex", 1))
    before = await snapshot(admin)
    refused: list[str] = []

    async def attempt(what: str, subject: str, coro: object) -> None:
        try:
            await coro  # type: ignore[misc]
        except (PermissionDenied, nats.errors.TimeoutError, TimeoutError, BusError):
            pass
        else:
            pytest.fail(f"tenant acme could {what}")
        await asyncio.sleep(0.1)
        assert acme.denied(subject), f"{what}: no permission error for {subject}"
        refused.append(what)

    step = ev.new_event(
        ev.StepCompleted(step=0, policy_version=0, rollout_ids=[]),
        run_id=RUN,
        event_id=ids.step_event_id(RUN, 0),
    )
    weights = ev.new_event(
        ev.WeightsReady(
            version=9,
            location=ev.PayloadRef(store="objstore", bucket="b", name="n", size=1, sha256="0" * 64),
            weights_checksum="0" * 64,
        ),
        run_id=RUN,
    )
    stream = stream_name(RUN)
    await attempt(
        "publish to another tenant's task subject",
        subjects.task_subject(RUN, "globex", "math"),
        acme.publish(task("globex", 2), timeout=1.0, retries=1),
    )
    await attempt(
        "publish a StepCompleted", subjects.step_subject(RUN), acme.publish(step, timeout=1.0, retries=1)
    )
    await attempt(
        "publish a WeightsReady", subjects.weights_subject(RUN), acme.publish(weights, timeout=1.0, retries=1)
    )
    await attempt(
        "create a consumer on the run's stream",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.spy",
        acme.js.add_consumer(stream, api.ConsumerConfig(durable_name="spy", filter_subject=f"jetrl.{RUN}.>")),
    )
    await attempt("delete the run's stream", f"$JS.API.STREAM.DELETE.{stream}", acme.js.delete_stream(stream))
    await attempt("purge the run's stream", f"$JS.API.STREAM.PURGE.{stream}", acme.js.purge_stream(stream))
    await attempt(
        "read another tenant's view",
        f"$JS.API.STREAM.INFO.{view_stream_name(RUN, 'globex')}",
        acme.js.stream_info(view_stream_name(RUN, "globex")),
    )
    assert len(refused) == 7
    # Reading another tenant's subjects directly (core NATS) is refused too.
    await acme.nc.subscribe(subjects.generation_subject(RUN, "globex"))
    await asyncio.sleep(0.3)
    assert acme.denied(subjects.generation_subject(RUN, "globex"))
    assert await snapshot(admin) == before


async def test_a_tenant_reads_only_its_own_view(acme: Bus, admin: Bus) -> None:
    await acme.publish(task("acme", 7))
    await admin.publish(task("globex", 7))
    view = view_stream_name(RUN, "acme")
    seen = set()
    for _ in range(50):  # the view is sourced: it follows the log within moments
        items = [i async for i in acme.tail(RUN, stream=view, to_head=True)]
        seen = {i.subject for i in items}
        if subjects.task_subject(RUN, "acme", "math") in seen:
            break
        await asyncio.sleep(0.1)
    assert subjects.task_subject(RUN, "acme", "math") in seen
    assert all(subjects.tenant_of(s) in ("acme", None) for s in seen), seen
    # Each item carries its sequence in the run's log, where its bytes are the same.
    for item in items:
        m = await admin.js.get_msg(stream_name(RUN), item.seq, direct=True)
        assert m.subject == item.subject


async def test_another_tenant_cannot_make_an_event_vanish_by_taking_its_id(
    server: EmbeddedServer, registry: TenantRegistry, admin: Bus, acme: Bus
) -> None:
    """Event ids are derived, so predictable: acme publishes on its own subject under the id
    of globex's next task (and of the trainer's next step); both are still stored."""
    globex = await connect(server, registry, "globex")
    try:
        victim = task("globex", 42)
        squat = task("acme", 42)
        await acme.nc.publish(  # core publish: acme's own subject, the victim's message id
            subjects.subject_for(squat), ev.encode_event(squat), headers={ev.HEADER_MSG_ID: victim.event_id}
        )
        step_id = ids.step_event_id(RUN, 5)
        await acme.nc.publish(subjects.subject_for(squat), b"x", headers={ev.HEADER_MSG_ID: step_id})
        await acme.nc.flush()
        await asyncio.sleep(0.2)
        ack = await globex.publish(victim)
        step = ev.new_event(
            ev.StepCompleted(step=5, policy_version=5, rollout_ids=[]), run_id=RUN, event_id=step_id
        )
        pub = admin.publisher()
        await pub.publish(step)
        await pub.flush()
        again = await globex.publish(victim)  # a retry of the victim is still a duplicate of itself
        assert again.duplicate and again.seq == ack.seq
        stored = await admin.js.get_msg(stream_name(RUN), ack.seq, direct=True)
        assert stored.subject == subjects.subject_for(victim)
        assert ev.decode_event(stored.data or b"").event_id == victim.event_id
        steps = await admin.read_log(RUN, filter_subject=subjects.step_subject(RUN))
        assert [i.event.event_id for i in steps if i.event] == [step_id]
    finally:
        await globex.close()


async def test_a_revoked_or_rotated_identity_is_refused_after_a_reload(
    server: EmbeddedServer, registry: TenantRegistry, admin: Bus
) -> None:
    reg = TenantRegistry(registry.dir)
    reg.add("initech", [RUN])
    reg.save()
    await asyncio.sleep(0.5)  # the reload
    old_creds = reg.creds_path("initech").read_text()
    live = await connect(server, reg, "initech")
    assert (await live.publish(task("initech", 1))).seq > 0
    reg.rotate("initech")
    reg.save()
    await asyncio.sleep(0.5)
    stale = Path(reg.dir / "old.creds")
    write(stale, old_creds)
    with pytest.raises(BusError, match="refused"):
        await Bus.connect(server.url, name="old", creds=str(stale), connect_timeout=2.0)
    await live.close()
    current = await connect(server, reg, "initech")
    creds = reg.creds_path("initech").read_text()
    reg.remove("initech")
    reg.save()
    for _ in range(20):  # the reload closes its live connection at once
        if not current.nc.is_connected:
            break
        await asyncio.sleep(0.1)
    assert not current.nc.is_connected
    await current.close()
    write(stale, creds)
    with pytest.raises(BusError, match="refused"):
        await Bus.connect(server.url, name="gone", creds=str(stale), connect_timeout=2.0)
