"""The communicator interface shared by every backend.

A communicator is a small frozen, hashable object describing a group of replicas. Transforms receive
it as ``comm=`` and call only these methods; every byte that crosses replicas goes through them.

Backends implement primitives on single arrays (``_psum``, ``_all_gather``, ``_permute``,
``_psum_scatter``, ``_all_to_all``, ``index``) plus ``size``; ``_permute`` may get several small
leaves packed into one flat array (``permute``, unless ``_packs_permutes`` says no). Everything
else (trees, communication dtypes, broadcast, agreement) is derived here once, so the backends
cannot disagree about it.
"""

from __future__ import annotations

import abc
import dataclasses
import operator
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np

from optaxdist.accounting import COLLECTIVES, LevelEvent

PyTree = Any
Permutation = Sequence[tuple[int, int]]

COMM_DTYPES = ("float32", "bfloat16", "float16")
NARROW_WIRE_DTYPES = ("bfloat16", "float16")


def canonical_comm_dtype(dtype: Any, *, name: str = "dtype") -> jnp.dtype | None:
    """Validate a communication dtype: None (the leaf's own dtype), float32, bfloat16 or float16."""
    if dtype is None:
        return None
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"{name}={dtype!r} is not a dtype; allowed: None, {COMM_DTYPES}") from e
    if dt.name not in COMM_DTYPES:
        raise ValueError(f"{name}={dtype!r} is not supported; allowed: None, {COMM_DTYPES}")
    return dt


def divides_first(leaf_dtype: Any, wire_dtype: Any) -> bool:
    """Whether a mean sent as ``wire_dtype`` (None: the leaf's own) divides by the group size
    *before* the sum: yes for a 16-bit float on the wire, whose sum of ``W`` values could overflow
    (float16 above 65504) or lose the small terms where the mean would not (PyTorch's
    ``fp16_compress_hook`` and ``bf16_compress_hook`` divide first too)."""
    on_wire = jnp.dtype(leaf_dtype if wire_dtype is None else wire_dtype)
    return jnp.issubdtype(leaf_dtype, jnp.floating) and on_wire.name in NARROW_WIRE_DTYPES


def mean_before_sum(x: jax.Array, wire_dtype: Any, size: int) -> jax.Array:
    """``pmean``'s operand before the sum: divided by ``size`` first when the wire is 16-bit
    (``divides_first``; ``wire_dtype`` None: the leaf's own)."""
    x = jnp.asarray(x)
    return x / jnp.asarray(size, x.dtype) if divides_first(x.dtype, wire_dtype) else x


def mean_after_sum(summed: jax.Array, leaf_dtype: Any, wire_dtype: Any, size: int) -> jax.Array:
    """``pmean``'s result from the sum (back in ``leaf_dtype``) of ``mean_before_sum``'s operands."""
    return summed if divides_first(leaf_dtype, wire_dtype) else summed / jnp.asarray(size, summed.dtype)


def sum_in_member_order(rows: jax.Array) -> jax.Array:
    """``rows[0] + rows[1] + ...`` left to right, 16-bit floats added in float32 and rounded once.

    A loop of adds, not ``jnp.sum(rows, axis=0)``: XLA:CPU reduces over a leading axis some 60×
    slower (39 ms against 0.65 ms for 4 × 466k bfloat16 here), and the fixed order makes every
    backend's result the same bits.
    """
    wide = jnp.float32 if jnp.issubdtype(rows.dtype, jnp.floating) and rows.dtype.itemsize < 4 else rows.dtype
    total = jax.lax.fori_loop(
        1, rows.shape[0], lambda i, acc: acc + rows[i].astype(wide), rows[0].astype(wide)
    )
    return total.astype(rows.dtype)


def cast_to_wire(x: jax.Array, dtype: jnp.dtype | None) -> jax.Array:
    """``x`` as sent in the wire dtype ``dtype`` (None: its own); integers and bools never cast."""
    if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return x.astype(dtype)


