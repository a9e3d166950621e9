"""Run one unchanged train step as N replicas: simulated (vmap), on a mesh (shard_map), or under MPI."""

from optaxdist.parallel.harness import (
    REPLICA_AXIS,
    assert_replicas_identical,
    broadcast_from_root,
    on_mesh,
    on_mpi,
    on_node,
    replicas_identical,
    replicate,
    simulate,
)
from optaxdist.parallel.multihost import global_replica_array, initialize_multihost

__all__ = [
    "REPLICA_AXIS",
    "assert_replicas_identical",
    "broadcast_from_root",
    "global_replica_array",
    "initialize_multihost",
    "on_mesh",
    "on_mpi",
    "on_node",
    "replicas_identical",
    "replicate",
    "simulate",
]
