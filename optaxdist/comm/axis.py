"""``AxisComm``: collectives over named axes with ``jax.lax`` (vmap, shard_map, multi-host meshes)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from optaxdist._compat import all_gather_invariant, manual_axes, pcast_varying
from optaxdist.comm.base import Communicator, sum_in_member_order


def all_reduce_widens(dtype: Any) -> bool:
    """Whether the default backend's all-reduce between devices runs ``dtype`` wider than it is:
    XLA:CPU runs every collective on bfloat16 in float32, and on 8-bit floats in float16 (float16
    stays float16)."""
    dtype = jnp.dtype(dtype)
    narrow = jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize <= 2 and dtype != jnp.float16
    return narrow and jax.default_backend() == "cpu"


@dataclasses.dataclass(frozen=True)
class AxisComm(Communicator):
    """Communicate over one named axis, or several (major to minor) treated as one flat group.

    Works wherever the axis is bound: ``jax.vmap(..., axis_name=...)`` (simulated replicas on one
    device) and ``jax.shard_map`` over a mesh, including meshes that span several hosts under
    ``jax.distributed``. Member ``index()`` is row-major over the axes, so
    ``AxisComm(("node", "local"))`` numbers replicas ``node * local_size + local``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> comm = AxisComm("replica")
        >>> jax.vmap(lambda x: comm.pmean(x), axis_name="replica")(jnp.arange(4.0))
        Array([1.5, 1.5, 1.5, 1.5], dtype=float32)
    """

    axis_name: str | tuple[str, ...]

    def __post_init__(self):
        names = self.axis_name if isinstance(self.axis_name, tuple) else (self.axis_name,)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"axis_name={self.axis_name!r} must be a non-empty string or a tuple of them")

    @property
    def axes(self) -> tuple[str, ...]:
        return self.axis_name if isinstance(self.axis_name, tuple) else (self.axis_name,)

    def _axis_size(self, name: str) -> int:
        try:
            return int(jax.lax.axis_size(name))
        except NameError as e:
            raise ValueError(
                f"AxisComm axis {name!r} is not bound here: call the update inside "
                f"jax.vmap(..., axis_name={name!r}) or jax.shard_map over a mesh with that axis "
                "(optaxdist.simulate / optaxdist.on_mesh do this for you)"
            ) from e

    @property
    def size(self) -> int:
        return math.prod(self._axis_size(a) for a in self.axes)

    def index(self) -> jax.Array:
        idx = jnp.zeros((), jnp.int32)
        for a in self.axes:
            idx = idx * self._axis_size(a) + jax.lax.axis_index(a).astype(jnp.int32)
        return idx

    def varying(self, tree):
        return jax.tree.map(lambda x: pcast_varying(jnp.asarray(x), self.axes), tree)

    def uniform(self, tree):
        batched = [a for a in self.axes if a not in manual_axes()]
        if not batched:
            return tree

        def one(x):
            x = jnp.asarray(x)
            y = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
            for a in batched:
                self._axis_size(a)  # the clear error when an axis is unbound
                y = jax.lax.pmax(y, a)
            return y.astype(x.dtype)

        return jax.tree.map(one, tree)

    def _on_mesh(self) -> bool:
        return set(self.axes) <= set(manual_axes())

    def _packs_permutes(self) -> bool:
        return self._on_mesh()  # under vmap nothing crosses devices: a permute is an indexing

    def _psum(self, x):
        self.size  # noqa: B018  (raises the clear error when an axis is unbound)
        if self._sums_in_two_phases(x.dtype):
            return self._psum_in_two_phases(x)
        return jax.lax.psum(pcast_varying(x, self.axes), self.axis_name)

    def _sums_in_two_phases(self, dtype) -> bool:
        """Sums the backend would widen go as a reduce-scatter and an all-gather of the bits."""
        return all_reduce_widens(dtype)

    def _narrow_float_psum_scatter(self, x):
        """Member ``i`` sums block ``i`` of every member's ``x`` (an all-to-all of the bits) in
        float32, in member order, rounded once. Under ``vmap`` nothing crosses devices: the same
        sum over the gathered values, so ``simulate`` gives the numbers of the mesh."""
        rows = x.reshape(self.size, -1)
        if self._on_mesh():
            bits = _bits(pcast_varying(rows, self.axes))
            received = _from_bits(jax.lax.all_to_all(bits, self.axis_name, 0, 0), x.dtype)
        else:
            received = self._all_gather(rows)[:, self.index()]
        return sum_in_member_order(received)

    def _gather_sum(self, block):
        if not self._on_mesh():
            return self._all_gather(block)
        # typed invariant over the axes, as a psum is: every member holds the same sum
        bits = _bits(block)
        for a in reversed(self.axes):
            bits = all_gather_invariant(bits, a)
        return _from_bits(bits.reshape((self.size,) + block.shape), block.dtype)

    def _all_gather(self, x):
        self.size  # noqa: B018
        bits = _bits(pcast_varying(x, self.axes))
        # Gather minor axis first: a tuple axis_name is not supported under nested vmap.
        for a in reversed(self.axes):
            bits = jax.lax.all_gather(bits, a)
        return _from_bits(bits.reshape((self.size,) + x.shape), x.dtype)

    def _psum_scatter(self, x):
        size = self.size
        if self._sums_in_two_phases(x.dtype):
            return self._narrow_float_psum_scatter(x)
        if len(self.axes) == 1:
            return jax.lax.psum_scatter(pcast_varying(x, self.axes), self.axis_name, tiled=True)
        # several axes: sum everywhere, keep my block (nested vmap has no multi-axis reduce-scatter)
        block = x.shape[0] // size
        return jax.lax.dynamic_slice(self._psum(x), (self.index() * block,), (block,))

    def _all_to_all(self, x):
        self.size  # noqa: B018
        if len(self.axes) > 1 and not self._on_mesh():
            # nested vmap has no multi-axis all-to-all; nothing crosses devices: pick my column
            return self._all_gather(x)[:, self.index()]
        bits = _bits(pcast_varying(x, self.axes))
        return _from_bits(jax.lax.all_to_all(bits, self.axis_name, 0, 0), x.dtype)

    def _permute(self, x, perm):
        size = self.size
        if self._on_mesh() or (len(self.axes) == 1 and len(perm) == size):
            return _from_bits(
                jax.lax.ppermute(_bits(pcast_varying(x, self.axes)), self.axis_name, perm), x.dtype
            )
        # vmap batches only full permutations over a single axis: simulate the rest with a gather.
        source = [-1] * self.size
        for src, dst in perm:
            source[dst] = src
        src = jnp.asarray(source, jnp.int32)[self.index()]
        received = self._all_gather(x)[jnp.maximum(src, 0)]
        return jnp.where(src >= 0, received, jnp.zeros_like(received))


def _bits(x: jax.Array) -> jax.Array:
    """Narrow floats as unsigned integers of their width, which no backend widens (exact)."""
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize <= 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16 if x.dtype.itemsize == 2 else jnp.uint8)
    return x


def _from_bits(x: jax.Array, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x
