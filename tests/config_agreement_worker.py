"""One process of the configuration-mismatch matrix (started by tests/test_config_agreement.py).

Under ``mpirun -n 2`` (``MpiComm``, ``on_mpi``) or as one of two ``jax.distributed`` processes
(``AxisComm`` over a global mesh, ``on_mesh``). For every case, process 1 builds a configuration
that differs from process 0's in one thing; each process calls the step once, records the error
it raised (or none) and the seconds it took, and writes them to ``<out>/rank<i>.json``.
"""

import json
import os
import sys
import time

BACKEND = sys.argv[1]  # "mpi" or "multihost"
if BACKEND == "multihost":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import optaxdist as od  # noqa: E402
from optaxdist import compress  # noqa: E402
from optaxdist import topology as topo  # noqa: E402


def cases(comm, other: bool, n: int):
    """name -> (transformation, params, expected text of the error); ``other`` on process 1."""

    def pick(a, b):
        return b if other else a

    w = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
    sgd = optax.sgd(0.1)
    yield "same configuration (control)", optax.chain(od.allreduce(comm=comm), optax.adam(1e-3)), w, None
    yield (
        "optax optimizer after allreduce",
        optax.chain(od.allreduce(comm=comm), optax.sgd(pick(0.1, 0.2))),
        w,
        "optimizers the step refers to.tx",
    )
    yield (
        "a rank fails while tracing",
        od.decentralized_sgd(sgd, comm=comm, topology=topo.ring(pick(n, n + 1))),
        w,
        "error while tracing differs",
    )
    yield "local_sgd period", od.local_sgd(sgd, comm=comm, period=pick(2, 3)), w, "local_sgd.period differs"
    yield "diloco period", od.diloco(sgd, comm=comm, period=pick(4, 5)), w, "diloco.period differs"
    yield (
        "allreduce wire dtype",
        optax.chain(od.allreduce(comm=comm, dtype=pick(None, "bfloat16")), sgd),
        w,
        "allreduce.dtype differs",
    )
    yield (
        "local_sgd warm-up",
        od.local_sgd(sgd, comm=comm, period=2, warmup_steps=pick(0, 5)),
        w,
        "local_sgd.warmup_steps differs",
    )
    yield (
        "top_k vs random_k",
        optax.chain(
            od.compressed_allreduce(
                pick(compress.top_k(fraction=0.5), compress.random_k(fraction=0.5)), comm=comm
            ),
            sgd,
        ),
        w,
        "compressed_allreduce.compressor.type differs",
    )
    yield (
        "top_k fraction",
        optax.chain(od.compressed_allreduce(compress.top_k(fraction=pick(0.5, 0.25)), comm=comm), sgd),
        w,
        "compressed_allreduce.compressor.fraction differs",
    )
    yield (
        "random_k seed",
        optax.chain(
            od.compressed_allreduce(compress.random_k(fraction=0.5), comm=comm, seed=pick(0, 1)), sgd
        ),
        w,
        "compressed_allreduce.seed differs",
    )
    yield (
        "powersgd rank",
        optax.chain(od.powersgd(comm=comm, rank=pick(1, 2)), sgd),
        w,
        "powersgd.rank differs",
    )
    yield (
        "powersgd warmup_steps",
        optax.chain(od.powersgd(comm=comm, warmup_steps=pick(10, 20)), sgd),
        w,
        "powersgd.warmup_steps differs",
    )
    yield (
        "op mean vs sum",
        optax.chain(od.allreduce(comm=comm, op=pick("mean", "sum")), sgd),
        w,
        "allreduce.op differs",
    )
    yield (
        "metropolis",
        od.decentralized_sgd(sgd, comm=comm, topology=topo.ring(n), metropolis=pick(False, True)),
        w,
        "decentralized_sgd.metropolis differs",
    )
    hier = od.Hierarchy(comm, od.SoloComm(), comm, n, 1)
    yield (
        "daso steps_per_epoch",
        od.daso(
            sgd, local_comm=hier.local, cross_comm=hier.cross, steps_per_epoch=pick(10, 12), total_epochs=4
        ),
        w,
        "daso.steps_per_epoch differs",
    )
    shapes = {"w": jnp.ones(pick((4, 3), (4, 5))), "b": jnp.zeros((3,))}
    yield (
        "parameter shape",
        optax.chain(od.allreduce(comm=comm), sgd),
        shapes,
        "allreduce.updates.['w'] differs",
    )
    leaves = pick(w, {**w, "extra": jnp.zeros((2,))})
    yield (
        "number of leaves",
        optax.chain(od.allreduce(comm=comm), sgd),
        leaves,
        "allreduce.updates.['extra'] differs",
    )
    chain = pick(
        optax.chain(od.allreduce(comm=comm), sgd),
        optax.chain(od.allreduce(comm=comm), optax.clip(1.0), sgd),
    )
    yield "transforms in the chain", chain, w, "optimizers the step refers to.tx.update_fns differs"
    key = jax.random.key(pick(0, 1))
    init = {"w": jax.random.normal(key, (4, 3)), "b": jnp.zeros((3,))}
    yield (
        "parameter values",
        od.local_sgd(sgd, comm=comm, period=2),
        init,
        "do not start from identical parameters",
    )


def main() -> None:
    out_dir = sys.argv[2]
    if BACKEND == "mpi":
        comm = od.MpiComm()
        rank, n = comm.rank, comm.size

        def harness(step):
            return od.on_mpi(step)

        def initial_state(tx, params):
            return tx.init(params)

        def barrier():
            comm.comm.Barrier()

    else:
        process_id, num_processes, port = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        od.initialize_multihost(f"127.0.0.1:{port}", num_processes, process_id)
        comm = od.AxisComm(od.REPLICA_AXIS)
        rank, n = jax.process_index(), jax.device_count()
        mesh = jax.make_mesh((n,), (od.REPLICA_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))

        def place(tree):  # this process's one row of the global stacked arrays
            return od.global_replica_array(jax.tree.map(lambda x: np.asarray(x)[None], tree), mesh)

        def harness(step):
            mapped = od.on_mesh(step, mesh)
            return lambda p, s, g: mapped(place(p), s, place(g))

        def initial_state(tx, params):
            return od.on_mesh(tx.init, mesh, check_config=False)(place(params))

        def barrier():
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("case")

    results = {}
    wanted = os.environ.get("OPTAXDIST_AGREEMENT_CASES")
    for name, tx, params, expected in cases(comm, rank == 1, n):
        if wanted and name not in wanted.split(","):
            continue
        barrier()
        start = time.perf_counter()

        def step(p, s, g, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        try:
            jax.block_until_ready(harness(step)(params, initial_state(tx, params), params))
            error = None
        except Exception as e:  # the error every process must raise
            error = f"{type(e).__name__}: {e}"
        results[name] = {"error": error, "expected": expected, "seconds": time.perf_counter() - start}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    if BACKEND == "multihost":
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
