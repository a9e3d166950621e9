"""Command line: ``optaxdist bench [options]``, or ``python -m optaxdist.bench [bench] [options]``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from optaxdist.bench import cost
from optaxdist.bench.algorithms import (
    ALGORITHM_GROUPS,
    ALGORITHMS,
    DEFAULT_ALGORITHMS,
    SCHEDULES,
    expand_names,
)
from optaxdist.bench.data import DATASETS, SHARDINGS
from optaxdist.bench.host_memory import HOST_MALLOC, keep_freed_memory
from optaxdist.bench.network import NETWORK_ROWS

SUBCOMMANDS = ("bench", "merge")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="optaxdist", description="optaxdist command line (see docs/benchmarks.md)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "bench",
        help="benchmark the registered algorithms",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Train a Flax MLP with N simulated replicas per algorithm and report loss, "
        "accuracy, bytes sent per replica, measured compute and modelled network time.",
    )
    b.add_argument(
        "--suite",
        choices=("train", "overhead", "compression-cost", "network", "sharded"),
        default="train",
        help="train: the algorithm table; overhead: allreduce+sgd vs lax.pmean+sgd, and the "
        "local/sync steps of the periodic-sync transforms (--rows); "
        "compression-cost: compression compute per step (one replica) vs PyTorch's "
        "powerSGD_hook, with the modelled comm time; network: jax.distributed processes in "
        "network namespaces on rate-limited links (root), measured step time and bytes on the wire; "
        "sharded: on 8 forced CPU devices, per-device bytes of params and state with the model "
        "split over |model| = 1, 2, 4 devices, and charlm training with FSDP inside 4 replicas vs "
        "simulate",
    )
    b.add_argument("--dataset", choices=DATASETS, default="digits")
    b.add_argument("--replicas", type=int, default=8, help="simulated replicas N")
    b.add_argument(
        "--shards",
        choices=SHARDINGS,
        default="iid",
        help="iid: random split; skewed: sorted by label, then split",
    )
    b.add_argument("--batch-size", type=int, default=32, help="minibatch per replica")
    b.add_argument(
        "--steps", type=int, default=None, help="train: 500; network: 40 (timed steps); sharded: 200"
    )
    b.add_argument("--lr", type=float, default=0.05)
    b.add_argument("--momentum", type=float, default=0.9, help="of the local optax.sgd (β₁ for adamw)")
    b.add_argument(
        "--optimizer",
        choices=("sgd", "adamw"),
        default="sgd",
        help="the local optimizer every algorithm wraps",
    )
    b.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="constant",
        help="learning rate of the local optimizer: constant, or linear warm-up over 5%% of the "
        "steps then cosine decay to lr/10",
    )
    b.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo rows: outer Nesterov SGD lr")
    b.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo rows: outer momentum")
    b.add_argument("--hidden", default="128,128", help="MLP hidden widths")
    b.add_argument(
        "--transformer",
        default=None,
        help="charlm, pysrc: the transformer's width, layers and heads, e.g. 256,4,8 (default: 64,2,4, "
        "117k parameters)",
    )
    b.add_argument(
        "--algorithms",
        default=None,
        # argparse %-formats help strings: names such as "topk-1%" need escaping
        help=(
            f"comma list of: {', '.join(ALGORITHMS)}; or groups: {', '.join(ALGORITHM_GROUPS)} "
            f"(each group = allreduce-fp32 + its rows). Default: train: {','.join(DEFAULT_ALGORITHMS)}; "
            f"network: {','.join(NETWORK_ROWS)}"
        ).replace("%", "%%"),
    )
    b.add_argument(
        "--network",
        choices=tuple(cost.NETWORKS),
        default="10GbE",
        help="link between nodes for the cost model",
    )
    b.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="nodes the replicas are spread over (default: one replica per node; "
        "1 = all on one node, modelled with nvlink)",
    )
    b.add_argument("--log-every", type=int, default=25, help="record the loss curve every k steps")
    b.add_argument(
        "--param-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the model's parameters (and gradients); outputs get a _bfloat16 suffix",
    )
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", default="bench_results", help="directory for JSON and PNG output")
    b.add_argument("--no-plots", action="store_true")
    b.add_argument("--quiet", action="store_true", help="no progress on stderr")
    b.add_argument("--list", action="store_true", help="list the algorithms and exit")
    o = b.add_argument_group("overhead suite")
    o.add_argument(
        "--backend",
        choices=("simulate", "mesh"),
        default="simulate",
        help="mesh: force --replicas host devices and time on_mesh too",
    )
    o.add_argument("--sizes", default=None, help="parameter counts (overhead: 1M,25M; compression-cost: 25M)")
    o.add_argument(
        "--rows",
        default="abstraction",
        help="comma list: abstraction (allreduce+sgd vs lax.pmean+sgd, over --sizes) and/or "
        "local-steps (local and sync step of every periodic-sync transform vs a plain optax step "
        "and the hand-written collective; compile time; state bytes per parameter byte)",
    )
    o.add_argument(
        "--replica-counts",
        default=None,
        help="local-steps rows: comma list of replica counts, e.g. 8,64,512 (default: --replicas "
        "and 512; parameters per replica: see --local-params)",
    )
    o.add_argument(
        "--harness",
        default=None,
        help="local-steps rows: comma list of simulate, mesh (default: simulate, plus mesh with "
        "--backend mesh); mesh forces max(8, --replicas) host devices and runs only the replica "
        "counts that fit",
    )
    o.add_argument(
        "--transforms",
        default=None,
        help="local-steps rows: comma list of local_sgd, diloco, slowmo, streaming_diloco, "
        "decentralized_sgd, sgp, daso (default: all); sharded suite, memory rows: comma list of "
        "allreduce, topk-1%%-ef, powersgd-r2, diloco-2 (default: all)",
    )
    o.add_argument(
        "--variants",
        default="default",
        help="local-steps rows: comma list of default, no-start-check (check_start=False), "
        "nonfinite-ignore (nonfinite='ignore'), no-exact-sync (exact_sync=False), bare (all three "
        "off): the transforms' options",
    )
    o.add_argument(
        "--donate",
        action="store_true",
        help="local-steps rows: every step (the transforms', the plain and the hand-written ones) "
        "donates its parameters and state (donate_argnums=(0, 1)), as a training loop does; each "
        "row's calls carry on from the arrays its last call returned, each timed call after the "
        "untimed step a training loop makes before it; also times 8 local steps in a row",
    )
    o.add_argument(
        "--host-malloc",
        choices=HOST_MALLOC,
        default="system",
        help="the process's C allocator: system (as configured) or keep (glibc keeps what it "
        "frees: a call's scratch reuses pages already mapped instead of faulting in fresh ones, "
        "as a GPU's pool does; see docs/benchmarks.md)",
    )
    o.add_argument(
        "--split-local-steps",
        action="store_true",
        help="local-steps rows: the transforms' steps run under split_local_steps=True (the "
        "harness compiles their local steps as a program of their own); needs --donate",
    )
    o.add_argument(
        "--local-params",
        default=None,
        help="local-steps rows: parameters per replica, e.g. 100K (default: 100K up to 64 "
        "replicas, 10K above)",
    )
    o.add_argument(
        "--local-leaves",
        type=int,
        default=4,
        help="local-steps rows: the parameters' arrays per replica, square matrices of one size "
        "(default 4; a model's layers make tens to hundreds; not with --local-model mlp)",
    )
    o.add_argument(
        "--local-model",
        default="none",
        help="local-steps rows: where a step's gradients come from: none (given, random: the "
        "optimizer's own cost, default) or mlp (each step takes the gradient of an MLP "
        "64 → w → w → 10 of about --local-params parameters on 32 scikit-learn digits per "
        "replica: a training step)",
    )
    o.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed runs per measurement (overhead: 11; compression-cost: 7)",
    )
    n = b.add_argument_group(
        "network suite (also uses --algorithms, --steps, --hidden, --dataset, --lr, --seed)"
    )
    n.add_argument("--net-nodes", default="2", help="comma list of node counts (one network namespace each)")
    n.add_argument(
        "--layouts",
        default="distributed",
        help="comma list of: distributed (jax.distributed, one process per node, on_mesh), mpi (one "
        "MPI rank per device, on_mpi; MPICH over TCP between the namespaces), node (one MPI rank per "
        "node with --devices-per-node CPU devices, node_hierarchy + on_node)",
    )
    n.add_argument("--devices-per-node", type=int, default=1, help="CPU devices (mpi: ranks) per node")
    n.add_argument(
        "--rates", default="1000", help="comma list of link rates in Mbit/s (tc tbf, each direction)"
    )
    n.add_argument(
        "--loopback",
        action="store_true",
        help="no namespaces: processes on 127.0.0.1, unshaped (the default when not root)",
    )
    n.add_argument("--no-calibrate", action="store_true", help="skip the collectives micro-benchmark")
    n.add_argument("--timeout", type=float, default=1800.0, help="seconds per (processes, rate) run")
    c = b.add_argument_group(
        "compression-cost suite (also uses --sizes, --repeats, --replicas, --network, --nodes, --seed)"
    )
    c.add_argument(
        "--matrices",
        type=int,
        default=5,
        help="square float32 matrices (each with a bias vector) making up the model",
    )
    c.add_argument("--warmup", type=int, default=3, help="untimed calls before timing (≥ 1)")
    c.add_argument(
        "--max-call-s",
        type=float,
        default=10.0,
        help="a variant whose first call takes longer is reported with that call only",
    )
    c.add_argument(
        "--no-torch", action="store_true", help="skip PyTorch's powerSGD_hook even if torch is installed"
    )
    c.add_argument(
        "--torch-threads", type=int, default=None, help="torch.set_num_threads (default: os.cpu_count())"
    )
    sh = b.add_argument_group(
        "sharded suite (also uses --sizes, --transforms, --algorithms, --steps, --batch-size, "
        "--optimizer, --lr, --momentum, --outer-lr, --outer-momentum, --seed)"
    )
    sh.add_argument(
        "--parts",
        default="memory,training",
        help="comma list of memory (per-device bytes vs |model|; --sizes: parameters of its model, "
        "default 1M) and training (charlm on a (replica, fsdp) 4 x 2 mesh vs simulate; "
        "--algorithms: registry rows, default diloco-50-topk10%%,powersgd-r2)",
    )
    sh.add_argument("--model-sizes", default="1,2,4", help="memory part: |model| values (2 replicas each)")
    sh.add_argument("--d-model", type=int, default=64, help="training part: transformer width")
    sh.add_argument("--layers", type=int, default=2, help="training part: transformer blocks")
    sh.add_argument("--heads", type=int, default=4, help="training part: attention heads")
    m = sub.add_parser(
        "merge",
        help="one table and one set of figures from train records run apart",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Merge the JSON records of `optaxdist bench` runs of the same experiment (same "
        "data, model, configuration, cost model and platform; one or more algorithms each) into "
        "one record: print its table, write its JSON and figures.",
    )
    m.add_argument("records", nargs="+", help="bench_<dataset>_<shards>.json files, rows in this order")
    m.add_argument("--out", required=True, help="directory for the merged JSON and PNG output")
    m.add_argument("--tag", default=None, help="file name stem (default: the first record's file name)")
    m.add_argument("--no-plots", action="store_true")
    return parser


def _force_host_devices(n: int) -> None:
    """Ask XLA for ``n`` CPU devices; effective if no JAX backend has been initialised yet.

    The flag configures the CPU (host) platform only: on a GPU the default backend, and so the
    mesh harness, still sees the GPUs (and a mesh row needing more devices than exist is skipped).
    Nothing is set when ``JAX_PLATFORMS`` excludes the CPU.
    """
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and "cpu" not in platforms.split(","):
        return
    flag = f"--xla_force_host_platform_device_count={n}"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


def _comma_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _overhead_options(args: argparse.Namespace) -> tuple[list[str], dict]:
    """The overhead suite's rows and the options of its local-steps rows (``ValueError`` if bad).

    Starts no JAX backend: the mesh harness must force its host devices first.
    """
    from optaxdist.bench.local_steps import MODELS, TRANSFORMS, VARIANTS
    from optaxdist.bench.overhead import parse_size

    rows = _comma_list(args.rows)
    allowed_rows = ("abstraction", "local-steps")
    if not rows or any(r not in allowed_rows for r in rows):
        raise ValueError(f"--rows {args.rows!r}: comma list of {', '.join(allowed_rows)}")
    try:
        counts = [int(c) for c in _comma_list(args.replica_counts or f"{args.replicas},512")]
    except ValueError:
        raise ValueError(f"--replica-counts {args.replica_counts!r}: comma list of ints") from None
    counts = list(dict.fromkeys(counts))  # in order, without repeats
    if not counts or min(counts) < 2:
        raise ValueError(f"--replica-counts {args.replica_counts!r}: every count must be ≥ 2")
    default_harness = "simulate,mesh" if args.backend == "mesh" else "simulate"
    harnesses = _comma_list(args.harness or default_harness)
    if not harnesses or any(h not in ("simulate", "mesh") for h in harnesses):
        raise ValueError(f"--harness {args.harness!r}: comma list of simulate, mesh")
    local_steps: dict = {"replica_counts": counts, "harnesses": harnesses}
    if args.transforms:
        transforms = _comma_list(args.transforms)
        if not transforms or any(t not in TRANSFORMS for t in transforms):
            raise ValueError(f"--transforms {args.transforms!r}: comma list of {', '.join(TRANSFORMS)}")
        local_steps["transforms"] = transforms
    variants = _comma_list(args.variants)
    if not variants or any(v not in VARIANTS for v in variants):
        raise ValueError(f"--variants {args.variants!r}: comma list of {', '.join(VARIANTS)}")
    local_steps["variants"] = variants
    if args.local_params:
        local_steps["n_params"] = parse_size(args.local_params)
    if args.local_leaves < 1:
        raise ValueError(f"--local-leaves {args.local_leaves}: at least 1")
    local_steps["leaves"] = args.local_leaves
    if args.local_model not in MODELS:
        raise ValueError(f"--local-model {args.local_model!r}: one of {', '.join(MODELS)}")
    if args.local_model == "mlp" and args.local_leaves != 4:
        raise ValueError(
            f"--local-leaves {args.local_leaves}: only with --local-model none (the MLP has its own)"
        )
    local_steps["model"] = args.local_model
    if args.donate:
        local_steps["donate"] = True
    if args.split_local_steps:
        if not args.donate:
            raise ValueError("--split-local-steps needs --donate (local steps are timed in a chain of calls)")
        local_steps["split"] = True
    return rows, local_steps


def _write_json(args: argparse.Namespace, name: str, record: object) -> None:
    """``record`` as ``<--out>/<name>`` (nothing without ``--out``)."""
    if not args.out:
        return
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, name)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    if not args.quiet:
        print(f"wrote {path}", file=sys.stderr)


def _compression_cost(args: argparse.Namespace) -> int:
    from optaxdist.bench.compression_cost import run_compression_cost
    from optaxdist.bench.overhead import parse_size
    from optaxdist.bench.run import environment

    records = []
    for size in [parse_size(s) for s in (args.sizes or "25M").split(",") if s.strip()]:
        rec = run_compression_cost(
            size,
            matrices=args.matrices,
            replicas=args.replicas,
            network=args.network,
            nodes=args.nodes,
            warmup=args.warmup,
            repeats=args.repeats or 7,
            use_torch=not args.no_torch,
            torch_threads=args.torch_threads,
            seed=args.seed,
            max_call_s=args.max_call_s,
            progress=not args.quiet,
        )
        rec["environment"] = environment()
        records.append(rec)
    _write_json(args, "compression_cost.json", records)
    return 0


def _network(args: argparse.Namespace) -> int:
    from optaxdist.bench.netns import have_netns
    from optaxdist.bench.network import NetworkConfig, run_network_suite
    from optaxdist.bench.run import parse_hidden

    loopback = args.loopback
    if not loopback and (reason := have_netns()):
        print(f"optaxdist bench: {reason}: running on the loopback, unshaped", file=sys.stderr)
        loopback = True
    try:
        cfg = NetworkConfig(
            nodes=tuple(int(p) for p in _comma_list(args.net_nodes)),
            layouts=tuple(_comma_list(args.layouts)),
            devices_per_node=args.devices_per_node,
            rates_mbit=tuple(float(r) for r in _comma_list(args.rates)),
            rows=expand_names(args.algorithms) if args.algorithms else NETWORK_ROWS,
            steps=args.steps or 40,
            lr=args.lr,
            momentum=args.momentum,
            hidden=parse_hidden(args.hidden) if args.hidden != "128,128" else (1024, 1024),
            dataset=args.dataset if args.dataset != "digits" else "mnist",
            seed=args.seed,
            calibrate=not args.no_calibrate,
            loopback=loopback,
            timeout_s=args.timeout,
            out=args.out or "",
            plots=not args.no_plots,
            progress=not args.quiet,
        )
    except ValueError as e:
        print(f"optaxdist bench: error: {e}", file=sys.stderr)
        return 2
    run_network_suite(cfg)
    return 0


def _sharded(args: argparse.Namespace) -> int:
    from optaxdist.bench.sharded import MEMORY_TRANSFORMS, TRAIN_ALGORITHMS, check_training_algorithms

    try:
        parts = _comma_list(args.parts)
        if not parts or any(p not in ("memory", "training") for p in parts):
            raise ValueError(f"--parts {args.parts!r}: comma list of memory, training")
        try:
            sizes = [int(m) for m in _comma_list(args.model_sizes)]
        except ValueError:
            sizes = []
        if not sizes or min(sizes) < 1:
            raise ValueError(f"--model-sizes {args.model_sizes!r}: comma list of positive ints")
        transforms = _comma_list(args.transforms) if args.transforms else list(MEMORY_TRANSFORMS)
        if not transforms or any(t not in MEMORY_TRANSFORMS for t in transforms):
            raise ValueError(
                f"--transforms {args.transforms!r}: comma list of {', '.join(MEMORY_TRANSFORMS)}"
            )
        algorithms = expand_names(args.algorithms) if args.algorithms else TRAIN_ALGORITHMS
        check_training_algorithms(algorithms)
    except ValueError as e:
        print(f"optaxdist bench: error: {e}", file=sys.stderr)
        return 2
    _force_host_devices(8)  # before the first JAX computation
    import jax

    from optaxdist.bench.overhead import parse_size
    from optaxdist.bench.run import environment
    from optaxdist.bench.sharded import format_tables, run_memory, run_training

    if len(jax.devices()) < 8:
        print(
            f"optaxdist bench: error: the sharded suite needs 8 devices, JAX has {len(jax.devices())} "
            "(XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before JAX starts)",
            file=sys.stderr,
        )
        return 2
    record: dict = {}
    if "memory" in parts:
        record["memory"] = [
            run_memory(
                parse_size(size),
                model_sizes=sizes,
                transforms=transforms,
                progress=not args.quiet,
            )
            for size in _comma_list(args.sizes or "1M")
        ]
    if "training" in parts:
        record["training"] = run_training(
            algorithms,
            steps=args.steps or 200,
            batch_size=args.batch_size,
            optimizer=args.optimizer,
            lr=args.lr,
            momentum=args.momentum,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            d_model=args.d_model,
            layers=args.layers,
            heads=args.heads,
            seed=args.seed,
            progress=not args.quiet,
        )
    record["environment"] = environment()
    print(format_tables(record))
    _write_json(args, "sharded.json", record)
    return 0


def _merge(args: argparse.Namespace) -> int:
    from optaxdist.bench.merge import load, merge_records
    from optaxdist.bench.run import format_table, write_outputs

    try:
        record = merge_records(load(args.records), names=args.records)
    except (OSError, ValueError) as e:
        print(f"optaxdist merge: error: {e}", file=sys.stderr)
        return 2
    tag = args.tag or os.path.splitext(os.path.basename(args.records[0]))[0]
    target = os.path.realpath(os.path.join(args.out, f"{tag}.json"))
    if target in {os.path.realpath(p) for p in args.records}:
        print(f"optaxdist merge: error: --out/--tag would overwrite the input {target}", file=sys.stderr)
        return 2
    print(format_table(record))
    paths = write_outputs(record, args.out, tag, plots=not args.no_plots)
    print("wrote " + ", ".join(paths), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``optaxdist`` console script and of ``python -m optaxdist.bench``.

    With no subcommand (or options only) it runs ``bench``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:  # `bench` is the default (and --help its help)
        argv = ["bench", *argv]
    args = _parser().parse_args(argv)
    if args.command == "merge":
        return _merge(args)

    if args.host_malloc != "system" and args.suite != "overhead":
        error = f"--host-malloc {args.host_malloc} applies to --suite overhead only"
        print(f"optaxdist bench: error: {error}", file=sys.stderr)
        return 2

    if args.list:
        for a in ALGORITHMS.values():
            print(f"{a.name:<16} {a.description}")
        for g, names in ALGORITHM_GROUPS.items():
            print(f"group {g:<10} {', '.join(names)}")
        return 0

    if args.suite == "compression-cost":
        return _compression_cost(args)

    if args.suite == "network":
        return _network(args)

    if args.suite == "sharded":
        return _sharded(args)

    if args.suite == "overhead":
        try:
            rows, local_steps = _overhead_options(args)
        except ValueError as e:
            print(f"optaxdist bench: error: {e}", file=sys.stderr)
            return 2
        if args.backend == "mesh" or "mesh" in local_steps["harnesses"]:
            _force_host_devices(max(args.replicas, 8))  # before the first JAX computation
        if args.host_malloc == "keep":
            try:
                keep_freed_memory()
            except RuntimeError as e:
                print(f"optaxdist bench: error: {e}", file=sys.stderr)
                return 2
        from optaxdist.bench.overhead import parse_size, run_overhead

        sizes = [parse_size(s) for s in (args.sizes or "1M,25M").split(",") if s.strip()]
        harnesses = ("simulate", "mesh") if args.backend == "mesh" else ("simulate",)
        record = run_overhead(
            sizes,
            replicas=args.replicas,
            harnesses=harnesses,
            repeats=args.repeats or 11,
            progress=not args.quiet,
            rows=rows,
            local_steps=local_steps,
        )
        from optaxdist.bench.run import environment

        record["environment"] = environment()
        _write_json(args, f"overhead_{args.backend}.json", record)
        return 0

    from optaxdist.bench.run import BenchConfig, parse_hidden, parse_transformer, run_bench

    try:
        cfg = BenchConfig(
            dataset=args.dataset,
            replicas=args.replicas,
            shards=args.shards,
            batch_size=args.batch_size,
            steps=args.steps or 500,
            lr=args.lr,
            momentum=args.momentum,
            optimizer=args.optimizer,
            schedule=args.schedule,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            hidden=parse_hidden(args.hidden),
            transformer=parse_transformer(args.transformer),
            param_dtype=args.param_dtype,
            algorithms=expand_names(args.algorithms or ",".join(DEFAULT_ALGORITHMS)),
            network=args.network,
            nodes=args.nodes,
            log_every=args.log_every,
            seed=args.seed,
            out=args.out or None,
            plots=not args.no_plots,
            progress=not args.quiet,
        )
    except ValueError as e:
        print(f"optaxdist bench: error: {e}", file=sys.stderr)
        return 2
    run_bench(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
