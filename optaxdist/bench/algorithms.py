"""The registry of benchmarked algorithms: one row per name, each a factory of an Optax transform.

A new algorithm adds one entry to ``ALGORITHMS``::

    ALGORITHMS["topk-1%"] = Algorithm(
        "topk-1%", lambda comm, local, ctx: optax.chain(optaxdist.topk(comm=comm, ...), local),
        "top-k sparsified all-reduce",
    )

The factory receives the replicas' communicator and the *local* optimizer (``optax.sgd`` with the
benchmark's learning rate and momentum) and returns the per-replica transform.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

import optaxdist
from optaxdist.comm.base import Communicator


class BenchContext(NamedTuple):
    """What a factory may need beyond the communicator and the local optimizer."""

    replicas: int
    hierarchy: optaxdist.Hierarchy  # node-local and cross-node groups (``('node', 'local')`` axes)
    steps: int
    lr: optax.ScalarOrSchedule  # the local optimizer's learning rate (SlowMo needs it)
    outer_lr: float = 0.7  # DiLoCo rows' outer Nesterov SGD
    outer_momentum: float = 0.9
    # how each replica's parameters are split over model axes (``--suite sharded``); the rows that
    # compress pass it to ``compressed_allreduce`` so each device compresses its own block
    model_sharding: optaxdist.ModelSharding | None = None

    def diloco_outer(self) -> optax.GradientTransformation:
        """The DiLoCo rows' outer optimizer: Nesterov SGD with ``outer_lr`` and ``outer_momentum``."""
        return optaxdist.diloco_outer_optimizer(self.outer_lr, self.outer_momentum)


Factory = Callable[[Communicator, optax.GradientTransformation, BenchContext], optax.GradientTransformation]


class Algorithm(NamedTuple):
    """One benchmark row.

    Attributes:
      name: the name used on the command line (``--algorithms``).
      make: ``make(comm, local_optimizer, ctx) -> GradientTransformation`` for one replica.
      description: one line for the docs and ``--list``.
      single: if True the algorithm runs on ONE replica that draws the global batch
        (``replicas × batch_size`` examples) from the whole training set, and sends nothing.
    """

    name: str
    make: Factory
    description: str
    single: bool = False


def _allreduce(dtype) -> Factory:
    return lambda comm, local, ctx: optax.chain(optaxdist.allreduce(comm=comm, dtype=dtype), local)


def _compressed(compressor, error_feedback: bool = True, scope: str = "model") -> Factory:
    return lambda comm, local, ctx: optax.chain(
        optaxdist.compressed_allreduce(
            compressor,
            comm=comm,
            error_feedback=error_feedback,
            scope=scope,
            model_sharding=ctx.model_sharding,
        ),
        local,
    )


def _powersgd(rank: int, error_feedback: bool = True) -> Factory:
    return lambda comm, local, ctx: optax.chain(
        optaxdist.powersgd(
            comm=comm, rank=rank, warmup_steps=0, error_feedback=error_feedback, warm_start=True
        ),
        local,
    )


def _with_and_without_ef(name: str, compressor, description: str) -> list[Algorithm]:
    return [
        Algorithm(f"{name}-ef", _compressed(compressor), f"{description}, error feedback"),
        Algorithm(name, _compressed(compressor, error_feedback=False), description),
    ]


def _paper_moment_periods(local: optax.GradientTransformation, period: int) -> dict[str, int]:
    """DES-LOC's periods for the moments ``local`` has: Adam's ``mu`` 3× and ``nu`` 6× ``period``
    (the paper's setting), SGD's momentum ``trace`` 3×; none for plain SGD."""
    state = jax.eval_shape(local.init, jax.ShapeDtypeStruct((), jnp.float32))
    fields = {
        key.name
        for path, _ in jax.tree_util.tree_leaves_with_path(state)
        for key in path
        if isinstance(key, jax.tree_util.GetAttrKey)
    }
    return {name: m * period for name, m in {"mu": 3, "nu": 6, "trace": 3}.items() if name in fields}


