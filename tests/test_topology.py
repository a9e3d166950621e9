"""Gossip topologies: fairscale schedules (compat and corrected), validity for ``comm.permute``,
stochasticity, spectral gaps, Metropolis weights, consensus and push-sum in NumPy, drawing."""

import dataclasses
import math

import numpy as np
import pytest

from optaxdist import topology as topo
from optaxdist.comm.base import _check_permutation
from optaxdist.topology.__main__ import catalog, table

FAIRSCALE = {
    "npeer": topo.npeer_dynamic_directed_exponential_graph,
    "dde": topo.dynamic_directed_exponential_graph,
    "dbe": topo.dynamic_bipartite_exponential_graph,
    "ddl": topo.dynamic_directed_linear_graph,
    "dbl": topo.dynamic_bipartite_linear_graph,
    "ring": topo.ring_graph,
}

# Out-peer offsets per round (out-peer of r is r + o, in-peer is r - o), peers_per_itr = 1.
# fairscale_compat=True: reference/seeds_spec.md §2.7 worked examples; the n = 4 rows of DBE, DDL,
# DBL and Ring follow from the phone-book formulas of the same table (book written out below).
COMPAT = {
    (8, "npeer"): [1, 2, 4],
    (8, "dde"): [1, -1, 2, -2, 4, 4],  # book [r+1, r-1, r+2, r-2, r+4, r+4]: duplicate kept (F1)
    (8, "dbe"): [1, -1, 3, 5, 5, 3],  # book [r±1, r±3, r±5], r-3 = r+5
    (8, "ddl"): [1, -1, 3, 5, 5, 3, 7, 1],  # book [r±1, r±3, r±5, r±7]
    (8, "dbl"): [1, -1, 3, 5, 5, 3, 7, 1],  # same as DDL for even n
    (8, "ring"): [1],  # static
    (4, "npeer"): [1, 2],
    (4, "dde"): [1, -1, 2, 2],
    (4, "dbe"): [1, 3, 3, 1],  # book [r+1, r-1, r+3, r-3]
    (4, "ddl"): [1, 3, 3, 1],  # book [r+1, r-1, r+3, r-3]
    (4, "dbl"): [1, 3, 3, 1],
    (4, "ring"): [1],
    (2, "npeer"): [1],
    (2, "dde"): [1, 1],  # book [1, 1]
    (2, "ring"): [1],  # book [1, 1], static: always index 0
}
# Default (corrected): each distinct peer once, in first-occurrence order; exact integer log.
CORRECTED = {
    (8, "npeer"): [1, 2, 4],
    (8, "dde"): [1, -1, 2, -2, 4],
    (8, "dbe"): [1, -1, 3, 5],
    (8, "ddl"): [1, -1, 3, 5],
    (8, "dbl"): [1, -1, 3, 5],
    (8, "ring"): [1],
    (4, "npeer"): [1, 2],
    (4, "dde"): [1, -1, 2],
    (4, "dbe"): [1, 3],
    (4, "ddl"): [1, 3],
    (4, "dbl"): [1, 3],
    (4, "ring"): [1],
    (2, "npeer"): [1],
    (2, "dde"): [1],
    (2, "ring"): [1],
}


def _offset_schedule(t: topo.Topology) -> list[list[int]]:
    """Per round, per slot: the offset o with out-peer r + o, checked identical for every r."""
    sched = []
    for rnd in range(t.period):
        offs = None
        for r in range(t.n):
            out, inn = t.peers(rnd, r)
            o = [(p - r) % t.n for p in out]
            assert [(r - q) % t.n for q in inn] == o, (t.name, rnd, r, out, inn)
            assert offs is None or o == offs, (t.name, rnd, r)
            offs = o
        sched.append(offs)
    return sched


@pytest.mark.parametrize(
    ("compat", "table_"), [(True, COMPAT), (False, CORRECTED)], ids=["compat", "corrected"]
)
@pytest.mark.parametrize("key", sorted(COMPAT))
def test_fairscale_schedules_match_spec_tables(key, compat, table_):
    n, cls = key
    t = FAIRSCALE[cls](n, fairscale_compat=compat)
    expected = [[o % n] for o in table_[key]]
    assert _offset_schedule(t) == expected
    assert t.period == len(expected)
    assert t.is_doubly_stochastic() and t.is_regular()
    w = t.mixing_matrix(0)
    assert np.allclose(np.diag(w), 0.5)  # UniformMixing: 1/(k+1) with k = 1


