"""Decentralized training: gossip averaging with neighbours instead of a global all-reduce.

* ``decentralized_sgd``: D-PSGD (mlbench ``DecentralizedSGD``): local step, then mixing with the
  in-neighbours of the round, ``x_i ← Σ_j W_ij x_j`` (``W`` row-stochastic).
* ``sgp``: Stochastic Gradient Push (fairscale ``SlowMoDistributedDataParallel(SGP)``): push-sum
  with a column-stochastic ``W`` applied to the numerator ``x`` and the weight ``w``; the model the
  user sees is always the de-biased ``z = x / w``.

Both read a static ``optaxdist.topology.Topology``: round ``t mod period`` is a synchronization of
the periodic engine (a branch of its ``lax.switch``), each slot lowering to one ``comm.permute``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optaxdist._validate import check_bools, check_int
from optaxdist.accounting import CommLedger, Kind, payload_bytes
from optaxdist.agreement import configured
from optaxdist.comm.base import Communicator, canonical_comm_dtype, cast_to_wire, divides_first
from optaxdist.topology import Topology
from optaxdist.transforms._checks import check_comm
from optaxdist.transforms.periodic import SyncInput, every_leaf, periodic

PERMUTE_KIND = Kind("permute", "params")
WEIGHT_KIND = Kind("permute", "ps_weight")
GLOBAL_KIND = Kind("all_reduce", "global average")


def _check(comm, topology: Topology, average_period: int | None) -> int | None:
    """Validate the gossip family's common arguments; ``average_period`` as a Python int."""
    check_comm("comm", comm)
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be an optaxdist.topology.Topology, got {topology!r}")
    return None if average_period is None else check_int("average_period", average_period, 1)


def _check_size(comm: Communicator, topology: Topology) -> None:
    if comm.size != topology.n:
        raise ValueError(f"topology {topology.name!r} has n={topology.n} nodes but the group has {comm.size}")


def _mix(
    values: list[jax.Array],
    topology: Topology,
    r: int,
    comm: Communicator,
    *,
    push: bool,
    ledger: CommLedger,
    kinds: tuple[str, ...],
    wires: list[Any],
) -> tuple[list[jax.Array], list[jax.Array], CommLedger]:
    """Round ``r`` of ``topology``: ``(own, received, ledger)``, the self-weighted own values and
    the weighted sum of what arrived, so that the mixed value is ``own + received`` (kept apart
    for the delayed variant). ``push``: weights applied by the sender (push-sum); else by the
    receiver. ``wires``: each value's dtype on the wire (None: its own). Each slot in which this
    replica has an out-peer records one event of ``kinds``."""
    me = comm.index()
    self_w, slot_w = topology.send_weights(r) if push else topology.receive_weights(r)
    own = [v * jnp.asarray(self_w, v.dtype)[me] for v in values]
    received = [jnp.zeros_like(v) for v in values]
    for slot, perm in enumerate(topology.perms(r)):
        w = jnp.asarray(slot_w[slot])[me]
        if push:
            arrived = _permute_by_wire(comm, [v * w.astype(v.dtype) for v in values], perm, wires)
        else:
            arrived = [a * w.astype(a.dtype) for a in _permute_by_wire(comm, values, perm, wires)]
        received = [a + b for a, b in zip(received, arrived)]
        sends = jnp.asarray(np.isin(np.arange(topology.n), [p[0] for p in perm]))[me]
        for kind in kinds:
            ledger = ledger.record(kind, sends.astype(jnp.int32))
    return own, received, ledger


def _permute_by_wire(comm: Communicator, values: list[jax.Array], perm: Any, wires: list[Any]) -> list:
    """``comm.permute`` of each value sent in its wire dtype (None: its own), back in its dtype:
    one call for all of them, so that the communicator can send small ones together."""
    sent = [cast_to_wire(v, canonical_comm_dtype(d)) for v, d in zip(values, wires)]
    return [a.astype(v.dtype) for a, v in zip(comm.permute(sent, perm), values)]


def _gossip_schedule(topology: Topology, average_period: int | None):
    """Every step a round of the topology (``1 + s mod period``); with ``average_period=K`` every
    K-th step the exact average instead (the last synchronization)."""

    def schedule(s, num_syncs):
        index = 1 + s % topology.period
        if average_period:
            index = jnp.where((s + 1) % average_period == 0, num_syncs, index)
        return index

    return schedule


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Gossip:
    """``decentralized_sgd``'s synchronization state: static (no arrays); marks the state as a
    gossip state for ``resize_replicas``."""


