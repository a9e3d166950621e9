"""``split_local_steps=True``: a harness that runs the periodic transforms' local steps as a program
of their own (``optaxdist.transforms.local_program``), chosen on the host from the step counters."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from optaxdist.transforms import local_program

INT32_MAX = np.iinfo(np.int32).max
TABLE_SIZE = 4096  # counter values whose schedule is evaluated at once, on the host's CPU


class _Plan(NamedTuple):
    """Where the traced step's periodic updates find and return their counters: positions in the
    flattened arguments and results, and each update's ``Schedule.plain_local``."""

    step_in: tuple[int, ...]
    step_out: tuple[int, ...]
    plain_local: tuple[Callable[[jax.Array], jax.Array], ...]


def _plan(args: tuple, out: Any, recorded: list[local_program.Schedule]) -> _Plan | None:
    """The plan of one trace, or None where the counters are not the step's own arguments and
    results (an update inside a ``lax.cond``, a ``scan``, another transform's branch; a counter
    the step does not return): such a step always runs the general program."""
    if not recorded:
        return None
    inputs = {id(x): i for i, x in enumerate(jax.tree.leaves(args))}
    outputs = {id(x): i for i, x in enumerate(jax.tree.leaves(out))}
    try:
        step_in = tuple(inputs[id(r.step_in)] for r in recorded)
        step_out = tuple(outputs[id(r.step_out)] for r in recorded)
    except KeyError:
        return None
    return _Plan(step_in, step_out, tuple(r.plain_local for r in recorded))


def _host_int(x: Any) -> int:
    """A replicated counter's value (one blocking read of one device's copy)."""
    if isinstance(x, jax.Array):
        x = x.addressable_shards[0].data
    return int(np.asarray(x).reshape(-1)[0])


class SplitLocalSteps:
    """A harness step compiled twice: the general program, and the local program that every
    periodic update of the step traces as its local step only. A call runs the local program when
    the step counters say that every periodic update of this call is a plain local step.

    The counters are kept on the host: read from the arguments (one blocking read of a scalar per
    transform) at the first call and whenever a call's counters are not the arrays the previous
    call returned, else counted. The schedules are evaluated ``TABLE_SIZE`` counter values at a
    time on the CPU. Keyword arguments, and arguments that are tracers, run the general program.
    Everything else (``lower``, ``trace``, ``agreement``...) is the general program's.
    """

    def __init__(self, build: Callable[[Callable[..., Any]], Callable[..., Any]], step: Callable[..., Any]):
        self._plans: dict[tuple[bool, Any], _Plan | None] = {}
        self._general = build(self._recording(step, local=False))
        self._local = build(self._recording(step, local=True))
        self._last: tuple[Any, list, list[int]] | None = None  # structure, counter arrays, values
        self._tables: dict[tuple[Any, int], tuple[Callable, int, np.ndarray]] = {}
        self.local_calls = 0  # calls that ran the local program

    def _recording(self, step: Callable[..., Any], *, local: bool) -> Callable[..., Any]:
        @functools.wraps(step)  # the configuration check follows the user's step from here
        def traced(*args: Any) -> Any:
            with local_program.tracing(local=local) as recorded:
                out = step(*args)
            self._plans[(local, jax.tree.structure(args))] = _plan(args, out, recorded)
            return out

        return traced

    def _counters(self, plan: _Plan, treedef: Any, leaves: list) -> list[int]:
        if self._last is not None:
            structure, arrays, values = self._last
            if structure == treedef and all(leaves[p] is a for p, a in zip(plan.step_in, arrays)):
                return values
        return [_host_int(leaves[p]) for p in plan.step_in]

    def _plain_local(self, treedef: Any, index: int, fn: Callable, counter: int) -> bool:
        key = (treedef, index)
        jitted, start, table = self._tables.get(key, (None, 0, np.zeros(0, bool)))
        if not start <= counter < start + len(table):
            jitted = jitted or jax.jit(fn)
            start = counter
            values = np.minimum(np.arange(TABLE_SIZE, dtype=np.int64) + counter, INT32_MAX)
            cpu = jax.devices("cpu")[0]
            table = np.asarray(jitted(jax.device_put(values.astype(np.int32), cpu)))
            self._tables[key] = (jitted, start, table)
        return bool(table[counter - start])

    def _local_traces_alike(self, plan: _Plan, treedef: Any, args: tuple) -> bool:
        """The local program finds and returns the counters where the general one does (traced
        once per argument structure, before its first call)."""
        if (True, treedef) not in self._plans:
            self._local.trace(*args)
        other = self._plans[(True, treedef)]
        return other is not None and other[:2] == plan[:2]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree.flatten(args)
        plan = self._plans.get((False, treedef))
        counters = None
        if plan is not None and not kwargs and not any(isinstance(x, jax.core.Tracer) for x in leaves):
            counters = self._counters(plan, treedef, leaves)
        local = (
            counters is not None
            and all(
                self._plain_local(treedef, i, fn, c)
                for i, (fn, c) in enumerate(zip(plan.plain_local, counters))
            )
            and self._local_traces_alike(plan, treedef, args)
        )
        out = (self._local if local else self._general)(*args, **kwargs)
        self.local_calls += local
        self._last = None
        if counters is not None:
            results = jax.tree.leaves(out)
            arrays = [results[p] for p in plan.step_out]
            self._last = (treedef, arrays, [min(c + 1, INT32_MAX) for c in counters])
        return out

    @property
    def general_program(self) -> Callable[..., Any]:
        """The step as the harness compiles it without ``split_local_steps``."""
        return self._general

    @property
    def local_program(self) -> Callable[..., Any]:
        """The step with every periodic update taking its local step only (``lower`` it with a
        state at a local step: it computes what the general program computes there)."""
        return self._local

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._general, name)
