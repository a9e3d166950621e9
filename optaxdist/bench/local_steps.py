"""Cost of the local step and of the sync step of every periodic-synchronization transform.

Part of ``optaxdist bench --suite overhead`` (``--rows local-steps``). By default no model
(``model="none"``): every replica holds precomputed random gradients for a flat params pytree of
four square float32 matrices, and one step is ``tx.update`` + ``optaxdist.apply_updates``
(``optax.apply_updates``, then the ``exact_sync`` replacement on synchronizing steps): the
optimizer's own cost, the hardest case for a ratio. With ``model="mlp"`` every step (ours, the
plain and the hand-written ones alike) first takes the gradient of an MLP's cross-entropy
(64 → w → w → 10, ``w`` so that it has about the parameters asked for) on a batch of ``BATCH``
scikit-learn digits per replica: a training step, as the issue measured it ("a 100 k-parameter
model"). The inner optimizer is always
``optax.sgd(0.01, momentum=0.9)``; every transform runs with its defaults (``check_start=True``,
non-finite updates skipped, ``exact_sync=True``; ``VARIANTS`` turns each off, to attribute the
cost) and a period of
``PERIOD`` steps (gossip: a global average every ``PERIOD`` steps on a ring; DASO: 4 or 8 replicas
per node, a blocking global sync every ``PERIOD`` batches; its local step is a batch without the
node's gradient average, which Heat's rules with this cycle turn on for good at the first global
sync: the cost of DASO's step without communication, not of its every batch).

For each transform, one harness (``simulate``: vmap on one device, or ``mesh``: shard_map over one
device per replica) and one number of replicas, the row reports:

* **local step**: the jitted step called with a state whose step counter sits at a non-sync
  position (the counter fields are set with ``_replace``), against the **plain** step (the same
  inner optimizer, no communication) — target ratio ≤ 1.10 on a mesh, ≤ 1.2 under ``simulate``.
  Gossip transforms (``decentralized_sgd``, ``sgp``) gossip every step: their local step is the
  gossip step, also compared with plain + the same ring exchange written with ``lax.ppermute``.
* **sync step**: the same jitted step with the counter at a sync position, against plain + the
  same collective written by hand (``lax.pmean`` of the new parameters; for Streaming DiLoCo of
  the syncing fragment; for DASO's blocking sync a ``bfloat16`` sum over the nodes, sent as
  ``bfloat16`` on a mesh of any backend (``_bf16_sum_over_nodes``), and a broadcast within the
  node, a masked ``psum`` of the floats) — target ratio ≤ 1.1. Where the sync step does more
  than that collective (DiLoCo, SlowMo and Streaming DiLoCo take an outer optimizer step on
  their anchors; DASO broadcasts bit-exactly, summing the root's int32 bit patterns), also
  against the **hand-written algorithm** (``OuterByHand``: plain + ``pmean`` + the same outer
  step; ``DasoByHand``: the hand-written sync with the broadcast made so; no schedule, ledger or
  guard): what the engine adds to the algorithm's own work.
* **compile**: seconds of ``.lower(...).compile()`` of the transform's step; with
  ``--split-local-steps`` also of its local program, and the seconds of the first call that runs
  a synchronization (it traces and compiles that synchronization's program).
* **state bytes per parameter byte**: the optimizer state's array bytes per replica over the
  parameter bytes per replica (counters and ledgers included; ``fixed_state_bytes`` are the
  scalar and integer leaves but for the parameters' bit patterns DASO's exact sync keeps, so
  ``(state − fixed) / params`` is an exact multiple of the parameter-sized buffers). A separate
  table lists it for the non-periodic transforms too.

Timings: the inputs are placed on the mesh first (a timed call moves nothing), each function is
compiled and called once untimed, then the functions of a row are called ``repeats`` times in turn
(interleaved; each timed call follows an untimed call of the step a training loop makes before it:
with ``--donate`` a step between synchronizations, without it the same call); medians are reported
(every sample is kept in the JSON record, with the opcodes the transform's program has beyond the
hand-written sync). The clock stops when the parameters a call returned are ready
(``_wait_for_step``), as in a loop that reads a result of every step: the results of one program
are ready together, and a state's other arrays were ready before the call. That is checked after
the clock stops (``late_state_arrays``, with a warning if not 0; on the CPU mesh ``on_mesh`` waits
for a call's results itself, so there it is 0 by construction). A wait on every array of the state
would cost the host about 4 µs per array on the CPU mesh whatever the step did (DASO's state has 57
arrays, the plain step's 6): that measures the state's size, not the step.
Before timing, the ledgers confirm that the "local" state sends nothing and the "sync" state does.
The plain and hand-written steps are compiled once per harness and shared by its rows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optaxdist
from optaxdist._compat import manual_axes
from optaxdist.bench import models
from optaxdist.bench.data import load_dataset, random_normal
from optaxdist.bench.host_memory import host_malloc, minor_faults
from optaxdist.bench.overhead import hlo_summary, make_params
from optaxdist.comm.axis import all_reduce_widens
from optaxdist.comm.base import as_bits, sum_in_member_order
from optaxdist.transforms.periodic import AgreedParams

PERIOD = 30
LOCAL_T = 5  # a step counter value at a non-sync position of every schedule below
SYNC_T = PERIOD - 1  # (t + 1) % PERIOD == 0: a sync position
# local steps in a row, timed as one (``_time_donated``'s ``steps``): from LOCAL_T none syncs
# (Streaming DiLoCo's second fragment syncs at step 14)
LOOP = 8
LR = 0.01
FRAGMENTS = 2
TRANSFORMS = (
    "local_sgd",
    "diloco",
    "slowmo",
    "streaming_diloco",
    "decentralized_sgd",
    "sgp",
    "daso",
)
STATE_ONLY = ("allreduce", "powersgd_r4", "topk_1pct_ef")  # state-bytes table only
HARNESSES = ("simulate", "mesh")
MODELS = ("none", "mlp")  # where a step's gradients come from: given, or an MLP on a batch
BATCH = 32  # examples per replica in a step of model="mlp"
DIGITS_FEATURES, DIGITS_CLASSES = 64, 10
# Keyword arguments of the transforms per variant: "default" is what users get (the non-finite
# guard on); "nonfinite-ignore" is the engine alone, what the zero-cost targets are about (the
# guard's cost, when on, is stated apart); the others attribute the cost of the start check and of
# exact sync.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "no-start-check": {"check_start": False},
    "nonfinite-ignore": {"nonfinite": "ignore"},
    "no-exact-sync": {"exact_sync": False},
    "bare": {"check_start": False, "nonfinite": "ignore", "exact_sync": False},
}
FLAT = (optaxdist.REPLICA_AXIS,)
NODE, LOCAL = "node", "local"

Step = Callable[..., Any]
Params = dict[str, jax.Array]


def inner() -> optax.GradientTransformation:
    """The inner (local) optimizer of every row, and the plain step's optimizer."""
    return optax.sgd(LR, momentum=0.9)


def default_params(replicas: int) -> int:
    """The issue's sizes: 100k parameters per replica up to 64 replicas, 10k above."""
    return 100_000 if replicas <= 64 else 10_000


