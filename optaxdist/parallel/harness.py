"""Harness helpers: the same per-replica step function on three backends.

A *step* is written for one replica and takes its communicator from a closure (``AxisComm`` for
``simulate`` and ``on_mesh``, ``MpiComm`` for ``on_mpi``). ``simulate`` and ``on_mesh`` take and
return *stacked* pytrees: every leaf has a leading axis of length N, row ``i`` belonging to replica
``i``. Under MPI each process holds only its own row.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from optaxdist._validate import check_bools, check_int
from optaxdist.accounting import CommLedger
from optaxdist.agreement import DIGEST_BYTES, DIGEST_KIND, agree, describe_step
from optaxdist.comm.base import Communicator
from optaxdist.comm.cross import CrossComm, numbered_exchanges
from optaxdist.comm.hierarchy import Hierarchy
from optaxdist.parallel.multihost import host_allgather
from optaxdist.parallel.split import SplitLocalSteps
from optaxdist.sharding import map_subtrees

PyTree = Any
REPLICA_AXIS = "replica"
# XLA:CPU copies what a conditional returns into the step's result buffers unless copy insertion
# analyses the conditional's branches, as the GPU compiler does by default: with it, the state a
# periodic transform's switch passes through stays in its donated buffers (a donated local step of
# a DiLoCo step on the benchmark's MLP copied 4 parameter-sized arrays without it, 2 with it).
COMPILER_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


class _Jitted:
    """How every harness jits its step: ``jax.jit(fun)`` compiled with ``COMPILER_OPTIONS`` on
    the CPU backend (other backends' plugins need not know the option). JAX takes compiler
    options on a top-level ``jit`` only, so a call from inside another transformation
    (``jax.jit``, ``make_jaxpr`` of a harness step) goes to the same function jitted without
    them; ``lower``, ``trace`` and the rest are the top-level one's."""

    def __init__(self, fun: Callable[..., Any], donate_argnums: int | Sequence[int]):
        options = COMPILER_OPTIONS if jax.default_backend() == "cpu" else None
        self._top = jax.jit(fun, donate_argnums=donate_argnums, compiler_options=options)
        self._nested = jax.jit(fun, donate_argnums=donate_argnums) if options else self._top

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kinds = set(map(type, jax.tree.leaves((args, kwargs))))  # a few types: cheap on every call
        traced = any(issubclass(kind, jax.core.Tracer) for kind in kinds)
        return (self._nested if traced else self._top)(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._top, name)


def _split(split_local_steps: object) -> bool:
    """Validate a harness's ``split_local_steps=``."""
    check_bools(split_local_steps=split_local_steps)
    return split_local_steps  # type: ignore[return-value]


def replicate(tree: PyTree, n: int) -> PyTree:
    """Stack ``n`` identical copies of ``tree`` on a new leading axis."""
    n = check_int("n", n, 1)
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)), tree)


