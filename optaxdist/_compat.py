"""Version shims: the one place that knows how JAX releases differ (0.10 on Python 3.11, 0.11+)."""

from __future__ import annotations

from collections.abc import Sequence

import jax

shard_map = jax.shard_map


def manual_axes() -> tuple[str, ...]:
    """Mesh axes that are manual at this point of the trace (the axes of an enclosing shard_map)."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(getattr(mesh, "manual_axes", ()) or ())


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The manual axes over which ``x`` varies (``aval.vma`` in JAX 0.11+, ``aval.mat`` in 0.10)."""
    aval = jax.typeof(x)
    if hasattr(aval, "vma"):
        return frozenset(aval.vma)
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def pcast_varying(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    """Mark ``x`` as varying over ``axes`` (shard_map only; a no-op elsewhere)."""
    axes = tuple(a for a in axes if a in manual_axes())
    if not axes:
        return x
    have = varying_axes(x)
    missing = tuple(a for a in axes if a not in have)
    if not missing:
        return x
    return jax.lax.pcast(x, missing, to="varying")


def all_gather_invariant(x: jax.Array, axis_name: str) -> jax.Array:
    """``all_gather`` whose result is typed invariant over ``axis_name`` (every member holds the
    same value): public in newer JAX, private in 0.10."""
    gather = getattr(jax.lax, "all_gather_invariant", None)
    if gather is None:
        from jax._src.lax.parallel import all_gather_invariant as gather
    return gather(x, axis_name)


def use_gloo_interface(interface: str) -> None:
    """Make the CPU client's gloo collectives listen on ``interface``: JAX builds them with the
    default (the address of the host's name) and has no option for it, so its factory is wrapped
    before the CPU backend is created."""
    import functools

    from jax._src import xla_bridge

    make = xla_bridge._jax.make_gloo_tcp_collectives
    if isinstance(make, functools.partial):
        make = make.func
    xla_bridge._jax.make_gloo_tcp_collectives = functools.partial(make, interface=interface)