def hierarchy_shape(replicas: int) -> tuple[int, int]:
    """``(nodes, local_size)`` for DASO: 4 replicas per node up to 8 replicas, 8 above."""
    local = 4 if replicas <= 8 else 8
    if replicas % local:
        local = 1
    return replicas // local, local


# ---------------------------------------------------------------------------------------------
# harnesses


@dataclasses.dataclass(frozen=True)
class Harness:
    """Where the per-replica step runs: ``simulate`` (vmap) or ``mesh`` (shard_map), flat
    (``("replica",)``) or two-level (``("node", "local")``) axes."""

    name: str
    axes: tuple[str, ...]
    shape: tuple[int, ...]
    mesh: Any = None

    @property
    def replicas(self) -> int:
        return math.prod(self.shape)

    def wrap(self, step: Step, *, donate: bool = False, split: bool = False) -> Step:
        """The jitted function of stacked arguments; ``donate``: it reuses the buffers of its
        first two arguments (parameters and state) for its results; ``split``: the harness's
        ``split_local_steps``."""
        options = {"donate_argnums": (0, 1) if donate else (), "split_local_steps": split}
        if self.name == "simulate":
            if len(self.axes) == 1:
                return optaxdist.simulate(step, axis_name=self.axes[0], **options)
            return optaxdist.simulate(step, axis_name=self.axes, shape=self.shape, **options)
        return optaxdist.on_mesh(step, self.mesh, **options)

    def place(self, tree: Any) -> Any:
        """Stacked arrays split over the mesh (so that a timed call moves nothing first)."""
        if self.mesh is None:
            return tree
        return jax.device_put(tree, NamedSharding(self.mesh, P(self.axes)))


def make_harness(name: str, replicas: int, *, hierarchical: bool) -> Harness:
    """A harness of ``replicas`` replicas; raises ``RuntimeError`` for a mesh without the devices."""
    if name not in HARNESSES:
        raise ValueError(f"harness={name!r}; allowed: {HARNESSES}")
    axes, shape = ((NODE, LOCAL), hierarchy_shape(replicas)) if hierarchical else (FLAT, (replicas,))
    if name == "simulate":
        return Harness(name, axes, shape)
    devices = jax.devices()
    if len(devices) < replicas:
        raise RuntimeError(f"the mesh harness needs {replicas} devices, have {len(devices)}")
    if hierarchical:
        mesh = optaxdist.mesh_hierarchy(*shape, devices=devices[:replicas]).mesh
    else:
        mesh = jax.make_mesh(shape, axes, devices=devices[:replicas])
    return Harness(name, axes, shape, mesh)


# ---------------------------------------------------------------------------------------------
# the transforms, where their schedules sync, and the same collectives written by hand


def _ring_mix(params: Params) -> Params:
    """One undirected-ring gossip round with weights 1/3, by hand (``lax.ppermute``)."""
    n = jax.lax.axis_size(optaxdist.REPLICA_AXIS)
    right = [(i, (i + 1) % n) for i in range(n)]
    left = [(i, (i - 1) % n) for i in range(n)]
    third = jnp.float32(1 / 3)

    def one(x):
        ax = optaxdist.REPLICA_AXIS
        return x * third + jax.lax.ppermute(x, ax, right) * third + jax.lax.ppermute(x, ax, left) * third

    return jax.tree.map(one, params)


def _pmean(params: Params) -> Params:
    return jax.lax.pmean(params, optaxdist.REPLICA_AXIS)


def _pmean_fragment(params: Params) -> Params:
    """The all-reduce of Streaming DiLoCo's fragment 0 (the one syncing at ``SYNC_T``)."""
    leaves, treedef = jax.tree.flatten(params)
    first = optaxdist.balanced_fragments(params, FRAGMENTS)[0]
    mean = jax.lax.pmean([leaves[i] for i in first], optaxdist.REPLICA_AXIS)
    for i, m in zip(first, mean, strict=True):
        leaves[i] = m
    return jax.tree.unflatten(treedef, leaves)


def _node_mean(grads: Params) -> Params:
    """DASO's gradient average within the node, before the local step of a global sync."""
    return jax.lax.pmean(grads, LOCAL)


