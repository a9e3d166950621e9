"""Checkpoint and resume under ``jax.distributed``: one orbax checkpoint of global arrays.

Run without arguments to spawn 2 local processes on 127.0.0.1 twice: the first job stops after
``--stop-at`` steps (as if its time limit hit), the second resumes from the latest checkpoint and
finishes; it then checks that the result is bit-identical to an uninterrupted run.

    python examples/multihost_checkpoint.py

or start every process yourself, one per host, with a directory all hosts can reach:

    python examples/multihost_checkpoint.py --process-id 0 --num-processes 2 \
        --coordinator HOST0:12355 --directory /shared/ckpt
"""

import argparse
import os
import socket
import subprocess
import sys
import tempfile


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--process-id", type=int, default=None)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--coordinator", default=None, help="host:port of process 0")
    ap.add_argument("--local-devices", type=int, default=2, help="CPU devices per process")
    ap.add_argument("--directory", default=None, help="checkpoint directory (shared by all hosts)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4, help="save every this many steps")
    ap.add_argument("--stop-at", type=int, default=None, help="stop after this step (simulated preemption)")
    return ap.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args, stop_at) -> int:
    coordinator = f"127.0.0.1:{free_port()}"
    common = ["--num-processes", str(args.num_processes), "--coordinator", coordinator]
    common += ["--local-devices", str(args.local_devices), "--directory", args.directory]
    common += ["--steps", str(args.steps), "--every", str(args.every)]
    common += ["--stop-at", str(stop_at)] if stop_at is not None else []
    procs = [
        subprocess.Popen([sys.executable, __file__, "--process-id", str(i), *common])
        for i in range(args.num_processes)
    ]
    try:
        codes = [p.wait(timeout=300) for p in procs]
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
    import orbax.checkpoint as ocp

    import optaxdist as od

    od.initialize_multihost(args.coordinator, args.num_processes, args.process_id)  # before any JAX call
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("replica",), axis_types=(jax.sharding.AxisType.Auto,))
    mine = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()]
    comm = od.AxisComm("replica")
    tx = optax.chain(
        od.compressed_allreduce(od.compress.top_k(fraction=0.5), comm=comm), optax.sgd(0.05, momentum=0.9)
    )

    def train_step(w, opt_state, x, y):
        grads = jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
        updates, opt_state = tx.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), opt_state

    def batch(t):  # the same global data on every process; each keeps its own rows
        x = np.random.default_rng(t).normal(size=(n, 16, 3)).astype(np.float32)
        y = x @ np.array([1.0, -2.0, 0.5], np.float32)
        return od.global_replica_array((x[mine], y[mine]), mesh)

    init = od.on_mesh(lambda p: (p, tx.init(p)), mesh)
    step = od.on_mesh(train_step, mesh)
    params0 = od.global_replica_array(np.zeros((len(mine), 3), np.float32), mesh)

    def run(state, first, last, manager=None):
        for t in range(first, last):
            state = step(*state, *batch(t))  # on CPU devices: one step in flight
            if manager is not None and (t + 1) % args.every == 0:
                od.save_checkpoint(manager, t + 1, state)
        return state

    last = args.steps if args.stop_at is None else args.stop_at
    state = init(params0)
    with ocp.CheckpointManager(args.directory) as manager:  # the same path on every process
        start = manager.latest_step() or 0
        if start:
            state = od.restore_checkpoint(manager, start, like=state)  # shards where `state` has them
        state = run(state, start, last, manager)
        manager.wait_until_finished()
    who = f"process {args.process_id}/{args.num_processes}"
    print(f"{who}: steps {start}..{last}" + (f" (resumed from step {start})" if start else ""), flush=True)

    if start and last == args.steps:  # compare with an uninterrupted run, leaf by leaf, bit for bit
        reference = run(init(params0), 0, args.steps)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(reference)):
            for sa, sb in zip(a.addressable_shards, b.addressable_shards):
                assert np.array_equal(np.asarray(sa.data), np.asarray(sb.data)), "resume is not bit-identical"
        print(f"{who}: bit-identical to the uninterrupted run", flush=True)
    jax.distributed.shutdown()


def main():
    args = parse_args()
    if args.process_id is not None:
        if args.coordinator is None or args.directory is None:
            sys.exit("--coordinator HOST:PORT and --directory are required with --process-id")
        train(args)
        return
    with tempfile.TemporaryDirectory() as directory:
        args.directory = directory
        stop = args.stop_at if args.stop_at is not None else args.steps // 2
        code = spawn(args, stop) or spawn(args, None)  # preempted job, then the resumed one
    sys.exit(code)


if __name__ == "__main__":
    main()
