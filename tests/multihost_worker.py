"""One process of the 2-process ``jax.distributed`` test (started by tests/test_multihost.py).

Each process owns 2 CPU devices of a 4-device global mesh, runs the allreduce + SGD trajectory of
tests/test_allreduce.py through ``on_mesh`` on global arrays, and saves the rows it owns; then
checks ``split_local_steps`` on the same mesh.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

import optaxdist as od  # noqa: E402


class MultiHostHarness:
    name = "multihost"

    def __init__(self):
        self.n = jax.device_count()
        self.comm = od.AxisComm(od.REPLICA_AXIS)
        self.mesh = jax.make_mesh((self.n,), (od.REPLICA_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
        mine = [i for i, d in enumerate(self.mesh.devices.flat) if d.process_index == jax.process_index()]
        self.rows = np.asarray(mine)

    def run(self, step, *stacked):
        local = jax.tree.map(lambda x: np.asarray(x)[self.rows], stacked)
        args = od.global_replica_array(local, self.mesh)
        out = od.on_mesh(step, self.mesh)(*args)
        self.last_global_output = out
        return jax.tree.map(
            lambda x: np.concatenate(
                [
                    np.asarray(s.data)
                    for s in sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
                ]
            ),
            out,
        )


def check_split_local_steps(harness: MultiHostHarness) -> None:
    """``split_local_steps=True`` on the 2-process mesh: each process picks its program on its
    own, the numbers are the same as without it (bit for bit: no product rounds at these
    learning rates), and the local program ran on the local steps, the synchronization's
    program on the synchronizations."""
    import optax

    outer = optax.sgd(0.5, momentum=0.5, nesterov=True)  # no product rounds in the outer step either
    tx = od.diloco(optax.sgd(0.125, momentum=0.5), comm=harness.comm, period=3, outer=outer)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return od.apply_updates(params, updates, state), state

    def global_rows(full):
        return od.global_replica_array(full[harness.rows], harness.mesh)

    start = np.broadcast_to(np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4), (harness.n, 3, 4))
    grads = [np.random.default_rng(k).normal(size=(harness.n, 3, 4)).astype(np.float32) for k in range(8)]
    finals = []
    for split in (False, True):
        run = od.on_mesh(step, harness.mesh, donate_argnums=(0, 1), split_local_steps=split)
        params = global_rows(start)
        state = od.on_mesh(tx.init, harness.mesh)(params)
        for g in grads:
            params, state = run(params, state, global_rows(g))
        finals.append(np.concatenate([np.asarray(s.data) for s in params.addressable_shards]))
    np.testing.assert_array_equal(finals[1], finals[0])
    assert run.local_calls == 8 - 1 - 2, run.local_calls  # not t = 0 (start check), nor t = 2, 5
    assert run.sync_calls == 2, run.sync_calls  # t = 2, 5: the synchronization's program


def main() -> None:
    process_id, num_processes, port, out_path = sys.argv[1:5]
    od.initialize_multihost(f"127.0.0.1:{port}", int(num_processes), int(process_id))
    import optax

    from tests.test_allreduce import run_trajectory

    harness = MultiHostHarness()
    params, state = run_trajectory(
        harness, lambda c: optax.chain(od.allreduce(comm=c), optax.sgd(0.1, momentum=0.9))
    )
    check_split_local_steps(harness)
    np.savez(
        out_path,
        rows=harness.rows,
        w=params["w"],
        b=params["b"],
        bytes=od.comm_stats(state).bytes,
        n=harness.n,
        # comm_stats straight from the global (multi-process) state, not only from numpy rows
        global_bytes=od.comm_stats(harness.last_global_output[1]).bytes,
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
