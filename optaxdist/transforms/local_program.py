"""Local steps as a program of their own: what the periodic engine tells a harness while it traces.

A periodic transform's step is one program whose ``lax.switch`` picks, from the replicated step
counter, the local step or a synchronization. Whatever the branch, the update crosses the
conditional, so it is written to memory and cannot fuse with ``params + updates`` after it, and
every branch's buffers are reserved. A harness made with ``split_local_steps=True``
(``optaxdist.simulate`` / ``on_mesh`` / ``on_mpi`` / ``on_node``) compiles the user's step twice
instead:

* the **general** program, as without the option; while it is traced, each periodic update
  records a ``Schedule``: the counter it got, the counter it returns, and a function that tells
  from a counter value whether that update is a plain local step (no synchronization, no warm-up,
  no start check, not the first step after the warm-up where a ``begin`` hook runs);
* the **local** program, traced under ``tracing(local=True)``: each periodic update emits its
  local step only (the switch's branch 0, without the start check) and nothing else.

The harness keeps the counters on the host (read from the device once, and again only when a
call gets a state that none of the last calls returned) and runs the local program on
the calls where every recorded update is a plain local step. On such a call both programs run
the same operations, which XLA may compile differently: the local program may fuse
``params + lr · m`` into one fused multiply-add where the general program rounds the update
first. ``tests/test_split_local_steps.py`` compares them bit for bit where no product rounds
(momentum SGD at learning rates that are powers of two) and to a rounding otherwise.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax


class Schedule(NamedTuple):
    """One periodic update, as traced.

    Attributes:
      step_in: the (traced) step counter the update got.
      step_out: the (traced) step counter it returned.
      plain_local: ``counters → bools``: for int32 counter values (an array, as ``step_in``
        holds them), whether the update at that value runs the local step only. Pure jnp.
    """

    step_in: Any
    step_out: Any
    plain_local: Callable[[jax.Array], jax.Array]


_LOCAL_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("optaxdist_local_only", default=False)
_UNSYNCED: contextvars.ContextVar[dict[int, Any] | None] = contextvars.ContextVar(
    "optaxdist_unsynced", default=None
)
_RECORDED: contextvars.ContextVar[list[Schedule] | None] = contextvars.ContextVar(
    "optaxdist_schedules", default=None
)


def local_only() -> bool:
    """True while a harness traces the local program: a periodic update emits its local step only."""
    return _LOCAL_ONLY.get()


def mark_unsynced(flags: Any) -> None:
    """Note the exact-sync flags a local step returns (every leaf "nothing agreed", known when
    traced), so that ``optaxdist.sync_params`` given exactly these values sets nothing."""
    marked = _UNSYNCED.get()
    if marked is not None:
        marked.update((id(x), x) for x in jax.tree.leaves(flags))


def unsynced(flag: Any) -> bool:
    """``flag`` is one that ``mark_unsynced`` noted in the program being traced (a value, not a
    context: a jitted helper's trace, which JAX reuses in the other program, never matches)."""
    marked = _UNSYNCED.get()
    return marked is not None and marked.get(id(flag)) is flag


def record(schedule: Schedule) -> None:
    """Tell the harness tracing this step about one periodic update (nothing outside a harness)."""
    recorded = _RECORDED.get()
    if recorded is not None:
        recorded.append(schedule)


@contextlib.contextmanager
def tracing(*, local: bool) -> Iterator[list[Schedule]]:
    """Trace a step: the ``Schedule`` of every periodic update it runs is appended to the list
    this yields; with ``local``, those updates emit their local step only."""
    recorded: list[Schedule] = []
    tokens = (_LOCAL_ONLY.set(local), _RECORDED.set(recorded), _UNSYNCED.set({} if local else None))
    try:
        yield recorded
    finally:
        _UNSYNCED.reset(tokens[2])
        _RECORDED.reset(tokens[1])
        _LOCAL_ONLY.reset(tokens[0])
