"""Sharded models: per-device memory under model sharding, and training with FSDP inside replicas.

Two parts, both on the 8-device CPU mesh (``XLA_FLAGS=--xla_force_host_platform_device_count=8``,
set by ``optaxdist bench --suite sharded`` before JAX starts):

1. **Memory.** A two-matrix model (``w1`` of ``s × 4s`` split on its columns, ``w2`` of ``4s × s``
   split on its rows, a bias ``b`` of ``s`` replicated) on a ``("replica", "model")`` mesh of
   ``2 × |model|``: the replica count stays 2 so that only the split changes, and ``|model|`` = 1,
   2, 4 uses 2, 4 and 8 devices. For each transform, after ``init`` and two steps under
   ``on_mesh``, the bytes of the parameters, of the local optimizer's state and of the algorithm's
   own state (error-feedback residuals, PowerSGD's factors and residuals, DiLoCo's anchor and outer
   momentum, counters) that each device holds are summed from the arrays' addressable shards (the
   largest over the devices is reported), and the compiled step's ``memory_analysis()`` (bytes of
   its arguments, temporaries and peak, per device) is reported beside them.
2. **Training.** The character transformer of ``--dataset charlm`` on a ``("replica", "fsdp")``
   mesh of ``4 × 2``, every parameter of two or more dimensions split over ``"fsdp"`` on its
   largest dimension that 2 divides (FSDP-style; biases and norms replicated), for rows of the
   algorithm registry (default: ``diloco-50-topk10%``, whose pseudo-gradients are compressed per
   block with ``model_sharding``, and ``powersgd-r2``); each row is also run under ``simulate``
   (4 replicas on one device, unsharded) from the same parameters on the same minibatches, and,
   as a control, under ``simulate`` from the parameters moved up by one float32 ulp: how far float32
   rounding alone moves that algorithm's result. The final train loss of each, the differences to
   ``simulate``, the largest parameter difference, the ledger's bytes per replica and the parameter
   and state bytes per device (after ``init`` and at the end) are reported.

The state that ``on_mesh(tx.init, ...)`` returns is placed as the compiler chose: zero-initialised
leaves (momenta, residuals) come out replicated over the model axes, and are split like the
parameters only once a step has produced them. Both are measured (``after_init``, and
``compiled_first_step`` against ``compiled``).
"""

from __future__ import annotations

import collections
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optaxdist
from optaxdist.bench.algorithms import HIERARCHICAL_ALGORITHMS, BenchContext, get_algorithms, local_optimizer
from optaxdist.bench.charlm import CharTransformer
from optaxdist.bench.data import load_dataset, make_shards, random_normal
from optaxdist.bench.models import cross_entropy

R = optaxdist.REPLICA_AXIS
MODEL = "model"
FSDP = "fsdp"
MEMORY_REPLICAS = 2
MODEL_SIZES = (1, 2, 4)
MEMORY_STEPS = 2  # DiLoCo (period 2) has synchronized once, PowerSGD has its factors
TRAIN_REPLICAS, TRAIN_FSDP = 4, 2
TRAIN_ALGORITHMS = ("diloco-50-topk10%", "powersgd-r2")
# the control run: simulate from the parameters moved up by one float32 ulp, to show how much
# float32 rounding alone moves each algorithm's final loss
PERTURBED = "simulate+1ulp"
HARNESSES = ("simulate", "mesh", PERTURBED)
HIERARCHICAL = tuple(a.name for a in HIERARCHICAL_ALGORITHMS)


def _log(msg: str, enabled: bool) -> None:
    if enabled:
        print(msg, file=sys.stderr, flush=True)


# ---- measuring ----------------------------------------------------------------------------------


def bytes_by_device(tree: Any) -> collections.Counter:
    """Bytes of every array of ``tree`` held by each device, from the arrays' addressable shards."""
    out: collections.Counter = collections.Counter()
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            out[shard.device] += shard.data.nbytes
    return out