def _names(axis_name: str | Sequence[str]) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def simulate(
    step: Callable[..., Any],
    *,
    axis_name: str | Sequence[str] = REPLICA_AXIS,
    shape: Sequence[int] | None = None,
    jit: bool = True,
    donate_argnums: int | Sequence[int] = (),
    split_local_steps: bool = False,
) -> Callable[..., Any]:
    """N simulated replicas of ``step`` on one device: ``jax.vmap`` with a named axis.

    Args:
      step: the per-replica function.
      axis_name: the axis name its ``AxisComm`` uses; a tuple such as ``("node", "local")`` maps
        nested axes (for hierarchical algorithms), with ``shape=(num_nodes, local_size)``.
      shape: sizes of the axes, needed when there are several (the stacked leading axis is their
        product); every argument must have that many rows (``ValueError`` at the first trace).
      jit: wrap the result in ``jax.jit``.
      donate_argnums: arguments whose buffers the step may reuse for its results
        (``jax.jit``'s; with ``jit=True`` only): pass the parameters and the optimizer state of a
        training step, so that state a local step leaves unchanged is not copied.
      split_local_steps: compile the steps on which every periodic transform of ``step`` (local
        SGD, DiLoCo, SlowMo, Streaming DiLoCo, DES-LOC, gossip...) takes its local step only, and
        each synchronization, as programs of their own without the schedule's switch, chosen on
        the host from the step counters (``SplitLocalSteps``): a local step then costs what its
        inner optimizer's step costs, for a compilation per program. Needs ``jit=True``.

    Returns:
      A function of stacked arguments returning stacked results.
    """
    names = _names(axis_name)
    if shape is not None:
        if len(shape) != len(names):
            raise ValueError(f"shape={tuple(shape)} must give one size per axis of axis_name={names}")
        shape = tuple(check_int(f"shape[{i}]", k, 1) for i, k in enumerate(shape))
    elif len(names) > 1:
        raise ValueError(f"axis_name={names} needs shape= with one size per axis")
    if _split(split_local_steps):
        if not jit:
            raise ValueError("split_local_steps=True needs jit=True (the host picks a compiled program)")
        build = functools.partial(simulate, axis_name=axis_name, shape=shape, donate_argnums=donate_argnums)
        return SplitLocalSteps(build, step, leading=1, donate_argnums=donate_argnums)
    mapped = step
    for name in reversed(names):
        mapped = jax.vmap(mapped, axis_name=name)

    def run(*args):
        if shape is not None:
            _check_stacked(args, math.prod(shape), f"simulate over {dict(zip(names, shape))}")
        if len(names) == 1:
            return mapped(*args)
        n = math.prod(shape)
        out = mapped(*jax.tree.map(lambda x: x.reshape(tuple(shape) + x.shape[1:]), args))
        return jax.tree.map(lambda x: x.reshape((n,) + x.shape[len(names) :]), out)

    return _Jitted(run, donate_argnums) if jit else run


def _check_stacked(args: tuple, replicas: int, where: str) -> None:
    """Raise ``ValueError`` unless every argument leaf has ``replicas`` rows on its leading
    (stacked) axis (checked where the step is traced: shapes are static)."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(args):
        shape = np.shape(leaf)
        if shape[:1] != (replicas,):
            raise ValueError(
                f"{where}: argument {jax.tree_util.keystr(path[:1])[1:-1]}, leaf "
                f"{jax.tree_util.keystr(path[1:]) or '(the argument)'} has shape {shape}; every "
                f"argument must be stacked over the {replicas} replicas on its leading axis"
            )


def _on_own_row(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` on the one row a device holds inside ``shard_map`` (leading axis of length 1)."""

    def per_device(*args):
        rows = jax.tree.map(lambda x: x[0], args)
        return jax.tree.map(lambda x: jnp.expand_dims(x, 0), step(*rows))

    return per_device


def _one_step_in_flight(mesh: Mesh | jax.sharding.AbstractMesh) -> bool:
    """Whether a step on ``mesh`` must wait for its results: this process holds several CPU devices
    of it (of an ``AbstractMesh``, which names none: several CPU devices at all). XLA:CPU runs
    their collectives as rendezvous on the devices' threads, which deadlock with many steps
    queued (docs/harnesses.md, "On CPU devices each call waits"); GPUs run a device's programs in
    order."""
    here = mesh.local_devices if isinstance(mesh, Mesh) else jax.local_devices()
    return len(here) > 1 and all(d.platform == "cpu" for d in here)


class AgreedStep:
    """A compiled step that checks, at its first call, that every process runs the same
    configuration (``optaxdist.agreement``) before any collective of the step runs. With
    ``wait`` each call returns once its results are ready (one step in flight).

    ``agreement`` is the ``CommLedger`` of the bytes that check exchanged (no events in one
    process, or with ``check_config=False``). Everything else (``lower``, ``trace``, ...) is the
    jitted function's.
    """

    def __init__(
        self,
        jitted: Callable[..., Any],
        traced: Callable[..., Any],
        step: Callable[..., Any],
        allgather: Callable[[bytes], list[bytes]] | None,
        who: str,
        *,
        wait: bool = False,
        check_args: Callable[..., None] | None = None,
    ):
        self._jitted, self._traced, self._step = jitted, traced, step
        self._allgather, self._who, self._wait = allgather, who, wait
        self._check_args = check_args
        self.agreement = CommLedger.create({DIGEST_KIND: DIGEST_BYTES})

    @property
    def waits(self) -> bool:
        """Whether a call returns once its results are ready."""
        return self._wait

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        """A call that returns as soon as the step is dispatched, whether or not it ``waits``: the
        caller waits for the results (``SplitLocalSteps``, after its own host work)."""
        if self._check_args is not None:
            self._check_args(args)
        if self._allgather is not None:  # until a call has agreed (every process raises alike)
            traced = functools.partial(self._traced, **kwargs)
            description = describe_step(traced, *args, user_step=self._step)
            self.agreement = agree(description, self._allgather, who=self._who)
            self._allgather = None
        return self._jitted(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.dispatch(*args, **kwargs)
        return jax.block_until_ready(out) if self._wait else out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jitted, name)


