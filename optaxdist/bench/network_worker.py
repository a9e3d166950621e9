"""One process of the network suite: ``python -m optaxdist.bench.network_worker CONFIG PROCESS_ID``.

Started by ``optaxdist.bench.network`` inside its node's network namespace; joins the others with
``jax.distributed`` (layout ``distributed``; CPU collectives over gloo) or MPI (layouts ``mpi`` and
``node``; the rank replaces ``PROCESS_ID``), and writes ``process<ID>.json`` into the config's
``out`` directory:

* ``calibration`` (when the config asks for it): seconds per collective (all-reduce, all-gather,
  permute) for a range of sizes;
* per algorithm row: compute-only seconds per step (the same step, one replica alone), then the
  seconds of each timed step of all replicas and its loss (the mean over this process's
  replicas), the node's interface byte counters around them, and the ledger's totals over those
  steps.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np


def _interface_bytes() -> tuple[int, int]:
    stats = "/sys/class/net/eth0/statistics/"
    if not os.path.exists(stats):  # a loopback run (no namespaces): the shared loopback
        stats = "/sys/class/net/lo/statistics/"
    with open(stats + "tx_bytes") as tx, open(stats + "rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


def _ledger(state: Any, levels: Any = None) -> dict[str, dict[str, Any]]:
    import optaxdist

    return {
        str(k): {
            "kind": [k.collective, k.payload, k.label, k.scope],
            "collectives": t.collectives,
            "bytes": t.bytes,
        }
        for k, t in optaxdist.comm_stats(state, levels=levels).by_kind.items()
    }


class Layout(NamedTuple):
    """How this process runs its replicas: the hierarchy the algorithms get, the harness, how the
    step's stacked arguments are placed, and how to read this process's first replica."""

    hierarchy: Any
    replicas: tuple[int, ...]  # the world indices of this process's replicas
    harness: Callable[[Callable], Callable]
    place: Callable[[Any], Any]
    mine: Callable[[Any], Any]


def make_layout(cfg: dict[str, Any], rank: int) -> Layout:
    """``distributed``: ``jax.distributed``, one process per node with ``devices_per_node``
    devices, ``on_mesh``; ``mpi``: one process per device, ``MpiComm``, ``on_mpi``; ``node``: one
    MPI process per node with ``devices_per_node`` devices, ``node_hierarchy``, ``on_node``."""
    import jax

    import optaxdist
    from optaxdist.parallel.multihost import global_replica_array

    g = cfg["devices_per_node"]
    if cfg["layout"] == "mpi":
        first_row = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731
        h = optaxdist.mpi_hierarchy(local_size=g)
        return Layout(h, (rank,), optaxdist.on_mpi, first_row, lambda tree: tree)
    if cfg["layout"] == "node":
        # a peer that never answers ends the job well before the suite's own timeout
        h = optaxdist.node_hierarchy(timeout_s=min(300.0, cfg["timeout_s"] / 4))
        rows = tuple(range(rank * g, (rank + 1) * g))
        return Layout(h, rows, lambda step: optaxdist.on_node(step, h), lambda tree: tree, _first)
    h = optaxdist.mesh_hierarchy(cfg["nodes"], g)
    rows = tuple(range(rank * g, (rank + 1) * g))
    return Layout(
        h,
        rows,
        lambda step: optaxdist.on_mesh(step, h.mesh),
        lambda t: global_replica_array(t, h.mesh),
        _first,
    )


def _alone() -> Layout:
    """One replica on this process's first device, nothing shared (the compute-only step)."""
    import jax

    import optaxdist
    from optaxdist.parallel.multihost import global_replica_array

    h = optaxdist.mesh_hierarchy(1, 1, devices=jax.local_devices()[:1])
    harness = lambda step: optaxdist.on_mesh(step, h.mesh, check_config=False)  # noqa: E731
    return Layout(h, (0,), harness, lambda t: global_replica_array(t, h.mesh), _first)


def _first(tree: Any) -> Any:
    """This process's first replica of stacked (possibly global) arrays."""
    import jax

    return jax.tree.map(
        lambda a: np.asarray(a.addressable_data(0) if hasattr(a, "addressable_data") else a)[0], tree
    )


