"""Exact accounting of what each replica sends.

Every communicating transform keeps a ``CommLedger`` in its state: one int32 event counter per kind
of collective, and, as static data fixed at ``init`` from the parameter shapes, the payload in
bytes of one event of that kind. Totals are ``count × payload`` computed with Python integers on the
host, so they stay exact for any run length (a float byte counter would not).

Conventions: one *event* is one call to the communicator on a pytree (``comm.psum(grads)``),
whatever number of physical collectives XLA's combiner makes of it. The *payload* of an event is
the size of the buffers this replica hands to it (for an all-reduce of ``S`` bytes, ``S``; what a
ring implementation puts on the wire, ``2(n−1)/n·S``, is the business of the cost model in
``optaxdist.bench.cost``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def payload_bytes(tree: PyTree, dtype: Any = None) -> int:
    """Static size in bytes of ``tree`` (arrays or ShapeDtypeStructs) sent as ``dtype``.

    ``dtype`` replaces the dtype of floating-point leaves (the communication dtype); integer and
    boolean leaves keep their own.
    """
    total = 0
    for leaf in jax.tree.leaves(tree):
        dt = jnp.dtype(leaf.dtype)
        if dtype is not None and jnp.issubdtype(dt, jnp.floating):
            dt = jnp.dtype(dtype)
        total += int(np.prod(leaf.shape, dtype=np.int64)) * dt.itemsize
    return total


def dtype_label(tree: PyTree, dtype: Any = None) -> str:
    """The dtype part of a ledger kind: ``dtype``'s name, or the sorted names of the leaves'
    dtypes joined by ``+`` (``"bfloat16+float32"``)."""
    if dtype is not None:
        return jnp.dtype(dtype).name
    return "+".join(sorted({jnp.dtype(x.dtype).name for x in jax.tree.leaves(tree)})) or "none"


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "permute")
SCOPES = ("world", "local", "cross")


class Kind(str):
    """A ledger kind: which collective, over which group, what payload; the only way to name one.

    It is the string ``"[<scope>:]<label>[<payload>]"`` (``"all_reduce[float32]"``,
    ``"local:param_average[bfloat16]"``), so totals are looked up by that text, and it carries its
    parts as attributes, so code that needs them (the cost model) reads them instead of parsing.

    Attributes:
      collective: one of ``COLLECTIVES``: the communicator call behind the events.
      payload: what is sent: a dtype label (``dtype_label``) or a short description.
      label: the name shown for the events (default: ``collective``), e.g. ``"param_average"``.
      scope: ``"world"`` (all replicas of the transform's ``comm``), ``"local"`` (the replicas of
        one node, ``local_comm``) or ``"cross"`` (one replica per node, ``cross_comm``).
    """

    collective: str
    payload: str
    label: str
    scope: str

    def __new__(cls, collective: str, payload: str, *, label: str | None = None, scope: str = "world"):
        if collective not in COLLECTIVES:
            raise ValueError(f"collective={collective!r}; allowed: {COLLECTIVES}")
        if scope not in SCOPES:
            raise ValueError(f"scope={scope!r}; allowed: {SCOPES}")
        label = label or collective
        self = super().__new__(cls, f"{'' if scope == 'world' else scope + ':'}{label}[{payload}]")
        self.collective, self.payload, self.label, self.scope = collective, payload, label, scope
        return self

    def __reduce__(self):
        return _kind, (self.collective, self.payload, self.label, self.scope)


def _kind(collective: str, payload: str, label: str, scope: str) -> Kind:
    return Kind(collective, payload, label=label, scope=scope)


def kind_name(
    collective: str, tree: PyTree, dtype: Any = None, *, label: str | None = None, scope: str = "world"
) -> Kind:
    """The ledger ``Kind`` of sending ``tree`` (as ``dtype``) with ``collective``."""
    return Kind(collective, dtype_label(tree, dtype), label=label, scope=scope)


@jax.tree_util.register_pytree_node_class
class CommLedger:
    """Per-kind event counters (dynamic, int32) with the static payload of one event of each kind.

    Create it in ``init`` with ``CommLedger.create({Kind("all_reduce", "float32"): nbytes, ...})``
    and call ``record(kind)`` each time the transform calls the communicator with that payload.
    """

    __slots__ = ("counts", "kinds", "payloads")

    def __init__(self, counts: tuple[jax.Array, ...], kinds: tuple[str, ...], payloads: tuple[int, ...]):
        self.counts = tuple(counts)
        self.kinds = tuple(kinds)
        self.payloads = tuple(payloads)

    @classmethod
    def create(cls, payloads: Mapping[Kind, int]) -> CommLedger:
        kinds = tuple(payloads)
        for kind in kinds:
            if not isinstance(kind, Kind):
                raise TypeError(f"ledger kinds are optaxdist.accounting.Kind values, got {kind!r}")
        return cls(
            tuple(jnp.zeros((), jnp.int32) for _ in kinds),
            kinds,
            tuple(int(payloads[k]) for k in kinds),
        )

    def record(self, kind: Kind, times: int | jax.Array = 1) -> CommLedger:
        """Count ``times`` more events of ``kind`` (a kind declared at ``create``)."""
        if kind not in self.kinds:
            raise KeyError(f"kind {kind!r} was not declared; declared kinds: {self.kinds}")
        i = self.kinds.index(kind)
        counts = list(self.counts)
        counts[i] = counts[i] + jnp.asarray(times, jnp.int32)
        return CommLedger(tuple(counts), self.kinds, self.payloads)

    def tree_flatten(self):
        return self.counts, (self.kinds, self.payloads)

    @classmethod
    def tree_unflatten(cls, aux, counts):
        return cls(tuple(counts), *aux)

    def __repr__(self) -> str:
        items = ", ".join(f"{k}: {c} × {b} B" for k, c, b in zip(self.kinds, self.counts, self.payloads))
        return f"CommLedger({items})"


class KindTotals(NamedTuple):
    collectives: int
    bytes: int


class CommStats(NamedTuple):
    """What one replica has sent: totals per kind of collective, and overall."""

    by_kind: dict[str, KindTotals]

    @property
    def collectives(self) -> int:
        return sum(t.collectives for t in self.by_kind.values())

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.by_kind.values())


def comm_stats(state: PyTree, *, replica: int | None = None) -> CommStats:
    """Totals of collectives and payload bytes sent by one replica, read from any optimizer state.

    Args:
      state: an optimizer state, nested at any depth (``optax.chain``, wrappers, ...), or a stack of
        per-replica states as returned by ``simulate``/``on_mesh`` (leading replica axes).
      replica: for stacked states, which replica to read. By default the counters must agree on all
        replicas (they do for every optaxdist transform) and that common value is returned.

    Returns:
      ``CommStats`` with ``by_kind[kind] = (collectives, bytes)`` and ``.collectives`` / ``.bytes``
      summed over kinds. Python integers: exact for any run length.
    """
    totals: dict[str, list[int]] = {}
    ledgers = [
        x
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, CommLedger))
        if isinstance(x, CommLedger)
    ]
    for ledger in ledgers:
        for kind, count, payload in zip(ledger.kinds, ledger.counts, ledger.payloads):
            n = _one_replica(_host_value(count), kind, replica)
            acc = totals.setdefault(kind, [0, 0])
            acc[0] += n
            acc[1] += n * payload
    return CommStats({k: KindTotals(c, b) for k, (c, b) in totals.items()})


def _host_value(x: Any) -> np.ndarray:
    """A counter on the host. For a global array spanning several processes (``jax.distributed``),
    only this process's rows are readable: those are returned (every row holds the same count)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.stack([np.asarray(s.data).reshape(-1) for s in x.addressable_shards]).reshape(-1)
    return np.asarray(x)


