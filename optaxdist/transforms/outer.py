"""Outer optimizers on periodically averaged replicas: DiLoCo, SlowMo and Streaming DiLoCo.

Every ``period`` steps the replicas' displacement from the shared *anchor* ``x₀`` (the parameters
at the last sync) is averaged into a pseudo-gradient ``Δ = x₀ − mean_i(x_i)``; an outer optax
optimizer turns it into a step on ``x₀``, and every replica continues from the new ``x₀``.
Streaming DiLoCo does the same per *fragment* of the parameters, the fragments' syncs staggered
over the period; DiLoCo is its one-fragment case. All of them are one ``outer_sync`` on the
periodic engine (``optaxdist.transforms.periodic``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P

from optaxdist._validate import check_bools, check_int
from optaxdist.accounting import CommLedger, Kind, Payload, dtype_label, kind_name, payload_bytes, per_replica
from optaxdist.agreement import configured
from optaxdist.comm.base import Communicator, canonical_comm_dtype, mean_after_sum, mean_before_sum
from optaxdist.partition import Partition, balanced_fragments, resolve_partition
from optaxdist.sharding import ModelSharding, map_subtrees, on_shards, same_layout
from optaxdist.transforms._checks import check_comm, check_float_leaves, check_number, check_transformation
from optaxdist.transforms.periodic import SyncInput, periodic

FlightKey = tuple[jnp.dtype, "jnp.dtype | None"]  # overlap's buffers: (anchor dtype, wire dtype)


class InFlight(NamedTuple):
    """``overlap``'s buffers: one flat vector each per key ``(anchor dtype, wire dtype)`` of the
    parameters (``FlightKey``), per replica.

    The all-reduce of a step reads ``outgoing`` and writes ``arrived``, both of them arguments
    and results of the step and nothing else: XLA gives such values buffers of their own, where
    it would share an intermediate's with the gradients' computation and so order the two.

    Attributes:
      pseudo: the pseudo-gradient of the fragment in flight (sized for the largest fragment:
        ``delay`` chunks, in the anchors' dtype), its chunks replaced by their means as they
        arrive; then one chunk where the steps that have no mean to keep write theirs (so that
        every step writes one chunk, in place, and reads none).
      outgoing: the chunk this step all-reduces, as it goes on the wire (``pmean``'s operand:
        in the wire dtype, divided by the group size first for a 16-bit wire).
      arrived: the sum of the chunk the previous step all-reduced, as it came off the wire.
    """

    pseudo: tuple[jax.Array, ...]
    outgoing: tuple[jax.Array, ...]
    arrived: tuple[jax.Array, ...]


def _to_wire(chunk: jax.Array, key: FlightKey, size: int) -> jax.Array:
    """What ``comm.pmean(chunk, dtype=key[1])`` sends of ``chunk`` (``Communicator.pmean``)."""
    return mean_before_sum(chunk, key[1], size).astype(key[1] or key[0])


def _from_wire(summed: jax.Array, key: FlightKey, size: int) -> jax.Array:
    """The mean ``comm.pmean`` returns, from the sum of ``_to_wire``'s chunks."""
    return mean_after_sum(summed.astype(key[0]), key[0], key[1], size)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class OuterLayout:
    """Static layout of an ``OuterState``: the fragments (tuples of leaf indices of the parameters)
    and, in the sharded mode, the number of shards (else None)."""

    fragments: Partition
    num_shards: int | None


class OuterState(NamedTuple):
    """The synchronization state of ``outer_sync`` (``PeriodicState.sync_state``).

    Attributes:
      layout: fragments and sharding (static).
      anchors: per fragment, ``x₀`` at the fragment's last sync (replicated): a tree of the
        parameters' structure when the fragment is all of them (DiLoCo, SlowMo), else the list of
        its leaves; sharded, this replica's flat block of ``ceil(P_f / num_shards)`` elements
        (with ``model_sharding``, a tuple of such blocks, one per group of leaves split over the
        same model axes, each itself split over those axes).
      outer_states: per fragment, the outer optimizer's state (replicated; a block when sharded).
      reducer_states: per fragment, a custom reducer's state (e.g. an error-feedback residual, per
        replica); empty without one.
      in_flight: with ``overlap``, the pseudo-gradient whose all-reduce is under way
        (``InFlight``, per replica); ``()`` without.
    """

    layout: OuterLayout
    anchors: tuple[Any, ...]
    outer_states: tuple[optax.OptState, ...]
    reducer_states: tuple[optax.OptState, ...]
    in_flight: InFlight | tuple[()] = ()

    def anchor_params(self, like: Any) -> Any:
        """The anchors ``x₀`` as a tree of the structure of ``like`` (the parameters); also on a
        stack of states (leading replica axes). Not in the sharded mode (each replica holds a
        block)."""
        if self.layout.num_shards is not None:
            raise ValueError("in the sharded mode each replica holds one block of the anchors")
        leaves: list[Any] = [None] * sum(len(part) for part in self.layout.fragments)
        for part, anchor in zip(self.layout.fragments, self.anchors):
            for i, x in zip(part, jax.tree.leaves(anchor)):
                leaves[i] = x
        return jax.tree.unflatten(jax.tree.structure(like), leaves)


def _label(fragments: Partition, f: int, leaves, dtype: Any = None) -> str:
    """The part of fragment ``f``'s ledger kinds inside the brackets: ``fragment<f>:<dtype>`` (with
    one fragment, DiLoCo, just the dtype)."""
    return (f"fragment{f}:" if len(fragments) > 1 else "") + dtype_label(leaves, dtype)


def _block_size(leaves, num_shards: int) -> int:
    return -(-sum(math.prod(x.shape) for x in leaves) // num_shards)


def _sharded_kind(op: str, fragments: Partition, f: int, dtype: Any) -> Kind:
    return Kind(op, _label(fragments, f, [], dtype))


def model_groups(
    model_sharding: ModelSharding, params: Any, part: tuple[int, ...]
) -> list[tuple[tuple[str, ...], list[int]]]:
    """Fragment ``part``'s leaves by the model axes that split them: ``[(axes, leaf indices)]``."""
    groups = [(axes, [i for i in ix if i in part]) for axes, ix in model_sharding.groups(params).items()]
    return [(axes, ix) for axes, ix in groups if ix]


def sharded_payloads(
    fragments: Partition, leaves, num_shards: int, model_sharding: ModelSharding | None = None
) -> dict[Kind, int]:
    """Ledger kinds and payloads of the sharded mode over ``num_shards`` replicas: per fragment, a
    reduce-scatter of the padded fragment and an all-gather of one block (``leaves``: the
    parameters' leaves, arrays or shapes with dtypes). With ``model_sharding`` each of a replica's
    devices does this for its own blocks, group by group of leaves split over the same axes."""
    out = {}
    for f, part in enumerate(fragments):
        mine = [leaves[i] for i in part]
        dtype = jnp.result_type(*[x.dtype for x in mine])
        if model_sharding is None:
            blocks, devices = [_block_size(mine, num_shards)], 1
        else:
            params = model_sharding.structure.unflatten(leaves)
            local = jax.tree.leaves(model_sharding.blocks(params))
            groups = model_groups(model_sharding, params, part)
            blocks = [_block_size([local[i] for i in ix], num_shards) for _, ix in groups]
            devices = model_sharding.devices
        out[_sharded_kind("reduce_scatter", fragments, f, dtype)] = (
            devices * sum(blocks) * num_shards * dtype.itemsize
        )
        out[_sharded_kind("all_gather", fragments, f, dtype)] = devices * sum(blocks) * dtype.itemsize
    return out


@configured("outer_sync")
def outer_sync(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation | None = None,
    *,
    comm: Communicator,
    period: int,
    num_fragments: int = 1,
    fragments: Partition | Any | None = None,
    delay: int = 0,
    blend: float = 0.0,
    overlap: bool = False,
    reducer: optax.GradientTransformation | None = None,
    num_shards: int | None = None,
    model_sharding: ModelSharding | None = None,
    dtype: Any = None,
    anchor_dtype: Any = "float32",
    anchor_after_first_step: bool = False,
    warmup_steps: int = 0,
    check_start: bool = True,
    nonfinite: str = "skip",
    exact_sync: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""Local steps of ``inner``; every ``period`` steps an ``outer`` step per fragment on the
    replicas' averaged displacement. ``diloco``, ``slowmo`` and ``streaming_diloco`` are this one
    function.

    Fragment :math:`f` of :math:`F` (its leaves; :math:`F = 1`: all of them) syncs on the steps
    :math:`t` with :math:`(t + 1 + f H / F) \bmod H = 0`:

    .. math::
        \Delta_f = \frac1W\sum_i (x_{0,f} - x_{i,f}), \qquad
        x_{0,f} \leftarrow x_{0,f} + \mathrm{outer}_f(\Delta_f), \qquad
        x_{i,f} \leftarrow \alpha\, x_{i,f} + (1-\alpha)\, x_{0,f}

    with :math:`x_0` the anchor (the parameters at the fragment's last sync, initially those passed
    to ``init``); the last assignment (the merge) runs ``delay`` steps after the sync
    (Streaming DiLoCo's overlap), α = ``blend``. The all-reduce of :math:`\Delta_f` runs at the
    sync; with ``overlap`` it is spread over the ``delay`` steps after it instead, in a part of the
    program that does not depend on those steps' gradients, so that it runs while they are
    computed, and the outer step is taken at the merge: the same numbers.

    Communication: on a fragment's sync the ``reducer``'s collective on its pseudo-gradient; by
    default one all-reduce of the fragment in ``dtype`` (ledger ``all_reduce[<dtype>]``, with
    fragments ``all_reduce[fragment<f>:<dtype>]``), ``P/H`` bytes per step on average. With
    ``num_shards``: a reduce-scatter of the fragment at its sync and an all-gather of ``1/W`` of it
    at its merge. Nothing on other steps (a branch of the engine's ``lax.switch``). With
    ``overlap``, on every step (outside any conditional, warm-up included) one all-reduce of
    ``1/delay`` of the largest fragment, rounded up, per pair of anchor and wire dtype (ledger
    ``overlapped_all_reduce[...]``): on the ``delay`` steps after a sync a chunk of that fragment,
    on the others (``H/F − delay`` of every ``H/F``, the warm-up, the steps before the first
    sync) a chunk nothing reads; ``delay = H/F − 1`` wastes least.

    Args:
      inner: the local optimizer.
      outer: the outer optimizer of every fragment (default ``diloco_outer_optimizer()``: Nesterov
        SGD, lr 0.7, momentum 0.9). Its ``update`` receives the extra argument ``inner_step`` (the
        0-based step of the sync).
      comm: all replicas.
      period: H, inner steps between a fragment's syncs (≥ 1).
      num_fragments: F (dividing ``period``); 1: DiLoCo.
      fragments: the F fragments as tuples of leaf indices (of ``jax.tree.leaves(params)``) or a
        function of the parameters returning them (default ``balanced_fragments``).
      delay: steps between a fragment's sync and the merge of its new anchor (``< H / F``).
      blend: α ∈ [0, 1), the weight of the local value at the merge (0: replace).
      overlap: spread each fragment's all-reduce over the ``delay`` steps between its sync and its
        merge, one chunk per step, each outside the step's dependence on its gradients (the
        engine's ``background``): XLA may run it while the forward and backward pass run, so a
        step costs up to the larger of its computation and its chunk's communication instead of
        their sum. Needs ``delay ≥ 1``, the default mean (no ``reducer``, no ``num_shards``);
        the pseudo-gradient in flight is kept in the state (``InFlight``: per pair of anchor
        and wire dtype, the largest fragment's leaves of that pair in the anchors' dtype, and two
        chunks).
      reducer: how the per-replica pseudo-gradients ``x₀ − x_i`` are averaged: any gradient
        transformation that averages over ``comm`` (e.g. ``compressed_allreduce(compress.top_k(...),
        comm=comm)`` for compressed pseudo-gradients with error feedback, one state per fragment).
        Default: ``comm.pmean`` in ``dtype``.
      num_shards: memory-efficient mode: shard each fragment's ``x₀`` and outer state over the
        ``num_shards`` (= ``comm.size``) replicas: a sync is a reduce-scatter, the outer update on
        this replica's block, and an all-gather of the new anchor at the merge. Same numbers for
        element-wise outer optimizers (SGD, Nesterov, Adam), ``1/W`` of the outer memory.
        Incompatible with a custom ``reducer`` and with ``dtype``.
      model_sharding: with ``num_shards``, how the parameters are split over model axes inside
        each replica (``optaxdist.ModelSharding``): each device flattens its own blocks of a
        fragment, group by group of leaves split over the same model axes, so nothing is gathered
        over a model axis and the anchor and outer-state blocks stay split like the parameters
        (``1/(W·D)`` of the outer memory per device, ``D`` devices per replica). The default mode
        needs none: its anchors and outer state are elementwise and stay split by themselves.
      dtype: wire dtype of the default mean (None: the parameters' dtype).
      anchor_dtype: the least dtype of the anchors ``x₀``, hence of the outer optimizer's state
        and of the pseudo-gradients: ``"float32"`` (default) keeps them in float32 for bfloat16 /
        float16 parameters, so outer steps smaller than a 16-bit ulp accumulate (4 bytes per
        parameter each for ``x₀`` and every outer moment, where the parameters take 2); None: the
        parameters' dtype. The wire keeps ``dtype`` (the parameters' by default).
      anchor_after_first_step: take ``x₀`` *after* the first local step (fairscale's behaviour:
        the first sync then covers ``period − 1`` steps) as the replicas' mean (one extra
        all-reduce, ledger ``anchor_average[...]``), instead of the parameters before it.
      warmup_steps, check_start, nonfinite, exact_sync: the engine's options, see ``periodic``
        (synchronous steps before the local steps, after which the anchors are taken; the first
        step's check that the replicas start identical; the local step's non-finite policy;
        bit-identical parameters after a merge with ``optaxdist.apply_updates``, at no memory
        cost since the anchors are those parameters — a copy of them in the sharded mode).

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
      arXiv:2311.08105; "Streaming DiLoCo with overlapping communication: Towards a Distributed
      Free Lunch", arXiv:2501.18512.
    """
    period = check_int("period", period, 1)
    check_comm("comm", comm)
    if num_shards is not None:
        num_shards = check_int("num_shards", num_shards, 1)
        if reducer is not None or dtype is not None:
            raise ValueError("num_shards (memory-efficient mode) can't be combined with a reducer or a dtype")
    if model_sharding is not None:
        if not isinstance(model_sharding, ModelSharding):
            raise TypeError(
                f"model_sharding must be an optaxdist.ModelSharding or None, got {model_sharding!r}"
            )
        if num_shards is None:
            raise ValueError(
                "model_sharding is for the num_shards (memory-efficient) mode; the default mode's anchors "
                "and outer state are elementwise and stay split like the parameters without it"
            )
    num_fragments = check_int("num_fragments", num_fragments, 1)
    if period % num_fragments:
        raise ValueError(f"num_fragments={num_fragments!r} must divide period={period}")
    stride = period // num_fragments
    delay = check_int("delay", delay, 0, stride)
    check_number("blend", blend, 0, 1, open_high=True)
    check_bools(overlap=overlap)
    if overlap and (delay < 1 or reducer is not None or num_shards is not None):
        raise ValueError(
            f"overlap=True spreads the default all-reduce over the delay steps after a sync: it needs "
            f"delay >= 1 (got {delay}), reducer=None and num_shards=None"
        )
    anchor_floor = None if anchor_dtype is None else jnp.dtype(anchor_dtype)
    if anchor_floor is not None and not jnp.issubdtype(anchor_floor, jnp.floating):
        raise ValueError(f"anchor_dtype={anchor_dtype!r} must be None or a floating-point dtype")
    outer = check_transformation("outer", outer) if outer is not None else diloco_outer_optimizer()
    wire = canonical_comm_dtype(dtype)
    outer = optax.with_extra_args_support(outer)
    reducer = optax.with_extra_args_support(reducer) if reducer is not None else None
    sharded = num_shards is not None
    fragment_spec = fragments if fragments is not None else lambda p: balanced_fragments(p, num_fragments)

    def layout_of(params) -> OuterLayout:
        parts = resolve_partition(fragment_spec, params)
        if len(parts) != num_fragments:
            raise ValueError(f"fragments has {len(parts)} groups, num_fragments={num_fragments}")
        return OuterLayout(parts, num_shards)

    def block_size(leaves) -> int:
        return _block_size(leaves, num_shards)

    def flat_dtype(leaves):
        return jnp.result_type(*leaves)

    def anchor_type(dtype) -> jnp.dtype:
        """The anchors' dtype for parameters of ``dtype``: at least ``anchor_dtype``."""
        dtype = jnp.dtype(dtype)
        return dtype if anchor_floor is None or dtype.itemsize >= anchor_floor.itemsize else anchor_floor

    def widen(tree):
        return jax.tree.map(lambda x: jnp.asarray(x).astype(anchor_type(x.dtype)), tree)

    def shard_groups(params, part: tuple[int, ...]) -> list[tuple[tuple[str, ...], list[int]]]:
        """The sharded mode's groups of a fragment's leaves, each flattened into one block per
        replica: all of them, or with ``model_sharding`` one group per set of model axes that
        split them (then each device flattens its own blocks; ``()``: replicated leaves)."""
        if model_sharding is None:
            return [((), list(part))]
        return model_groups(model_sharding, params, part)

    def on_blocks(fn, axes: tuple[str, ...], in_specs: tuple[Any, ...], out_specs: Any):
        """``fn`` on each device's blocks of a group of leaves split over ``axes`` (a flat anchor
        block is split over all of them: ``P(axes)``); itself for a group split over none."""
        return on_shards(fn, model_sharding, in_specs, out_specs) if axes else fn

    def split_like_blocks(tree, blocks: tuple[jax.Array, ...], groups) -> Any:
        """``tree`` (the outer state of a fragment) with each tuple laid out like the fragment's
        blocks split over the model axes like them: ``outer.init``'s zeros do not depend on the
        blocks, so the compiler would leave them whole on every device."""
        if model_sharding is None:
            return tree

        def split(node):
            if not same_layout(node, blocks):
                return None
            return tuple(
                on_blocks(lambda b: b, axes, (P(axes),), P(axes))(b) for b, (axes, _) in zip(node, groups)
            )

        return map_subtrees(split, tree)

    def leaf_specs(params, ix: list[int]) -> tuple[P, ...]:
        if model_sharding is None:
            return (P(),) * len(ix)
        specs = model_sharding.leaf_specs(params)
        return tuple(specs[i] for i in ix)

    def kinds(params, inner_state) -> dict[Kind, int]:
        del inner_state
        layout, leaves = layout_of(params), jax.tree.leaves(params)
        if sharded:
            out = sharded_payloads(layout.fragments, leaves, num_shards, model_sharding)
        elif reducer is None:
            out = {
                Kind("all_reduce", _label(layout.fragments, f, mine, wire)): payload_bytes(mine, wire)
                for f, mine in enumerate([[leaves[i] for i in part] for part in layout.fragments])
            }
        else:
            out = {}
        if overlap:
            chunks = flight_plan(params)[0]
            sizes = [(n, jnp.dtype(on_wire or anchor).itemsize) for (anchor, on_wire), n in chunks.items()]
            out = {overlap_kind(params): Payload(sizes)}
        if anchor_after_first_step:
            out[kind_name("all_reduce", params, label="anchor_average")] = payload_bytes(params)
        return out

    def flight_plan(params) -> tuple[dict[FlightKey, int], list[dict[FlightKey, list[int]]]]:
        """``overlap``'s buffers: per key ``(anchor dtype, wire dtype or None)`` (what ``pmean``
        gets: None sends the anchors' dtype) the elements of one chunk (a ``delay``-th of the
        largest fragment's leaves of that key, rounded up), and per fragment its leaves by key."""
        leaves = jax.tree.leaves(params)
        plans: list[dict[FlightKey, list[int]]] = []
        for part in layout_of(params).fragments:
            plans.append({})
            for i in part:
                dtype = jnp.dtype(leaves[i].dtype)
                anchor = anchor_type(dtype)
                plans[-1].setdefault((anchor, wire or (None if anchor == dtype else dtype)), []).append(i)
        chunks: dict[FlightKey, int] = {}
        for plan in plans:
            for key, ix in plan.items():
                size = -(-sum(math.prod(leaves[i].shape) for i in ix) // delay)
                chunks[key] = max(chunks.get(key, 0), size)
        return chunks, plans

    def fragment(tree, part: tuple[int, ...]):
        """The fragment's values: the tree itself when the fragment is all of it in order (DiLoCo:
        tree-structured outer optimizers and reducers, ``optax.masked``, work), else the list of
        its leaves."""
        leaves, treedef = jax.tree.flatten(tree)
        if part == tuple(range(len(leaves))):
            return tree
        return [leaves[i] for i in part]

    def checked_layout(x: SyncInput) -> OuterLayout:
        """The state's layout, which must be the one of these parameters and settings."""
        layout = x.sync_state.layout
        if layout != layout_of(x.params):
            raise ValueError(
                f"the outer state was made for {layout}, these parameters and settings give "
                f"{layout_of(x.params)}: initialise it with the same fragments and num_shards"
            )
        return layout

    def init_sync(params) -> OuterState:
        check_float_leaves(params, "outer_sync (diloco, slowmo, streaming_diloco)")
        layout = layout_of(params)
        leaves = jax.tree.leaves(params)
        anchors, outer_states = [], []
        for part in layout.fragments:
            mine = fragment(params, part)
            if sharded:  # filled from the parameters on the first step, where comm.index() is known
                dtype = anchor_type(flat_dtype(jax.tree.leaves(mine)))

                def zeros(*mine, dtype=dtype):  # made per device: split like the blocks will be
                    return jnp.zeros((block_size(mine),), dtype)

                groups = shard_groups(params, part)
                blocks = tuple(
                    on_blocks(zeros, axes, leaf_specs(params, ix), P(axes))(*[leaves[i] for i in ix])
                    for axes, ix in groups
                )
                anchors.append(blocks if model_sharding else blocks[0])
                outer_states.append(split_like_blocks(outer.init(anchors[-1]), blocks, groups))
            else:  # copies, not aliases: callers may donate params and state to the same jitted step
                anchors.append(jax.tree.map(lambda x: jnp.array(x, anchor_type(x.dtype), copy=True), mine))
                outer_states.append(outer.init(anchors[-1]))
        in_flight = ()
        if overlap:
            chunks = flight_plan(params)[0]
            in_flight = InFlight(
                pseudo=tuple(jnp.zeros(((delay + 1) * n,), key[0]) for key, n in chunks.items()),
                outgoing=tuple(jnp.zeros((n,), key[1] or key[0]) for key, n in chunks.items()),
                arrived=tuple(jnp.zeros((n,), key[1] or key[0]) for key, n in chunks.items()),
            )
        return OuterState(
            layout=layout,
            anchors=tuple(anchors),
            outer_states=tuple(outer_states),
            reducer_states=tuple(reducer.init(a) for a in anchors) if reducer is not None else (),
            in_flight=in_flight,
        )

    def my_blocks(values, part: tuple[int, ...]) -> Any:
        """This replica's block of the fragment (a tuple of blocks under ``model_sharding``)."""
        if comm.size != num_shards:
            raise ValueError(f"num_shards={num_shards} must equal the group size {comm.size}")
        leaves = jax.tree.leaves(values)
        dtype = anchor_type(flat_dtype([leaves[i] for i in part]))

        def cut(*mine):
            block = block_size(mine)
            flat = ravel_pytree(list(mine))[0].astype(dtype)
            padded = jnp.pad(flat, (0, block * num_shards - flat.shape[0]))
            return jax.lax.dynamic_slice(padded, (comm.index() * block,), (block,))

        blocks = tuple(
            on_blocks(cut, axes, leaf_specs(values, ix), P(axes))(*[leaves[i] for i in ix])
            for axes, ix in shard_groups(values, part)
        )
        return blocks if model_sharding else blocks[0]

    def begin(x: SyncInput) -> SyncInput:
        """The anchors, when the local steps start: the parameters (this replica's blocks when
        sharded), or with ``anchor_after_first_step`` the replicas' mean after the first step."""
        values = x.params
        if anchor_after_first_step:  # fairscale's quirk, made consistent: the replicas' mean
            values = comm.pmean(x.local)
            x = x._replace(ledger=x.ledger.record(kind_name("all_reduce", x.params, label="anchor_average")))
        anchors = []
        for part in checked_layout(x).fragments:
            anchors.append(my_blocks(values, part) if sharded else widen(fragment(values, part)))
        return x._replace(sync_state=x.sync_state._replace(anchors=tuple(anchors)))

    def sync(f: int):
        def branch(x: SyncInput) -> SyncInput:
            state: OuterState = x.sync_state
            layout = checked_layout(x)
            local = fragment(x.local, layout.fragments[f])
            anchor, ledger = state.anchors[f], x.ledger
            reducer_states = list(state.reducer_states)
            if sharded:  # the wire carries the parameters' dtype, the sum lands in the anchor's
                on_wire = flat_dtype(jax.tree.leaves(local))
                leaves = jax.tree.leaves(x.local)

                def scatter(block, *mine):
                    flat = ravel_pytree(list(mine))[0].astype(on_wire)
                    padded = jnp.pad(flat, (0, block.shape[0] * num_shards - flat.shape[0]))
                    total = comm.psum_scatter(padded).astype(block.dtype)
                    return block - total / jnp.asarray(num_shards, block.dtype)

                groups = shard_groups(x.local, layout.fragments[f])
                blocks = anchor if model_sharding else (anchor,)
                deltas = tuple(
                    on_blocks(scatter, axes, (P(axes), *leaf_specs(x.local, ix)), P(axes))(
                        block, *[leaves[i] for i in ix]
                    )
                    for (axes, ix), block in zip(groups, blocks)
                )
                delta = deltas if model_sharding else deltas[0]
                ledger = ledger.record(_sharded_kind("reduce_scatter", layout.fragments, f, on_wire))
            else:
                pseudo = jax.tree.map(lambda a, v: a - v.astype(a.dtype), anchor, local)
                if overlap:  # the background sends it over the next `delay` steps (`in_flight`)
                    return x._replace(sync_state=launch(x.params, f, pseudo, state))
                if reducer is None:  # on the wire in `dtype`, else in the parameters' own dtype
                    delta = jax.tree.map(
                        lambda d, v: comm.pmean(d, dtype=wire or (None if d.dtype == v.dtype else v.dtype)),
                        pseudo,
                        local,
                    )
                    ledger = ledger.record(Kind("all_reduce", _label(layout.fragments, f, local, wire)))
                else:
                    delta, reducer_states[f] = reducer.update(pseudo, reducer_states[f], anchor)
            state = outer_step(f, delta, state._replace(reducer_states=tuple(reducer_states)), x.step)
            x = x._replace(sync_state=state, ledger=ledger)
            return merge(f)(x) if delay == 0 else x

        return branch

    def outer_step(f: int, delta: Any, state: OuterState, inner_step: jax.Array) -> OuterState:
        """Fragment ``f``'s outer step on the averaged pseudo-gradient ``delta``."""
        anchor, outer_states = state.anchors[f], list(state.outer_states)
        step, outer_states[f] = outer.update(delta, outer_states[f], anchor, inner_step=inner_step)
        anchors = list(state.anchors)
        anchors[f] = optax.apply_updates(anchor, step)
        return state._replace(anchors=tuple(anchors), outer_states=tuple(outer_states))

    def overlap_kind(params) -> Kind:
        return Kind("all_reduce", dtype_label(params, wire), label="overlapped_all_reduce")

    def launch(params, f: int, pseudo: Any, state: OuterState) -> OuterState:
        """``overlap``: fragment ``f``'s pseudo-gradient into the in-flight buffers, and its first
        chunk out: the background all-reduces one chunk on each of the next ``delay`` steps."""
        chunks, plans = flight_plan(params)
        mine = dict(zip(state.layout.fragments[f], jax.tree.leaves(pseudo)))
        flight: InFlight = state.in_flight
        buffers, outgoing = list(flight.pseudo), list(flight.outgoing)
        for k, (key, n) in enumerate(chunks.items()):
            if key in plans[f]:
                flat = jnp.concatenate([mine[i].reshape(-1) for i in plans[f][key]])
                buffers[k] = jnp.pad(flat, (0, buffers[k].shape[0] - flat.shape[0]))
                outgoing[k] = _to_wire(buffers[k][:n], key, comm.size)
        return state._replace(in_flight=flight._replace(pseudo=tuple(buffers), outgoing=tuple(outgoing)))

    def landed(params, f: int, state: OuterState) -> Any:
        """``overlap``: fragment ``f``'s averaged pseudo-gradient on its merge step, when the last
        chunk's mean has just arrived, structured like its anchors."""
        chunks, plans = flight_plan(params)
        leaves, values = jax.tree.leaves(params), {}
        flight: InFlight = state.in_flight
        for k, (key, n) in enumerate(chunks.items()):
            last = _from_wire(flight.arrived[k], key, comm.size)
            mean = jax.lax.dynamic_update_slice(flight.pseudo[k], last, ((delay - 1) * n,))
            offset = 0
            for i in plans[f].get(key, []):
                size = math.prod(leaves[i].shape)
                values[i] = mean[offset : offset + size].reshape(leaves[i].shape)
                offset += size
        anchor = state.anchors[f]
        return jax.tree.unflatten(jax.tree.structure(anchor), [values[i] for i in state.layout.fragments[f]])

    def background(s: jax.Array, params: Any, state: OuterState, ledger: CommLedger):
        """``overlap``, on every step: the all-reduce of ``outgoing`` into ``arrived`` (a sum, the
        collective's own result); the chunk that arrived on the previous step written back as a
        mean, the next chunk made ``outgoing``.

        On the ``j``-th step after a fragment's sync (``j < delay``) the chunk is chunk ``j`` of
        its pseudo-gradient; on the others (``stride − delay`` per ``stride`` steps) a chunk that
        nothing reads. No conditional: XLA runs a collective concurrently with other work only
        outside one."""
        j = s % stride  # the last sync (of any fragment) was step s − j − 1
        sending = j < delay  # before the first sync: garbage written back, then overwritten by it
        flight: InFlight = state.in_flight
        pseudo, outgoing, arrived = [], [], []
        for k, (key, n) in enumerate(flight_plan(params)[0].items()):
            arrived.append(comm.psum(flight.outgoing[k]))
            back = jnp.where(sending & (j > 0), j - 1, delay) * n  # the previous step's chunk, or scratch
            mean = _from_wire(flight.arrived[k], key, comm.size)
            pseudo.append(jax.lax.dynamic_update_slice(flight.pseudo[k], mean, (back,)))
            following = jnp.minimum(j + 1, delay - 1) * n
            outgoing.append(_to_wire(jax.lax.dynamic_slice(pseudo[-1], (following,), (n,)), key, comm.size))
        flight = InFlight(tuple(pseudo), tuple(outgoing), tuple(arrived))
        ledger = ledger.record(overlap_kind(params))
        return state._replace(in_flight=per_replica(flight, comm)), ledger

    def merge(f: int):
        """Fragment ``f``'s local values ← ``α·local + (1 − α)·x₀`` (``x₀`` itself when α = 0)."""

        def branch(x: SyncInput) -> SyncInput:
            if overlap:  # the last chunk's all-reduce ran in this step's background
                landing = landed(x.params, f, x.sync_state)
                x = x._replace(sync_state=outer_step(f, landing, x.sync_state, x.step - delay))
            state: OuterState = x.sync_state
            part = checked_layout(x).fragments[f]
            values, treedef = jax.tree.flatten(x.local)
            anchor, ledger = jax.tree.leaves(state.anchors[f]), x.ledger
            if sharded:
                on_wire = flat_dtype([values[i] for i in part])

                def gather(block, *mine):
                    flat = comm.all_gather(block.astype(on_wire)).reshape(-1)
                    return ravel_pytree(list(mine))[1](flat[: sum(v.size for v in mine)])

                blocks = state.anchors[f] if model_sharding else (state.anchors[f],)
                merged: dict[int, jax.Array] = {}
                for (axes, ix), block in zip(shard_groups(x.local, part), blocks):
                    specs = leaf_specs(x.local, ix)
                    gathered = on_blocks(gather, axes, (P(axes), *specs), list(specs))
                    merged.update(zip(ix, gathered(block, *[values[i] for i in ix])))
                anchor = [merged[i] for i in part]
                ledger = ledger.record(_sharded_kind("all_gather", state.layout.fragments, f, on_wire))
            for i, a in zip(part, anchor):
                mixed = blend * values[i].astype(a.dtype) + (1 - blend) * a
                values[i] = a if blend == 0 else mixed.astype(values[i].dtype)
            agreed = part if blend == 0 else ()  # a blend keeps part of each replica's own values
            return x._replace(local=jax.tree.unflatten(treedef, values), ledger=ledger, agreed=agreed)

        return branch

    def schedule(s, num_syncs):
        phase = (-(s + 1)) % period  # fragment f syncs when (s + 1 + f·stride) mod H = 0
        index = jnp.where(phase % stride == 0, 1 + phase // stride, 0)
        if delay:  # its new anchor is merged delay steps later (never on another fragment's sync)
            merge_phase = (-(s - delay + 1)) % period
            merging = (merge_phase % stride == 0) & (s >= delay)
            index = jnp.where((index == 0) & merging, 1 + num_fragments + merge_phase // stride, index)
        return index

    fragment_indices = range(num_fragments)
    return periodic(
        inner,
        comm=comm,
        name="outer_sync (diloco, slowmo, streaming_diloco)",
        schedule=schedule,
        syncs=[sync(f) for f in fragment_indices] + ([merge(f) for f in fragment_indices] if delay else []),
        kinds=kinds,
        init_sync=init_sync,
        begin=begin if (sharded or anchor_after_first_step or warmup_steps) else None,
        background=background if overlap else None,
        warmup_steps=warmup_steps,
        dtype=dtype,
        check_start=check_start,
        nonfinite=nonfinite,
        exact_sync=exact_sync,
        # a merge sets the anchors (whole unless sharded); with a blend nothing is agreed
        agreed_values="never" if blend else "copy" if sharded else "anchors",
    )


def diloco_outer_optimizer(
    learning_rate: float = 0.7, momentum: float = 0.9, nesterov: bool = True
) -> optax.GradientTransformation:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum, lr 0.7, momentum 0.9."""
    return optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov)


@configured("diloco")
def diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation | None = None,
    *,
    comm: Communicator,
    period: int,
    reducer: optax.GradientTransformation | None = None,
    num_shards: int | None = None,
    model_sharding: ModelSharding | None = None,
    dtype: Any = None,
    anchor_dtype: Any = "float32",
    warmup_steps: int = 0,
    check_start: bool = True,
    nonfinite: str = "skip",
    exact_sync: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""DiLoCo: ``period`` local steps of ``inner``, then an outer step on the averaged displacement.

    With :math:`x_0` the anchor (parameters at the last sync, initially the parameters passed to
    ``init``) and :math:`x_i` replica :math:`i` after its local steps, on steps :math:`t` with
    :math:`(t+1) \bmod H = 0`:

    .. math::
        \Delta = \frac1W \sum_i (x_0 - x_i), \qquad
        x_0 \leftarrow x_0 + \mathrm{outer}(\Delta), \qquad x_i \leftarrow x_0 .

    ``outer = optax.sgd(1.0)`` gives local SGD (parameter averaging every ``H`` steps).

    Communication: on sync steps the ``reducer``'s collective on the pseudo-gradient — by default
    one all-reduce of every parameter element (ledger ``all_reduce[...]``), i.e. ``P/H`` per step;
    with ``reducer=compressed_allreduce(...)`` whatever that compressor sends, with error feedback
    kept per replica. With ``num_shards``: one reduce-scatter of ``P`` and one all-gather of
    ``P/W`` per sync. Nothing on other steps (a branch of ``lax.switch`` on the replicated step).

    Args:
      inner: the local optimizer (DiLoCo: AdamW).
      outer: the outer optimizer (default ``diloco_outer_optimizer()``: Nesterov SGD, lr 0.7,
        momentum 0.9).
      comm: all replicas.
      period: H, local steps between syncs (DiLoCo: 500).
      reducer, num_shards, model_sharding, dtype, anchor_dtype, warmup_steps, check_start, nonfinite,
        exact_sync: see
        ``outer_sync`` (16-bit parameters get float32 anchors and outer momentum by default).

    Example:
      >>> tx = diloco(optax.adamw(4e-4), comm=comm, period=500)

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
      arXiv:2311.08105.
    """
    return outer_sync(
        inner,
        outer,
        comm=comm,
        period=period,
        reducer=reducer,
        num_shards=num_shards,
        model_sharding=model_sharding,
        dtype=dtype,
        anchor_dtype=anchor_dtype,
        warmup_steps=warmup_steps,
        check_start=check_start,
        nonfinite=nonfinite,
        exact_sync=exact_sync,
    )


class SlowMoOuterState(NamedTuple):
    """State of the SlowMo outer step: the slow momentum buffer ``u``."""

    slow_momentum: optax.Updates


def slowmo_outer_optimizer(
    learning_rate: optax.ScalarOrSchedule, *, momentum: float = 0.5, slow_lr: float = 1.0
) -> optax.GradientTransformationExtraArgs:
    r"""fairscale's slow-momentum step on the pseudo-gradient :math:`\Delta = x_0 - \bar x`:

    .. math:: u \leftarrow \beta u + \Delta / \eta_t, \qquad x_0 \leftarrow x_0 - \alpha\,\eta_t\, u

    with :math:`\eta_t` the inner learning rate at the sync step (``inner_step`` extra argument).
    """

    def init_fn(params):
        return SlowMoOuterState(jax.tree.map(jnp.zeros_like, params))

    def update_fn(delta, state, params=None, *, inner_step=0, **extra):
        del params, extra
        lr = learning_rate(inner_step) if callable(learning_rate) else learning_rate
        u = jax.tree.map(lambda b, d: momentum * b + d / jnp.asarray(lr, d.dtype), state.slow_momentum, delta)
        step = jax.tree.map(lambda b: -jnp.asarray(slow_lr * lr, b.dtype) * b, u)
        return step, SlowMoOuterState(u)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@configured("slowmo")
def slowmo(
    inner: optax.GradientTransformation,
    *,
    comm: Communicator,
    period: int,
    learning_rate: optax.ScalarOrSchedule,
    momentum: float = 0.5,
    slow_lr: float = 1.0,
    anchor_after_first_step: bool = False,
    num_shards: int | None = None,
    model_sharding: ModelSharding | None = None,
    anchor_dtype: Any = "float32",
    warmup_steps: int = 0,
    check_start: bool = True,
    nonfinite: str = "skip",
    exact_sync: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""SlowMo (fairscale ``SlowMoDistributedDataParallel`` with LocalSGD base): local steps, and
    every ``period`` (τ) steps average the parameters and take a slow-momentum step.

    .. math::
        \bar x = \frac1W\sum_i x_i, \quad u \leftarrow \beta u + \frac{x_0 - \bar x}{\eta_t}, \quad
        x_0 \leftarrow x_0 - \alpha\,\eta_t\,u, \quad x_i \leftarrow x_0

    with :math:`\eta_t` the inner optimizer's current learning rate (pass the same float or
    schedule as ``learning_rate``). β = 0, α = 1 is local SGD. For fairscale's extra LocalSGD
    averaging every ``H`` steps between slow steps, use ``inner=local_sgd(..., period=H)``.

    Communication: one all-reduce of the parameters every τ steps (``all_reduce[...]``); with
    ``num_shards=W`` a reduce-scatter of ``P`` and an all-gather of ``P/W`` instead, and ``x₀``
    and ``u`` are sharded over the replicas (fairscale's memory-efficient, ZeRO-1-like layout, same
    numbers).

    Args:
      inner: the local optimizer.
      comm: all replicas.
      period: τ (fairscale default 48).
      learning_rate: the inner optimizer's learning rate (float or the same schedule).
      momentum: β (fairscale default 0.5).
      slow_lr: α (fairscale default 1.0).
      anchor_after_first_step: fairscale's quirk: ``x₀`` taken after the first local step (the
        first slow step then covers τ−1 steps), as the replicas' mean (fairscale: each process's
        own). Default: the parameters before training.
      num_shards: shard ``x₀`` and ``u`` over the ``num_shards = comm.size`` replicas (fairscale's
        ``memory_efficient``; static). None: every replica holds them whole.
      model_sharding: with ``num_shards``, the parameters' split over model axes (``outer_sync``).
      anchor_dtype: the least dtype of ``x₀`` and ``u`` (float32: 16-bit parameters keep them in
        float32; None: the parameters' dtype).
      warmup_steps, check_start, nonfinite, exact_sync: the engine's options (``outer_sync``).

    References:
      Wang, Tantia, Ballas, Rabbat, "SlowMo: Improving Communication-Efficient Distributed SGD with
      Slow Momentum", ICLR 2020. fairscale ``SlowMoDistributedDataParallel``.
    """
    check_number("momentum", momentum, 0, 1, open_high=True)
    if not callable(learning_rate):  # SlowMo divides by it
        check_number("learning_rate", learning_rate, 0, open_low=True, open_high=True)
    check_number("slow_lr", slow_lr, 0, open_low=True)
    return outer_sync(
        inner,
        slowmo_outer_optimizer(learning_rate, momentum=momentum, slow_lr=slow_lr),
        comm=comm,
        period=period,
        num_shards=num_shards,
        model_sharding=model_sharding,
        anchor_dtype=anchor_dtype,
        anchor_after_first_step=anchor_after_first_step,
        warmup_steps=warmup_steps,
        check_start=check_start,
        nonfinite=nonfinite,
        exact_sync=exact_sync,
    )


def streaming_diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation | None = None,
    *,
    num_fragments: int,
    **options: Any,
) -> optax.GradientTransformationExtraArgs:
    r"""Streaming DiLoCo: DiLoCo per fragment, the fragments' syncs staggered across the period;
    ``outer_sync`` with ``num_fragments`` fragments (its other options: ``comm``, ``period``,
    ``delay``, ``blend``, ``overlap``, ``fragments``, ``reducer``, ``num_shards``, ``dtype``, the
    engine's).

    The same ``P/H`` bytes per step on average as DiLoCo with ``F`` times lower peak; with ``delay``
    the paper's overlap (the new anchor merged ``delay`` steps after its all-reduce).

    Example:
      >>> tx = streaming_diloco(optax.adamw(4e-4), comm=comm, period=100, num_fragments=4, delay=5)

    References:
      Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a Distributed
      Free Lunch", arXiv:2501.18512.
    """
    return outer_sync(inner, outer, num_fragments=num_fragments, **options)


# The signature is outer_sync's with num_fragments required: help() shows every option, and the
# configuration agreement sees unpassed options at their defaults, as for every other transform.
streaming_diloco.__signature__ = inspect.signature(outer_sync).replace(
    parameters=[
        p.replace(default=inspect.Parameter.empty) if p.name == "num_fragments" else p
        for p in inspect.signature(outer_sync).parameters.values()
    ]
)
streaming_diloco = configured("streaming_diloco")(streaming_diloco)