C = optaxdist.compress

COMPRESSION_ALGORITHMS: list[Algorithm] = [
    *_with_and_without_ef("cast-bf16", C.cast("bfloat16"), "bf16 cast all-reduce"),
    *_with_and_without_ef("topk-1%", C.top_k(fraction=0.01), "top-1% (index, value) all-gather"),
    *_with_and_without_ef("randomk-1%", C.random_k(fraction=0.01), "random 1% (shared key)"),
    *_with_and_without_ef("blockk-1%", C.block_k(fraction=0.01), "contiguous 1% block"),
    *_with_and_without_ef(
        "threshold-1e-3",
        C.threshold(1e-3, mode="padded", max_fraction=0.01),
        "|g| ≥ 1e-3, padded all-gather bounded at 1%",
    ),
    *_with_and_without_ef("scaled-sign", C.sign(scaled=True), "EF-signSGD scaled sign, 1 bit"),
    Algorithm(
        "sign-vote",
        lambda comm, local, ctx: optax.chain(
            optaxdist.compressed_allreduce(
                C.sign(), comm=comm, error_feedback=False, model_sharding=ctx.model_sharding
            ),
            optax.sgd(1e-3),
        ),
        "signSGD with majority vote, 1 bit; fixed lr 1e-3, no momentum (ignores --lr)",
    ),
    *(
        Algorithm(
            f"powersgd-r{r}",
            _powersgd(r),
            f"PowerSGD rank {r}, error feedback, warm start, warmup_steps=0",
        )
        for r in (1, 2, 4)
    ),
    Algorithm(
        "powersgd-r2-noef",
        _powersgd(2, error_feedback=False),
        "PowerSGD rank 2 without error feedback, warm start, warmup_steps=0",
    ),
    Algorithm(
        "demo",
        lambda comm, local, ctx: optaxdist.demo(ctx.lr, comm=comm),
        "DeMo: local momentum (decay 0.999), 32 of every 64×64 DCT coefficients sent (12-bit indices, "
        "float32 values), sign-of-mean step with --lr (ignores the local optimizer)",
    ),
]

T = optaxdist.topology