def test_npeer_two_peers_per_round_matches_spec():
    # seeds_spec §2.7: n=8, k=2: round0 out {r+1, r+2} in {r-1, r-2}; round1 out {r+3, r+6} in {r-3, r-6}
    for compat in (True, False):
        t = topo.npeer_dynamic_directed_exponential_graph(8, peers_per_itr=2, fairscale_compat=compat)
        assert _offset_schedule(t) == [[1, 2], [3, 6]]
        assert t.peers(0, 5) == ([6, 7], [4, 3])
        assert np.allclose(t.mixing_matrix(1)[0], np.eye(8)[0] / 3 + (np.eye(8)[5] + np.eye(8)[2]) / 3)


def test_fairscale_compat_keeps_duplicates_in_one_round():
    # F1 with peers_per_itr=2: DDE(8) book [+1,-1,+2,-2,+4,+4] -> the third round sends to r+4 twice.
    t = topo.dynamic_directed_exponential_graph(8, peers_per_itr=2, fairscale_compat=True)
    assert _offset_schedule(t) == [[1, 7], [2, 6], [4, 4]]
    assert t.peers(2, 0) == ([4, 4], [4, 4])
    assert np.isclose(t.mixing_matrix(2)[0, 4], 2 / 3) and t.is_doubly_stochastic()
    corrected = topo.dynamic_directed_exponential_graph(8, peers_per_itr=2)
    # book [+1,-1,+2,-2,+4] (length 5), indices advance by 2 mod 5: period 5, never a repeat.
    assert corrected.period == 5
    assert all(len(set(o)) == 2 for o in _offset_schedule(corrected))
    # ring_graph n=2: compat book [1, 1] allows peers_per_itr=2 (same peer twice); corrected has 1 peer.
    assert topo.ring_graph(2, peers_per_itr=2, fairscale_compat=True).peers(0, 0) == ([1, 1], [1, 1])
    with pytest.raises(ValueError, match="peers_per_itr=2 exceeds the 1 distinct peers"):
        topo.ring_graph(2, peers_per_itr=2)


def test_fairscale_compat_float_log_floor_error():
    # F2: int(math.log(243, 3)) == 4, so n = 244, k = 2 loses the 3^5 level (offsets 243, 486).
    assert int(math.log(243, 3)) == 4
    compat = topo.npeer_dynamic_directed_exponential_graph(244, peers_per_itr=2, fairscale_compat=True)
    fixed = topo.npeer_dynamic_directed_exponential_graph(244, peers_per_itr=2)
    offs = lambda t: {o for r in range(t.period) for o in t.peers(r, 0)[0]}
    assert offs(fixed) - offs(compat) == {243, 486 % 244}
    assert (compat.period, fixed.period) == (5, 6)
    # base 2 has no such error in this range: compat == corrected whenever no duplicates arise.
    for n in (2, 3, 5, 9, 17, 33, 65):
        assert topo.npeer_dynamic_directed_exponential_graph(n, fairscale_compat=True) == dataclasses.replace(
            topo.npeer_dynamic_directed_exponential_graph(n),
            name="npeer_dynamic_directed_exponential_graph(fairscale_compat)",
        )


def test_ring_graph_is_static_ring():
    directed = topo.ring(8, directed=True).mixing_matrix(0)
    assert topo.ring_graph(8).mixing_matrix(0).tolist() == directed.tolist()
    assert np.allclose(topo.ring_graph(8, peers_per_itr=2).mixing_matrix(0), topo.ring(8).mixing_matrix(0))


