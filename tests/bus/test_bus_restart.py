"""The server dies mid-stream (SIGKILL) and comes back on its files: nothing is lost."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import nats.errors
import pytest
from nats.aio.msg import Msg

from jetrl.bus import events as ev
from jetrl.bus import subjects
from jetrl.bus.client import Bus
from jetrl.bus.consumer import ConsumerSpec
from jetrl.bus.server import EmbeddedServer
from jetrl.deploy.launcher import process_start_time
from tests.conftest import TEST_LIMITS

N_EVENTS = 3000


async def test_publisher_and_consumer_recover_from_server_restart(tmp_path) -> None:
    srv = EmbeddedServer(tmp_path / "nats").start()
    run_id = "restart1"
    try:
        pub_bus = await Bus.connect(srv.url, name="publisher")
        await pub_bus.ensure_run(run_id, TEST_LIMITS)
        sub_bus = await Bus.connect(srv.url, name="consumer")
        consumer = await sub_bus.consumer(
            ConsumerSpec(
                run_id=run_id,
                durable="counter",
                filter_subjects=[subjects.all_subjects(run_id)],
                ack_wait=2.0,
            )
        )
        sent: list[str] = []
        received: set[str] = set()
        stop = asyncio.Event()

        async def produce() -> None:
            pub = pub_bus.publisher(max_inflight=64, ack_timeout=2.0, retries=50)
            for i in range(N_EVENTS):
                e = ev.new_event(
                    ev.WorkerHeartbeat(worker_id="w", kind="inference", inflight=i), run_id=run_id
                )
                sent.append(e.event_id)
                await pub.publish(e)
                if i % 25 == 0:
                    await asyncio.sleep(0.02)  # a steady stream, so the crash lands mid-way
            await pub.flush(timeout=60)

        async def consume() -> None:
            while not stop.is_set():
                for d in await consumer.fetch(100, timeout=0.5):
                    received.add(d.event.event_id)
                    await d.ack()

        cons = asyncio.create_task(consume())
        prod = asyncio.create_task(produce())
        while len(received) < N_EVENTS // 3:
            await asyncio.sleep(0.05)
        sent_at_crash = len(sent)
        srv.kill()
        await asyncio.sleep(1.0)
        srv.start()
        await asyncio.wait_for(prod, 90)
        deadline = asyncio.get_running_loop().time() + 60
        while len(received) < N_EVENTS and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        stop.set()
        await cons

        assert len(sent) == N_EVENTS
        assert sent_at_crash < N_EVENTS, "the crash must land while events are still being published"
        assert received == set(sent), f"lost {len(set(sent) - received)} events"
        # Resent publishes were deduplicated: the log holds each event exactly once.
        assert await pub_bus.last_seq(run_id) == N_EVENTS
        await pub_bus.close()
        await sub_bus.close()
    finally:
        srv.stop()


STARTER = """
import sys, threading, time
from jetrl.bus.server import EmbeddedServer
from jetrl.deploy.launcher import process_start_time
def start():
    srv = EmbeddedServer(sys.argv[1]).start()
    print(srv.proc.pid, flush=True)
if sys.argv[2] == "main":
    start()
else:
    t = threading.Thread(target=start)
    t.start()
    t.join()
