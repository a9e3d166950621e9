"""The host memory behind XLA:CPU's buffers, as the benchmark sees it.

XLA:CPU takes every call's scratch buffers (and results that reuse no donated argument) from the
C allocator and gives them back when the call ends. With glibc's defaults, an allocation above the
mmap threshold (32 MiB at most) is a fresh mapping each time, and freed memory at the top of the
heap above the trim threshold goes back to the kernel. The next call then writes to unmapped
pages: a page fault per 4 KiB page on first touch. A program whose scratch crosses those
thresholds pays that on every call, one whose scratch stays below them does not, so on the CPU a
program's time depends on how much scratch it frees, not only on the work it does (a guarded
gossip step at 64 × 100k: 12,444 faults per call, 50–53 ms against 38–39 ms without them;
docs/benchmarks.md).
GPUs and TPUs keep a pool (BFC allocator) and never see it.

``keep_freed_memory`` sets glibc to keep what it frees (no mapping per allocation, no trimming),
as ``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=...`` does at start-up,
so that every call reuses pages already mapped. ``minor_faults`` counts the page faults.
"""

from __future__ import annotations

import ctypes
import os
import resource

HOST_MALLOC = ("system", "keep")

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_MAX = -4
_LARGEST_TRIM_THRESHOLD = 2**31 - 1
_kept = False


def keep_freed_memory() -> None:
    """Make glibc's malloc keep the memory it frees in the heap (``mallopt``: no allocation
    mapped apart, trimming only above 2 GiB free). For this process, from now on; raises
    ``RuntimeError`` where the C library has no ``mallopt`` (not glibc) or refuses."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        raise RuntimeError("--host-malloc keep needs glibc's mallopt; this C library has none")
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, _LARGEST_TRIM_THRESHOLD)):
        raise RuntimeError("--host-malloc keep: mallopt refused M_MMAP_MAX or M_TRIM_THRESHOLD")
    global _kept
    _kept = True


def host_malloc() -> str:
    """How this process's allocator is set, for the record: ``"keep"`` after
    ``keep_freed_memory``, else ``"system"`` with the environment's malloc settings if any."""
    if _kept:
        return "keep"
    names = sorted(k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")
    settings = [f"{k}={os.environ[k]}" for k in names]
    return " ".join(["system", *settings])


def minor_faults() -> int:
    """This process's minor page faults so far (``getrusage``): the pages it touched first."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