PERIODIC_ALGORITHMS: list[Algorithm] = [
    *(
        Algorithm(
            f"local-sgd-{h}",
            lambda comm, local, ctx, h=h: optaxdist.local_sgd(local, comm=comm, period=h),
            f"local steps, parameter averaging every {h} steps",
        )
        for h in (8, 50)
    ),
    Algorithm(
        "post-local-sgd-50",
        lambda comm, local, ctx: optaxdist.local_sgd(
            local, comm=comm, period=50, warmup_steps=ctx.steps // 10
        ),
        "exact all-reduce for the first 10% of the steps, then local SGD with H = 50",
    ),
    Algorithm(
        "slowmo-50",
        lambda comm, local, ctx: optaxdist.slowmo(
            local, comm=comm, period=50, learning_rate=ctx.lr, momentum=0.5
        ),
        "SlowMo, τ = 50, β = 0.5, α = 1",
    ),
    Algorithm(
        "slowmo-50-sharded",
        lambda comm, local, ctx: optaxdist.slowmo(
            local,
            comm=comm,
            period=50,
            learning_rate=ctx.lr,
            momentum=0.5,
            num_shards=ctx.replicas,
        ),
        "SlowMo, τ = 50, x0 and u sharded (reduce-scatter + all-gather)",
    ),
    *(
        Algorithm(
            f"diloco-{h}",
            lambda comm, local, ctx, h=h: optaxdist.diloco(local, ctx.diloco_outer(), comm=comm, period=h),
            f"DiLoCo, H = {h}, outer Nesterov SGD (default lr 0.7, momentum 0.9)",
        )
        for h in (10, 30, 50, 100)
    ),
    Algorithm(
        "diloco-50-topk10%",
        lambda comm, local, ctx: optaxdist.diloco(
            local,
            ctx.diloco_outer(),
            comm=comm,
            period=50,
            reducer=optaxdist.compressed_allreduce(
                C.top_k(fraction=0.1), comm=comm, scope="model", model_sharding=ctx.model_sharding
            ),
        ),
        "DiLoCo, H = 50, pseudo-gradients top-10% with error feedback",
    ),
    *(
        Algorithm(
            f"diloco-30-int{bits}",
            lambda comm, local, ctx, bits=bits: optaxdist.diloco(
                local,
                ctx.diloco_outer(),
                comm=comm,
                period=30,
                reducer=optaxdist.compressed_allreduce(
                    C.quantize(bits, block_size=64, exchange="two_phase"), comm=comm
                ),
            ),
            f"DiLoCo, H = 30, pseudo-gradients int{bits}/64 by the two-phase quantized all-reduce, "
            "error feedback",
        )
        for bits in (8, 4)
    ),
    Algorithm(
        "muloco-30",
        lambda comm, local, ctx: optaxdist.diloco(
            optax.contrib.muon(0.02, adam_learning_rate=ctx.lr), ctx.diloco_outer(), comm=comm, period=30
        ),
        "MuLoCo: DiLoCo, H = 30, inner Muon (optax.contrib.muon, lr 0.02; Adam at --lr on non-matrix "
        "leaves) in place of the local optimizer",
    ),
    Algorithm(
        "sparseloco-30",
        lambda comm, local, ctx: optaxdist.sparseloco(
            local, comm=comm, period=30, model_sharding=ctx.model_sharding
        ),
        "SparseLoCo, H = 30: 64 of every 4096 pseudo-gradient entries, 12-bit indices, 2-bit values "
        "(4 bins over 6σ of each chunk's kept values, centroids sent), leaves smaller than a chunk "
        "packed into one vector, error feedback decay 0.95, outer SGD lr 1",
    ),
    Algorithm(
        "sparseloco-30-absmax",
        lambda comm, local, ctx: optaxdist.sparseloco(
            local, comm=comm, period=30, value_scale="absmax", model_sharding=ctx.model_sharding
        ),
        "sparseloco-30 with this library's symmetric 2-bit quantizer in place of the σ bins: levels "
        "{-m, 0, m}, m the chunk's largest kept magnitude",
    ),
    Algorithm(
        "sparseloco-30-nopack",
        lambda comm, local, ctx: optaxdist.sparseloco(
            local, comm=comm, period=30, pack_small_leaves=False, model_sharding=ctx.model_sharding
        ),
        "sparseloco-30 with every leaf chunked on its own (a leaf smaller than a chunk sends up to k "
        "of its entries, as Templar's per-tensor chunks do), not the small leaves packed together",
    ),
    *(
        Algorithm(
            f"sparseloco-{name}",
            lambda comm, local, ctx, o=options, nesterov=nesterov: optaxdist.sparseloco(
                local,
                comm=comm,
                outer=ctx.diloco_outer() if nesterov else None,
                model_sharding=ctx.model_sharding,
                **o,
            ),
            f"sparseloco-30 ablation: {what}",
        )
        for name, options, nesterov, what in (
            ("30-k256", {"period": 30, "k": 256}, False, "256 of every 4096 entries (6.25 %)"),
            ("30-k1024", {"period": 30, "k": 1024}, False, "1024 of every 4096 entries (25 %)"),
            ("30-fp32", {"period": 30, "value_bits": None}, False, "the kept values sent as float32"),
            ("30-ef1", {"period": 30, "error_decay": 1.0}, False, "error feedback without decay"),
            ("15", {"period": 15}, False, "H = 15"),
            ("30-lr0.7", {"period": 30, "outer_lr": 0.7}, False, "outer lr 0.7"),
            ("30-nesterov", {"period": 30}, True, "DiLoCo's outer Nesterov SGD"),
            (
                "30-nesterov-k1024-fp32",
                {"period": 30, "k": 1024, "value_bits": None},
                True,
                "DiLoCo's outer Nesterov SGD, 1024 of every 4096 entries as float32",
            ),
        )
    ),
    Algorithm(
        "local-adam-50",
        lambda comm, local, ctx: optaxdist.local_sgd(local, comm=comm, period=50, average_inner_state=True),
        "Local Adam: local steps; parameters and the optimizer state averaged every 50 steps",
    ),
    Algorithm(
        "des-loc-50",
        lambda comm, local, ctx: optaxdist.des_loc(
            local, comm=comm, period=50, state_periods=_paper_moment_periods(local, 50)
        ),
        "DES-LOC: parameters averaged every 50 steps, Adam's mu every 150 and nu every 300 "
        "(SGD's momentum every 150)",
    ),
    Algorithm(
        "streaming-diloco-50",
        lambda comm, local, ctx: optaxdist.streaming_diloco(
            local, ctx.diloco_outer(), comm=comm, period=50, num_fragments=2
        ),
        "Streaming DiLoCo, H = 50, 2 staggered fragments",
    ),
    *(
        Algorithm(
            f"diloco-10-{mode}9",
            lambda comm, local, ctx, overlap=overlap: optaxdist.streaming_diloco(
                local,
                ctx.diloco_outer(),
                comm=comm,
                period=10,
                num_fragments=1,
                delay=9,
                blend=0.5,
                overlap=overlap,
            ),
            f"DiLoCo, H = 10, the new anchor merged 9 steps after the sync (α = 0.5){what}",
        )
        for mode, overlap, what in (
            ("delay", False, ": the all-reduce at the sync"),
            ("overlap", True, ": the all-reduce spread over those 9 steps, overlapping their computation"),
        )
    ),
    Algorithm(
        "partial-avg",
        lambda comm, local, ctx: optaxdist.partial_average(
            local, comm=comm, partitions=lambda p: optaxdist.balanced_fragments(p, 3)
        ),
        "SINGA partial averaging: one of 3 partitions per step",
    ),
]