def _all_topologies():
    out = []
    for n in (4, 8):
        out += [(f"{k}@{n}", t) for k, t in catalog(n).items()]
    out += [
        ("torus12", topo.torus(12)),
        ("torus3x5", topo.torus(15, rows=3, cols=5)),
        ("torus1x4", topo.torus(4, rows=1)),
        ("ring2", topo.ring(2)),
        ("ring5", topo.ring(5)),
        ("exp_base3", topo.exponential(10, base=3)),
        ("npeer_k3_n5", topo.npeer_dynamic_directed_exponential_graph(5, peers_per_itr=3)),
        ("npeer_k2_n6", topo.npeer_dynamic_directed_exponential_graph(6, peers_per_itr=2)),
        (
            "npeer_k3_n5_compat",
            topo.npeer_dynamic_directed_exponential_graph(5, peers_per_itr=3, fairscale_compat=True),
        ),
        ("ddl_odd", topo.dynamic_directed_linear_graph(7, peers_per_itr=2)),
        ("neighbors", topo.from_neighbors([[1, 2, 3], [0], [0, 3], [0, 2]])),
        ("neighbors_directed", topo.from_neighbors([[1, 2], [2], [0, 3], [0]], directed=True)),
    ]
    return out


ALL = _all_topologies()


@pytest.mark.parametrize(("label", "t"), ALL, ids=[a for a, _ in ALL])
def test_every_round_is_valid_for_comm_permute(label, t):
    hash(t)
    for r in range(t.period):
        rnd = t.rounds[r]
        for perm in rnd.perms:
            assert _check_permutation(perm, t.n) == perm
        # receiver- and sender-indexed weights rebuild the same W.
        for how in (t.receive_weights, t.send_weights):
            self_w, slot_w = how(r)
            assert slot_w.shape == (rnd.num_slots, t.n)
            assert np.allclose(self_w, np.diag(t.mixing_matrix(r)))
        x = np.random.default_rng(r).normal(size=t.n)
        assert np.allclose(_gossip(t, r, x, "receiver"), t.mixing_matrix(r) @ x)
        assert np.allclose(_gossip(t, r, x, "sender"), t.mixing_matrix(r) @ x)


def _permute(x: np.ndarray, perm) -> np.ndarray:
    """NumPy model of ``comm.permute``: dst gets src's value, members receiving nothing get 0."""
    out = np.zeros_like(x)
    for s, d in perm:
        out[d] = x[s]
    return out


def _gossip(t, r, x, where):
    """One gossip round the way a transform would run it: one permute per slot."""
    if where == "receiver":
        self_w, slot_w = t.receive_weights(r)
        return self_w * x + sum(slot_w[s] * _permute(x, p) for s, p in enumerate(t.perms(r)))
    self_w, slot_w = t.send_weights(r)
    return self_w * x + sum(_permute(slot_w[s] * x, p) for s, p in enumerate(t.perms(r)))


def test_mixing_convention_rows_receive():
    t = topo.ring(4, directed=True)  # 0 -> 1 -> 2 -> 3 -> 0
    w = t.mixing_matrix(0)
    assert w[1, 0] == 0.5 and w[0, 1] == 0.0  # row 1 = node 1 receives from node 0
    assert t.peers(0, 1) == ([2], [0])
    assert t.round(5) is t.rounds[0]
    with pytest.raises(ValueError, match="round=-1"):
        t.round(-1)
    d = topo.from_neighbors([[1, 2], [2], [0, 3], [0]], directed=True)
    w = d.mixing_matrix(0)
    assert np.allclose(w.sum(axis=0), 1) and not np.allclose(w.sum(axis=1), 1)
    assert w[1, 0] == pytest.approx(1 / 3)  # node 0 has 2 out-peers: sends 1/3 to each, keeps 1/3
    assert d.is_column_stochastic() and not d.is_row_stochastic() and not d.is_doubly_stochastic()


DOUBLY = [(label, t) for label, t in ALL if t.is_doubly_stochastic()]


def test_which_topologies_are_not_doubly_stochastic():
    assert len(DOUBLY) >= len(ALL) - 4
    assert all("star" in label or not t.is_regular() for label, t in ALL if (label, t) not in DOUBLY)


