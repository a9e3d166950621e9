"""SparseLoCo: DiLoCo whose pseudo-gradients travel as chunked top-k with quantized values and a
decaying error-feedback buffer in place of outer momentum."""

from __future__ import annotations

import optax

from optaxdist.agreement import configured
from optaxdist.comm.base import Communicator
from optaxdist.compress.chunked import chunked_top_k
from optaxdist.compress.quantize import quantize
from optaxdist.sharding import ModelSharding
from optaxdist.transforms._checks import check_int, check_number
from optaxdist.transforms.compressed import compressed_allreduce
from optaxdist.transforms.outer import outer_sync

VALUE_BITS = (None, 2, 4, 8)


@configured("sparseloco")
def sparseloco(
    inner: optax.GradientTransformation,
    *,
    comm: Communicator,
    period: int = 30,
    chunk_size: int = 4096,
    k: int = 64,
    value_bits: int | None = 2,
    error_decay: float = 0.95,
    outer_lr: float = 1.0,
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
    their values quantized to ``value_bits`` with one float32 scale per chunk
    (``chunked_top_k(chunk_size, k, values=quantize(value_bits, block_size=k))``), :math:`\beta`
    is ``error_decay`` and :math:`\eta` ``outer_lr``. The decaying buffer takes the place of
    DiLoCo's outer Nesterov momentum. This is ``diloco(inner, optax.sgd(outer_lr), reducer=
    compressed_allreduce(chunked_top_k(...), error_decay=...))``, written out.

    Communication per sync and replica (an all-gather; nothing on other steps), for a leaf of
    :math:`d` values in :math:`c = \lceil d / \text{chunk\_size}\rceil` chunks:
    :math:`\lceil c k \lceil\log_2 \text{chunk\_size}\rceil / 8\rceil` bytes of indices,
    :math:`\lceil c k \cdot \text{value\_bits} / 8\rceil` bytes of values and :math:`4c` bytes of
    scales (``value_bits=None``: :math:`4ck` bytes of float32 values). With the defaults, 116
    bytes per 4096 parameters: 141× less than float32, and every ``period`` steps only.

    Args:
      inner: the local optimizer (SparseLoCo: AdamW).
      comm: all replicas.
      period: H, local steps between syncs (SparseLoCo: 30).
      chunk_size: values per chunk (4096).
      k: entries kept per chunk (64, 1.56 %).
      value_bits: bits per kept value, one of ``(None, 2, 4, 8)``; None sends float32 (2).
      error_decay: β, the decay of the error-feedback buffer (0.95).
      outer_lr: η, the outer learning rate (1.0).
      model_sharding: under FSDP / tensor parallelism inside each replica, the parameters' split
        (``optaxdist.ModelSharding``): each device compresses its own blocks, chunk by chunk.
      warmup_steps, check_start, nonfinite, exact_sync: see ``outer_sync``.

    Differences from the paper: the 2-bit values are this library's symmetric block quantizer
    (three levels :math:`\{-s, 0, s\}` with :math:`s` the chunk's largest kept magnitude), not the
    paper's four bins over :math:`\pm 6\sigma`; what a value loses stays in the error-feedback
    buffer either way.

    Example:
      >>> tx = sparseloco(optax.adamw(1e-3), comm=comm, period=30)

    References:
      "Communication Efficient LLM Pre-training with SparseLoCo" (Templar), arXiv:2508.15706.
    """
    if value_bits not in VALUE_BITS:
        raise ValueError(f"value_bits={value_bits!r}; allowed: {VALUE_BITS}")
    check_int("k", k, low=1)
    if value_bits is not None and k % (8 // value_bits):
        raise ValueError(
            f"k={k} must be a multiple of {8 // value_bits} at value_bits={value_bits} (whole bytes "
            "of values per chunk)"
        )
    check_number("outer_lr", outer_lr, low=0.0, open_low=True)
    values = None if value_bits is None else quantize(value_bits, block_size=k)
    reducer = compressed_allreduce(
        chunked_top_k(chunk_size, k, values=values),
        comm=comm,
        error_decay=error_decay,
        model_sharding=model_sharding,
    )
    return outer_sync(
        inner,
        optax.sgd(outer_lr),
        comm=comm,
        period=period,
        reducer=reducer,
        warmup_steps=warmup_steps,
        check_start=check_start,
        nonfinite=nonfinite,
        exact_sync=exact_sync,
    )