def _bf16_sum_over_nodes(leaves: list[jax.Array], member_order: bool = False) -> list[jax.Array]:
    """Each leaf's ``bfloat16`` sum over the nodes, sending ``bfloat16``. A ``lax.psum`` does that
    where the backend all-reduces ``bfloat16`` as such (GPUs), and under ``simulate``, where
    nothing crosses devices (there it rounds after each add: with more than 2 nodes its last bits
    may differ from DASO's, which adds in ``float32`` and rounds once). Between the devices of an
    XLA:CPU mesh it runs in ``float32``, twice the bytes; there, as DASO does: the leaves
    concatenated, an all-to-all of the 16-bit patterns (each node gets its block of every
    node's), the block summed in ``float32`` node by node and rounded once, and an all-gather of
    the blocks' bits. ``member_order``: under ``simulate`` too, where the backend widens, as
    DASO's communicator sums there: each node's block of the gathered values, summed so, then
    the blocks gathered."""
    on_mesh = NODE in manual_axes()
    if not all_reduce_widens(jnp.bfloat16) or not (on_mesh or member_order):
        return [jax.lax.psum(x.astype(jnp.bfloat16), NODE) for x in leaves]
    nodes = jax.lax.axis_size(NODE)
    flat = jnp.concatenate([x.astype(jnp.bfloat16).reshape(-1) for x in leaves])
    block = -(-flat.size // nodes)
    rows = jnp.pad(flat, (0, block * nodes - flat.size)).reshape(nodes, block)
    if on_mesh:
        bits = jax.lax.all_to_all(jax.lax.bitcast_convert_type(rows, jnp.uint16), NODE, 0, 0)
        mine = sum_in_member_order(jax.lax.bitcast_convert_type(bits, jnp.bfloat16))
        gathered = jax.lax.all_gather(jax.lax.bitcast_convert_type(mine, jnp.uint16), NODE)
        total = jax.lax.bitcast_convert_type(gathered, jnp.bfloat16).reshape(-1)
    else:  # nothing crosses devices: every node's block, picked from the gathered rows
        mine = sum_in_member_order(jax.lax.all_gather(rows, NODE)[:, jax.lax.axis_index(NODE)])
        total = jax.lax.all_gather(mine, NODE).reshape(-1)
    ends = np.cumsum([x.size for x in leaves])
    return [part.reshape(x.shape) for x, part in zip(leaves, jnp.split(total[: flat.size], ends[:-1]))]


def _daso_blocking_sync(params: Params, exact: bool = False) -> Params:
    """DASO's blocking global sync, by hand: a bf16 sum over the nodes (``_bf16_sum_over_nodes``)
    divided by their number, then a broadcast within the node from local index 0 (a masked
    ``psum``: of the floats, whose result every member shares but which can flush the root's
    subnormals and turn its −0 into +0; ``exact``: of their int32 bit patterns, as DASO's
    ``Communicator.broadcast`` and Heat's ``torch.distributed.broadcast`` give the root's bits,
    and the sum over the nodes added as DASO adds under ``simulate`` too)."""
    nodes = jax.lax.axis_size(NODE)
    leaves, treedef = jax.tree.flatten(params)
    root = jax.lax.axis_index(LOCAL) == 0

    def one(x, total):
        avg = (total / jnp.asarray(nodes, jnp.bfloat16)).astype(x.dtype)
        if exact:
            bits = as_bits(avg)
            summed = jax.lax.psum(jnp.where(root, bits, jnp.zeros_like(bits)), LOCAL)
            return jax.lax.bitcast_convert_type(summed, x.dtype)
        return jax.lax.psum(jnp.where(root, avg, jnp.zeros_like(avg)), LOCAL)

    totals = _bf16_sum_over_nodes(leaves, member_order=exact)
    return jax.tree.unflatten(treedef, [one(x, t) for x, t in zip(leaves, totals)])


@dataclasses.dataclass(frozen=True)
class OuterByHand:
    """DiLoCo's family written by hand, as a user would without the library: the plain step,
    then on the syncing fragment's leaves (Streaming DiLoCo: fragment 0 of ``fragments``; the
    others: every leaf) the mean of the new parameters (``lax.pmean``), the outer optimizer's step
    on ``Δ = x₀ − mean``, ``x₀ ← x₀ + step`` and the parameters set to ``x₀``. Its state is
    ``(inner state, anchors x₀, outer states)``, the anchors and outer states per fragment. No
    schedule, no ledger, no guard: it is the sync step's own work, the reference for what the
    engine adds to it."""

    outer: Callable[[], optax.GradientTransformation]
    fragments: int = 1

    def parts(self, params: Params) -> list[list[int]]:
        if self.fragments == 1:
            return [list(range(len(jax.tree.leaves(params))))]
        return [list(part) for part in optaxdist.balanced_fragments(params, self.fragments)]

    def init(self, params: Params) -> tuple:
        leaves = jax.tree.leaves(params)
        anchors = tuple([leaves[i] for i in part] for part in self.parts(params))
        return inner().init(params), anchors, tuple(self.outer().init(a) for a in anchors)

    def local(self, params: Params, state: tuple, grads: Params) -> tuple[Params, tuple]:
        """A step between synchronizations: the plain step, anchors and outer states unchanged."""
        inner_state, anchors, outer_states = state
        updates, inner_state = inner().update(grads, inner_state, params)
        return optax.apply_updates(params, updates), (inner_state, anchors, outer_states)

    def step(self, params: Params, state: tuple, grads: Params) -> tuple[Params, tuple]:
        params, (inner_state, anchors, outer_states) = self.local(params, state, grads)
        leaves, treedef = jax.tree.flatten(params)
        part = self.parts(params)[0]
        mean = jax.lax.pmean([leaves[i] for i in part], optaxdist.REPLICA_AXIS)
        delta = [a - m for a, m in zip(anchors[0], mean, strict=True)]
        step, outer_state = self.outer().update(delta, outer_states[0], anchors[0])
        synced = optax.apply_updates(anchors[0], step)
        for i, x in zip(part, synced, strict=True):
            leaves[i] = x
        state = (inner_state, (synced, *anchors[1:]), (outer_state, *outer_states[1:]))
        return jax.tree.unflatten(treedef, leaves), state


@dataclasses.dataclass(frozen=True)
class DasoByHand:
    """DASO's blocking global sync written by hand with its in-node broadcast bit-exact, as DASO
    makes it: the node's gradient average, the plain step, then ``_daso_blocking_sync(exact=True)``
    (the hand-written sync, ``hand_sync``, broadcasts the floats). No schedule, ledger, guard or
    exact-sync state: the sync step's own work, the reference for what the transform adds to it."""

    def init(self, params: Params) -> optax.OptState:
        return inner().init(params)

    def local(self, params: Params, state: optax.OptState, grads: Params) -> tuple[Params, optax.OptState]:
        """The batch before a global sync, as DASO's in the bench (Heat's rules average the node's
        gradients before every global sync): the plain step on the node's mean gradient."""
        updates, state = inner().update(_node_mean(grads), state, params)
        return optax.apply_updates(params, updates), state

    def step(self, params: Params, state: optax.OptState, grads: Params) -> tuple[Params, optax.OptState]:
        params, state = self.local(params, state, grads)
        return _daso_blocking_sync(params, exact=True), state


@dataclasses.dataclass(frozen=True)
class Case:
    """One transform: how to build it, the state fields that put its schedule on a local and on a
    sync step, and the collective its sync (and, for gossip, its local step) performs."""

    name: str
    build: Callable[..., optax.GradientTransformationExtraArgs]  # (replicas, **options)
    local_at: Mapping[str, int | bool]
    sync_at: Mapping[str, int | bool]
    hand_sync: Callable[[Params], Params]
    hand_local: Callable[[Params], Params] | None = None
    hand_sync_grads: Callable[[Params], Params] | None = None  # on the gradients, before the step
    # the sync step's whole algorithm by hand, where it does more than plain + hand_sync
    hand_algorithm: OuterByHand | DasoByHand | None = None
    hierarchical: bool = False
    settings: str = ""
    options: tuple[str, ...] = ("check_start", "nonfinite", "exact_sync")  # the VARIANTS options it takes

    def variant_options(self, variant: str) -> dict[str, Any]:
        """The keyword arguments of ``variant`` that this transform accepts."""
        return {k: v for k, v in VARIANTS[variant].items() if k in self.options}


def _flat_comm() -> optaxdist.AxisComm:
    return optaxdist.AxisComm(optaxdist.REPLICA_AXIS)


# DASO's schedule in the rows: no warm-up or cool-down epochs, a blocking global sync every PERIOD
# batches, after the node's gradient average (Heat's rules turn it on before every global sync, and
# with local_skip == global_skip never off again: the local rows set it off by hand).
DASO_SETTINGS = {
    "steps_per_epoch": 1000,
    "total_epochs": 10,
    "warmup_epochs": 0,
    "cooldown_epochs": 0,
    "first_cycle": (PERIOD, PERIOD, 0),
}


def _daso(replicas: int, **options: Any) -> optax.GradientTransformationExtraArgs:
    h = optaxdist.axis_hierarchy(*hierarchy_shape(replicas))
    return optaxdist.daso(inner(), local_comm=h.local, cross_comm=h.cross, **DASO_SETTINGS, **options)


def _gossip_case(name: str, factory: Callable[..., optax.GradientTransformationExtraArgs]) -> Case:
    """D-PSGD or SGP on a ring with an exact average every PERIOD steps; the local step gossips."""

    def build(n: int, **options: Any) -> optax.GradientTransformationExtraArgs:
        ring = optaxdist.topology.ring(n)
        return factory(inner(), comm=_flat_comm(), topology=ring, average_period=PERIOD, **options)

    return Case(
        name,
        build,
        {"step": LOCAL_T},
        {"step": SYNC_T},
        _pmean,
        hand_local=_ring_mix,
        settings=f"ring, average_period={PERIOD}",
    )


def cases() -> dict[str, Case]:
    """The periodic-synchronization transforms, in ``TRANSFORMS`` order."""
    comm = _flat_comm
    out = [
        Case(
            "local_sgd",
            lambda n, **o: optaxdist.local_sgd(inner(), comm=comm(), period=PERIOD, **o),
            {"step": LOCAL_T},
            {"step": SYNC_T},
            _pmean,
            settings=f"period={PERIOD}",
        ),
        Case(
            "diloco",
            lambda n, **o: optaxdist.diloco(inner(), comm=comm(), period=PERIOD, **o),
            {"step": LOCAL_T},
            {"step": SYNC_T},
            _pmean,
            hand_algorithm=OuterByHand(optaxdist.diloco_outer_optimizer),
            settings=f"period={PERIOD}, outer Nesterov 0.7/0.9",
        ),
        Case(
            "slowmo",
            lambda n, **o: optaxdist.slowmo(inner(), comm=comm(), period=PERIOD, learning_rate=LR, **o),
            {"step": LOCAL_T},
            {"step": SYNC_T},
            _pmean,
            hand_algorithm=OuterByHand(lambda: optaxdist.slowmo_outer_optimizer(LR)),
            settings=f"period={PERIOD}",
        ),
        Case(
            "streaming_diloco",
            lambda n, **o: optaxdist.streaming_diloco(
                inner(), comm=comm(), period=PERIOD, num_fragments=FRAGMENTS, **o
            ),
            {"step": LOCAL_T},
            {"step": SYNC_T},
            _pmean_fragment,
            hand_algorithm=OuterByHand(optaxdist.diloco_outer_optimizer, FRAGMENTS),
            settings=f"period={PERIOD}, {FRAGMENTS} fragments (sync: fragment 0)",
        ),
        _gossip_case("decentralized_sgd", optaxdist.decentralized_sgd),
        _gossip_case("sgp", optaxdist.sgp),
        Case(
            "daso",
            _daso,
            {"batch_in_epoch": LOCAL_T, "local_sync_next": False},
            {"batch_in_epoch": PERIOD, "local_sync_next": True},
            _daso_blocking_sync,
            hand_sync_grads=_node_mean,
            hand_algorithm=DasoByHand(),
            hierarchical=True,
            settings=f"blocking global sync every {PERIOD} batches after a node gradient average",
            options=("nonfinite", "exact_sync"),  # daso has no start check
        ),
    ]
    return {c.name: c for c in out}


def state_only_transforms() -> dict[str, Callable[[], optax.GradientTransformation]]:
    """Gradient-averaging transforms chained before the inner optimizer (state-bytes table)."""
    c = _flat_comm
    return {
        "allreduce": lambda: optax.chain(optaxdist.allreduce(comm=c()), inner()),
        "powersgd_r4": lambda: optax.chain(optaxdist.powersgd(comm=c(), rank=4), inner()),
        "topk_1pct_ef": lambda: optax.chain(
            optaxdist.compressed_allreduce(optaxdist.compress.top_k(fraction=0.01), comm=c()), inner()
        ),
    }


# ---------------------------------------------------------------------------------------------
# measuring


def _step(tx: optax.GradientTransformation) -> Step:
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optaxdist.apply_updates(params, updates, state), state  # optax's + sync_params

    return step


GradientsOf = Callable[[Params, Any], Params]


def given_gradients(params: Params, grads: Params) -> Params:
    """``model="none"``: a step's third argument is its gradients."""
    return grads


@functools.cache
def mlp_gradients(width: int) -> GradientsOf:
    """``model="mlp"``: the gradients of ``MLP((width, width))``'s cross-entropy on the step's
    third argument, a batch ``(x, y)`` (one function per width: the jitted steps are shared)."""
    model = models.MLP(hidden=(width, width))

    def gradients(params: Params, batch: tuple[jax.Array, jax.Array]) -> Params:
        x, y = batch
        return jax.grad(lambda p: models.cross_entropy(model, p, x, y))(params)

    return gradients


def _on_data(step: Step, gradients_of: GradientsOf) -> Step:
    """``step`` of ``(params, state, grads)`` as a step of ``(params, state, data)``, its
    gradients ``gradients_of(params, data)``."""

    def run(params, state, data):
        return step(params, state, gradients_of(params, data))

    return run


def _then(
    step: Step, collective: Callable[[Params], Params], on_grads: Callable[[Params], Params] | None = None
) -> Step:
    """``step`` followed by ``collective`` on the new parameters (the hand-written reference),
    after ``on_grads`` on the gradients if given."""

    def run(params, state, grads):
        params, state = step(params, state, grads if on_grads is None else on_grads(grads))
        return collective(params), state

    return run


def reference_step(
    harness: Harness,
    collective: Callable[[Params], Params] | None,
    donate: bool = False,
    on_grads: Callable[[Params], Params] | None = None,
    gradients_of: GradientsOf = given_gradients,
) -> Step:
    """The plain optax step (``collective=None``) or plain + a hand-written collective (after
    ``on_grads`` on the gradients), jitted once per harness and model: every row of a harness
    times the same executables."""
    return _reference_step(harness, collective, donate, on_grads, gradients_of)


@functools.cache  # positional only: the same step whichever way reference_step was called
def _reference_step(harness, collective, donate, on_grads, gradients_of) -> Step:
    step = _step(inner())
    step = step if collective is None else _then(step, collective, on_grads)
    return harness.wrap(_on_data(step, gradients_of), donate=donate)


def _at(state: Any, fields: Mapping[str, int | bool], early: int = 0) -> Any:
    """``state`` (stacked over replicas) with its schedule fields set on every replica, the
    counters ``early`` steps before."""
    shifted = {k: v if isinstance(v, bool) else v - early for k, v in fields.items()}
    return state._replace(**{k: jnp.full_like(getattr(state, k), v) for k, v in shifted.items()})


def state_bytes(state: Any, replicas: int) -> tuple[int, int]:
    """``(all bytes, fixed bytes)`` of one replica's share of a stacked state (or its shapes);
    fixed: scalar and non-floating leaves (counters, ledgers, flags), but for the parameters' bit
    patterns that exact sync keeps (DASO's ``AgreedParams.values``: a parameter-sized buffer)."""
    nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, AgreedParams))
    bits = {id(x) for a in nodes if isinstance(a, AgreedParams) for x in jax.tree.leaves(a.values)}
    total = fixed = 0
    for x in jax.tree.leaves(state):
        nbytes = int(x.size) * jnp.dtype(x.dtype).itemsize // replicas
        total += nbytes
        if len(x.shape) <= 1 or not (jnp.issubdtype(x.dtype, jnp.floating) or id(x) in bits):
            fixed += nbytes
    return total, fixed


