"""Model sharding inside a replica: which dimensions of each parameter are split over which model
axes (FSDP, tensor parallelism), and running a function on each device's own shard.

``on_mesh(step, mesh, axis_name="replica")`` leaves every other mesh axis to the compiler, which
keeps elementwise work (an all-reduce, an outer optimizer, an anchor) sharded by itself. A
compressor is not elementwise: a top-k over a flattened leaf needs the whole leaf, so the compiler
gathers it over the model axes on every device. ``ModelSharding`` tells a transform how the
parameters are split, and ``on_shards`` runs its compression on each device's own block (a nested
``jax.shard_map`` over the model axes on a mesh; the same blocks under ``jax.vmap`` with the model
axes' names elsewhere, so ``simulate`` computes the numbers of the mesh).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optaxdist._compat import manual_axes
from optaxdist._validate import is_int

PyTree = Any


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _dim_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes one entry of a ``PartitionSpec`` splits its dimension over (major first)."""
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class ModelSharding:
    """How each parameter leaf of one replica is split over the model axes.

    Attributes:
      specs: a pytree with the parameters' structure, one ``PartitionSpec`` per leaf naming model
        axes only (``P(None, "model")``: columns split over ``"model"``; ``P()``: replicated). The
        replica axes never appear here: they are the stacked leading axis of ``on_mesh``.
      axis_sizes: ``((name, size), ...)`` of every model axis of the mesh, in mesh order; each
        device of a replica holds one block of every leaf.

    Build it with ``ModelSharding.from_mesh(mesh, specs, replica_axes)``.
    """

    specs: PyTree
    axis_sizes: tuple[tuple[str, int], ...]

    def __post_init__(self):
        try:
            pairs = tuple((n, s) for n, s in self.axis_sizes)
        except (TypeError, ValueError):
            pairs = ()
        if not pairs or not all(isinstance(n, str) and is_int(s) and s >= 1 for n, s in pairs):
            raise ValueError(
                f"axis_sizes={self.axis_sizes!r} must be a non-empty tuple of (model axis name, int size ≥ 1)"
            )
        pairs = tuple((n, int(s)) for n, s in pairs)  # a NumPy size configures as a Python one
        object.__setattr__(self, "axis_sizes", pairs)
        sizes = dict(pairs)
        leaves = jax.tree_util.tree_leaves_with_path(self.specs, is_leaf=lambda x: x is None or _is_spec(x))
        for path, spec in leaves:
            if not _is_spec(spec):
                raise TypeError(
                    f"specs{jax.tree_util.keystr(path)}={spec!r} must be a jax.sharding.PartitionSpec"
                )
            for entry in spec:
                for axis in _dim_axes(entry):
                    if axis not in sizes:
                        raise ValueError(
                            f"specs{jax.tree_util.keystr(path)}={spec} names axis {axis!r}, which is not "
                            f"a model axis; allowed: {tuple(sizes)} (replica axes never appear in specs)"
                        )

    @classmethod
    def from_mesh(cls, mesh: Any, specs: PyTree, replica_axes: str | tuple[str, ...]) -> ModelSharding:
        """The model axes are the mesh axes that are not ``replica_axes`` (those of ``on_mesh``)."""
        replica_axes = (replica_axes,) if isinstance(replica_axes, str) else tuple(replica_axes)
        missing = [a for a in replica_axes if a not in mesh.axis_names]
        if missing:
            raise ValueError(f"replica_axes {missing} are not axes of the mesh {tuple(mesh.axis_names)}")
        sizes = tuple((a, int(mesh.shape[a])) for a in mesh.axis_names if a not in replica_axes)
        if not sizes:
            raise ValueError(
                f"the mesh {dict(mesh.shape)} has no axis besides the replica axes {replica_axes}: "
                "nothing is model-sharded"
            )
        return cls(specs, sizes)

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.axis_sizes)

    @property
    def devices(self) -> int:
        """Devices per replica: each sends its own blocks."""
        return math.prod(s for _, s in self.axis_sizes)

    def local_shape(self, shape: tuple[int, ...], spec: P, where: str = "") -> tuple[int, ...]:
        """The shape of one device's block of a leaf of ``shape`` split as ``spec``."""
        sizes = dict(self.axis_sizes)
        if len(spec) > len(shape):
            raise ValueError(f"specs{where}={spec} has more entries than the leaf's shape {shape}")
        out = list(shape)
        for d, entry in enumerate(spec):
            split = math.prod(sizes[a] for a in _dim_axes(entry))
            if out[d] % split:
                raise ValueError(
                    f"specs{where}={spec}: dimension {d} of the leaf (shape {shape}) is {out[d]}, not "
                    f"divisible by {split} (the size of axes {_dim_axes(entry)})"
                )
            out[d] //= split
        return tuple(out)

    @property
    def structure(self) -> Any:
        """The parameters' tree structure (that of ``specs``)."""
        return jax.tree.structure(self.specs, is_leaf=_is_spec)

    def leaf_specs(self, tree: PyTree) -> list[P]:
        """One ``PartitionSpec`` per leaf of ``tree`` (the parameters, gradients or their shapes),
        in the order of its leaves; checked against ``tree``."""
        return jax.tree.leaves(self.specs_for(tree), is_leaf=_is_spec)

    def specs_for(self, tree: PyTree) -> PyTree:
        """``specs``, checked against ``tree`` (the parameters, gradients or their shapes)."""
        self.blocks(tree)
        return self.specs

    def blocks(self, tree: PyTree, dtype: Any = None) -> PyTree:
        """One device's block of every leaf of ``tree`` (which has the parameters' structure), as
        ``jax.ShapeDtypeStruct`` (in ``dtype`` if given)."""
        if self.structure != jax.tree.structure(tree):
            raise ValueError(
                "ModelSharding.specs must have the structure of the parameters "
                f"({jax.tree.structure(tree)}), got {self.structure}"
            )

        def block(path, spec, x):
            shape = self.local_shape(tuple(jnp.shape(x)), spec, jax.tree_util.keystr(path))
            return jax.ShapeDtypeStruct(shape, x.dtype if dtype is None else dtype)

        return jax.tree_util.tree_map_with_path(block, self.specs, tree, is_leaf=_is_spec)

    def split_axes(self, spec: P) -> tuple[str, ...]:
        """The model axes that split a leaf of ``spec`` (mesh order)."""
        named = {a for entry in spec for a in _dim_axes(entry)}
        return tuple(a for a in self.axes if a in named)

    def matrix_axes(self, spec: P, ndim: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The model axes that split the rows and the columns of a leaf's matrix view (all
        dimensions but the last are rows): rows in mesh order, columns as the spec names them."""
        entries = list(spec) + [None] * (ndim - len(spec))
        rows = {a for e in entries[:-1] for a in _dim_axes(e)}
        return tuple(a for a in self.axes if a in rows), _dim_axes(entries[-1]) if ndim else ()

    def groups(self, tree: PyTree) -> dict[tuple[str, ...], list[int]]:
        """The leaves of ``tree`` (indices into its flattened leaves) by the model axes that split
        them, in order of first appearance."""
        out: dict[tuple[str, ...], list[int]] = {}
        for i, spec in enumerate(self.leaf_specs(tree)):
            out.setdefault(self.split_axes(spec), []).append(i)
        return out

    def block_index(self, axes: tuple[str, ...]) -> jax.Array:
        """This device's block number over ``axes`` (row-major); only inside ``on_shards``."""
        sizes = dict(self.axis_sizes)
        idx = jnp.zeros((), jnp.int32)
        for a in axes:
            idx = idx * sizes[a] + jax.lax.axis_index(a).astype(jnp.int32)
        return idx


