"""Hosts made of Linux network namespaces, for multi-host tests on one machine.

Each "host" is a namespace of its own with one veth interface on a private subnet; the other
ends sit on a bridge inside a further namespace, so the hosts reach each other only through it
and nothing is routed to or from the machine's own namespace. Processes run on a host through
``ip netns exec``; they share the machine's filesystem (as nodes share a cluster filesystem).
Needs root (or CAP_SYS_ADMIN) and iproute2; :func:`why_not` says what is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

SUBNET = "10.213.{net}.{host}"  # private to the namespaces: never routed off them


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def why_not() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"jrlprobe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        return f"cannot make a network namespace (`ip netns add`: {exc.stderr.strip()}); run as root"
    _ip("netns", "del", probe)
    return None


@dataclass
class Hosts:
    """``count`` hosts, ``addresses[i]`` the address of host ``i``."""

    count: int = 3
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    names: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)

    @property
    def bridge_ns(self) -> str:
        return f"jrl{self.tag}br"

    def up(self) -> Hosts:
        net = int(self.tag, 16) % 250 + 1
        made = [self.bridge_ns]
        try:
            _ip("netns", "add", self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for i in range(self.count):
                ns, addr = f"jrl{self.tag}h{i}", SUBNET.format(net=net, host=i + 1)
                _ip("netns", "add", ns)
                made.append(ns)
                # The pair is made inside the bridge's namespace, its host end moved at once.
                veth = ("type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.bridge_ns, "link", "add", f"b{i}", *veth)
                _ip("-n", self.bridge_ns, "link", "set", f"b{i}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                self.names.append(ns)
                self.addresses.append(addr)
        except BaseException:
            for ns in made:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            raise
        return self

    def down(self) -> None:
        for ns in [*self.names, self.bridge_ns]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.names.clear()
        self.addresses.clear()

    def exists(self) -> list[str]:
        """The namespaces of these hosts the machine still has."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        present = {line.split()[0] for line in listed.splitlines() if line.strip()}
        return sorted(n for n in present if n.startswith(f"jrl{self.tag}"))

    def popen(
        self,
        host: int,
        argv: Sequence[str],
        *,
        out: IO[bytes] | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """``argv`` started on host ``host``, its output to ``out``."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.names[host], *argv],
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            env=dict(os.environ, **(env or {})),
        )

    def run(self, host: int, argv: Sequence[str], timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """``argv`` run to its end on host ``host``."""
        return subprocess.run(
            ["ip", "netns", "exec", self.names[host], *argv], capture_output=True, text=True, timeout=timeout
        )