def per_device_bytes(tree: Any) -> int:
    """The most bytes of ``tree`` any one device holds."""
    return max(bytes_by_device(tree).values(), default=0)


def split_state(state: Any) -> tuple[Any, Any]:
    """``(local optimizer's state, the algorithm's own state)`` of ``optax.chain(algorithm, local)``
    or of a transform that wraps the local optimizer (its ``inner_state``)."""
    if hasattr(state, "inner_state"):
        return state.inner_state, state._replace(inner_state=())
    if isinstance(state, tuple) and len(state) == 2:
        return state[1], state[0]
    raise TypeError(f"cannot tell the local optimizer's state in {type(state).__name__}")


def compiled_memory(compiled: Any, batch_bytes: int) -> dict[str, int] | None:
    """Per-device bytes from ``compiled.memory_analysis()`` (``None`` where the backend has none)."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None
    if ma is None:
        return None
    out = {
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "alias_bytes": int(ma.alias_size_in_bytes),
        "temp_bytes": int(ma.temp_size_in_bytes),
        "batch_bytes": batch_bytes,
        "arguments_without_batch": int(ma.argument_size_in_bytes) - batch_bytes,
    }
    peak = getattr(ma, "peak_memory_in_bytes", None)
    if peak is not None:
        out["peak_bytes"] = int(peak)
    return out


def _mesh(shape: tuple[int, int], names: tuple[str, str]) -> Mesh:
    devices = np.asarray(jax.devices()[: math.prod(shape)]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * 2)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _place(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """Stacked ``tree`` on ``mesh``: the replica axis on the leading dimension, ``specs`` after it."""
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, P(R, *s)), specs, is_leaf=_is_spec)
    return jax.device_put(tree, shardings)


# ---- part 1: memory -----------------------------------------------------------------------------


def memory_params(n_params: int) -> tuple[dict[str, jax.Array], dict[str, P]]:
    """``w1`` (s, 4s), ``w2`` (4s, s), ``b`` (s,) with about ``n_params`` elements (s a multiple of
    8), and their split over ``"model"``: columns of ``w1``, rows of ``w2``, ``b`` replicated."""
    side = max(8, 8 * round(math.sqrt(n_params / 8) / 8))
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": random_normal(k1, (side, 4 * side)) / math.sqrt(side),
        "w2": random_normal(k2, (4 * side, side)) / math.sqrt(4 * side),
        "b": jnp.zeros((side,)),
    }
    return params, {"w1": P(None, MODEL), "w2": P(MODEL, None), "b": P()}


def _memory_local() -> optax.GradientTransformation:
    return optax.sgd(0.01, momentum=0.9)


#: name -> (description, factory(comm, model_sharding) -> transform); each wraps SGD with momentum
MEMORY_TRANSFORMS: dict[str, tuple[str, Callable[..., optax.GradientTransformation]]] = {
    "allreduce": (
        "allreduce + sgd(momentum 0.9)",
        lambda c, ms: optax.chain(optaxdist.allreduce(comm=c), _memory_local()),
    ),
    "topk-1%-ef": (
        "compressed_allreduce(top_k 1 %, model_sharding) + sgd(momentum 0.9)",
        lambda c, ms: optax.chain(
            optaxdist.compressed_allreduce(
                optaxdist.compress.top_k(fraction=0.01), comm=c, model_sharding=ms
            ),
            _memory_local(),
        ),
    ),
    "powersgd-r2": (
        "powersgd(rank 2, warm start) + sgd(momentum 0.9)",
        lambda c, ms: optax.chain(
            optaxdist.powersgd(comm=c, rank=2, warmup_steps=0, warm_start=True), _memory_local()
        ),
    ),
    "diloco-2": (
        "diloco(sgd(momentum 0.9), outer Nesterov, H = 2)",
        lambda c, ms: optaxdist.diloco(
            _memory_local(), optaxdist.diloco_outer_optimizer(0.7, 0.9), comm=c, period=2
        ),
    ),
}


def _memory_loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] + p["b"] - y) ** 2)


def run_memory(
    n_params: int,
    *,
    model_sizes: Sequence[int] = MODEL_SIZES,
    transforms: Sequence[str] = tuple(MEMORY_TRANSFORMS),
    progress: bool = True,
) -> dict[str, Any]:
    """Part 1: per-device bytes of each transform on ``2 × |model|`` meshes (see the module doc)."""
    params, specs = memory_params(n_params)
    side = params["b"].shape[0]
    comm = optaxdist.AxisComm(R)
    n = MEMORY_REPLICAS
    kx, ky = jax.random.split(jax.random.key(1))
    x = random_normal(kx, (MEMORY_STEPS, n, 8, side))
    y = random_normal(ky, (MEMORY_STEPS, n, 8, side))
    results, skipped = [], []
    for m in model_sizes:
        if n * m > len(jax.devices()):
            skipped.append({"model": m, "reason": f"needs {n * m} devices, {len(jax.devices())} exist"})
            _log(f"  |model| = {m}: skipped, {n * m} devices needed", progress)
            continue
        mesh = _mesh((n, m), (R, MODEL))
        sharding = optaxdist.ModelSharding.from_mesh(mesh, specs, R)
        for name in transforms:
            _, make = MEMORY_TRANSFORMS[name]
            tx = make(comm, sharding)

            def step(p, s, xb, yb, tx=tx):
                g = jax.grad(_memory_loss)(p, xb, yb)
                u, s = tx.update(g, s, p)
                return optaxdist.apply_updates(p, u, s), s

            p = _place(optaxdist.replicate(params, n), specs, mesh)
            s = optaxdist.on_mesh(tx.init, mesh, axis_name=R)(p)
            init_local, init_algo = split_state(s)
            run = optaxdist.on_mesh(step, mesh, axis_name=R)
            data = NamedSharding(mesh, P(R))
            xs = [jax.device_put(x[t], data) for t in range(MEMORY_STEPS)]
            ys = [jax.device_put(y[t], data) for t in range(MEMORY_STEPS)]
            batch = per_device_bytes((xs[0], ys[0]))
            # The state of `init` comes out as the compiler places it: the step's first call is
            # compiled for those shardings, later calls for the ones the step's outputs have.
            first = run.lower(p, s, xs[0], ys[0]).compile()
            p, s = first(p, s, xs[0], ys[0])
            steady = run.lower(p, s, xs[0], ys[0]).compile()
            for t in range(1, MEMORY_STEPS):
                p, s = steady(p, s, xs[t], ys[t])
            jax.block_until_ready((p, s))
            local_state, algo_state = split_state(s)
            row = {
                "transform": name,
                "model": m,
                "replicas": n,
                "mesh": {R: n, MODEL: m},
                "params_bytes": per_device_bytes(p),
                "local_state_bytes": per_device_bytes(local_state),
                "algorithm_state_bytes": per_device_bytes(algo_state),
                "total_bytes": per_device_bytes((p, s)),
                "after_init": {
                    "local_state_bytes": per_device_bytes(init_local),
                    "algorithm_state_bytes": per_device_bytes(init_algo),
                },
                "compiled": compiled_memory(steady, batch),
                "compiled_first_step": compiled_memory(first, batch),
                "ledger_bytes_per_replica": optaxdist.comm_stats(s).bytes,
            }
            results.append(row)
            _log(f"  {name:<12} |model| = {m}: {row['total_bytes']:,} bytes per device", progress)
    base = {r["transform"]: r["total_bytes"] for r in results if r["model"] == min(model_sizes)}
    for r in results:
        r["total_vs_smallest_model"] = (
            r["total_bytes"] / base[r["transform"]] if r["transform"] in base else None
        )
    n_total = sum(int(v.size) for v in jax.tree.leaves(params))
    return {
        "model": {
            "parameters": n_total,
            "shapes": {k: list(v.shape) for k, v in params.items()},
            "specs": {k: str(v) for k, v in specs.items()},
            "param_bytes": 4 * n_total,
        },
        "replicas": n,
        "steps": MEMORY_STEPS,
        "transforms": {k: MEMORY_TRANSFORMS[k][0] for k in transforms},
        "results": results,
        "skipped": skipped,
    }


# ---- part 2: training -----------------------------------------------------------------------------


def fsdp_specs(params: Any, size: int, axis: str = FSDP) -> Any:
    """FSDP-style split: each leaf of two or more dimensions over ``axis`` on its largest dimension
    that ``size`` divides (the first such); other leaves (biases, norms) replicated."""

    def spec(x):
        dims = [d for d in range(x.ndim) if x.shape[d] % size == 0] if x.ndim >= 2 else []
        if not dims:
            return P()
        d = max(dims, key=lambda d: x.shape[d])
        return P(*([None] * d), axis)

    return jax.tree.map(spec, params)


def check_training_algorithms(names: Sequence[str]) -> list:
    """The registry rows ``names`` (``ValueError`` for unknown names, the single-replica row and the
    hierarchical rows, whose ``('node', 'local')`` communicators this suite does not build)."""
    algos = get_algorithms(list(names))
    bad = [a.name for a in algos if a.single or a.name in HIERARCHICAL]
    if bad:
        raise ValueError(f"--suite sharded runs the flat data-parallel rows only, not {bad}")
    return algos


def run_training(
    algorithms: Sequence[str] = TRAIN_ALGORITHMS,
    *,
    steps: int = 200,
    batch_size: int = 8,
    optimizer: str = "sgd",
    lr: float = 0.05,
    momentum: float = 0.9,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    d_model: int = 64,
    layers: int = 2,
    heads: int = 4,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Part 2: each registry row on the 4 × 2 ``("replica", "fsdp")`` mesh and under ``simulate``."""
    n = TRAIN_REPLICAS
    algos = check_training_algorithms(algorithms)
    data = load_dataset("charlm")
    seq_len = data.x_train.shape[1]
    model = CharTransformer(data.num_classes, seq_len=seq_len, d_model=d_model, layers=layers, heads=heads)
    params0 = model.init(jax.random.key(seed), jnp.asarray(data.x_train[:1]))["params"]
    n_params = sum(int(v.size) for v in jax.tree.leaves(params0))
    bumped = jax.tree.map(lambda v: jnp.nextafter(v, jnp.inf), params0)  # one float32 ulp up
    specs = fsdp_specs(params0, TRAIN_FSDP)
    mesh = _mesh((n, TRAIN_FSDP), (R, FSDP))
    sharding = optaxdist.ModelSharding.from_mesh(mesh, specs, R)

    # the same minibatches for both harnesses: (steps, replicas, batch, seq_len)
    shards = make_shards(data.y_train, n, "iid", seed=seed)
    idx = np.random.default_rng(seed + 1).integers(0, shards.shape[1], size=(steps, n, batch_size))
    rows = shards[np.arange(n)[None, :, None], idx]
    xb, yb = data.x_train[rows], data.y_train[rows]

    @jax.jit
    def evaluate(p0):
        return cross_entropy(model, p0, jnp.asarray(data.x_train), jnp.asarray(data.y_train))

    comm = optaxdist.AxisComm(R)
    hierarchy = optaxdist.axis_hierarchy(1, n)
    results = []
    for algo in algos:
        ctx = BenchContext(n, hierarchy, steps, lr, outer_lr, outer_momentum, model_sharding=sharding)
        tx = algo.make(comm, local_optimizer(lr, momentum, optimizer), ctx)

        def step(p, s, x, y, tx=tx):
            loss, g = jax.value_and_grad(lambda q: cross_entropy(model, q, x, y))(p)
            u, s = tx.update(g, s, p, value=loss)
            return optaxdist.apply_updates(p, u, s), s, loss

        finals = {}
        for harness in HARNESSES:
            _log(f"[{algo.name}] {harness}: compiling and training {steps} steps ...", progress)
            start = optaxdist.replicate(params0 if harness != PERTURBED else bumped, n)
            if harness == "mesh":
                start = _place(start, specs, mesh)
                wrap = lambda f: optaxdist.on_mesh(f, mesh, axis_name=R)  # noqa: E731
                put = lambda a: jax.device_put(a, NamedSharding(mesh, P(R)))  # noqa: E731
            else:
                wrap = optaxdist.simulate
                put = jnp.asarray
            s = wrap(tx.init)(start)
            init_state_bytes = per_device_bytes(s) // (1 if harness == "mesh" else n)
            p = start
            # jitted, not compiled ahead: the state of `init` comes out placed as the compiler
            # chose, so the first step is compiled for it and the second for the step's outputs
            run = wrap(step)
            times = []
            for t in range(steps):
                t1 = time.perf_counter()
                p, s, _ = run(p, s, put(xb[t]), put(yb[t]))
                jax.block_until_ready(p)
                times.append(time.perf_counter() - t1)
            compile_s = sum(times[:2]) - 2 * statistics.median(times[2:] or times)
            host = jax.device_get(p)
            loss = float(evaluate(jax.tree.map(lambda a: a[0], host)))
            local_state, algo_state = split_state(s)
            if harness == "mesh":
                per_dev = {
                    "params_bytes": per_device_bytes(p),
                    "local_state_bytes": per_device_bytes(local_state),
                    "algorithm_state_bytes": per_device_bytes(algo_state),
                    "total_bytes": per_device_bytes((p, s)),
                }
                fsdp_ok = all(
                    FSDP in tuple(leaf.sharding.spec)
                    for leaf, sp in zip(
                        jax.tree.leaves(p), jax.tree.leaves(specs, is_leaf=_is_spec), strict=True
                    )
                    if FSDP in tuple(sp)
                )
            else:  # one replica per device: the stacked bytes over the replicas
                per_dev = {
                    "params_bytes": per_device_bytes(p) // n,
                    "local_state_bytes": per_device_bytes(local_state) // n,
                    "algorithm_state_bytes": per_device_bytes(algo_state) // n,
                    "total_bytes": per_device_bytes((p, s)) // n,
                }
                fsdp_ok = None
            finals[harness] = {
                "harness": harness,
                "mesh": {R: n, FSDP: TRAIN_FSDP} if harness == "mesh" else {R: n},
                "start": "params + 1 ulp" if harness == PERTURBED else "params",
                "final_train_loss": loss,
                "ledger_bytes_per_replica": optaxdist.comm_stats(s).bytes,
                **per_dev,
                "state_bytes_after_init": init_state_bytes,
                "params_still_split": fsdp_ok,
                "first_two_steps_less_median_s": compile_s,
                "step_ms_median": 1e3 * statistics.median(times[2:] or times),
                "_params": host,
            }
            _log(f"  {algo.name} {harness}: train loss {loss:.6f}", progress)
        sim, msh, ulp = finals["simulate"], finals["mesh"], finals[PERTURBED]
        sim_params = sim.pop("_params")

        def max_diff(other, ref=sim_params):
            return max(
                float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(other.pop("_params")), strict=True)
            )

        results.append(
            {
                "algorithm": algo.name,
                "description": algo.description,
                "simulate": sim,
                "mesh": msh,
                PERTURBED: ulp,
                "loss_difference": msh["final_train_loss"] - sim["final_train_loss"],
                "max_param_difference": max_diff(msh),
                "ulp_loss_difference": ulp["final_train_loss"] - sim["final_train_loss"],
                "ulp_max_param_difference": max_diff(ulp),
            }
        )
    return {
        "dataset": data.name,
        "model": {
            "kind": "CharTransformer",
            "d_model": d_model,
            "layers": layers,
            "heads": heads,
            "parameters": n_params,
            "param_bytes": 4 * n_params,
            "specs": {
                jax.tree_util.keystr(k): str(v)
                for k, v in jax.tree_util.tree_leaves_with_path(specs, is_leaf=_is_spec)
            },
        },
        "replicas": n,
        "fsdp": TRAIN_FSDP,
        "steps": steps,
        "batch_per_replica": batch_size,
        "optimizer": optimizer,
        "lr": lr,
        "momentum": momentum,
        "results": results,
    }


