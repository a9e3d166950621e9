"""Configuration agreement: every process of a run checks, before the run's first collective, that
all of them run the same configuration.

A process whose configuration differs (another ``period``, wire dtype, compressor, topology,
parameter shape, chain of transforms) would otherwise wait forever in a collective that its peers
never enter, abort MPI with an unrelated message, or silently compute other numbers. The harnesses
that run one program per process (``on_mpi``, and ``on_mesh`` under ``jax.distributed``) call
``agree`` on the first call of a step:

1. The step is traced once (``jax.eval_shape``, nothing runs) while every optaxdist transform
   whose ``update`` it calls notes its configuration: its name, the arguments of its factory (as
   plain data: numbers, dtype names, compressors and topologies field by field, communicators by
   kind and size, schedules by their values at a few probe steps, inner optax transformations by
   the hyperparameters in their closures) and the shapes and dtypes of the updates it receives.
   The pytree structure of every argument of the step is added (it covers the optimizer state,
   so a different chain of transforms is seen even where the extra transform never communicates).
2. The processes exchange a 32-byte SHA-256 digest of that description: the same collective, of
   the same size, on every process, whatever the configurations, so the check itself cannot hang.
3. Only if the digests differ, they exchange the descriptions themselves (again the same
   collectives on every process: lengths, then the padded bytes) and every process raises the same
   ``ValueError``, naming the transform, the field and the values per process, e.g.
   ``local_sgd.period differs across processes: 2 on [0], 3 on [1]``.

The bytes exchanged are counted in a ``CommLedger`` that the harness exposes as
``step.agreement`` (``optaxdist.comm_stats((opt_state, step.agreement))``). In one process
(``simulate``, ``on_mesh`` on one host) there is a single configuration: nothing is exchanged.
Pass ``check_config=False`` to the harness to skip the check.

Values are *not* compared here (replicas legitimately hold different gradients and data); the
transforms that average parameters check at their first step that the replicas start from the
same parameters (``check_start``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import inspect
import json
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from optaxdist.accounting import CommLedger, Kind

DIGEST_KIND = Kind("all_gather", "config digest")
DESCRIPTION_KIND = Kind("all_gather", "config description")
DIGEST_BYTES = 32
PROBE_STEPS = (0, 1, 10, 100, 1000, 10000)
_MAX_INLINE = 32  # longer sequences and arrays are described by length and digest
_MAX_DEPTH = 32
_MAX_REPORTED = 8


class Configured(NamedTuple):
    """What one optaxdist factory was called with: its public name and bound arguments."""

    name: str
    arguments: dict[str, Any]


_CONFIGS: weakref.WeakKeyDictionary[Callable[..., Any], Configured] = weakref.WeakKeyDictionary()
_local = threading.local()


def configured(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a transform factory so that its configuration takes part in the agreement.

    The transformation it returns is unchanged except that its ``update``, when traced under
    ``collecting()``, notes ``Configured(name, arguments)`` and the shapes of its updates.
    Transforms built inside another configured factory (``diloco`` builds an ``outer_sync``) are
    described by the outer one only.
    """

    def decorate(factory: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(factory)

        @functools.wraps(factory)
        def make(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            config = Configured(name, dict(bound.arguments))
            depth = getattr(_local, "building", 0)
            _local.building = depth + 1
            try:
                tx = factory(*args, **kwargs)
            finally:
                _local.building = depth
            if depth:
                return tx
            inner_update = tx.update

            def update(updates, state, params=None, **extra):
                _note(config, updates)
                return inner_update(updates, state, params, **extra)

            _CONFIGS[update] = config
            return tx._replace(update=update)

        return make

    return decorate


def _note(config: Configured, updates: Any) -> None:
    seen = getattr(_local, "seen", None)
    if seen is None or any(c is config for c, _ in seen):
        return
    shapes = {
        jax.tree_util.keystr(path): f"{np.dtype(x.dtype).name}{list(np.shape(x))}"
        for path, x in jax.tree_util.tree_leaves_with_path(updates)
    }
    seen.append((config, shapes))


@contextlib.contextmanager
def collecting() -> Iterator[list[tuple[Configured, dict[str, str]]]]:
    """Collect the configurations of the transforms whose ``update`` is traced in this block."""
    outer = getattr(_local, "seen", None)
    _local.seen = []
    try:
        yield _local.seen
    finally:
        _local.seen = outer


# ---- describing values as plain data --------------------------------------------------------


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _array(x: Any) -> Any:
    x = np.asarray(x)
    label = f"{x.dtype.name}{list(x.shape)}"
    if x.size <= _MAX_INLINE and x.dtype.kind in "biuf":
        return {"array": label, "values": x.ravel().tolist()}
    return {"array": label, "sha256": _digest(np.ascontiguousarray(x).tobytes())}


def _probe(fn: Callable[..., Any]) -> Any:
    """A schedule's values at ``PROBE_STEPS``, or None if ``fn`` is not a schedule of one step.

    Only optax's functions, jitted functions and functions whose name says ``schedule`` are called
    (a user's one-argument callback with a side effect is described by its code instead)."""
    name = getattr(fn, "__qualname__", "") or ""
    module = getattr(fn, "__module__", "") or ""
    if not ("schedule" in name.lower() or module.startswith("optax") or hasattr(fn, "lower")):
        return None
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    required = [
        p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(required) != 1:
        return None
    try:
        with jax.ensure_compile_time_eval(), jax.numpy_dtype_promotion("standard"):
            return {str(t): repr(float(np.asarray(fn(t)))) for t in PROBE_STEPS}
    except Exception:  # not a schedule (or not evaluable on a bare step): described otherwise
        return None


def _function(fn: Callable[..., Any], depth: int, seen: set[int]) -> Any:
    if fn in _CONFIGS:
        config = _CONFIGS[fn]
        nested = getattr(_local, "nested", None)
        if nested is None:  # described on its own, under its name
            return {"transform": config.name}
        nested.add(id(config))
        return {"transform": config.name, **_describe(config.arguments, depth + 1, seen)}
    values = _probe(fn)
    if values is not None:
        return {"schedule": values}
    out: dict[str, Any] = {"function": getattr(fn, "__qualname__", type(fn).__name__)}
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is not None:
        numbers = [repr(c) for c in code.co_consts if isinstance(c, (int, float)) and not isinstance(c, bool)]
        if numbers:  # a lambda's hyperparameters live in its code: ``lambda t: 0.1 * 0.9**t``
            out["constants"] = numbers
        for var, cell in zip(code.co_freevars, cells):
            try:
                out[var] = _describe(cell.cell_contents, depth + 1, seen)
            except ValueError:  # an empty cell
                continue
    return out


def _describe(value: Any, depth: int = 0, seen: set[int] | None = None) -> Any:
    """``value`` as JSON-able data, the same on every process for the same configuration."""
    seen = set() if seen is None else seen
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (np.dtype, type)) and _is_dtype(value):
        return np.dtype(value).name
    if depth > _MAX_DEPTH or id(value) in seen:
        return f"<{type(value).__name__}>"
    seen = seen | {id(value)}
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        if np.ndim(value) == 0 and np.asarray(value).dtype.kind in "fiub":
            scalar = np.asarray(value).item()  # np.float32(0.5) is described like 0.5
            return repr(scalar) if isinstance(scalar, float) else scalar
        return _array(value)
    if _is_communicator(value):
        return value.describe()
    if isinstance(value, optax.GradientTransformation):
        return _function(value.update, depth, seen)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
        return {"type": type(value).__name__, **{k: _describe(v, depth + 1, seen) for k, v in fields}}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        fields = list(zip(value._fields, value))
        return {"type": type(value).__name__, **{k: _describe(v, depth + 1, seen) for k, v in fields}}
    if isinstance(value, dict):
        return {str(k): _describe(v, depth + 1, seen) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_describe(v, depth + 1, seen) for v in value]
        if len(items) > _MAX_INLINE:
            return {"length": len(items), "sha256": _digest(json.dumps(items, sort_keys=True).encode())}
        return items
    if callable(value):
        return _function(value, depth, seen)
    return f"<{type(value).__name__}>"


def _is_dtype(value: Any) -> bool:
    try:
        np.dtype(value)
    except TypeError:
        return False
    return not isinstance(value, type) or issubclass(value, np.generic) or hasattr(value, "dtype")


def _is_communicator(value: Any) -> bool:
    from optaxdist.comm.base import Communicator

    return isinstance(value, Communicator)


def _referenced_optimizers(
    fn: Callable[..., Any], depth: int = 0, visited: set[int] | None = None
) -> dict[str, Any]:
    """The optax transformations that ``fn`` reaches through its closure and the module globals
    its code names, following plain Python functions a few levels down (``train_step`` calling
    ``tx.update`` through a helper). These hold the optimizers no optaxdist factory describes,
    e.g. the ``optax.adam`` chained after ``allreduce``."""
    visited = set() if visited is None else visited
    code = getattr(fn, "__code__", None)
    if code is None or id(fn) in visited or depth > 3:
        return {}
    visited.add(id(fn))
    names: list[str] = []
    codes = [code]
    while codes:
        c = codes.pop()
        names.extend(c.co_names)
        codes.extend(k for k in c.co_consts if inspect.iscode(k))
    found = {}
    namespace = getattr(fn, "__globals__", {})
    cells = dict(zip(code.co_freevars, (getattr(fn, "__closure__", None) or ())))
    candidates = [(n, namespace[n]) for n in dict.fromkeys(names) if n in namespace]
    for var, cell in cells.items():
        try:
            candidates.append((var, cell.cell_contents))
        except ValueError:
            continue
    defaults = inspect.signature(fn).parameters.values() if callable(fn) else ()
    candidates.extend((p.name, p.default) for p in defaults if p.default is not p.empty)
    for name, value in candidates:
        if isinstance(value, optax.GradientTransformation):
            found[name] = value
        elif inspect.isfunction(value) and getattr(value, "__module__", None) == getattr(
            fn, "__module__", None
        ):
            found.update(_referenced_optimizers(value, depth + 1, visited))
    return found


def describe_step(
    fn: Callable[..., Any], *args: Any, user_step: Callable[..., Any] | None = None
) -> dict[str, Any]:
    """The configuration of a step as plain data: the transforms its trace calls (in order), what
    each was built with and the shapes it receives, the optax transformations ``user_step`` (by
    default ``fn``) refers to, and the pytree structure of each argument.

    If tracing raises, the error becomes part of the description (so the processes still exchange
    it, instead of the failing one leaving the others waiting) and is raised after the exchange."""
    with collecting() as seen:
        try:
            jax.eval_shape(lambda *a: fn(*a), *args)
            error = None
        except Exception as e:
            error = e
    names = [c.name for c, _ in seen]
    described = {}
    _local.nested = nested = set()
    try:
        for config, shapes in seen:
            described[id(config)] = {**_describe(config.arguments), "updates": shapes}
    finally:
        _local.nested = None
    description: dict[str, Any] = {"transforms used": names}
    for i, (config, _) in enumerate(seen):
        if id(config) in nested:  # described inside the transform that holds it
            continue
        repeat = names[: i + 1].count(config.name)
        key = config.name if names.count(config.name) == 1 else f"{config.name}#{repeat}"
        description[key] = described[id(config)]
    optimizers = _referenced_optimizers(user_step or fn)
    description["optimizers the step refers to"] = {k: _describe(v) for k, v in optimizers.items()}
    description["argument structures"] = [str(jax.tree.structure(a)) for a in args]
    if error is not None:
        description["error while tracing"] = f"{type(error).__name__}: {error}"
        description = {**description, _TRACE_ERROR: error}
    return description


# ---- comparing descriptions -----------------------------------------------------------------


_ABSENT = object()


def _diff(values: list[Any], path: str, out: list[tuple[str, list[Any]]]) -> None:
    """Append ``(path, values)`` for the smallest subtrees whose values are not all equal."""
    if all(v == values[0] for v in values):
        return
    if all(isinstance(v, dict) for v in values):
        keys = list(dict.fromkeys(k for v in values for k in v))
        for k in keys:
            _diff([v.get(k, _ABSENT) for v in values], f"{path}.{k}" if path else str(k), out)
    elif (
        all(isinstance(v, list) for v in values)
        and len({len(v) for v in values}) == 1
        and path != "transforms used"
    ):
        for i, items in enumerate(zip(*values)):
            _diff(list(items), f"{path}[{i}]", out)
    else:
        out.append((path, values))


def _shown(values: list[str], limit: int = 120) -> list[str]:
    """The values, cut to the neighbourhood of the first character where they differ."""
    common = len(os.path.commonprefix(values))
    start = max(0, common - 40) if max(map(len, values)) > limit else 0
    return [
        ("..." if start else "") + v[start : start + limit] + ("..." if len(v) > start + limit else "")
        for v in values
    ]


def differences(descriptions: Sequence[dict[str, Any]], *, who: str = "processes") -> list[str]:
    """One line per field whose value is not the same in every description (index = process)."""
    found: list[tuple[str, list[Any]]] = []
    _diff(list(descriptions), "", found)
    explained = [item for item in found if not item[0].startswith("argument structures")]
    found = explained or found  # a transform that differs explains the structure of its state
    first = ("transforms used", "error while tracing")
    found.sort(key=lambda item: first.index(item[0]) if item[0] in first else len(first))
    lines = []
    for path, values in found:
        texts = ["<absent>" if v is _ABSENT else json.dumps(v) for v in values]
        distinct = list(dict.fromkeys(texts))
        shown = dict(zip(distinct, _shown(distinct)))
        groups: dict[str, list[int]] = {}
        for rank, t in enumerate(texts):
            groups.setdefault(t, []).append(rank)
        lines.append(
            f"{path} differs across {who}: " + ", ".join(f"{shown[t]} on {r}" for t, r in groups.items())
        )
    return lines


_TRACE_ERROR = "__trace_error__"


def agree(
    description: dict[str, Any], allgather: Callable[[bytes], list[bytes]], *, who: str = "processes"
) -> CommLedger:
    """Exchange ``description``'s digest with ``allgather`` (bytes in, one bytes per process out,
    called identically on every process); on a difference exchange the descriptions and raise
    ``ValueError`` naming every field that differs. Returns the ledger of what was sent."""
    description = dict(description)
    error = description.pop(_TRACE_ERROR, None)
    text = json.dumps(description, sort_keys=True).encode()
    digests = allgather(hashlib.sha256(text).digest())
    ledger = CommLedger.create({DIGEST_KIND: DIGEST_BYTES, DESCRIPTION_KIND: len(text)})
    ledger = ledger.record(DIGEST_KIND)
    if len(set(digests)) == 1:
        if error is not None:  # every process failed to trace the step alike: its own error
            raise error
        return ledger
    everyone = [json.loads(t) for t in allgather(text)]
    lines = differences(everyone, who=who)
    shown = lines[:_MAX_REPORTED] + (
        [f"... and {len(lines) - _MAX_REPORTED} more"] if len(lines) > _MAX_REPORTED else []
    )
    raise ValueError(
        f"the configuration differs across {who} (each of them raises this error):\n  "
        + "\n  ".join(shown or ["(the descriptions differ only in their encoding)"])
    )