def _state_entry(name: str, state: Any, replicas: int, param_bytes: int) -> dict[str, Any]:
    total, fixed = state_bytes(state, replicas)
    return {
        "transform": name,
        "state_bytes": total,
        "fixed_state_bytes": fixed,
        "param_bytes": param_bytes,
        "state_bytes_per_param_byte": total / param_bytes,
        "buffer_bytes_per_param_byte": (total - fixed) / param_bytes,
    }


@dataclasses.dataclass
class Inputs:
    """Stacked params and each replica's data of one size: its gradients (``model="none"``) or a
    batch of the model's (``"mlp"``), and how a step turns them into gradients."""

    params: Params
    data: Any
    gradients_of: GradientsOf
    parameters: int
    param_bytes: int  # per replica
    model: str = "none"


def mlp_width(n_params: int) -> int:
    """The hidden width ``w`` whose MLP 64 → w → w → 10 has the parameter count nearest ``n_params``
    (``w² + 76 w + 10`` parameters)."""
    count = lambda w: w * w + (DIGITS_FEATURES + 2 + DIGITS_CLASSES) * w + DIGITS_CLASSES  # noqa: E731
    w = max(1, math.isqrt(max(n_params, 0)))
    while w > 1 and count(w) > n_params:
        w -= 1
    return min((w, w + 1), key=lambda v: abs(count(v) - n_params))


