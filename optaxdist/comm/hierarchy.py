"""Two-level groups: replicas inside a node (``local``) and the same local index across nodes (``cross``).

Ranks are node-major, as in Heat, fairscale and SINGA: ``rank = node * local_size + local``.
``local`` is the fast group (NVLink, one host); ``cross`` connects the member with the same local
index on every node (Heat DASO's "MPI group i"); ``world`` is everybody.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from optaxdist._validate import check_int
from optaxdist.comm.axis import AxisComm
from optaxdist.comm.base import Communicator
from optaxdist.comm.cross import DEFAULT_TIMEOUT_S, CrossComm, _Exchange, check_timeout
from optaxdist.comm.cross import _mpi as _mpi4py
from optaxdist.comm.mpi import MpiComm, _mpi
from optaxdist.comm.node import NodeComm

NODE_AXIS = "node"
LOCAL_AXIS = "local"


class Hierarchy(NamedTuple):
    world: Communicator
    local: Communicator
    cross: Communicator
    num_nodes: int
    local_size: int
    mesh: Any = None


def _check_split(world_size: int, local_size: int) -> int:
    local_size = check_int("local_size", local_size, 1)
    if world_size % local_size:
        raise ValueError(
            f"local_size={local_size} does not divide the world size {world_size}: every node "
            "must hold the same number of replicas"
        )
    return world_size // local_size


def axis_hierarchy(num_nodes: int, local_size: int) -> Hierarchy:
    """Communicators over the axes ``('node', 'local')``, for ``simulate(..., shape=(N, G))``."""
    num_nodes, local_size = check_int("num_nodes", num_nodes, 1), check_int("local_size", local_size, 1)
    return Hierarchy(
        world=AxisComm((NODE_AXIS, LOCAL_AXIS)),
        local=AxisComm(LOCAL_AXIS),
        cross=AxisComm(NODE_AXIS),
        num_nodes=num_nodes,
        local_size=local_size,
    )


def mesh_hierarchy(num_nodes: int, local_size: int, *, devices: list[jax.Device] | None = None) -> Hierarchy:
    """A ``('node', 'local')`` device mesh of shape ``(num_nodes, local_size)`` and its communicators.

    With ``jax.distributed`` and the default ``devices`` (all global devices, host-major), each host
    is one node when ``local_size`` equals ``jax.local_device_count()``.
    """
    num_nodes = check_int("num_nodes", num_nodes, 1)
    devices = list(jax.devices() if devices is None else devices)
    nodes = _check_split(len(devices), local_size)
    if nodes != num_nodes:
        raise ValueError(
            f"num_nodes={num_nodes} × local_size={local_size} must equal the number of devices "
            f"({len(devices)})"
        )
    mesh = jax.make_mesh(
        (num_nodes, local_size),
        (NODE_AXIS, LOCAL_AXIS),
        devices=devices,
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )
    return axis_hierarchy(num_nodes, local_size)._replace(mesh=mesh)


def mpi_hierarchy(local_size: int | None = None, *, comm: Any = None) -> Hierarchy:
    """Split an MPI communicator into node-local and cross-node groups (as Heat's DASO does).

    Args:
      local_size: processes per node. By default, the size of the shared-memory group of this
        process (``MPI.COMM_TYPE_SHARED``), which must be the same on every node.
      comm: the mpi4py communicator to split (default ``COMM_WORLD``).
    """
    MPI, _ = _mpi()
    world = MpiComm(comm)
    if local_size is None:
        shared = world.comm.Split_type(MPI.COMM_TYPE_SHARED)
        local_size = int(world.comm.allreduce(shared.Get_size(), op=MPI.MIN))
        if int(world.comm.allreduce(shared.Get_size(), op=MPI.MAX)) != local_size:
            raise ValueError("nodes hold different numbers of processes; pass local_size")
    num_nodes = _check_split(world.size, local_size)
    rank = world.rank
    local = world.comm.Split(color=rank // local_size, key=rank)
    cross = world.comm.Split(color=rank % local_size, key=rank)
    return Hierarchy(world, MpiComm(local), MpiComm(cross), num_nodes, local_size)


def node_hierarchy(
    *, devices: list[jax.Device] | None = None, comm: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Hierarchy:
    """One process per node: ``local`` = this process's devices (``jax.lax`` collectives over the
    mesh axis ``'local'``), ``cross`` = the devices with my local index on every node (MPI),
    ``world`` = both composed (``NodeComm``: local reduce-scatter → cross-node all-reduce of 1/G of
    the data per device, the G devices at once → local all-gather). Run the step with
    ``optaxdist.on_node(step, hierarchy)``.

    Args:
      devices: the node's devices (default: ``jax.local_devices()``); every node must have as many.
      comm: the mpi4py communicator of the nodes, one process each (default ``COMM_WORLD``).
      timeout_s: how long a cross-node exchange waits for the other nodes (seconds, default 300).
        A peer that has not answered by then (a node that skipped a step, ran another program or
        died) ends the job: the exchange writes this rank, the ranks not heard from, the exchange
        and the deadline to stderr, and aborts the MPI job (``MPI_Abort``) so that ``mpirun``
        ends every node instead of hanging.

    Launch one process per node (MPICH ``mpirun -n <nodes> --ppn 1``, Open MPI ``mpirun -n <nodes>
    --map-by ppr:1:node``, ``srun --ntasks-per-node=1``) with
    no ``jax.distributed``: the processes meet only through MPI.
    """
    timeout_s = check_timeout(timeout_s)
    MPI = _mpi4py()
    comm = MPI.COMM_WORLD if comm is None else comm
    devices = list(jax.local_devices() if devices is None else devices)
    local_size = len(devices)
    sizes = comm.allgather(local_size)
    if len(set(sizes)) != 1:
        raise ValueError(
            f"the nodes hold different numbers of devices (by rank: {sizes}); every node must use "
            "the same number (pass devices=)"
        )
    mesh = jax.make_mesh(
        (local_size,), (LOCAL_AXIS,), devices=devices, axis_types=(jax.sharding.AxisType.Auto,)
    )
    cross = CrossComm(_Exchange(comm, local_size, timeout_s=timeout_s), LOCAL_AXIS, local_size)
    return Hierarchy(NodeComm(cross), AxisComm(LOCAL_AXIS), cross, cross.size, local_size, mesh)