@functools.lru_cache(maxsize=256)
def _misplaced_replica_axes(spec: P, names: tuple[str, ...]) -> str | None:
    """Why ``spec`` splits an array over a replica axis elsewhere than alone on its leading
    (stacked) dimension, or None when it does not."""
    for dim, entry in enumerate(spec):
        axes = (entry,) if isinstance(entry, str) else tuple(entry) if isinstance(entry, tuple) else ()
        replica = [a for a in axes if a in names]
        if dim > 0 and replica:
            return f"splits dimension {dim} over the replica axes {replica}"
        if dim == 0 and replica and len(replica) != len(axes):
            others = [a for a in axes if a not in names]
            return (
                f"splits the leading (stacked) dimension over {list(axes)}: replica axes mixed with {others}"
            )
    return None


@functools.lru_cache(maxsize=1024)
def _misplaced_sharding(sharding: NamedSharding, names: tuple[str, ...]) -> str | None:
    """``_misplaced_replica_axes`` of a sharding on a mesh with the replica axes, else None
    (cached: every call of a step checks every argument). An array's sharding has at most one
    entry per dimension, so its spec alone says where it splits."""
    if not set(names) <= set(sharding.mesh.axis_names):
        return None
    return _misplaced_replica_axes(sharding.spec, names)


_SHARDING = operator.attrgetter("sharding")  # a concrete array's sharding, at C speed


def _check_replica_placement(args: tuple, mesh: Mesh, names: tuple[str, ...]) -> None:
    """Raise ``ValueError`` if a concrete argument's ``NamedSharding`` on a mesh with the replica
    axes puts one of them anywhere but alone on the leading (stacked) dimension. Each call reads
    the arguments' distinct shardings (one, or a few, for a training step's arrays)."""

    def why(sharding: Any) -> str | None:
        return _misplaced_sharding(sharding, names) if isinstance(sharding, NamedSharding) else None

    leaves = jax.tree.leaves(args)
    try:
        shardings = set(map(_SHARDING, leaves))
    except AttributeError:  # NumPy arrays, Python scalars, tracers
        shardings = {getattr(leaf, "sharding", None) for leaf in leaves}
    if not any(map(why, shardings)):
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(args):
        reason = why(getattr(leaf, "sharding", None))
        if reason:
            raise ValueError(
                f"on_mesh argument {jax.tree_util.keystr(path[:1])[1:-1]}, leaf "
                f"{jax.tree_util.keystr(path[1:]) or '(the argument)'}: its sharding "
                f"{leaf.sharding.spec} {reason}. on_mesh stacks replicas on the leading dimension, "
                f"split over the replica axes {list(names)} of the mesh {dict(mesh.shape)}; the "
                f"other dimensions may be split over the remaining axes only, e.g. "
                f"P({names[0] if len(names) == 1 else names!r}, None, 'model')"
            )


