"""The host memory behind XLA:CPU's buffers, as the benchmark sees it.

XLA:CPU takes every call's scratch buffers (and results that reuse no donated argument) from the
C allocator and gives them back when the call ends. With glibc's defaults, an allocation above the
mmap threshold (dynamic, 32 MiB at most) is a fresh mapping each time, and so is one above 64 MiB
made by a thread with an arena of its own; freed memory at the top of the heap above the trim
threshold goes back to the kernel. The next call then writes to unmapped pages: a page fault per
4 KiB page on first touch. A program whose scratch crosses those thresholds pays that on every
call, one whose scratch stays below them does not, so on the CPU a program's time depends on how
much scratch it frees, not only on the work it does (a guarded gossip step at 64 × 100k: 12,444
faults per call, 50–53 ms against 38–39 ms without them; docs/benchmarks.md). GPUs and TPUs keep
a pool (BFC allocator) and never see it.

``keep_freed_memory`` sets glibc to keep what it frees (one arena, no mapping per allocation, no
trimming), as ``GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:
glibc.malloc.trim_threshold=...`` does at start-up, so that every call reuses pages already
mapped. ``minor_faults`` counts the page faults.
"""

from __future__ import annotations

import ctypes
import os

HOST_MALLOC = ("system", "keep")

# glibc's mallopt parameters (malloc.h), each with the value that keeps freed memory
_KEEP = {
    "M_ARENA_MAX": (-8, 1),  # threads share the main heap: a thread's arena maps its large blocks
    "M_MMAP_MAX": (-4, 0),  # no block is mapped apart from the heap
    "M_TRIM_THRESHOLD": (-1, 2**31 - 1),  # the heap gives memory back above 2 GiB free only
}
_kept = False


def keep_freed_memory() -> None:
    """Make glibc's malloc keep the memory it frees (``mallopt``: ``_KEEP``). For this process,
    from now on; raises ``RuntimeError`` where the C library has no ``mallopt`` (not glibc) or
    refuses one of the settings (naming it; those before it stay set)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        raise RuntimeError("--host-malloc keep needs glibc's mallopt; this C library has none")
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    for name, (param, value) in _KEEP.items():
        if not mallopt(param, value):
            raise RuntimeError(f"--host-malloc keep: mallopt refused {name}={value}")
    global _kept
    _kept = True


def host_malloc() -> str:
    """How this process's allocator is set, for the record: ``"keep"`` after
    ``keep_freed_memory``, else ``"system"``; then the environment's settings if any
    (``MALLOC_*``, ``GLIBC_TUNABLES``, and ``LD_PRELOAD``, which may replace glibc's malloc)."""
    names = sorted(k for k in os.environ if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "LD_PRELOAD"))
    return " ".join(["keep" if _kept else "system", *(f"{k}={os.environ[k]}" for k in names)])


def minor_faults() -> int:
    """This process's minor page faults so far (``getrusage``): the pages it touched first."""
    import resource  # POSIX only: the rest of the bench runs elsewhere

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
