"""Communicators: the only code in optaxdist that moves bytes between replicas."""

from optaxdist.comm.axis import AxisComm
from optaxdist.comm.base import Communicator
from optaxdist.comm.cross import CrossComm
from optaxdist.comm.hierarchy import Hierarchy, axis_hierarchy, mesh_hierarchy, mpi_hierarchy, node_hierarchy
from optaxdist.comm.mpi import MpiComm
from optaxdist.comm.node import NodeComm
from optaxdist.comm.solo import SoloComm

__all__ = [
    "AxisComm",
    "Communicator",
    "CrossComm",
    "Hierarchy",
    "MpiComm",
    "NodeComm",
    "SoloComm",
    "axis_hierarchy",
    "mesh_hierarchy",
    "mpi_hierarchy",
    "node_hierarchy",
]
