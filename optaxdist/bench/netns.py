"""A shaped network on one machine: one Linux network namespace per process, joined by a switch.

``Lab(nodes, rate_mbit=..., delay_ms=...)`` builds, inside namespaces it creates and nowhere else:

* a switch namespace ``<prefix>sw`` holding a bridge ``br0``;
* per node ``i`` a namespace ``<prefix>n<i>`` with an interface ``eth0`` at ``10.213.<k>.<i+1>/24``,
  one end of a veth pair whose other end (``p<i>``) is a port of the bridge.

Each direction of each node's link is shaped on its sending side: ``eth0`` for what the node sends,
the bridge port ``p<i>`` for what it receives, each with ``netem delay`` (one way, so a round trip
costs ``2 × delay``) above a ``tbf`` rate limit. Deleting a namespace deletes the veth ends in it, so
``close()`` (also run at exit, on SIGINT/SIGTERM and by ``with``) removes everything ``Lab`` made.
Needs root (``CAP_NET_ADMIN``) and iproute2's ``ip`` and ``tc``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Sequence

NAME_PREFIX = "odnet"


def have_netns() -> str | None:
    """None if this process can build a ``Lab``, else the reason it cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run as root, or use --loopback"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"iproute2 tools not found: {missing}"
    return None


def _run(*argv: str) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if out.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {out.stderr.strip()}")
    return out.stdout


def leftovers(prefix: str = NAME_PREFIX) -> list[str]:
    """Network namespaces whose name starts with ``prefix`` (those a ``Lab`` left behind)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


class Lab:
    """``nodes`` namespaces on a bridge, links shaped to ``rate_mbit`` and ``delay_ms`` (None:
    unshaped); see the module docstring."""

    def __init__(self, nodes: int, *, rate_mbit: float | None = None, delay_ms: float = 0.0):
        if reason := have_netns():
            raise PermissionError(reason)
        if not 1 <= nodes <= 250:
            raise ValueError(f"nodes={nodes!r} must be in [1, 250]")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit={rate_mbit!r} must be positive (or None: unshaped)")
        if delay_ms < 0:
            raise ValueError(f"delay_ms={delay_ms!r} must be ≥ 0")
        tag = uuid.uuid4().hex[:6]
        self.prefix = f"{NAME_PREFIX}{tag}"
        self.subnet = 1 + int(tag, 16) % 250  # 10.213.<subnet>.0/24: labs side by side do not mix
        self.nodes, self.rate_mbit, self.delay_ms = nodes, rate_mbit, delay_ms
        self._made: list[str] = []
        self._previous_handlers = {}
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def namespace(self, i: int) -> str:
        return f"{self.prefix}n{i}"

    def address(self, i: int) -> str:
        return f"10.213.{self.subnet}.{i + 1}"

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(i), *argv]

    def counters(self, i: int) -> tuple[int, int]:
        """Bytes node ``i`` has sent and received on its link (``eth0``), headers included."""
        stats = "/sys/class/net/eth0/statistics/"
        out = _run("ip", "netns", "exec", self.namespace(i), "cat", stats + "tx_bytes", stats + "rx_bytes")
        tx, rx = (int(v) for v in out.split())
        return tx, rx

    def _build(self) -> None:
        _run("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns, port = self.namespace(i), f"p{i}"
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            _run(
                "ip",
                "link",
                "add",
                "eth0",
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                self.switch,
            )
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # no IPv6 autoconfiguration chatter in the counters
            _run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
            self._shape(ns, "eth0")
            self._shape(self.switch, port)

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate_mbit is None and not self.delay_ms:
            return
        tc = ("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev)
        parent = ("root",)
        if self.delay_ms:
            try:
                _run(*tc, "root", "handle", "1:", "netem", "delay", f"{self.delay_ms}ms", "limit", "100000")
            except RuntimeError as e:
                if "unknown" not in str(e):
                    raise
                raise ValueError(
                    f"delay_ms={self.delay_ms}: this kernel has no netem qdisc (sch_netem); use delay_ms=0"
                ) from e
            parent = ("parent", "1:1")
        if self.rate_mbit is not None:
            # burst: at least one MTU and 1 ms at the rate; queue: 400 ms at the rate
            burst = max(int(self.rate_mbit * 1e6 / 8 / 1000), 16 * 1514)
            rate = f"{self.rate_mbit}mbit"
            _run(*tc, *parent, "handle", "10:", "tbf", "rate", rate, "burst", str(burst), "latency", "400ms")

    def _on_signal(self, signum, frame) -> None:
        self.close()
        previous = self._previous_handlers.get(signum)
        signal.signal(signum, previous if callable(previous) else signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def close(self) -> None:
        """Delete every namespace this lab made (their veths and the bridge go with them)."""
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True, timeout=30)
        for sig, previous in self._previous_handlers.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, previous)
        self._previous_handlers = {}
        atexit.unregister(self.close)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