@pytest.mark.parametrize(("label", "t"), DOUBLY, ids=[a for a, _ in DOUBLY])
def test_doubly_stochastic_gossip_reaches_the_average(label, t):
    x0 = np.random.default_rng(0).normal(size=(t.n, 3))
    mean = x0.mean(axis=0)
    m = t.period_matrix()
    gap = t.spectral_gap()
    assert gap > 0 and t.is_strongly_connected()
    x = x0
    for _ in range(3):  # the period contraction bound of the spectral gap
        new = m @ x
        assert np.linalg.norm(new - mean) <= (1 - gap) * np.linalg.norm(x - mean) + 1e-12
        x = new
    x = x0
    for step in range(400 * t.period):
        x = t.mixing_matrix(step) @ x
        assert np.allclose(x.mean(axis=0), mean)  # the average is preserved every round
    np.testing.assert_allclose(x, np.broadcast_to(mean, x.shape), atol=1e-8)


def test_spectral_gap_known_values():
    n = 8
    assert topo.ring(n, directed=True).spectral_gap() == pytest.approx(1 - math.cos(math.pi / n))
    assert topo.ring(n).spectral_gap() == pytest.approx(1 - (1 + 2 * math.cos(2 * math.pi / n)) / 3)
    assert topo.complete(n).spectral_gap() == pytest.approx(1.0)
    sgp = topo.npeer_dynamic_directed_exponential_graph(n)
    np.testing.assert_allclose(sgp.period_matrix(), np.full((n, n), 1 / n), atol=1e-15)
    assert sgp.spectral_gap() == 1.0 and sgp.spectral_gap(mode="per_round") == 1.0
    assert sgp.spectral_gap(0) == pytest.approx(1 - math.cos(math.pi / n))  # one round: a ring
    sv = np.linalg.svd(sgp.expected_matrix(), compute_uv=False)
    assert sgp.spectral_gap(mode="expected") == pytest.approx(1 - sv[1])
    dbe = topo.dynamic_bipartite_exponential_graph(n)
    assert dbe.spectral_gap(mode="per_round") == pytest.approx(1 - (1 - dbe.spectral_gap()) ** (1 / 4))
    with pytest.raises(ValueError, match="mode='x'"):
        sgp.spectral_gap(mode="x")


def test_metropolis_makes_irregular_graphs_doubly_stochastic():
    star = topo.star(6)
    assert star.is_row_stochastic() and not star.is_column_stochastic() and not star.is_regular()
    x0 = np.arange(6.0)
    x = x0
    for _ in range(500):
        x = star.mixing_matrix(0) @ x
    assert np.allclose(x, x[0]) and abs(x[0] - x0.mean()) > 0.1  # consensus, but on a biased value
    mh = star.metropolis()
    assert mh.is_doubly_stochastic() and np.allclose(mh.mixing_matrix(0), mh.mixing_matrix(0).T)
    w = mh.mixing_matrix(0)
    assert (w[0, 3], w[3, 3], w[0, 0]) == pytest.approx((1 / 6, 5 / 6, 1 / 6))
    x = x0
    for _ in range(500):
        x = mh.mixing_matrix(0) @ x
    np.testing.assert_allclose(x, x0.mean())
    g = topo.from_neighbors([[1, 2, 3], [0], [0, 3], [0, 2]])  # mlbench-style irregular graph
    assert not g.is_doubly_stochastic() and g.metropolis().is_doubly_stochastic()
    # W[i, j] = 1 / (1 + max(d_i, d_j)): d = (3, 1, 2, 2)
    assert g.metropolis().mixing_matrix(0)[2, 3] == pytest.approx(1 / 3)
    assert g.metropolis().mixing_matrix(0)[1, 0] == pytest.approx(1 / 4)
    # regular graphs: metropolis == uniform weights
    assert np.allclose(topo.torus(12).metropolis().mixing_matrix(0), topo.torus(12).mixing_matrix(0))
    with pytest.raises(ValueError, match="metropolis\\(\\) needs undirected rounds"):
        topo.ring(8, directed=True).metropolis()