GOSSIP_ALGORITHMS: list[Algorithm] = [
    Algorithm(
        "dpsgd-ring",
        lambda comm, local, ctx: optaxdist.decentralized_sgd(local, comm=comm, topology=T.ring(ctx.replicas)),
        "D-PSGD on the undirected ring (2 peers per step)",
    ),
    Algorithm(
        "dpsgd-exp",
        lambda comm, local, ctx: optaxdist.decentralized_sgd(
            local, comm=comm, topology=T.npeer_dynamic_directed_exponential_graph(ctx.replicas)
        ),
        "D-PSGD on fairscale's one-peer dynamic exponential graph",
    ),
    Algorithm(
        "sgp-exp",
        lambda comm, local, ctx: optaxdist.sgp(
            local, comm=comm, topology=T.npeer_dynamic_directed_exponential_graph(ctx.replicas)
        ),
        "SGP (push-sum) on the one-peer dynamic exponential graph (fairscale's default)",
    ),
    Algorithm(
        "sgp-exp-global-48",
        lambda comm, local, ctx: optaxdist.sgp(
            local,
            comm=comm,
            topology=T.npeer_dynamic_directed_exponential_graph(ctx.replicas),
            average_period=48,
        ),
        "SGP with an exact global average every 48 steps",
    ),
    Algorithm(
        "slowmo-48-sgp",
        lambda comm, local, ctx: optaxdist.slowmo(
            optaxdist.sgp(
                local,
                comm=comm,
                check_start=False,
                topology=T.npeer_dynamic_directed_exponential_graph(ctx.replicas),
            ),
            comm=comm,
            period=48,
            learning_rate=ctx.lr,
            momentum=0.5,
        ),
        "SlowMo (τ = 48, β = 0.5) over SGP",
    ),
]

