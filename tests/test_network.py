"""The network suite: namespaces that leave nothing behind, the fitted cost model, and (slow) a real
two-process run whose interface counters match the ledger."""

import json
import signal
import subprocess
import sys
import time

import pytest

from optaxdist.accounting import Kind
from optaxdist.bench import cost
from optaxdist.bench.netns import Lab, have_netns, leftovers

NO_NETNS = have_netns()  # None, or why this runner cannot build network namespaces
needs_netns = pytest.mark.skipif(NO_NETNS is not None, reason=str(NO_NETNS))


def _namespaces_of(prefix):
    return [ns for ns in leftovers() if ns.startswith(prefix)]


@needs_netns
def test_lab_builds_shaped_links_and_removes_everything():
    with Lab(3, rate_mbit=100) as lab:
        assert sorted(_namespaces_of(lab.prefix)) == sorted(
            [lab.switch, *(lab.namespace(i) for i in range(3))]
        )
        qdiscs = subprocess.run(
            lab.command(1, ["tc", "qdisc", "show", "dev", "eth0"]), capture_output=True, text=True
        )
        assert "tbf" in qdiscs.stdout and "100Mbit" in qdiscs.stdout
        server = subprocess.Popen(
            lab.command(2, [sys.executable, "-c", _SERVER]), stdout=subprocess.PIPE, text=True
        )
        time.sleep(0.5)
        sent_before = lab.counters(0)[0]
        subprocess.run(
            lab.command(0, [sys.executable, "-c", _CLIENT.format(host=lab.address(2))]),
            check=True,
            timeout=60,
        )
        assert server.communicate(timeout=60)[0].strip() == "1000000"
        sent = lab.counters(0)[0] - sent_before
        assert 1_000_000 < sent < 1_100_000  # the payload and the TCP/IP headers, through eth0
    assert _namespaces_of(lab.prefix) == []


@needs_netns
def test_lab_is_removed_on_error_and_on_signals():
    with pytest.raises(RuntimeError, match="inside"), Lab(2) as lab:
        raise RuntimeError("inside")
    assert _namespaces_of(lab.prefix) == []
    for sig in (signal.SIGINT, signal.SIGTERM):
        child = subprocess.Popen([sys.executable, "-c", _HOLD_A_LAB], stdout=subprocess.PIPE, text=True)
        prefix = child.stdout.readline().strip()
        assert _namespaces_of(prefix)
        child.send_signal(sig)
        child.wait(timeout=30)
        assert _namespaces_of(prefix) == []


def test_lab_refuses_bad_settings():
    if NO_NETNS is not None:
        with pytest.raises(PermissionError, match="root"):
            Lab(2)
        return
    with pytest.raises(ValueError, match="nodes="):
        Lab(0)
    with pytest.raises(ValueError, match="rate_mbit="):
        Lab(2, rate_mbit=0)


def test_fitted_links_recover_latency_and_bandwidth():
    n, latency, bandwidth = 4, 2e-4, 1.25e8
    samples = {}
    for collective in ("all_reduce", "all_gather", "permute"):
        link = cost.Network("true", bandwidth, latency)
        samples[collective] = [
            (s, cost.collective_time(collective, s, n, link)) for s in (4096, 65536, 1 << 20)
        ]
    links = cost.fit_links(samples, n)
    for collective in ("all_reduce", "all_gather", "permute", "broadcast", "reduce_scatter"):
        assert links[collective].bandwidth == pytest.approx(bandwidth, rel=1e-6)
        assert links[collective].latency == pytest.approx(latency, rel=1e-6)
    by_kind = {Kind("all_reduce", "float32"): (10, 10 * 4 * 2**20)}
    assert cost.comm_time_per_step(by_kind, 10, n, links) == pytest.approx(
        cost.collective_time("all_reduce", 4 * 2**20, n, cost.Network("true", bandwidth, latency))
    )
    with pytest.raises(ValueError, match="all_reduce"):
        cost.fit_links({"permute": samples["permute"]}, n)


def _network_suite(tmp_path, *options: str) -> list[dict]:
    """The rows of ``optaxdist bench --suite network`` on 2 namespaces at 1 Gbit/s, 4 timed steps
    of the float32 and bfloat16 all-reduces, with ``options``."""
    out = subprocess.run(
        [sys.executable, "-m", "optaxdist.bench", "--suite", "network", "--net-nodes", "2", "--rates", "1000",
         "--algorithms", "allreduce-fp32,allreduce-bf16", "--steps", "4", "--out", str(tmp_path), "--quiet",
         "--timeout", "600", *options],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((tmp_path / "network.json").read_text())["results"]


@pytest.mark.slow
@needs_netns
def test_two_processes_send_what_the_ledger_says(tmp_path):
    """bfloat16 and float32 all-reduce between two processes on a 1 Gbit/s link, under
    jax.distributed and under MPI: the interface counts the ring formula's bytes of the ledger
    (within TCP/IP headers, < 5 %)."""
    results = _network_suite(tmp_path, "--layouts", "distributed,mpi", "--hidden", "256", "--no-calibrate")
    for layout in ("distributed", "mpi"):  # jax.distributed over gloo; MPICH over TCP
        rows = {r["algorithm"]: r for r in results if r["layout"] == layout}
        fp32, bf16 = rows["allreduce-fp32"], rows["allreduce-bf16"]
        assert bf16["ledger_bytes_per_step"] * 2 == fp32["ledger_bytes_per_step"]
        for r in (fp32, bf16):
            assert r["ring_wire_bytes_per_step"] == r["ledger_bytes_per_step"]  # n = 2: a ring sends S
            assert 1.0 <= r["measured_over_ring"] < 1.05
    assert _namespaces_of("odnet") == []


@pytest.mark.slow
@needs_netns
def test_one_process_per_node_sends_what_the_levels_say(tmp_path):
    """Layout ``node``: 2 namespaces, one MPI rank each with 2 CPU devices (node_hierarchy,
    on_node), full-size float32 and bfloat16 all-reduces (3.7 MB per device: the size that
    deadlocked through jax.pure_callback). What the node's link carries is its 2 devices' cross-node
    all-reduces of half the data each (the levelled ledger, by the ring formula), within TCP/IP
    headers."""
    results = _network_suite(tmp_path, "--layouts", "node", "--devices-per-node", "2", "--no-plots")
    rows = {r["algorithm"]: r for r in results}
    fp32, bf16 = rows["allreduce-fp32"], rows["allreduce-bf16"]
    assert bf16["ledger_bytes_per_step"] * 2 == fp32["ledger_bytes_per_step"]
    for r in (fp32, bf16):
        assert r["layout"] == "node" and r["devices_per_node"] == 2
        # N = 2: each device's cross all-reduce of S/2 sends S/2; the node's 2 devices send S (+ padding)
        assert r["ledger_bytes_per_step"] <= r["ring_wire_bytes_per_step"] < r["ledger_bytes_per_step"] + 64
        assert 1.0 <= r["measured_over_ring"] < 1.05
    assert _namespaces_of("odnet") == []


_SERVER = """
import socket
s = socket.socket(); s.bind(("0.0.0.0", 5001)); s.listen(); c, _ = s.accept(); n = 0
while (d := c.recv(1 << 16)):
    n += len(d)
print(n)
"""
_CLIENT = (
    "import socket; s = socket.create_connection(('{host}', 5001)); s.sendall(b'x' * 1_000_000); s.close()"
)
_HOLD_A_LAB = """
import time
from optaxdist.bench.netns import Lab
lab = Lab(2)
print(lab.prefix, flush=True)
time.sleep(60)
"""