def test_push_sum_on_irregular_directed_graphs_recovers_the_average():
    n = 5
    a = topo.from_neighbors([[1, 2], [2], [0, 3, 4], [0], [3]], directed=True)
    b = topo.from_neighbors([[4], [0, 3], [1], [1, 2, 4], [0]], directed=True)
    assert a.is_strongly_connected() and not a.is_regular() and not a.is_row_stochastic()
    dyn = topo.Topology(n, (a.rounds[0], b.rounds[0]), name="two directed graphs")
    assert dyn.is_column_stochastic() and not dyn.is_row_stochastic()
    x0 = np.random.default_rng(1).normal(size=n)
    for t in (a, dyn):
        x, w, plain = x0.copy(), np.ones(n), x0.copy()
        for step in range(300):
            # SGP: push-sum numerator and weight, scaled by the sender, summed by the receiver.
            x, w = _gossip(t, step, x, "sender"), _gossip(t, step, w, "sender")
            plain = t.mixing_matrix(step) @ plain
        assert np.isclose(x.sum(), x0.sum()) and np.isclose(w.sum(), n)  # mass is conserved
        np.testing.assert_allclose(x / w, x0.mean(), atol=1e-10)  # de-biased: the true average
        assert not np.allclose(plain, x0.mean(), atol=1e-3)  # without the weight: biased


def test_graph_properties():
    assert topo.dynamic_bipartite_exponential_graph(8).is_bipartite()
    assert topo.dynamic_directed_linear_graph(8).is_bipartite()
    assert not topo.exponential(8).is_bipartite()
    assert topo.ring(8).is_symmetric() and not topo.ring(8, directed=True).is_symmetric()
    assert topo.exponential(8).peers(0, 0) == ([1, 7, 2, 6, 4], [7, 1, 6, 2, 4])
    assert topo.exponential(8, directed=True).peers(0, 3) == ([4, 5, 7], [2, 1, 7])
    assert topo.torus(12).name == "torus(3x4)" and topo.torus(12).peers(0, 5) == ([6, 4, 9, 1], [4, 6, 1, 9])
    assert topo.torus(8).peers(0, 0) == ([1, 3, 4], [3, 1, 4])  # 2 rows: one vertical neighbour
    assert topo.torus(4, rows=1).mixing_matrix(0).tolist() == topo.ring(4).mixing_matrix(0).tolist()
    assert topo.complete(5).mixing_matrix(0) == pytest.approx(np.full((5, 5), 0.2))
    assert topo.star(4).peers(0, 0) == ([1, 2, 3], [1, 2, 3]) and topo.star(4).peers(0, 2) == ([0], [0])
    assert not topo.from_neighbors([[1], [0], [3], [2]]).is_strongly_connected()
    # from_neighbors packs edges into max-degree permutations (König): star(8)-like hub needs 7.
    hub = topo.from_neighbors([[1, 2, 3, 4, 5, 6, 7]] + [[0]] * 7)
    assert hub.rounds[0].num_slots == 7
    assert hub.mixing_matrix(0).tolist() == topo.star(8).mixing_matrix(0).tolist()
    g = topo.from_neighbors([[1, 2, 3], [0, 2], [0, 1, 3], [0, 2]])
    assert g.rounds[0].num_slots == 3