def by_split_axes(
    fn: Callable[..., tuple[list[jax.Array], ...]],
    sharding: ModelSharding,
    trees: tuple[PyTree, ...],
    replicated: tuple[Any, ...] = (),
) -> tuple[PyTree, ...]:
    """Apply ``fn`` to each device's blocks, one group of leaves at a time: the leaves of ``trees``
    (each with the parameters' structure) split over the same model axes form a group.

    ``fn(axes, group, *leaf_lists, *replicated)`` takes the group's leaves of each tree as lists
    (``group`` numbers the groups, ``axes`` are the axes that split them, ``()`` for leaves
    replicated over every model axis, which ``fn`` sees whole, without a ``shard_map``) and returns
    one list per tree. A replicated leaf is thus never mixed with blocks that differ between the
    devices of a replica: its result stays the same on all of them.
    """
    specs = sharding.leaf_specs(trees[0])
    flat = [jax.tree.leaves(t) for t in trees]
    out = [list(leaves) for leaves in flat]
    for number, (axes, ix) in enumerate(sharding.groups(trees[0]).items()):
        leaf_lists = tuple([leaves[i] for i in ix] for leaves in flat)
        run = functools.partial(fn, axes, number)
        if axes:
            group_specs = [specs[i] for i in ix]
            run = on_shards(
                run,
                sharding,
                (group_specs,) * len(flat) + (P(),) * len(replicated),
                (group_specs,) * len(flat),
            )
        results = run(*leaf_lists, *replicated)
        for leaves, result in zip(out, results):
            for i, y in zip(ix, result):
                leaves[i] = y
    return tuple(jax.tree.unflatten(jax.tree.structure(t), leaves) for t, leaves in zip(trees, out))


def map_subtrees(
    replace: Callable[[PyTree], PyTree | None], tree: PyTree, leaf: Callable[[Any], Any] = lambda x: x
) -> PyTree:
    """``tree`` with each outermost subtree for which ``replace`` returns a value replaced by it
    (``None``: look inside), and each leaf outside those passed through ``leaf``."""

    def visit(node):
        replaced = replace(node)
        if replaced is not None:
            return replaced
        children, inner = jax.tree.flatten(node, is_leaf=lambda x: x is not node)
        if len(children) == 1 and children[0] is node:
            return leaf(node)
        return jax.tree.unflatten(inner, [visit(c) for c in children])

    return visit(tree)


