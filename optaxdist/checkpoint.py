"""Checkpoints of params and optimizer state with orbax: the glue a user would otherwise repeat.

The checkpoint itself is orbax's (``ocp.CheckpointManager``, one ``StandardSave`` item). This
module adds three things:

* a description of the tree (``describe``: tree structure with the state classes and the ledgers'
  static kinds and payloads, every leaf's path, shape and dtype) saved next to it as a JSON item,
  and compared on restore: a checkpoint whose state has another structure, shape, dtype or ledger
  (another transform, fraction, rank, wire dtype, parameter tree) raises
  ``CheckpointMismatchError`` naming what differs instead of being silently reinterpreted. A
  hyperparameter that leaves the state unchanged (a period, a learning rate) is not in the state
  and is not compared; the configuration agreement of the harness compares those across processes;
* the restore target built from a freshly initialised state (``like``): shapes, dtypes and, for
  global arrays on a mesh (also across hosts under ``jax.distributed``), their shardings;
* the MPI layout. Each MPI process is its own JAX world, so ranks write to their own
  sub-directory ``<dir>/rank<r>-of-<n>`` (``rank_directory``), each holding that rank's row of the
  stacked state. ``simulate`` / ``on_mesh`` / ``jax.distributed`` write one item of stacked (global)
  arrays. ``restore_stacked`` reads either layout as one stacked NumPy tree, which is what
  ``resize_replicas`` (elastic restart) takes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    import orbax.checkpoint as ocp

PyTree = Any
FORMAT = 1


def _orbax():
    """orbax, imported on first use (it adds about a second to ``import optaxdist``)."""
    import orbax.checkpoint

    return orbax.checkpoint


_STATE, _DESC = "state", "structure"
_SHOWN = 12  # differences a mismatch error lists
_RANK_DIR = re.compile(r"^rank(\d+)-of-(\d+)$")


class CheckpointMismatchError(ValueError):
    """The checkpoint was written by another configuration than the one restoring it."""


def describe(tree: PyTree, *, graphdef: Any = None) -> dict:
    """A JSON-able description of ``tree``: the tree structure (state classes, dict keys, ledgers'
    kinds and payloads) and, per leaf, its path, shape and dtype. With ``graphdef`` (the Flax NNX
    ``GraphDef`` of an ``nnx.State`` ``tree``), also the pytree nodes it holds: the optimizer
    state's classes and ledgers, which ``nnx.State`` flattens away."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    out = {
        "format": FORMAT,
        "treedef": str(jax.tree.structure(tree)),
        "leaves": [[jax.tree_util.keystr(p), list(np.shape(x)), _dtype_name(x)] for p, x in leaves],
    }
    if graphdef is not None:
        out["pytrees"] = _graph_pytrees(graphdef)
    return out


def _graph_pytrees(graphdef: Any) -> list[str]:
    """The structures (``PyTreeDef``) of the pytree nodes in an NNX ``GraphDef``, in its order."""
    nodes = getattr(graphdef, "nodes", None)
    if not isinstance(nodes, (list, tuple)):
        raise TypeError(
            f"graphdef must be a flax.nnx GraphDef (from nnx_replicate), got {type(graphdef).__name__}"
        )
    found = []
    for node in nodes:
        metadata = getattr(node, "metadata", None)
        if isinstance(metadata, tuple):
            found += [str(x) for x in metadata if isinstance(x, jax.tree_util.PyTreeDef)]
    return found


def _dtype_name(x) -> str:
    return str(x.dtype) if hasattr(x, "dtype") else str(np.result_type(x))  # typed keys: key<fry>


def _first_difference(a: str, b: str, width: int = 70) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    lo = max(0, i - width)
    return f"checkpoint: ...{a[lo : i + width]}...\n  this run:   ...{b[lo : i + width]}..."


