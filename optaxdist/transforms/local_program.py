"""Local steps as a program of their own: what the periodic engine tells a harness while it traces.

A periodic transform's step is one program whose ``lax.switch`` picks, from the replicated step
counter, the local step or a synchronization. Whatever the branch, the update crosses the
conditional, so it is written to memory and cannot fuse with ``params + updates`` after it, and
every branch's buffers are reserved. A harness made with ``split_local_steps=True``
(``optaxdist.simulate`` / ``on_mesh`` / ``on_mpi`` / ``on_node``) compiles the user's step once
per branch that runs instead:

* the **general** program, as without the option; while it is traced, each periodic update
  records a ``Schedule``: the control values it got (a step counter), the ones it returns, and a
  function that tells from control values which branch the update takes there, where a program
  of that branch alone computes it (not at the start check, in the warm-up, or on the first step
  after it, where a ``begin`` hook runs: those run the general program), and what it returns;
* the **local** program, traced under ``tracing(branches=lambda position: 0)``: each periodic
  update emits its local step only (the switch's branch 0, without the start check);
* a **synchronization's** program, traced under ``tracing(branches=...)`` with the branch of each
  update: the local step and that synchronization, without a conditional (compiled the first
  time a call takes it).

The harness keeps the control values on the host (read from the device once, and again only
when a call gets a state that none of the last calls returned, or after a call whose control
depends on the data) and runs, on each call, the program of the branches every recorded update
takes. These programs run the same operations, which XLA may
compile differently: the local program may fuse ``params + lr · m`` into one fused multiply-add
where the general program rounds the update first. ``tests/test_split_local_steps.py`` compares
them bit for bit where no product rounds (momentum SGD at learning rates that are powers of
two) and to a rounding otherwise.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax


class Schedule(NamedTuple):
    """One periodic update, as traced.

    Attributes:
      control_in: the (traced) replicated scalars its schedule reads, a tuple: the step counter
        of the periodic engine, DASO's batch index, cycle and pending send.
      control_out: the ones it returned, in the same order.
      plan: ``control → (branch, next control, known)``, pure jnp on int32 scalars (booleans as
        0 / 1): the branch the update takes at ``control``, where a program of that branch alone
        computes it (0: the local step only; ``k ≥ 1``: the local step then synchronization
        ``k``; -1: only the general program does, as at the start check, in the warm-up or where
        a ``begin`` hook runs), the control it returns there, and whether that does not depend
        on the data (False where it does, as DASO's cycle at an epoch's end: the harness then
        reads the returned control from the device).
      position: the update's place in the step, in the order of ``next_update`` calls (the
        index of its branch in a harness's ``tracing(branches=...)``).
    """

    control_in: tuple[Any, ...]
    control_out: tuple[Any, ...]
    plan: Callable[[tuple[jax.Array, ...]], tuple[jax.Array, tuple[jax.Array, ...], jax.Array]]
    position: int


class _Trace:
    """What a harness's trace of a step shares with the periodic updates in it."""

    def __init__(self, branches: Callable[[int], int | None] | None):
        self.branches = branches
        self.updates = 0  # ``next_update`` calls so far
        self.recorded: list[Schedule] = []
        self.flags: dict[int, tuple[Any, int]] = {}  # ``mark_flags``: id → (traced flag, its value)


_TRACE: contextvars.ContextVar[_Trace | None] = contextvars.ContextVar("optaxdist_trace", default=None)


def next_update() -> tuple[int, int | None]:
    """For a periodic update being traced: its position in the step, and the branch of its
    schedule the program being traced takes (None: the general program, a ``lax.switch`` on the
    counter; 0: the local step only; ``k``: the local step then synchronization ``k``)."""
    trace = _TRACE.get()
    if trace is None:
        return 0, None
    position, trace.updates = trace.updates, trace.updates + 1
    return position, None if trace.branches is None else trace.branches(position)


def static_program() -> bool:
    """True while a harness traces a program of fixed branches (its local program, or a
    synchronization's): no conditional is needed to pick what runs."""
    trace = _TRACE.get()
    return trace is not None and trace.branches is not None


def mark_flags(flags: Any, values: Sequence[int]) -> None:
    """Note the exact-sync flags an update of a fixed branch returns (a tree of traced int8
    scalars) with their values, known when traced, so that ``optaxdist.sync_params`` given
    exactly these traced values picks its leaves without a conditional."""
    trace = _TRACE.get()
    if trace is not None and trace.branches is not None:
        trace.flags.update((id(x), (x, v)) for x, v in zip(jax.tree.leaves(flags), values, strict=True))


def static_flag(flag: Any) -> int | None:
    """The value ``mark_flags`` noted for ``flag`` in the program being traced, else None (it
    goes by the traced value, not by a context: a jitted helper's trace, which JAX reuses in
    another program, never matches)."""
    trace = _TRACE.get()
    marked = None if trace is None else trace.flags.get(id(flag))
    return marked[1] if marked is not None and marked[0] is flag else None


def record(schedule: Schedule) -> None:
    """Tell the harness tracing this step about one periodic update (nothing outside a harness)."""
    trace = _TRACE.get()
    if trace is not None:
        trace.recorded.append(schedule)


@contextlib.contextmanager
def tracing(*, branches: Callable[[int], int | None] | None = None) -> Iterator[list[Schedule]]:
    """Trace a step: the ``Schedule`` of every periodic update it runs is appended to the list
    this yields. ``branches``: the branch the update at each position takes (None: the general
    program; ``lambda position: 0``: the local program)."""
    trace = _Trace(branches)
    token = _TRACE.set(trace)
    try:
        yield trace.recorded
    finally:
        _TRACE.reset(token)