def test_topology_is_frozen_and_hashable():
    a, b = topo.ring(8), topo.ring(8)
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a != topo.ring(8, directed=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.n = 4
    r = topo.Round(perms=[[(0, 1), (1, 0)]], weights=[[0.5, 0.5]], self_weights=[0.5, 0.5])
    assert r.perms == (((0, 1), (1, 0)),) and topo.Topology(2, (r,)) == topo.Topology(2, [r])


def test_invalid_arguments_raise_clear_errors():
    constructors = [topo.ring, topo.exponential, topo.torus, topo.complete, topo.star, *FAIRSCALE.values()]
    for make in constructors:
        for n in (0, 1):
            with pytest.raises(ValueError, match=f"n={n} is invalid; allowed: n >= 2"):
                make(n)
        with pytest.raises(TypeError, match="n must be an int"):
            make(8.0)
    for make in (topo.dynamic_bipartite_exponential_graph, topo.dynamic_bipartite_linear_graph):
        with pytest.raises(ValueError, match=r"n=7 is odd; allowed: even n >= 2"):
            make(7)
    with pytest.raises(ValueError, match="peers_per_itr=0 is invalid"):
        topo.dynamic_directed_exponential_graph(8, peers_per_itr=0)
    with pytest.raises(ValueError, match="peers_per_itr=0 is invalid"):
        topo.npeer_dynamic_directed_exponential_graph(8, peers_per_itr=0)
    # k > available: DDE(4) has 3 distinct peers (compat: 4 with the duplicate)
    with pytest.raises(ValueError, match=r"peers_per_itr=4 exceeds the 3 distinct peers.*<= 3"):
        topo.dynamic_directed_exponential_graph(4, peers_per_itr=4)
    assert topo.dynamic_directed_exponential_graph(4, peers_per_itr=4, fairscale_compat=True).period == 1
    with pytest.raises(ValueError, match="peers_per_itr=3 exceeds the 2 distinct peers"):
        topo.ring_graph(8, peers_per_itr=3)
    # fairscale would put rank r in its own phone book (n=6, k=2: offset 6 = 0 mod 6) and hang.
    with pytest.raises(ValueError, match="contains itself"):
        topo.npeer_dynamic_directed_exponential_graph(6, peers_per_itr=2, fairscale_compat=True)
    assert _offset_schedule(topo.npeer_dynamic_directed_exponential_graph(6, peers_per_itr=2)) == [
        [1, 2],
        [3, 1],
        [2, 3],
    ]
    with pytest.raises(ValueError, match=r"torus\(n=8, rows=3\): rows must divide n; allowed: \[1, 2, 4, 8"):
        topo.torus(8, rows=3)
    with pytest.raises(ValueError, match="cols must divide n"):
        topo.torus(8, cols=5)
    with pytest.raises(ValueError, match=r"rows \* cols must equal n"):
        topo.torus(8, rows=2, cols=3)
    with pytest.raises(ValueError, match="base=1 is invalid"):
        topo.exponential(8, base=1)
    with pytest.raises(ValueError, match="not symmetric: 1 is in neighbors\\[0\\] but 0 is not"):
        topo.from_neighbors([[1], [2], [1]])
    with pytest.raises(ValueError, match="contains 1 itself"):
        topo.from_neighbors([[1], [1, 0]])
    with pytest.raises(ValueError, match="out of range"):
        topo.from_neighbors([[5], [0]])
    with pytest.raises(ValueError, match="repeats"):
        topo.from_neighbors([[1, 1], [0]])
    with pytest.raises(ValueError, match="n=1 is invalid"):
        topo.from_neighbors([[]])
    ok = topo.Round(perms=[[(0, 1), (1, 0)]], weights=[[0.5, 0.5]], self_weights=[0.5, 0.5])
    with pytest.raises(ValueError, match="at most once"):
        topo.Topology(3, (topo.Round([[(0, 1), (2, 1)]], [[0.5, 0.5]], [1, 0, 1]),))
    with pytest.raises(ValueError, match="self pair"):
        topo.Topology(2, (topo.Round([[(0, 0)]], [[0.5]], [0.5, 1]),))
    with pytest.raises(ValueError, match="out of range"):
        topo.Topology(2, (topo.Round([[(0, 2)]], [[0.5]], [0.5, 1]),))
    with pytest.raises(ValueError, match="2 self weights for n=3"):
        topo.Topology(3, (ok,))
    with pytest.raises(ValueError, match="2 pairs but 1 weights"):
        topo.Round([[(0, 1), (1, 0)]], [[0.5]], [0.5, 0.5])
    with pytest.raises(ValueError, match="finite and >= 0"):
        topo.Topology(2, (topo.Round([[(0, 1)]], [[-0.5]], [1, 1]),))
    with pytest.raises(ValueError, match="rounds is empty"):
        topo.Topology(2, ())


def test_table_and_draw(tmp_path):
    text = table(8)
    assert "| `star (metropolis)` | 1 | 7 | yes | yes | yes | no |" in text
    pytest.importorskip("matplotlib")
    path = tmp_path / "g.png"
    t = topo.dynamic_directed_exponential_graph(4, peers_per_itr=2, fairscale_compat=True)
    topo.draw(t, path, round=1)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
