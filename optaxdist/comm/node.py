"""``NodeComm``: every device of every node, as one group — the node's devices through their own
collectives, the nodes through MPI (one process per node, several devices each).

Member ``node * G + l`` is device ``l`` of node ``node`` (node-major, as in ``mpi_hierarchy``).
Each collective is composed from the node-local one (``jax.lax`` over ``local_axis``) and the
cross-node one (``CrossComm``), so that what leaves a node is as small as it can be:

* all-reduce: local reduce-scatter → cross-node all-reduce of ``1/G`` of the data per device, the
  ``G`` devices of a node at once → local all-gather (the bandwidth-optimal hierarchical scheme);
* all-gather: cross-node all-gather of each device's own value → local all-gather;
* reduce-scatter: local reduce-scatter → cross-node reduce-scatter;
* permutation: each message goes through at most one cross-node hop (between the devices with the
  sender's local index) and one local hop, packed greedily into rounds (one for a ring).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optaxdist._compat import all_gather_invariant, manual_axes, pcast_varying
from optaxdist.accounting import LevelEvent
from optaxdist.comm.axis import AxisComm
from optaxdist.comm.base import Communicator, refuse_all_to_all
from optaxdist.comm.cross import CrossComm


@dataclasses.dataclass(frozen=True, eq=False)
class NodeComm(Communicator):
    """All devices of all nodes (``num_nodes × local_size`` members); see the module docstring.

    Built by ``optaxdist.node_hierarchy`` (its ``world``); used inside ``optaxdist.on_node``.
    """

    cross: CrossComm

    @property
    def local(self) -> AxisComm:
        return AxisComm(self.cross.local_axis)

    @property
    def local_size(self) -> int:
        return self.cross.local_size

    @property
    def size(self) -> int:
        return self.cross.size * self.local_size

    def _bound(self) -> None:
        if self.cross.local_axis not in manual_axes():
            raise RuntimeError(
                f"NodeComm runs inside a jax.shard_map over the node's devices (axis "
                f"{self.cross.local_axis!r}): use optaxdist.on_node(step, hierarchy)"
            )

    def index(self) -> jax.Array:
        self._bound()
        return self.cross.index() * self.local_size + jax.lax.axis_index(self.cross.local_axis).astype(
            jnp.int32
        )

    def describe(self) -> dict[str, Any]:
        return {**self.cross.describe(), "type": "NodeComm"}

    def varying(self, tree):
        return jax.tree.map(lambda x: pcast_varying(jnp.asarray(x), (self.cross.local_axis,)), tree)

    def _psum(self, x):
        self._bound()
        flat = x.reshape(-1)
        block = -(-flat.size // self.local_size)
        padded = jnp.pad(flat, (0, block * self.local_size - flat.size))
        mine = self.cross._psum(self.local._psum_scatter(padded))
        return self._gather_node(mine).reshape(-1)[: flat.size].reshape(x.shape)

    def _all_gather(self, x):
        self._bound()
        by_node = self._gather_node(self.cross._all_gather(x))  # [G, N, ...]
        return jnp.swapaxes(by_node, 0, 1).reshape((self.size,) + x.shape)

    def _gather_node(self, x: jax.Array) -> jax.Array:
        # Typed invariant over the local axis, as a psum over replica axes is: every member of the
        # world holds the same result.
        return all_gather_invariant(pcast_varying(x, (self.cross.local_axis,)), self.cross.local_axis)

    def _psum_scatter(self, x):
        self._bound()
        nodes, local = self.cross.size, self.local_size
        by_local = jnp.swapaxes(x.reshape(nodes, local, -1), 0, 1).reshape(-1)  # [G·N·B]
        return self.cross._psum_scatter(self.local._psum_scatter(by_local))

    has_all_to_all = False

    def _all_to_all(self, x):
        refuse_all_to_all(self)

    def _permute(self, x, perm):
        me = self.index()  # checks the axis is bound
        to_myself = tuple(any(s == d == w for s, d in perm) for w in range(self.size))
        out = jnp.where(jnp.asarray(to_myself)[me], x, jnp.zeros_like(x))
        for hop in _route(perm, self.cross.size, self.local_size):
            arrived = x
            if any(hop.cross):
                arrived = self.cross.permute_per_local(x, hop.cross)
                out = jnp.where(jnp.asarray(hop.cross_final)[me], arrived, out)
            if hop.local:
                sent = jnp.where(jnp.asarray(hop.forward)[me], arrived, x)
                got = self.local._permute(sent, hop.local)
                out = jnp.where(jnp.asarray(hop.local_final)[me], got, out)
        return out

    def _by_level(self, collective, buffers, perm, member):
        """With ``N`` nodes of ``G`` devices, ``S = Σ n·b`` over the buffers (``n`` elements of
        ``b`` bytes) and ``B = Σ ⌈n/G⌉·b`` (each buffer padded to a multiple of ``G``):

        * all-reduce, broadcast (``_psum``): local reduce-scatter of ``G·B``, cross all-reduce of
          ``B``, local all-gather of ``B``;
        * all-gather: cross all-gather of ``S``, local all-gather of ``N·S``;
        * reduce-scatter: local reduce-scatter of ``S``, cross reduce-scatter of ``S/G``;
        * permutation, per round of ``_route``: a cross permute of ``S`` where ``member`` sends in
          the cross stage, a local permute of ``S`` where its local index sends in the local stage
          (the devices of that index on every node send, forwarding a message or not).
        """
        if collective == "all_to_all":
            refuse_all_to_all(self)
        nodes, g = self.cross.size, self.local_size
        total = sum(n * b for n, b in buffers)
        if collective == "permute":
            node, local = divmod(member, g)
            out = []
            for hop in _route(perm, nodes, g):
                if any(n == node for n, _ in hop.cross[local]):
                    out.append(LevelEvent("cross", "permute", total))
                if any(i == local for i, _ in hop.local):
                    out.append(LevelEvent("local", "permute", total))
            return tuple(out)
        if collective == "all_gather":
            return (
                LevelEvent("cross", "all_gather", total),
                LevelEvent("local", "all_gather", nodes * total),
            )
        if collective == "reduce_scatter":
            return (
                LevelEvent("local", "reduce_scatter", total),
                LevelEvent("cross", "reduce_scatter", total // g),
            )
        block = sum(-(-n // g) * b for n, b in buffers)
        return (
            LevelEvent("local", "reduce_scatter", g * block),
            LevelEvent("cross", "all_reduce", block),
            LevelEvent("local", "all_gather", block),
        )


class _Round(NamedTuple):
    """One cross-node stage then one local stage (static tables, indexed by member)."""

    cross: tuple[tuple[tuple[int, int], ...], ...]  # per local index: (from node, to node) pairs
    local: tuple[tuple[int, int], ...]  # (from local index, to local index), the same on every node
    forward: tuple[bool, ...]  # the local stage sends what the cross stage brought, not my own
    cross_final: tuple[bool, ...]  # what the cross stage brought is my result
    local_final: tuple[bool, ...]  # what the local stage brought is my result


def _route(perm: tuple[tuple[int, int], ...], nodes: int, local_size: int) -> list[_Round]:
    """Pack the messages of ``perm`` (not those to oneself) into rounds, greedily, in order.
    Message ``(n, i) → (m, k)`` crosses between the devices of local index ``i`` (``n → m``), then
    moves ``i → k`` inside node ``m``; in a round every device sends and receives at most once per
    stage, and the local stage is one permutation of local indices for all nodes (a ``ppermute``
    over the local axis)."""
    world = nodes * local_size
    rounds: list[dict[str, Any]] = []

    def fits(r, src, via, dst, i, k):
        if src // local_size != dst // local_size and (src in r["cross_send"] or via in r["cross_recv"]):
            return False
        if i == k:
            return True
        same_pi = r["pi"].get(i, k) == k and r["pi_inv"].get(k, i) == i
        return same_pi and via not in r["local_send"] and dst not in r["local_recv"]

    for src, dst in perm:
        if src == dst:
            continue
        (n, i), (m, k) = divmod(src, local_size), divmod(dst, local_size)
        via = m * local_size + i  # where the message is between its two hops
        r = next((r for r in rounds if fits(r, src, via, dst, i, k)), None)
        if r is None:
            r = {key: set() for key in ("cross_send", "cross_recv", "local_send", "local_recv")}
            r.update(pi={}, pi_inv={}, cross=[[] for _ in range(local_size)])
            r.update(forward=set(), cross_final=set(), local_final=set())
            rounds.append(r)
        if n != m:
            r["cross_send"].add(src)
            r["cross_recv"].add(via)
            r["cross"][i].append((n, m))
        if i == k:
            r["cross_final"].add(dst)
            continue
        r["pi"][i], r["pi_inv"][k] = k, i
        r["local_send"].add(via)
        r["local_recv"].add(dst)
        r["local_final"].add(dst)
        if n != m:
            r["forward"].add(via)
    return [
        _Round(
            cross=tuple(tuple(pairs) for pairs in r["cross"]),
            local=tuple(sorted(r["pi"].items())),
            forward=tuple(w in r["forward"] for w in range(world)),
            cross_final=tuple(w in r["cross_final"] for w in range(world)),
            local_final=tuple(w in r["local_final"] for w in range(world)),
        )
        for r in rounds
    ]