# ---- output ----------------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def _kb(b: int | None) -> str:
    return "—" if b is None else f"{b / 1e3:,.1f}"


def format_tables(record: dict[str, Any]) -> str:
    """The memory table and the training table of a ``sharded.json`` record, as Markdown."""
    out = []
    for mem in record.get("memory", []):
        rows = []
        for r in mem["results"]:
            c = r["compiled"] or {}
            ratio = r["total_vs_smallest_model"]
            rows.append(
                [
                    r["transform"],
                    str(r["model"]),
                    f"{r['replicas']} × {r['model']}",
                    _kb(r["params_bytes"]),
                    _kb(r["local_state_bytes"]),
                    _kb(r["algorithm_state_bytes"]),
                    _kb(r["total_bytes"]),
                    "—" if ratio is None else f"{ratio:.3f}",
                    _kb(sum(r["after_init"].values())),
                    _kb((r["compiled_first_step"] or {}).get("arguments_without_batch")),
                    _kb(c.get("arguments_without_batch")),
                    _kb(c.get("temp_bytes")),
                    _kb(c.get("peak_bytes")),
                ]
            )
        header = [
            "transform",
            "|model|",
            "mesh",
            "params KB",
            "local opt KB",
            "algorithm state KB",
            "total KB/device",
            f"vs |model|={min((r['model'] for r in mem['results']), default=1)}",
            "state after init KB",
            "compiled args − batch KB, step 1",
            "compiled args − batch KB, later",
            "compiled temp KB",
            "compiled peak KB",
        ]
        out.append(
            f"Memory per device ({mem['model']['parameters']:,} parameters, "
            f"{mem['replicas']} replicas, after {mem['steps']} steps):\n\n" + _table(header, rows)
        )
    train = record.get("training")
    if train:
        rows = []
        for r in train["results"]:
            for h in HARNESSES:
                x = r[h]
                mesh = " × ".join(str(v) for v in x["mesh"].values())
                prefix = {"mesh": "", PERTURBED: "ulp_"}.get(h)
                rows.append(
                    [
                        r["algorithm"],
                        f"{h} {mesh}",
                        f"{x['final_train_loss']:.6f}",
                        "" if prefix is None else f"{r[prefix + 'loss_difference']:+.2e}",
                        "" if prefix is None else f"{r[prefix + 'max_param_difference']:.2e}",
                        f"{x['ledger_bytes_per_replica'] / 1e6:.3f}",
                        _kb(x["params_bytes"]),
                        _kb(x["local_state_bytes"] + x["algorithm_state_bytes"]),
                        _kb(x["state_bytes_after_init"]),
                        f"{x['step_ms_median']:.1f}",
                    ]
                )
        header = [
            "algorithm",
            "harness",
            "final train loss",
            "Δ loss vs simulate",
            "max |Δ param|",
            "ledger MB/replica",
            "params KB/device",
            "state KB/device",
            "state KB/device after init",
            "ms/step",
        ]
        m = train["model"]
        out.append(
            f"Training ({train['dataset']}, CharTransformer d={m['d_model']} × {m['layers']} layers, "
            f"{m['parameters']:,} parameters, {train['steps']} steps, {train['replicas']} replicas × "
            f"{train['batch_per_replica']} windows, {train['optimizer']} lr {train['lr']}):\n\n"
            + _table(header, rows)
        )
    return "\n\n".join(out)