def _local_mean(x: Any) -> float:
    """The mean of a stacked (possibly global) array over this process's replicas."""
    shards = [s.data for s in x.addressable_shards] if hasattr(x, "addressable_shards") else [x]
    return float(np.mean(np.concatenate([np.asarray(s).reshape(-1) for s in shards])))


def calibrate(cfg: dict[str, Any], layout: Layout) -> dict[str, Any]:
    """Median seconds of one collective of each kind and payload size (float32 buffers), over
    every node: the ``jax.distributed`` mesh of one device per node, or under the ``mpi`` layout
    (one rank per node) its ``MpiComm``."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import optaxdist

    if cfg["layout"] == "mpi":
        comm = layout.hierarchy.world
        n = comm.size
        compiled = jax.jit
        argument = lambda local: jax.numpy.asarray(local[0])  # noqa: E731
    else:
        mesh = layout.hierarchy.mesh
        comm, n, spec = optaxdist.AxisComm(mesh.axis_names), mesh.size, P(mesh.axis_names)

        def compiled(op):
            return jax.jit(jax.shard_map(lambda x: op(x[0])[None], mesh=mesh, in_specs=spec, out_specs=spec))

        def argument(local):
            return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local)

    ring = [(i, (i + 1) % n) for i in range(n)]
    ops = {
        "all_reduce": lambda x: comm.psum(x),
        "all_gather": lambda x: comm.all_gather(x).reshape(-1)[: x.size],
        "permute": lambda x: comm.permute(x, ring),
    }
    out: dict[str, Any] = {}
    for kind, op in ops.items():
        fn = compiled(op)
        rows = []
        for size in cfg["calibration_bytes"][kind]:
            local = np.ones((1, max(size // 4, 1)), np.float32)
            x = argument(local)
            for _ in range(2):
                jax.block_until_ready(fn(x))
            times = []
            for _ in range(cfg["calibration_repeats"]):
                t = time.perf_counter()
                jax.block_until_ready(fn(x))
                times.append(time.perf_counter() - t)
            rows.append([local.nbytes, statistics.median(times)])
        out[kind] = rows
    return out


def run_row(cfg: dict[str, Any], name: str, data: Any, layout: Layout, alone: Layout) -> dict[str, Any]:
    """Compute-only timing on this process alone, then the timed steps on the whole mesh."""
    import jax

    import optaxdist
    from optaxdist.bench.algorithms import ALGORITHMS, BenchContext, local_optimizer
    from optaxdist.bench.data import make_shards
    from optaxdist.bench.models import MLP, cross_entropy, init_params

    model = MLP(tuple(cfg["hidden"]), data.num_classes)
    params0 = init_params(model, data.x_train.shape[1], seed=cfg["seed"])
    algo = ALGORITHMS[name]
    batch = cfg["batch_size"]

    def build(h):
        ctx = BenchContext(h.num_nodes * h.local_size, h, cfg["steps"], cfg["lr"])
        tx = algo.make(h.world, local_optimizer(cfg["lr"], cfg["momentum"]), ctx)

        def replica_step(params, opt_state, x, y, key):
            key, draw = jax.random.split(key)
            idx = jax.random.randint(draw, (batch,), 0, x.shape[0])
            loss, grads = jax.value_and_grad(lambda p: cross_entropy(model, p, x[idx], y[idx]))(params)
            updates, opt_state = tx.update(grads, opt_state, params, value=loss)
            return optaxdist.apply_updates(params, updates, opt_state), opt_state, key, loss

        return tx, replica_step

    def inputs(layout, tx, replicas):
        """The step's arguments for ``replicas`` (world indices), stacked, placed for ``layout``."""
        shards = make_shards(data.y_train, cfg["replicas"], "iid", seed=cfg["seed"])[list(replicas)]
        state0 = tx.init(params0)
        rows = (
            jax.tree.map(lambda a: np.stack([np.asarray(a)] * len(replicas)), params0),
            jax.tree.map(lambda a: np.stack([np.asarray(a)] * len(replicas)), state0),
            data.x_train[shards],
            data.y_train[shards],
            np.stack(
                [np.asarray(jax.random.key_data(jax.random.key(cfg["seed"] + 1 + r))) for r in replicas]
            ),
        )
        return layout.place(rows)

    def timed(step, args, count, layout=layout):
        params, state, x, y, key = args
        times, losses = [], []
        for _ in range(count):
            t = time.perf_counter()
            params, state, key, loss = step(params, state, x, y, key)
            # the mean over this process's replicas (every process holds as many): the suite's mean
            # over processes is then the mean over all replicas, on every layout
            loss = _local_mean(loss)  # waits for the step
            times.append(time.perf_counter() - t)
            losses.append(loss)
        return (params, state, x, y, key), times, losses

    # compute-only: the same step, one replica alone (a group of one sends nothing)
    tx1, step1 = build(alone.hierarchy)
    args = inputs(alone, tx1, layout.replicas[:1])
    solo = alone.harness(_with_raw_key(step1))
    args, _, _ = timed(solo, args, cfg["warmup"], alone)
    _, compute_times, _ = timed(solo, args, cfg["compute_steps"], alone)

    tx, step = build(layout.hierarchy)
    fn = layout.harness(_with_raw_key(step))
    args = inputs(layout, tx, layout.replicas)
    t = time.perf_counter()
    args, _, _ = timed(fn, args, cfg["warmup"])
    warmup_s = time.perf_counter() - t
    ledger0 = _ledger(layout.mine(args[1]))
    state0 = args[1]
    counters0 = _interface_bytes()
    args, times, losses = timed(fn, args, cfg["steps"])
    counters1 = _interface_bytes()
    ledger1 = _ledger(layout.mine(args[1]))
    for k, totals in ledger1.items():
        totals["collectives"] -= ledger0[k]["collectives"]
        totals["bytes"] -= ledger0[k]["bytes"]
    levels = {}
    if cfg["layout"] == "node":  # what each level ran for the world's collectives (NodeComm)
        levels0 = _ledger(layout.mine(state0), layout.hierarchy.world)
        levels = _ledger(layout.mine(args[1]), layout.hierarchy.world)
        for k, totals in levels.items():
            totals["collectives"] -= levels0[k]["collectives"]
            totals["bytes"] -= levels0[k]["bytes"]
    return {
        **({"levels": levels} if levels else {}),
        "compute_s": compute_times,
        "warmup_s": warmup_s,
        "step_s": times,
        "loss": losses,
        "tx_bytes": counters1[0] - counters0[0],
        "rx_bytes": counters1[1] - counters0[1],
        "ledger": ledger1,
    }


