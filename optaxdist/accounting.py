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

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from optaxdist.comm.base import Communicator

PyTree = Any


class Payload(int):
    """The bytes of one event, an ``int``, that also know the buffers they are sent as:
    ``buffers = ((elements, itemsize), ...)``, one per leaf. A communicator that pads each buffer
    (``NodeComm``) counts its padding from them (``Communicator.by_level``).

    ``Payload(b) + Payload(c)`` lists the buffers of both; with a plain ``int`` it is an ``int``.
    Comparison, hashing and printing are the ``int``'s.
    """

    buffers: tuple[tuple[int, int], ...]

    def __new__(cls, buffers: Iterable[tuple[int, int]]):
        buffers = tuple((int(n), int(b)) for n, b in buffers)
        self = super().__new__(cls, sum(n * b for n, b in buffers))
        self.buffers = buffers
        return self

    def __add__(self, other: Any) -> Any:
        if isinstance(other, Payload):
            return Payload(self.buffers + other.buffers)
        return int(self) + other

    def __reduce__(self):
        return Payload, (self.buffers,)


def payload_bytes(tree: PyTree, dtype: Any = None) -> Payload:
    """Static size in bytes of ``tree`` (arrays or ShapeDtypeStructs) sent as ``dtype``: a
    ``Payload``, whose ``buffers`` are the leaves' ``(elements, itemsize)``.

    ``dtype`` replaces the dtype of floating-point leaves (the communication dtype); integer and
    boolean leaves keep their own.
    """
    buffers = []
    for leaf in jax.tree.leaves(tree):
        dt = jnp.dtype(leaf.dtype)
        if dtype is not None and jnp.issubdtype(dt, jnp.floating):
            dt = jnp.dtype(dtype)
        buffers.append((int(np.prod(leaf.shape, dtype=np.int64)), dt.itemsize))
    return Payload(buffers)


def dtype_label(tree: PyTree, dtype: Any = None) -> str:
    """The dtype part of a ledger kind: ``dtype``'s name, or the sorted names of the leaves'
    dtypes joined by ``+`` (``"bfloat16+float32"``)."""
    if dtype is not None:
        return jnp.dtype(dtype).name
    return "+".join(sorted({jnp.dtype(x.dtype).name for x in jax.tree.leaves(tree)})) or "none"


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "permute")
SCOPES = ("world", "local", "cross", "model")


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
        one node, ``local_comm``), ``"cross"`` (one replica per node, ``cross_comm``) or
        ``"model"`` (between the devices of one replica, over its model axes: what an algorithm
        adds to the model's own FSDP / tensor-parallel traffic, e.g. sharded PowerSGD's products).
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


class LevelEvent(NamedTuple):
    """One collective a member runs at one level of a group (``Communicator.by_level``).

    Attributes:
      scope: the level: ``"world"`` (the group as one level), ``"local"`` (inside a node) or
        ``"cross"`` (between nodes), as in ``Kind.scope``.
      collective: one of ``COLLECTIVES``.
      payload: the bytes the member hands to it (the ledger's payload convention).
    """

    scope: str
    collective: str
    payload: int


def kind_name(
    collective: str, tree: PyTree, dtype: Any = None, *, label: str | None = None, scope: str = "world"
) -> Kind:
    """The ledger ``Kind`` of sending ``tree`` (as ``dtype``) with ``collective``."""
    return Kind(collective, dtype_label(tree, dtype), label=label, scope=scope)