def make_inputs(n_params: int, replicas: int, seed: int = 0, leaves: int = 4, model: str = "none") -> Inputs:
    """``replicas`` copies of the parameters and each replica's data. ``"mlp"``: ``leaves`` does
    not apply (the MLP has 6 arrays); each replica's batch is ``BATCH`` examples drawn (seeded,
    with replacement) from the digits' training split."""
    if model not in MODELS:
        raise ValueError(f"model={model!r}; allowed: {MODELS}")
    if model == "mlp":
        width = mlp_width(n_params)
        params = models.init_params(models.MLP(hidden=(width, width)), DIGITS_FEATURES, seed)
        params = optaxdist.replicate(params, replicas)
        digits = load_dataset("digits")
        picks = np.random.default_rng(seed).integers(0, len(digits.y_train), (replicas, BATCH))
        data = (jnp.asarray(digits.x_train[picks]), jnp.asarray(digits.y_train[picks]))
        gradients_of = mlp_gradients(width)
    else:
        params = optaxdist.replicate(make_params(n_params, leaves), replicas)
        keys = jax.random.split(jax.random.key(seed), len(params))
        data = {
            k: random_normal(kk, v.shape, v.dtype) for (k, v), kk in zip(params.items(), keys, strict=True)
        }
        gradients_of = given_gradients
    parameters = sum(int(x[0].size) for x in jax.tree.leaves(params))
    return Inputs(params, data, gradients_of, parameters, 4 * parameters, model)


def _hlo_extra(ours: Any, hand: Any) -> dict[str, Any]:
    """Instruction counts of two compiled programs and the opcodes ``ours`` has in excess."""
    h_ours, h_hand = hlo_summary(ours), hlo_summary(hand)
    ops = set(h_ours["opcodes"]) | set(h_hand["opcodes"])
    extra = {k: h_ours["opcodes"].get(k, 0) - h_hand["opcodes"].get(k, 0) for k in sorted(ops)}
    return {
        "ours_instructions": h_ours["instructions"],
        "hand_sync_instructions": h_hand["instructions"],
        "extra_in_ours": {k: v for k, v in extra.items() if v},
    }


def _timings(samples: Mapping[str, list[float]]) -> dict[str, float]:
    """Medians (ms) and the ratios the issue's targets are about."""
    ms = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    hand_local = ms.get("hand_local", ms["plain"])
    return {
        "local_ms": ms["local"],
        "plain_ms": ms["plain"],
        "local_ratio": ms["local"] / ms["plain"],
        "hand_local_ms": hand_local,
        "local_hand_ratio": ms["local"] / hand_local,
        "sync_ms": ms["sync"],
        "hand_sync_ms": ms["hand_sync"],
        "sync_ratio": ms["sync"] / ms["hand_sync"],
        "hand_algorithm_ms": ms.get("hand_algorithm"),
        "sync_algorithm_ratio": ms["sync"] / ms["hand_algorithm"] if "hand_algorithm" in ms else None,
        "loop_local_ms": ms.get("loop_local"),
        "loop_plain_ms": ms.get("loop_plain"),
        "loop_local_ratio": ms["loop_local"] / ms["loop_plain"] if "loop_local" in ms else None,
        "loop_hand_local_ms": ms.get("loop_hand_local"),
        "loop_local_hand_ratio": (
            ms["loop_local"] / ms["loop_hand_local"] if "loop_hand_local" in ms else None
        ),
    }


def measure_case(
    case: Case,
    harness: Harness,
    inputs: Inputs,
    *,
    repeats: int,
    variant: str = "default",
    donate: bool = False,
    split: bool = False,
) -> dict[str, Any]:
    """One row: local and sync step of ``case`` against plain and hand-written steps; with
    ``donate`` every step (ours and the references) reuses its parameters' and state's buffers,
    and each timed call follows the untimed step a training loop makes before it
    (``_time_donated``'s ``before``). With ``split`` ours runs under ``split_local_steps=True``;
    needs ``donate``."""
    options = case.variant_options(variant)
    tx, plain_tx, gradients_of = case.build(harness.replicas, **options), inner(), inputs.gradients_of
    ours = harness.wrap(_on_data(_step(tx), gradients_of), donate=donate, split=split)
    plain = reference_step(harness, None, donate, gradients_of=gradients_of)
    hands = {"hand_sync": reference_step(harness, case.hand_sync, donate, case.hand_sync_grads, gradients_of)}
    if case.hand_local is not None:
        hands["hand_local"] = reference_step(harness, case.hand_local, donate, gradients_of=gradients_of)
    state = harness.wrap(tx.init)(inputs.params)
    total, fixed = state_bytes(state, harness.replicas)

    params, data = harness.place(inputs.params), harness.place(inputs.data)
    local_state = harness.place(_at(state, case.local_at))
    sync_state = harness.place(_at(state, case.sync_at))
    plain_state = harness.place(harness.wrap(plain_tx.init)(inputs.params))

    t0 = time.perf_counter()
    compiled = ours.lower(params, local_state, data).compile()
    compile_s = time.perf_counter() - t0
    local_compile_s = local_compiled = None
    if split:  # compiled first, as the first local call would (timed: not yet in JAX's caches)
        t0 = time.perf_counter()
        local_compiled = ours.lower_local(params, local_state, data).compile()
        local_compile_s = time.perf_counter() - t0
    first_sync_s = _check_schedule(case, ours, params, local_state, sync_state, data)
    calls = {
        "local": (ours, (params, local_state, data)),
        "plain": (plain, (params, plain_state, data)),
        "sync": (ours, (params, sync_state, data)),
        **{k: (f, (params, plain_state, data)) for k, f in hands.items()},
    }
    if case.hand_algorithm is not None:
        by_hand = harness.wrap(_on_data(case.hand_algorithm.step, gradients_of), donate=donate)
        algorithm_state = harness.place(harness.wrap(case.hand_algorithm.init)(inputs.params))
        start_grads = harness.wrap(gradients_of)(params, data)  # the model's gradients at the start
        wrap = {"donate": donate, "split": split}
        _check_hand_algorithm(case, harness, tx, wrap, params, sync_state, algorithm_state, start_grads)
        calls["hand_algorithm"] = (by_hand, (params, algorithm_state, data))
    if donate:
        at = {"local": case.local_at, "sync": case.sync_at}

        def reset(name: str, state: Any, early: int) -> Any:
            return harness.place(_at(state, at[name], early)) if name in at else state

        before = predecessors(case, harness, ours, donate, gradients_of)
        samples, faults, late, _ = _time_donated(calls, repeats, reset, before)
        looped = {k: calls[k] for k in ("local", "plain", "hand_local") if k in calls}
        loop_samples, _, loop_late, ends = _time_donated(looped, repeats, reset, before, steps=LOOP)
        samples |= {f"loop_{k}": v for k, v in loop_samples.items()}
        late |= {f"loop_{k}": v for k, v in loop_late.items()}
        if _sync_events(case, ends["local"]) != _sync_events(case, local_state):
            raise RuntimeError(
                f"{case.name}: a synchronization ran in {LOOP} local steps from {dict(case.local_at)}"
            )
    else:
        samples, faults, late = _time_after_itself(calls, repeats)
    late_rows = sorted(k for k, v in late.items() if max(v))
    if late_rows:
        warnings.warn(
            f"{case.name}: arrays of the state were not ready when the parameters were, in {late_rows}: "
            "the clock stopped before the step was done",
            stacklevel=2,
        )
    if split and not ours.local_calls:  # gossip: every step ran a synchronization's program
        local_compile_s = local_compiled = None
    hand_compiled = hands["hand_sync"].lower(params, plain_state, data).compile()
    plain_compiled = plain.lower(params, plain_state, data).compile()
    return {
        "transform": case.name,
        "variant": variant,
        "options": options,
        "settings": case.settings,
        "harness": harness.name,
        "replicas": harness.replicas,
        "axes": list(harness.axes),
        "shape": list(harness.shape),
        "parameters": inputs.parameters,
        "leaves": len(jax.tree.leaves(inputs.params)),
        "model": inputs.model,
        "repeats": repeats,
        "donate": donate,
        **_timings(samples),
        "compile_s": compile_s,
        "split": split,
        "local_compile_s": local_compile_s,
        "first_sync_s": first_sync_s if split else None,
        "local_program_step_bytes": None if local_compiled is None else step_bytes(local_compiled),
        "state_bytes": total,
        "fixed_state_bytes": fixed,
        "param_bytes": inputs.param_bytes,
        "state_bytes_per_param_byte": total / inputs.param_bytes,
        "buffer_bytes_per_param_byte": (total - fixed) / inputs.param_bytes,
        "temp_bytes": _temp_bytes(compiled),
        "plain_temp_bytes": _temp_bytes(plain_compiled),
        "step_bytes": step_bytes(compiled),
        "plain_step_bytes": step_bytes(plain_compiled),
        "peak_bytes_in_use": peak_bytes_in_use(),
        "samples_s": samples,
        "faults_per_call": {k: statistics.median(v) for k, v in faults.items()},
        "late_state_arrays": {k: max(v) for k, v in late.items()},
        "hlo": _hlo_extra(compiled, hand_compiled),
    }


