"""The benchmark harness: a tiny in-process run, its JSON record, and the network cost model.

Timings are never asserted (benchmarks are not tests); only structure and exact byte counts are.
"""

import dataclasses
import functools
import json
import operator
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from optaxdist.accounting import Kind
from optaxdist.bench import cost, local_steps
from optaxdist.bench import models as bench_models
from optaxdist.bench.__main__ import main
from optaxdist.bench.data import load_dataset, make_shards

STEPS, REPLICAS = 20, 2


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = main(
        [
            "bench",
            "--algorithms",
            "allreduce-fp32,allreduce-bf16",
            "--steps",
            str(STEPS),
            "--replicas",
            str(REPLICAS),
            "--log-every",
            "10",
            "--hidden",
            "16",
            "--out",
            str(out),
            "--quiet",
            "--network",
            "100Gb",
        ]
    )
    assert rc == 0
    with open(out / "bench_digits_iid.json") as f:
        rec = json.load(f)
    rec["_out"] = out
    return rec


def test_record_fields(record):
    assert {"config", "environment", "dataset", "model", "cost_model", "results"} <= set(record)
    assert [r["algorithm"] for r in record["results"]] == ["allreduce-fp32", "allreduce-bf16"]
    for r in record["results"]:
        for field in (
            "final_train_loss",
            "final_test_loss",
            "test_accuracy",
            "steps",
            "bytes_per_replica",
            "reduction_vs_fp32",
            "compute_s_per_step",
            "comm_s_per_step_model",
            "modelled_s_per_step",
            "curve",
        ):
            assert field in r
        assert r["steps"] == STEPS
        assert np.isfinite(r["final_train_loss"]) and np.isfinite(r["final_test_loss"])
        assert r["curve"]["step"] == [0, 10, 20]
        assert len(r["curve"]["train_loss"]) == len(r["curve"]["test_loss"]) == 3
        assert r["curve"]["test_loss"][-1] < r["curve"]["test_loss"][0]
    assert record["cost_model"]["network"] == "100Gb"
    for name in ("loss_vs_step", "loss_vs_bytes", "loss_vs_modelled_time"):
        assert (record["_out"] / f"bench_digits_iid_{name}.png").stat().st_size > 0


def test_bytes_match_formula(record):
    # MLP 64 -> 16 -> 10: one all-reduce of every parameter per step.
    n_params = 64 * 16 + 16 + 16 * 10 + 10
    assert record["model"]["parameters"] == n_params
    fp32, bf16 = record["results"]
    assert fp32["bytes_per_replica"] == 4 * n_params * STEPS
    assert fp32["bytes_by_kind"] == {
        "all_reduce[float32]": {"collectives": STEPS, "bytes": 4 * n_params * STEPS}
    }
    assert bf16["bytes_per_replica"] == 2 * n_params * STEPS
    assert fp32["curve"]["bytes"] == [0, 4 * n_params * 10, 4 * n_params * 20]
    assert fp32["reduction_vs_fp32"] == 1.0
    assert bf16["reduction_vs_fp32"] == 2.0


def test_modelled_time_is_compute_plus_ring_allreduce(record):
    net = cost.NETWORKS["100Gb"]
    for r in record["results"]:
        per_event = r["bytes_per_replica"] / STEPS
        n = REPLICAS
        expected = 2 * (n - 1) / n * per_event / net.bandwidth + 2 * (n - 1) * net.latency
        assert r["comm_s_per_step_model"] == pytest.approx(expected, rel=1e-12)
        assert r["modelled_s_per_step"] == pytest.approx(r["compute_s_per_step"] + expected, rel=1e-12)


@pytest.mark.parametrize("network", ["10GbE", "100Gb", "400Gb", "nvlink"])
@pytest.mark.parametrize("n", [2, 8, 64])
def test_ring_allreduce_formula(network, n):
    net = cost.NETWORKS[network]
    s = 26_122 * 4
    expected = 2 * (n - 1) / n * s / net.bandwidth + 2 * (n - 1) * net.latency
    kinds = (
        Kind("all_reduce", "float32"),
        Kind("all_reduce", "bfloat16", label="param_average"),
        Kind("all_reduce", "int32", label="agree"),
        "all_reduce",
    )
    for kind in kinds:
        assert cost.collective_time(kind, s, n, network) == pytest.approx(expected, rel=1e-12)


def test_step_time_hides_overlapped_collectives_behind_the_computation():
    net = cost.NETWORKS["10GbE"]
    plain = Kind("all_reduce", "float32")
    hidden = Kind("all_reduce", "float32", label="overlapped_all_reduce")
    t = cost.collective_time(plain, 1e6, 4, net)
    assert cost.step_time(0.0, {plain: (1, 10**6)}, 1, 4, net) == pytest.approx(t)
    assert cost.step_time(t / 2, {plain: (1, 10**6)}, 1, 4, net) == pytest.approx(1.5 * t)
    assert cost.step_time(t / 2, {hidden: (1, 10**6)}, 1, 4, net) == pytest.approx(t)
    assert cost.step_time(2 * t, {hidden: (1, 10**6), plain: (1, 10**6)}, 1, 4, net) == pytest.approx(3 * t)


def test_cost_model_constants_and_edge_cases():
    assert cost.NETWORKS["10GbE"].bandwidth == 1.25e9
    assert cost.NETWORKS["nvlink"].bandwidth == 450e9
    net = cost.NETWORKS["10GbE"]
    assert cost.collective_time(Kind("all_gather", "float32"), 1000, 4, net) == pytest.approx(
        3 * 1000 / net.bandwidth + 3 * net.latency
    )
    assert cost.collective_time(Kind("permute", "float32"), 1000, 4, net) == pytest.approx(
        1000 / net.bandwidth + net.latency
    )
    assert cost.collective_time(Kind("all_reduce", "float32"), 10**6, 1, net) == 0.0
    assert cost.link_for("10GbE", 1).name == "nvlink"
    assert cost.link_for("10GbE", 2).name == "10GbE"
    with pytest.raises(ValueError, match="no cost model"):
        cost.collective_time("teleport", 10, 2, net)
    with pytest.raises(ValueError, match="network"):
        cost.get_network("carrier-pigeon")


