"""The server dies mid-stream (SIGKILL) and comes back on its files: nothing is lost."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

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
