"""``split_local_steps=True``: a harness that runs the periodic transforms' local steps as a program
of their own (``optaxdist.transforms.local_program``), chosen on the host from the step counters."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from optaxdist.transforms import local_program

INT32_MAX = int(np.iinfo(np.int32).max)
TABLE_SIZE = 4096  # counter values whose schedule is evaluated at once, on the host's CPU


class _Plan(NamedTuple):
    """Where one trace's periodic updates find and return their counters (positions in the
    flattened arguments and results), each update's ``Schedule.plain_local`` (jitted once), and
    the tables of its values computed so far (``index → (first counter, bools)``)."""

    step_in: tuple[int, ...]
    step_out: tuple[int, ...]
    plain_local: tuple[Callable[[jax.Array], jax.Array], ...]
    tables: dict[int, tuple[int, np.ndarray]]


def _plan(arg_leaves: list, out: Any, recorded: list[local_program.Schedule]) -> _Plan | None:
    """The plan of one trace, or None (with a warning) where the step has no periodic update, or
    where their counters are not the step's own arguments and results (an update inside a
    ``lax.cond``, a ``scan``, another transform's branch; a counter the step does not return):
    such a step always runs the general program. ``arg_leaves``: the arguments' leaves as the
    step got them (a step may update its arguments in place, as Flax NNX's ``merge`` and
    ``Optimizer.update`` do)."""
    inputs = {id(x): i for i, x in enumerate(arg_leaves)}
    outputs = {id(x): i for i, x in enumerate(jax.tree.leaves(out))}
    try:
        step_in = tuple(inputs[id(r.step_in)] for r in recorded)
        step_out = tuple(outputs[id(r.step_out)] for r in recorded)
    except KeyError:
        why = (
            "a periodic update's step counter is not one of the step's own arguments and results "
            "(an update inside optax.MultiSteps, a lax.scan or another transform's branch, or a "
            "state the step does not return)"
        )
    else:
        if recorded:
            return _Plan(step_in, step_out, tuple(jax.jit(r.plain_local) for r in recorded), {})
        why = "the step runs no periodic transform"
    warnings.warn(f"split_local_steps: {why}; every call runs the general program", stacklevel=2)
    return None


def _signature(treedef: Any, leaves: list, leading: int) -> tuple:
    """What makes ``jax.jit`` trace the step again, as one replica's step sees it: the
    arguments' structure, and their shapes (without the ``leading`` stacked axes), dtypes and
    weak types."""
    return treedef, tuple(
        (np.shape(x)[leading:], getattr(x, "dtype", type(x)), getattr(x, "weak_type", False)) for x in leaves
    )


def _host_counter(x: Any) -> int:
    """A replicated counter's value: the largest over the replicas this process holds (what
    ``Communicator.uniform`` makes of it under ``simulate``); one blocking read."""
    if isinstance(x, jax.Array):
        return max(int(np.asarray(s.data).max()) for s in x.addressable_shards)
    return int(np.asarray(x).max())


def _table_device() -> jax.Device:
    """Where the schedules are evaluated: this process's CPU, else its first device."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # no CPU backend (JAX_PLATFORMS=cuda)
        return jax.local_devices()[0]


class SplitLocalSteps:
    """A harness step compiled twice: the general program, and the local program in which every
    periodic update of the step takes its local step only. A call runs the local program when
    the step counters say that every periodic update of this call is a plain local step.

    ``build`` makes the harness's compiled step of a per-replica step; ``leading`` is the number
    of stacked axes the harness's arguments have in front of one replica's (1, or 0 under MPI).
    The counters are kept on the host. They are read from the arguments (one blocking read of a
    scalar per transform) on the first call after the step's first trace, and whenever a call's
    counters are not the arrays the previous call returned; otherwise they are counted. A call
    with arguments of a new signature (structure, shapes, dtypes) runs the general program: its
    trace says where the counters are. The schedules are evaluated ``TABLE_SIZE`` counter values
    at a time on the CPU.
    Arguments that are tracers (a call from inside another ``jax.jit``) run the general program.
    ``local_calls`` counts the calls that ran the local program; everything else (``lower``,
    ``trace``, ``agreement``...) is the general program's.
    """

    def __init__(
        self,
        build: Callable[[Callable[..., Any]], Callable[..., Any]],
        step: Callable[..., Any],
        leading: int,
    ):
        self._plans: dict[tuple[bool, tuple], _Plan | None] = {}  # (local?, signature) → plan
        self._leading = leading
        self._general = build(self._recording(step, local=False))
        self._local = build(self._recording(step, local=True))
        self._last: tuple[tuple, list, list[int]] | None = None  # signature, counters, values
        self.local_calls = 0

    def _recording(self, step: Callable[..., Any], *, local: bool) -> Callable[..., Any]:
        @functools.wraps(step)  # the configuration check follows the user's step from here
        def traced(*args: Any) -> Any:
            leaves, treedef = jax.tree.flatten(args)  # before the step, which may update them
            with local_program.tracing(local=local) as recorded:
                out = step(*args)
            self._plans[(local, _signature(treedef, leaves, 0))] = _plan(leaves, out, recorded)
            return out

        return traced

    def _counters(self, plan: _Plan, signature: tuple, leaves: list) -> list[int]:
        if self._last is not None:
            last_signature, arrays, values = self._last
            if last_signature == signature and all(leaves[p] is a for p, a in zip(plan.step_in, arrays)):
                return values
        return [_host_counter(leaves[p]) for p in plan.step_in]

    def _plain_local(self, plan: _Plan, index: int, counter: int) -> bool:
        start, table = plan.tables.get(index, (0, np.zeros(0, bool)))
        if not start <= counter < start + len(table):
            start = counter
            values = np.minimum(np.arange(TABLE_SIZE, dtype=np.int64) + counter, INT32_MAX).astype(np.int32)
            table = np.asarray(plan.plain_local[index](jax.device_put(values, _table_device())))
            plan.tables[index] = (start, table)
        return bool(table[counter - start])

    def _local_traces_alike(self, plan: _Plan, signature: tuple, args: tuple) -> bool:
        """The local program finds and returns the counters where the general one does (traced
        once per signature, before its first call)."""
        if (True, signature) not in self._plans:
            self._local.trace(*args)
        other = self._plans.get((True, signature))
        return other is not None and (other.step_in, other.step_out) == (plan.step_in, plan.step_out)

    def __call__(self, *args: Any) -> Any:
        leaves, treedef = jax.tree.flatten(args)
        signature = _signature(treedef, leaves, self._leading)
        plan = self._plans.get((False, signature))
        counters = None
        if plan is not None and not any(isinstance(x, jax.core.Tracer) for x in leaves):
            counters = self._counters(plan, signature, leaves)
        local = (
            counters is not None
            and all(self._plain_local(plan, i, c) for i, c in enumerate(counters))
            and self._local_traces_alike(plan, signature, args)
        )
        out = (self._local if local else self._general)(*args)
        self.local_calls += local
        self._last = None
        if counters is not None:
            results = jax.tree.leaves(out)
            arrays = [results[p] for p in plan.step_out]
            self._last = (signature, arrays, [min(c + 1, INT32_MAX) for c in counters])
        return out

    @property
    def general_program(self) -> Callable[..., Any]:
        """The step as the harness compiles it without ``split_local_steps``."""
        return self._general

    @property
    def local_program(self) -> Callable[..., Any]:
        """The step with every periodic update taking its local step only (``lower`` it with a
        state at a local step: it computes what the general program computes there, up to
        rounding, see ``optaxdist.transforms.local_program``)."""
        return self._local

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._general, name)