def same_layout(a: PyTree, b: PyTree) -> bool:
    """Whether ``a`` and ``b`` have the same tree structure and leaf shapes."""
    return jax.tree.structure(a) == jax.tree.structure(b) and [jnp.shape(x) for x in jax.tree.leaves(a)] == [
        jnp.shape(x) for x in jax.tree.leaves(b)
    ]


def on_shards(
    fn: Callable[..., Any],
    sharding: ModelSharding,
    in_specs: tuple[PyTree, ...],
    out_specs: PyTree,
) -> Callable[..., Any]:
    """``fn`` run on each device's block: its arguments split as ``in_specs`` (pytree prefixes of
    ``PartitionSpec`` over the model axes, ``P()`` for replicated values), its results joined as
    ``out_specs``. Inside, the model axes are bound (``jax.lax.psum(x, "model")`` sums over a
    replica's blocks) and collectives over the replica axes work as outside.

    Inside ``on_mesh`` with the model axes left to the compiler this is a nested ``jax.shard_map``
    over the model axes: no data moves between a replica's devices unless ``fn`` asks. Elsewhere
    (``simulate``, one device) the same blocks are cut out and mapped with ``jax.vmap`` under the
    model axes' names, so the results are the mesh's.
    """
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(manual_axes())
    replica_like = [a for a in sharding.axes if a in manual]
    if replica_like:
        raise ValueError(
            f"model axes {replica_like} of the ModelSharding are manual (replica) axes here: run the "
            "step with on_mesh(..., axis_name=<the replica axes only>) so the model axes stay with the "
            "compiler"
        )
    if all(a in mesh.axis_names for a in sharding.axes):
        return jax.shard_map(
            fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(sharding.axes)
        )
    return _on_blocks(fn, sharding, in_specs, out_specs)


def _spec_leaves(specs: PyTree, tree: PyTree) -> list[P]:
    """One spec per leaf of ``tree`` (``specs`` is a prefix of it)."""
    return jax.tree.leaves(jax.tree.broadcast(specs, tree, is_leaf=_is_spec), is_leaf=_is_spec)


def _split(x: jax.Array, spec: P, sizes: Mapping[str, int], axes: tuple[str, ...]) -> jax.Array:
    """``x`` with one leading dimension per model axis that splits it (in ``axes`` order), the
    rest of each split dimension left in place."""
    shape, where = [], {}
    for d, n in enumerate(x.shape):
        names = _dim_axes(spec[d]) if d < len(spec) else ()
        for a in names:
            where[a] = len(shape)
            shape.append(sizes[a])
        shape.append(n // math.prod(sizes[a] for a in names))
    blocks = x.reshape(shape)
    order = [where[a] for a in axes if a in where]
    return jnp.moveaxis(blocks, order, list(range(len(order))))


def _join(x: jax.Array, spec: P, sizes: Mapping[str, int], axes: tuple[str, ...]) -> jax.Array:
    """Inverse of ``_split``: ``x`` has one leading dimension per model axis that splits it."""
    present = [a for a in axes if any(a in _dim_axes(e) for e in spec)]
    block_shape = x.shape[len(present) :]
    shape, where, full = [], {}, []
    for d, n in enumerate(block_shape):
        names = _dim_axes(spec[d]) if d < len(spec) else ()
        for a in names:
            where[a] = len(shape)
            shape.append(sizes[a])
        shape.append(n)
        full.append(n * math.prod(sizes[a] for a in names))
    moved = jnp.moveaxis(x, list(range(len(present))), [where[a] for a in present])
    return moved.reshape(full)


def _on_blocks(fn, sharding: ModelSharding, in_specs, out_specs):
    sizes = dict(sharding.axis_sizes)
    axes = sharding.axes

    def splits(spec: P, a: str) -> bool:
        return any(a in _dim_axes(e) for e in spec)

    def run(*args):
        arg_specs = _spec_leaves(tuple(in_specs), args)
        flat, treedef = jax.tree.flatten(args)
        out_def = []

        def leaf_fn(*leaves):
            out = fn(*jax.tree.unflatten(treedef, list(leaves)))
            out_def.append(jax.tree.structure(out))
            return jax.tree.leaves(out)

        mapped = leaf_fn
        for a in reversed(axes):
            in_axes = tuple(0 if splits(s, a) else None for s in arg_specs)
            mapped = jax.vmap(mapped, in_axes=in_axes, out_axes=0, axis_name=a, axis_size=sizes[a])
        outs = mapped(*[_split(x, s, sizes, axes) for x, s in zip(flat, arg_specs)])
        out_tree = jax.tree.unflatten(out_def[0], outs)
        joined = []
        for y, s in zip(outs, _spec_leaves(out_specs, out_tree)):
            # one leading dimension per model axis; a result not split over an axis is the same
            # on every block of it (as shard_map's out_specs assume): keep block 0
            keep = tuple(slice(None) if splits(s, a) else 0 for a in axes)
            joined.append(_join(y[keep], s, sizes, axes))
        return jax.tree.unflatten(out_def[0], joined)

    return run