time.sleep(120)
"""


def test_a_server_ends_with_the_process_that_started_it_killed_outright(tmp_path) -> None:
    """A supervisor killed with SIGKILL: its nats-server stops too (SIGTERM: its files closed
    in order), rather than keep the run's JetStream files open under the server a resumed run
    starts on them. A server started from another thread than the main one is not tied."""
    for where, tied in (("main", True), ("thread", False)):
        starter = subprocess.Popen(
            [sys.executable, "-c", STARTER, str(tmp_path / where), where], stdout=subprocess.PIPE, text=True
        )
        assert starter.stdout is not None
        server = int(starter.stdout.readline())
        starter.kill()
        starter.wait()
        deadline = time.monotonic() + (15 if tied else 2)  # untied: still there 2 s on
        while time.monotonic() < deadline and _running(server):
            time.sleep(0.1)
        try:
            assert _running(server) is not tied, where
        finally:
            if _running(server):
                os.kill(server, signal.SIGKILL)


def _running(pid: int) -> bool:
    return process_start_time(pid) is not None  # a zombie has ended


async def test_requests_waiting_on_a_dropped_connection_fail_at_once(tmp_path) -> None:
    """A request or JetStream publish in flight when the server dies can never get its reply
    (replies go back on the connection that asked): it fails as timed out when the client sees
    the connection drop, to be retried, instead of waiting out its own timeout (10 s for a
    direct get or a publisher's ack, which stalled a run after each nats-server crash); a
    consumer's fetch waiting on the dropped connection returns empty, to fetch again."""
    srv = EmbeddedServer(tmp_path / "nats").start()
    run_id = "lost1"
    try:
        bus = await Bus.connect(srv.url, name="asker")
        await bus.ensure_run(run_id, TEST_LIMITS)
        await bus.nc.subscribe("svc.silent", cb=_ignore)  # a responder that never answers
        await bus.nc.subscribe("svc.echo", cb=_echo)
        consumer = await bus.consumer(
            ConsumerSpec(run_id=run_id, durable="idle", filter_subjects=[subjects.all_subjects(run_id)])
        )
        await bus.nc.flush()
        await bus.nc.request("svc.echo", b"?", timeout=30)  # the client's reply inbox made
        asked = asyncio.create_task(bus.nc.request("svc.silent", b"?", timeout=600))
        for _ in range(3000):  # until the request waits for its reply (nats-py's map of them)
            if bus.nc._resp_map:
                break
            await asyncio.sleep(0.01)
        fetching = asyncio.create_task(consumer.fetch(10, timeout=600))  # nothing to fetch yet
        # The server frozen, a JetStream publish goes out and waits for an ack that cannot come.
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGSTOP)
        pub = bus.publisher(max_inflight=8, ack_timeout=600, retries=50)
        event = ev.new_event(ev.WorkerHeartbeat(worker_id="w", kind="inference", inflight=1), run_id=run_id)
        await pub.publish(event)
        await asyncio.sleep(0.2)
        assert pub.inflight == 1
        srv.kill()  # the frozen server dies: the client sees its connection reset
        # Failed as a timeout (nats' own), not after the request's 600 s: the bound only ends
        # a test whose requests were never failed.
        with pytest.raises(nats.errors.TimeoutError):
            await asyncio.wait_for(asked, 60)
        assert bus.lost_requests == 2  # the request and the publish
        assert await asyncio.wait_for(fetching, 60) == []  # its wait ended, to be asked again
        srv.start()
        await pub.flush(timeout=60)  # re-sent at once, not after its 600 s ack timeout
        assert pub.resent >= 1
        assert await bus.last_seq(run_id) == 1  # stored once
        await bus.close()
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            srv.proc.send_signal(signal.SIGCONT)
        srv.stop()


async def _ignore(msg: object) -> None:
    return None


async def _echo(msg: Msg) -> None:
    await msg.respond(msg.data)


async def test_a_tail_goes_on_after_a_server_restart_with_its_consumer_made_anew(tmp_path) -> None:
    """A tail's ordered consumer is ephemeral: a restarted server has lost it. It is made anew
    from the tail's next sequence as the connection comes back (not at nats-py's next check
    of the missed heartbeats), and the tail goes on in order, nothing skipped or repeated."""
    srv = EmbeddedServer(tmp_path / "nats").start()
    run_id = "tail1"
    try:
        bus = await Bus.connect(srv.url, name="follower")
        await bus.ensure_run(run_id, TEST_LIMITS)

        def beat(i: int) -> ev.Event:
            body = ev.WorkerHeartbeat(worker_id="w", kind="inference", inflight=i)
            return ev.new_event(body, run_id=run_id)

        seen: list[int] = []
        got_two, got_four = asyncio.Event(), asyncio.Event()

        async def follow() -> None:
            async for item in bus.tail(run_id):
                assert item.event is not None
                body = item.event.body
                assert isinstance(body, ev.WorkerHeartbeat)
                seen.append(body.inflight)
                if len(seen) == 2:
                    got_two.set()
                if len(seen) == 4:
                    got_four.set()
                    return

        follower = asyncio.create_task(follow())
        for i in (0, 1):
            await bus.publish(beat(i))
        await asyncio.wait_for(got_two.wait(), 30)
        srv.kill()
        srv.start()
        for i in (2, 3):
            await bus.publish(beat(i))  # retried until the connection is back
        await asyncio.wait_for(got_four.wait(), 60)
        await follower
        assert seen == [0, 1, 2, 3]
        assert bus.tails_restarted == 1
        await bus.close()
    finally:
        srv.stop()
