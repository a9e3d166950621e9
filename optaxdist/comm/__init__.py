"""Communicators: the only code in optaxdist that moves bytes between replicas."""

from optaxdist.comm.axis import AxisComm
from optaxdist.comm.base import Communicator
from optaxdist.comm.hierarchy import Hierarchy, axis_hierarchy, mesh_hierarchy, mpi_hierarchy
from optaxdist.comm.mpi import MpiComm
from optaxdist.comm.solo import SoloComm

__all__ = [
    "AxisComm",
    "Communicator",
    "Hierarchy",
    "MpiComm",
    "SoloComm",
    "axis_hierarchy",
    "mesh_hierarchy",
    "mpi_hierarchy",
]
