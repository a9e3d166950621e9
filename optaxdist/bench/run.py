"""The training benchmark: every registered algorithm on the same data, model and replicas.

Each replica draws its own minibatches (uniformly, with replacement, from its shard) with a key
derived from ``(seed, step, replica)``; all algorithms start from the same parameters. The
simulated step (``optaxdist.simulate``: ``jax.vmap`` over the axis ``"replica"``) runs
``log_every`` steps per call of one jitted ``fori_loop``; after each call the train loss on the
whole training set, the test loss and the test accuracy of replica 0's parameters are recorded
(on a fixed, evenly spaced ``EVAL_LIMIT`` of the examples where a set is larger: ``pysrc``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optaxdist
from optaxdist.accounting import payload_bytes
from optaxdist.bench import cost
from optaxdist.bench.algorithms import (
    DEFAULT_ALGORITHMS,
    OPTIMIZERS,
    Algorithm,
    BenchContext,
    get_algorithms,
    learning_rate_schedule,
    local_optimizer,
)
from optaxdist.bench.charlm import CharTransformer
from optaxdist.bench.data import TEXT_DATASETS, Dataset, load_dataset, make_shards
from optaxdist.bench.host_memory import host_malloc
from optaxdist.bench.models import MLP, cross_entropy, evaluate_in_batches

FP32_REFERENCE = "allreduce-fp32"
PARAM_DTYPES = ("float32", "bfloat16")
CHARLM_TRANSFORMER = (64, 2, 4)  # width, layers, heads of the char-LM tables' 117k-parameter model
EVAL_LIMIT = 8192  # examples a train or test loss is measured on (every one of the smaller datasets)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Everything a training benchmark run depends on (recorded in the JSON)."""

    dataset: str = "digits"
    replicas: int = 8
    shards: str = "iid"
    batch_size: int = 32
    steps: int = 500
    lr: float = 0.05
    momentum: float = 0.9
    optimizer: str = "sgd"
    schedule: str = "constant"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    hidden: tuple[int, ...] = (128, 128)
    transformer: tuple[int, int, int] | None = None  # charlm: (width, layers, heads); None: (64, 2, 4)
    param_dtype: str = "float32"
    algorithms: tuple[str, ...] = DEFAULT_ALGORITHMS
    network: str = "10GbE"
    nodes: int | None = None
    log_every: int = 25
    seed: int = 0
    out: str | None = "bench_results"
    plots: bool = True
    progress: bool = True

    def __post_init__(self):
        for name in ("replicas", "batch_size", "steps", "log_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        nodes = self.num_nodes
        if not 1 <= nodes <= self.replicas:
            raise ValueError(f"nodes={nodes} must be between 1 and replicas={self.replicas}")
        if self.replicas % nodes:
            raise ValueError(f"nodes={nodes} must divide replicas={self.replicas}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"param_dtype={self.param_dtype!r}; allowed: {PARAM_DTYPES}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}; allowed: {OPTIMIZERS}")
        learning_rate_schedule(self.lr, self.schedule, self.steps)  # raises on an unknown schedule
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr={self.outer_lr!r} must be > 0")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum={self.outer_momentum!r} must be in [0, 1)")
        cost.get_network(self.network)
        get_algorithms(list(self.algorithms))
        if self.transformer is not None:
            if self.dataset not in TEXT_DATASETS:
                raise ValueError(
                    f"transformer={self.transformer} applies to the text datasets {TEXT_DATASETS} only"
                )
            shape = tuple(self.transformer)
            if len(shape) != 3 or min(shape) < 1 or shape[0] % shape[2]:
                raise ValueError(
                    f"transformer={self.transformer}: (width, layers, heads), positive, and the heads "
                    "must divide the width"
                )

    @property
    def transformer_shape(self) -> tuple[int, int, int]:
        """The charlm transformer's (width, layers, heads)."""
        return self.transformer or CHARLM_TRANSFORMER

    @property
    def num_nodes(self) -> int:
        """Nodes the replicas are spread over (default: one replica per node)."""
        return self.replicas if self.nodes is None else self.nodes

    @property
    def tag(self) -> str:
        """File name stem of this run's outputs."""
        suffix = "" if self.param_dtype == "float32" else f"_{self.param_dtype}"
        return f"bench_{self.dataset}_{self.shards}{suffix}"


