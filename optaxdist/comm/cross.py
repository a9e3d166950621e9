"""``CrossComm``: MPI between nodes, for a program that runs over the devices of each node.

One process per node (``mpirun``/``srun``), several devices per process, a ``jax.shard_map`` over the
process's devices: device ``l`` of every node forms one group (Heat DASO's "MPI group ``l``"), and
the ``G`` groups of a node exchange at the same time, each on its own MPI communicator.

mpi4jax's primitives carry an ordered effect, which JAX refuses in a program over several devices,
so the exchange runs in a host callback (``jax.pure_callback``) calling mpi4py with NumPy buffers.
What keeps it matched and moving:

* Every message is point-to-point with a **tag numbered at trace time** (``numbered_exchanges``,
  entered by ``optaxdist.on_node`` for each trace of the step). MPI matches messages by source, tag
  and communicator, so exchanges in flight at once on one device never take each other's data.
  Every node compiles the same program, and a device runs its exchanges in that program's order;
  the tags do not make a different order safe (a callback blocks until its peers answer).
* The callback computes with NumPy and mpi4py only (JAX hands it its operands), and ``on_node``
  waits for each step's results before the next step starts: a callback blocks its device's thread
  until the peers answer, and a second step queued behind it could hold the threads they need.

* Every exchange has a deadline (``node_hierarchy(timeout_s=...)``): it polls its requests
  (``Testall``, sleeping a little longer each time, up to 1 ms) instead of blocking in ``Waitall``.
  A peer that has not answered by then (a node that skipped a step, ran another program or died)
  gets an ``ExchangeTimeout`` naming this rank, the peers not heard from, the exchange and the
  deadline, written to stderr and raised in the callback (an ``XlaRuntimeError`` on the caller of
  the step); and since the job's messages are out of step for good, the MPI job is aborted
  (``MPI_Abort``, which makes ``mpirun`` end every node) when this process exits — before MPI's
  finalize, which could wait for the silent peer — or ``timeout_s`` later if it is still running.

The all-reduce is the bandwidth-optimal direct scheme: block ``j`` of the data goes to node ``j``,
which adds the ``N`` blocks in node order and sends the sum back to everybody — ``2(N−1)/N`` of the
data out and in per device, like a ring, in two rounds of messages instead of ``2(N−1)``.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import dataclasses
import itertools
import math
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optaxdist._compat import host_callback, manual_axes, pcast_varying
from optaxdist.comm.base import Communicator, refuse_all_to_all

_TAGS: contextvars.ContextVar[Iterator[int] | None] = contextvars.ContextVar("optaxdist_tags", default=None)
_PHASES = 2  # tags per exchange: its two rounds of messages never share a tag
DEFAULT_TIMEOUT_S = 300.0
_FIRST_PAUSE_S, _LONGEST_PAUSE_S = 2e-5, 1e-3  # between polls of an exchange's requests


class ExchangeTimeout(TimeoutError):
    """A cross-node exchange heard nothing from some peer within ``timeout_s``."""


def check_timeout(timeout_s: Any) -> float:
    """``timeout_s`` as a float, or a ``ValueError`` naming the parameter."""
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not (math.isfinite(timeout_s) and timeout_s > 0)
    ):
        raise ValueError(
            f"timeout_s={timeout_s!r} must be a positive finite number of seconds: how long a "
            "cross-node exchange waits for the other nodes before it ends the job"
        )
    return float(timeout_s)


@contextlib.contextmanager
def numbered_exchanges() -> Iterator[None]:
    """Number the cross-node exchanges traced inside, from 0 (``on_node`` enters it per trace).

    Every process traces the same step, so the same exchange gets the same number everywhere."""
    token = _TAGS.set(itertools.count())
    try:
        yield
    finally:
        _TAGS.reset(token)


def _next_tag(upper_bound: int) -> int:
    counter = _TAGS.get()
    if counter is None:
        raise RuntimeError(
            "a cross-node exchange (CrossComm, NodeComm) was traced outside optaxdist.on_node: "
            "on_node numbers the exchanges of each step so that every node matches them; run the "
            "step with on_node(step, hierarchy)"
        )
    return (next(counter) % (upper_bound // _PHASES)) * _PHASES


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - depends on the installed extras
        raise ImportError("one process per node needs mpi4py: pip install 'optaxdist[mpi]'") from e
    return MPI


_HALF_FLOATS = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def _accumulator(dtype: np.dtype) -> np.dtype:
    # The cross-node stage adds 16-bit floats in float32 and rounds once, as MpiComm does.
    return np.dtype(np.float32) if dtype in _HALF_FLOATS else dtype


def _as_bytes(a: np.ndarray) -> np.ndarray:
    """The bytes of ``a`` (contiguous), a view: a receive buffer must be the array itself."""
    return a.reshape(-1).view(np.uint8)


class _Exchange:
    """The host side: one duplicated communicator per local index; NumPy in, NumPy out."""

    def __init__(
        self, comm: Any, local_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S, abort: bool = True
    ):
        self.timeout_s = check_timeout(timeout_s)
        self.abort = bool(abort)
        MPI = _mpi()
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                "one process per node needs MPI initialised with MPI_THREAD_MULTIPLE (the devices of "
                f"a node exchange from their own threads); this MPI gives level {MPI.Query_thread()}. "
                "Do not set mpi4py.rc.thread_level below 'multiple', and use an MPI built with "
                "thread support (the mpich wheel is)"
            )
        self.comm = comm
        self.comms = tuple(comm.Dup() for _ in range(local_size))
        self.rank = int(comm.Get_rank())
        self.size = int(comm.Get_size())
        self.tag_ub = int(comm.Get_attr(MPI.TAG_UB))
        self._abandoned: list[Any] = []
        self._lock, self._armed = threading.Lock(), False

    def host_allgather(self, data: bytes) -> list[bytes]:
        """Every node's ``data`` (host bytes), outside compiled code."""
        return [bytes(d) for d in self.comm.allgather(bytes(data))]

    def _talk(
        self,
        local: int,
        tag: int,
        sends: list[tuple[int, np.ndarray]],
        recvs: list[tuple[int, np.ndarray]],
        what: str = "exchange",
    ):
        MPI = _mpi()
        comm = self.comms[local]
        requests = [comm.Irecv([_as_bytes(buf), MPI.BYTE], source=src, tag=tag) for src, buf in recvs]
        requests += [comm.Isend([_as_bytes(buf), MPI.BYTE], dest=dst, tag=tag) for dst, buf in sends]
        if not requests or MPI.Request.Testall(requests):
            return
        deadline = time.monotonic() + self.timeout_s
        pause = _FIRST_PAUSE_S
        while not MPI.Request.Testall(requests):
            left = deadline - time.monotonic()
            if left <= 0:
                self._expired(local, tag, what, requests, sends, recvs)
            time.sleep(min(pause, max(left, 0.0)))
            pause = min(2 * pause, _LONGEST_PAUSE_S)

    def _expired(self, local, tag, what, requests, sends, recvs):
        """Name what did not arrive, then end the job (or raise, with ``abort=False``)."""
        peers = [("from", src) for src, _ in recvs] + [("to", dst) for dst, _ in sends]
        pending = [peer for request, peer in zip(requests, peers) if not request.Test()]
        silent = sorted({rank for way, rank in pending if way == "from"})
        unsent = sorted({rank for way, rank in pending if way == "to"})
        message = (
            f"optaxdist: cross-node exchange timed out on rank {self.rank} of {self.size} "
            f"(local device {local}): {what} (MPI tag {tag}) heard nothing from rank(s) {silent}"
            + (f" and could not deliver to rank(s) {unsent}" if unsent else "")
            + f" within timeout_s={self.timeout_s:g} s (node_hierarchy(timeout_s=...)). A node "
            "skipped or added a step, ran a different program, or died"
        )
        # The buffers stay referenced: a late message must not land in freed memory.
        self._abandoned.append((requests, sends, recvs))
        if self.abort:
            self._arm_abort(message)
        raise ExchangeTimeout(message)

    def _arm_abort(self, message: str) -> None:
        """The job cannot go on (its messages are out of step): report once, then abort it when
        this process exits (before MPI's finalize, which could wait for the silent peer) or
        ``timeout_s`` from now, whichever comes first — the error meanwhile reaches the caller."""
        with self._lock:
            if self._armed:
                return
            self._armed = True
        print(
            f"{message}. The MPI job is aborted when this process exits, or in {self.timeout_s:g} s.",
            file=sys.stderr,
            flush=True,
        )
        atexit.register(self._abort, "at exit")
        threading.Thread(target=self._abort_later, name="optaxdist-abort", daemon=True).start()

    def _abort_later(self) -> None:
        time.sleep(self.timeout_s)
        self._abort(f"{self.timeout_s:g} s after the timeout")

    def _abort(self, when: str) -> None:
        print(
            f"optaxdist: rank {self.rank}: aborting the MPI job ({when}) after a cross-node "
            "exchange timed out",
            file=sys.stderr,
            flush=True,
        )
        self.comm.Abort(1)

    def _reduce_blocks(self, local: int, tag: int, blocks: np.ndarray, op: str) -> np.ndarray:
        """Block ``rank`` of the sum over nodes of ``blocks`` (``[size, B]``), added in node order."""
        others = [j for j in range(self.size) if j != self.rank]
        arrived = np.empty_like(blocks)
        sends, recvs = [(j, blocks[j]) for j in others], [(j, arrived[j]) for j in others]
        self._talk(local, tag, sends, recvs, _describe(op, tag))
        arrived[self.rank] = blocks[self.rank]
        acc = arrived[0].astype(_accumulator(blocks.dtype))
        for j in range(1, self.size):
            acc = acc + arrived[j].astype(acc.dtype)
        return acc.astype(blocks.dtype)

    def _gather(self, local: int, tag: int, mine: np.ndarray, op: str) -> np.ndarray:
        others = [j for j in range(self.size) if j != self.rank]
        out = np.empty((self.size,) + mine.shape, mine.dtype)
        out[self.rank] = mine
        sends, recvs = [(j, mine) for j in others], [(j, out[j, ...]) for j in others]
        self._talk(local, tag, sends, recvs, _describe(op, tag))
        return out

    def all_reduce(self, local: int, tag: int, x: np.ndarray) -> np.ndarray:
        flat = x.reshape(-1)
        block = -(-flat.size // self.size)
        padded = np.zeros(block * self.size, x.dtype)
        padded[: flat.size] = flat
        mine = self._reduce_blocks(local, tag, padded.reshape(self.size, block), "all-reduce")
        return self._gather(local, tag + 1, mine, "all-reduce").reshape(-1)[: flat.size].reshape(x.shape)

    def reduce_scatter(self, local: int, tag: int, x: np.ndarray) -> np.ndarray:
        return self._reduce_blocks(local, tag, x.reshape(self.size, -1), "reduce-scatter")

    def all_gather(self, local: int, tag: int, x: np.ndarray) -> np.ndarray:
        return self._gather(local, tag, x, "all-gather")

    def permute(self, local: int, tag: int, x: np.ndarray, dest: Routes, source: Routes) -> np.ndarray:
        """Send ``x`` to node ``dest[local][rank]``, receive from ``source[local][rank]`` (−1:
        none; nothing received is 0)."""
        out = np.zeros_like(x)
        to, frm = dest[local][self.rank], source[local][self.rank]
        sends, recvs = [(to, x)] if to >= 0 else [], [(frm, out)] if frm >= 0 else []
        self._talk(local, tag, sends, recvs, _describe("permute", tag))
        return out


@dataclasses.dataclass(frozen=True, eq=False)
class CrossComm(Communicator):
    """The devices with my local index on every node, through MPI (one process per node).

    Used inside ``optaxdist.on_node``: the program runs over the node's devices (mesh axis
    ``local_axis``), and device ``l`` exchanges with device ``l`` of the other nodes. Build it with
    ``optaxdist.node_hierarchy``, which also gives the node-local and world groups.
    """

    exchange: _Exchange
    local_axis: str
    local_size: int

    @property
    def size(self) -> int:
        return self.exchange.size

    @property
    def rank(self) -> int:
        """This node's rank (a static Python int, the MPI rank of this process)."""
        return self.exchange.rank

    @property
    def mpi_comm(self) -> Any:
        """The mpi4py communicator of the nodes (for host-side exchanges of your own)."""
        return self.exchange.comm

    def index(self) -> jax.Array:
        # A callback, not the constant rank, so that every node compiles the same program.
        return jax.pure_callback(
            lambda: np.int32(self.exchange.rank),
            jax.ShapeDtypeStruct((), jnp.int32),
            vmap_method="broadcast_all",
        )

    def describe(self) -> dict[str, Any]:
        return {
            "type": "CrossComm",
            "nodes": self.size,
            "local_axis": self.local_axis,
            "local_size": self.local_size,
        }

    def _call(self, method: str, x: jax.Array, out: jax.ShapeDtypeStruct, *static: Any) -> jax.Array:
        if self.local_axis not in manual_axes():
            raise RuntimeError(
                f"{type(self).__name__} runs inside a jax.shard_map over the node's devices (axis "
                f"{self.local_axis!r}): use optaxdist.on_node(step, hierarchy)"
            )
        tag = _next_tag(self.exchange.tag_ub)
        fn = getattr(self.exchange, method)

        def host(local, value):
            return np.asarray(fn(int(local), tag, np.require(value, requirements="C"), *static), out.dtype)

        local = jax.lax.axis_index(self.local_axis)
        x = pcast_varying(x, (self.local_axis,))
        # not jax.pure_callback: its copy of the operands onto CPU device 0 deadlocks a node of CPU
        # devices (device 0 is busy with its own part of the step; see host_callback)
        return host_callback(host, out, local, x)

    def _psum(self, x):
        return self._call("all_reduce", x, jax.ShapeDtypeStruct(x.shape, x.dtype))

    def _all_gather(self, x):
        return self._call("all_gather", x, jax.ShapeDtypeStruct((self.size,) + x.shape, x.dtype))

    def _psum_scatter(self, x):
        return self._call("reduce_scatter", x, jax.ShapeDtypeStruct((x.shape[0] // self.size,), x.dtype))

    has_all_to_all = False

    def _all_to_all(self, x):
        refuse_all_to_all(self)

    def _permute(self, x, perm):
        return self.permute_per_local(x, (perm,) * self.local_size)

    def permute_per_local(self, x: jax.Array, perms: tuple[tuple[tuple[int, int], ...], ...]) -> jax.Array:
        """``permute`` with its own node permutation ``perms[l]`` for the devices of local index
        ``l`` (the G groups exchange at once)."""
        dest = tuple(tuple(_table(perm, self.size, 0)) for perm in perms)
        source = tuple(tuple(_table(perm, self.size, 1)) for perm in perms)
        return self._call("permute", x, jax.ShapeDtypeStruct(x.shape, x.dtype), dest, source)


Routes = tuple[tuple[int, ...], ...]


def _describe(op: str, tag: int) -> str:
    """Where an exchange is in the step: its number (in trace order) and message round."""
    number, round_ = divmod(tag, _PHASES)
    return f"the {op} of cross-node exchange #{number} of the step (message round {round_ + 1})"


def _table(perm: tuple[tuple[int, int], ...], size: int, key: int) -> list[int]:
    """``perm`` as a lookup by sender (``key=0``: its destination) or by receiver (``key=1``: its
    source), −1 where none."""
    out = [-1] * size
    for pair in perm:
        out[pair[key]] = pair[1 - key]
    return out
