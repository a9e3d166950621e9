"""Multi-host meshes under ``jax.distributed`` (one process per host)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def initialize_multihost(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    cpu_collectives: str | None = "gloo",
    **kwargs: Any,
) -> None:
    """``jax.distributed.initialize`` with CPU collectives enabled (gloo), for CPU clusters and tests.

    On GPU/TPU clusters the CPU setting is harmless; pass ``cpu_collectives=None`` to leave it.
    Must run before any other JAX call in the process.
    """
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        **kwargs,
    )


def global_replica_array(local_rows: Any, mesh: Mesh, *, axis_name: str | Sequence[str] | None = None) -> Any:
    """Build global stacked arrays from this process's rows (those of its addressable devices).

    ``local_rows`` holds ``jax.local_device_count()`` rows per leaf, for the replicas whose devices
    this process owns, in mesh order. The result can be passed to a function made by ``on_mesh``.
    """
    names = mesh.axis_names if axis_name is None else axis_name
    sharding = NamedSharding(mesh, P(tuple(names) if not isinstance(names, str) else names))
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), local_rows)
