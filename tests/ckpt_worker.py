"""One process of the multi-process checkpoint tests (started by tests/test_checkpoint.py).

``python -m tests.ckpt_worker mpi <dir> <names>`` under ``mpirun -n 2``: one replica per process
(``MpiComm``), each rank saving its row to its own directory (``rank_directory``).
``python -m tests.ckpt_worker multihost <dir> <names> <process_id> <num_processes> <port>``: one
process of a ``jax.distributed`` run, 2 CPU devices each, global arrays on one mesh, one orbax
checkpoint written by all processes together.

For each transform: the uninterrupted run of 2K steps; then a run of K steps saved at step K; then
a fresh init restored from disk and continued to 2K. Each process writes, to
``<dir>/result<process>.json``, which transforms resumed bit-identically (every leaf of params and
state of its own replicas, ledger counters included).
"""

import json
import os
import sys

MODE = sys.argv[1]
if MODE == "multihost":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402


def steps(run, state, batches):
    for batch in batches:
        state = run(*state, *batch)
        jax.block_until_ready(state)  # as on_mesh does on CPU devices (docs/harnesses.md)
    return state


def resume_check(name, run, init, p0, batches, manager_dir) -> str:
    import orbax.checkpoint as ocp

    import optaxdist as od
    from tests.ckpt_common import K, assert_trees_identical, host

    reference = host(steps(run, init(p0), batches))
    saved = steps(run, init(p0), batches[:K])
    with ocp.CheckpointManager(manager_dir) as manager:
        od.save_checkpoint(manager, K, saved)
        manager.wait_until_finished()
    del saved
    fresh = init(p0)  # a new run: fresh init, then the checkpoint
    with ocp.CheckpointManager(manager_dir) as manager:
        restored = od.restore_checkpoint(manager, None, fresh)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(fresh)):  # restored where fresh lives
        if a.sharding != b.sharding:
            return f"restored with sharding {a.sharding}, fresh state has {b.sharding}"
    try:
        assert_trees_identical(host(steps(run, restored, batches[K:])), reference, f"{name}: ")
    except AssertionError as err:
        return f"differs: {err}"
    return "ok"


def main() -> None:
    directory, names = sys.argv[2], sys.argv[3].split(",")
    if MODE == "multihost":
        import optaxdist as od

        process_id, num_processes, port = (int(a) for a in sys.argv[4:7])
        od.initialize_multihost(f"127.0.0.1:{port}", num_processes, process_id)
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    import optaxdist as od
    from tests.ckpt_common import K, data, make, params_row, step_fn

    if MODE == "mpi":
        comm = od.MpiComm()
        n, me = comm.size, comm.rank
        rows = np.asarray([me])
    else:
        comm = od.AxisComm(od.REPLICA_AXIS)
        n, me = jax.device_count(), jax.process_index()
        mesh = jax.make_mesh((n,), (od.REPLICA_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
        rows = np.asarray([i for i, d in enumerate(mesh.devices.flat) if d.process_index == me])

        def mine(tree):  # this process's rows of a stacked tree, as global arrays
            return od.global_replica_array(jax.tree.map(lambda x: np.asarray(x)[rows], tree), mesh)

    xs, ys = data(n, 2 * K)
    results = {}
    for name in names:
        tx = make(name, comm, n)
        if MODE == "mpi":
            run = od.on_mpi(step_fn(tx))
            init = od.on_mpi(lambda p, tx=tx: (p, tx.init(p)))
            p0 = params_row()
            batches = [(xs[t, me], ys[t, me]) for t in range(2 * K)]
            manager_dir = od.rank_directory(os.path.join(directory, name), comm=comm)
        else:
            run = od.on_mesh(step_fn(tx), mesh)
            init = od.on_mesh(lambda p, tx=tx: (p, tx.init(p)), mesh)
            p0 = mine(od.replicate(params_row(), n))
            batches = [mine((xs[t], ys[t])) for t in range(2 * K)]
            manager_dir = os.path.join(directory, name)
        results[name] = resume_check(name, run, init, p0, batches, manager_dir)
    with open(os.path.join(directory, f"result{me}.json"), "w") as f:
        json.dump({"rows": rows.tolist(), "results": results}, f)
    if MODE == "multihost":
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