def _one_replica(count: np.ndarray, kind: str, replica: int | None) -> int:
    if count.ndim == 0:
        return int(count)
    flat = count.reshape(-1)
    if replica is not None:
        return int(flat[replica])
    if not (flat == flat[0]).all():
        raise ValueError(
            f"replicas disagree on the count of {kind!r} ({flat.tolist()}); pass replica=<index>"
        )
    return int(flat[0])


def per_replica(tree: PyTree, comm: Any) -> PyTree:
    """``comm.varying`` on every leaf but the ledgers (which stay replicated).

    Inside ``shard_map`` the two branches of a ``lax.cond`` must agree on which values vary across
    replicas; transforms mark their per-replica values with this in ``init`` and in every branch.
    Outside ``shard_map`` it is the identity.
    """
    is_ledger = lambda x: isinstance(x, CommLedger)
    return jax.tree.map(lambda x: x if is_ledger(x) else comm.varying(x), tree, is_leaf=is_ledger)


def keep_ledgers(selected: PyTree, latest: PyTree) -> PyTree:
    """``selected`` with every ledger taken from ``latest``: events that happened stay counted even
    when the rest of a state is rolled back (a skipped step still sent its collectives)."""
    is_ledger = lambda x: isinstance(x, CommLedger)
    return jax.tree.map(lambda s, n: n if is_ledger(s) else s, selected, latest, is_leaf=is_ledger)