def predecessors(
    case: Case, harness: Harness, ours: Step, donate: bool, gradients_of: GradientsOf = given_gradients
) -> dict[str, Step]:
    """Row → the step a training loop makes before that row's step (``_time_donated``'s
    ``before``): ours, its own step (from one step earlier in its schedule: the step before a
    synchronization); the plain step and the hand-written local step, themselves; the hand-written
    sync, the hand-written step before it (gossip: the ring exchange; DASO: the plain step on the
    node's mean gradient, as ours averages the gradients over the node before a global sync;
    else the plain step); the hand-written algorithm, its local step."""
    plain = reference_step(harness, None, donate, gradients_of=gradients_of)
    out = {"local": ours, "sync": ours, "plain": plain}
    if case.hand_local is not None:
        ring = reference_step(harness, case.hand_local, donate, gradients_of=gradients_of)
        out["hand_local"] = out["hand_sync"] = ring
    elif case.hand_sync_grads is not None:
        out["hand_sync"] = reference_step(harness, _unchanged, donate, case.hand_sync_grads, gradients_of)
    else:
        out["hand_sync"] = plain
    if case.hand_algorithm is not None:
        local = _on_data(case.hand_algorithm.local, gradients_of)
        out["hand_algorithm"] = harness.wrap(local, donate=donate)
    return out


def _unchanged(params: Params) -> Params:
    """No collective (with ``reference_step``'s ``on_grads``: a step on transformed gradients)."""
    return params


def _copies(*trees: Any) -> tuple:
    """Fresh copies (same placement) of ``trees``, ready: what a donating call may consume."""
    return jax.block_until_ready(jax.tree.map(lambda x: x.copy(), trees))


Samples = dict[str, list[float]]  # per row name, one value per timed call: seconds or page faults


def _wait_for_step(params: Any) -> None:
    """Waits until a step is done: until the parameters it returned are ready (see the timings in
    the module's docstring)."""
    jax.block_until_ready(params)


def _late_arrays(state: Any) -> int:
    """How many arrays of ``state`` are not ready yet (after ``_wait_for_step``: 0 where the step
    is done), then waits for them."""
    late = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array) and not x.is_ready()]
    jax.block_until_ready(late)
    return len(late)


def _time_after_itself(
    calls: Mapping[str, tuple[Step, tuple]], repeats: int
) -> tuple[Samples, Samples, Samples]:
    """Seconds and page faults of each row's call on its own arguments (nothing donated), the
    rows in turn, each timed call right after an untimed one of itself: never right after another
    row's program (see ``_time_donated``); and the state's arrays not ready when the clock stopped."""
    samples: Samples = {k: [] for k in calls}
    faults: Samples = {k: [] for k in calls}
    late: Samples = {k: [] for k in calls}
    for i in range(repeats + 1):  # the first round warms up
        for name, (fn, args) in calls.items():
            jax.block_until_ready(fn(*args))
            f, t = minor_faults(), time.perf_counter()
            params, state = fn(*args)
            _wait_for_step(params)
            seconds, faults_now = time.perf_counter() - t, minor_faults() - f
            late_now = _late_arrays(state)
            if i > 0:
                samples[name].append(seconds)
                faults[name].append(faults_now)
                late[name].append(late_now)
    return samples, faults, late


def _time_donated(
    calls: Mapping[str, tuple[Step, tuple]],
    repeats: int,
    reset: Callable[[str, Any, int], Any],
    before: Mapping[str, Step],
    steps: int = 1,
) -> tuple[Samples, Samples, dict[str, Any]]:
    """Seconds per step of each row's calls with donated arguments, as a training loop makes
    them: each run of a row continues from the parameters and state its last run returned (its
    own copy of the arguments at first), follows an untimed call of ``before[name]``, the step a
    loop makes before it (``predecessors``; ours from its schedule one step earlier,
    ``reset(name, state, 1)``, small arrays set before the clock starts), and times ``steps``
    calls in a row, each dispatched as soon as the one before returns, with one wait at the end
    (``_wait_for_step``).

    So every timed call comes after the program it comes after in training, never after another
    row's: a program runs faster right after itself, and a synchronization right after another
    synchronization, whose collective left the devices' threads warm (on a CPU mesh that took up
    to a sixth off a hand-written sync). And a ``split_local_steps`` step finds its counters on
    the host, as it does in a loop. With ``steps`` > 1 the host's part of a call overlaps the
    device's work on the ones before it wherever the device is the slower (a GPU; on the CPU a
    call mostly runs as it is dispatched, and on a mesh of CPU devices ``on_mesh`` waits for each
    call's results). Returns the seconds and the host's page faults per step (``host_memory``), the
    state's arrays not ready when the clock stopped, and each row's last state (its ledgers count
    every call's communication)."""
    carried = {name: _copies(*args) for name, (_, args) in calls.items()}
    samples: Samples = {k: [] for k in calls}
    faults: Samples = {k: [] for k in calls}
    late: Samples = {k: [] for k in calls}
    for i in range(repeats + 1):  # the first round warms up
        for name, (fn, _) in calls.items():
            params, state, data = carried[name]
            state = jax.block_until_ready(reset(name, state, 1))
            params, state = jax.block_until_ready(before[name](params, state, data))
            f, t = minor_faults(), time.perf_counter()
            for _ in range(steps):
                params, state = fn(params, state, data)
            _wait_for_step(params)
            seconds, faults_now = time.perf_counter() - t, minor_faults() - f
            late_now = _late_arrays(state)
            if i > 0:
                samples[name].append(seconds / steps)
                faults[name].append(faults_now / steps)
                late[name].append(late_now)
            carried[name] = (params, state, data)
    return samples, faults, late, {name: state for name, (_, state, _) in carried.items()}


