"""Decentralized training: gossip averaging with neighbours instead of a global all-reduce.

* ``decentralized_sgd``: D-PSGD (mlbench ``DecentralizedSGD``): local step, then mixing with the
  in-neighbours of the round, ``x_i ← Σ_j W_ij x_j`` (``W`` row-stochastic).
* ``sgp``: Stochastic Gradient Push (fairscale ``SlowMoDistributedDataParallel(SGP)``): push-sum
  with a column-stochastic ``W`` applied to the numerator ``x`` and the weight ``w``; the model the
  user sees is always the de-biased ``z = x / w``.

Both read a static ``optaxdist.topology.Topology``: round ``t mod period`` selects the static
permutations (``lax.switch``), each lowering to one ``comm.permute``.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optaxdist.accounting import CommLedger, payload_bytes, per_replica
from optaxdist.agreement import configured
from optaxdist.comm.base import Communicator
from optaxdist.topology import Topology
from optaxdist.transforms._checks import check_nonfinite, local_step
from optaxdist.transforms._start import check_identical_start, start_kinds

PERMUTE_KIND = "permute[params]"
WEIGHT_KIND = "permute[ps_weight]"
GLOBAL_KIND = "all_reduce[global average]"


def _check(comm, topology: Topology, global_every: int | None) -> None:
    if not isinstance(comm, Communicator):
        raise TypeError(f"comm must be an optaxdist Communicator, got {type(comm).__name__}")
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be an optaxdist.topology.Topology, got {topology!r}")
    if global_every is not None and (not isinstance(global_every, int) or global_every < 1):
        raise ValueError(f"global_every={global_every!r} must be None or an int ≥ 1")


def _check_size(comm: Communicator, topology: Topology) -> None:
    if comm.size != topology.n:
        raise ValueError(f"topology {topology.name!r} has n={topology.n} nodes but the group has {comm.size}")


def _gossip(
    values: list[jax.Array],
    topology: Topology,
    round_index: jax.Array,
    comm: Communicator,
    *,
    push: bool,
    ledger: CommLedger,
    kinds: tuple[str, ...],
) -> tuple[list[jax.Array], list[jax.Array], CommLedger]:
    """One gossip round (``lax.switch`` over the static rounds).

    Returns ``(own, received, ledger)``: the self-weighted own values and the weighted sum of what
    arrived, so that the mixed value is ``own + received`` (kept apart for the delayed variant).
    ``push``: weights applied by the sender (push-sum); else by the receiver.
    """
    me = comm.index()

    def one_round(r: int):
        def branch(operand):
            vals, led = operand
            self_w, slot_w = topology.send_weights(r) if push else topology.receive_weights(r)
            own = [v * jnp.asarray(self_w, v.dtype)[me] for v in vals]
            received = [jnp.zeros_like(v) for v in vals]
            for s, perm in enumerate(topology.perms(r)):
                w = jnp.asarray(slot_w[s])[me]
                if push:
                    arrived = comm.permute([v * w.astype(v.dtype) for v in vals], perm)
                else:
                    arrived = [a * w.astype(a.dtype) for a in comm.permute(vals, perm)]
                received = [a + b for a, b in zip(received, arrived)]
                sends = jnp.asarray(np.isin(np.arange(topology.n), [p[0] for p in perm]))[me]
                for kind in kinds:
                    led = led.record(kind, sends.astype(jnp.int32))
            return per_replica((own, received, led), comm)

        return branch

    own, received, ledger = jax.lax.switch(
        round_index % topology.period,
        [one_round(r) for r in range(topology.period)],
        (values, ledger),
    )
    return own, received, ledger


class DecentralizedSgdState(NamedTuple):
    """State of ``decentralized_sgd``: step (replicated), inner state (per replica), ledger (per
    replica: on irregular graphs replicas send different numbers of messages)."""

    gossip_step: jax.Array
    inner_state: optax.OptState
    gossip_ledger: CommLedger


@configured("decentralized_sgd")
def decentralized_sgd(
    inner: optax.GradientTransformation,
    *,
    comm: Communicator,
    topology: Topology,
    metropolis: bool = False,
    global_every: int | None = None,
    check_start: bool = True,
    nonfinite: str = "skip",
) -> optax.GradientTransformationExtraArgs:
    r"""D-PSGD: a local step, then averaging with the round's in-neighbours.

    .. math:: x_i \leftarrow \sum_j W^{(t)}_{ij} \bigl(x_j + \mathrm{inner}(g_j)\bigr)

    with :math:`W^{(t)}` the mixing matrix of round :math:`t \bmod P` of ``topology`` (row
    :math:`i` = what replica :math:`i` receives). Uniform weights :math:`1/(d+1)` are doubly
    stochastic on regular graphs; ``metropolis=True`` uses Metropolis–Hastings weights so that
    irregular undirected graphs (star, ``from_neighbors``) stay doubly stochastic. With
    ``global_every=K``, every K-th step replaces the gossip by an exact all-reduce average.

    Communication: per step, for each slot of the round in which this replica has an out-peer, one
    point-to-point message of all parameters (``comm.permute``; ledger ``permute[params]``, ``P``
    bytes each). Independent of the number of replicas: a one-peer graph sends ``P`` per step
    where a ring all-reduce sends ``2(n−1)/n·P``. Global steps: one all-reduce of ``P``.

    Args:
      inner: the local optimizer (momentum stays local, as in mlbench).
      comm: the replicas; ``comm.size`` must equal ``topology.n``.
      topology: a static gossip graph (``optaxdist.topology``).
      metropolis: reweight undirected rounds with Metropolis–Hastings weights.
      global_every: exact global averaging every K steps (None: never).
      check_start: raise on step 0 if the replicas' parameters differ.
      nonfinite: a local step whose update is not finite is skipped on this replica only
        (``"skip"``, the default: zero update, inner state kept, nothing sent, so non-finite
        gradients never reach any replica's state) or applied as it is (``"ignore"``, no cost).

    References:
      Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms?", NeurIPS 2017.
      mlbench ``DecentralizedSGD``.
    """
    _check(comm, topology, global_every)
    topo = topology.metropolis() if metropolis else topology
    if not topo.is_row_stochastic():
        raise ValueError(
            f"topology {topo.name!r} is not row-stochastic: D-PSGD's average would be biased; "
            "use sgp (push-sum) for directed graphs"
        )
    check_nonfinite(nonfinite)
    inner = optax.with_extra_args_support(inner)

    def kinds(params):
        out = {PERMUTE_KIND: payload_bytes(params)} | start_kinds(check_start, params)
        return out | ({GLOBAL_KIND: payload_bytes(params)} if global_every else {})

    def init_fn(params):
        return DecentralizedSgdState(
            gossip_step=jnp.zeros((), jnp.int32),
            inner_state=per_replica(inner.init(params), comm),
            gossip_ledger=comm.varying(CommLedger.create(kinds(params))),
        )

    def update_fn(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("decentralized_sgd needs params: call update(updates, state, params)")
        _check_size(comm, topo)
        t = comm.uniform(state.gossip_step)  # one round's branch runs, also under simulate
        ledger = check_identical_start(check_start, params, t, state.gossip_ledger, comm)
        u, inner_state = local_step(inner, updates, state.inner_state, params, nonfinite=nonfinite, **extra)
        leaves, treedef = jax.tree.flatten(optax.apply_updates(params, u))

        def gossip(led):
            own, received, led = _gossip(leaves, topo, t, comm, push=False, ledger=led, kinds=(PERMUTE_KIND,))
            return per_replica(([a + b for a, b in zip(own, received)], led), comm)

        def average(led):
            return per_replica((comm.pmean(leaves), led.record(GLOBAL_KIND)), comm)

        if global_every:
            mixed, ledger = jax.lax.cond((t + 1) % global_every == 0, average, gossip, ledger)
        else:
            mixed, ledger = gossip(ledger)
        out = [(m - p).astype(p.dtype) for m, p in zip(mixed, jax.tree.leaves(params))]
        return jax.tree.unflatten(treedef, out), DecentralizedSgdState(
            gossip_step=optax.safe_increment(t), inner_state=inner_state, gossip_ledger=ledger
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class SgpState(NamedTuple):
    """State of ``sgp``.

    Attributes:
      gossip_step: steps so far (int32, replicated).
      ps_weight: this replica's push-sum weight ``w`` (float32 scalar, per replica; 1 at start).
      inner_state: the inner optimizer's state (per replica).
      in_flight: with ``overlap``, what arrived this step and is mixed in at the next (numerator
        leaves and weight); empty otherwise.
      gossip_ledger: what this replica sent (per replica).
    """

    gossip_step: jax.Array
    ps_weight: jax.Array
    inner_state: optax.OptState
    in_flight: Any
    gossip_ledger: CommLedger


@configured("sgp")
def sgp(
    inner: optax.GradientTransformation,
    *,
    comm: Communicator,
    topology: Topology,
    ordering: Literal["push_sum", "push_pull"] = "push_sum",
    overlap: bool = False,
    global_every: int | None = None,
    check_start: bool = True,
    nonfinite: str = "skip",
) -> optax.GradientTransformationExtraArgs:
    r"""Stochastic Gradient Push: push-sum gossip with de-biased parameters.

    The user's parameters are the de-biased model :math:`z_i = x_i / w_i`; the numerator
    :math:`x_i` and the weight :math:`w_i` (1 at start) are internal. Each step, with
    :math:`W^{(t)}` the column-stochastic mixing matrix of round :math:`t \bmod P`:

    .. math::
        x_i \leftarrow w_i z_i + \mathrm{inner}(g_i(z_i)), \qquad
        x_i \leftarrow \sum_j W_{ij} x_j, \quad w_i \leftarrow \sum_j W_{ij} w_j, \qquad
        z_i = x_i / w_i

    Because :math:`W` conserves mass, :math:`\sum_i x_i / \sum_i w_i` is the true average, and the
    :math:`z_i` converge to it even on directed, non-regular graphs (where plain averaging is
    biased). On regular graphs with uniform weights :math:`w \equiv 1` and SGP equals D-PSGD.

    ``ordering="push_pull"`` is fairscale's PushPull (blocking send/receive pairs on bipartite
    graphs); in a static-permutation program both orderings give the same numbers and messages, so
    it only checks that the graph is bipartite. ``overlap=True`` models OSGP: what a replica
    receives at step :math:`t` is mixed in at step :math:`t+1` (one step of staleness).
    ``global_every=K`` replaces every K-th gossip by the exact average :math:`\sum_i x_i / \sum_i
    w_i` (one all-reduce of the numerators and weights; weights reset to 1).

    Communication: per step, for each slot in which this replica has an out-peer, one message of
    all parameters plus, unless the topology is doubly stochastic, its weight (ledgers
    ``permute[params]`` ``P`` bytes, ``permute[ps_weight]`` 4 bytes). Global steps: one all-reduce.

    Args:
      inner: the local optimizer.
      comm: the replicas; ``comm.size == topology.n``.
      topology: a column-stochastic gossip graph (fairscale's default:
        ``topology.npeer_dynamic_directed_exponential_graph(n)``).
      ordering: ``"push_sum"`` or ``"push_pull"`` (needs a bipartite topology).
      overlap: apply received mixing one step late (OSGP).
      global_every: exact global averaging every K steps.
      check_start: raise on step 0 if the replicas' parameters differ.
      nonfinite: a local step whose update is not finite is skipped on this replica only
        (``"skip"``, the default: zero update, inner state kept, nothing sent, so non-finite
        gradients never reach any replica's state) or applied as it is (``"ignore"``, no cost).

    References:
      Assran, Loizou, Ballas, Rabbat, "Stochastic Gradient Push for Distributed Deep Learning",
      ICML 2019. fairscale ``SlowMoDistributedDataParallel`` (SGP, PushSum, PushPull).
    """
    _check(comm, topology, global_every)
    if ordering not in ("push_sum", "push_pull"):
        raise ValueError(f"ordering={ordering!r}; allowed: 'push_sum', 'push_pull'")
    if ordering == "push_pull" and not topology.is_bipartite():
        raise ValueError(f"ordering='push_pull' needs a bipartite topology; {topology.name!r} is not")
    if not topology.is_column_stochastic():
        raise ValueError(f"topology {topology.name!r} is not column-stochastic: push-sum needs it")
    send_weight = not topology.is_doubly_stochastic()
    gossip_kinds = (PERMUTE_KIND, WEIGHT_KIND) if send_weight else (PERMUTE_KIND,)
    check_nonfinite(nonfinite)
    inner = optax.with_extra_args_support(inner)

    def kinds(params):
        # numerators travel in float32, whatever the parameters' dtype
        out = {PERMUTE_KIND: payload_bytes(params, jnp.float32)} | start_kinds(check_start, params)
        out |= {WEIGHT_KIND: 4} if send_weight else {}
        global_bytes = payload_bytes(params, jnp.float32) + 4  # float32 numerators and the weight
        return out | ({GLOBAL_KIND: global_bytes} if global_every else {})

    def init_fn(params):
        in_flight = ()
        if overlap:
            in_flight = (
                [jnp.zeros(x.shape, jnp.float32) for x in jax.tree.leaves(params)],
                jnp.zeros((), jnp.float32),
            )
        return SgpState(
            gossip_step=jnp.zeros((), jnp.int32),
            ps_weight=per_replica(jnp.ones((), jnp.float32), comm),
            inner_state=per_replica(inner.init(params), comm),
            in_flight=per_replica(in_flight, comm),
            gossip_ledger=comm.varying(CommLedger.create(kinds(params))),
        )

    def update_fn(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("sgp needs params: call update(updates, state, params)")
        _check_size(comm, topology)
        t, w = comm.uniform(state.gossip_step), state.ps_weight
        ledger = check_identical_start(check_start, params, t, state.gossip_ledger, comm)
        u, inner_state = local_step(inner, updates, state.inner_state, params, nonfinite=nonfinite, **extra)
        p_leaves, treedef = jax.tree.flatten(params)
        numerator = [
            (z.astype(jnp.float32) * w + d.astype(jnp.float32)) for z, d in zip(p_leaves, jax.tree.leaves(u))
        ]

        def gossip(operand):
            led, in_flight = operand
            own, received, led = _gossip(
                [*numerator, w], topology, t, comm, push=True, ledger=led, kinds=gossip_kinds
            )
            if overlap:  # mix in what arrived last step; keep this step's arrivals for the next
                late_x, late_w = in_flight
                mixed = [a + b for a, b in zip(own[:-1], late_x)] + [own[-1] + late_w]
                in_flight = (received[:-1], received[-1])
            else:
                mixed = [a + b for a, b in zip(own, received)]
            return per_replica((mixed[:-1], mixed[-1], led, in_flight), comm)

        def average(operand):
            led, in_flight = operand
            # the true average is Σx / Σw (a mean of the de-biased z_i would be biased)
            *sums, total_w = comm.psum([*numerator, w])
            mean = [s / total_w for s in sums]
            if overlap:  # nothing stays in flight across an exact average
                in_flight = jax.tree.map(jnp.zeros_like, in_flight)
            return per_replica((mean, jnp.ones((), jnp.float32), led.record(GLOBAL_KIND), in_flight), comm)

        operand = (ledger, state.in_flight)
        if global_every:
            x, w, ledger, in_flight = jax.lax.cond((t + 1) % global_every == 0, average, gossip, operand)
        else:
            x, w, ledger, in_flight = gossip(operand)
        z = [xi / w for xi in x]
        out = [(zi - p.astype(jnp.float32)).astype(p.dtype) for zi, p in zip(z, p_leaves)]
        return jax.tree.unflatten(treedef, out), SgpState(
            gossip_step=optax.safe_increment(t),
            ps_weight=w,
            inner_state=inner_state,
            in_flight=in_flight,
            gossip_ledger=ledger,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
