"""``split_local_steps=True``: a harness that runs the periodic transforms' local steps, and each of
their synchronizations, as a program of its own (``optaxdist.transforms.local_program``), chosen
on the host from the schedules' control values (step counters)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from optaxdist.transforms import local_program

TABLE_SIZE = 4096  # steps whose schedule is evaluated at once, on the host's CPU
TABLE_LIMIT = 4 * TABLE_SIZE  # control values an update's table holds before it starts again
CHAINS = 8  # runs of one step whose control values are counted on the host at once (training, evaluation...)
SYNC_PROGRAMS = 16  # synchronizations' programs compiled per step; others run the general program
LOCAL = "local"  # the local program's key (a synchronization's: the branch of each update)


Control = tuple[int, ...]  # an update's control values on the host (``Schedule.control_in``)
Step = tuple[int, Control | None]  # its branch there, and the control it returns (None: unknown)
Key = str | tuple[int, ...]  # a program of fixed branches: LOCAL, or a synchronization's branches


class _Plan(NamedTuple):
    """Where one trace's periodic updates (in the order of their positions) find and return their
    control values (per update, positions in the flattened arguments and results; ``read`` and
    ``returned``: all of them, in that order), each update's ``Schedule.plan`` run over
    ``TABLE_SIZE`` steps (jitted once), the steps it gave so far (per update,
    ``control → (branch, next control)``), and for each result the argument it returns
    unchanged (its position), else None."""

    control_in: tuple[tuple[int, ...], ...]
    control_out: tuple[tuple[int, ...], ...]
    read: tuple[int, ...]
    returned: tuple[int, ...]
    steps: tuple[Callable[..., Any], ...]
    tables: tuple[dict[Control, Step], ...]
    forwarded: tuple[int | None, ...]
    out_treedef: Any


@dataclasses.dataclass(slots=True)
class _Pruned:
    """A program of fixed branches (the local program, or a synchronization's) for one signature
    as a function of what it reads and writes
    (``SplitLocalSteps._pruning``): the positions of the argument leaves it takes, split into
    those whose buffers it may reuse and the others; for each result the argument leaf it is
    (returned by the host, not by the program), else None; the results that read no argument
    (the same every call: kept by the host, ``_Entry.constants``)."""

    program: Callable[..., Any]
    donated: tuple[int, ...]
    kept: tuple[int, ...]
    out_treedef: Any
    sources: tuple[int, ...]  # the forwarded arguments
    constant: tuple[int, ...]  # in order of position
    take_donated: Callable[[list], tuple]  # the argument leaves of each group, from all of them
    take_kept: Callable[[list], tuple]
    # the results from (program's results, argument leaves, constants)
    assemble: Callable[[tuple], tuple]


def _plan(arg_leaves: list, out: Any, recorded: list[local_program.Schedule]) -> _Plan | None:
    """The plan of one trace, or None (with a warning) where the step has no periodic update, or
    where their counters are not the step's own arguments and results (an update inside a
    ``lax.cond``, a ``scan``, another transform's branch; a counter the step does not return):
    such a step always runs the general program. ``arg_leaves``: the arguments' leaves as the
    step got them (a step may update its arguments in place, as Flax NNX's ``merge`` and
    ``Optimizer.update`` do)."""
    inputs = {id(x): i for i, x in enumerate(arg_leaves)}
    out_leaves = jax.tree.leaves(out)
    outputs: dict[int, int] = {}
    for i, x in enumerate(out_leaves):  # a value returned twice (a DASO event repeating the state's
        outputs.setdefault(id(x), i)  # group, in a program of one branch): where it comes first
    recorded = sorted(recorded, key=lambda r: r.position)
    try:
        if [r.position for r in recorded] != list(range(len(recorded))):
            raise KeyError  # an update traced twice (inside another's branches)
        control_in = tuple(tuple(inputs[id(x)] for x in r.control_in) for r in recorded)
        control_out = tuple(tuple(outputs[id(x)] for x in r.control_out) for r in recorded)
    except KeyError:
        why = (
            "a periodic update's step counter is not one of the step's own arguments and results "
            "(an update inside optax.MultiSteps, a lax.scan or another transform's branch, or a "
            "state the step does not return)"
        )
    else:
        if recorded:
            return _Plan(
                control_in,
                control_out,
                sum(control_in, ()),
                sum(control_out, ()),
                tuple(_steps(r.plan) for r in recorded),
                tuple({} for _ in recorded),
                tuple(inputs.get(id(x)) for x in out_leaves),
                jax.tree.structure(out),
            )
        why = (
            "the step runs no periodic transform (DASO with one batch per epoch ends an epoch on every call)"
        )
    warnings.warn(f"split_local_steps: {why}; every call runs the general program", stacklevel=2)
    return None


def _signature(treedef: Any, leaves: list, leading: int) -> tuple:
    """What makes ``jax.jit`` trace the step again, as one replica's step sees it: the
    arguments' structure, and their shapes (without the ``leading`` stacked axes), dtypes and
    weak types."""
    return treedef, tuple(_leaf_signature(x, leading) for x in leaves)


def _leaf_signature(x: Any, leading: int) -> tuple:
    try:  # an array: read on every call, so the common case first
        return x.shape[leading:], x.dtype, x.weak_type
    except AttributeError:
        return np.shape(x)[leading:], getattr(x, "dtype", type(x)), False


def _steps(plan: Callable[..., Any]) -> Callable[..., Any]:
    """``Schedule.plan`` run for ``TABLE_SIZE`` steps from a control value, jitted: per step the
    control, the branch, the next control and whether it is known."""

    def run(control: tuple[jax.Array, ...]) -> Any:
        def step(now, _):
            branch, after, known = plan(now)
            after = tuple(jnp.asarray(x, jnp.int32) for x in after)
            return after, (now, branch, after, known)

        return jax.lax.scan(step, control, None, length=TABLE_SIZE)[1]

    return jax.jit(run)


def _host_counters(arrays: Sequence[Any]) -> list[int]:
    """Replicated control values: each the largest over the replicas this process holds (what
    ``Communicator.uniform`` makes of it under ``simulate``); one blocking read for all of them."""
    shards = [[s.data for s in x.addressable_shards] if isinstance(x, jax.Array) else [x] for x in arrays]
    return [int(max(np.asarray(v).max() for v in values)) for values in jax.device_get(shards)]


def _table_device() -> jax.Device:
    """Where the schedules are evaluated: this process's CPU, else its first device."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # no CPU backend (JAX_PLATFORMS=cuda)
        return jax.local_devices()[0]


def _dce(traced: Any, results: Sequence[bool], keep: int | None = None) -> tuple[Any, list[bool]]:
    """A traced program's jaxpr computing only the ``results`` (dead-code elimination), from its
    flattened arguments that they read and argument ``keep`` (None: no other), and which of the
    arguments it takes."""
    from jax._src.interpreters import partial_eval as pe  # no public API runs JAX's DCE

    jaxpr = traced.jaxpr.jaxpr
    keeping = [k == keep for k in range(len(jaxpr.invars))]
    only, used = pe.dce_jaxpr(jaxpr, list(results), instantiate=keeping)
    return only, list(used)


def _reads(traced: Any, results: list[bool]) -> list[bool] | None:
    """Which of a traced program's flattened arguments the ``results`` read, or None where that
    cannot be told."""
    try:
        if len(traced.jaxpr.jaxpr.outvars) != len(results):
            return None
        return _dce(traced, results)[1]
    except (ImportError, AttributeError, TypeError):
        return None


def _constant_results(traced: Any, candidates: list[int], count: int) -> frozenset[int]:
    """The ``candidates`` (result positions of ``count``) that read no argument, found by
    bisection; none where the program has effects (a callback may return anything) or where
    computing them communicates (a metric's ``psum`` of a constant: it runs in the harness's
    program, not in one of its own)."""
    if getattr(traced.jaxpr, "effects", True):
        return frozenset()
    found: list[int] = []
    groups = [candidates]
    while groups:
        group = groups.pop()
        used = _reads(traced, [k in group for k in range(count)]) if group else [True]
        if used is not None and not any(used):
            found += group
        elif len(group) > 1:
            groups += [group[: len(group) // 2], group[len(group) // 2 :]]
    if found and _communicates(_dce(traced, [k in found for k in range(count)])[0]):
        return frozenset()
    return frozenset(found)


# primitives that exchange data between replicas (by the start of their names)
_COMMUNICATION = (
    "psum",
    "pmax",
    "pmin",
    "all_gather",
    "all_to_all",
    "ppermute",
    "reduce_scatter",
    "pbroadcast",
)


def _communicates(jaxpr: Any) -> bool:
    """Whether a jaxpr (or one nested in it) runs a collective, a callback or a foreign call."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name.startswith(_COMMUNICATION) or "callback" in name or name == "ffi_call":
            return True
    return any(_communicates(sub) for sub in jax_core.subjaxprs(jaxpr))


def _constants_program(
    traced: Any, positions: Sequence[int], count: int, anchor: int | None
) -> Callable[..., tuple]:
    """A compiled program returning the results at ``positions`` (of ``count``) of a traced
    program, which read none of its arguments (``_constant_results``): its jaxpr without the
    rest, so that it compiles in a fraction of the whole program's time. It takes the argument
    ``anchor`` (an array; None: no argument), unread, so that its results are placed and
    committed as the whole program's are (on the arguments' device, or over their mesh)."""
    only = _dce(traced, [k in positions for k in range(count)], keep=anchor)[0]
    closed = jax_core.ClosedJaxpr(only, traced.jaxpr.consts)
    return jax.jit(jax_core.jaxpr_as_fun(closed), keep_unused=True)


def _split_over_other_axes(x: Any) -> bool:
    """An array split over a mesh axis beyond its leading (replica) dimension: a model-sharded
    leaf, whose results the harness places like their arguments (``on_mesh``)."""
    sharding = getattr(x, "sharding", None)
    return isinstance(sharding, NamedSharding) and any(e is not None for e in tuple(sharding.spec)[1:])


_AVAL = operator.attrgetter("aval")  # an array's abstract value (shape, dtype, weak type...), at C speed
_IS_DELETED = operator.methodcaller("is_deleted")


class _Entry:
    """What the calls of one signature (the arguments as given, stacked axes included) share: the
    general program's plan, and per program of fixed branches (its key) whether it traces alike,
    its pruned program, and the results that one keeps on the host (``constants``) with the
    program that computes them (``_constants_program``) and the argument it takes."""

    __slots__ = ("signature", "plan", "arrays", "alike", "pruned", "constants", "constants_programs")

    def __init__(self, signature: tuple, plan: _Plan, *, arrays: bool):
        self.signature, self.plan, self.arrays = signature, plan, arrays  # arrays: every leaf a jax.Array
        self.alike: dict[Key, bool] = {}  # program's key → traces alike
        self.pruned: dict[Key, _Pruned | None] = {}  # absent: not looked up yet
        self.constants: dict[Key, tuple[jax.Array, ...]] = {}
        self.constants_programs: dict[Key, tuple[Callable[..., tuple], int | None]] = {}  # and anchor


def _owners(args: tuple) -> list[int]:
    """The argument each of the arguments' flattened leaves belongs to (its position)."""
    return [a for a, arg in enumerate(args) for _ in jax.tree.leaves(arg)]


def _picker(positions: Sequence[int]) -> Callable[[Sequence], tuple]:
    """A function of a sequence returning its items at ``positions``, as a tuple (at C speed)."""
    if len(positions) == 1:
        (position,) = positions
        return lambda items: (items[position],)
    return operator.itemgetter(*positions) if positions else lambda items: ()


def _branches(key: Key | None) -> Callable[[int], int | None] | None:
    """``local_program.tracing``'s ``branches`` for the program of ``key``."""
    if key == LOCAL:
        return lambda position: 0
    return None if key is None else lambda position: key[position] if position < len(key) else None


class _NotAsTraced(Exception):
    """A pruned program's trace forwards other arguments than the whole one's."""


class SplitLocalSteps:
    """A harness step compiled once per branch that runs: the general program; the local program,
    in which every periodic update of the step takes its local step only; and, made at the first
    call that takes it, the program of each synchronization (the branch of every update fixed:
    the local step, then that update's synchronization; up to ``SYNC_PROGRAMS`` of them). A call
    runs the program of the branches the control values (step counters; DASO's batch, cycle and
    pending send) give its periodic updates, the general program where one of them needs it (the
    start check, a warm-up, a ``begin`` hook, DASO's epoch end).

    ``build`` makes the harness's compiled step of a per-replica step; ``leading`` is the number
    of stacked axes the harness's arguments have in front of one replica's (1, or 0 under MPI).
    The control values are kept on the host. They are read from the arguments (one blocking read
    for all of them) on the first call after the step's first trace, whenever a call's are
    not arrays a call returned and no call took since (up to ``CHAINS`` such states), and after a
    call whose control depends on the data (DASO's cycle at an epoch's end); otherwise they are
    counted (so that runs taking turns with one step, such as training and evaluation, read
    nothing after their first call). A call with arguments of a new signature (structure,
    shapes, dtypes) runs the general program: its trace says where the control values are. The
    schedules are run ``TABLE_SIZE`` steps at a time on the CPU, and what they give is kept per
    control value.
    Arguments that are tracers (a call from inside another ``jax.jit``) run the general program.

    The local program, and each synchronization's, runs as a function of what it reads and
    writes (``_pruning``): an argument it returns unchanged (a DiLoCo anchor, a ledger between
    syncs) is neither donated nor returned by it, if it belongs to a donated argument and comes
    back in one result only; the host puts it into the results as it came. The arguments it does
    not read (local SGD's copy of the agreed parameters, at a synchronization that writes it) are
    not passed, and its small results that read no argument (flags, the synchronization's index)
    are computed once by a program of their own and kept (with donation; only that part of the
    program is compiled twice): every state a call returns
    holds those very arrays, so a program that reads and donates one gets a copy of it
    (``_kept``). On a mesh each array of a call costs its dispatch (per device), so a local step
    moves about as many arrays as a plain optax step. Not where an argument is split over a mesh
    axis beyond the replicas' (the harness then places results like arguments), nor for a call
    with one array at two argument positions: there the program takes and returns everything, as
    the general program does.
    Where the harness's steps wait for their results (``on_node``, and ``on_mesh`` where this
    process holds several CPU devices of the mesh), a call dispatches its program, does the host's
    part (putting the results together, counting the control values), then waits for the arrays
    that program computed; a call whose program fails there counts nothing.
    ``local_calls`` and ``sync_calls`` count the calls that ran the local program and a
    synchronization's; everything else (``lower``, ``trace``, ``agreement``...) is the general
    program's.
    """

    def __init__(
        self,
        build: Callable[..., Callable[..., Any]],
        step: Callable[..., Any],
        leading: int,
        donate_argnums: int | Sequence[int] = (),
    ):
        # (program's key: None for the general one, LOCAL, or a synchronization's branches,
        # signature) → plan
        self._plans: dict[tuple[Any, tuple], _Plan | None] = {}
        # (LOCAL or a synchronization's branches, signature) → pruned program
        self._pruned: dict[tuple[Any, tuple], _Pruned | None] = {}
        self._build, self._step, self._leading = build, step, leading
        self._donate = {donate_argnums} if isinstance(donate_argnums, int) else set(donate_argnums)
        self._general = build(self._recording(step, None))
        # the harness's steps wait for their results (on_node; on_mesh over several CPU devices):
        # the calls dispatch their program, do the host's part, then wait
        self._waits = bool(getattr(self._general, "waits", False))
        self._local = build(self._recording(step, LOCAL))
        self._syncs: dict[tuple[int, ...], Callable[..., Any]] = {}  # branches → program
        self._entries: dict[tuple, _Entry] = {}
        self._recent: tuple[tuple, _Entry] | None = None  # the last call's key and entry
        # the control values calls returned and no call took yet: id of the first → (plan, their
        # arrays, their values)
        self._counted: dict[int, tuple[_Plan, list, list[Control]]] = {}  # in order of insertion
        # every result kept on the host and not deleted (id → array), whatever its signature or
        # program: every state a call returned it to holds it
        self._kept: dict[int, jax.Array] = {}
        self.local_calls = self.sync_calls = 0

    def _recording(self, step: Callable[..., Any], key: Key | None) -> Callable[..., Any]:
        """``step`` traced as the program of ``key`` (None: the general program), its plan noted."""
        branches = _branches(key)

        @functools.wraps(step)  # the configuration check follows the user's step from here
        def traced(*args: Any) -> Any:
            leaves, treedef = jax.tree.flatten(args)  # before the step, which may update them
            with local_program.tracing(branches=branches) as recorded:
                out = step(*args)
            self._plans[(key, _signature(treedef, leaves, 0))] = _plan(leaves, out, recorded)
            if key is None:  # a new trace of the general program: the entries look up its plan again
                self._entries.clear()
                self._recent = None
            return out

        return traced

    def _entry(self, treedef: Any, leaves: list) -> _Entry | None:
        """The calls' shared lookups for this call's signature, or None before the general program
        was traced for it (or for a call with tracers: it runs the general program)."""
        if any(issubclass(kind, jax.core.Tracer) for kind in set(map(type, leaves))):
            return None
        try:  # arrays
            key, arrays = (treedef, tuple(map(_AVAL, leaves))), True
        except AttributeError:  # NumPy arrays, Python scalars: their signature, stacked axes included
            key, arrays = ("signature", _signature(treedef, leaves, 0)), False
        if self._recent is not None and self._recent[0] == key:
            entry = self._recent[1]  # outputs of one program share their avals: no hashing
        else:
            entry = self._entries.get(key)
        if entry is None:
            signature = _signature(treedef, leaves, self._leading)
            plan = self._plans.get((None, signature))
            if plan is None:
                return None
            entry = self._entries[key] = _Entry(signature, plan, arrays=arrays)
        self._recent = (key, entry)
        return entry

    def _controls(self, entry: _Entry, leaves: list) -> list[Control]:
        """The updates' control values: counted from the last calls, else read."""
        plan = entry.plan
        known = self._counted.pop(id(leaves[plan.read[0]]), None)  # the chain goes on from this call
        if known is not None:
            counted, arrays, values = known
            if counted is plan and all(leaves[p] is a for p, a in zip(plan.read, arrays)):
                return values
        values = iter(_host_counters([leaves[p] for p in plan.read]))
        return [tuple(next(values) for _ in positions) for positions in plan.control_in]

    def _step_at(self, plan: _Plan, index: int, control: Control) -> Step:
        """What update ``index`` does at ``control``: from its table, filled ``TABLE_SIZE`` steps
        at a time from the control values it is missing."""
        table = plan.tables[index]
        found = table.get(control)
        if found is None:
            if len(table) >= TABLE_LIMIT:
                table.clear()
            start = tuple(jax.device_put(np.int32(v), _table_device()) for v in control)
            now, branch, after, known = jax.device_get(plan.steps[index](start))
            now, after = (list(zip(*(x.tolist() for x in values))) for values in (now, after))
            for c, b, a, k in zip(now, branch.tolist(), after, known.tolist()):
                table.setdefault(c, (b, a if k else None))
            found = table[control]
        return found

    def _program(self, key: tuple[int, ...]) -> Callable[..., Any] | None:
        """The program of these branches (a synchronization's), made at its first call; None
        beyond ``SYNC_PROGRAMS`` of them."""
        program = self._syncs.get(key)
        if program is None and len(self._syncs) < SYNC_PROGRAMS:
            program = self._syncs[key] = self._build(self._recording(self._step, key))
        return program

    def _start(self, program: Callable[..., Any], *args: Any) -> Any:
        """``program``'s results, without waiting for them (``__call__`` waits, where the harness's
        steps do, once the host's part of the call is done)."""
        return program.dispatch(*args) if self._waits else program(*args)

    def _whole(self, key: Key) -> Callable[..., Any]:
        """The program of fixed branches ``key`` (LOCAL or a synchronization's), taking and
        returning every argument."""
        return self._local if key == LOCAL else self._syncs[key]

    def _traces_alike(self, entry: _Entry, key: Any, program: Callable, args: tuple) -> bool:
        """The program of ``key`` finds and returns the counters where the general one does
        (traced once per signature, before its first call)."""
        alike = entry.alike.get(key)
        if alike is None:
            if (key, entry.signature) not in self._plans:
                program.trace(*args)
            other, plan = self._plans.get((key, entry.signature)), entry.plan
            alike = entry.alike[key] = other is not None and other[:2] == plan[:2]  # control_in, _out
        return alike

    def _pruning(self, key: Key, signature: tuple, args: tuple, leaves: list, treedef: Any) -> _Pruned | None:
        """The program of ``key`` (LOCAL or a synchronization's branches) for this signature as a
        function of the argument leaves it reads, returning the results that are not arguments
        returned unchanged (built once per program and signature; None where the whole program
        runs)."""
        if (key, signature) in self._pruned:
            return self._pruned[(key, signature)]
        self._pruned[(key, signature)] = None
        if any(_split_over_other_axes(x) for x in leaves):
            return None
        owner = _owners(args)
        # an argument comes back as it came only from a donated argument (the caller gave it up:
        # no other reference of theirs sees it again) and in one result only (two results never
        # share a buffer); any other result is the program's own, a new buffer
        forwarded = self._plans[(key, signature)].forwarded
        times = collections.Counter(forwarded)
        forwarded = tuple(
            f if f is not None and owner[f] in self._donate and times[f] == 1 else None for f in forwarded
        )
        traced = self._whole(key).trace(*args)
        used = _reads(traced, [f is None for f in forwarded])
        if used is None or len(used) != len(leaves):
            return None
        # small results that read no argument (flags, a "last sync" of 0): kept on the host, where
        # the caller donates (and so gives up the results it passes back)
        counters = set(self._plans[(key, signature)].returned)
        sizes = [math.prod(np.shape(x)[self._leading :]) for x in jax.tree.leaves(traced.out_info)]
        scalars = [j for j, f in enumerate(forwarded) if f is None and j not in counters and sizes[j] <= 1]
        constant = tuple(sorted(_constant_results(traced, scalars, len(forwarded)))) if self._donate else ()
        sources = tuple(sorted({f for f in forwarded if f is not None}))
        placeholders = {}  # the arguments it does not read, as one replica's zeros
        for i, x in enumerate(leaves):
            if not used[i] and isinstance(x, jax.Array) and not x.weak_type:
                placeholders[i] = (x.shape[self._leading :], x.dtype)
        taken = [i for i in range(len(leaves)) if i not in placeholders]
        donated = tuple(i for i in taken if owner[i] in self._donate and i not in sources)
        kept = tuple(i for i in taken if i not in donated)
        step = self._step

        @functools.wraps(step)
        def pruned(donated_leaves: tuple, kept_leaves: tuple) -> tuple:
            full: list[Any] = [None] * len(leaves)
            for i, x in (*zip(donated, donated_leaves), *zip(kept, kept_leaves)):
                full[i] = x
            for i, (shape, dtype) in placeholders.items():
                full[i] = jnp.zeros(shape, dtype)
            with local_program.tracing(branches=_branches(key)):
                out = jax.tree.leaves(step(*jax.tree.unflatten(treedef, full)))
            # the arguments it returns unchanged are the full trace's (a placeholder may come back
            # marked as varying over the replicas: a new tracer of the same value)
            ids = {id(x): i for i, x in enumerate(full)}
            returned = [(x, f) for x, f in zip(out, forwarded) if f is not None and f not in placeholders]
            if any(ids.get(id(x)) != f for x, f in returned):
                raise _NotAsTraced
            return tuple(x for j, (x, f) in enumerate(zip(out, forwarded)) if f is None and j not in constant)

        program = self._build(pruned, donate_argnums=(0,) if donated else ())
        out_treedef = self._plans[(key, signature)].out_treedef
        computed = [j for j, f in enumerate(forwarded) if f is None and j not in constant]
        origin = {j: k for k, j in enumerate(computed)}
        origin |= {j: len(computed) + f for j, f in enumerate(forwarded) if f is not None}
        origin |= {j: len(computed) + len(leaves) + k for k, j in enumerate(constant)}
        self._pruned[(key, signature)] = _Pruned(
            program,
            donated,
            kept,
            out_treedef,
            sources,
            constant,
            _picker(donated),
            _picker(kept),
            _picker([origin[j] for j in range(len(forwarded))]),
        )
        return self._pruned[(key, signature)]

    def _run_fixed(
        self, entry: _Entry, key: Key, args: tuple, leaves: list, treedef: Any
    ) -> tuple[Any, list, Any]:
        """The results of the program of ``key`` (the local program, or a synchronization's), their
        leaves, and those the program computes (the others were ready before the call)."""
        pruned = entry.pruned.get(key, False)
        if pruned is False:
            pruned = entry.pruned[key] = self._pruning(key, entry.signature, args, leaves, treedef)
        # an array at two argument positions: the whole program, which donates as jax.jit does
        if not (
            pruned is not None
            and (entry.arrays or all(isinstance(leaves[i], jax.Array) for i in pruned.sources))
            and len(set(map(id, leaves))) == len(leaves)
        ):
            pruned = None
        if pruned is not None:
            constants = entry.constants.get(key, ())  # computed at the first call, and again if deleted
            if len(constants) != len(pruned.constant) or any(map(_IS_DELETED, constants)):
                constants = entry.constants[key] = self._constants(entry, key, args, leaves)
                if self._waits:  # ready before the call returns, as the program's results
                    jax.block_until_ready(constants)
                self._kept = {i: x for i, x in self._kept.items() if not x.is_deleted()}
                self._kept.update((id(x), x) for x in constants)
            donated = pruned.take_donated(leaves)
            if not self._kept.keys().isdisjoint(map(id, donated)):  # read and donated: a copy
                donated = tuple(x.copy() if id(x) in self._kept else x for x in donated)
            try:
                results = self._start(pruned.program, donated, pruned.take_kept(leaves))
            except _NotAsTraced:  # at its first call, before any buffer is donated
                self._pruned[(key, entry.signature)] = entry.pruned[key] = None
            else:
                out = pruned.assemble((*results, *leaves, *constants))
                return jax.tree.unflatten(pruned.out_treedef, out), out, results
        out = self._start(self._whole(key), *self._unshared(args, leaves, treedef))
        return out, jax.tree.leaves(out), out

    def _constants(self, entry: _Entry, key: Key, args: tuple, leaves: list) -> tuple[jax.Array, ...]:
        """The results of the program of ``key`` that read no argument, for ``entry``'s shapes."""
        found = entry.constants_programs.get(key)
        if found is None:
            anchor = next((i for i, x in enumerate(leaves) if isinstance(x, jax.Array)), None)
            pruned, traced = entry.pruned[key], self._whole(key).trace(*args)
            program = _constants_program(traced, pruned.constant, pruned.out_treedef.num_leaves, anchor)
            found = entry.constants_programs[key] = (program, anchor)
        program, anchor = found
        return tuple(program(*([] if anchor is None else [leaves[anchor]])))

    def _unshared(self, args: tuple, leaves: list, treedef: Any) -> tuple:
        """The arguments with a copy of each kept result at a donated position, for a program that
        takes every argument: it may consume the copy, never the array other states hold (two
        runs taking turns, a state and the one before it)."""
        if not self._kept or self._kept.keys().isdisjoint(map(id, leaves)):
            return args
        owner = _owners(args)
        leaves = [
            x.copy() if id(x) in self._kept and owner[i] in self._donate else x for i, x in enumerate(leaves)
        ]
        return jax.tree.unflatten(treedef, leaves)

    def _choose(self, entry: _Entry, branches: tuple[int, ...], args: tuple) -> Key | None:
        """The key of the program of the updates' branches: LOCAL, a synchronization's, else None
        (the general program)."""
        if -1 in branches:
            return None
        key, program = (LOCAL, self._local) if not any(branches) else (branches, self._program(branches))
        if program is None or not self._traces_alike(entry, key, program, args):
            return None
        return key

    def __call__(self, *args: Any) -> Any:
        leaves, treedef = jax.tree.flatten(args)
        entry = self._entry(treedef, leaves)
        if entry is None:
            return self._general(*self._unshared(args, leaves, treedef))  # it waits if it must
        plan = entry.plan
        steps = [self._step_at(plan, i, c) for i, c in enumerate(self._controls(entry, leaves))]
        key = self._choose(entry, tuple(branch for branch, _ in steps), args)
        if key is None:
            out = computed = self._start(self._general, *self._unshared(args, leaves, treedef))
            results = jax.tree.leaves(out)
        else:
            out, results, computed = self._run_fixed(entry, key, args, leaves, treedef)
        after = [control for _, control in steps]
        chain = None
        if None not in after:  # else the next call reads what this one returned
            arrays = [results[p] for p in plan.returned]
            chain = id(arrays[0])
            self._counted[chain] = (plan, arrays, after)
            if len(self._counted) > CHAINS:
                self._counted.pop(next(iter(self._counted)))
        if self._waits:
            try:
                jax.block_until_ready(computed)
            except Exception:  # the program failed (an error a host callback raised): no results
                self._counted.pop(chain, None)
                raise
        if key is not None:
            self.local_calls += key == LOCAL
            self.sync_calls += key != LOCAL
        return out

    def lower_local(self, *args: Any) -> Any:
        """The program a local call with these arguments (arrays) runs, lowered
        (``jax.stages.Lowered``): the local program as a function of what it reads and writes
        where that applies, else the whole local program. Its memory analysis counts the arrays
        it takes and returns; those it leaves where they are (DiLoCo's anchors) are not."""
        leaves, treedef = jax.tree.flatten(args)
        if not all(isinstance(x, jax.Array) for x in leaves):  # shapes alone: nothing to prune
            return self._local.lower(*args)
        entry = self._entry(treedef, leaves)
        if entry is None:
            self._general.trace(*args)  # a plan for this signature, traced first as a call does
            entry = self._entry(treedef, leaves)
        pruned = None
        if entry is not None and self._traces_alike(entry, LOCAL, self._local, args):
            pruned = self._pruning(LOCAL, entry.signature, args, leaves, treedef)
        if pruned is None:
            return self._local.lower(*args)
        return pruned.program.lower(pruned.take_donated(leaves), pruned.take_kept(leaves))

    @property
    def general_program(self) -> Callable[..., Any]:
        """The step as the harness compiles it without ``split_local_steps``."""
        return self._general

    @property
    def local_program(self) -> Callable[..., Any]:
        """The step with every periodic update taking its local step only (``lower`` it with a
        state at a local step: it computes what the general program computes there, up to
        rounding, see ``optaxdist.transforms.local_program``). It takes and returns every
        argument; the calls run it as a function of what it reads and writes, where they can."""
        return self._local

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._general, name)
