"""Version shims: the one place that knows how JAX releases differ (0.10 on Python 3.11, 0.11+)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np

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


def host_callback(callback, result_shape_dtypes, *args):
    """``jax.pure_callback(callback, result_shape_dtypes, *args, vmap_method="sequential")``, but
    ``callback`` gets the NumPy operands the runtime hands over as they are.

    ``jax.pure_callback`` first puts its operands on CPU device 0 (``jax.device_put``). Inside a
    program over several CPU devices, device 0 is itself busy running its part of that program, and
    a copy above ~100 KB waits behind it: with every device's callback blocked until a cross-node
    peer answers, the node deadlocks (measured: 2 CPU devices, 400 KB per device, JAX 0.10). This
    primitive has ``pure_callback``'s rules (abstract evaluation, no differentiation, sequential
    ``vmap``, per-device sharding inside ``shard_map``) and lowers to the same host callback,
    without that copy. Falls back to ``jax.pure_callback`` where JAX's internals differ."""
    prim = _numpy_callback_primitive()
    if prim is None:
        return jax.pure_callback(callback, result_shape_dtypes, *args, vmap_method="sequential")
    return _bind(prim, callback, result_shape_dtypes, *args)


def _bind(prim, callback, result_shape_dtypes, *args):
    """``prim`` applied to ``args`` with ``pure_callback``'s parameters."""
    from jax._src import callback as cb

    flat_args, in_tree = jax.tree.flatten((args, {}))
    result_avals = jax.tree.map(lambda x: jax.core.ShapedArray(x.shape, x.dtype), result_shape_dtypes)
    flat_avals, out_tree = jax.tree.flatten(result_avals)
    out = prim.bind(
        *flat_args,
        callback=cb._FlatCallback(callback, in_tree),
        result_avals=tuple(flat_avals),
        sharding=None,
        vmap_method="sequential",
    )
    return jax.tree.unflatten(out_tree, out)


@functools.cache
def _numpy_callback_primitive():
    """The primitive, or None where this JAX release's internals do not build or run it."""
    try:
        prim = _make_primitive()
    except Exception:  # noqa: BLE001 (JAX's internals differ: use the public API)
        return None
    return prim if _works(prim) else None


def _make_primitive():
    from jax._src import callback as cb
    from jax._src import core, dispatch, ffi
    from jax._src.interpreters import ad, batching, mlir

    prim = core.Primitive("optaxdist_host_callback")
    prim.multiple_results = True
    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
    prim.def_abstract_eval(cb.pure_callback_abstract_eval)
    dispatch.prim_requires_devices_during_lowering.add(prim)
    ad.primitive_jvps[prim] = cb.pure_callback_jvp_rule
    ad.primitive_transposes[prim] = cb.pure_callback_transpose_rule
    batching.primitive_batchers[prim] = functools.partial(ffi.ffi_batching_rule, prim)

    def lowering(ctx, *args, callback, sharding, **params):
        del params

        def on_host(*operands):  # NumPy arrays, as the runtime hands them
            return tuple(np.asarray(r) for r in callback(*operands))

        op_sharding = cb._callback_op_sharding(ctx.module_context.axis_context, sharding, ctx.avals_out)
        result, _, _ = cb.emit_python_callback(
            ctx,
            on_host,
            None,
            list(args),
            ctx.avals_in,
            ctx.avals_out,
            has_side_effect=False,
            returns_token=False,
            sharding=op_sharding,
        )
        return result

    mlir.register_lowering(prim, lowering, cacheable=False)
    return prim


def _works(prim) -> bool:
    """The primitive compiles and runs on the CPU with this JAX release (its internals are not a
    stable API: where they changed, ``host_callback`` falls back to ``jax.pure_callback``)."""
    three = jax.ShapeDtypeStruct((3,), np.float32)
    try:
        with jax.ensure_compile_time_eval():  # first use is often inside a trace: run it now
            x = jax.device_put(np.arange(3, dtype=np.float32), jax.devices("cpu")[0])
            got = jax.jit(lambda x: _bind(prim, lambda a: np.asarray(a) * 2, three, x))(x)
            return np.array_equal(np.asarray(got), [0.0, 2.0, 4.0])
    except Exception:  # noqa: BLE001 (any failure of JAX's internals means: use the public API)
        return False
