"""Multi-host meshes under ``jax.distributed`` (one process per host)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from optaxdist._compat import use_gloo_interface


def initialize_multihost(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    cpu_collectives: str | None = "gloo",
    gloo_interface: str | None = None,
    **kwargs: Any,
) -> None:
    """``jax.distributed.initialize`` with CPU collectives enabled (gloo), for CPU clusters and tests.

    On GPU/TPU clusters the CPU setting is harmless; pass ``cpu_collectives=None`` to leave it.
    ``gloo_interface`` names the network interface gloo listens on (``"eth0"``); by default gloo
    uses the address the host's name resolves to, which is the loopback where ``/etc/hosts`` says
    so (containers, network namespaces). Must run before any other JAX call in the process.
    """
    if gloo_interface is not None:
        if cpu_collectives != "gloo":
            raise ValueError(f"gloo_interface={gloo_interface!r} needs cpu_collectives='gloo'")
        use_gloo_interface(gloo_interface)
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


def host_allgather(data: bytes) -> list[bytes]:
    """Every process's ``data`` (host bytes, any length) under ``jax.distributed``: the lengths,
    then the bytes padded to the longest, each with ``process_allgather`` (the same collectives, of
    the same shapes, on every process whatever the lengths)."""
    from jax.experimental import multihost_utils

    mine = np.frombuffer(bytes(data), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.asarray([mine.size], np.int32))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: mine.size] = mine
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [row[:n].tobytes() for row, n in zip(rows, lengths)]
