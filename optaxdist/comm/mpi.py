"""``MpiComm``: collectives between MPI processes through mpi4jax (one device per process)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from optaxdist._compat import manual_axes
from optaxdist.comm.base import Communicator, sum_in_member_order


def _mpi():
    try:
        import mpi4jax
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - depends on the installed extras
        raise ImportError(
            "MpiComm needs mpi4py and mpi4jax: pip install 'optaxdist[mpi]' "
            "(set CUDA_PATH=/usr/local/cuda when building mpi4jax on a machine with CUDA)"
        ) from e
    return MPI, mpi4jax


@dataclasses.dataclass(frozen=True, eq=False)
class MpiComm(Communicator):
    """Communicate between the processes of an MPI communicator (default ``COMM_WORLD``).

    Launch one process per device (``mpirun -n 4 python train.py``) and call the update inside a
    plain ``jax.jit``. mpi4jax primitives carry an ordered effect that JAX refuses in computations
    over several devices, so using an ``MpiComm`` inside ``shard_map`` or ``vmap`` raises a clear
    error; for a node of several devices per process use ``node_hierarchy`` and ``on_node``.

    Example (run with ``mpirun -n 2``)::

        comm = MpiComm()
        tx = optax.chain(optaxdist.allreduce(comm=comm), optax.sgd(0.1))
    """

    comm: Any = None

    def __post_init__(self):
        MPI, _ = _mpi()
        if self.comm is None:
            object.__setattr__(self, "comm", MPI.COMM_WORLD)
        if not isinstance(self.comm, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py communicator or None, got {type(self.comm)}")

    @property
    def size(self) -> int:
        return int(self.comm.Get_size())

    @property
    def rank(self) -> int:
        """This process's rank in the communicator (a static Python int)."""
        return int(self.comm.Get_rank())

    def index(self) -> jax.Array:
        return jnp.asarray(self.rank, jnp.int32)

    def describe(self) -> dict[str, Any]:
        return {"type": "MpiComm", "size": self.size}

    def host_allgather(self, data: bytes) -> list[bytes]:
        """Every process's ``data`` (host bytes, any length), outside compiled code: mpi4py's
        ``allgather``, the same collectives on every process whatever the lengths."""
        return [bytes(d) for d in self.comm.allgather(bytes(data))]

    def _check_single_device(self, x: jax.Array) -> None:
        if manual_axes():
            raise RuntimeError(
                "MpiComm was used inside jax.shard_map over a multi-device mesh: mpi4jax needs one "
                "device per MPI process. For one process per node with several devices use "
                "optaxdist.node_hierarchy() and on_node (the node's devices through jax.lax, the "
                "nodes through MPI), or run one process per device."
            )
        if isinstance(x, jax.core.Tracer) and type(x).__name__ == "BatchTracer":
            raise RuntimeError(
                "MpiComm was used inside jax.vmap: MPI collectives run between processes, not "
                "between vmapped replicas. Use AxisComm for simulated replicas."
            )

    def _psum(self, x):
        MPI, mpi4jax = _mpi()
        self._check_single_device(x)
        if self._sums_in_two_phases(x.dtype):
            return self._psum_in_two_phases(x)
        return mpi4jax.allreduce(x, op=MPI.SUM, comm=self.comm)

    def _sums_in_two_phases(self, dtype) -> bool:
        """MPI has no 16-bit float sum: the bits go as an all-to-all (then added in float32,
        rounded once) and an all-gather."""
        return jnp.dtype(dtype) in _HALF_TYPES

    def _all_gather(self, x):
        _, mpi4jax = _mpi()
        self._check_single_device(x)
        return _from_wire(mpi4jax.allgather(_to_wire(x), comm=self.comm), x.dtype)

    def _psum_scatter(self, x):
        _, mpi4jax = _mpi()
        self._check_single_device(x)
        # all-to-all of the blocks moves exactly a reduce-scatter's bytes; then add what arrived
        blocks = x.reshape(self.size, -1)
        received = _from_wire(mpi4jax.alltoall(_to_wire(blocks), comm=self.comm), x.dtype)
        return sum_in_member_order(received)

    def _all_to_all(self, x):
        _, mpi4jax = _mpi()
        self._check_single_device(x)
        return _from_wire(mpi4jax.alltoall(_to_wire(x), comm=self.comm), x.dtype)

    def broadcast(self, tree, root: int | jax.Array = 0):
        _, mpi4jax = _mpi()
        root = self._root(root)
        if isinstance(root, jax.Array):  # MPI_Bcast takes its root as a number: a branch per root
            for x in jax.tree.leaves(tree):
                self._check_single_device(x)  # its clear error before the branches' traces
            branches = [functools.partial(self.broadcast, root=r) for r in range(self.size)]
            return jax.lax.switch(root, branches, tree)

        def one(x):
            x = jnp.asarray(x)
            self._check_single_device(x)
            return _from_wire(mpi4jax.bcast(_to_wire(x), root, comm=self.comm), x.dtype)

        return jax.tree.map(one, tree)

    def _permute(self, x, perm):
        _, mpi4jax = _mpi()
        self._check_single_device(x)
        me = self.rank
        dest = next((d for s, d in perm if s == me), None)
        source = next((s for s, d in perm if d == me), None)
        zeros = jnp.zeros_like(x)
        wire, wire_zeros = _to_wire(x), _to_wire(zeros)
        if dest is not None and source is not None:
            out = mpi4jax.sendrecv(wire, wire_zeros, source, dest, comm=self.comm)
        elif dest is not None:
            mpi4jax.send(wire, dest, comm=self.comm)
            out = wire_zeros
        elif source is not None:
            out = mpi4jax.recv(wire_zeros, source, comm=self.comm)
        else:
            out = wire_zeros
        return _from_wire(out, x.dtype)


# mpi4jax knows no 16-bit float MPI type: such values travel as their uint16 bit patterns.
_HALF_TYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _to_wire(x: jax.Array) -> jax.Array:
    if x.dtype in _HALF_TYPES:
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    return x


def _from_wire(x: jax.Array, dtype) -> jax.Array:
    if dtype in _HALF_TYPES:
        return jax.lax.bitcast_convert_type(x, dtype)
    if dtype == jnp.bool_:
        return x.astype(jnp.bool_)
    return x
