"""The registry of benchmarked algorithms: one row per name, each a factory of an Optax transform.

A new algorithm adds one entry to ``ALGORITHMS``::

    ALGORITHMS["topk-1%"] = Algorithm(
        "topk-1%", lambda comm, local: optax.chain(optaxdist.topk(comm=comm, ...), local),
        "top-k sparsified all-reduce",
    )

The factory receives the replicas' communicator and the *local* optimizer (``optax.sgd`` with the
benchmark's learning rate and momentum) and returns the per-replica transform.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
import optax

import optaxdist
from optaxdist.comm.base import Communicator

Factory = Callable[[Communicator, optax.GradientTransformation], optax.GradientTransformation]


class Algorithm(NamedTuple):
    """One benchmark row.

    Attributes:
      name: the name used on the command line (``--algorithms``).
      make: ``make(comm, local_optimizer) -> GradientTransformation`` for one replica.
      description: one line for the docs and ``--list``.
      single: if True the algorithm runs on ONE replica that draws the global batch
        (``replicas × batch_size`` examples) from the whole training set, and sends nothing.
    """

    name: str
    make: Factory
    description: str
    single: bool = False


def _allreduce(dtype) -> Factory:
    return lambda comm, local: optax.chain(optaxdist.allreduce(comm=comm, dtype=dtype), local)


def _compressed(compressor, error_feedback: bool = True, scope: str = "model") -> Factory:
    return lambda comm, local: optax.chain(
        optaxdist.compressed_allreduce(
            compressor, comm=comm, error_feedback=error_feedback, scope=scope
        ),
        local,
    )


def _powersgd(rank: int, error_feedback: bool = True) -> Factory:
    return lambda comm, local: optax.chain(
        optaxdist.powersgd(
            comm=comm, rank=rank, start_iter=0, error_feedback=error_feedback, warm_start=True
        ),
        local,
    )


def _with_and_without_ef(name: str, compressor, description: str) -> list[Algorithm]:
    return [
        Algorithm(f"{name}-ef", _compressed(compressor), f"{description}, error feedback"),
        Algorithm(name, _compressed(compressor, error_feedback=False), description),
    ]


C = optaxdist.compress

COMPRESSION_ALGORITHMS: list[Algorithm] = [
    *_with_and_without_ef("cast-bf16", C.cast("bfloat16"), "bf16 cast all-reduce"),
    *_with_and_without_ef("topk-1%", C.top_k(fraction=0.01), "top-1% (index, value) all-gather"),
    *_with_and_without_ef("randomk-1%", C.random_k(fraction=0.01), "random 1% (shared key)"),
    *_with_and_without_ef("blockk-1%", C.block_k(fraction=0.01), "contiguous 1% block"),
    *_with_and_without_ef(
        "threshold-1e-3", C.threshold(1e-3, mode="padded", max_fraction=0.01),
        "|g| ≥ 1e-3, padded all-gather bounded at 1%",
    ),
    *_with_and_without_ef("scaled-sign", C.sign(scaled=True), "EF-signSGD scaled sign, 1 bit"),
    Algorithm(
        "sign-vote",
        lambda comm, local: optax.chain(
            optaxdist.compressed_allreduce(C.sign(), comm=comm, error_feedback=False),
            optax.sgd(1e-3),
        ),
        "signSGD with majority vote, 1 bit; fixed lr 1e-3, no momentum (ignores --lr)",
    ),
    *(
        Algorithm(
            f"powersgd-r{r}", _powersgd(r),
            f"PowerSGD rank {r}, error feedback, warm start, start_iter=0",
        )
        for r in (1, 2, 4)
    ),
    Algorithm(
        "powersgd-r2-noef", _powersgd(2, error_feedback=False),
        "PowerSGD rank 2 without error feedback, warm start, start_iter=0",
    ),
]

ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in [
        Algorithm(
            "single",
            lambda comm, local: local,
            "one replica, global batch (replicas × batch) from the whole train set; no comm",
            single=True,
        ),
        Algorithm(
            "allreduce-fp32", _allreduce(jnp.float32), "gradient all-reduce (mean) in float32"
        ),
        Algorithm(
            "allreduce-bf16", _allreduce(jnp.bfloat16), "gradient all-reduce (mean) in bfloat16"
        ),
        Algorithm(
            "allreduce-fp16", _allreduce(jnp.float16), "gradient all-reduce (mean) in float16"
        ),
        Algorithm(
            "param-avg",
            lambda comm, local: optax.chain(local, optaxdist.average_params(comm=comm)),
            "local SGD step, then parameter averaging every step (momentum stays local)",
        ),
        *COMPRESSION_ALGORITHMS,
    ]
}

DEFAULT_ALGORITHMS: tuple[str, ...] = (
    "single", "allreduce-fp32", "allreduce-bf16", "allreduce-fp16", "param-avg",
)


#: Names that ``--algorithms`` expands to a list of rows (``get_algorithms`` expands them).
ALGORITHM_GROUPS: dict[str, tuple[str, ...]] = {
    "default": DEFAULT_ALGORITHMS,
    "compression": ("allreduce-fp32", *(a.name for a in COMPRESSION_ALGORITHMS)),
    "all": tuple(ALGORITHMS),
}


def expand_names(names: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """A comma list (or sequence) of registry names and group names (``ALGORITHM_GROUPS``) as
    registry names, groups expanded in place, duplicates dropped (first occurrence kept)."""
    if isinstance(names, str):
        names = [s.strip() for s in names.split(",") if s.strip()]
    out: list[str] = []
    for n in names:
        for m in ALGORITHM_GROUPS.get(n, (n,)):
            if m not in out:
                out.append(m)
    return tuple(out)


def local_optimizer(lr: float, momentum: float = 0.9) -> optax.GradientTransformation:
    """The local optimizer every algorithm wraps: ``optax.sgd`` (no momentum when it is 0)."""
    return optax.sgd(lr, momentum=momentum or None)


def get_algorithms(names: str | list[str] | tuple[str, ...]) -> list[Algorithm]:
    """Look up a comma-separated list (or a sequence) of registry names, in that order; group
    names (``ALGORITHM_GROUPS``: ``default``, ``compression``, ``all``) expand to their rows."""
    names = expand_names(names)
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown or not names:
        raise ValueError(
            f"unknown algorithms {unknown}; available: {', '.join(ALGORITHMS)}; "
            f"groups: {', '.join(ALGORITHM_GROUPS)}"
        )
    return [ALGORITHMS[n] for n in names]