class PushSumState(NamedTuple):
    """``sgp``'s synchronization state (``PeriodicState.sync_state``).

    Attributes:
      ps_weight: this replica's push-sum weight ``w`` (float32 scalar, per replica; 1 at start).
      in_flight: with ``overlap``, what arrived this step and is mixed in at the next (numerator
        leaves and weight); empty otherwise.
    """

    ps_weight: jax.Array
    in_flight: Any


@configured("decentralized_sgd")
def decentralized_sgd(
    inner: optax.GradientTransformation,
    *,
    comm: Communicator,
    topology: Topology,
    metropolis: bool = False,
    average_period: int | None = None,
    dtype: Any = None,
    warmup_steps: int = 0,
    check_start: bool = True,
    nonfinite: str = "skip",
    exact_sync: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""D-PSGD: a local step, then averaging with the round's in-neighbours.

    .. math:: x_i \leftarrow \sum_j W^{(t)}_{ij} \bigl(x_j + \mathrm{inner}(g_j)\bigr)

    with :math:`W^{(t)}` the mixing matrix of round :math:`s \bmod P` of ``topology`` (:math:`s` the
    step counted from the end of the warm-up; row
    :math:`i` = what replica :math:`i` receives). Uniform weights :math:`1/(d+1)` are doubly
    stochastic on regular graphs; ``metropolis=True`` uses Metropolis–Hastings weights so that
    irregular undirected graphs (star, ``from_neighbors``) stay doubly stochastic. With
    ``average_period=K``, every K-th step replaces the gossip by an exact all-reduce average.

    Communication: per step, for each slot of the round in which this replica has an out-peer, one
    point-to-point message of all parameters (``comm.permute``; ledger ``permute[params]``, ``P``
    bytes each). Independent of the number of replicas: a one-peer graph sends ``P`` per step
    where a ring all-reduce sends ``2(n−1)/n·P``. Global steps: one all-reduce of ``P``. ``P``
    counts the parameters in ``dtype``.

    Args:
      inner: the local optimizer (momentum stays local, as in mlbench).
      comm: the replicas; ``comm.size`` must equal ``topology.n``.
      topology: a static gossip graph (``optaxdist.topology``).
      metropolis: reweight undirected rounds with Metropolis–Hastings weights.
      average_period: exact global averaging every K steps (None: never).
      dtype: wire dtype of the messages and of the global averages (None: the parameters' dtype;
        ``bfloat16`` halves the bytes, each received value rounded to it).
      warmup_steps, check_start, nonfinite, exact_sync: the engine's options (``periodic``).

    References:
      Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms?", NeurIPS 2017.
      mlbench ``DecentralizedSGD``.
    """
    average_period = _check(comm, topology, average_period)
    wire = canonical_comm_dtype(dtype)
    check_bools(metropolis=metropolis)
    topo = topology.metropolis() if metropolis else topology
    if not topo.is_row_stochastic():
        raise ValueError(
            f"topology {topo.name!r} is not row-stochastic: D-PSGD's average would be biased; "
            "use sgp (push-sum) for directed graphs"
        )

    def kinds(params, inner_state):
        return {PERMUTE_KIND: payload_bytes(params, wire)} | (
            {GLOBAL_KIND: payload_bytes(params, wire)} if average_period else {}
        )

    def gossip(r: int):
        def sync(x: SyncInput) -> SyncInput:
            _check_size(comm, topo)
            leaves, treedef = jax.tree.flatten(x.local)
            own, received, ledger = _mix(
                leaves,
                topo,
                r,
                comm,
                push=False,
                ledger=x.ledger,
                kinds=(PERMUTE_KIND,),
                wires=[wire] * len(leaves),
            )
            mixed = [a + b for a, b in zip(own, received)]
            return x._replace(local=jax.tree.unflatten(treedef, mixed), ledger=ledger)

        return sync

    def average(x: SyncInput) -> SyncInput:
        mean = comm.pmean(x.local, dtype=wire)
        return x._replace(local=mean, ledger=x.ledger.record(GLOBAL_KIND), agreed=every_leaf(mean))

    return periodic(
        inner,
        comm=comm,
        name="decentralized_sgd",
        schedule=_gossip_schedule(topo, average_period),
        syncs=[gossip(r) for r in range(topo.period)] + ([average] if average_period else []),
        kinds=kinds,
        init_sync=lambda params: Gossip(),
        warmup_steps=warmup_steps,
        dtype=dtype,
        ledger_varies=True,
        check_start=check_start,
        nonfinite=nonfinite,
        exact_sync=exact_sync,
        agreed_values="copy" if average_period else "never",  # only the global average agrees
    )


@configured("sgp")
def sgp(
    inner: optax.GradientTransformation,
    *,
    comm: Communicator,
    topology: Topology,
    overlap: bool = False,
    average_period: int | None = None,
    dtype: Any = None,
    warmup_steps: int = 0,
    check_start: bool = True,
    nonfinite: str = "skip",
    exact_sync: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""Stochastic Gradient Push: push-sum gossip with de-biased parameters.

    The user's parameters are the de-biased model :math:`z_i = x_i / w_i`; the numerator
    :math:`x_i` and the weight :math:`w_i` (1 at start) are internal. Each step, with
    :math:`W^{(t)}` the column-stochastic mixing matrix of round :math:`s \bmod P` (:math:`s` the step
    counted from the end of the warm-up):

    .. math::
        x_i \leftarrow w_i z_i + \mathrm{inner}(g_i(z_i)), \qquad
        x_i \leftarrow \sum_j W_{ij} x_j, \quad w_i \leftarrow \sum_j W_{ij} w_j, \qquad
        z_i = x_i / w_i

    Because :math:`W` conserves mass, :math:`\sum_i x_i / \sum_i w_i` is the true average, and the
    :math:`z_i` converge to it even on directed, non-regular graphs (where plain averaging is
    biased). On regular graphs with uniform weights :math:`w \equiv 1` and SGP equals D-PSGD.

    ``overlap=True`` models OSGP: what a replica receives at step :math:`t` is mixed in at step
    :math:`t+1` (one step of staleness). ``average_period=K`` replaces every K-th gossip by the exact
    average :math:`\sum_i x_i / \sum_i w_i` (one all-reduce of the numerators and weights; weights
    reset to 1). fairscale's PushSum and PushPull orderings give the same numbers and messages in a
    static-permutation program: there is one.

    Communication: per step, for each slot in which this replica has an out-peer, one message of
    all parameters plus, unless the topology is doubly stochastic, its weight (ledgers
    ``permute[params]`` ``P`` bytes, ``permute[ps_weight]`` 4 bytes). Global steps: one all-reduce.
    ``P`` counts the numerators in ``dtype`` (float32 by default, whatever the parameters' dtype).

    Args:
      inner: the local optimizer.
      comm: the replicas; ``comm.size == topology.n``.
      topology: a column-stochastic gossip graph (fairscale's default:
        ``topology.npeer_dynamic_directed_exponential_graph(n)``).
      overlap: apply received mixing one step late (OSGP).
      average_period: exact global averaging every K steps.
      dtype: wire dtype of the numerators (None: float32); the weights always travel in float32.
        A narrower wire rounds the mass a replica receives, so ``Σ x_i`` is conserved only to
        that rounding.
      warmup_steps, check_start, nonfinite, exact_sync: the engine's options (``periodic``).

    References:
      Assran, Loizou, Ballas, Rabbat, "Stochastic Gradient Push for Distributed Deep Learning",
      ICML 2019. fairscale ``SlowMoDistributedDataParallel`` (SGP, PushSum, PushPull).
    """
    average_period = _check(comm, topology, average_period)
    check_bools(overlap=overlap)
    if not topology.is_column_stochastic():
        raise ValueError(f"topology {topology.name!r} is not column-stochastic: push-sum needs it")
    wire = canonical_comm_dtype(dtype) or jnp.dtype(jnp.float32)
    gossip_kinds = (PERMUTE_KIND, WEIGHT_KIND)  # the weight travels even where it stays 1

    def kinds(params, inner_state):
        out = {PERMUTE_KIND: payload_bytes(params, wire)}
        out |= {WEIGHT_KIND: 4}
        # the numerators and the float32 weight
        global_bytes = payload_bytes(params, wire) + payload_bytes(jax.ShapeDtypeStruct((), jnp.float32))
        return out | ({GLOBAL_KIND: global_bytes} if average_period else {})

    def init_sync(params) -> PushSumState:
        in_flight = ()
        if overlap:
            in_flight = (
                [jnp.zeros(x.shape, jnp.float32) for x in jax.tree.leaves(params)],
                jnp.zeros((), jnp.float32),
            )
        return PushSumState(ps_weight=jnp.ones((), jnp.float32), in_flight=in_flight)

    def numerator(x: SyncInput) -> tuple[list[jax.Array], Any]:
        """``x = w·z + update`` in float32 (``z``: the de-biased parameters), and the tree's def."""
        w = x.sync_state.ps_weight
        z, treedef = jax.tree.flatten(x.params)
        return [
            zi.astype(jnp.float32) * w + d.astype(jnp.float32) for zi, d in zip(z, jax.tree.leaves(x.update))
        ], treedef

    def gossip(r: int):
        def sync(x: SyncInput) -> SyncInput:
            _check_size(comm, topology)
            num, treedef = numerator(x)
            state: PushSumState = x.sync_state
            own, received, ledger = _mix(
                [*num, state.ps_weight],
                topology,
                r,
                comm,
                push=True,
                ledger=x.ledger,
                kinds=gossip_kinds,
                wires=[wire] * len(num) + [None],
            )
            in_flight = state.in_flight
            if overlap:  # mix in what arrived last step; keep this step's arrivals for the next
                late_x, late_w = in_flight
                mixed = [a + b for a, b in zip(own[:-1], late_x)] + [own[-1] + late_w]
                in_flight = (received[:-1], received[-1])
            else:
                mixed = [a + b for a, b in zip(own, received)]
            w = mixed[-1]
            z = jax.tree.unflatten(treedef, [xi / w for xi in mixed[:-1]])
            return x._replace(local=z, sync_state=PushSumState(w, in_flight), ledger=ledger)

        return sync

    def average(x: SyncInput) -> SyncInput:
        # the true average is Σx / Σw (a mean of the de-biased z_i would be biased), the mass still
        # in flight (overlap) included: it is folded in here, then nothing stays in flight
        num, treedef = numerator(x)
        state: PushSumState = x.sync_state
        w = state.ps_weight
        if overlap:
            late_x, late_w = state.in_flight
            num, w = [n + lx for n, lx in zip(num, late_x)], w + late_w
        # a 16-bit sum of W numerators could overflow: pmean divides first (Σx/Σw is the same)
        reduce = comm.pmean if divides_first(jnp.float32, wire) else comm.psum
        *sums, total_w = reduce(num, dtype=wire) + [reduce(w)]
        in_flight = jax.tree.map(jnp.zeros_like, state.in_flight)
        z = jax.tree.unflatten(treedef, [v / total_w for v in sums])
        state = PushSumState(jnp.ones((), jnp.float32), in_flight)
        return x._replace(
            local=z, sync_state=state, ledger=x.ledger.record(GLOBAL_KIND), agreed=every_leaf(z)
        )

    return periodic(
        inner,
        comm=comm,
        name="sgp",
        schedule=_gossip_schedule(topology, average_period),
        syncs=[gossip(r) for r in range(topology.period)] + ([average] if average_period else []),
        kinds=kinds,
        init_sync=init_sync,
        warmup_steps=warmup_steps,
        dtype=dtype,
        ledger_varies=True,
        check_start=check_start,
        nonfinite=nonfinite,
        exact_sync=exact_sync,
        agreed_values="copy" if average_period else "never",  # only the global average agrees
    )


def consensus_distance(params: Any, *, comm: Communicator) -> jax.Array:
    r"""Mean squared distance of the replicas from their average, :math:`\frac1W\sum_i \|x_i -
    \bar x\|^2`, identical on every replica (for logging). Two all-reduces (of the parameters and of
    one scalar); not counted in any optimizer ledger."""
    mean = comm.pmean(params)
    sq = sum(
        jnp.sum(jnp.square(x.astype(jnp.float32) - m.astype(jnp.float32)))
        for x, m in zip(jax.tree.leaves(params), jax.tree.leaves(mean))
    )
    return comm.pmean(sq)
