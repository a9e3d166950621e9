"""DES-LOC: local steps of an adaptive optimizer; the parameters and each optimizer-state moment are
averaged on periods of their own (Iacob et al., 2025)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optaxdist._validate import check_int
from optaxdist.accounting import Kind, dtype_label, kind_name, payload_bytes
from optaxdist.agreement import configured
from optaxdist.comm.base import Communicator, canonical_comm_dtype
from optaxdist.transforms._checks import check_comm
from optaxdist.transforms.periodic import Sync, SyncInput, every_leaf, periodic


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _field_names(path: tuple) -> list[str]:
    """The NamedTuple (or dataclass) field names on a key path, outermost first."""
    return [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]


def _fields_with_floats(state: Any) -> list[str]:
    """The field names of ``state`` under which a floating-point leaf lies, for error messages."""
    names: list[str] = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if _is_float(leaf):
            names += [n for n in _field_names(path) if n not in names]
    return names


def state_field_leaves(state: Any, names: Any) -> dict[str, list[int]]:
    """For each name, the positions in ``jax.tree.leaves(state)`` of the floating-point leaves that
    lie under a state field of that name, at any depth (``optax.chain``, ``inject_hyperparams``,
    ...). Counters (integer leaves) are never included.

    Raises:
      ValueError: a name has no floating-point leaf under it, or a leaf lies under two names.
    """
    found: dict[str, list[int]] = {name: [] for name in names}
    for i, (path, leaf) in enumerate(jax.tree_util.tree_leaves_with_path(state)):
        hits = sorted({n for n in _field_names(path) if n in found})
        if len(hits) > 1:
            raise ValueError(
                f"state_periods names nested fields {hits} of the inner optimizer's state (at "
                f"{jax.tree_util.keystr(path)}): give one of them"
            )
        if hits and _is_float(leaf):
            found[hits[0]].append(i)
    missing = [name for name, positions in found.items() if not positions]
    if missing:
        raise ValueError(
            f"state_periods names {missing}, not a field of the inner optimizer's state with "
            f"floating-point leaves; allowed: {_fields_with_floats(state)}"
        )
    return found


def _occurring(periods: list[int]) -> list[int]:
    """The bit masks (bit ``j``: ``periods[j]`` divides the step) that some step ``≥ 1`` has,
    zero excluded: by inclusion–exclusion over one common multiple ``L`` of the periods, the steps
    in ``[1, L]`` divisible by exactly the periods of a mask."""
    whole = math.lcm(*periods)
    out = []
    for mask in range(1, 2 ** len(periods)):
        chosen = [p for j, p in enumerate(periods) if mask >> j & 1]
        others = [p for j, p in enumerate(periods) if not mask >> j & 1]
        base = math.lcm(*chosen)
        count = sum(
            (-1) ** len(extra) * (whole // math.lcm(base, *extra))
            for r in range(len(others) + 1)
            for extra in itertools.combinations(others, r)
        )
        if count > 0:
            out.append(mask)
    return out


@configured("des_loc")
def des_loc(
    inner: optax.GradientTransformation,
    *,
    comm: Communicator,
    period: int,
    state_periods: Mapping[str, int],
    warmup_steps: int = 0,
    dtype: Any = None,
    check_start: bool = True,
    nonfinite: str = "skip",
    exact_sync: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""DES-LOC: local steps of ``inner``; the parameters are averaged every ``period`` steps and
    each named part of ``inner``'s state every ``state_periods[name]`` steps.

    With :math:`t` the 0-based step, :math:`T_w` = ``warmup_steps``, :math:`s = t - T_w + 1`,
    :math:`K_x` = ``period`` and :math:`K_f` = ``state_periods[f]``, on replica :math:`i` of
    :math:`W`:

    * :math:`t < T_w`: :math:`g \leftarrow \frac1W\sum_i g_i` before ``inner`` (replicas stay
      identical);
    * otherwise the local step :math:`x_i, S_i \leftarrow \mathrm{inner}(g_i; x_i, S_i)`, then

      .. math::

         x_i \leftarrow \tfrac1W \textstyle\sum_j x_j \ \text{ if } K_x \mid s, \qquad
         S_i.f \leftarrow \tfrac1W \textstyle\sum_j S_j.f \ \text{ if } K_f \mid s
         \quad \text{for each } f \text{ in } \texttt{state\_periods}.

    For Adam, :math:`S = (\mathrm{count}, \mu, \nu)` and the paper takes :math:`K_\mu = 3K_x`,
    :math:`K_\nu = 6K_x` (``state_periods={"mu": 3 * period, "nu": 6 * period}``): the moments
    decay slowly (:math:`\beta_2 = 0.99`: half-life 69 steps), so replicas' moments stay close
    between averages. All periods count from the same origin (no offsets): with multiples of
    ``period`` every state average falls on a parameter average. Periods that are not multiples
    are allowed (the paper's toy problem uses :math:`K_x = 192, K_\nu = 692`): a state average
    then may fall on a step without a parameter average.

    A name in ``state_periods`` is a field of a NamedTuple in ``inner``'s state, found at any
    depth (inside ``optax.chain``, ``inject_hyperparams``, ...; every field of that name): optax's
    ``ScaleByAdamState`` has ``"mu"`` and ``"nu"``, ``TraceState`` (SGD momentum) ``"trace"``.
    Only its floating-point leaves are averaged; counters (Adam's ``count``) are never averaged:
    they are the same on every replica. Float leaves not named are never averaged.

    Every period equal to ``period`` is Local Adam, ``local_sgd(inner, period=period,
    average_inner_state=True)`` when every float leaf of the state is named; state periods
    longer than the run are ``local_sgd(inner, period=period)`` (both tested).

    Communication (``P`` = parameter bytes, ``S_f`` = bytes of the float leaves under field
    ``f``, both in ``dtype``): an all-reduce of ``P`` every ``period`` steps (ledger
    ``param_average[<dtype>]``), an all-reduce of ``S_f`` every ``state_periods[f]`` steps
    (``state_average[<f>,<dtype>]``); per step on average ``P/K_x + Σ_f S_f/K_f``. For Adam with
    the paper's multiples that is ``P/K_x · (1 + 1/3 + 1/6) = 1.5 P/K_x``, half of Local Adam's
    ``3 P/K_x``. During the warm-up one all-reduce of the gradients per step
    (``all_reduce[<dtype>]``). Each step's combination of averages is one branch of a
    ``lax.switch`` on the replicated step counter: a local step sends nothing.

    Args:
      inner: the local optimizer (Adam, AdamW, SGD with momentum, ...).
      comm: all replicas.
      period: :math:`K_x`, steps between parameter averages (≥ 1).
      state_periods: ``{field name: steps between averages of that part of the state}`` (each
        ≥ 1). Names not found in the state, or without a floating-point leaf, raise at ``init``
        with the allowed names. ``{}``: the state stays local (``local_sgd``).
      warmup_steps: exact gradient all-reduce steps before the local steps start.
      dtype: wire dtype of every average (None: each leaf's own dtype).
      check_start, nonfinite, exact_sync: the engine's options (``periodic``): raise on the first
        step if the replicas' parameters differ; the local step's non-finite policy; keep a copy
        of the averaged parameters so that ``optaxdist.apply_updates`` leaves the replicas
        bit-identical after each parameter average.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state ``PeriodicState`` (``inner_state``
      per replica between averages; ``ledger`` replicated).

    Example:
      >>> tx = des_loc(optax.adam(1e-3), comm=comm, period=16,
      ...              state_periods={"mu": 48, "nu": 96})

    References:
      Iacob, Sani, Safaryan et al., "DES-LOC: Desynced Low Communication Adaptive Optimizers for
      Training Foundation Models", arXiv:2505.22549, 2025 (ICLR 2026).
    """
    period = check_int("period", period, 1)
    if not isinstance(state_periods, Mapping):
        raise TypeError(
            f"state_periods must map state field names to periods, e.g. {{'mu': {3 * period}, "
            f"'nu': {6 * period}}} for Adam; got {type(state_periods).__name__}"
        )
    for name in state_periods:
        if not isinstance(name, str):
            raise TypeError(f"state_periods keys are state field names (str), got {name!r}")
    state_periods = {name: check_int(f"state_periods[{name!r}]", p, 1) for name, p in state_periods.items()}
    check_comm("comm", comm)
    wire = canonical_comm_dtype(dtype)
    names = tuple(state_periods)
    periods = [period, *(state_periods[n] for n in names)]

    def param_kind(params) -> Kind:
        return kind_name("all_reduce", params, wire, label="param_average")

    def state_kind(name: str, leaves: list) -> Kind:
        return Kind("all_reduce", f"{name},{dtype_label(leaves, wire)}", label="state_average")

    def field_leaves(inner_state) -> dict[str, list]:
        leaves = jax.tree.leaves(inner_state)
        return {n: [leaves[i] for i in ix] for n, ix in state_field_leaves(inner_state, names).items()}

    def kinds(params, inner_state) -> dict[Kind, int]:  # at init: checks the names
        out = {param_kind(params): payload_bytes(params, wire)}
        for name, leaves in field_leaves(inner_state).items():
            out[state_kind(name, leaves)] = payload_bytes(leaves, wire)
        return out

    def average(mask: int) -> Sync:
        """The synchronization of the steps whose averages are the bits of ``mask``."""

        def sync(x: SyncInput) -> SyncInput:
            ledger, local, agreed = x.ledger, x.local, x.agreed
            if mask & 1:
                local, agreed = comm.pmean(x.local, dtype=wire), every_leaf(x.local)
                ledger = ledger.record(param_kind(x.params))
            leaves, treedef = jax.tree.flatten(x.inner_state)
            positions = state_field_leaves(x.inner_state, names)
            for j, name in enumerate(names, start=1):
                if mask >> j & 1:
                    ix = positions[name]
                    for i, mean in zip(ix, comm.pmean([leaves[i] for i in ix], dtype=wire)):
                        leaves[i] = mean
                    ledger = ledger.record(state_kind(name, [leaves[i] for i in ix]))
            inner_state = jax.tree.unflatten(treedef, leaves)
            return x._replace(local=local, inner_state=inner_state, ledger=ledger, agreed=agreed)

        return sync

    masks = _occurring(periods)
    # mask -> 1-based index of its synchronization (0: none), looked up with the step's mask
    table = [0] * 2 ** len(periods)
    for k, mask in enumerate(masks, start=1):
        table[mask] = k

    def schedule(s, num_syncs):
        due = [((s + 1) % p == 0).astype(jnp.int32) << j for j, p in enumerate(periods)]
        return jnp.asarray(table, jnp.int32)[sum(due)]

    return periodic(
        inner,
        comm=comm,
        name="des_loc",
        schedule=schedule,
        syncs=[average(mask) for mask in masks],
        kinds=kinds,
        warmup_steps=warmup_steps,
        dtype=dtype,
        check_start=check_start,
        nonfinite=nonfinite,
        exact_sync=exact_sync,
        averages_inner_state=bool(state_periods),
    )