def check_description(saved: dict, expected: dict, *, replicas: int | None = None) -> None:
    """Raise ``CheckpointMismatchError`` naming the first differences between two ``describe``
    results. With ``replicas``, ``saved`` is stacked (a leading axis of that length) and
    ``expected`` describes one replica."""
    if saved.get("format") != FORMAT:
        raise CheckpointMismatchError(f"unknown checkpoint description format {saved.get('format')!r}")
    got = {p: (tuple(s), d) for p, s, d in saved["leaves"]}
    want = {p: (tuple(s), d) for p, s, d in expected["leaves"]}
    if replicas is not None:
        bad = [p for p, (s, _) in got.items() if s[:1] != (replicas,)]
        if bad:
            raise CheckpointMismatchError(f"{bad[0]} is not stacked over {replicas} replicas")
        got = {p: (s[1:], d) for p, (s, d) in got.items()}
    problems = []
    missing = [p for p in want if p not in got]
    extra = [p for p in got if p not in want]
    if missing:
        problems.append(f"missing in the checkpoint: {', '.join(missing[:5])}")
    if extra:
        problems.append(f"in the checkpoint but not in this run's state: {', '.join(extra[:5])}")
    for p in want:
        if p in got and got[p] != want[p]:
            (gs, gd), (ws, wd) = got[p], want[p]
            problems.append(f"{p}: checkpoint has shape {list(gs)} {gd}, this run {list(ws)} {wd}")
    if problems:
        shapes = [(got[p][0], want[p][0]) for p in want if p in got]
        if shapes and all(g[1:] == w[1:] and g[:1] != w[:1] for g, w in shapes if g and w):
            problems.insert(
                0,
                "the leading (replica) axes differ: a checkpoint of another world size is read with "
                "restore_stacked and mapped with resize_replicas",
            )
        if len(problems) > _SHOWN:
            problems[_SHOWN:] = [f"... and {len(problems) - _SHOWN} more"]
        listed = "\n  ".join(problems)
        raise CheckpointMismatchError(f"checkpoint written by another configuration:\n  {listed}")
    structures = [(saved["treedef"], expected["treedef"])]
    if "pytrees" in saved and "pytrees" in expected:  # NNX: the optimizer state's own structure
        structures.append(("\n".join(saved["pytrees"]), "\n".join(expected["pytrees"])))
    for theirs, ours in structures:
        if theirs != ours:
            raise CheckpointMismatchError(
                "checkpoint written by another configuration: the tree structure differs (state "
                "classes, field names or ledger kinds/payloads):\n  " + _first_difference(theirs, ours)
            )


def save_checkpoint(
    manager: ocp.CheckpointManager, step: int, tree: PyTree, *, graphdef: Any = None, **kwargs: Any
) -> bool:
    """``manager.save(step, ...)`` of ``tree`` (stacked or global arrays, or one MPI rank's row)
    with its ``describe`` description. Returns what ``manager.save`` returns; call
    ``manager.wait_until_finished()`` before exiting. For a Flax NNX state pass its ``graphdef``
    (from ``nnx_replicate``), here and to ``restore_checkpoint``: ``nnx.State`` keeps no ledger
    kinds or state classes, the graphdef does."""
    ocp = _orbax()
    description = describe(tree, graphdef=graphdef)
    args = ocp.args.Composite(**{_STATE: ocp.args.StandardSave(tree), _DESC: ocp.args.JsonSave(description)})
    return manager.save(step, args=args, **kwargs)


def abstract_like(like: PyTree) -> PyTree:
    """The restore target of ``like`` (a freshly initialised state, concrete or abstract): a tree
    of ``jax.ShapeDtypeStruct`` with the shardings of ``like``'s arrays (none for NumPy arrays)."""

    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        sharding = x.sharding if isinstance(x, jax.Array) else None
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree.map(one, like)


def _read_description(manager: ocp.CheckpointManager, step: int) -> dict:
    ocp = _orbax()
    try:
        return manager.restore(step, args=ocp.args.Composite(**{_DESC: ocp.args.JsonRestore()}))[_DESC]
    except (FileNotFoundError, KeyError, ValueError) as err:
        raise CheckpointMismatchError(
            f"step {step} in {manager.directory} has no optaxdist description (not written by "
            f"save_checkpoint?): {err}"
        ) from err


def _step(manager: ocp.CheckpointManager, step: int | None) -> int:
    if step is None:
        step = manager.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {manager.directory}")
    elif step not in manager.all_steps():
        raise FileNotFoundError(f"no step {step} in {manager.directory}; steps: {manager.all_steps()}")
    return step


