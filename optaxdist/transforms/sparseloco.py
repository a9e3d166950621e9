"""SparseLoCo: DiLoCo whose pseudo-gradients travel as chunked top-k with quantized values and a
decaying error-feedback buffer in place of outer momentum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from optaxdist._validate import check_int, is_bool
from optaxdist.agreement import configured
from optaxdist.comm.base import Communicator
from optaxdist.compress.chunked import chunked_top_k
from optaxdist.compress.quantize import quantize
from optaxdist.sharding import ModelSharding
from optaxdist.transforms._checks import check_number, check_transformation
from optaxdist.transforms.compressed import compressed_allreduce
from optaxdist.transforms.outer import outer_sync

VALUE_BITS = (None, 2, 4, 8)
VALUE_SCALES = ("sigma", "absmax")


@configured("sparseloco")
def sparseloco(
    inner: optax.GradientTransformation,
    *,
    comm: Communicator,
    period: int = 30,
    chunk_size: int = 4096,
    k: int = 64,
    value_bits: int | None = 2,
    value_scale: str = "sigma",
    pack_small_leaves: bool | None = None,
    error_decay: float = 0.95,
    outer_lr: float = 1.0,
    outer: optax.GradientTransformation | None = None,
    model_sharding: ModelSharding | None = None,
    warmup_steps: int = 0,
    check_start: bool = True,
    nonfinite: str = "skip",
    exact_sync: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""SparseLoCo: ``period`` local steps of ``inner``, then an outer SGD step on the average of
    the replicas' sparsified pseudo-gradients.

    On sync steps, replica :math:`i` with pseudo-gradient :math:`\Delta_i = x_0 - x_i` and
    error-feedback buffer :math:`e_i`:

    .. math::
        v_i = \Delta_i + \beta e_i, \qquad s_i = D(C(v_i)), \qquad e_i \leftarrow v_i - s_i,
        \qquad x_0 \leftarrow x_0 - \eta \frac1W \sum_i s_i, \qquad x_i \leftarrow x_0

    where :math:`C` keeps the ``k`` entries of largest magnitude of every chunk of ``chunk_size``
    values, their in-chunk indices packed in :math:`\lceil\log_2 \text{chunk\_size}\rceil` bits and
    their values quantized to ``value_bits`` per chunk: by default (``value_scale="sigma"``) the
    paper's :math:`2^{\text{value\_bits}}` bins over :math:`6\sigma` of the chunk's kept values,
    each decoded to its bin's centroid, sent as a table of :math:`2^{\text{value\_bits}}` float32
    (``chunked_top_k(chunk_size, k, values=quantize(value_bits, block_size=k, scale="sigma"))``);
    :math:`\beta` is ``error_decay`` and :math:`\eta` ``outer_lr``. The decaying buffer takes the
    place of DiLoCo's outer Nesterov momentum. This is ``diloco(inner, optax.sgd(outer_lr),
    reducer=compressed_allreduce(chunked_top_k(...), error_decay=...))``, written out, with the
    leaves smaller than a chunk packed into one vector (``pack_small_leaves``).

    Communication per sync and replica (an all-gather; nothing on other steps), for a vector of
    :math:`d` values in :math:`c = \lceil d / \text{chunk\_size}\rceil` chunks:
    :math:`\lceil c k \lceil\log_2 \text{chunk\_size}\rceil / 8\rceil` bytes of indices,
    :math:`\lceil c k \cdot \text{value\_bits} / 8\rceil` bytes of values and
    :math:`4 \cdot 2^{\text{value\_bits}} c` bytes of bin tables (``value_scale="absmax"``:
    :math:`4c` bytes of scales; ``value_bits=None``: :math:`4ck` bytes of float32 values). With the
    defaults, 128 bytes per 4096 parameters: 128× less than float32 (116 bytes, 141×, with
    ``"absmax"``), and every ``period`` steps only. The vectors: every leaf of ``chunk_size``
    values or more on its own, and the concatenation (in tree order) of the smaller ones, so that
    a model of many small leaves (biases, norms) does not send a padded chunk for each.

    Args:
      inner: the local optimizer (SparseLoCo: AdamW).
      comm: all replicas.
      period: H, local steps between syncs (SparseLoCo: 30).
      chunk_size: values per chunk (4096).
      k: entries kept per chunk (64, 1.56 %).
      value_bits: bits per kept value, one of ``(None, 2, 4, 8)``; None sends float32 (2).
      value_scale: ``"sigma"`` (the paper's bins over ±3σ of each chunk's kept values, decoded to
        the bins' centroids) or ``"absmax"`` (this library's symmetric quantizer: integers in
        [−q, q] times the chunk's largest kept magnitude over q; at 2 bits three levels
        {−m, 0, m}).
      pack_small_leaves: concatenate the leaves smaller than ``chunk_size`` into one vector before
        chunking (None: yes, unless ``model_sharding`` is given; it can't be combined with it).
      error_decay: β, the decay of the error-feedback buffer (0.95).
      outer_lr: η, the outer learning rate (1.0).
      outer: another outer optimizer in place of SGD(``outer_lr``) (e.g. DiLoCo's Nesterov
        momentum, ``diloco_outer_optimizer()``); None: the paper's SGD. The error-feedback buffer
        already acts as momentum, so on the char-LM benchmark adding Nesterov momentum on top made
        it much worse (see docs/transforms/sparseloco.md).
      model_sharding: under FSDP / tensor parallelism inside each replica, the parameters' split
        (``optaxdist.ModelSharding``): each device compresses its own blocks, chunk by chunk.
      warmup_steps, check_start, nonfinite, exact_sync: see ``outer_sync``.

    Differences from the paper (Templar's code): the bins' statistics (mean, σ) and centroid
    table are per chunk of kept values here, per tensor there (16 bytes of table per chunk);
    chunks are runs of ``chunk_size`` consecutive values of a leaf (the last one zero-padded) or of
    the packed small leaves, where Templar tiles each matrix into 2-D blocks of a divisor of the
    target size; the aggregation is the plain mean of what the replicas sent (Templar's validator
    also clips each peer's norm to the median).

    Example:
      >>> tx = sparseloco(optax.adamw(1e-3), comm=comm, period=30)

    References:
      "Communication Efficient LLM Pre-training with SparseLoCo" (Templar), arXiv:2508.15706.
    """
    if value_bits not in VALUE_BITS:
        raise ValueError(f"value_bits={value_bits!r}; allowed: {VALUE_BITS}")
    if value_scale not in VALUE_SCALES:
        raise ValueError(f"value_scale={value_scale!r}; allowed: {VALUE_SCALES}")
    if not (pack_small_leaves is None or is_bool(pack_small_leaves)):
        raise ValueError(f"pack_small_leaves={pack_small_leaves!r} must be None, True or False")
    if pack_small_leaves and model_sharding is not None:
        raise ValueError(
            "pack_small_leaves=True can't be combined with model_sharding (each device compresses its "
            "own blocks of each leaf); leave it None or False"
        )
    k = check_int("k", k, low=1)
    if value_bits is not None and k % (8 // value_bits):
        raise ValueError(
            f"k={k} must be a multiple of {8 // value_bits} at value_bits={value_bits} (whole bytes "
            "of values per chunk)"
        )
    check_number("outer_lr", outer_lr, low=0.0, open_low=True)
    if outer is not None:
        check_transformation("outer", outer)
        if outer_lr != 1.0:
            raise ValueError(
                f"outer_lr={outer_lr!r} is SGD's learning rate: with outer= given, set its own rate"
            )
    values = None if value_bits is None else quantize(value_bits, block_size=k, scale=value_scale)
    reducer = compressed_allreduce(
        chunked_top_k(chunk_size, k, values=values),
        comm=comm,
        error_decay=error_decay,
        model_sharding=model_sharding,
    )
    if pack_small_leaves is None:
        pack_small_leaves = model_sharding is None
    if pack_small_leaves:
        reducer = _on_packed_small_leaves(reducer, chunk_size)
    return outer_sync(
        inner,
        optax.sgd(outer_lr) if outer is None else outer,
        comm=comm,
        period=period,
        reducer=reducer,
        warmup_steps=warmup_steps,
        check_start=check_start,
        nonfinite=nonfinite,
        exact_sync=exact_sync,
    )


def _on_packed_small_leaves(
    reducer: optax.GradientTransformation, chunk_size: int
) -> optax.GradientTransformationExtraArgs:
    """``reducer`` on a list: the leaves of ``chunk_size`` values or more as they are, then (if
    any) the concatenation of the flattened smaller leaves in tree order; its output is put back
    into the tree (each leaf in its own dtype). Its state (the error-feedback residual) has the
    list's structure."""
    reducer = optax.with_extra_args_support(reducer)

    def pack(tree):
        leaves = jax.tree.leaves(tree)
        small = [x.reshape(-1) for x in leaves if x.size < chunk_size]
        return [x for x in leaves if x.size >= chunk_size] + ([jnp.concatenate(small)] if small else [])

    def unpack(tree, packed):
        leaves, treedef = jax.tree.flatten(tree)
        big = iter(packed)
        out = [next(big) if x.size >= chunk_size else None for x in leaves]
        offset, flat = 0, packed[-1]
        for i, x in enumerate(leaves):
            if x.size < chunk_size:
                out[i] = flat[offset : offset + x.size].reshape(x.shape).astype(x.dtype)
                offset += x.size
        return jax.tree.unflatten(treedef, out)

    def init_fn(params):
        return reducer.init(pack(params))

    def update_fn(updates, state, params=None, **extra):
        packed, state = reducer.update(
            pack(updates), state, None if params is None else pack(params), **extra
        )
        return unpack(updates, packed), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