def _log(msg: str, enabled: bool = True) -> None:
    if enabled:
        print(msg, file=sys.stderr, flush=True)


def run_algorithm(cfg: BenchConfig, data: Dataset, algo: Algorithm, params0: Any) -> dict[str, Any]:
    """Train ``algo`` for ``cfg.steps`` steps from ``params0`` and return its result record."""
    n = 1 if algo.single else cfg.replicas
    batch = cfg.batch_size * cfg.replicas if algo.single else cfg.batch_size
    if algo.single:
        shard_idx = np.arange(len(data.y_train))[None]
    else:
        shard_idx = make_shards(data.y_train, n, cfg.shards, seed=cfg.seed)  # type: ignore[arg-type]
    xs, ys = jnp.asarray(data.x_train[shard_idx]), jnp.asarray(data.y_train[shard_idx])
    model = make_model(cfg, data)
    # Replicas are laid out as (node, local): flat algorithms use the whole group, hierarchical
    # ones (DASO, node-level local SGD) its two levels.
    nodes = 1 if algo.single else cfg.num_nodes
    hierarchy = optaxdist.axis_hierarchy(nodes, n // nodes)
    lr = learning_rate_schedule(cfg.lr, cfg.schedule, cfg.steps)
    ctx = BenchContext(n, hierarchy, cfg.steps, lr, cfg.outer_lr, cfg.outer_momentum)
    tx = algo.make(hierarchy.world, local_optimizer(lr, cfg.momentum, cfg.optimizer), ctx)

    def replica_step(params, opt_state, x, y, key):
        idx = jax.random.randint(key, (batch,), 0, x.shape[0])
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(model, p, x[idx], y[idx]))(params)
        updates, opt_state = tx.update(grads, opt_state, params, value=loss)
        return optax.apply_updates(params, updates), opt_state, loss

    simulated = optaxdist.simulate(
        replica_step, axis_name=hierarchy.world.axis_name, shape=(nodes, n // nodes), jit=False
    )

    def chunk(params, opt_state, x, y, key, start, count):
        def body(i, carry):
            p, s, acc = carry
            keys = jax.random.split(jax.random.fold_in(key, i), n)
            p, s, loss = simulated(p, s, x, y, keys)
            return p, s, acc + loss.mean()

        p, s, acc = jax.lax.fori_loop(start, start + count, body, (params, opt_state, 0.0))
        return p, s, acc / count.astype(jnp.float32)

    train_eval, test_eval = evaluation_subset(len(data.y_train)), evaluation_subset(len(data.y_test))

    @jax.jit
    def evaluate(params):
        p0 = jax.tree.map(lambda a: a[0], params)
        train_loss, _ = evaluate_in_batches(model, p0, data.x_train[train_eval], data.y_train[train_eval])
        return (train_loss, *evaluate_in_batches(model, p0, data.x_test[test_eval], data.y_test[test_eval]))

    params = optaxdist.replicate(params0, n)
    # init where the replica axes are bound, as the steps run: a transform may need the group size
    init = optaxdist.simulate(tx.init, axis_name=hierarchy.world.axis_name, shape=(nodes, n // nodes))
    opt_state = init(params)
    key = jax.random.key(cfg.seed + 1)
    t0 = time.perf_counter()
    compiled = (
        jax.jit(chunk, donate_argnums=(0, 1))
        .lower(params, opt_state, xs, ys, key, np.int32(0), np.int32(cfg.log_every))
        .compile()
    )
    compile_s = time.perf_counter() - t0

    loss0, test_loss0, acc0 = evaluate(params)
    curve = {
        "step": [0],
        "train_loss": [float(loss0)],
        "test_loss": [float(test_loss0)],
        "test_accuracy": [float(acc0)],
        "bytes": [0],
        "minibatch_loss": [None],
    }
    step, per_step_s, last_report = 0, [], 0
    while step < cfg.steps:
        count = min(cfg.log_every, cfg.steps - step)
        t = time.perf_counter()
        params, opt_state, mb_loss = compiled(params, opt_state, xs, ys, key, np.int32(step), np.int32(count))
        jax.block_until_ready((params, opt_state, mb_loss))
        per_step_s.append((time.perf_counter() - t) / count)
        step += count
        loss, test_loss, acc = evaluate(params)
        curve["step"].append(step)
        curve["train_loss"].append(float(loss))
        curve["test_loss"].append(float(test_loss))
        curve["test_accuracy"].append(float(acc))
        curve["bytes"].append(optaxdist.comm_stats(opt_state).bytes)
        curve["minibatch_loss"].append(float(mb_loss))
        if step - last_report >= max(cfg.steps // 4, 1) or step == cfg.steps:
            last_report = step
            _log(
                f"  {algo.name:<16} step {step:>5}/{cfg.steps}  train loss {float(loss):.4f}  "
                f"test acc {float(acc):.4f}",
                cfg.progress,
            )

    stats = optaxdist.comm_stats(opt_state)
    by_kind = {k: {"collectives": t.collectives, "bytes": t.bytes} for k, t in stats.by_kind.items()}
    fp32_bytes = payload_bytes(params0, jnp.float32) * cfg.steps
    compute_s = statistics.median(per_step_s) / n
    totals = {k: (t.collectives, t.bytes) for k, t in stats.by_kind.items()}
    comm_s = cost.comm_time_per_step(totals, cfg.steps, n, cfg.network, nodes=nodes)
    intra_bytes, inter_bytes = cost.split_bytes(totals, nodes)
    return {
        "algorithm": algo.name,
        "description": algo.description,
        "replicas": n,
        "batch_per_replica": batch,
        "steps": cfg.steps,
        "final_train_loss": curve["train_loss"][-1],
        "final_test_loss": curve["test_loss"][-1],
        "test_accuracy": curve["test_accuracy"][-1],
        "bytes_per_replica": stats.bytes,
        "intra_node_bytes_per_replica": intra_bytes,
        "inter_node_bytes_per_replica": inter_bytes,
        "collectives_per_replica": stats.collectives,
        "bytes_by_kind": by_kind,
        "reduction_vs_fp32": (fp32_bytes / stats.bytes) if stats.bytes else None,
        "compile_s": compile_s,
        "simulated_step_s": statistics.median(per_step_s),
        "compute_s_per_step": compute_s,
        "comm_s_per_step_model": comm_s,
        "modelled_s_per_step": compute_s + comm_s,
        "curve": curve,
    }


def evaluation_subset(n: int, limit: int = EVAL_LIMIT) -> np.ndarray:
    """The examples a loss or accuracy is measured on: all ``n`` up to ``limit``, else ``limit``
    of them evenly spaced (a large text corpus: a fixed sample of windows from all of it)."""
    return np.arange(n) if n <= limit else np.linspace(0, n - 1, limit).round().astype(np.int64)


def make_model(cfg: BenchConfig, data: Dataset) -> Any:
    """The MLP classifier, or the character transformer for the text datasets (token windows)."""
    if data.x_train.ndim == 2 and jnp.issubdtype(data.x_train.dtype, jnp.integer):
        width, layers, heads = cfg.transformer_shape
        return CharTransformer(
            data.num_classes, seq_len=data.x_train.shape[1], d_model=width, layers=layers, heads=heads
        )
    return MLP(cfg.hidden, data.num_classes)


def environment() -> dict[str, Any]:
    """Versions and hardware the numbers were measured on."""
    return {
        "jax": jax.__version__,
        "optax": optax.__version__,
        "optaxdist": optaxdist.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "cpu_count": os.cpu_count(),
        "host_malloc": host_malloc(),
    }


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run every algorithm of ``cfg``, print the table, write JSON (and plots) under ``cfg.out``.

    Returns:
      The JSON record: ``config``, ``environment``, ``dataset``, ``model``, ``cost_model``,
      ``results`` (one record per algorithm) and ``wall_s``.
    """
    t_start = time.perf_counter()
    data = load_dataset(cfg.dataset, seed=cfg.seed)  # type: ignore[arg-type]
    model = make_model(cfg, data)
    params0 = model.init(jax.random.key(cfg.seed), jnp.asarray(data.x_train[:1]))["params"]
    params0 = jax.tree.map(lambda x: x.astype(cfg.param_dtype), params0)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params0))
    link = cost.link_for(cfg.network, cfg.num_nodes)
    _log(
        f"optaxdist bench: {cfg.dataset} ({len(data.y_train)} train / {len(data.y_test)} test), "
        f"{type(model).__name__} ({n_params} params), {cfg.replicas} replicas, {cfg.shards} "
        f"shards, batch {cfg.batch_size}/replica, {cfg.steps} steps, {cfg.param_dtype} parameters",
        cfg.progress,
    )
    results = []
    for algo in get_algorithms(list(cfg.algorithms)):
        _log(f"[{algo.name}] compiling and training ...", cfg.progress)
        results.append(run_algorithm(cfg, data, algo, params0))
    record = {
        "config": dataclasses.asdict(cfg),
        "environment": environment(),
        "dataset": {
            "name": data.name,
            "train": len(data.y_train),
            "test": len(data.y_test),
            "features": int(data.x_train.shape[1]),
            "classes": data.num_classes,
        },
        "model": {
            "kind": type(model).__name__,
            **(
                {"width_layers_heads": list(cfg.transformer_shape)}
                if isinstance(model, CharTransformer)
                else {"hidden": list(cfg.hidden)}
            ),
            "parameters": n_params,
            "param_bytes_fp32": payload_bytes(params0, jnp.float32),
            "param_dtype": cfg.param_dtype,
        },
        "cost_model": {
            "network": link.name,
            "bandwidth_Bps": link.bandwidth,
            "latency_s": link.latency,
            "nodes": cfg.num_nodes,
            "requested_network": cfg.network,
        },
        "results": results,
    }
    record["wall_s"] = time.perf_counter() - t_start
    print(format_table(record))
    if cfg.out:
        paths = write_outputs(record, cfg.out, cfg.tag, plots=cfg.plots)
        _log("wrote " + ", ".join(paths), cfg.progress)
    return record


def write_outputs(record: dict[str, Any], out: str, tag: str, *, plots: bool = True) -> list[str]:
    """Write ``<out>/<tag>.json`` and, with ``plots``, the PNG figures; return the paths."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{tag}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    paths = [path]
    if plots:
        from optaxdist.bench.plots import plot_curves

        paths += plot_curves(record, out, tag)
    return paths


def _fmt_bytes(b: int) -> str:
    return f"{b / 1e6:.2f}" if b else "0"


def format_table(record: dict[str, Any]) -> str:
    """A Markdown table of ``record["results"]`` (also readable in a terminal)."""
    cm = record["cost_model"]
    net = f"{cm['network']}, {cm['nodes']} node{'s' if cm['nodes'] > 1 else ''}"
    header = [
        "algorithm",
        "train loss",
        "test loss",
        "test acc",
        "steps",
        "MB sent/replica",
        "inter-node MB",
        "vs fp32 AR",
        "compute ms/step (1 replica, est.)",
        f"comm ms/step (model, {net})",
        "modelled ms/step",
    ]
    rows = []
    for r in record["results"]:
        red = r["reduction_vs_fp32"]
        rows.append(
            [
                r["algorithm"],
                f"{r['final_train_loss']:.4f}",
                f"{r['final_test_loss']:.4f}",
                f"{r['test_accuracy']:.4f}",
                str(r["steps"]),
                _fmt_bytes(r["bytes_per_replica"]),
                _fmt_bytes(r.get("inter_node_bytes_per_replica", r["bytes_per_replica"])),
                "—" if red is None else f"{red:.2f}×",
                f"{r['compute_s_per_step'] * 1e3:.3f}",
                f"{r['comm_s_per_step_model'] * 1e3:.3f}",
                f"{r['modelled_s_per_step'] * 1e3:.3f}",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def parse_transformer(text: str | None) -> tuple[int, int, int] | None:
    """``"256,4,8"`` → ``(256, 4, 8)`` (width, layers, heads); None stays None."""
    if text is None:
        return None
    try:
        width, layers, heads = (int(s) for s in text.split(","))
    except ValueError:
        raise ValueError(f"--transformer {text!r} must be three ints: width,layers,heads") from None
    return width, layers, heads


def parse_hidden(text: str) -> tuple[int, ...]:
    """``"128,128"`` → ``(128, 128)``."""
    hidden = tuple(int(s) for s in text.split(",") if s.strip())
    if not hidden or min(hidden) < 1:
        raise ValueError(f"--hidden {text!r} must be a comma list of positive ints")
    return hidden


def as_tuple(names: str | Sequence[str]) -> tuple[str, ...]:
    """A comma list (or sequence) of names as a tuple."""
    if isinstance(names, str):
        return tuple(s.strip() for s in names.split(",") if s.strip())
    return tuple(names)
