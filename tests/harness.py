"""The four test harnesses. Each runs a per-replica ``step(*rows)`` on stacked inputs and returns
stacked NumPy outputs, so one test body checks vmap, the 8-device mesh, MPI (one process per
device) and one process per node (MPI between processes of several devices each) alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import optaxdist as od


class VmapHarness:
    name = "vmap"

    def __init__(self, n: int):
        self.n = n
        self.comm = od.AxisComm(od.REPLICA_AXIS)

    def run(self, step: Callable[..., Any], *stacked: Any) -> Any:
        return jax.tree.map(np.asarray, od.simulate(step)(*stacked))

    def run_loop(self, step: Callable[..., Any], carry: tuple, xs: list, **options: Any) -> tuple[Any, Any]:
        """``carry = step(*carry, x)`` for each ``x`` of ``xs``, one compiled call each (a training
        loop); ``options`` go to the harness. Returns the last carry (stacked NumPy) and the
        compiled step."""
        return _loop(od.simulate(step, **options), carry, xs)


class MeshHarness:
    name = "mesh"

    def __init__(self, n: int):
        if jax.device_count() < n:
            raise RuntimeError(f"mesh harness needs {n} devices, have {jax.device_count()}")
        self.n = n
        self.comm = od.AxisComm(od.REPLICA_AXIS)
        self.mesh = jax.make_mesh(
            (n,),
            (od.REPLICA_AXIS,),
            devices=jax.devices()[:n],
            axis_types=(jax.sharding.AxisType.Auto,),
        )

    def run(self, step: Callable[..., Any], *stacked: Any) -> Any:
        return jax.tree.map(np.asarray, od.on_mesh(step, self.mesh)(*stacked))

    def run_loop(self, step: Callable[..., Any], carry: tuple, xs: list, **options: Any) -> tuple[Any, Any]:
        return _loop(od.on_mesh(step, self.mesh, **options), carry, xs)


class MpiHarness:
    """One replica per MPI process: each runs its own row, then the rows are gathered (host side,
    with mpi4py) so every process can compare the full stacked result."""

    name = "mpi"

    def __init__(self):
        self.comm = od.MpiComm()
        self.n = self.comm.size

    def run(self, step: Callable[..., Any], *stacked: Any) -> Any:
        rank = self.comm.rank
        rows = jax.tree.map(lambda x: np.asarray(x)[rank], stacked)
        out = jax.tree.map(np.asarray, od.on_mpi(step)(*rows))
        gathered = self.comm.comm.allgather(out)
        return jax.tree.map(lambda *xs: np.stack(xs), *gathered)

    def run_loop(self, step: Callable[..., Any], carry: tuple, xs: list, **options: Any) -> tuple[Any, Any]:
        rank = self.comm.rank
        row = lambda tree: jax.tree.map(lambda x: np.asarray(x)[rank], tree)  # noqa: E731
        out, compiled = _loop(od.on_mpi(step, **options), row(carry), [row(x) for x in xs])
        gathered = self.comm.comm.allgather(out)
        return jax.tree.map(lambda *xs: np.stack(xs), *gathered), compiled


class NodeHarness:
    """One process per node (``mpirun -n N``, ``G`` CPU devices each): ``node_hierarchy`` and
    ``on_node``. Each process runs its node's rows; the rows of all nodes are gathered host side."""

    name = "node"

    _hierarchy = None  # one per process: each duplicates an MPI communicator per device

    def __init__(self):
        if NodeHarness._hierarchy is None:
            NodeHarness._hierarchy = od.node_hierarchy()
        self.hierarchy = NodeHarness._hierarchy
        self.comm = self.hierarchy.world
        self.n = self.comm.size
        self._mpi = self.hierarchy.cross.mpi_comm

    def run(self, step: Callable[..., Any], *stacked: Any) -> Any:
        g, node = self.hierarchy.local_size, self._mpi.Get_rank()
        rows = jax.tree.map(lambda x: np.asarray(x)[node * g : (node + 1) * g], stacked)
        out = jax.tree.map(np.asarray, od.on_node(step, self.hierarchy)(*rows))
        gathered = self._mpi.allgather(out)
        return jax.tree.map(lambda *xs: np.concatenate(xs), *gathered)

    def run_loop(self, step: Callable[..., Any], carry: tuple, xs: list, **options: Any) -> tuple[Any, Any]:
        g, node = self.hierarchy.local_size, self._mpi.Get_rank()
        rows = lambda tree: jax.tree.map(lambda x: np.asarray(x)[node * g : (node + 1) * g], tree)  # noqa: E731
        out, compiled = _loop(od.on_node(step, self.hierarchy, **options), rows(carry), [rows(x) for x in xs])
        gathered = self._mpi.allgather(out)
        return jax.tree.map(lambda *xs: np.concatenate(xs), *gathered), compiled


def _loop(compiled: Callable[..., Any], carry: tuple, xs: list) -> tuple[Any, Any]:
    for x in xs:
        carry = compiled(*carry, x)
    return jax.tree.map(np.asarray, carry), compiled
