"""Gossip topologies as static data: per-round permutations for ``comm.permute``, mixing matrices,
stochasticity checks, spectral gaps, Metropolis–Hastings weights, and drawings.

Pure Python/NumPy: nothing here traces or communicates. A gossip transform picks round
``t % topology.period`` and issues one ``comm.permute(x, perm)`` per slot of that round (``lax.switch``
over the ``period`` static rounds); see ``optaxdist.topology.base`` for the mixing convention
(``x⁺ = W x``: row ``i`` is what node ``i`` receives).

Example:
  >>> from optaxdist import topology as topo
  >>> t = topo.npeer_dynamic_directed_exponential_graph(8)      # SGP's default graph
  >>> t.period, [t.peers(r, node=0) for r in range(t.period)]
  (3, [([1], [7]), ([2], [6]), ([4], [4])])
  >>> round(t.spectral_gap(), 12)                                # exact averaging after a period
  1.0
"""

from optaxdist.topology.base import Permutation, Round, Topology, uniform_round
from optaxdist.topology.draw import draw
from optaxdist.topology.graphs import (
    complete,
    dynamic_bipartite_exponential_graph,
    dynamic_bipartite_linear_graph,
    dynamic_directed_exponential_graph,
    dynamic_directed_linear_graph,
    exponential,
    from_neighbors,
    npeer_dynamic_directed_exponential_graph,
    ring,
    ring_graph,
    star,
    torus,
)

__all__ = [
    "Permutation",
    "Round",
    "Topology",
    "complete",
    "draw",
    "dynamic_bipartite_exponential_graph",
    "dynamic_bipartite_linear_graph",
    "dynamic_directed_exponential_graph",
    "dynamic_directed_linear_graph",
    "exponential",
    "from_neighbors",
    "npeer_dynamic_directed_exponential_graph",
    "ring",
    "ring_graph",
    "star",
    "torus",
    "uniform_round",
]