class _OutputsLikeInputs:
    """``jax.jit(run)`` that places its results like the arguments split over the model axes
    (``_place_like``); one compiled function per placement of the arguments. ``lower``, ``trace``
    and ``eval_shape`` take the arguments of a call (arrays, or ``jax.ShapeDtypeStruct`` with
    shardings)."""

    def __init__(
        self, run: Callable[..., Any], mesh: Mesh, model_axes: Sequence[str], donate_argnums: Any = ()
    ):
        self._run, self._mesh, self._model_axes = run, mesh, frozenset(model_axes)
        self._donate_argnums = donate_argnums
        self._jitted: dict[tuple, Callable[..., Any]] = {}

    def _placement(self, args: tuple) -> tuple[tuple, tuple]:
        """The arguments split over a model axis, each as (structure, leaf shapes, the leaves'
        shardings where they split a model axis, else None), and those shardings by per-replica
        leaf shape (the shapes whose split leaves all agree)."""
        templates, by_shape = [], {}
        for arg in args:
            leaves, treedef = jax.tree.flatten(arg)
            shardings = tuple(self._model_split(getattr(x, "sharding", None)) for x in leaves)
            split = [(np.shape(x)[1:], s) for x, s in zip(leaves, shardings) if s is not None]
            if split:
                templates.append((treedef, tuple(np.shape(x) for x in leaves), shardings))
            for shape, sharding in split:
                by_shape.setdefault(shape, set()).add(sharding)
        agreed = tuple((shape, *found) for shape, found in by_shape.items() if len(found) == 1)
        return tuple(templates), agreed

    def _model_split(self, sharding: Any) -> NamedSharding | None:
        """``sharding`` if it is on this mesh and splits a dimension over a model axis."""
        if not isinstance(sharding, NamedSharding) or sharding.mesh.shape_tuple != self._mesh.shape_tuple:
            return None
        split = any(a in self._model_axes for entry in tuple(sharding.spec)[1:] for a in _names(entry or ()))
        return sharding if split else None

    def _jit_for(self, args: tuple) -> Callable[..., Any]:
        placement = self._placement(args)
        if placement not in self._jitted:
            placed = lambda *a: _place_like(self._run(*a), *placement)  # noqa: E731
            self._jitted[placement] = _Jitted(placed, self._donate_argnums)
        return self._jitted[placement]

    def __call__(self, *args: Any) -> Any:
        return self._jit_for(args)(*args)

    def lower(self, *args: Any) -> Any:
        return self._jit_for(args).lower(*args)

    def trace(self, *args: Any) -> Any:
        return self._jit_for(args).trace(*args)

    def eval_shape(self, *args: Any) -> Any:
        return self._jit_for(args).eval_shape(*args)


def _place_like(tree: PyTree, templates: tuple, by_shape: tuple) -> PyTree:
    """``tree`` placed like the model-split leaves of the arguments: in a subtree with an
    argument's structure and leaf shapes, each leaf takes the sharding of the argument's leaf if
    that one is split over a model axis (the first argument that matches, outermost subtrees
    first); any other leaf whose per-replica shape ends with a model-split argument leaf's shape
    takes its sharding, the extra leading dimensions not split (a stack of per-leaf residuals).
    The rest is left to the compiler."""
    suffixes = sorted(by_shape, key=lambda item: -len(item[0]))

    def constrain(x, sharding):
        return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)

    def like_a_leaf(x):
        shape = np.shape(x)[1:]
        for leaf_shape, sharding in suffixes:
            extra = len(shape) - len(leaf_shape)
            if extra >= 0 and shape[extra:] == leaf_shape:
                lead, *rest = tuple(sharding.spec) + (None,) * (1 + len(leaf_shape) - len(sharding.spec))
                return constrain(x, NamedSharding(sharding.mesh, P(lead, *(None,) * extra, *rest)))
        return x

    def like_an_argument(node):
        leaves, treedef = jax.tree.flatten(node)
        shapes = tuple(np.shape(x) for x in leaves)
        for template_def, template_shapes, shardings in templates:
            if treedef == template_def and shapes == template_shapes:
                return jax.tree.unflatten(treedef, [constrain(x, s) for x, s in zip(leaves, shardings)])
        return None

    return map_subtrees(like_an_argument, tree, like_a_leaf)