@jax.tree_util.register_pytree_node_class
class CommLedger:
    """Per-kind event counters (dynamic, int32) with the static payload of one event of each kind.

    Create it in ``init`` with ``CommLedger.create({Kind("all_reduce", "float32"): nbytes, ...})``
    (``nbytes``: best a ``payload_bytes``, which also lists the leaves sent) and call
    ``record(kind)`` each time the transform calls the communicator with that payload.
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
            tuple(p if isinstance(p, Payload) else int(p) for p in (payloads[k] for k in kinds)),
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
    """What one replica has sent: totals per kind of collective, and overall.

    The keys of ``by_kind`` are ``Kind`` strings (they carry their parts).
    """

    by_kind: dict[str, KindTotals]

    @property
    def collectives(self) -> int:
        return sum(t.collectives for t in self.by_kind.values())

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.by_kind.values())

    @property
    def by_scope(self) -> dict[str, KindTotals]:
        """Totals per group of the kinds (``Kind.scope``): ``"world"``, ``"local"`` (inside a node),
        ``"cross"`` (between nodes). With ``comm_stats(..., levels=hierarchy.world)``, what one
        replica sent across nodes is ``by_scope["cross"]``."""
        out: dict[str, KindTotals] = {}
        for kind, t in self.by_kind.items():
            c, b = out.get(kind.scope, (0, 0))
            out[kind.scope] = KindTotals(c + t.collectives, b + t.bytes)
        return out


def comm_stats(state: PyTree, *, replica: int | None = None, levels: Communicator | None = None) -> CommStats:
    """Totals of collectives and payload bytes sent by one replica, read from any optimizer state.

    Args:
      state: an optimizer state, nested at any depth (``optax.chain``, wrappers, ...), or a stack of
        per-replica states as returned by ``simulate``/``on_mesh`` (leading replica axes).
      replica: for stacked states, which replica to read. By default the counters must agree on all
        replicas (they do for every optaxdist transform) and that common value is returned.
      levels: the communicator the transforms' world-scoped events ran on (their ``comm=``, e.g.
        ``hierarchy.world``). Each such event is counted as the collectives that communicator runs
        for it at each level (``Communicator.by_level``): for ``NodeComm`` an all-reduce of ``S``
        bytes becomes ``local:<label>/reduce_scatter`` of ``G·B``, ``cross:<label>`` (an
        all-reduce) of ``B`` and ``local:<label>/all_gather`` of ``B``, ``B = Σ ⌈n/G⌉·itemsize``
        over the leaves (each padded to a multiple of the ``G`` devices of a node). Events of
        other scopes are at their level already, and permutations stay as recorded (their split
        depends on the permutation, which the ledger does not keep: ``by_level`` gives it). A
        payload given as a plain ``int`` counts as one buffer (of the dtype its kind names, or of
        bytes); ``payload_bytes`` lists the leaves.

    Returns:
      ``CommStats`` with ``by_kind[kind] = (collectives, bytes)`` and ``.collectives`` / ``.bytes``
      summed over kinds (``.by_scope``: per group). Python integers: exact for any run length.
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
            for level_kind, level_payload in _at_levels(kind, payload, levels):
                acc = totals.setdefault(level_kind, [0, 0])
                acc[0] += n
                acc[1] += n * level_payload
    return CommStats({k: KindTotals(c, b) for k, (c, b) in totals.items()})


def _at_levels(kind: Kind, payload: int, levels: Communicator | None) -> list[tuple[Kind, int]]:
    """One event of ``kind`` as the kinds and payloads of the collectives ``levels`` runs for it."""
    if levels is None or kind.scope != "world" or kind.collective == "permute":
        return [(kind, payload)]
    out = []
    for e in levels.by_level(kind.collective, _buffers(kind, payload)):
        label = kind.label if e.collective == kind.collective else f"{kind.label}/{e.collective}"
        out.append((Kind(e.collective, kind.payload, label=label, scope=e.scope), e.payload))
    return out


def _buffers(kind: Kind, payload: int) -> tuple[tuple[int, int], ...]:
    if isinstance(payload, Payload):
        return payload.buffers
    try:
        itemsize = jnp.dtype(kind.payload).itemsize
    except TypeError:  # the kind names no dtype ("config digest")
        itemsize = 1
    return ((payload // itemsize, itemsize),)


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