def _memory(compiled: Any) -> Any:
    """XLA's memory analysis of a compiled program, or None where the backend has none."""
    try:
        return compiled.memory_analysis()
    except Exception:  # noqa: BLE001 (not every backend or version has it)
        return None


def _temp_bytes(compiled: Any) -> int | None:
    """Scratch memory of a compiled program (XLA's memory analysis), where the backend reports it."""
    m = _memory(compiled)
    return None if m is None else int(m.temp_size_in_bytes)


def step_bytes(compiled: Any) -> int | None:
    """Device memory one call of a compiled step holds at once, at most (XLA's memory analysis,
    every backend): its arguments, its results that do not reuse a donated argument's buffer, and
    its scratch. Per device on a mesh; all replicas under ``simulate``."""
    m = _memory(compiled)
    if m is None:
        return None
    outputs = m.output_size_in_bytes - m.alias_size_in_bytes
    return int(m.argument_size_in_bytes + outputs + m.temp_size_in_bytes)


def peak_bytes_in_use() -> int | None:
    """The device's peak memory so far (``memory_stats()["peak_bytes_in_use"]``: GPU/TPU; None on
    the CPU, which keeps no such statistics). Cumulative over the process: a row's value covers it
    and every row before it."""
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return int(peak) if peak is not None else None


def _sync_events(case: Case, state: Any) -> int:
    """The synchronizations ``state``'s ledgers counted: every event (gossip: the global average's,
    its every step exchanging with the ring)."""
    by_kind = optaxdist.comm_stats(state).by_kind
    counted = [t for k, t in by_kind.items() if case.hand_local is None or k.collective == "all_reduce"]
    return sum(t.collectives for t in counted)


def _check_schedule(case: Case, step: Step, params, local_state, sync_state, data) -> float:
    """The two states are where they claim to be: the ledgers' event counts grow on the sync
    step and not on the local step (gossip: the global-average kind only). Returns the seconds of
    the sync step's call: the first call to run a synchronization (with ``split_local_steps``,
    the one that traces and compiles its program)."""

    before = _sync_events(case, local_state)
    if _sync_events(case, step(*_copies(params, local_state, data))[1]) != before:  # copies: donating
        raise AssertionError(f"{case.name}: the 'local' step at {dict(case.local_at)} communicated")
    args = _copies(params, sync_state, data)
    t0 = time.perf_counter()
    synced = jax.block_until_ready(step(*args))
    seconds = time.perf_counter() - t0
    if _sync_events(case, synced[1]) == _sync_events(case, sync_state):
        raise AssertionError(f"{case.name}: the 'sync' step at {dict(case.sync_at)} sent nothing")
    return seconds


def _check_hand_algorithm(
    case: Case, harness: Harness, tx: Any, wrap: Mapping[str, bool], params, sync_state, hand_state, grads
) -> None:
    """Two sync steps in a row of the hand-written algorithm give the parameters two of ``tx``'s
    give from the same start (anchors at the parameters, zero momenta), up to rounding: the second
    starts from the outer state the first left, so the outer optimizer's settings count (from
    zero momentum SlowMo's first step is the mean whatever its learning rate). Both take the same
    given ``grads``: a model's gradient at parameters that differ by rounding can differ by more
    (a ReLU at its kink), and this checks the algorithms' arithmetic. ``wrap``: the timed step's
    ``donate`` and ``split``."""
    ours = harness.wrap(_step(tx), **wrap)
    by_hand = harness.wrap(case.hand_algorithm.step, donate=wrap["donate"])
    mine, theirs = (params, sync_state), (params, hand_state)
    for sync in range(2):
        mine = ours(*_copies(*mine, grads))
        mine = (mine[0], harness.place(_at(mine[1], case.sync_at)))
        theirs = by_hand(*_copies(*theirs, grads))
        for a, b in zip(jax.tree.leaves(mine[0]), jax.tree.leaves(theirs[0]), strict=True):
            if not jnp.allclose(a, b, rtol=1e-5, atol=1e-6):
                raise AssertionError(
                    f"{case.name}: the hand-written algorithm's sync step {sync} computes other parameters"
                )


def measure_state_bytes(
    n_params: int, replicas: int = 8, *, leaves: int = 4, model: str = "none"
) -> list[dict[str, Any]]:
    """State bytes per parameter byte of every transform, on the parameters of ``make_inputs``
    (shapes only: nothing is computed)."""
    inputs = make_inputs(n_params, replicas, leaves=leaves, model=model)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), inputs.params)
    rows = []
    for case in cases().values():
        harness = make_harness("simulate", replicas, hierarchical=case.hierarchical)
        state = jax.eval_shape(harness.wrap(case.build(replicas).init), abstract)
        rows.append(_state_entry(case.name, state, replicas, inputs.param_bytes))
    flat = make_harness("simulate", replicas, hierarchical=False)
    for name, build in state_only_transforms().items():
        state = jax.eval_shape(flat.wrap(build().init), abstract)
        rows.append(_state_entry(name, state, replicas, inputs.param_bytes))
    for row in rows:
        row["parameters"] = inputs.parameters
    return rows


