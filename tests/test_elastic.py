"""Elastic restart: ``resize_replicas`` maps a stacked state of N replicas to M (8 → 4, 4 → 8).

For every public transform: run at N, resize, build the transform for M, continue. The resized
state has exactly the structure, shapes, dtypes and ledger payloads of a fresh init at M; the run
continues finite; leaves the rule table calls replicated stay identical on every replica; the
error-feedback residuals' sum over replicas is preserved exactly (checked with rationals).
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import optaxdist as od
from optaxdist.elastic import RESIDUAL, SUM, exact_sum_rows, leaf_rules
from tests.ckpt_common import NAMES, fast_or_slow, make, params_row, step_fn
from tests.problems import replica_data
from tests.test_checkpoint import COMM, compiled, fresh, run_steps

STEPS = 4  # a sync point for every contract configuration (DASO: the end of an epoch)
# the parameters are identical on all replicas after every step (all-reduce based, period 1)
SYNCED_PARAMS = {
    "allreduce",
    "allreduce_bf16_sum",
    "allreduce_fp16_clip",
    "average_params",
    "compressed_top_k",
    "compressed_sign_model",
    "compressed_random_k_no_ef",
    "exact_warmup",
    "powersgd",
    "local_sgd",
    "diloco",
    "slowmo_memory_efficient",
    "dynamic_loss_scale",
    "daso",
    "daso_heat",
    "composed_diloco_top_k",
}
assert set(NAMES) >= SYNCED_PARAMS


def resize_kwargs(name: str, m: int) -> dict:
    if name.startswith("daso"):
        return {"node_size": m}  # the contract's DASO has one node: local_comm = all replicas
    if name in ("decentralized_sgd", "sgp_overlap"):
        return {"topology": lambda n: od.topology.ring(n, directed=name == "sgp_overlap")}
    return {}


def rows_exact_sum(x) -> list[Fraction]:
    x = np.asarray(x).reshape(len(x), -1)
    return [sum((Fraction(float(v)) for v in x[:, j]), Fraction(0)) for j in range(x.shape[1])]


def check_identical_where_replicated(state, what):
    for (path, x), rule in zip(jax.tree_util.tree_leaves_with_path(state), _rules_by_leaf(state)):
        if rule == "replicated":
            x = np.asarray(x)
            assert all(np.array_equal(x[0], x[i], equal_nan=True) for i in range(len(x))), (
                f"{what}{jax.tree_util.keystr(path)}"
            )


def _rules_by_leaf(state):
    """One rule per array leaf of ``state`` (ledgers: one per counter)."""
    rules = leaf_rules(state)
    out = []
    for node in jax.tree.leaves(rules, is_leaf=lambda r: isinstance(r, str)):
        out.append(node)
    is_ledger = lambda x: isinstance(x, od.CommLedger)  # noqa: E731
    per_leaf = []
    for rule, sub in zip(out, jax.tree.leaves(state, is_leaf=is_ledger)):
        per_leaf += [rule] * (len(sub.counts) if is_ledger(sub) else 1)
    return per_leaf


@pytest.mark.parametrize("direction", [(8, 4), (4, 8)], ids=["8to4", "4to8"])
@pytest.mark.parametrize("name", fast_or_slow())
def test_resize_and_continue(name, direction):
    n, m = direction
    xs, ys = replica_data(n, STEPS, seed=3)
    params, state = run_steps(name, "vmap", n, fresh(name, "vmap", n), 0, STEPS, xs, ys)
    params, state = jax.tree.map(np.asarray, (params, state))
    _, _, tx_m = compiled(name, "vmap", m)
    like = jax.eval_shape(jax.vmap(tx_m.init), od.replicate(params_row(), m))

    new_params, new_state = od.resize_replicas(params, state, m, like=like, **resize_kwargs(name, m))

    # exactly the tree a fresh init at M has (the like= check), as NumPy arrays
    assert jax.tree.structure(new_state) == jax.tree.structure(like)
    for x, ref in zip(jax.tree.leaves(new_state), jax.tree.leaves(like)):
        assert isinstance(x, np.ndarray) and x.shape == ref.shape and x.dtype == ref.dtype
    rules = _rules_by_leaf(state)
    assert len(rules) == len(jax.tree.leaves(state))
    # counters, schedules, ledgers' counts, anchors... kept; residual sums preserved exactly
    for rule, old, new in zip(rules, jax.tree.leaves(state), jax.tree.leaves(new_state)):
        if rule in (RESIDUAL, SUM):
            assert rows_exact_sum(old) == rows_exact_sum(new)
        elif rule in ("replicated", "ledger") and np.array_equal(old, old[:1].repeat(n, 0)):
            np.testing.assert_array_equal(new, old[:1].repeat(m, 0))
    if any(r == RESIDUAL for r in rules):
        assert any(np.any(old != 0) for r, old in zip(rules, jax.tree.leaves(state)) if r == RESIDUAL)
    if name in SYNCED_PARAMS:  # resized at a sync point: the parameters are kept exactly
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[0], b[0]), params, new_params)
    check_identical_where_replicated(new_state, f"{name} resized: ")

    xs, ys = replica_data(m, STEPS, seed=4)
    params2, state2 = run_steps(name, "vmap", m, (new_params, new_state), 0, STEPS, xs, ys)
    params2, state2 = jax.tree.map(np.asarray, (params2, state2))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params2))
    assert jax.tree.structure(state2) == jax.tree.structure(like)
    check_identical_where_replicated(state2, f"{name} continued: ")
    if name in SYNCED_PARAMS:
        od.assert_replicas_identical(params2)
    # the ledgers went on counting from where the N-replica run was
    before, after = od.comm_stats(state, replica=0), od.comm_stats(state2, replica=0)
    assert all(after.by_kind[k].collectives >= t.collectives for k, t in before.by_kind.items())


def test_checkpoint_of_8_resumed_on_a_mesh_of_4(tmp_path):
    """The whole recipe: save 8 stacked replicas, read them back on the host, resize, place the 4
    rows on a 4-device mesh, continue there."""
    name = "compressed_top_k"
    xs, ys = replica_data(8, STEPS, seed=5)
    saved = run_steps(name, "vmap", 8, fresh(name, "vmap", 8), 0, STEPS, xs, ys)
    with ocp.CheckpointManager(tmp_path) as manager:
        od.save_checkpoint(manager, STEPS, saved)
        manager.wait_until_finished()

    tx8 = make(name, COMM, 8)
    row = jax.eval_shape(lambda p: (p, tx8.init(p)), params_row())  # one replica of the old run
    params, state = od.restore_stacked(tmp_path, None, row)
    params, state = od.resize_replicas(params, state, 4)
    mesh = jax.make_mesh(
        (4,), ("replica",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,)
    )
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("replica"))
    params, state = jax.device_put((params, state), sharding)
    tx4 = make(name, COMM, 4)

    def step(p, s, x, y):
        g = jax.grad(lambda q: 0.5 * jnp.mean(jnp.sum((x @ q["w"] + q["b"] - y) ** 2, -1)))(p)
        u, s = tx4.update(g, s, p)
        return optax.apply_updates(p, u), s

    xs, ys = replica_data(4, 2, seed=6)
    run = od.on_mesh(step, mesh)
    for t in range(2):
        params, state = run(params, state, xs[t], ys[t])
    od.assert_replicas_identical(params)
    assert od.comm_stats(state).collectives == STEPS + 2


# ---------------------------------------------------------------- the exact residual redistribution


def test_exact_sum_rows_keeps_the_sum_exactly():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(8, 40)) * np.exp2(rng.integers(-12, 12, size=(8, 40)))).astype(np.float32)
    for m in (2, 3, 4, 7, 8, 16):
        y = exact_sum_rows(x, m)
        assert y.shape == (m, 40) and y.dtype == np.float32
        assert rows_exact_sum(y) == rows_exact_sum(x)
    # a rounded float32 sum would not keep it: the test can tell
    rounded = np.concatenate([x.sum(0, keepdims=True), np.zeros((3, 40), np.float32)])
    assert rows_exact_sum(rounded) != rows_exact_sum(x)
    ints = np.arange(16, dtype=np.int32).reshape(8, 2)
    np.testing.assert_array_equal(exact_sum_rows(ints, 3), [[56, 64], [0, 0], [0, 0]])


def test_exact_sum_rows_refuses_what_it_cannot_keep():
    x = np.asarray([[1.0], [2.0**-30], [2.0**-60]], np.float32)
    with pytest.raises(ValueError, match="exact_residuals=False"):
        exact_sum_rows(x, 1, where="opt_state.error")
    y = exact_sum_rows(x, 1, exact=False)
    assert y.shape == (1, 1) and y[0, 0] == np.float32(1.0)
    assert rows_exact_sum(exact_sum_rows(x, 3)) == rows_exact_sum(x)
    with pytest.raises(ValueError, match="non-finite"):
        exact_sum_rows(np.asarray([[1.0], [np.inf]], np.float32), 1)


# ---------------------------------------------------------------- sizes the algorithm can't take


def _state(name, n):
    _, _, tx = compiled(name, "vmap", n)
    params = od.replicate(params_row(), n)
    return params, jax.vmap(tx.init)(params)


def test_gossip_needs_a_topology_for_the_new_size():
    params, state = _state("sgp_overlap", 4)
    with pytest.raises(ValueError, match="topology="):
        od.resize_replicas(params, state, 8)
    with pytest.raises(ValueError, match=r"new_n=1 .*allowed: n >= 2"):
        od.resize_replicas(params, state, 1, topology=od.topology.ring)
    with pytest.raises(ValueError, match=r"new_n=6 .*rows must divide n; allowed"):
        od.resize_replicas(params, state, 6, topology=lambda n: od.topology.torus(n, rows=4))
    with pytest.raises(ValueError, match=r"n=4; new_n=8; allowed: new_n=4"):
        od.resize_replicas(params, state, 8, topology=od.topology.ring(4))


def test_daso_needs_a_node_layout_and_no_pending_send():
    params, state = _state("daso", 4)
    with pytest.raises(ValueError, match="node_size="):
        od.resize_replicas(params, state, 8)
    with pytest.raises(
        ValueError, match=r"new_n=6 is not a multiple of node_size=4; allowed: \[4, 8, 12, 16\]"
    ):
        od.resize_replicas(params, state, 6, node_size=4)
    pending = state._replace(pending_valid=jnp.ones_like(state.pending_valid))
    with pytest.raises(ValueError, match="pending_valid"):
        od.resize_replicas(params, pending, 8, node_size=4)
    _, resized = od.resize_replicas(params, state, 8, node_size=4)
    assert resized.send_group.shape == (8,)


def test_replicated_state_that_differs_is_refused():
    params, state = _state("allreduce", 4)
    ledger = state.allreduce_ledger
    bad = state._replace(
        allreduce_ledger=od.CommLedger((jnp.arange(4, dtype=jnp.int32),), ledger.kinds, ledger.payloads)
    )
    _, out = od.resize_replicas(params, bad, 2)  # ledgers may differ (gossip): by slot
    np.testing.assert_array_equal(out.allreduce_ledger.counts[0], [0, 1])
    params, state = _state("compressed_top_k", 4)
    step = state.compress_step.at[1].add(1)
    with pytest.raises(ValueError, match=r"opt_state\.compress_step: replicated state differs"):
        od.resize_replicas(params, state._replace(compress_step=step), 2)


def test_bad_arguments():
    params, state = _state("allreduce", 4)
    with pytest.raises(ValueError, match="new_n=0"):
        od.resize_replicas(params, state, 0)
    with pytest.raises(ValueError, match="stacked over the same leading replica axis"):
        od.resize_replicas(params, {"x": np.zeros(3)}, 2)
    _, _, tx2 = compiled("powersgd", "vmap", 2)
    like = jax.eval_shape(jax.vmap(tx2.init), od.replicate(params_row(), 2))
    with pytest.raises(ValueError, match="structure of like="):
        od.resize_replicas(params, state, 2, like=like)
    params, state = _state("powersgd", 4)
    _, _, tx = compiled("powersgd", "vmap", 2)
    row = jax.eval_shape(tx.init, params_row())  # one replica's state: not stacked
    with pytest.raises(ValueError, match=r"like= has .* \(like= is stacked: a leading axis of new_n=2\)"):
        od.resize_replicas(params, state, 2, like=row)


def test_sgp_resize_is_the_push_sum_average():
    """Parameters become Σ w z / Σ w (mass in flight included), weights 1, nothing in flight."""
    params, state = _state("sgp_overlap", 4)
    w = np.asarray([1.0, 0.5, 2.0, 0.5], np.float32)
    late_w = np.asarray([0.0, 0.5, 0.0, 0.0], np.float32)
    late_x = [np.zeros_like(np.asarray(x)) for x in state.sync_state.in_flight[0]]
    late_x = [x + np.arange(4, dtype=np.float32).reshape((4,) + (1,) * (x.ndim - 1)) for x in late_x]
    state = state._replace(sync_state=od.PushSumState(ps_weight=w, in_flight=(late_x, late_w)))
    leaves = [np.asarray(x) for x in jax.tree.leaves(params)]
    new_params, new_state = od.resize_replicas(params, state, 2, topology=od.topology.ring)
    for z, lx, new in zip(leaves, late_x, jax.tree.leaves(new_params)):
        wz = z.astype(np.float64) * w.reshape((-1,) + (1,) * (z.ndim - 1))
        want = ((wz + lx).sum(0) / (w.sum() + late_w.sum())).astype(np.float32)
        np.testing.assert_array_equal(new, np.stack([want, want]))
    np.testing.assert_array_equal(new_state.sync_state.ps_weight, [1.0, 1.0])
    assert all(not np.any(x) for x in jax.tree.leaves(new_state.sync_state.in_flight))


def test_sharded_slowmo_reblocks_the_anchor():
    """8 blocks of ceil(P/8) → 4 blocks of ceil(P/4): the concatenated anchor is the same vector."""
    xs, ys = replica_data(8, STEPS, seed=3)
    name = "slowmo_memory_efficient"
    params, state = run_steps(name, "vmap", 8, fresh(name, "vmap", 8), 0, STEPS, xs, ys)
    size = sum(x[0].size for x in jax.tree.leaves(params))
    _, new_state = od.resize_replicas(params, state, 4)
    old = np.asarray(state.sync_state.anchors[0]).reshape(-1)[:size]
    new = np.asarray(new_state.sync_state.anchors[0])
    assert new.shape == (4, -(-size // 4))
    np.testing.assert_array_equal(new.reshape(-1)[:size], old)
    # and the flat anchor is the (synchronised) parameters
    flat = np.concatenate([np.asarray(x)[0].reshape(-1) for x in jax.tree.leaves(params)])
    np.testing.assert_array_equal(old, flat)


def test_per_replica_prng_keys_are_handled_deterministically():
    """Typed keys that differ between replicas: kept by slot when shrinking, folded when growing
    (no two new replicas share a key); identical keys stay identical."""
    keys = jax.random.split(jax.random.key(0), 4)
    shared = jnp.stack([jax.random.key(1)] * 4)
    tree = {"keys": keys, "shared": shared, "w": np.ones((4, 2), np.float32)}
    small, _ = od.resize_replicas(tree, (), 2)
    assert np.array_equal(jax.random.key_data(small["keys"]), jax.random.key_data(keys[:2]))
    big, _ = od.resize_replicas(tree, (), 8)
    data = np.asarray(jax.random.key_data(big["keys"]))
    assert len({tuple(r) for r in data}) == 8
    np.testing.assert_array_equal(data[:4], jax.random.key_data(keys))
    np.testing.assert_array_equal(data[5], jax.random.key_data(jax.random.fold_in(keys[1], 1)))
    again, _ = od.resize_replicas(tree, (), 8)
    np.testing.assert_array_equal(jax.random.key_data(again["keys"]), data)
    shared8 = np.asarray(jax.random.key_data(big["shared"]))
    assert all(np.array_equal(shared8[0], r) for r in shared8)


@pytest.mark.slow  # DASO compiles slowly (~10 s on 2 loaded cores); its rules run by default above
@pytest.mark.parametrize("nodes", [(2, 1), (2, 3)], ids=["2to1nodes", "2to3nodes"])
def test_hierarchical_daso_changes_its_number_of_nodes(nodes):
    """DASO on nodes of G=4 replicas: 2 nodes saved at the end of a cycling epoch, 1 or 3 nodes
    restored; the next epoch ends with every replica identical."""
    G, spe = 4, 4
    old, new = nodes

    def run(num_nodes, state, steps, seed):
        h = od.axis_hierarchy(num_nodes, G)
        tx = od.daso(
            optax.sgd(0.05, momentum=0.9),
            local_comm=h.local,
            cross_comm=h.cross,
            steps_per_epoch=spe,
            total_epochs=6,
            warmup_epochs=1,
            cooldown_epochs=0,
            first_cycle=(2, 1, 1),
        )
        n = num_nodes * G
        if state is None:
            params = od.replicate(params_row(), n)
            state = (params, od.simulate(tx.init, axis_name=("node", "local"), shape=(num_nodes, G))(params))
        step = od.simulate(step_fn(tx), axis_name=("node", "local"), shape=(num_nodes, G))
        xs, ys = replica_data(n, steps, seed=seed)
        for t in range(steps):
            state = step(*state, xs[t], ys[t])
        like = jax.eval_shape(tx.init, params_row())
        return jax.tree.map(np.asarray, state), like

    (params, state), _ = run(old, None, 2 * spe, 7)  # warm-up epoch, then one cycling epoch
    assert int(state.global_skip[0]) == 2 and not state.pending_valid.any()
    new_params, new_state = od.resize_replicas(params, state, new * G, node_size=G)
    assert new_state.pending_sum["w"].shape == (new * G, 3, 2) and not new_state.pending_sum["w"].any()
    np.testing.assert_array_equal(new_state.global_skip, state.global_skip[:1].repeat(new * G))
    (params2, state2), like = run(new, (new_params, new_state), spe, 8)
    od.assert_replicas_identical(params2)  # DASO: every replica holds the same model at an epoch end
    assert jax.tree.structure(state2) == jax.tree.structure(like)
    assert int(state2.epoch[0]) == 3


def test_sharded_outer_state_over_part_of_the_parameters_is_refused():
    comm = od.AxisComm(od.REPLICA_AXIS)
    outer = od.diloco(optax.sgd(0.1), comm=comm, period=2, num_shards=8)
    tx = optax.multi_transform({"d": outer, "s": optax.sgd(0.1)}, {"w": "d", "b": "s"})
    params = od.replicate({"w": jnp.ones((3, 4)), "b": jnp.zeros((5,))}, 8)
    state = od.simulate(tx.init)(params)
    with pytest.raises(ValueError, match="does not cover the 17 elements of params"):
        od.resize_replicas(params, state, 4)