HIERARCHICAL_ALGORITHMS: list[Algorithm] = [
    Algorithm(
        "daso",
        lambda comm, local, ctx: optaxdist.daso(
            local,
            local_comm=ctx.hierarchy.local,
            cross_comm=ctx.hierarchy.cross,
            steps_per_epoch=max(ctx.steps // 10, 1),
            total_epochs=10,
            warmup_epochs=1,
            cooldown_epochs=1,
        ),
        "DASO: 10 epochs of steps/10, warm-up 1, cool-down 1, max_global_skips 8, bf16",
    ),
    Algorithm(
        "hier-local-sgd-4-50",
        lambda comm, local, ctx: optaxdist.local_sgd(
            local, comm=comm, period=50, local_comm=ctx.hierarchy.local, local_period=5
        ),
        "local SGD: node average every 5 steps, global every 50",
    ),
]

ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in [
        Algorithm(
            "single",
            lambda comm, local, ctx: local,
            "one replica, global batch (replicas × batch) from the whole train set; no comm",
            single=True,
        ),
        Algorithm("allreduce-fp32", _allreduce(jnp.float32), "gradient all-reduce (mean) in float32"),
        Algorithm("allreduce-bf16", _allreduce(jnp.bfloat16), "gradient all-reduce (mean) in bfloat16"),
        Algorithm("allreduce-fp16", _allreduce(jnp.float16), "gradient all-reduce (mean) in float16"),
        Algorithm(
            "param-avg",
            lambda comm, local, ctx: optax.chain(local, optaxdist.average_params(comm=comm)),
            "local SGD step, then parameter averaging every step (momentum stays local)",
        ),
        *COMPRESSION_ALGORITHMS,
        *PERIODIC_ALGORITHMS,
        *GOSSIP_ALGORITHMS,
        *HIERARCHICAL_ALGORITHMS,
    ]
}

DEFAULT_ALGORITHMS: tuple[str, ...] = (
    "single",
    "allreduce-fp32",
    "allreduce-bf16",
    "allreduce-fp16",
    "param-avg",
)


#: Names that ``--algorithms`` expands to a list of rows (``get_algorithms`` expands them).
ALGORITHM_GROUPS: dict[str, tuple[str, ...]] = {
    "default": DEFAULT_ALGORITHMS,
    "compression": ("allreduce-fp32", *(a.name for a in COMPRESSION_ALGORITHMS)),
    "periodic": ("allreduce-fp32", *(a.name for a in PERIODIC_ALGORITHMS)),
    "gossip": ("allreduce-fp32", *(a.name for a in GOSSIP_ALGORITHMS)),
    "hierarchical": ("allreduce-fp32", *(a.name for a in HIERARCHICAL_ALGORITHMS)),
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


OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "warmup-cosine")


def learning_rate_schedule(lr: float, schedule: str, steps: int) -> optax.ScalarOrSchedule:
    """``constant``: ``lr``; ``warmup-cosine``: linear warm-up from 0 over the first 5 % of
    ``steps``, then cosine decay to ``lr / 10`` at ``steps``."""
    if schedule == "constant":
        return lr
    if schedule != "warmup-cosine":
        raise ValueError(f"schedule={schedule!r}; allowed: {SCHEDULES}")
    return optax.warmup_cosine_decay_schedule(0.0, lr, max(steps // 20, 1), steps, end_value=lr / 10)


def local_optimizer(
    lr: optax.ScalarOrSchedule, momentum: float = 0.9, optimizer: str = "sgd"
) -> optax.GradientTransformation:
    """The local optimizer every algorithm wraps: ``optax.sgd`` (no momentum when it is 0), or
    ``optax.adamw`` (β₂ 0.99, weight decay 0.01; ``momentum`` is β₁)."""
    if optimizer == "adamw":
        return optax.adamw(lr, b1=momentum, b2=0.99, weight_decay=0.01)
    if optimizer != "sgd":
        raise ValueError(f"optimizer={optimizer!r}; allowed: {OPTIMIZERS}")
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
