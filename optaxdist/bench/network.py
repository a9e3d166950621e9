"""The network suite: real processes on shaped links, measured seconds and bytes on the wire.

For each layout, node count and link rate, ``run_network_suite`` builds a ``Lab`` (one network
namespace per node on a bridge, each link rate-limited with ``tc``), starts the
``optaxdist.bench.network_worker`` processes of each node in its namespace (``distributed``: one
``jax.distributed`` process per node, CPU collectives over gloo; ``mpi``: one MPICH rank per
device, launched by one ``mpiexec``, TCP between the namespaces; ``node``: one MPICH rank per node
with ``devices_per_node`` CPU devices, ``node_hierarchy`` + ``on_node``, launched the same way) and
collects, per algorithm row:

* the ledger's bytes per step, and what one node sends for them by the ring formulas
  (``cost.wire_bytes``), against the bytes the interface counted (headers included);
* the compute-only step (the same step on one process alone) and the measured step on the mesh;
* the α-β model's step time, with the nominal link (the rate, ``NOMINAL_LATENCY_S``) and with the
  link fitted per collective from the calibration micro-benchmark (``cost.fit_links``);
* time-to-loss: wall-clock until the row's (smoothed) training loss reaches the final loss of
  ``allreduce-fp32``.

Without root it says why and runs on the loopback, unshaped (``--loopback``), where the interface
counters are shared by all processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from optaxdist.accounting import Kind
from optaxdist.bench import cost
from optaxdist.bench.algorithms import ALGORITHMS
from optaxdist.bench.netns import Lab, have_netns

NETWORK_ROWS = (
    "allreduce-fp32",
    "allreduce-bf16",
    "powersgd-r2",
    "topk-1%-ef",
    "local-sgd-8",
    "diloco-10",
    "diloco-10-delay9",
    "diloco-10-overlap9",
)
NOMINAL_LATENCY_S = 50e-6
CALIBRATED = ("all_reduce", "all_gather", "permute")
#: distributed: jax.distributed, one process per node (its devices_per_node devices), on_mesh;
#: mpi: one MPI rank per device (MpiComm, on_mpi); node: one MPI rank per node, its devices_per_node
#: devices through jax.lax and the nodes through MPI (node_hierarchy, on_node).
LAYOUTS = ("distributed", "mpi", "node")
#: the layouts launched by one mpiexec (each node's ranks in its namespace)
MPI_LAYOUTS = ("mpi", "node")
#: MPICH between namespaces: no shared memory, libfabric's TCP provider on the lab's interface.
MPI_OVER_TCP = {
    "MPIR_CVAR_NOLOCAL": "1",
    "MPIR_CVAR_CH4_NETMOD": "ofi",
    "FI_PROVIDER": "tcp",
    "FI_TCP_IFACE": "eth0",
}


@dataclasses.dataclass(frozen=True)
class NetworkConfig:
    """What the network suite runs (``optaxdist bench --suite network``)."""

    nodes: tuple[int, ...] = (2,)
    rates_mbit: tuple[float, ...] = (1000.0,)
    layouts: tuple[str, ...] = ("distributed",)
    devices_per_node: int = 1
    rows: tuple[str, ...] = NETWORK_ROWS
    steps: int = 40
    warmup: int = 3
    compute_steps: int = 10
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    hidden: tuple[int, ...] = (1024, 1024)
    dataset: str = "mnist"
    seed: int = 0
    calibrate: bool = True
    calibration_repeats: int = 5
    loopback: bool = False
    timeout_s: float = 1800.0
    out: str = "bench_results"
    plots: bool = True
    progress: bool = True

    def __post_init__(self):
        unknown = [r for r in self.rows if r not in ALGORITHMS]
        if unknown or not self.rows:
            raise ValueError(f"rows: unknown {unknown}; available: {', '.join(ALGORITHMS)}")
        if [r for r in self.rows if ALGORITHMS[r].single]:
            raise ValueError("rows: 'single' sends nothing; the network suite runs replicated rows")
        if not self.nodes or any(not isinstance(p, int) or p < 2 for p in self.nodes):
            raise ValueError(f"nodes={self.nodes!r} must be ints ≥ 2")
        if not self.layouts or any(lay not in LAYOUTS for lay in self.layouts):
            raise ValueError(f"layouts={self.layouts!r}; allowed: {LAYOUTS}")
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise ValueError(f"devices_per_node={self.devices_per_node!r} must be an int ≥ 1")
        if not self.rates_mbit or any(r <= 0 for r in self.rates_mbit):
            raise ValueError(f"rates_mbit={self.rates_mbit!r} must be positive (Mbit/s)")
        for name in ("steps", "warmup", "compute_steps", "batch_size", "calibration_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be ≥ 1")


def _log(msg: str, enabled: bool) -> None:
    if enabled:
        print(msg, file=sys.stderr, flush=True)


def calibration_sizes(rate_mbit: float | None, n: int) -> dict[str, list[int]]:
    """Payload sizes per collective: 4 KB up to what the link moves in about 0.2 s (at most 16 MB)."""
    top_bytes_per_s = (rate_mbit or 10_000) * 1e6 / 8
    sizes = {}
    for collective in CALIBRATED:
        largest = min(16 << 20, int(0.2 * top_bytes_per_s / max(cost.wire_bytes(collective, 1, n), 1e-9)))
        largest = max(largest, 64 << 10)
        sizes[collective] = sorted({int(4096 * (largest / 4096) ** (i / 4)) // 4 * 4 for i in range(5)})
    return sizes


def run_config(cfg: NetworkConfig, layout: str, nodes: int, rate_mbit: float | None) -> dict[str, Any]:
    """One lab (``nodes`` namespaces at ``rate_mbit``; the loopback if None and ``cfg.loopback``):
    start the workers of ``layout``, wait for them, return their records."""
    port = random.randint(20000, 40000)
    g = cfg.devices_per_node
    with tempfile.TemporaryDirectory(prefix="optaxdist-net-") as tmp:
        lab = None if cfg.loopback else Lab(nodes, rate_mbit=rate_mbit)
        try:
            host = "127.0.0.1" if lab is None else lab.address(0)
            worker_cfg = {
                **dataclasses.asdict(cfg),
                "layout": layout,
                "nodes": nodes,
                "replicas": nodes * g,
                "coordinator": f"{host}:{port}",
                "out": tmp,
                # the micro-benchmark runs over one device per node: the jax.distributed mesh, or
                # the MPI ranks (one per node)
                "calibration_bytes": calibration_sizes(rate_mbit, nodes)
                if cfg.calibrate and layout in ("distributed", "mpi") and g == 1
                else None,
            }
            path = os.path.join(tmp, "config.json")
            with open(path, "w") as f:
                json.dump(worker_cfg, f)
            env = _worker_env(1 if layout == "mpi" else g, mpi=layout in MPI_LAYOUTS and lab is not None)
            procs = []
            per_node = g if layout == "mpi" else 1
            commands = []
            for i in range(nodes):
                argv = [sys.executable, "-m", "optaxdist.bench.network_worker", path, str(i)]
                commands.append(argv if lab is None else lab.command(i, argv))
            if layout == "distributed":
                launches = commands
            else:  # mpi, node: one mpiexec, each node's ranks in its own namespace (MPMD)
                mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
                launch = [mpiexec]
                for argv in commands:
                    launch += [*([":"] if len(launch) > 1 else []), "-n", str(per_node), *argv]
                launches = [launch]
            for i, argv in enumerate(launches):
                log = open(os.path.join(tmp, f"process{i}.log"), "w")  # noqa: SIM115 (closed below)
                stderr = None if i == 0 and cfg.progress else log
                procs.append(
                    (subprocess.Popen(argv, env=env, stdout=log, stderr=stderr, start_new_session=True), log)
                )
            _wait(procs, cfg.timeout_s, tmp)
            records = []
            for i in range(nodes * per_node):
                with open(os.path.join(tmp, f"process{i}.json")) as f:
                    records.append(json.load(f))
            return {
                "layout": layout,
                "nodes": nodes,
                "devices_per_node": g,
                "rate_mbit": rate_mbit,
                "workers": records,
            }
        finally:
            if lab is not None:
                lab.close()


def _worker_env(devices: int, *, mpi: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("XLA_FLAGS", None)
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    if mpi:
        env.update(MPI_OVER_TCP)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _wait(procs: list[tuple[subprocess.Popen, Any]], timeout_s: float, tmp: str) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p, _ in procs):
            failed = [i for i, (p, _) in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
            log.close()
    bad = [i for i, (p, _) in enumerate(procs) if p.returncode != 0]
    if bad:
        tails = []
        for i in bad:
            with open(os.path.join(tmp, f"process{i}.log")) as f:
                tails.append(f"--- process {i} (exit {procs[i][0].returncode}) ---\n" + f.read()[-3000:])
        why = "timed out" if time.monotonic() > deadline else "failed"
        raise RuntimeError(f"network suite workers {bad} {why}:\n" + "\n".join(tails))


def _smoothed(values: Sequence[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def node_wire_bytes(ledger: dict[Kind, tuple[int, int]], nodes: int, g: int) -> float | None:
    """What one node sends through its link for the ledger of one replica, by the ring formulas,
    with one device per node; None with several (where a flat ring over them puts its node
    boundaries is the backend's business, not modelled), unless ``ledger`` is split by level
    (``comm_stats(levels=...)``, the ``node`` layout): then the node's ``g`` devices each send
    their cross-node kinds through the link (local kinds stay inside; None if a world-scoped kind
    is left, a permutation, whose split the ledger does not keep)."""
    if g > 1:
        if any(k.scope == "world" and c for k, (c, _) in ledger.items()):
            return None
        cross = [(k, c, b) for k, (c, b) in ledger.items() if k.scope == "cross" and c]
        return g * sum(cost.wire_bytes(k, b / c, nodes) * c for k, c, b in cross)
    members = {"world": nodes, "cross": nodes, "local": 1}
    return sum(cost.wire_bytes(k, b / c, members[k.scope]) * c for k, (c, b) in ledger.items() if c)


def summarize(config_run: dict[str, Any], steps: int) -> list[dict[str, Any]]:
    """Per row: bytes (ledger, ring formula, interface), times (compute, measured, modelled)."""
    layout, nodes, g = config_run["layout"], config_run["nodes"], config_run["devices_per_node"]
    rate, workers = config_run["rate_mbit"], config_run["workers"]
    n = nodes * g
    nominal = cost.Network("nominal", (rate or 10_000) * 1e6 / 8, NOMINAL_LATENCY_S)
    fitted = None
    if "calibration" in workers[0]:
        samples = {}
        for kind, points in workers[0]["calibration"].items():
            seconds = [
                statistics.median(w["calibration"][kind][i][1] for w in workers) for i in range(len(points))
            ]
            samples[kind] = [(size, t) for (size, _), t in zip(points, seconds)]
        fitted = cost.fit_links(samples, nodes)
    first_of_node = list({w["node"]: w for w in reversed(workers)}.values())  # one counter per namespace
    window = max(1, min(10, steps // 4))
    rows = []
    for name in workers[0]["rows"]:
        per = [w["rows"][name] for w in workers]
        ledger = {
            Kind(c, payload, label=label, scope=scope): (t["collectives"], t["bytes"])
            for (c, payload, label, scope), t in ((t["kind"], t) for t in per[0]["ledger"].values())
        }
        ledger_bytes = sum(b for _, b in ledger.values()) / steps
        ring = node_wire_bytes(_levels(per[0]) if "levels" in per[0] else ledger, nodes, g)
        ring = None if ring is None else ring / steps
        measured = statistics.mean(w["rows"][name]["tx_bytes"] for w in first_of_node) / steps
        compute = statistics.mean(statistics.median(r["compute_s"]) for r in per)
        step_s = per[0]["step_s"]
        model = cost.step_time(compute, ledger, steps, n, nominal, nodes=nodes)
        calibrated = cost.step_time(compute, ledger, steps, n, fitted) if fitted else None
        loss = _smoothed([statistics.mean(r["loss"][i] for r in per) for i in range(steps)], window)
        rows.append(
            {
                "algorithm": name,
                "layout": layout,
                "nodes": nodes,
                "devices_per_node": g,
                "rate_mbit": rate,
                "ledger_bytes_per_step": ledger_bytes,
                "ring_wire_bytes_per_step": ring,
                "measured_bytes_per_step": measured,
                "measured_over_ring": measured / ring if ring else None,
                "compute_s": compute,
                "step_s_median": statistics.median(step_s),
                "step_s_mean": statistics.mean(step_s),
                "model_s": model,
                "calibrated_model_s": calibrated,
                "mean_over_calibrated": statistics.mean(step_s) / calibrated if calibrated else None,
                "final_loss": loss[-1],
                "loss": loss,
                "elapsed_s": [sum(step_s[: i + 1]) for i in range(steps)],
                "warmup_s": per[0]["warmup_s"],
            }
        )
    baseline = next((r for r in rows if r["algorithm"] == "allreduce-fp32"), None)
    for r in rows:
        reached = [t for t, v in zip(r["elapsed_s"], r["loss"]) if baseline and v <= baseline["final_loss"]]
        r["time_to_loss_s"] = reached[0] if reached else None
    return [{**r, "fitted_links": _links_json(fitted)} for r in rows]


def _levels(row: dict[str, Any]) -> dict[Kind, tuple[int, int]]:
    """A worker row's ledger split by level (``comm_stats(levels=world)``), as ``{Kind: totals}``."""
    return {
        Kind(c, payload, label=label, scope=scope): (t["collectives"], t["bytes"])
        for (c, payload, label, scope), t in ((t["kind"], t) for t in row["levels"].values())
    }


def _links_json(links: dict[str, cost.Network] | None) -> dict[str, Any] | None:
    if links is None:
        return None
    return {k: {"bandwidth_Bps": v.bandwidth, "latency_s": v.latency} for k, v in links.items()}


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| algorithm | layout | nodes × devices | Mbit/s | ledger MB/step | ring formula MB/node/step | "
        "interface MB/node/step | "
        "interface / formula | compute ms | step ms (median) | step ms (mean) | model ms | "
        "calibrated ms | mean / calibrated | time to fp32's loss s | final loss |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]

    def f(v, scale=1.0, digits=1):
        return "–" if v is None else f"{v * scale:.{digits}f}"

    for r in rows:
        cells = [
            r["algorithm"],
            r["layout"],
            f"{r['nodes']} × {r['devices_per_node']}",
            f(r["rate_mbit"], digits=0) if r["rate_mbit"] else "loopback",
            f(r["ledger_bytes_per_step"], 1e-6, 3),
            f(r["ring_wire_bytes_per_step"], 1e-6, 3),
            f(r["measured_bytes_per_step"], 1e-6, 3),
            f(r["measured_over_ring"], digits=3),
            f(r["compute_s"], 1e3),
            f(r["step_s_median"], 1e3),
            f(r["step_s_mean"], 1e3),
            f(r["model_s"], 1e3),
            f(r["calibrated_model_s"], 1e3),
            f(r["mean_over_calibrated"], digits=2),
            f(r["time_to_loss_s"], digits=2),
            f"{r['final_loss']:.4f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_network_suite(cfg: NetworkConfig) -> dict[str, Any]:
    """Every (process count, rate) of ``cfg``; prints the table, writes JSON (and a plot)."""
    if not cfg.loopback and (reason := have_netns()):
        raise PermissionError(f"the network suite {reason}")
    t0 = time.perf_counter()
    rows = []
    for layout in cfg.layouts:
        for n in cfg.nodes:
            for rate in [None] if cfg.loopback else cfg.rates_mbit:
                where = "loopback" if rate is None else f"{rate:g} Mbit/s"
                _log(f"[network] {layout}, {n} nodes × {cfg.devices_per_node}, {where}", cfg.progress)
                rows += summarize(run_config(cfg, layout, n, rate), cfg.steps)
    record = {"config": dataclasses.asdict(cfg), "results": rows, "wall_s": time.perf_counter() - t0}
    print(format_table(rows))
    if cfg.out:
        os.makedirs(cfg.out, exist_ok=True)
        path = os.path.join(cfg.out, "network.json")
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
        paths = [path]
        if cfg.plots and not cfg.loopback:
            paths.append(plot_step_time(rows, cfg.out))
        _log("wrote " + ", ".join(paths), cfg.progress)
    return record


def plot_step_time(rows: list[dict[str, Any]], out: str) -> str:
    """Mean step time vs link rate, one line per algorithm, one panel per process count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({(r["layout"], r["nodes"]) for r in rows})
    fig, axes = plt.subplots(1, len(counts), figsize=(5 * len(counts), 4), dpi=110, squeeze=False)
    for ax, n in zip(axes[0], counts):
        for name in dict.fromkeys(r["algorithm"] for r in rows):
            pts = sorted(
                (r["rate_mbit"], r["step_s_mean"])
                for r in rows
                if r["algorithm"] == name and (r["layout"], r["nodes"]) == n
            )
            ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="link rate (Mbit/s)", ylabel="step time (ms, mean)")
        ax.set_title(f"{n[0]}, {n[1]} nodes", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, "network_step_time.png")
    fig.savefig(path)
    plt.close(fig)
    return path