# ``permute`` sends the leaves under PACK_LEAF_BYTES (on the wire) together: each collective has
# a fixed cost (a rendezvous of the device threads on a CPU mesh, a launch and a handshake on a
# GPU, a message under MPI) that small leaves do not amortize. Larger leaves go alone, so packing
# never copies a model's large arrays; a bucket holds at most PACK_BUCKET_BYTES. On the 2-core
# CPU mesh, packing every leaf of the benchmark's MLP into one 390 KiB buffer made D-PSGD's step
# 3.6 times slower under glibc's default malloc (not with glibc keeping its memory); with these
# sizes its step went from 0.99-1.00 to 0.77 of a ring sending each leaf alone (docs/benchmarks.md).
PACK_LEAF_BYTES = 64 << 10
PACK_BUCKET_BYTES = 1 << 20


def _buckets(leaves: Sequence[jax.Array]) -> list[list[int]]:
    """The positions of ``leaves`` in the order they go: the small leaves of one dtype in buckets
    (in order, up to ``PACK_BUCKET_BYTES`` each), every other leaf alone."""
    out: list[list[int]] = []
    open_bucket: dict[Any, tuple[list[int], int]] = {}  # dtype → its last bucket and its bytes
    for i, x in enumerate(leaves):
        nbytes = x.size * x.dtype.itemsize
        if nbytes >= PACK_LEAF_BYTES:
            out.append([i])
            continue
        bucket, filled = open_bucket.get(x.dtype, (None, 0))
        if bucket is None or filled + nbytes > PACK_BUCKET_BYTES:
            bucket, filled = [], 0
            out.append(bucket)
        bucket.append(i)
        open_bucket[x.dtype] = (bucket, filled + nbytes)
    return out


def _send_joined(leaves: Sequence[jax.Array], positions: Sequence[int], send: Any, out: list) -> None:
    """``send`` of the leaves at ``positions`` joined into one flat array; what comes back is cut
    into ``out`` at the same positions, in their leaves' shapes (``send`` keeps elements in place)."""
    arrived = send(jnp.concatenate([leaves[i].reshape(-1) for i in positions]))
    ends = np.cumsum([leaves[i].size for i in positions])
    for i, piece in zip(positions, jnp.split(arrived, ends[:-1])):
        out[i] = piece.reshape(leaves[i].shape)


def _send_packed(leaves: Sequence[jax.Array], send: Any) -> list[jax.Array]:
    """``[send(x) for x in leaves]`` with the leaves of each of ``_buckets`` sent as one flat
    array (``send`` moves its array's elements as they are: a permutation). Bit-exact."""
    out: list[Any] = [None] * len(leaves)
    for bucket in _buckets(leaves):
        if len(bucket) == 1:
            (i,) = bucket
            out[i] = send(leaves[i])
        else:
            _send_joined(leaves, bucket, send, out)
    return out