def run_local_steps(
    *,
    replica_counts: Sequence[int] = (8,),
    harnesses: Sequence[str] = ("simulate",),
    transforms: Sequence[str] = TRANSFORMS,
    variants: Sequence[str] = ("default",),
    n_params: int | None = None,
    leaves: int = 4,
    model: str = "none",
    repeats: int = 11,
    donate: bool = False,
    split: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Every transform × harness × replica count; mesh rows only where the devices exist.

    Each transform runs in every ``VARIANTS`` entry of ``variants`` that changes one of its
    options (a variant equal to one already run for that transform is left out).

    ``split``: the transforms' steps run under ``split_local_steps=True`` (needs ``donate``).
    ``leaves``: the parameters' arrays per replica (``n_params`` spread over them).
    ``model``: where a step's gradients come from (``MODELS``: ``"none"``, given; ``"mlp"``, an
    MLP of about ``n_params`` parameters on a batch of ``BATCH`` digits per replica).

    Returns the ``local_steps`` part of the overhead record (``results``: timing rows,
    ``state_bytes``: the state table per parameter count, ``skipped``: rows that could not run).
    """
    if split and not donate:
        raise ValueError("split=True (--split-local-steps) needs donate=True (--donate)")
    if model == "mlp" and leaves != 4:
        raise ValueError(
            f"leaves={leaves} (--local-leaves): the MLP has its own arrays; only with model='none'"
        )
    unknown = [t for t in transforms if t not in TRANSFORMS] + [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(
            f"unknown transforms or variants {unknown}; allowed: {TRANSFORMS}, {tuple(VARIANTS)}"
        )
    table = cases()
    rows, skipped, sizes = [], [], {}
    for replicas in replica_counts:
        size = n_params or default_params(replicas)
        inputs = make_inputs(size, replicas, leaves=leaves, model=model)
        sizes[inputs.parameters] = size
        for harness_name in harnesses:
            if harness_name == "mesh" and len(jax.devices()) < replicas:
                skipped.append(f"mesh × {replicas}: {len(jax.devices())} devices")
                if progress:
                    print(
                        f"[local-steps] skip mesh × {replicas} ({len(jax.devices())} devices)",
                        file=sys.stderr,
                    )
                continue
            for name in transforms:
                case = table[name]
                harness = make_harness(harness_name, replicas, hierarchical=case.hierarchical)
                for variant in _distinct_variants(case, variants):
                    if progress:
                        print(
                            f"[local-steps] {name} [{variant}], {harness_name} × {replicas}, "
                            f"{inputs.parameters} params ...",
                            file=sys.stderr,
                            flush=True,
                        )
                    rows.append(
                        measure_case(
                            case,
                            harness,
                            inputs,
                            repeats=repeats,
                            variant=variant,
                            donate=donate,
                            split=split,
                        )
                    )
    state_table = [
        row for size in sizes.values() for row in measure_state_bytes(size, leaves=leaves, model=model)
    ]
    return {
        "period": PERIOD,
        "platform": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "peak_bytes_in_use": peak_bytes_in_use(),
        "inner": f"optax.sgd({LR}, momentum=0.9)",
        "local_step_counter": LOCAL_T,
        "sync_step_counter": {"default": SYNC_T, "daso": PERIOD},
        "donate": donate,
        "split": split,
        "host_malloc": host_malloc(),
        "leaves": leaves if model == "none" else None,
        "model": model,
        "batch": BATCH if model == "mlp" else None,
        "results": rows,
        "state_bytes": state_table,
        "skipped": skipped,
    }


def _distinct_variants(case: Case, variants: Sequence[str]) -> list[str]:
    """``variants`` without those that give ``case`` the same options as an earlier one."""
    seen, out = [], []
    for v in variants:
        options = case.variant_options(v)
        if options not in seen:
            seen.append(options)
            out.append(v)
    return out


def _compile(row: Mapping[str, Any]) -> str:
    parts = [row["compile_s"], row.get("local_compile_s"), row.get("first_sync_s")]
    while parts[-1] is None:  # rows without the split; gossip's, without a local program: "–"
        parts.pop()
    return " + ".join(_number(x, 2) for x in parts)


def _parameters(row: Mapping[str, Any]) -> str:
    """Per replica; in how many arrays where that is not the default 4."""
    leaves = row.get("leaves", 4)
    return f"{row['parameters']:,}" + ("" if leaves == 4 else f" in {leaves}")


def _number(x: float | None, digits: int) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _mb(nbytes: int | None) -> str:
    return "–" if nbytes is None else f"{nbytes / 2**20:.1f}"


def _local_mb(row: Mapping[str, Any]) -> str:
    local = row.get("local_program_step_bytes")
    return "" if local is None else f" ({_mb(local)})"


def _faults(row: Mapping[str, Any]) -> str:
    faults = row.get("faults_per_call")
    return "–" if faults is None else " / ".join(f"{faults[k]:,.0f}" for k in ("local", "sync", "plain"))


def format_local_steps(section: Mapping[str, Any]) -> str:
    """Markdown tables: the timing rows, then state bytes per parameter byte."""
    if section.get("donate"):
        out = [
            "every step donates its parameters and state (--donate); each timed step follows the "
            "untimed step a training loop makes before it (ours: its own, one step earlier in its "
            "schedule; a hand-written sync: the hand-written step before it); loop: "
            f"{LOOP} local steps in a row with one wait at the end, per step (hand: the "
            "hand-written local step, else plain)",
            "",
        ]
    else:
        out = ["each timed call follows an untimed call of itself (nothing donated; a sync after a sync)", ""]
    if section.get("model") == "mlp":
        out += [
            f"every step computes its gradients: an MLP 64 → w → w → 10 on {section['batch']} digits "
            "per replica (its cross-entropy's gradient), then the update",
            "",
        ]
    out += [
        "page faults: the host's minor page faults per call, medians (a first write to memory the C "
        "allocator took from the kernel; host malloc: "
        f"{section.get('host_malloc', 'system')}, --host-malloc)",
        "",
    ]
    if section.get("split"):
        out += [
            "the transforms' steps run under split_local_steps=True (--split-local-steps); compile "
            "s: general program + local program + first sync call (– where a row has no local "
            "program); step MB: general program (the local program a local call runs) / plain",
            "",
        ]
    out += [
        "| transform | harness | replicas | parameters | local ms | plain ms | local / plain | "
        "hand local ms | local / hand | sync ms | hand sync ms | sync / hand | hand algorithm ms | "
        "sync / hand algorithm | loop local ms | loop local / plain | loop local / hand | compile s | "
        "state B / param B | step MB / plain MB | peak MB | page faults local / sync / plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in section["results"]:
        shape = "×".join(map(str, r["shape"]))
        name = r["transform"] + ("" if r["variant"] == "default" else f" [{r['variant']}]")
        out.append(
            f"| {name} | {r['harness']} | {shape} | {_parameters(r)} | "
            f"{r['local_ms']:.3f} | {r['plain_ms']:.3f} | {r['local_ratio']:.2f} | "
            f"{r['hand_local_ms']:.3f} | {r['local_hand_ratio']:.2f} | {r['sync_ms']:.3f} | "
            f"{r['hand_sync_ms']:.3f} | {r['sync_ratio']:.2f} | {_number(r['hand_algorithm_ms'], 3)} | "
            f"{_number(r['sync_algorithm_ratio'], 2)} | {_number(r.get('loop_local_ms'), 3)} | "
            f"{_number(r.get('loop_local_ratio'), 2)} | "
            f"{_number(r.get('loop_local_hand_ratio') or r.get('loop_local_ratio'), 2)} | {_compile(r)} | "
            f"{r['state_bytes_per_param_byte']:.3f} | {_mb(r.get('step_bytes'))}{_local_mb(r)} / "
            f"{_mb(r.get('plain_step_bytes'))} | {_mb(r.get('peak_bytes_in_use'))} | {_faults(r)} |"
        )
    out += [
        "",
        "| transform | parameters | state B / param B | parameter-sized buffers | fixed bytes |",
        "|---|---|---|---|---|",
    ]
    for r in section["state_bytes"]:
        out.append(
            f"| {r['transform']} | {r['parameters']:,} | {r['state_bytes_per_param_byte']:.4f} | "
            f"{r['buffer_bytes_per_param_byte']:.4f} | {r['fixed_state_bytes']} |"
        )
    if section["skipped"]:
        out += ["", "skipped: " + "; ".join(section["skipped"])]
    return "\n".join(out)
