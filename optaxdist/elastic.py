"""Elastic restart: map a saved N-replica state to another number of replicas.

``resize_replicas`` works on *stacked* trees (a leading replica axis of length N, the layout of
``simulate`` / ``on_mesh`` and of ``optaxdist.checkpoint.restore_stacked``), on the host, with
NumPy. Each leaf follows a rule chosen from the state *type* that holds it (the table ``RULES``
below, one entry per optaxdist state class); leaves of other types (plain optax states such as
``ScaleByAdamState``, tuples, dicts) follow the rule of their container. The rules:

==============  ==========================================================================
rule            what happens to rows ``x[0..N)`` when going to ``M`` replicas
==============  ==========================================================================
``replicated``  all rows must be identical (else ``ValueError`` naming the leaf); row 0 is
                copied to every new replica. Counters, schedules, loss scales, anchors, outer
                momentum, PowerSGD's ``Q``.
``average``     per-replica values (parameters, inner optimizer states): identical rows are kept
                as they are; otherwise floating-point leaves become their mean (computed in
                float64, rounded once). Non-float leaves that differ (per-replica counters,
                integer PRNG keys): new replica ``j`` takes old row ``j mod N``; typed PRNG keys
                take ``fold_in(old[j mod N], j // N)`` so that no two new replicas share a key.
``residual``    error-feedback residuals: redistributed so that their sum over replicas is
                preserved *exactly* (as a real number). ``M ≥ N``: old rows kept, new rows
                zero. ``M < N``: the N rows are turned into an error-free expansion (TwoSum
                passes, Ogita–Rump–Oishi) whose non-zero terms are packed into the M rows, the
                float sum on replica 0. If some element needs more than M terms (rare;
                always possible for ``M = 1``), ``ValueError`` unless ``exact_residuals=False``
                (then the leftover terms are added to row 0, rounded).
``sum``         per-replica partial sums whose total is what matters (DASO's epoch loss sum and
                count): the same exact redistribution as ``residual`` (integers: total on row 0).
``ledger``      ``CommLedger`` counts: kept when all replicas agree (every transform but gossip on
                irregular graphs); otherwise new replica ``j`` takes old row ``j mod N``.
==============  ==========================================================================

Algorithm-specific rules:

* ``PushSumState`` (``sgp``): the parameters become the exact push-sum average
  ``(Σ_i w_i z_i + Σ_i in_flight_x_i) / (Σ_i w_i + Σ_i in_flight_w_i)`` (what ``average_period``
  computes), push-sum weights are renormalised to 1, nothing stays in flight.
* ``OuterState`` with ``num_shards`` (memory-efficient SlowMo/DiLoCo/Streaming DiLoCo): each
  fragment's anchor and outer state blocks are concatenated and re-split into ``M`` blocks of
  ``ceil(P_f / M)`` elements; the static payloads of the reduce-scatter / all-gather ledger kinds
  are recomputed for ``M``.
* ``InFlight`` (``streaming_diloco(overlap=True)``, an all-reduce in chunks under way): the
  pseudo-gradient in flight becomes its mean over the replicas (the chunks already averaged stay
  as they are), and the chunks on the wire are rescaled for ``M`` replicas, so the merge takes
  the outer step on the mean, as a sync would have.
* ``DasoState``: ``M`` must be a multiple of ``node_size=`` (the new configuration's replicas per
  node, DASO's ``local_comm`` size); a resize with a pending (not yet merged) cross-node send is
  refused (resize at an epoch end, where DASO is blocking); the unused pending-sum buffer is
  zeroed; the rotating group indices ``send_group`` / ``previous_send_group`` are taken modulo
  ``node_size``.
* Gossip states (``decentralized_sgd``, ``sgp``): ``topology=`` must accept ``M``.

A resize is meant to happen at a synchronisation point (after an all-reduce step, a local-SGD or
DiLoCo sync, an epoch end of DASO), where the ``average`` rule keeps values bit-identical. Between
syncs it *is* one extra model average: replicas' parameters and inner states are averaged, which
is what the next sync would have done to the parameters (not, in general, to the inner states).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from optaxdist._validate import check_int
from optaxdist.accounting import CommLedger
from optaxdist.comm.base import divides_first
from optaxdist.optimizers import SignSgdState, SingaSgdState
from optaxdist.topology import Topology
from optaxdist.transforms._checks import find_states
from optaxdist.transforms.allreduce import AllReduceState
from optaxdist.transforms.averaged_iterate import AveragedIterateState
from optaxdist.transforms.compressed import CompressedAllReduceState, ExactWarmupState
from optaxdist.transforms.daso import DasoEvents, DasoState
from optaxdist.transforms.gossip import Gossip, PushSumState
from optaxdist.transforms.loss_scale import DynamicLossScaleState
from optaxdist.transforms.outer import InFlight, OuterLayout, OuterState, SlowMoOuterState, sharded_payloads
from optaxdist.transforms.periodic import AgreedParams, PeriodicState
from optaxdist.transforms.powersgd import PowerSgdState

PyTree = Any

REPLICATED, AVERAGE, RESIDUAL, SUM, LEDGER = "replicated", "average", "residual", "sum", "ledger"
# ``None``: the field's subtree follows its container's rule (nested states keep their own rules).
INHERIT = None

RULES: dict[type, dict[str, str | None]] = {
    AllReduceState: {"allreduce_ledger": LEDGER},
    AveragedIterateState: {"average_count": AVERAGE, "averaged_params": AVERAGE},
    CompressedAllReduceState: {"compress_step": REPLICATED, "error": RESIDUAL, "compressed_ledger": LEDGER},
    ExactWarmupState: {"step": REPLICATED, "exact_state": INHERIT, "compressed_state": INHERIT},
    PowerSgdState: {
        "powersgd_step": REPLICATED,
        "powersgd_q": REPLICATED,
        "powersgd_error": RESIDUAL,
        "powersgd_ledger": LEDGER,
    },
    PeriodicState: {
        "step": REPLICATED,
        "last_sync": REPLICATED,
        "inner_state": AVERAGE,
        "sync_state": INHERIT,
        "ledger": LEDGER,
        "agreed": INHERIT,
    },
    AgreedParams: {"fresh": "zero", "values": AVERAGE},  # nothing agreed since the resize
    OuterState: {
        "layout": INHERIT,
        "anchors": REPLICATED,
        "outer_states": REPLICATED,
        "reducer_states": AVERAGE,
        "in_flight": INHERIT,
    },
    # ``_Resizer.in_flight``: the pseudo-gradient averaged, the wire chunks rescaled for M
    InFlight: {"pseudo": AVERAGE, "outgoing": "rescaled", "arrived": "rescaled"},
    SlowMoOuterState: {"slow_momentum": INHERIT},
    PushSumState: {
        "ps_weight": "ps_weight",  # renormalised to 1
        "in_flight": "in_flight",  # folded into the parameters, then zero
    },
    DasoState: {
        **{
            name: REPLICATED
            for name in DasoState._fields
            if name
            not in (
                "pending_sum",
                "epoch_loss_sum",
                "epoch_loss_count",
                "inner_state",
                "daso_ledger",
                "agreed",
            )
        },
        "pending_sum": "zero",  # only read while pending_valid, which a resize requires False
        "epoch_loss_sum": SUM,
        "epoch_loss_count": SUM,
        "inner_state": AVERAGE,
        "daso_ledger": LEDGER,
        "agreed": INHERIT,
    },
    DasoEvents: dict.fromkeys(DasoEvents._fields, REPLICATED),
    DynamicLossScaleState: {
        "loss_scale": REPLICATED,
        "good_steps": REPLICATED,
        "skipped_steps": REPLICATED,
        "inner_state": INHERIT,
        "loss_scale_ledger": LEDGER,
    },
    SignSgdState: {"count": AVERAGE, "sign_momentum": AVERAGE},
    SingaSgdState: {"count": AVERAGE, "momentum_buffer": AVERAGE},
}
GOSSIP_STATES = (Gossip, PushSumState)


def _is_ledger(x) -> bool:
    return isinstance(x, CommLedger)


def _rows(x) -> np.ndarray:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x  # typed keys stay JAX arrays
    return np.asarray(x)


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _identical(x) -> bool:
    if _is_key(x):
        x = np.asarray(jax.random.key_data(x))
    return all(np.array_equal(x[0], x[i], equal_nan=True) for i in range(1, len(x)))


def _broadcast(row, m: int):
    if _is_key(row):
        return jax.numpy.broadcast_to(row, (m,) + row.shape)
    return np.ascontiguousarray(np.broadcast_to(row, (m,) + row.shape))


def _by_slot(x, m: int):
    """New replica ``j`` takes old row ``j mod N`` (typed keys: folded with ``j // N``)."""
    n = len(x)
    if _is_key(x):
        return jax.numpy.stack([jax.random.fold_in(x[j % n], j // n) if j >= n else x[j] for j in range(m)])
    return np.stack([x[j % n] for j in range(m)])


def _floating(x) -> bool:
    return not _is_key(x) and jax.numpy.issubdtype(np.asarray(x).dtype, jax.numpy.floating)


def _two_sum(a, b):
    s = a + b
    bp = s - a
    ap = s - bp
    return s, (a - ap) + (b - bp)


def exact_sum_rows(x: np.ndarray, m: int, *, exact: bool = True, where: str = "") -> np.ndarray:
    """``M`` rows whose sum (as real numbers) equals the sum of the ``N`` rows of ``x`` exactly.

    Growing keeps the rows and appends zeros. Shrinking packs an error-free expansion of the sum
    (repeated TwoSum sweeps, each preserving the exact sum) into ``M`` rows, the float sum
    first. Integer arrays: the total on row 0. See the module docstring for when it raises.
    """
    x = np.asarray(x)
    n = len(x)
    if m >= n:
        return np.concatenate([x, np.zeros((m - n,) + x.shape[1:], x.dtype)])
    if not jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
        total = x.sum(axis=0, dtype=np.int64)
        if np.any(total != total.astype(x.dtype)):
            raise ValueError(f"{where}: the sum over replicas overflows {x.dtype}")
        return np.concatenate([total[None].astype(x.dtype), np.zeros((m - 1,) + x.shape[1:], x.dtype)])
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{where}: non-finite residuals can't be redistributed")
    work = np.float64 if x.dtype == np.float64 else np.float32  # exact upcast of 16-bit floats
    terms = [r.astype(work) for r in x]
    with np.errstate(over="raise"):
        for _ in range(2 * n + 2):
            before = [t.copy() for t in terms]
            for i in range(n - 1):  # one sweep: the running sum moves up, the errors stay behind
                terms[i + 1], terms[i] = _two_sum(terms[i + 1], terms[i])
            nonzero = np.count_nonzero(np.stack(terms), axis=0)
            if nonzero.max(initial=0) <= m or all(np.array_equal(a, b) for a, b in zip(before, terms)):
                break
    stacked = np.stack(terms[::-1])  # the float sum first, then the error terms
    order = np.argsort(stacked == 0, axis=0, kind="stable")  # non-zero terms first
    packed = np.take_along_axis(stacked, order, axis=0)
    rest = packed[m:]
    if np.any(rest != 0):
        if exact:
            raise ValueError(
                f"{where}: the sum of {n} residual rows needs more than {m} {x.dtype} values to be "
                "kept exactly; pass exact_residuals=False to round the remainder into replica 0"
            )
        packed[0] = packed[0] + rest.sum(axis=0)
    out = packed[:m].astype(x.dtype)
    if exact and not np.array_equal(out.astype(work), packed[:m]):
        raise ValueError(f"{where}: the exact residual terms do not fit in {x.dtype}")
    return out


def _mean_rows(x: np.ndarray, m: int) -> np.ndarray:
    mean = np.mean(x.astype(np.float64), axis=0)
    return _broadcast(mean.astype(x.dtype), m)


def _apply_leaf(rule: str, x, m: int, path: str, exact: bool):
    x = _rows(x)
    if rule == REPLICATED:
        if not _identical(x):
            raise ValueError(
                f"{path}: replicated state differs between replicas; resize at a synchronisation point"
            )
        return _broadcast(x[0], m)
    if rule == AVERAGE:
        if _identical(x):
            return _broadcast(x[0], m)
        return _mean_rows(x, m) if _floating(x) else _by_slot(x, m)
    if rule in (RESIDUAL, SUM):
        return exact_sum_rows(x, m, exact=exact, where=path)
    if rule == "zero":
        return np.zeros((m,) + x.shape[1:], x.dtype)
    raise AssertionError(rule)


def _ledger(ledger: CommLedger, m: int, path: str, payloads=None) -> CommLedger:
    counts = []
    for c in ledger.counts:
        c = np.asarray(c)
        counts.append(_broadcast(c[0], m) if _identical(c) else _by_slot(c, m))
    return CommLedger(tuple(counts), ledger.kinds, payloads if payloads is not None else ledger.payloads)


class _Resizer:
    def __init__(self, n: int, m: int, exact: bool, leaf_shapes: list, node_size: int | None):
        self.n, self.m, self.exact, self.leaf_shapes = n, m, exact, leaf_shapes
        self.node_size = node_size

    def walk(self, node, rule: str, path: str):
        if _is_ledger(node):
            return _ledger(node, self.m, path)
        if isinstance(node, InFlight):
            return self.in_flight(node, path)
        table = RULES.get(type(node))
        if table is not None:
            if _is_sharded(node):
                return self.sharded_outer(node, path)
            fields = {}
            for name in node._fields:
                sub = table[name]
                value = getattr(node, name)
                where = f"{path}.{name}"
                if sub in ("ps_weight",):
                    fields[name] = np.ones((self.m,) + np.shape(value)[1:], np.asarray(value).dtype)
                elif sub == "in_flight":
                    fields[name] = jax.tree.map(lambda x: np.zeros((self.m,) + x.shape[1:], x.dtype), value)
                else:
                    fields[name] = self.walk(value, rule if sub is INHERIT else sub, where)
            if isinstance(node, DasoState):  # group indices in the new node
                for name in ("send_group", "previous_send_group"):
                    g = fields[name]
                    fields[name] = np.where(g >= 0, g % self.node_size, g).astype(g.dtype)
            return type(node)(**fields)
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return type(node)(*(self.walk(v, rule, f"{path}.{k}") for k, v in zip(node._fields, node)))
        if isinstance(node, (tuple, list)):
            return type(node)(self.walk(v, rule, f"{path}[{i}]") for i, v in enumerate(node))
        if isinstance(node, dict):
            return type(node)({k: self.walk(v, rule, f"{path}[{k!r}]") for k, v in node.items()})
        if node is None:
            return None
        leaves, treedef = jax.tree.flatten(node, is_leaf=_is_ledger)
        if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # an array
            return _apply_leaf(rule, node, self.m, path, self.exact)
        # another registered pytree container (e.g. a flax State): one level down, same rule
        children, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
        out = [self.walk(v, rule, path + jax.tree_util.keystr(p)) for p, v in children]
        return jax.tree.unflatten(treedef, out)

    def in_flight(self, node: InFlight, path: str) -> InFlight:
        """``streaming_diloco(overlap=True)``'s all-reduce under way: each replica's pseudo-gradient
        (and the chunks already averaged) become their mean, as at a sync. ``outgoing`` is each
        replica's next chunk as sent (divided by ``N`` first on a 16-bit wire: now by ``M``),
        ``arrived`` the sum over the ``N`` replicas of the previous one (the mean times ``N``,
        or the mean on a 16-bit wire): rescaled so that their mean is unchanged with ``M``."""
        n, m = self.n, self.m
        pseudo, outgoing, arrived = [], [], []
        for k, (p, o, a) in enumerate(zip(node.pseudo, node.outgoing, node.arrived)):
            first = divides_first(np.asarray(p).dtype, np.asarray(o).dtype)
            pseudo.append(self.walk(p, AVERAGE, f"{path}.pseudo[{k}]"))
            sent = np.asarray(o, np.float64).mean(axis=0) * (n / m if first else 1.0)
            summed = np.asarray(a, np.float64)[0] * (1.0 if first else m / n)
            outgoing.append(_broadcast(sent.astype(np.asarray(o).dtype), m))
            arrived.append(_broadcast(summed.astype(np.asarray(a).dtype), m))
        return InFlight(tuple(pseudo), tuple(outgoing), tuple(arrived))

    def sharded_outer(self, s: PeriodicState, path: str) -> PeriodicState:
        n, m = self.n, self.m
        outer: OuterState = s.sync_state
        fragments = outer.layout.fragments
        total = sum(math.prod(x.shape) for x in self.leaf_shapes)
        covered = sorted(i for part in fragments for i in part) == list(range(len(self.leaf_shapes)))
        if any(isinstance(a, tuple) for a in outer.anchors):
            raise ValueError(
                f"{path}: resizing a sharded DiLoCo/SlowMo/Streaming DiLoCo state made with "
                "model_sharding (blocks per group of model-sharded leaves) is not supported"
            )
        if not covered or outer.layout.num_shards != n:
            raise ValueError(
                f"{path}: a sharded outer state over {outer.layout.num_shards} replicas does not cover "
                f"the {total} elements of params on {n} replicas; resizing a sharded "
                "DiLoCo/SlowMo/Streaming DiLoCo that covers only part of the parameters (inside "
                "optax.multi_transform or masked) is not supported"
            )
        anchors, outer_states = [], []
        for f, part in enumerate(fragments):
            block = np.shape(outer.anchors[f])[1]
            size = sum(math.prod(self.leaf_shapes[i].shape) for i in part)
            if not 0 <= n * block - size < n:
                raise ValueError(
                    f"{path}: {n} blocks of {block} elements do not hold fragment {f} ({size} elements)"
                )
            new_block = -(-size // m)

            def reblock(x, block=block, new_block=new_block, where=f"{path}.sync_state.outer_states[{f}]"):
                x = np.asarray(x)
                if x.shape[1:] != (block,):
                    return self.walk(x, REPLICATED, where)
                flat = x.reshape(-1)[: min(n * block, m * new_block)]
                return np.pad(flat, (0, m * new_block - flat.shape[0])).reshape(m, new_block)

            anchors.append(reblock(outer.anchors[f]))
            outer_states.append(jax.tree.map(reblock, outer.outer_states[f]))
        resized = sharded_payloads(fragments, self.leaf_shapes, m)
        payloads = tuple(resized.get(k, p) for k, p in zip(s.ledger.kinds, s.ledger.payloads))
        return PeriodicState(
            step=self.walk(s.step, REPLICATED, f"{path}.step"),
            last_sync=self.walk(s.last_sync, REPLICATED, f"{path}.last_sync"),
            inner_state=self.walk(s.inner_state, AVERAGE, f"{path}.inner_state"),
            sync_state=OuterState(
                OuterLayout(fragments, m), tuple(anchors), tuple(outer_states), outer.reducer_states
            ),
            ledger=_ledger(s.ledger, m, f"{path}.ledger", payloads),
            agreed=self.walk(s.agreed, AVERAGE, f"{path}.agreed"),
        )


def _is_sharded(s: Any) -> bool:
    """A ``PeriodicState`` of the sharded outer mode."""
    return (
        isinstance(s, PeriodicState)
        and isinstance(s.sync_state, OuterState)
        and s.sync_state.layout.num_shards is not None
    )


def _check_topology(topology, m: int) -> None:
    if topology is None:
        raise ValueError(
            "resizing a gossip state (decentralized_sgd / sgp) needs topology=: the new graph, or its "
            "family as a function of the number of replicas (e.g. optaxdist.topology.ring)"
        )
    if isinstance(topology, Topology):
        if topology.n != m:
            raise ValueError(
                f"topology {topology.name!r} has n={topology.n}; new_n={m}; allowed: new_n={topology.n}"
            )
        return
    if not callable(topology):
        raise TypeError(f"topology must be a Topology or a function n -> Topology, got {topology!r}")
    try:
        built = topology(m)
    except ValueError as err:
        raise ValueError(f"new_n={m} is not a size the topology accepts: {err}") from err
    if not isinstance(built, Topology) or built.n != m:
        raise ValueError(f"topology({m}) did not return a Topology of {m} nodes: {built!r}")


def resize_replicas(
    params: PyTree,
    opt_state: PyTree,
    new_n: int,
    *,
    node_size: int | None = None,
    topology: Topology | Callable[[int], Topology] | None = None,
    exact_residuals: bool = True,
    like: PyTree = None,
) -> tuple[PyTree, PyTree]:
    """Map stacked ``(params, opt_state)`` of N replicas to ``new_n`` replicas (elastic restart).

    Args:
      params: stacked parameters (leading axis N; NumPy or JAX arrays). Per-replica: averaged (for
        ``sgp``: the exact push-sum average).
      opt_state: the stacked optimizer state of the same run (any nesting of optaxdist and optax
        states); each leaf follows ``RULES`` (see the module docstring).
      new_n: the new number of replicas (≥ 1).
      node_size: replicas per node of the new hierarchical configuration (DASO's ``local_comm``
        size, hierarchical local SGD's); ``new_n`` must be a multiple of it. Required when the state
        holds a ``DasoState``.
      topology: for gossip states, the new topology or its family (``n -> Topology``), which must
        accept ``new_n``.
      exact_residuals: refuse (``ValueError``) to round an error-feedback residual sum that
        ``new_n`` values can't hold exactly (False: round the remainder into replica 0).
      like: optional: the new configuration's stacked state (arrays or ``ShapeDtypeStruct``s, e.g.
        ``jax.eval_shape`` of the new init); the result is checked against its structure, shapes,
        dtypes and ledgers' static kinds and payloads (``ValueError`` naming the first difference).

    Returns:
      ``(params, opt_state)`` stacked over ``new_n`` replicas, as NumPy arrays, ready to be placed on
      a mesh or split into MPI rows.

    Raises:
      ValueError: ``new_n`` is not a size the configuration can take (naming the parameter and the
        allowed values), a replicated leaf differs between replicas, DASO has a pending send, or
        ``like`` does not match.
    """
    new_n = check_int("new_n", new_n, 1)
    leaves = jax.tree.leaves((params, opt_state))
    if not leaves:
        raise ValueError("nothing to resize: params and opt_state have no arrays")
    n = int(np.shape(leaves[0])[0]) if np.ndim(leaves[0]) else 0
    for path, x in jax.tree_util.tree_leaves_with_path((params, opt_state)):
        if np.ndim(x) == 0 or np.shape(x)[0] != n:
            raise ValueError(
                f"{jax.tree_util.keystr(path)} has shape {np.shape(x)}: every leaf must be stacked over "
                f"the same leading replica axis (N={n})"
            )
    if node_size is not None:
        node_size = check_int("node_size", node_size, 1)
        if new_n % node_size:
            allowed = [node_size * k for k in range(1, 5)]
            raise ValueError(
                f"new_n={new_n} is not a multiple of node_size={node_size}; allowed: {allowed}, ..."
            )
    dasos = find_states(opt_state, DasoState)
    if dasos:
        if node_size is None:
            raise ValueError(
                "resizing a DASO state needs node_size= (replicas per node in the new configuration)"
            )
        for d in dasos:
            if np.any(np.asarray(d.pending_valid)):
                raise ValueError(
                    "DASO has a pending cross-node send (pending_valid): resize at an epoch end, where "
                    "the sync is blocking and nothing is in flight"
                )
    if find_states(opt_state, GOSSIP_STATES):
        _check_topology(topology, new_n)

    leaf_shapes = [jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype) for x in jax.tree.leaves(params)]
    resizer = _Resizer(n, new_n, exact_residuals, leaf_shapes, node_size)
    sgps = find_states(opt_state, PushSumState)
    if len(sgps) > 1:
        raise ValueError("more than one sgp state in opt_state: the parameters have one push-sum weight")
    if sgps:
        new_params = _push_sum_average(params, sgps[0], new_n)
    else:
        new_params = resizer.walk(params, AVERAGE, "params")
    new_state = resizer.walk(opt_state, AVERAGE, "opt_state")
    if like is not None:
        new_state = _match_like(new_state, like, new_n)
    return new_params, new_state


def _push_sum_average(params, s: PushSumState, m: int):
    w = np.asarray(s.ps_weight, np.float64)
    leaves, treedef = jax.tree.flatten(params)
    if s.in_flight == ():
        late_x, late_w = [0.0] * len(leaves), np.zeros_like(w)
    else:
        late_x = [np.asarray(v, np.float64) for v in s.in_flight[0]]
        late_w = np.asarray(s.in_flight[1], np.float64)
    total_w = (w + late_w).sum()
    out = []
    for z, lx in zip(leaves, late_x):
        z = np.asarray(z)
        wz = z.astype(np.float64) * w.reshape((-1,) + (1,) * (z.ndim - 1))
        mean = (wz + lx).sum(axis=0) / total_w
        out.append(_broadcast(mean.astype(z.dtype), m))
    return jax.tree.unflatten(treedef, out)


def _match_like(state, like, m: int):
    got, want = jax.tree.structure(state, is_leaf=_is_ledger), jax.tree.structure(like, is_leaf=_is_ledger)
    if got != want:
        raise ValueError(f"the resized state does not have the structure of like=:\n  {got}\n  vs {want}")

    def one(path, x, ref):
        if _is_ledger(x):
            if x.kinds != ref.kinds:
                where = jax.tree_util.keystr(path)
                raise ValueError(f"{where}: ledger kinds {x.kinds} vs {ref.kinds} in like=")
            if x.payloads != ref.payloads:
                where = jax.tree_util.keystr(path)
                raise ValueError(f"{where}: ledger payloads {x.payloads} vs {ref.payloads} in like=")
            return x
        if tuple(np.shape(x)) != tuple(ref.shape) or np.dtype(x.dtype) != np.dtype(ref.dtype):
            stacked = "" if np.shape(ref)[:1] == (m,) else f" (like= is stacked: a leading axis of new_n={m})"
            raise ValueError(
                f"{jax.tree_util.keystr(path)}: resized to {np.shape(x)} {x.dtype}, like= has "
                f"{tuple(ref.shape)} {ref.dtype}{stacked}"
            )
        return x

    return jax.tree_util.tree_map_with_path(one, state, like, is_leaf=_is_ledger)


def leaf_rules(opt_state: PyTree) -> PyTree:
    """The rule ``resize_replicas`` applies to each leaf of ``opt_state`` (a tree of strings with
    the structure of ``opt_state``, ledgers as their rule name): handy to see which leaves are
    replicated."""

    def walk(node, rule):
        if _is_ledger(node):
            return LEDGER
        table = RULES.get(type(node))
        if table is not None:
            if isinstance(node, OuterState) and node.layout.num_shards is not None:
                table = dict(table, anchors="sharded", outer_states="sharded")
            return type(node)(
                **{k: walk(getattr(node, k), rule if table[k] is INHERIT else table[k]) for k in node._fields}
            )
        if node is None:
            return None
        if isinstance(node, (str, np.ndarray, jax.Array, np.generic)) or not jax.tree.leaves(node):
            return rule if isinstance(node, (np.ndarray, jax.Array, np.generic)) else node
        treedef = jax.tree.structure(node, is_leaf=lambda x: x is not node)
        children = jax.tree.leaves(node, is_leaf=lambda x: x is not node)
        return jax.tree.unflatten(treedef, [walk(c, rule) for c in children])

    return walk(opt_state, AVERAGE)
