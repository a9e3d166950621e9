"""Compression compute per step, and PyTorch's ``powerSGD_hook`` on the same matrices.

``optaxdist bench --suite compression-cost``: for a model of about ``n`` parameters (default 25M)
made of ``matrices`` square float32 matrices ``side × side`` plus one bias vector of ``side`` per
matrix (``side = round(sqrt(n / matrices))``; 25M → five 2236 × 2236 matrices and five 2236-vectors,
25,009,660 parameters), time the jitted ``update`` of

* ``allreduce-fp32`` (``optaxdist.allreduce``): the all-reduce step's compute, the baseline;
* every compressor of the training table through ``compressed_allreduce`` (error feedback on,
  ``scope="model"`` as in the registry rows; ``sign-vote`` without error feedback as its row);
* ``powersgd`` rank 1, 2, 4 (error feedback, warm start, ``warmup_steps=0``), with its default
  ``batch_same_shape=True`` and with ``False``, and once more without donating the state;
* PyTorch's ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook`` on the same
  gradients (a gloo process group of world size 1 and a duck-typed bucket; torch's default
  ``batch_tensors_with_same_shape=False`` and ``True``), if torch is installed.

Everything runs with **one** replica so the collective is trivial and only the compression compute
is measured: optaxdist uses ``SoloComm`` (a ``Communicator`` of size 1 whose collectives are the
identity), PowerSGD gets ``compress_single_replica=True`` (PyTorch always compresses). Each
variant is compiled, called ``warmup`` times, then called ``repeats`` times, the variants of a
group interleaved call by call so that load changes on the machine hit them alike; every call is
followed by ``block_until_ready`` (JAX) or ends with the hook's ``future.wait()`` (torch). The
optimizer state is donated (``donate_argnums``) and threaded through the calls, as in a jitted
training step; the "state not donated" PowerSGD rows show the cost of fresh output buffers, which
torch's hook pays on every call (it allocates a clone and a new residual). Next to the
compute, the modelled communication time of one step among ``replicas`` replicas (ledger payloads,
``cost.py``) shows what the compression buys.

Both sides view a 2-D gradient as the same ``n × m`` matrix (torch: ``(shape[0], -1)``, optaxdist:
``(prod(shape[:-1]), shape[-1])``; they differ for ≥ 3-D tensors, hence square matrices here) and
use the same compression-rate rule, so they compress the same matrices with the same rank; the
suite checks that their ``P``/``Q``/uncompressed sizes agree.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optaxdist
from optaxdist.accounting import Kind
from optaxdist.bench import cost
from optaxdist.bench.overhead import hlo_summary
from optaxdist.comm.base import Communicator
from optaxdist.comm.solo import SoloComm
from optaxdist.transforms.powersgd import P_KIND, Q_KIND

C = optaxdist.compress


def model_shapes(n_params: int, matrices: int = 5) -> dict[str, tuple[int, ...]]:
    """``matrices`` square matrices ``side × side`` and as many ``side`` vectors, about
    ``n_params`` parameters in all."""
    if matrices < 1:
        raise ValueError(f"matrices={matrices!r} must be ≥ 1")
    side = max(2, round(math.sqrt(n_params / matrices)))
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(matrices):
        shapes[f"w{i}"] = (side, side)
        shapes[f"b{i}"] = (side,)
    return shapes


def make_gradients(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, np.ndarray]:
    """Standard-normal float32 gradients (NumPy, so both frameworks get the same bits)."""
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}


def _compressed(compressor, error_feedback: bool = True):
    return lambda comm: optaxdist.compressed_allreduce(
        compressor, comm=comm, error_feedback=error_feedback, scope="model"
    )


def _powersgd(rank: int, batch: bool = True):
    return lambda comm: optaxdist.powersgd(
        comm=comm,
        rank=rank,
        warmup_steps=0,
        error_feedback=True,
        warm_start=True,
        batch_same_shape=batch,
        compress_single_replica=True,
    )


#: name → factory(comm) of the transform timed (the compression part of the registry rows).
TRANSFORMS: dict[str, Callable[[Communicator], optax.GradientTransformation]] = {
    "allreduce-fp32": lambda comm: optaxdist.allreduce(comm=comm, dtype=jnp.float32),
    "cast-bf16-ef": _compressed(C.cast("bfloat16")),
    "topk-1%-ef": _compressed(C.top_k(fraction=0.01)),
    "randomk-1%-ef": _compressed(C.random_k(fraction=0.01)),
    "blockk-1%-ef": _compressed(C.block_k(fraction=0.01)),
    "threshold-1e-3-ef": _compressed(C.threshold(1e-3, mode="padded", max_fraction=0.01)),
    "scaled-sign-ef": _compressed(C.sign(scaled=True)),
    "sign-vote": _compressed(C.sign(), error_feedback=False),
    **{f"powersgd-r{r}": _powersgd(r) for r in (1, 2, 4)},
    **{f"powersgd-r{r}-unbatched": _powersgd(r, batch=False) for r in (1, 2, 4)},
}

RANKS = (1, 2, 4)


class _JaxRunner:
    """One optaxdist transform: jitted ``update`` with the state donated and threaded through."""

    framework = "optaxdist"

    def __init__(self, name: str, grads: dict[str, np.ndarray], donate: bool = True):
        self.name = name if donate else f"{name} (state not donated)"
        self.tx = TRANSFORMS[name](SoloComm())
        self.grads = jax.tree.map(jnp.asarray, grads)
        self.state = self.tx.init(self.grads)
        fn = jax.jit(lambda g, s: self.tx.update(g, s), donate_argnums=1 if donate else ())
        t = time.perf_counter()
        self.compiled = fn.lower(self.grads, self.state).compile()
        self.compile_s = time.perf_counter() - t
        self.calls = 0
        self.times: list[float] = []

    def call(self, timed: bool = True) -> None:
        t = time.perf_counter()
        out, self.state = self.compiled(self.grads, self.state)
        jax.block_until_ready((out, self.state))
        dt = time.perf_counter() - t
        del out
        self.calls += 1
        if timed:
            self.times.append(dt)

    def comm(self) -> dict[str, tuple[int, int]]:
        """Ledger totals ``{kind: (collectives, bytes)}`` over ``self.calls`` steps."""
        stats = optaxdist.comm_stats(self.state)
        return {k: (t.collectives, t.bytes) for k, t in stats.by_kind.items()}

    def describe(self) -> dict[str, Any]:
        return {"compile_s": self.compile_s, "hlo": hlo_summary(self.compiled)}


class _Bucket:
    """What ``powerSGD_hook`` calls on a ``dist.GradBucket``: one flat buffer, per-parameter views."""

    def __init__(self, torch, shapes: dict[str, tuple[int, ...]]):
        total = sum(math.prod(s) for s in shapes.values())
        self._buffer = torch.zeros(total, dtype=torch.float32)
        self._grads, start = [], 0
        for s in shapes.values():
            n = math.prod(s)
            self._grads.append(self._buffer[start : start + n].view(s))
            start += n
        self._params = [torch.zeros(s, dtype=torch.float32) for s in shapes.values()]

    def buffer(self):
        return self._buffer

    def set_buffer(self, tensor):
        self._buffer.copy_(tensor)

    def gradients(self):
        return self._grads

    def parameters(self):
        return self._params

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


class _TorchRunner:
    """PyTorch's ``powerSGD_hook`` on a duck-typed bucket; the gradient is copied into the bucket
    before every call (untimed), as DDP's backward would."""

    framework = "torch"

    def __init__(self, torch, rank: int, batch: bool, grads: dict[str, np.ndarray], start_iter: int = 2):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        self.torch, self.ps = torch, ps
        self.rank, self.batch = rank, batch
        self.name = f"torch powerSGD_hook r{rank}" + (" (batched)" if batch else "")
        shapes = {k: tuple(v.shape) for k, v in grads.items()}
        self.bucket = _Bucket(torch, shapes)
        self.flat = torch.from_numpy(np.concatenate([v.reshape(-1) for v in grads.values()]))
        self.state = ps.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=start_iter,
            min_compression_rate=2,
            use_error_feedback=True,
            warm_start=True,
            batch_tensors_with_same_shape=batch,
        )
        self.start_iter = start_iter
        self.calls = 0
        self.times: list[float] = []
        self.compile_s = 0.0
        # Which gradients torch compresses, by its own rule (``_should_compress``).
        self.compressed_numel = self.uncompressed_numel = self.p_numel = self.q_numel = 0
        for s in shapes.values():
            n = s[0]
            m = math.prod(s) // n
            r = min(n, m, rank)
            if ps._should_compress(n, m, r, 2)[0]:
                self.p_numel += n * r
                self.q_numel += m * r
            else:
                self.uncompressed_numel += n * m

    def call(self, timed: bool = True) -> None:
        self.bucket._buffer.copy_(self.flat)
        t = time.perf_counter()
        self.ps.powerSGD_hook(self.state, self.bucket).wait()
        dt = time.perf_counter() - t
        self.calls += 1
        if timed:
            self.times.append(dt)

    def comm(self) -> dict[Kind, tuple[int, int]]:
        """Per-step all-reduces of the hook in the ledger's form, over the compressed calls."""
        k = max(self.calls - self.start_iter, 0)
        return {
            P_KIND: (k, k * 4 * self.p_numel),
            Q_KIND: (k, k * 4 * self.q_numel),
            Kind("all_reduce", "float32"): (k, k * 4 * self.uncompressed_numel),
        }

    def describe(self) -> dict[str, Any]:
        p = self.state.p_memory_dict.get(0)
        q = self.state.q_memory_dict.get(0)
        return {
            "p_memory_numel": None if p is None else int(p.numel()),
            "q_memory_numel": None if q is None else int(q.numel()),
            "uncompressed_numel": self.uncompressed_numel,
            "iter": self.state.iter,
        }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def torch_world_of_one(threads: int):
    """Import torch, set its intra-op threads, and open a gloo process group of world size 1 on
    127.0.0.1 (a free port); yields the ``torch`` module, or None if torch is not installed."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        yield None
        return
    torch.set_num_threads(threads)
    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        created = True
    try:
        yield torch
    finally:
        if created:
            dist.destroy_process_group()


def _run_group(runners: Sequence[Any], warmup: int, repeats: int, progress: bool, max_call_s: float) -> None:
    """Warm up each runner, then time them interleaved. A runner whose first call takes longer
    than ``max_call_s`` is not called again: that one call is its only (untimed-warm-up) sample."""
    live = []
    for r in runners:
        t = time.perf_counter()
        r.call(timed=False)
        first = time.perf_counter() - t
        if first > max_call_s:
            r.times, r.over_budget = [first], True
            continue
        for _ in range(warmup - 1):
            r.call(timed=False)
        live.append(r)
    for _ in range(repeats):
        for r in live:
            r.call()
    if progress:
        print(
            "  " + ", ".join(f"{r.name} {statistics.median(r.times) * 1e3:.1f} ms" for r in runners),
            file=sys.stderr,
            flush=True,
        )


def _row(r: Any, n_params: int, replicas: int, link: cost.Network) -> dict[str, Any]:
    comm = r.comm()
    steps = max(r.calls - getattr(r, "start_iter", 0), 1)
    bytes_per_step = sum(b for _, b in comm.values()) / steps
    fp32 = 4 * n_params
    return {
        "name": r.name,
        "framework": r.framework,
        "compute_s": statistics.median(r.times),
        "compute_min_s": min(r.times),
        "compute_all_s": r.times,
        "over_budget": getattr(r, "over_budget", False),
        "bytes_per_step": bytes_per_step,
        "reduction_vs_fp32": fp32 / bytes_per_step if bytes_per_step else None,
        "by_kind_per_step": {k: [c / steps, b / steps] for k, (c, b) in comm.items()},
        "comm_s_model": cost.comm_time_per_step(comm, steps, replicas, link),
        **r.describe(),
    }


def run_compression_cost(
    n_params: int = 25_000_000,
    *,
    matrices: int = 5,
    replicas: int = 8,
    network: str = "10GbE",
    nodes: int | None = None,
    warmup: int = 3,
    repeats: int = 7,
    use_torch: bool = True,
    torch_threads: int | None = None,
    seed: int = 0,
    transforms: Sequence[str] | None = None,
    ranks: Sequence[int] = RANKS,
    max_call_s: float = 10.0,
    progress: bool = True,
) -> dict[str, Any]:
    """Time every transform of ``TRANSFORMS`` (and torch's hook) on one model; print the tables.

    ``transforms`` restricts the non-PowerSGD rows (default: all of them); ``ranks`` the PowerSGD
    ranks (each timed as ``powersgd-r<rank>``, its unbatched variant and torch's hook). A variant
    whose first call takes more than ``max_call_s`` seconds is reported with that single call.

    Returns:
      The JSON record: ``model``, ``threads``, ``cost_model``, ``results`` (one per variant) and
      ``powersgd`` (the side-by-side comparison per rank).
    """
    if warmup < 1 or repeats < 1:
        raise ValueError(f"warmup={warmup} and repeats={repeats} must be ≥ 1")
    shapes = model_shapes(n_params, matrices)
    grads = make_gradients(shapes, seed)
    n_actual = sum(math.prod(s) for s in shapes.values())
    link = cost.link_for(network, replicas if nodes is None else nodes)
    torch_threads = torch_threads or os.cpu_count() or 1

    def log(msg):
        if progress:
            print(msg, file=sys.stderr, flush=True)

    log(
        f"[compression-cost] {n_actual:,} parameters: {matrices} × {shapes['w0']} + "
        f"{matrices} × {shapes['b0']}; warm-up {warmup}, {repeats} timed calls each"
    )
    results: list[dict[str, Any]] = []
    torch_info: dict[str, Any] = {"available": False}
    group1 = [n for n in TRANSFORMS if not n.startswith("powersgd")]
    if transforms is not None:
        unknown = [n for n in transforms if n not in group1]
        if unknown:
            raise ValueError(f"unknown transforms {unknown}; available: {group1}")
        group1 = list(transforms)
    if any(r not in RANKS for r in ranks):
        raise ValueError(f"ranks={ranks!r} must be among {RANKS}")
    if group1:
        log("[compression-cost] all-reduce and compressors ...")
        runners = [_JaxRunner(n, grads) for n in group1]
        _run_group(runners, warmup, repeats, progress, max_call_s)
        results += [_row(r, n_actual, replicas, link) for r in runners]
        del runners

    with torch_world_of_one(torch_threads) if use_torch else contextlib.nullcontext() as torch:
        if torch is not None:
            torch_info = {
                "available": True,
                "version": torch.__version__,
                "threads": torch.get_num_threads(),
                "interop_threads": torch.get_num_interop_threads(),
            }
        elif use_torch:
            log(
                "[compression-cost] torch is not installed: skipping PyTorch's powerSGD_hook "
                "(pip install 'optaxdist[torch]')"
            )
        else:
            log("[compression-cost] torch comparison disabled (--no-torch)")
        for rank in ranks:
            log(f"[compression-cost] PowerSGD rank {rank} ...")
            runners = [
                _JaxRunner(f"powersgd-r{rank}", grads),
                _JaxRunner(f"powersgd-r{rank}-unbatched", grads),
                _JaxRunner(f"powersgd-r{rank}", grads, donate=False),
            ]
            if torch is not None:
                runners += [_TorchRunner(torch, rank, False, grads), _TorchRunner(torch, rank, True, grads)]
            _run_group(runners, warmup + (2 if torch is not None else 0), repeats, progress, max_call_s)
            results += [_row(r, n_actual, replicas, link) for r in runners]
            del runners

    by_name = {r["name"]: r for r in results}
    side_by_side = []
    for rank in ranks:
        ours = by_name[f"powersgd-r{rank}"]
        row = {
            "rank": rank,
            "ours_s": ours["compute_s"],
            "ours_unbatched_s": by_name[f"powersgd-r{rank}-unbatched"]["compute_s"],
            "ours_not_donated_s": by_name[f"powersgd-r{rank} (state not donated)"]["compute_s"],
            "ours_bytes_per_step": ours["bytes_per_step"],
        }
        t = by_name.get(f"torch powerSGD_hook r{rank}")
        if t is not None:
            tb = by_name[f"torch powerSGD_hook r{rank} (batched)"]
            row.update(
                torch_s=t["compute_s"],
                torch_batched_s=tb["compute_s"],
                torch_bytes_per_step=t["bytes_per_step"],
                same_bytes=t["bytes_per_step"] == ours["bytes_per_step"],
                ratio=ours["compute_s"] / min(t["compute_s"], tb["compute_s"]),
            )
        side_by_side.append(row)

    record = {
        "suite": "compression-cost",
        "model": {"parameters": n_actual, "shapes": {k: list(v) for k, v in shapes.items()}},
        "warmup": warmup,
        "repeats": repeats,
        "seed": seed,
        "threads": {
            "cpu_count": os.cpu_count(),
            "xla": "XLA:CPU's own intra-op pool (one thread per core by default)",
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
            "torch": torch_info,
        },
        "cost_model": {
            "network": link.name,
            "bandwidth_Bps": link.bandwidth,
            "latency_s": link.latency,
            "replicas": replicas,
            "nodes": replicas if nodes is None else nodes,
        },
        "results": results,
        "powersgd": side_by_side,
    }
    print(format_compression_cost(record))
    return record


def format_compression_cost(record: dict[str, Any]) -> str:
    """The two Markdown tables of a compression-cost record."""
    cm = record["cost_model"]
    net = f"{cm['network']}, {cm['replicas']} replicas on {cm['nodes']} nodes"
    out = [
        f"| transform | bytes sent/step/replica | vs fp32 AR | compute ms/step (median) | "
        f"compute ms (min) | comm ms/step (model, {net}) | compute + comm ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in record["results"]:
        red = r["reduction_vs_fp32"]
        out.append(
            f"| {r['name']} | {r['bytes_per_step']:,.0f} | "
            f"{'—' if red is None else f'{red:.1f}×'} | {r['compute_s'] * 1e3:.1f}"
            f"{' (1 call, over budget)' if r['over_budget'] else ''} | "
            f"{r['compute_min_s'] * 1e3:.1f} | {r['comm_s_model'] * 1e3:.3f} | "
            f"{(r['compute_s'] + r['comm_s_model']) * 1e3:.1f} |"
        )
    out += [
        "",
        "| rank | optaxdist ms (batch_same_shape=True) | optaxdist ms (False) | "
        "optaxdist ms (True, state not donated) | "
        "torch hook ms (batch_tensors_with_same_shape=False) | torch hook ms (True) | "
        "optaxdist / best torch | same bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in record["powersgd"]:
        if "torch_s" in s:
            torch_cells = (
                f"{s['torch_s'] * 1e3:.1f} | {s['torch_batched_s'] * 1e3:.1f} | "
                f"{s['ratio']:.2f} | {'yes' if s['same_bytes'] else 'NO'}"
            )
        else:
            torch_cells = "— | — | — | —"
        out.append(
            f"| {s['rank']} | {s['ours_s'] * 1e3:.1f} | {s['ours_unbatched_s'] * 1e3:.1f} | "
            f"{s['ours_not_donated_s'] * 1e3:.1f} | {torch_cells} |"
        )
    return "\n".join(out)