def _with_raw_key(step):
    """Keys travel as raw uint32 data (global arrays of typed keys are awkward to build)."""
    import jax

    def wrapped(params, state, x, y, key):
        params, state, new_key, loss = step(params, state, x, y, jax.random.wrap_key_data(key))
        return params, state, jax.random.key_data(new_key), loss

    return wrapped


def main(config_path: str, process_id: int) -> None:
    with open(config_path) as f:
        cfg = json.load(f)
    import optaxdist

    if cfg["layout"] == "distributed":
        interface = "eth0" if os.path.exists("/sys/class/net/eth0") and not cfg["loopback"] else None
        optaxdist.initialize_multihost(cfg["coordinator"], cfg["nodes"], process_id, gloo_interface=interface)
    else:
        from mpi4py import MPI

        process_id = MPI.COMM_WORLD.Get_rank()
    import jax

    from optaxdist.bench.data import load_dataset

    layout, alone = make_layout(cfg, process_id), _alone()
    data = load_dataset(cfg["dataset"], seed=cfg["seed"])
    node = process_id // (cfg["devices_per_node"] if cfg["layout"] == "mpi" else 1)  # node: a rank each
    record: dict[str, Any] = {"process": process_id, "node": node, "rows": {}}
    if cfg["calibration_bytes"]:
        record["calibration"] = calibrate(cfg, layout)
    for name in cfg["rows"]:
        record["rows"][name] = run_row(cfg, name, data, layout, alone)
        if process_id == 0:
            r = record["rows"][name]
            step_ms = statistics.median(r["step_s"]) * 1e3
            compute_ms = statistics.median(r["compute_s"]) * 1e3
            mb = r["tx_bytes"] / len(r["step_s"]) / 1e6
            print(
                f"  {name:<18} step {step_ms:8.1f} ms  compute {compute_ms:7.1f} ms  "
                f"node sent {mb:8.3f} MB/step  loss {r['loss'][-1]:.4f}",
                file=sys.stderr,
                flush=True,
            )
    with open(os.path.join(cfg["out"], f"process{process_id}.json"), "w") as f:
        json.dump(record, f)
    if cfg["layout"] == "distributed":
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