def on_mesh(
    step: Callable[..., Any],
    mesh: Mesh,
    *,
    axis_name: str | Sequence[str] | None = None,
    check_config: bool = True,
    donate_argnums: int | Sequence[int] = (),
    split_local_steps: bool = False,
) -> AgreedStep | SplitLocalSteps:
    """Run ``step`` with one replica per device of ``mesh``: ``jax.shard_map`` over stacked inputs.

    The leading axis of every argument is split over ``axis_name`` (default: all mesh axes,
    row-major), so each device runs ``step`` on its own row with per-replica (varying) values; in
    particular gradients taken inside ``step`` are each replica's local gradients. Works for a mesh
    spanning several hosts under ``jax.distributed`` when the inputs are global arrays
    (``global_replica_array``); there, unless ``check_config=False``, the first call checks that
    every process runs the same configuration (``AgreedStep``).

    Mesh axes not in ``axis_name`` (``"model"``) are left to the compiler: arguments may be
    sharded over them on their other dimensions (``P("replica", None, "model")``), and stay so.
    A result with the structure and shapes of an argument split over those axes is placed like
    it: ``on_mesh(tx.init, ...)(params)`` returns momenta, residuals and anchors split like the
    parameters, not replicated (zeros do not depend on the parameters, so the compiler would not
    split them), and a step returns parameters and state as it took them.
    Each call raises ``ValueError`` if an argument's ``NamedSharding`` splits a dimension other
    than the leading one over a replica axis, or the leading one over replica and other axes
    together (``P(None, "replica")``, ``P(("replica", "model"), None)``). Where this process holds
    several CPU devices of the mesh, each call waits for its results (``_one_step_in_flight``).
    The leading axis of every argument must have one row per replica device (``ValueError`` at
    the first trace otherwise: ``shard_map`` alone would give each device a block of rows).
    ``donate_argnums`` is ``jax.jit``'s and ``split_local_steps`` ``simulate``'s (every process
    of a multi-host mesh must then pass the same states, as it must anyway).
    """
    if _split(split_local_steps):
        build = functools.partial(
            on_mesh, mesh=mesh, axis_name=axis_name, check_config=check_config, donate_argnums=donate_argnums
        )
        return SplitLocalSteps(build, step, leading=1, donate_argnums=donate_argnums)
    names = _names(mesh.axis_names if axis_name is None else axis_name)
    missing = [a for a in names if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"axis_name {missing} not in the mesh axes {mesh.axis_names}")
    spec = P(names)
    model_axes = [a for a in mesh.axis_names if a not in names]

    mapped = jax.shard_map(_on_own_row(step), mesh=mesh, in_specs=spec, out_specs=spec, axis_names=set(names))

    explicit = all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    place = jax.reshard if explicit else jax.lax.with_sharding_constraint

    def placed(x):
        # The replica axis leads; the other dimensions keep whatever sharding over the model axes
        # the caller (or the compiler) gave them.
        rest = (P.UNCONSTRAINED,) * (jnp.ndim(x) - 1) if model_axes and not explicit else ()
        return place(x, NamedSharding(mesh, P(names, *rest)))

    sizes = {a: mesh.shape[a] for a in names}

    def run(*args):
        _check_stacked(args, math.prod(sizes.values()), f"on_mesh over the replica axes {sizes}")
        return mapped(*jax.tree.map(placed, args))

    many = check_config and jax.process_count() > 1
    return AgreedStep(
        _Jitted(run, donate_argnums)
        if explicit or not model_axes
        else _OutputsLikeInputs(run, mesh, model_axes, donate_argnums),
        run,
        step,
        host_allgather if many else None,
        "processes",
        wait=_one_step_in_flight(mesh),
        check_args=functools.partial(_check_replica_placement, mesh=mesh, names=names),
    )


def on_mpi(
    step: Callable[..., Any],
    *,
    comm: Any = None,
    check_config: bool = True,
    donate_argnums: int | Sequence[int] = (),
    split_local_steps: bool = False,
) -> AgreedStep | SplitLocalSteps:
    """Run ``step`` under MPI: one process per device, each calling it on its own (unstacked) data.

    This is ``jax.jit(step)`` whose first call checks, unless ``check_config=False``, that every
    process of ``comm`` (an ``MpiComm``; default: ``COMM_WORLD``) runs the same configuration
    (``AgreedStep``). Launch with ``mpirun -n N python script.py`` and build the step's
    communicator with ``MpiComm()``. ``donate_argnums`` is ``jax.jit``'s and
    ``split_local_steps`` ``simulate``'s.
    """
    if _split(split_local_steps):
        build = functools.partial(on_mpi, comm=comm, check_config=check_config, donate_argnums=donate_argnums)
        return SplitLocalSteps(build, step, leading=0, donate_argnums=donate_argnums)
    allgather = None
    if check_config:
        from optaxdist.comm.mpi import MpiComm

        comm = MpiComm() if comm is None else comm
        allgather = comm.host_allgather if comm.size > 1 else None
    return AgreedStep(_Jitted(step, donate_argnums), step, step, allgather, "ranks")


