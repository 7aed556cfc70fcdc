"""What the demo's log holds: events and bytes per step, by type, against the arrays' own bytes.

Runs the demo (configs/demo.toml, recorder off) for ``--steps`` steps on a private
nats-server, then reads its log back: for each event type the count and the encoded bytes
(what the stream stores of each message's data), and the bytes of the arrays carried inline
(token ids, logprobs, routing traces: the payload the events exist to move). The ratio of the
log's bytes to the arrays' is the cost of the envelope, the ids and the field names; it ends
with that line.

    python bench/log_bytes.py [--steps 30]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections import Counter
from pathlib import Path

import msgspec

from jetrl.bus import events as ev
from jetrl.bus.client import Bus
from jetrl.bus.log import configure
from jetrl.bus.server import EmbeddedServer
from jetrl.bus.streams import stream_name
from jetrl.deploy.config import load_config
from jetrl.deploy.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[1]


def inline_bytes(value: object) -> int:
    """The bytes of every inline array in a body (walked through its structs and lists)."""
    if isinstance(value, ev.InlineArray):
        return len(value.data)
    if isinstance(value, msgspec.Struct):
        return sum(inline_bytes(getattr(value, f)) for f in value.__struct_fields__)
    if isinstance(value, list | tuple):
        return sum(inline_bytes(v) for v in value)
    return 0


async def measure(url: str, run_id: str) -> tuple[Counter[str], Counter[str], Counter[str], int, int]:
    bus = await Bus.connect(url)
    try:
        info = await bus.js.stream_info(stream_name(run_id))
        count: Counter[str] = Counter()
        size: Counter[str] = Counter()
        arrays: Counter[str] = Counter()
        async for item in bus.tail(run_id, to_head=True):
            if item.event is None:
                continue
            t = item.event.type
            count[t] += 1
            size[t] += len(ev.encode_event(item.event))
            arrays[t] += inline_bytes(item.event.body)
        return count, size, arrays, int(info.state.bytes), int(info.state.messages)
    finally:
        await bus.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    configure("warning")
    over = [
        "--trainer.max_steps",
        str(args.steps),
        "--trainer.stop_at_reward",
        "2.0",
        "--store.recorder",
        "false",
    ]
    cfg = load_config(ROOT / "configs" / "demo.toml", over)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer(Path(tmp) / "nats") as srv:
        run_id = "logbytes"
        asyncio.run(Supervisor(cfg, run_id, Path(tmp) / run_id, nats_url=srv.url, quiet=True).run())
        count, size, arrays, stored, messages = asyncio.run(measure(srv.url, run_id))
    steps = args.steps
    print(f"the demo, {steps} steps: {messages} messages, {stored / 1e6:.2f} MB stored by the stream")
    print(f"{'event':<24}{'events/step':>12}{'bytes/step':>14}{'arrays/step':>14}")
    for t, n in count.most_common():
        print(f"{t:<24}{n / steps:>12.1f}{size[t] / steps:>14,.0f}{arrays[t] / steps:>14,.0f}")
    total, payload = sum(size.values()), sum(arrays.values())
    print(f"{'all':<24}{sum(count.values()) / steps:>12.1f}{total / steps:>14,.0f}{payload / steps:>14,.0f}")
    print()
    print(f"log bytes per step {total / steps:,.0f}, {total / payload:.2f}x the arrays' own bytes")


if __name__ == "__main__":
    main()
