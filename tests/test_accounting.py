"""Exact communication accounting, checked against the collectives in the compiled HLO."""

import pickle
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxdist as od
from optaxdist.accounting import Kind, payload_bytes
from optaxdist.bench.cost import wire_bytes
from tests.problems import init_params

HLO_DTYPES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "s16": 2, "u16": 2, "u8": 1, "pred": 1}


def hlo_collective_payloads(fn, *args, op="all-reduce", compiled=False):
    """Bytes per HLO dtype summed over every ``op`` instruction of the program as lowered, or as
    compiled for this CPU backend."""
    lowered = fn.lower(*args)
    text = lowered.compile().as_text() if compiled else lowered.as_text(dialect="hlo")
    totals = {}
    for line in text.splitlines():
        m = re.search(r"=\s*(\(.*?\)|\S+)\s+" + op + r"(?:-start)?\(", line)
        if not m:
            continue
        for dt, nbytes in _buffers(m.group(1)):
            totals[dt] = totals.get(dt, 0) + nbytes
    return totals


def _buffers(types: str) -> list[tuple[str, int]]:
    return [
        (dt, int(np.prod([int(d) for d in dims.split(",") if d])) * HLO_DTYPES[dt])
        for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", types)
    ]


# What one member sends per byte of an instruction's result, in a group of n.
_WIRE_PER_RESULT_BYTE = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: n - 1,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1,
}


def compiled_wire_bytes(fn, *args) -> dict[str, float]:
    """Bytes one member sends, per HLO dtype, over every collective of the program XLA compiled
    for this backend (ring algorithms, as ``optaxdist.bench.cost`` models them)."""
    totals = {}
    ops = "|".join(_WIRE_PER_RESULT_BYTE)
    for line in fn.lower(*args).compile().as_text().splitlines():
        m = re.search(r"=\s*(\(.*?\)|\S+)\s+(" + ops + r")\(", line)
        if not m:
            continue
        groups = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
        iota = re.search(r"replica_groups=\[\d+,(\d+)\]", line)
        n = len(groups.group(1).split(",")) if groups else int(iota.group(1)) if iota else 2
        for dt, nbytes in _buffers(m.group(1)):
            totals[dt] = totals.get(dt, 0) + nbytes * _WIRE_PER_RESULT_BYTE[m.group(2)](n)
    return totals


def ledger_wire_bytes(stats, n: int) -> float:
    """Bytes one member sends for the events of a ledger, per the cost model."""
    return sum(
        wire_bytes(kind, t.bytes / t.collectives, n) * t.collectives
        for kind, t in stats.by_kind.items()
        if t.collectives
    )


@pytest.mark.parametrize("dtype, hlo", [(None, "f32"), ("bfloat16", "u16"), ("float16", "f16")])
def test_ledger_equals_compiled_collectives(dtype, hlo):
    """What the ledger counts is what the compiled program sends, in the dtype it says: XLA:CPU
    would run a bfloat16 all-reduce in float32, so the communicator sends the bits."""
    n = 8
    mesh = jax.make_mesh((n,), ("replica",), axis_types=(jax.sharding.AxisType.Auto,))
    comm = od.AxisComm("replica")
    tx = optax.chain(od.allreduce(comm=comm, dtype=dtype), optax.sgd(0.1))
    params = od.replicate(jax.tree.map(jnp.asarray, init_params()), n)

    def step(p, g):
        u, s = tx.update(g, tx.init(p), p)
        return optax.apply_updates(p, u), s

    fn = od.on_mesh(step, mesh)
    _, state = fn(params, params)
    stats = od.comm_stats(state)
    assert stats.collectives == 1
    assert compiled_wire_bytes(fn, params, params) == {hlo: pytest.approx(ledger_wire_bytes(stats, n))}