def restore_checkpoint(
    manager: ocp.CheckpointManager, step: int | None, like: PyTree, *, graphdef: Any = None
) -> PyTree:
    """Restore ``step`` (None: the latest) with the structure, dtypes and shardings of ``like``.

    ``like`` is what a fresh run would start from: e.g. ``(params, opt_state)`` after
    ``init`` on the same harness (stacked arrays under ``simulate``, global sharded arrays under
    ``on_mesh``, one rank's row under MPI), or its ``jax.eval_shape``. Leaves without a sharding
    (NumPy arrays, ``ShapeDtypeStruct`` without one) come back as NumPy arrays. ``graphdef``: a
    Flax NNX state's (``like`` an ``nnx.State``), as given to ``save_checkpoint``; the state
    classes and ledgers it holds are compared with the checkpoint's where both have them.

    Raises:
      CheckpointMismatchError: the checkpoint holds another tree (structure, state classes,
        ledger kinds, shapes or dtypes), naming the differences.
    """
    ocp = _orbax()
    step = _step(manager, step)
    check_description(_read_description(manager, step), describe(like, graphdef=graphdef))
    target = abstract_like(like)
    leaves = jax.tree.leaves(target)
    if leaves and all(x.sharding is not None for x in leaves):
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(target)})
        return manager.restore(step, args=args)[_STATE]
    restore_args = jax.tree.map(
        lambda x: (
            ocp.ArrayRestoreArgs(sharding=x.sharding)
            if x.sharding is not None
            else ocp.RestoreArgs(restore_type=np.ndarray)
        ),
        target,
    )
    with ocp.CheckpointManager(manager.directory) as reader:  # a PyTree reader of the same files
        item = ocp.args.PyTreeRestore(item=target, restore_args=restore_args)
        return reader.restore(step, args=ocp.args.Composite(**{_STATE: item}))[_STATE]


def rank_directory(directory: str | Path, *, comm: Any = None) -> Path:
    """This MPI rank's checkpoint directory: ``<directory>/rank<r>-of-<n>``, both numbers
    zero-padded to 5 digits (``rank00001-of-00004``).

    Under MPI every process is its own JAX world; give each its own ``CheckpointManager`` on this
    directory. ``comm``: an ``optaxdist.MpiComm`` or mpi4py communicator (default COMM_WORLD).
    """
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    comm = getattr(comm, "comm", comm)  # MpiComm -> its mpi4py communicator
    rank, size = comm.Get_rank(), comm.Get_size()
    return Path(directory) / f"rank{rank:05d}-of-{size:05d}"


def _rank_dirs(directory: Path) -> list[Path]:
    found = sorted(
        (int(m.group(1)), int(m.group(2)), p)
        for p in directory.iterdir()
        if p.is_dir() and (m := _RANK_DIR.match(p.name))
    )
    if not found:
        return []
    n = found[0][1]
    if [r for r, _, _ in found] != list(range(n)) or any(s != n for _, s, _ in found):
        raise CheckpointMismatchError(
            f"{directory}: incomplete or mixed MPI layout: {[p.name for _, _, p in found]}"
        )
    return [p for _, _, p in found]


def restore_stacked(directory: str | Path, step: int | None, like_row: PyTree) -> PyTree:
    """Read a checkpoint of any harness as one stacked NumPy tree (leading axis: the replicas).

    Works for the stacked layout (``simulate``, ``on_mesh``, ``jax.distributed``) and for the MPI
    per-rank layout (``rank_directory``), whatever the current process's devices: this is the
    input of ``resize_replicas``.

    Args:
      directory: the directory given to ``CheckpointManager`` (for MPI: the parent of the
        ``rank*`` directories).
      step: the step (None: the latest; under MPI, the latest of rank 0).
      like_row: the state of ONE replica in the configuration that wrote the checkpoint (e.g.
        ``jax.eval_shape(tx.init, params)`` with the old transform, or a row of it).
    """
    ocp = _orbax()
    directory = Path(directory)
    row = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), like_row)
    ranks = _rank_dirs(directory)
    if ranks:
        rows = []
        for path in ranks:
            with ocp.CheckpointManager(path) as manager:
                s = _step(manager, step)
                if step is None:
                    step = s
                rows.append(restore_checkpoint(manager, s, row))
        return jax.tree.map(lambda *xs: np.stack(xs), *rows)
    with ocp.CheckpointManager(directory) as manager:
        step = _step(manager, step)
        saved = _read_description(manager, step)
        n = saved["leaves"][0][1][0] if saved["leaves"] and saved["leaves"][0][1] else None
        if n is None:
            raise CheckpointMismatchError(f"{directory} step {step} holds unstacked arrays")
        check_description(saved, describe(row), replicas=n)
        stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype), row)
        return restore_checkpoint(manager, step, stacked)
