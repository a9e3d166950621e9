"""Data-parallel SGD on a mesh spanning several processes ("hosts") under ``jax.distributed``.

Run without arguments to spawn 2 local processes on 127.0.0.1 (CPU collectives over gloo):

    python examples/multihost_allreduce.py

or start every process yourself, one per host (same coordinator address everywhere):

    python examples/multihost_allreduce.py --process-id 0 --num-processes 2 --coordinator HOST0:12355
    python examples/multihost_allreduce.py --process-id 1 --num-processes 2 --coordinator HOST0:12355

Each process owns ``--local-devices`` CPU devices (forced with XLA_FLAGS; on a GPU cluster the
real local devices are used instead). The mesh is ``('node', 'local')``: one node per process.
"""

import argparse
import os
import socket
import subprocess
import sys


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--process-id", type=int, default=None)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--coordinator", default=None, help="host:port of process 0")
    ap.add_argument("--local-devices", type=int, default=2, help="CPU devices per process")
    ap.add_argument("--steps", type=int, default=50)
    return ap.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args) -> int:
    """Launch ``num_processes`` copies of this script on this machine and wait for all of them."""
    coordinator = args.coordinator or f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--process-id",
                str(i),
                "--num-processes",
                str(args.num_processes),
                "--coordinator",
                coordinator,
                "--local-devices",
                str(args.local_devices),
                "--steps",
                str(args.steps),
            ]
        )
        for i in range(args.num_processes)
    ]
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # jax.distributed catches SIGTERM; SIGKILL always works
    return max(codes)


def train(args) -> None:
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.local_devices}")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import optaxdist

    # Before any other JAX call: connect to the coordinator, enable gloo CPU collectives.
    optaxdist.initialize_multihost(args.coordinator, args.num_processes, args.process_id)
    local = jax.local_device_count()
    h = optaxdist.mesh_hierarchy(args.num_processes, local)  # one node per process
    comm = h.world  # AxisComm(("node", "local")): every device of every process
    tx = optax.chain(optaxdist.allreduce(comm=comm), optax.sgd(learning_rate=0.1))

    def loss_fn(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    def train_step(w, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(w, x, y)
        updates, opt_state = tx.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, comm.pmean(loss)

    # Every process builds the same global data set and keeps the rows of its own devices.
    n = jax.device_count()
    w_true = np.array([1.0, -2.0, 0.5], np.float32)
    x_all = np.random.default_rng(0).normal(size=(n, 16, 3)).astype(np.float32)
    y_all = x_all @ w_true
    mine = slice(args.process_id * local, (args.process_id + 1) * local)

    def to_global(rows):
        return optaxdist.global_replica_array(rows, h.mesh)

    params = to_global(np.zeros((local, 3), np.float32))
    x, y = to_global(x_all[mine]), to_global(y_all[mine])
    opt_state = optaxdist.on_mesh(tx.init, h.mesh)(params)
    step = optaxdist.on_mesh(train_step, h.mesh)
    for _ in range(args.steps):
        params, opt_state, loss = step(params, opt_state, x, y)  # on CPU devices: one step in flight

    # Global arrays are not fully addressable: read this process's shards.
    my_params = np.asarray(params.addressable_shards[0].data)[0]
    my_loss = float(np.asarray(loss.addressable_shards[0].data)[0])
    my_state = jax.tree.map(lambda a: a.addressable_shards[0].data, opt_state)
    stats = optaxdist.comm_stats(my_state)
    print(
        f"process {args.process_id}/{args.num_processes} ({local} devices): "
        f"loss {my_loss:.3e} params {my_params} sent {stats.collectives} collectives / "
        f"{stats.bytes} B",
        flush=True,
    )
    jax.distributed.shutdown()


def main():
    args = parse_args()
    if args.process_id is None:
        sys.exit(spawn(args))
    if args.coordinator is None:
        sys.exit("--coordinator HOST:PORT is required with --process-id")
    train(args)


if __name__ == "__main__":
    main()