def test_average_params_and_loss_scale_hlo():
    n = 8
    mesh = jax.make_mesh((n,), ("replica",), axis_types=(jax.sharding.AxisType.Auto,))
    comm = od.AxisComm("replica")
    tx = od.dynamic_loss_scale(
        optax.chain(optax.sgd(0.1), od.average_params(comm=comm, dtype="bfloat16")), comm=comm
    )
    params = od.replicate(jax.tree.map(jnp.asarray, init_params()), n)
    fn = od.on_mesh(lambda p, g: tx.update(g, tx.init(p), p)[1], mesh)
    stats = od.comm_stats(fn(params, params))
    average, agree = stats.by_kind["param_average[bfloat16]"], stats.by_kind["agree[int32]"]
    assert compiled_wire_bytes(fn, params, params) == {
        "u16": pytest.approx(wire_bytes("all_reduce", average.bytes, n)),
        "s32": pytest.approx(wire_bytes("all_reduce", agree.bytes, n)),
    }


def test_counts_are_exact_beyond_float32_range():
    kind = Kind("all_reduce", "float32")
    ledger = od.CommLedger.create({kind: 25_000_000 * 4})
    ledger = ledger.record(kind, jnp.asarray(2**31 - 1, jnp.int32) - 1)
    stats = od.comm_stats({"nested": [ledger]})
    assert stats.bytes == (2**31 - 2) * 100_000_000  # 2.1e17: not representable in float32
    assert isinstance(stats.bytes, int)


def test_nested_states_are_summed_by_kind():
    comm = od.AxisComm("replica")
    tx = od.dynamic_loss_scale(
        optax.chain(od.allreduce(comm=comm), optax.sgd(0.1), od.average_params(comm=comm)),
        comm=comm,
    )
    p = od.replicate(jnp.zeros(5), 2)
    state = od.simulate(lambda q: tx.update(q, tx.init(q), q)[1])(p)
    stats = od.comm_stats(state)
    assert stats.by_kind == {
        "all_reduce[float32]": od.KindTotals(1, 20),
        "param_average[float32]": od.KindTotals(1, 20),
        "agree[int32]": od.KindTotals(1, 4),
    }
    assert (stats.collectives, stats.bytes) == (3, 44)


def test_disagreeing_replicas_need_an_explicit_replica():
    ledger = od.CommLedger.create({Kind("broadcast", "k"): 3})
    stacked = jax.tree.map(lambda c: jnp.asarray([1, 2], jnp.int32), ledger)
    with pytest.raises(ValueError, match="replica="):
        od.comm_stats(stacked)
    assert od.comm_stats(stacked, replica=1).bytes == 6


def test_undeclared_kind_is_an_error():
    with pytest.raises(KeyError, match="not declared"):
        od.CommLedger.create({Kind("permute", "a"): 1}).record(Kind("permute", "b"))


def test_payload_bytes():
    tree = {
        "a": jnp.zeros((3, 4)),
        "b": jnp.zeros(5, jnp.int32),
        "c": jax.ShapeDtypeStruct((2, 2), jnp.bfloat16),
    }
    assert payload_bytes(tree) == 48 + 20 + 8
    assert payload_bytes(tree, jnp.float16) == 24 + 20 + 8


def test_a_kind_is_its_text_and_carries_its_parts():
    kind = Kind("all_reduce", "bfloat16", label="param_average", scope="local")
    assert kind == "local:param_average[bfloat16]"
    assert (kind.collective, kind.payload, kind.label, kind.scope) == (
        "all_reduce", "bfloat16", "param_average", "local",
    )  # fmt: skip
    assert pickle.loads(pickle.dumps(kind)).scope == "local"
    with pytest.raises(ValueError, match="collective="):
        Kind("teleport", "float32")
    with pytest.raises(ValueError, match="scope="):
        Kind("all_reduce", "float32", scope="global")
    with pytest.raises(TypeError, match="Kind"):
        od.CommLedger.create({"all_reduce[float32]": 4})