def on_node(
    step: Callable[..., Any],
    hierarchy: Hierarchy,
    *,
    check_config: bool = True,
    donate_argnums: int | Sequence[int] = (),
    split_local_steps: bool = False,
) -> AgreedStep | SplitLocalSteps:
    """Run ``step`` with one replica per device of this node, the nodes joined by MPI: one
    process per node (``mpirun``/``srun``, no ``jax.distributed``), ``hierarchy`` from
    ``node_hierarchy()``.

    Arguments and results are stacked over **this node's** replicas (leading axis
    ``hierarchy.local_size``, local order, else ``ValueError``); replica ``node * local_size + l``
    of the world is row ``l`` on the process of rank ``node``. Inside, ``hierarchy.world`` /
    ``.local`` / ``.cross`` communicate as their names say. Each call waits for its results (a
    step's cross-node exchange blocks its devices' threads until the other nodes answer, so a second
    step must not queue behind it). Unless ``check_config=False``, the first call checks that every
    node runs the same configuration (``AgreedStep``). ``donate_argnums`` is ``jax.jit``'s and
    ``split_local_steps`` ``simulate``'s.
    """
    if _split(split_local_steps):
        build = functools.partial(
            on_node, hierarchy=hierarchy, check_config=check_config, donate_argnums=donate_argnums
        )
        return SplitLocalSteps(build, step, leading=1, donate_argnums=donate_argnums)
    if hierarchy.mesh is None or not isinstance(hierarchy.cross, CrossComm):
        raise TypeError("on_node needs the hierarchy of optaxdist.node_hierarchy()")
    spec = P(hierarchy.mesh.axis_names)

    def per_device(*args):
        with numbered_exchanges():
            return _on_own_row(step)(*args)

    mapped = jax.shard_map(per_device, mesh=hierarchy.mesh, in_specs=spec, out_specs=spec)

    def run(*args):
        _check_stacked(args, hierarchy.local_size, "on_node, this node's replicas")
        return mapped(
            *jax.tree.map(
                lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(hierarchy.mesh, spec)), args
            )
        )

    exchange = hierarchy.cross.exchange
    allgather = exchange.host_allgather if check_config and exchange.size > 1 else None
    jitted = _Jitted(run, donate_argnums)
    return AgreedStep(jitted, run, step, allgather, "nodes", wait=True)


def broadcast_from_root(tree: PyTree, *, comm: Communicator, root: int = 0) -> PyTree:
    """Inside a step: every replica takes replica ``root``'s values (make replicas start identical)."""
    return comm.broadcast(tree, root)


def replicas_identical(tree: PyTree, *, comm: Communicator) -> jax.Array:
    """Inside a step: True on every replica iff all replicas hold bit-identical values."""
    same = [
        jnp.all((x == y) | (jnp.isnan(x) & jnp.isnan(y)))
        if jnp.issubdtype(x.dtype, jnp.floating)
        else jnp.all(x == y)
        for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(comm.broadcast(tree, 0)))
    ]
    mine = jnp.stack(same).all() if same else jnp.asarray(True)
    return comm.agree(mine, op="all")


def assert_replicas_identical(stacked: PyTree) -> None:
    """Host-side check on a stacked pytree: raise ``AssertionError`` naming the first leaf whose
    replicas differ."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(stacked):
        x = np.asarray(leaf)
        if x.ndim == 0:
            continue
        diff = np.nonzero([not np.array_equal(x[0], x[i], equal_nan=True) for i in range(len(x))])
        if diff[0].size:
            raise AssertionError(
                f"replicas {diff[0].tolist()} differ from replica 0 at {jax.tree_util.keystr(path)}"
            )
