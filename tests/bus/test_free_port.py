"""`free_port`: a loopback port a server can bind, below the kernel's ephemeral range, whatever
has seeded the global `random` module (test tools reseed it to one value in every process)."""

from __future__ import annotations

import random
import socket

from jetrl.bus.server import _ephemeral_range, free_port


def test_ports_are_bindable_and_below_the_ephemeral_range() -> None:
    low, _ = _ephemeral_range()
    for _ in range(5):
        port = free_port()
        assert 10000 <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_the_global_random_seed_does_not_decide_the_port() -> None:
    random.seed(1234)
    first = [free_port() for _ in range(5)]
    random.seed(1234)
    again = [free_port() for _ in range(5)]
    assert first != again  # the same five in a row by chance: about 1 in 10**21