def test_shards():
    data = load_dataset("digits")
    assert len(data.y_train) + len(data.y_test) == 1797
    iid = make_shards(data.y_train, 8, "iid")
    skewed = make_shards(data.y_train, 8, "skewed")
    assert iid.shape == skewed.shape == (8, len(data.y_train) // 8)
    assert len(np.unique(iid)) == iid.size
    assert max(len(np.unique(data.y_train[s])) for s in skewed) <= 3
    assert min(len(np.unique(data.y_train[s])) for s in iid) == 10


def test_cli_rejects_unknown_algorithm(capsys):
    assert main(["--algorithms", "nope", "--quiet", "--out", ""]) == 2
    assert "unknown algorithms" in capsys.readouterr().err


def test_algorithm_groups_expand():
    from optaxdist.bench.algorithms import (
        ALGORITHMS,
        COMPRESSION_ALGORITHMS,
        DEFAULT_ALGORITHMS,
        expand_names,
        get_algorithms,
    )

    comp = expand_names("compression")
    assert comp[0] == "allreduce-fp32"
    assert comp[1:] == tuple(a.name for a in COMPRESSION_ALGORITHMS)
    assert {"powersgd-r1", "powersgd-r2", "powersgd-r4", "powersgd-r2-noef"} <= set(comp)
    assert expand_names("default") == DEFAULT_ALGORITHMS
    assert expand_names("single,default") == DEFAULT_ALGORITHMS  # duplicates dropped
    assert [a.name for a in get_algorithms("all")] == list(ALGORITHMS)


def test_powersgd_rows_bytes_match_formula(tmp_path):
    """The row without error feedback (its only use in the default run); the row with it sends the
    same bytes (test_powersgd: test_accounting_equals_formula_and_compiled_hlo)."""
    steps = 10
    rc = main(
        [
            "bench",
            "--algorithms",
            "powersgd-r2-noef",
            "--steps",
            str(steps),
            "--replicas",
            str(REPLICAS),
            "--log-every",
            "10",
            "--hidden",
            "16",
            "--out",
            str(tmp_path),
            "--no-plots",
            "--quiet",
        ]
    )
    assert rc == 0
    with open(tmp_path / "bench_digits_iid.json") as f:
        rec = json.load(f)
    # MLP 64 -> 16 -> 10, rank 2: both kernels pass (n + m)·2·2 < n·m; biases travel exactly.
    p, q, exact = 64 * 2 + 16 * 2, 16 * 2 + 10 * 2, 16 + 10
    for r in rec["results"]:
        assert r["bytes_by_kind"] == {
            "powersgd_p[float32]": {"collectives": steps, "bytes": 4 * p * steps},
            "powersgd_q[float32]": {"collectives": steps, "bytes": 4 * q * steps},
            "all_reduce[float32]": {"collectives": steps, "bytes": 4 * exact * steps},
        }
        assert r["bytes_per_replica"] == 4 * (p + q + exact) * steps
        assert np.isfinite(r["final_train_loss"])


def test_compression_cost_suite_without_torch(monkeypatch, capsys):
    import sys

    from optaxdist.bench.compression_cost import format_compression_cost, run_compression_cost

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    rec = run_compression_cost(
        2000,
        transforms=("allreduce-fp32", "topk-1%-ef"),
        ranks=(2,),
        warmup=1,
        repeats=2,
        replicas=8,
        network="10GbE",
    )
    captured = capsys.readouterr()
    assert "torch is not installed" in captured.err
    assert "powersgd-r2" in captured.out
    by_name = {r["name"]: r for r in rec["results"]}
    assert set(by_name) == {
        "allreduce-fp32",
        "topk-1%-ef",
        "powersgd-r2",
        "powersgd-r2-unbatched",
        "powersgd-r2 (state not donated)",
    }
    assert rec["model"]["parameters"] == 5 * 20 * 20 + 5 * 20
    # five 20×20 matrices at rank 2 (P and Q: 20·2 each) and five exact 20-vectors.
    assert by_name["powersgd-r2"]["bytes_per_step"] == 4 * (5 * (40 + 40) + 5 * 20)
    assert by_name["allreduce-fp32"]["bytes_per_step"] == 4 * 2100
    assert by_name["topk-1%-ef"]["bytes_per_step"] == 8 * 21  # floor(1% of 2100) (index, value)
    net = cost.NETWORKS["10GbE"]
    assert by_name["allreduce-fp32"]["comm_s_model"] == pytest.approx(
        2 * 7 / 8 * 8400 / net.bandwidth + 14 * net.latency
    )
    assert len(by_name["powersgd-r2"]["compute_all_s"]) == 2
    assert rec["powersgd"][0]["rank"] == 2 and "torch_s" not in rec["powersgd"][0]
    assert "| 2 |" in format_compression_cost(rec)


def test_help_lists_the_bench_options(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--algorithms" in out and "topk-1%" in out and "--network" in out


def test_cli_rejects_bad_schedule_and_outer_settings(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--schedule", "linear", "--quiet", "--out", ""])
    assert info.value.code == 2
    assert "--schedule" in capsys.readouterr().err
    assert main(["--outer-momentum", "1.0", "--quiet", "--out", ""]) == 2
    assert "outer_momentum=1.0 must be in [0, 1)" in capsys.readouterr().err
    assert main(["--outer-lr", "0", "--quiet", "--out", ""]) == 2
    assert "outer_lr=0.0 must be > 0" in capsys.readouterr().err


def test_bfloat16_parameters_halve_the_bytes_of_a_parameter_dtype_wire(tmp_path, capsys):
    """--param-dtype bfloat16: parameters and gradients in bfloat16; param-avg's wire is the
    parameters' dtype, so it sends half the float32 reference's bytes; outputs get a suffix."""
    argv = ["bench", "--algorithms", "param-avg", "--steps", "2", "--log-every", "2", "--hidden", "8"]
    argv += [
        "--replicas",
        str(REPLICAS),
        "--param-dtype",
        "bfloat16",
        "--out",
        str(tmp_path),
        "--no-plots",
        "--quiet",
    ]
    assert main(argv) == 0
    with open(tmp_path / "bench_digits_iid_bfloat16.json") as f:
        rec = json.load(f)
    assert rec["model"]["param_dtype"] == "bfloat16"
    assert rec["results"][0]["bytes_per_replica"] == 2 * rec["model"]["param_bytes_fp32"] // 2
    assert rec["results"][0]["reduction_vs_fp32"] == 2.0
    with pytest.raises(SystemExit):
        main(["bench", "--param-dtype", "float16", "--quiet", "--out", ""])
    assert "--param-dtype: invalid choice: 'float16'" in capsys.readouterr().err


def test_learning_rate_schedule():
    from optaxdist.bench.algorithms import learning_rate_schedule

    assert learning_rate_schedule(0.1, "constant", 100) == 0.1
    sched = learning_rate_schedule(0.1, "warmup-cosine", 200)
    np.testing.assert_allclose([sched(0), sched(5), sched(10), sched(200)], [0.0, 0.05, 0.1, 0.01], rtol=1e-6)
    assert 0.01 < sched(105) < 0.1
    with pytest.raises(ValueError, match="schedule='step'; allowed"):
        learning_rate_schedule(0.1, "step", 100)


def test_diloco_rows_use_the_outer_settings():
    import jax.numpy as jnp

    import optaxdist
    from optaxdist.bench.algorithms import BenchContext

    ctx = BenchContext(2, optaxdist.axis_hierarchy(1, 2), 10, 0.1)
    custom = ctx._replace(outer_lr=1.0, outer_momentum=0.0)
    g = {"w": jnp.ones(3)}
    for c, expected in ((ctx, -0.7 * 1.9), (custom, -1.0)):  # Nesterov: -lr·(1 + μ)·g on step 1
        tx = c.diloco_outer()
        u, _ = tx.update(g, tx.init(g))
        np.testing.assert_allclose(u["w"], expected, rtol=1e-6)


def test_charlm_windows():
    from optaxdist.bench.charlm import load_charlm, pydoc_text

    data = load_charlm(seq_len=32)
    text = pydoc_text()
    n = len(text) // 33
    assert len(data.y_train) + len(data.y_test) == n
    assert len(data.y_test) == round(0.1 * n)
    np.testing.assert_array_equal(data.x_train[:, 1:], data.y_train[:, :-1])  # y is x shifted by one
    vocab = sorted(set(text))
    assert data.num_classes == len(vocab)
    assert "".join(vocab[i] for i in data.x_train[0]) == text[:32]


def test_pysrc_is_the_standard_librarys_source_without_tests():
    from optaxdist.bench.charlm import OTHER, load_charlm, stdlib_source_text

    text = stdlib_source_text()
    assert len(text) > 5_000_000 and "def " in text and "import unittest" in text
    assert set(text) <= {chr(c) for c in range(32, 127)} | {"\n", "\t", OTHER}
    data = load_charlm(seq_len=32, corpus="pysrc")
    assert data.name.startswith("pysrc[") and len(data.y_train) + len(data.y_test) == len(text) // 33
    vocab = sorted(set(text))
    assert "".join(vocab[i] for i in data.x_train[0]) == text[:32]


@pytest.mark.parametrize("labels", ["sequence", "class"])
def test_evaluation_in_batches_is_the_whole_set_mean(labels):
    import flax.linen as nn

    from optaxdist.bench.models import accuracy, cross_entropy, evaluate_in_batches

    rng = np.random.default_rng(0)
    if labels == "sequence":  # token windows, a label per position
        x, y = rng.integers(0, 11, (37, 8)).astype(np.int32), rng.integers(0, 11, (37, 8)).astype(np.int32)
        model = nn.Sequential([nn.Embed(11, 4), nn.Dense(11)])
    else:  # features, one label per example
        x, y = rng.normal(size=(37, 5)).astype(np.float32), rng.integers(0, 11, 37).astype(np.int32)
        model = nn.Dense(11)
    params = model.init(jax.random.key(0), x[:1])["params"]
    loss, acc = evaluate_in_batches(model, params, x, y, batch=16)  # 3 batches, the last padded
    np.testing.assert_allclose(loss, cross_entropy(model, params, x, y), rtol=1e-6)
    np.testing.assert_allclose(acc, accuracy(model, params, x, y), rtol=1e-6)
    assert 0 < acc < 1


def test_losses_are_measured_on_an_evenly_spaced_sample_of_a_large_set():
    from optaxdist.bench.run import EVAL_LIMIT, evaluation_subset

    np.testing.assert_array_equal(evaluation_subset(6439), np.arange(6439))  # charlm: every window
    sample = evaluation_subset(167_797)
    assert len(sample) == len(set(sample)) == EVAL_LIMIT and sample[0] == 0 and sample[-1] == 167_796
    assert np.ptp(np.diff(sample)) <= 1


@pytest.mark.slow  # 47 s, mostly compiling the transformer; the MLP rows above run the same harness
def test_charlm_short_run(tmp_path):
    # optax's Adam bias correction raises a Python float to an int32 power: not strict-promotion clean.
    with jax.numpy_dtype_promotion("standard"):
        args = "--dataset charlm --optimizer adamw --lr 3e-3 --schedule warmup-cosine --algorithms diloco-50"
        args += " --steps 50 --replicas 2 --batch-size 2 --log-every 50 --no-plots --quiet"
        rc = main(["bench", *args.split(), "--out", str(tmp_path)])
    assert rc == 0
    with open(tmp_path / "bench_charlm_iid.json") as f:
        rec = json.load(f)
    assert rec["config"]["schedule"] == "warmup-cosine"
    (dl,) = rec["results"]
    p = rec["model"]["parameters"]
    assert dl["bytes_by_kind"]["all_reduce[float32]"] == {"collectives": 1, "bytes": 4 * p}
    assert dl["curve"]["test_loss"][-1] < dl["curve"]["test_loss"][0]


def test_charlm_transformer_size(capsys):
    from optaxdist.bench.run import BenchConfig, make_model

    data = load_dataset("charlm", seed=0)
    cfg = BenchConfig(dataset="charlm", transformer=(32, 3, 2), algorithms=("allreduce-fp32",), out=None)
    model = make_model(cfg, data)
    params = jax.eval_shape(model.init, jax.random.key(0), data.x_train[:1])  # shapes: nothing compiled
    d, layers, vocab, window = 32, 3, data.num_classes, data.x_train.shape[1]
    block = 2 * (2 * d) + 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)  # 2 norms, attention, MLP
    want = vocab * d + window * d + layers * block + 2 * d + d * vocab + vocab
    assert sum(x.size for x in jax.tree.leaves(params)) == want
    for bad, message in (
        ("32,3", "three ints"),
        ("32,3,5", "heads must divide the width"),
        ("0,1,1", "positive"),
    ):
        assert main(["bench", "--dataset", "charlm", "--transformer", bad, "--out", ""]) == 2
        assert message in capsys.readouterr().err
    assert main(["bench", "--transformer", "32,3,2", "--out", ""]) == 2
    assert "applies to the text datasets ('charlm', 'pysrc') only" in capsys.readouterr().err


def test_overhead_local_steps_rows(tmp_path, capsys):
    """The local-steps rows of the overhead suite at a tiny size: record structure, and the exact
    state bytes per parameter byte (never timings)."""
    rc = main(
        [
            "bench",
            "--suite",
            "overhead",
            "--rows",
            "local-steps",
            "--transforms",
            "local_sgd,diloco",
            "--replica-counts",
            "8",
            "--local-params",
            "1K",
            "--repeats",
            "2",
            "--out",
            str(tmp_path),
            "--quiet",
        ]
    )
    assert rc == 0
    assert "| local_sgd | simulate | 8 | 1,024 |" in capsys.readouterr().out
    rec = json.loads((tmp_path / "overhead_simulate.json").read_text())
    assert rec["rows"] == ["local-steps"] and rec["results"] == []
    section = rec["local_steps"]
    assert section["host_malloc"].startswith("system")
    rows = {r["transform"]: r for r in section["results"]}
    assert set(rows) == {"local_sgd", "diloco"}
    param_bytes = 4 * 4 * 16 * 16  # four 16×16 float32 matrices
    for r in rows.values():
        assert (r["harness"], r["replicas"], r["parameters"]) == ("simulate", 8, 1024)
        assert r["param_bytes"] == param_bytes
        for key in ("local", "plain", "sync", "hand_sync"):
            assert len(r["samples_s"][key]) == 2
            assert r["faults_per_call"][key] >= 0
            assert r["late_state_arrays"][key] == 0  # done when its parameters are ready
        assert r["local_ratio"] == r["local_ms"] / r["plain_ms"] > 0
        assert r["sync_ratio"] == r["sync_ms"] / r["hand_sync_ms"] > 0
        assert r["compile_s"] > 0
        # the step holds at least its arguments: parameters, gradients and the state, all replicas
        assert r["step_bytes"] >= 8 * (2 * param_bytes + r["state_bytes"])
        assert r["step_bytes"] > r["plain_step_bytes"] >= 8 * 3 * param_bytes  # plain: one trace
    # DiLoCo's sync step is also timed against DiLoCo written by hand (checked to compute the same
    # parameters); local SGD has no such reference
    diloco = rows["diloco"]
    assert len(diloco["samples_s"]["hand_algorithm"]) == 2
    assert diloco["sync_algorithm_ratio"] == diloco["sync_ms"] / diloco["hand_algorithm_ms"] > 0
    assert "hand_algorithm" not in rows["local_sgd"]["samples_s"]
    assert rows["local_sgd"]["hand_algorithm_ms"] is None is rows["local_sgd"]["sync_algorithm_ratio"]
    # momentum SGD keeps one trace; local SGD and gossip add the exact_sync copy of the parameters;
    # DiLoCo adds the anchor (which is also what exact_sync reads) and the outer Nesterov momentum
    assert rows["local_sgd"]["buffer_bytes_per_param_byte"] == 2.0
    assert rows["diloco"]["buffer_bytes_per_param_byte"] == 3.0
    table = {r["transform"]: r for r in section["state_bytes"]}
    expected = {"local_sgd": 2.0, "diloco": 3.0, "slowmo": 3.0, "streaming_diloco": 3.0}
    expected |= {"decentralized_sgd": 2.0, "sgp": 2.0, "allreduce": 1.0, "topk_1pct_ef": 2.0}
    expected |= {"daso": 3.0}  # momentum, the pending sum, and exact sync's bit patterns
    for name, buffers in expected.items():
        assert table[name]["buffer_bytes_per_param_byte"] == buffers, name
        assert table[name]["state_bytes"] == buffers * param_bytes + table[name]["fixed_state_bytes"]


_TOUCH_80_MIB = """
import sys
import threading

from optaxdist.bench import host_memory

print(host_memory.host_malloc())
if sys.argv[1] == "keep":
    host_memory.keep_freed_memory()
    print(host_memory.host_malloc())

def touch():  # 80 MiB (above a thread arena's 64 MiB heaps), every page written, then freed
    block = bytearray(80 << 20)
    del block

def faults_per_block():
    touch(), touch()
    before = host_memory.minor_faults()
    for _ in range(4):
        touch()
    return (host_memory.minor_faults() - before) / 4

print(faults_per_block())
in_thread = []
worker = threading.Thread(target=lambda: in_thread.append(faults_per_block()))
worker.start(), worker.join()
print(in_thread[0])
"""


def _transparent_huge_pages_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt: Linux only")
@pytest.mark.skipif(_transparent_huge_pages_always(), reason="huge pages fault once per 2 MiB")
def test_keep_freed_memory_reuses_the_pages_it_freed():
    """``--host-malloc keep``: with glibc's defaults an 80 MiB block is mapped afresh on every
    allocation, in the main thread and in another one, and each of its 20,480 pages faults on its
    first write; once the allocator keeps what it frees, the block reuses pages already mapped,
    in both. In processes of their own (the setting stays for a process's life), with no malloc
    settings or other allocator from the environment."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "LD_PRELOAD", "PYTHONMALLOC"))
    }
    pages = (80 << 20) // os.sysconf("SC_PAGE_SIZE")

    def run(mode: str) -> list[str]:
        done = subprocess.run(
            [sys.executable, "-c", _TOUCH_80_MIB, mode], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    named, main_thread, other_thread = run("system")
    assert named == "system" and float(main_thread) >= 0.9 * pages and float(other_thread) >= 0.9 * pages
    before, after, main_thread, other_thread = run("keep")
    assert (before, after) == ("system", "keep")
    assert float(main_thread) < 0.01 * pages and float(other_thread) < 0.01 * pages
    assert main(["bench", "--host-malloc", "keep", "--out", ""]) == 2  # the overhead suite's option


# SlowMo's case needs the second step to tell; DiLoCo's right reference is checked by every row
# (test_overhead_local_steps_rows), its wrong one in the full run
@pytest.mark.parametrize("name", [pytest.param("diloco", marks=pytest.mark.slow), "slowmo"])
def test_a_hand_written_algorithm_that_computes_otherwise_is_refused(name):
    """The hand-written references are checked against the transform's sync steps: one with
    another outer optimizer is not a reference for the same work. For SlowMo from zero momentum
    a first step cannot tell (it is the mean whatever the learning rate): the second one does."""
    case = local_steps.cases()[name]
    wrong = dataclasses.replace(case, hand_algorithm=local_steps.OuterByHand(lambda: optax.sgd(1.0)))
    harness = local_steps.make_harness("simulate", 4, hierarchical=False)
    inputs = local_steps.make_inputs(256, 4)
    local_steps.measure_case(case, harness, inputs, repeats=1)  # the right one passes
    with pytest.raises(
        AssertionError, match=f"{name}: the hand-written algorithm's sync step . computes other"
    ):
        local_steps.measure_case(wrong, harness, inputs, repeats=1)


def test_state_arrays_not_ready_with_the_parameters_are_counted_and_warned_about(monkeypatch):
    """The clock stops when a call's parameters are ready; the state's arrays that were not ready
    by then are counted per row (``late_state_arrays``) and named in a warning: the row's time
    would not be the whole step's."""
    ready = jax.block_until_ready(jax.numpy.ones(3))
    assert local_steps._late_arrays({"host": np.zeros(2), "ready": ready, "none": None}) == 0
    case = local_steps.cases()["local_sgd"]
    harness = local_steps.make_harness("simulate", 4, hierarchical=False)
    monkeypatch.setattr(local_steps, "_late_arrays", lambda state: 2)
    with pytest.warns(
        UserWarning, match=r"local_sgd: arrays of the state were not ready .* in \['hand_sync'"
    ):
        row = local_steps.measure_case(case, harness, local_steps.make_inputs(256, 4), repeats=1)
    assert row["late_state_arrays"] == {"local": 2, "plain": 2, "sync": 2, "hand_sync": 2}


def test_overhead_local_steps_split(tmp_path, capsys):
    """``--split-local-steps``: the local step timed on calls that ran the local program, whose
    compile time is reported too, with the first synchronization's call; it needs ``--donate``.
    ``--local-leaves`` spreads the parameters over that many arrays."""
    args = "--suite overhead --rows local-steps --transforms local_sgd --replica-counts 8 --local-params 1K"
    args += " --repeats 2 --quiet --split-local-steps --local-leaves 6"
    assert main(["bench", *args.split(), "--out", ""]) == 2
    assert "--split-local-steps needs --donate" in capsys.readouterr().err
    assert main(["bench", *args.split(), "--donate", "--local-leaves", "0", "--out", ""]) == 2
    assert "--local-leaves 0: at least 1" in capsys.readouterr().err
    assert main(["bench", *args.split(), "--donate", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "compile s: general program + local program + first sync call" in out
    assert "| 1,014 in 6 |" in out
    (row,) = json.loads((tmp_path / "overhead_simulate.json").read_text())["local_steps"]["results"]
    assert row["split"] and row["local_compile_s"] > 0 and row["local_program_step_bytes"] > 0
    assert row["first_sync_s"] > 0 and row["leaves"] == 6
    assert all(
        len(row["samples_s"][key]) == 2 for key in ("local", "plain", "sync", "loop_local", "loop_plain")
    )
    assert row["loop_local_ratio"] == row["loop_local_ms"] / row["loop_plain_ms"] > 0
    assert set(row["late_state_arrays"].values()) == {0}
    assert f"loop: {local_steps.LOOP} local steps in a row" in out


# local SGD by default (test_overhead_local_steps_rows runs DiLoCo's rows without the model); DiLoCo,
# its sync checked against DiLoCo written by hand with the model, and gossip, whose reference is the
# ring, in the full run
@pytest.mark.parametrize(
    ("transform", "reference"),
    [
        ("local_sgd", "hand_sync"),
        pytest.param("diloco", "hand_algorithm", marks=pytest.mark.slow),
        pytest.param("decentralized_sgd", "hand_local", marks=pytest.mark.slow),
    ],
)
def test_overhead_local_steps_with_a_model(transform, reference, tmp_path, capsys):
    """``--local-model mlp``: every step takes the gradient of an MLP of about ``--local-params``
    parameters on its replica's batch of digits: ours and every reference alike (DASO's reference
    averages the model's gradients over the node: test_the_hand_written_daso_sync_sets_the_bits_daso_does;
    a step given a batch where it expects gradients fails to trace). Bad values are named."""
    args = f"--suite overhead --rows local-steps --transforms {transform} --replica-counts 8"
    args += " --local-params 1K --repeats 1 --quiet"
    assert main(["bench", *args.split(), "--local-model", "cnn", "--out", ""]) == 2
    assert "--local-model 'cnn': one of none, mlp" in capsys.readouterr().err
    assert main(["bench", *args.split(), "--local-model", "mlp", "--local-leaves", "6", "--out", ""]) == 2
    assert "--local-leaves 6: only with --local-model none" in capsys.readouterr().err
    assert main(["bench", *args.split(), "--local-model", "mlp", "--out", str(tmp_path)]) == 0
    assert f"on {local_steps.BATCH} digits per replica" in capsys.readouterr().out
    section = json.loads((tmp_path / "overhead_simulate.json").read_text())["local_steps"]
    assert (section["model"], section["leaves"]) == ("mlp", None)
    (row,) = section["results"]
    assert (row["transform"], row["model"], row["leaves"]) == (transform, "mlp", 6)
    assert row["parameters"] == 11 * 11 + 76 * 11 + 10 == 967  # 64 → 11 → 11 → 10
    assert len(row["samples_s"][reference]) == 1
    states = {r["transform"]: r for r in section["state_bytes"]}
    assert {r["parameters"] for r in states.values()} == {967}  # the model's, not the flat arrays'
    assert states[transform]["param_bytes"] == 967 * 4 == row["param_bytes"]


def test_a_model_step_descends_the_models_gradient():
    """With ``model="mlp"`` a step's third argument is a batch: the plain step from zero momentum
    moves every replica's parameters by −lr × the gradient of the MLP's cross-entropy on its own
    batch (the replicas' batches differ)."""
    inputs = local_steps.make_inputs(1000, 2, model="mlp")
    harness = local_steps.make_harness("simulate", 2, hierarchical=False)
    plain = local_steps.reference_step(harness, None, gradients_of=inputs.gradients_of)
    state = harness.wrap(local_steps.inner().init)(inputs.params)
    stepped, _ = plain(inputs.params, state, inputs.data)
    model = bench_models.MLP(hidden=(local_steps.mlp_width(1000),) * 2)
    x, y = inputs.data
    assert not np.array_equal(x[0], x[1])
    loss = functools.partial(bench_models.cross_entropy, model)
    for r in range(2):
        params = jax.tree.map(operator.itemgetter(r), inputs.params)
        grads = jax.grad(loss)(params, x[r], y[r])
        expected = jax.tree.map(lambda p, g: p - local_steps.LR * g, params, grads)
        got = jax.tree.map(operator.itemgetter(r), stepped)
        for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("harness_name", "shape"), [("mesh", (4, 2)), ("simulate", (2, 4)), ("simulate", (4, 2))]
)
def test_the_hand_written_daso_sync_sets_the_bits_daso_does(harness_name, shape, monkeypatch):
    """The reference of DASO's sync row computes what DASO's blocking sync computes, bit for bit:
    the node's gradient mean, the local step, the bf16 sum over the nodes (on the CPU mesh by
    hand, as the bf16 bits, as DASO sends it: an all-to-all, not XLA's float32 all-reduce), its
    mean, the broadcast within the node (the hand-written algorithm, ``DasoByHand``, alike with
    its bit-exact broadcast). The replicas start apart, so every sum matters; with 4
    nodes (the mesh case) so does the order of the sum. (Under ``simulate`` the reference is
    XLA's ``psum``, which rounds after each add: the bits are DASO's with 2 nodes; the algorithm's
    sum is DASO's with 4.)"""
    monkeypatch.setattr(local_steps, "hierarchy_shape", lambda replicas: shape)
    case = local_steps.cases()["daso"]
    harness = local_steps.make_harness(harness_name, 8, hierarchical=True)
    inputs = local_steps.make_inputs(1000, 8, model="mlp")
    noise = np.random.default_rng(0)
    params = jax.tree.map(lambda x: x + 0.01 * noise.standard_normal(x.shape).astype(x.dtype), inputs.params)
    params, data = harness.place(params), harness.place(inputs.data)
    tx, gradients_of = case.build(8), inputs.gradients_of
    ours = harness.wrap(local_steps._on_data(local_steps._step(tx), gradients_of))
    hand = local_steps.reference_step(harness, case.hand_sync, False, case.hand_sync_grads, gradients_of)
    plain = local_steps.reference_step(harness, None, gradients_of=gradients_of)
    state = harness.place(local_steps._at(harness.wrap(tx.init)(inputs.params), case.sync_at))
    synced, _ = ours(params, state, data)
    plain_state = harness.place(harness.wrap(local_steps.inner().init)(inputs.params))
    by_hand, _ = hand(params, plain_state, data)
    algorithm = harness.wrap(local_steps._on_data(case.hand_algorithm.step, gradients_of))
    algorithm_state = harness.place(harness.wrap(case.hand_algorithm.init)(inputs.params))
    by_hand_exact, _ = algorithm(params, algorithm_state, data)
    stepped, _ = plain(params, plain_state, data)
    for a, b, e, c in zip(*map(jax.tree.leaves, (synced, by_hand, by_hand_exact, stepped)), strict=True):
        a, b, e, c = np.asarray(a), np.asarray(b), np.asarray(e), np.asarray(c)
        if harness_name == "mesh" or shape[0] == 2:  # XLA's bfloat16 psum: DASO's bits with 2 nodes
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
        assert np.array_equal(a.view(np.uint32), e.view(np.uint32))  # DASO's sum, its broadcast
        assert all(np.array_equal(a[r], a[0]) for r in range(8))  # a global average
        assert not np.array_equal(a, c)  # not the local step's parameters
    if harness_name == "mesh":
        assert "all-to-all(" in hand.lower(params, plain_state, data).compile().as_text()


def test_each_timed_step_follows_the_step_a_loop_makes_before_it():
    """``_time_donated`` times each row's step right after an untimed call of its ``before`` step,
    on the state that call returned (ours: from one step earlier in its schedule), never right
    after another row's step; with ``steps`` it times that many calls after one untimed step."""
    calls_made = []

    def recorder(name):
        def step(params, state, grads):
            calls_made.append((name, int(state)))
            return params, state + 1

        return step

    zeros = (np.zeros(()),) * 3
    calls = {"sync": (recorder("sync"), zeros), "hand_sync": (recorder("hand_sync"), zeros)}
    before = {"sync": recorder("local"), "hand_sync": recorder("plain")}
    reset = lambda name, state, early: np.asarray(100 - early) if name == "sync" else state  # noqa: E731
    samples, faults, late, _ = local_steps._time_donated(calls, 3, reset, before)
    assert {k: len(v) for k, v in samples.items()} == {"sync": 3, "hand_sync": 3}
    assert {k: len(v) for k, v in faults.items()} == {"sync": 3, "hand_sync": 3}
    assert late == {"sync": [0] * 3, "hand_sync": [0] * 3}  # NumPy states: nothing to wait for
    assert calls_made[:4] == [("local", 99), ("sync", 100), ("plain", 0), ("hand_sync", 1)]
    assert calls_made[4:8] == [("local", 99), ("sync", 100), ("plain", 2), ("hand_sync", 3)]
    assert len(calls_made) == 2 * 2 * 4
    calls_made.clear()
    looped, _, _, ends = local_steps._time_donated(
        {"sync": calls["sync"]}, 2, reset, {"sync": calls["sync"][0]}, local_steps.LOOP
    )
    assert len(looped["sync"]) == 2 and int(ends["sync"]) == 100 + local_steps.LOOP
    assert calls_made == 3 * [("sync", 99), *(("sync", 100 + k) for k in range(local_steps.LOOP))]


# by default each transform with one of the two programs (the check is the same for all)
@pytest.mark.parametrize(
    "name, split",
    [
        ("local_sgd", False),
        pytest.param("local_sgd", True, marks=pytest.mark.slow),
        pytest.param("sgp", False, marks=pytest.mark.slow),
        ("sgp", True),
    ],
)
def test_local_steps_timed_in_a_loop_are_all_local(name, split):
    """The loop's local steps synchronize nothing (gossip: no global average): a schedule position
    from which a synchronization comes within ``LOOP`` steps is refused, not timed as local
    steps, with or without the split."""
    case = local_steps.cases()[name]
    harness = local_steps.make_harness("simulate", 4, hierarchical=False)
    inputs = local_steps.make_inputs(256, 4)
    late = dataclasses.replace(case, local_at={"step": local_steps.SYNC_T - 3})
    with pytest.raises(
        RuntimeError, match=f"{name}: a synchronization ran in {local_steps.LOOP} local steps"
    ):
        local_steps.measure_case(late, harness, inputs, repeats=1, donate=True, split=split)


def test_each_row_follows_the_hand_written_step_before_it():
    """The hand-written sync follows the hand-written step that comes before it in a loop: the
    ring exchange for gossip, the step on the node's mean gradient for DASO (whose step before a
    global sync averages the gradients over the node), the plain step otherwise; the hand-written
    algorithm follows its own local step; ours and the plain step follow themselves."""
    harness = local_steps.make_harness("simulate", 4, hierarchical=False)
    plain = local_steps.reference_step(harness, None, True)
    for name, case in local_steps.cases().items():
        ours = object()
        before = local_steps.predecessors(case, harness, ours, True)
        assert before["local"] is before["sync"] is ours, name
        assert before["plain"] is plain, name
        if name in ("decentralized_sgd", "sgp"):
            ring = local_steps.reference_step(harness, case.hand_local, True)
            assert before["hand_sync"] is before["hand_local"] is ring, name
        elif name == "daso":
            on_node_mean = local_steps.reference_step(
                harness, local_steps._unchanged, True, case.hand_sync_grads
            )
            assert before["hand_sync"] is on_node_mean
        else:
            assert before["hand_sync"] is plain, name
        assert ("hand_algorithm" in before) == (case.hand_algorithm is not None), name


def test_sharded_suite_memory(tmp_path, capsys):
    """``--suite sharded`` memory part at a tiny size: per-device bytes of the parameters, momentum
    and error-feedback residuals fall as 1/|model| (the replicated bias and the counters excepted)."""
    args = "--suite sharded --parts memory --sizes 4K --transforms topk-1%-ef --model-sizes 1,2,4 --quiet"
    assert main(["bench", *args.split(), "--out", str(tmp_path)]) == 0
    assert "| topk-1%-ef | 4       | 2 × 4 |" in capsys.readouterr().out
    rec = json.loads((tmp_path / "sharded.json").read_text())
    assert "training" not in rec
    mem = {r["model"]: r for r in rec["memory"][0]["results"]}
    assert set(mem) == {1, 2, 4}
    side = rec["memory"][0]["model"]["shapes"]["b"][0]
    kernels = 4 * 8 * side * side  # w1 and w2, float32
    for m, r in mem.items():
        assert r["params_bytes"] == kernels // m + 4 * side  # the bias is replicated
        assert r["local_state_bytes"] == r["params_bytes"]  # momentum, split like the parameters
        assert kernels // m <= r["algorithm_state_bytes"] - 4 * side < kernels // m + 64  # residuals
        assert r["total_bytes"] == r["params_bytes"] + r["local_state_bytes"] + r["algorithm_state_bytes"]
        assert abs(r["total_vs_smallest_model"] - 1 / m) < 0.02
        if r["compiled"] is not None:  # the compiled step's arguments: the same state, and the batch
            assert abs(r["compiled"]["arguments_without_batch"] - r["total_bytes"]) < 64


@pytest.mark.slow  # about a minute: the transformer is compiled four times
def test_sharded_suite_training(tmp_path):
    """The training part at a tiny size: on the 4 × 2 FSDP mesh the parameters stay split, the
    ledger is simulate's and, after a few steps, so are the parameters (to float32 rounding)."""
    args = "--suite sharded --parts training --algorithms powersgd-r2 --steps 3 --batch-size 2"
    args += " --d-model 16 --layers 1 --heads 2 --quiet"
    assert main(["bench", *args.split(), "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "sharded.json").read_text())
    (row,) = rec["training"]["results"]
    assert row["algorithm"] == "powersgd-r2" and row["mesh"]["params_still_split"]
    assert abs(row["loss_difference"]) < 1e-5 and row["max_param_difference"] < 1e-5
    assert row["mesh"]["ledger_bytes_per_replica"] == row["simulate"]["ledger_bytes_per_replica"] > 0
    assert row["mesh"]["params_bytes"] < 0.6 * row["simulate"]["params_bytes"]


def test_merge_joins_rows_of_one_experiment_and_refuses_others(record, tmp_path, capsys):
    base = {k: v for k, v in record.items() if k != "_out"}
    paths = []
    for i, result in enumerate(base["results"]):  # one record per row, as separate runs write them
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(dict(base, results=[result])))
        paths.append(str(path))
    out = tmp_path / "merged"
    assert main(["merge", *reversed(paths), "--out", str(out), "--tag", "t"]) == 0
    merged = json.loads((out / "t.json").read_text())
    assert [r["algorithm"] for r in merged["results"]] == ["allreduce-bf16", "allreduce-fp32"]
    assert merged["results"] == base["results"][::-1]
    assert merged["config"]["algorithms"] == ["allreduce-bf16", "allreduce-fp32"]
    assert (out / "t_loss_vs_bytes.png").exists()
    assert "allreduce-bf16" in capsys.readouterr().out

    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(base, results=base["results"][1:], config=dict(base["config"], lr=0.5))))
    assert main(["merge", paths[0], str(other), "--out", str(out)]) == 2
    assert "config.lr: 0.05 vs 0.5" in capsys.readouterr().err
    assert main(["merge", paths[0], paths[0], "--out", str(out)]) == 2
    assert "'allreduce-fp32' is in both" in capsys.readouterr().err
    other.write_text(json.dumps(dict(base, environment=dict(base["environment"], device_kind="H200"))))
    assert main(["merge", paths[0], str(other), "--out", str(out)]) == 2
    assert "environment.device_kind" in capsys.readouterr().err
    other.write_text(json.dumps({k: v for k, v in base.items() if k != "dataset"}))
    assert main(["merge", paths[0], str(other), "--out", str(out)]) == 2
    assert "has no dataset" in capsys.readouterr().err
    assert main(["merge", paths[0], "--out", str(tmp_path)]) == 2  # would overwrite run0.json
    assert "would overwrite the input" in capsys.readouterr().err
    other.write_text("not JSON")
    assert main(["merge", paths[0], str(other), "--out", str(out)]) == 2
    assert f"{other} is not a train record of optaxdist bench (not JSON" in capsys.readouterr().err
    # --nodes spelled out as its default (one replica per node) is the same experiment
    assert base["config"]["nodes"] is None
    config = dict(base["config"], nodes=base["config"]["replicas"])
    explicit = dict(base, results=base["results"][1:], config=config)
    other.write_text(json.dumps(explicit))
    assert main(["merge", paths[0], str(other), "--out", str(out)]) == 0
    # so is --transformer spelled as the model's shape (text datasets record it in the model)
    from optaxdist.bench.merge import merge_records

    text = dict(base, model=dict(base["model"], width_layers_heads=[64, 2, 4]))
    spelled = dict(text, results=base["results"][1:], config=dict(base["config"], transformer=[64, 2, 4]))
    assert len(merge_records([dict(text, results=base["results"][:1]), spelled])["results"]) == 2
    with pytest.raises(ValueError, match="config.transformer"):
        merge_records(
            [
                dict(text, results=base["results"][:1]),
                dict(spelled, config=dict(base["config"], transformer=[32, 2, 4])),
            ]
        )