class Communicator(abc.ABC):
    """A group of replicas that can exchange values (see ``AxisComm`` and ``MpiComm``)."""

    #: whether ``all_to_all`` works (a hierarchical group of several MPI processes has none)
    has_all_to_all: ClassVar[bool] = True

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """Number of members of the group (a static Python int)."""

    @abc.abstractmethod
    def index(self) -> jax.Array:
        """This member's position in the group, 0 ≤ index < size (an int32 scalar)."""

    @abc.abstractmethod
    def _psum(self, x: jax.Array) -> jax.Array: ...

    @abc.abstractmethod
    def _all_gather(self, x: jax.Array) -> jax.Array: ...

    @abc.abstractmethod
    def _permute(self, x: jax.Array, perm: tuple[tuple[int, int], ...]) -> jax.Array: ...

    @abc.abstractmethod
    def _psum_scatter(self, x: jax.Array) -> jax.Array:
        """Sum over members of ``x`` (length ``size·L``), returning this member's block of ``L``."""

    @abc.abstractmethod
    def _all_to_all(self, x: jax.Array) -> jax.Array:
        """Row ``i`` of the result is row ``index()`` of member ``i``'s ``x`` (leading axis ``size``)."""

    def describe(self) -> dict[str, Any]:
        """The group as plain data, the same on every member (for configuration agreement)."""
        fields = dataclasses.fields(self) if dataclasses.is_dataclass(self) else ()
        return {"type": type(self).__name__, **{f.name: repr(getattr(self, f.name)) for f in fields}}

    def varying(self, tree: PyTree) -> PyTree:
        """Mark values as per-replica (shard_map's ``pcast``); the identity for other backends."""
        return tree

    def uniform(self, tree: PyTree) -> PyTree:
        """Replicated values (step counters, schedule state) as values the program treats as the
        same on every member, so that a ``lax.cond`` on them stays a branch.

        Where each member runs its own program (``shard_map``, MPI) a ``cond`` is a branch already:
        the identity, no collective is added. Under ``jax.vmap`` (``simulate``) a ``cond`` whose
        predicate is batched becomes a ``select`` that runs both branches on every step;
        ``AxisComm`` takes the maximum over the vmapped axes instead, which unbatches the value
        (a reduction inside the one device's program, nothing crosses devices). The values must
        already be equal on every member; this only changes how the program sees them. Values
        that differ come out as their maximum over the replicas one program holds (under
        ``simulate`` all of them, elsewhere its own): a flag raised on some replica stays raised,
        which the non-finite guard of the local step relies on.
        """
        return tree

    # ---- derived collectives -------------------------------------------------------------

    def psum(self, tree: PyTree, *, dtype: Any = None) -> PyTree:
        """All-reduce sum. ``dtype`` is the type on the wire; results come back in each leaf's dtype.

        One ``lax.psum`` per leaf: XLA's all-reduce combiner merges them into as few collectives as
        its size threshold allows. Ledgers count one event per call (see ``optaxdist.accounting``).
        """
        dt = canonical_comm_dtype(dtype)
        leaves, treedef = jax.tree.flatten(tree)
        leaves = [jnp.asarray(x) for x in leaves]
        sent = [x.astype(jnp.int32) if x.dtype == jnp.bool_ else cast_to_wire(x, dt) for x in leaves]
        summed: list[Any] = [None] * len(sent)
        by_dtype: dict[jnp.dtype, list[int]] = {}
        for i, x in enumerate(sent):
            if self._sums_in_two_phases(x.dtype):
                by_dtype.setdefault(x.dtype, []).append(i)
            else:
                summed[i] = self._psum(x)
        for ix in by_dtype.values():  # one reduce-scatter + all-gather per dtype: padded once
            _send_joined(sent, ix, self._psum_in_two_phases, summed)
        out = [s > 0 if x.dtype == jnp.bool_ else s.astype(x.dtype) for x, s in zip(leaves, summed)]
        return jax.tree.unflatten(treedef, out)

    def _sums_in_two_phases(self, dtype: jnp.dtype) -> bool:
        """Whether this backend sums ``dtype`` as a reduce-scatter then an all-gather, where its
        all-reduce would not send the dtype as it is (``_psum_in_two_phases``)."""
        return False

    def _psum_in_two_phases(self, x: jax.Array) -> jax.Array:
        """All-reduce as reduce-scatter (``_psum_scatter``) + all-gather (``_gather_sum``) of ``x``
        flattened and padded with zeros to a multiple of ``size``: the bytes of a ring all-reduce,
        ``2(n−1)/n`` of the padded payload sent by each member."""
        flat = x.reshape(-1)
        block = -(-flat.size // self.size)
        mine = self._psum_scatter(jnp.pad(flat, (0, block * self.size - flat.size)))
        return self._gather_sum(mine).reshape(-1)[: flat.size].reshape(x.shape)

    def _gather_sum(self, block: jax.Array) -> jax.Array:
        """Every member's block of a sum, stacked (the all-gather that ends ``_psum_in_two_phases``)."""
        return self._all_gather(block)

    def pmean(self, tree: PyTree, *, dtype: Any = None) -> PyTree:
        """All-reduce mean. With float32 or float64 on the wire: ``psum`` followed by division by
        ``size`` in each leaf's dtype (a division, not a multiplication by ``1/size``, so the result
        is bitwise ``torch``'s ``sum / W``). With a 16-bit float on the wire (``dtype``, or the
        leaf's own): division first, in the leaf's dtype, so the sum stays in range
        (``divides_first``)."""
        for x in jax.tree.leaves(tree):
            if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
                raise TypeError(f"pmean needs floating-point leaves, got {jnp.asarray(x).dtype}")
        dt = canonical_comm_dtype(dtype)
        size = self.size
        summed = self.psum(jax.tree.map(lambda x: mean_before_sum(x, dt, size), tree), dtype=dt)
        return jax.tree.map(lambda x, s: mean_after_sum(s, jnp.asarray(x).dtype, dt, size), tree, summed)

    def psum_scatter(self, x: jax.Array) -> jax.Array:
        """Reduce-scatter of a flat vector whose length is a multiple of ``size``: member ``i`` gets
        block ``i`` (of ``len(x) / size`` elements) of the sum over members."""
        x = jnp.asarray(x)
        if x.ndim != 1 or x.shape[0] % self.size:
            raise ValueError(
                f"psum_scatter needs a flat vector whose length is a multiple of {self.size}, "
                f"got shape {x.shape}"
            )
        return self._psum_scatter(x)

    def all_gather(self, tree: PyTree) -> PyTree:
        """Every member's value stacked on a new leading axis of length ``size``."""
        return jax.tree.map(lambda x: self._all_gather(jnp.asarray(x)), tree)

    def all_to_all(self, tree: PyTree) -> PyTree:
        """Transpose rows across members: every leaf has a leading axis of length ``size``; member
        ``j`` receives row ``j`` of every member's leaf, stacked in member order (row ``i`` from
        member ``i``). Each member sends ``(size − 1)/size`` of its buffer."""
        leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
        for x in leaves:
            if x.ndim == 0 or x.shape[0] != self.size:
                raise ValueError(
                    f"all_to_all needs leaves with a leading axis of {self.size}, got shape {x.shape}"
                )
        return jax.tree.map(lambda x: self._all_to_all(jnp.asarray(x)), tree)

    def permute(self, tree: PyTree, perm: Permutation, *, dtype: Any = None) -> PyTree:
        """Send to the static destinations ``perm = [(src, dst), ...]``; members receiving nothing get
        0. ``dtype`` is the type on the wire; what arrives comes back in each leaf's dtype. Where
        collectives cross devices or processes (``_packs_permutes``), the leaves under
        ``PACK_LEAF_BYTES`` on the wire travel together, one collective per dtype (and per
        ``PACK_BUCKET_BYTES``)."""
        perm = _check_permutation(perm, self.size)
        dt = canonical_comm_dtype(dtype)
        leaves, treedef = jax.tree.flatten(tree)
        leaves = [jnp.asarray(x) for x in leaves]
        wire = [cast_to_wire(x, dt) for x in leaves]
        send = lambda x: self._permute(x, perm)  # noqa: E731
        arrived = _send_packed(wire, send) if self._packs_permutes() else [send(x) for x in wire]
        return jax.tree.unflatten(treedef, [a.astype(x.dtype) for a, x in zip(arrived, leaves)])

    def _packs_permutes(self) -> bool:
        """Whether ``permute`` sends small leaves together: where a collective has a fixed cost."""
        return True

    def broadcast(self, tree: PyTree, root: int | jax.Array = 0) -> PyTree:
        """Member ``root``'s value on every member, bit-exact whatever the others hold (NaN, Inf).

        ``root`` is an int (checked against ``size``), or a traced integer scalar that is the
        same on every member (state: DASO's sending group), clamped into the group as
        ``lax.switch`` clamps its index. Either way one program: a sum of the root's bit
        patterns and the others' zeros. Under ``shard_map`` a traced root's type counts: a root
        that varies over an axis outside the group (state on a two-level mesh) makes the result
        vary over it too, where an int root's result is invariant."""
        root = self._root(root)
        is_root = self.index() == root

        def one(x):
            x = jnp.asarray(x)
            if x.dtype == jnp.bool_:
                return self._psum(jnp.where(is_root, x, False).astype(jnp.int32)) > 0
            if jnp.issubdtype(x.dtype, jnp.floating):
                # Sum bit patterns, not floats: a float sum would flush subnormals and turn -0 to +0.
                bits = as_bits(x)
                summed = self._psum(jnp.where(is_root, bits, jnp.zeros_like(bits)))
                return jax.lax.bitcast_convert_type(summed, x.dtype)
            return self._psum(jnp.where(is_root, x, jnp.zeros_like(x)))

        return jax.tree.map(one, tree)

    def _root(self, root: int | jax.Array) -> int | jax.Array:
        """A broadcast's root: an int in the group (else ``ValueError``; a concrete array too), or a
        traced integer scalar (else ``TypeError``), clamped."""
        if not isinstance(root, jax.core.Tracer):  # a Python or NumPy int, a concrete array
            root = operator.index(root)
            if not 0 <= root < self.size:
                raise ValueError(f"root={root} is out of range for a group of size {self.size}")
            return root
        if jnp.ndim(root) != 0 or not jnp.issubdtype(root.dtype, jnp.integer):
            raise TypeError(f"a traced broadcast root must be an integer scalar, got {jax.typeof(root)}")
        return jnp.clip(root.astype(jnp.int32), 0, self.size - 1)

    def agree(self, pred: jax.Array, *, op: Literal["any", "all"] = "any") -> jax.Array:
        """Make a boolean identical on every member: true if it holds on any (or all) members."""
        if op not in ("any", "all"):
            raise ValueError(f"op={op!r}; allowed: 'any', 'all'")
        votes = self._psum(jnp.asarray(pred, jnp.bool_).astype(jnp.int32))
        return votes > 0 if op == "any" else votes == self.size

    # ---- accounting ----------------------------------------------------------------------

    def by_level(
        self,
        collective: str,
        buffers: Sequence[tuple[int, int]],
        *,
        perm: Permutation | None = None,
        member: int | None = None,
    ) -> tuple[LevelEvent, ...]:
        """What a member hands to the collectives of each level in one call of ``collective`` in
        which every member sends ``buffers``.

        A group of one level (this default) is its own level: one ``LevelEvent("world",
        collective, S)``, ``S = Σ elements·itemsize``, and for a permutation only on a member that
        sends to another. ``NodeComm`` returns the node-local and cross-node collectives it
        composes the call of. ``optaxdist.comm_stats(state, levels=comm)`` reads every world-scoped
        ledger event this way.

        Args:
          collective: one of ``optaxdist.accounting.COLLECTIVES``.
          buffers: ``((elements, itemsize), ...)``, one per leaf as sent (``Payload.buffers``).
          perm: for ``"permute"`` only, and required there: the permutation.
          member: for ``"permute"`` only, and required there: whose sends (they differ by member).

        Returns:
          The member's level events, in the order they run (payloads in bytes).
        """
        if collective not in COLLECTIVES:
            raise ValueError(f"collective={collective!r}; allowed: {COLLECTIVES}")
        if (collective == "permute") != (perm is not None) or (perm is None) != (member is None):
            raise ValueError("give perm= and member= for collective='permute', and only then")
        if perm is not None:
            perm = _check_permutation(perm, self.size)
            if not 0 <= member < self.size:
                raise ValueError(f"member={member} is out of range for a group of size {self.size}")
        return self._by_level(collective, tuple((int(n), int(b)) for n, b in buffers), perm, member)

    def _by_level(
        self,
        collective: str,
        buffers: tuple[tuple[int, int], ...],
        perm: tuple[tuple[int, int], ...] | None,
        member: int | None,
    ) -> tuple[LevelEvent, ...]:
        sends = perm is None or any(s == member != d for s, d in perm)
        return (LevelEvent("world", collective, sum(n * b for n, b in buffers)),) if sends else ()


def refuse_all_to_all(comm: Communicator) -> None:
    """The error of a hierarchical group asked for an all-to-all."""
    raise NotImplementedError(
        f"{type(comm).__name__} has no all-to-all: a hierarchical group cannot run "
        'quantize(exchange="two_phase"); use exchange="all_gather", or a flat group (AxisComm over '
        "the replica axes, MpiComm)"
    )


_SAME_WIDTH_INT = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def as_bits(x: jax.Array) -> jax.Array:
    """A float array's bit patterns (the integer of its width); any other array unchanged."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return jax.lax.bitcast_convert_type(x, _SAME_WIDTH_INT[x.dtype.itemsize])


def _check_permutation(perm: Permutation, size: int) -> tuple[tuple[int, int], ...]:
    pairs = tuple((int(s), int(d)) for s, d in perm)
    srcs = [s for s, _ in pairs]
    dsts = [d for _, d in pairs]
    for s, d in pairs:
        if not (0 <= s < size and 0 <= d < size):
            raise ValueError(f"perm pair {(s, d)} is out of range for a group of size {size}")
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"perm={pairs} must send from and to each member at most once")
    return pairs
