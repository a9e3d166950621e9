"""Topology constructors: generic static graphs and fairscale's gossip graph classes.

Every constructor returns a ``Topology`` (static data); see ``optaxdist.topology.base`` for the
mixing convention (``x⁺ = W x``, row ``i`` = what node ``i`` receives).

Generic graphs (static: one round, every edge every step):

* ``ring(n, directed=False)``, ``exponential(n, directed=False, base=2)`` (BlueFog
  ``RingGraph`` / ``ExponentialGraph`` / ``SymmetricExponentialGraph``), ``torus(n, rows, cols)``
  (BlueFog ``MeshGrid2DGraph`` with wrap-around), ``complete(n)``, ``star(n)`` and
  ``from_neighbors(neighbors)`` (mlbench ``DecentralizedAggregation``).

fairscale graphs (``graph_manager.py``; named after the classes, one peer slot per
``peers_per_itr``, rotating through each rank's "phone book" every round):

* ``dynamic_directed_exponential_graph``, ``npeer_dynamic_directed_exponential_graph`` (the SGP
  default), ``dynamic_bipartite_exponential_graph``, ``dynamic_directed_linear_graph``,
  ``dynamic_bipartite_linear_graph``, ``ring_graph``.

By default the fairscale schedules are *corrected*: the phone book keeps each distinct peer once
(what ``_add_peers`` intends) and ``⌊log_b(n − 1)⌋`` is computed exactly in integers. With
``fairscale_compat=True`` they reproduce fairscale bit for bit, including its two bugs
(``reference/seeds_spec.md`` §6):

* F1: ``_add_peers`` compares an ``int`` with ``Edge`` objects, so duplicate peers stay in the
  phone book and are visited again (e.g. ``DynamicDirectedExponentialGraph(8)`` visits ``r+4`` twice
  per period of 6);
* F2: ``int(math.log(n - 1, b))`` under-counts at exact powers for ``b ≠ 2``
  (``int(math.log(243, 3)) == 4``), dropping the last exponential level (n = 244, k = 2).

References:
  fairscale ``fairscale/experimental/nn/data_parallel/gossip/graph_manager.py``;
  BlueFog ``bluefog/common/topology_util.py``; mlbench-core
  ``mlbench_core/aggregation/pytorch/decentralized.py``; Assran et al., ICML 2019 (SGP);
  Lian et al., NeurIPS 2017 (D-PSGD).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from optaxdist.topology.base import Pair, Permutation, Round, Topology, _as_int, uniform_round

__all__ = [
    "complete",
    "dynamic_bipartite_exponential_graph",
    "dynamic_bipartite_linear_graph",
    "dynamic_directed_exponential_graph",
    "dynamic_directed_linear_graph",
    "exponential",
    "from_neighbors",
    "npeer_dynamic_directed_exponential_graph",
    "ring",
    "ring_graph",
    "star",
    "torus",
]


# ---- helpers ------------------------------------------------------------------------------------


def _check_n(n: object, who: str, *, even: bool = False) -> int:
    n = _as_int(n, "n")
    if n < 2:
        raise ValueError(f"{who}: n={n} is invalid; allowed: n >= 2 nodes")
    if even and n % 2:
        raise ValueError(
            f"{who}: n={n} is odd; allowed: even n >= 2 (a bipartite graph pairs the even "
            "(passive) ranks with the odd (active) ranks; odd n gives phone books of different "
            "lengths and inconsistent in/out edges in fairscale)"
        )
    return n


def _shift(n: int, offset: int) -> Permutation:
    """The circulant permutation ``r → r + offset (mod n)``."""
    return tuple((r, (r + offset) % n) for r in range(n))


def _distinct_offsets(n: int, offsets: Sequence[int]) -> list[int]:
    """Offsets mod n, first occurrence kept, 0 (self) dropped."""
    out: list[int] = []
    for o in offsets:
        o %= n
        if o and o not in out:
            out.append(o)
    return out


def _static(n: int, perms: Sequence[Permutation], name: str, *, convention: str = "receiver") -> Topology:
    return Topology(n, (uniform_round(n, perms, convention=convention),), name=name)


def _floor_log(x: int, base: int, compat: bool) -> int:
    """``⌊log_base(x)⌋`` for ``x >= 1``: exact in integers, or fairscale's ``int(math.log(x, base))``."""
    if compat:
        return int(math.log(x, base))
    e, p = 0, base
    while p <= x:
        e, p = e + 1, p * base
    return e


# ---- generic static graphs ----------------------------------------------------------------------


def ring(n: int, *, directed: bool = False) -> Topology:
    """Ring: node ``r`` exchanges with ``r ± 1`` (undirected) or sends to ``r + 1`` (directed).

    One static round with uniform weights ``1/(d+1)`` (``d`` = 2, or 1 when directed or ``n = 2``):
    ``W = (I + P + Pᵀ)/3`` or ``(I + P)/2`` with ``P`` the cyclic shift. Doubly stochastic.
    Spectral gap ``1 − (1 + 2cos(2π/n))/3`` (undirected) or ``1 − cos(π/n)`` (directed).

    Example: ``ring(8).peers(0, node=0) == ([1, 7], [7, 1])``.
    """
    n = _check_n(n, "ring")
    offsets = _distinct_offsets(n, [1] if directed else [1, -1])
    return _static(n, [_shift(n, o) for o in offsets], f"ring{'(directed)' if directed else ''}")


def exponential(n: int, *, directed: bool = False, base: int = 2) -> Topology:
    """Static exponential graph: node ``r`` sends to ``r + base^i`` for every ``base^i <= n − 1``
    (directed; BlueFog ``ExponentialGraph`` / ``ExponentialTwoGraph``), or exchanges with
    ``r ± base^i`` (undirected; BlueFog ``SymmetricExponentialGraph``).

    One round with all ``⌊log_base(n−1)⌋ + 1`` (directed) peers, uniform weights ``1/(d+1)``;
    circulant, hence regular and doubly stochastic. For the *dynamic* one-peer-per-round version
    (SGP's default) see ``npeer_dynamic_directed_exponential_graph``.
    """
    n = _check_n(n, "exponential")
    base = _as_int(base, "base")
    if base < 2:
        raise ValueError(f"exponential: base={base} is invalid; allowed: base >= 2")
    powers = [base**i for i in range(_floor_log(n - 1, base, compat=False) + 1)]
    signed = powers if directed else [s * p for p in powers for s in (1, -1)]
    offsets = _distinct_offsets(n, signed)
    label = "exponential" + ("(directed)" if directed else "") + ("" if base == 2 else f"(base={base})")
    return _static(n, [_shift(n, o) for o in offsets], label)


def torus(n: int, *, rows: int | None = None, cols: int | None = None) -> Topology:
    """2-D torus: ``rows × cols`` grid (node ``r = row·cols + col``) with wrap-around; node ``r``
    exchanges with its left/right/up/down neighbours.

    Without ``rows``/``cols`` the most square factorisation is used (BlueFog ``MeshGrid2DGraph``).
    A side of length 2 gives one neighbour in that direction, a side of length 1 none. Uniform
    weights ``1/(d+1)``; vertex-transitive, hence regular and doubly stochastic.

    Raises:
      ValueError: if ``rows × cols != n`` (or the one given does not divide ``n``).
    """
    n = _check_n(n, "torus")
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    if rows is not None:
        rows = _as_int(rows, "rows")
    if cols is not None:
        cols = _as_int(cols, "cols")
    if rows is None and cols is None:
        rows = max(d for d in divisors if d * d <= n)
    if rows is None:
        assert cols is not None
        if cols < 1 or n % cols:
            raise ValueError(f"torus(n={n}, cols={cols}): cols must divide n; allowed: {divisors}")
        rows = n // cols
    if cols is None:
        if rows < 1 or n % rows:
            raise ValueError(f"torus(n={n}, rows={rows}): rows must divide n; allowed: {divisors}")
        cols = n // rows
    if rows < 1 or cols < 1 or rows * cols != n:
        raise ValueError(f"torus(n={n}, rows={rows}, cols={cols}): rows * cols must equal n")

    def move(dr: int, dc: int) -> Permutation:
        return tuple(
            (r * cols + c, ((r + dr) % rows) * cols + (c + dc) % cols)
            for r in range(rows)
            for c in range(cols)
        )

    perms: list[Permutation] = []
    for p in (move(0, 1), move(0, -1), move(1, 0), move(-1, 0)):
        if all(s != d for s, d in p) and p not in perms:
            perms.append(p)
    return _static(n, perms, f"torus({rows}x{cols})")


def complete(n: int) -> Topology:
    """Complete graph: every node exchanges with every other node (``n − 1`` slots, offsets
    ``1 … n−1``); weights ``1/n`` give ``W = 11ᵀ/n`` — exact averaging in one round (spectral gap
    1), at the cost of an all-to-all."""
    n = _check_n(n, "complete")
    return _static(n, [_shift(n, o) for o in range(1, n)], "complete")


def star(n: int) -> Topology:
    """Star with hub 0: leaf ``j`` exchanges with the hub. ``n − 1`` slots (slot ``s`` pairs the hub
    with leaf ``s + 1`` both ways).

    Irregular: uniform weights ``1/(d+1)`` (hub ``1/n``, leaves ``1/2``) are row-stochastic but not
    column-stochastic, so plain gossip converges to a *weighted* average that over-weights the hub.
    Use ``star(n).metropolis()`` for a doubly stochastic ``W`` (hub–leaf weight ``1/n``).
    """
    n = _check_n(n, "star")
    return _static(n, [((0, s), (s, 0)) for s in range(1, n)], "star")


def _edge_colouring(n: int, edges: Sequence[Pair]) -> list[Permutation]:
    """Split directed edges into permutations (each node at most once as source and as destination
    per permutation) using ``Δ`` of them, ``Δ`` = the largest in- or out-degree (König's theorem:
    a proper edge colouring of the bipartite graph sources × destinations, by alternating paths)."""
    by_src: list[dict[int, int]] = []  # colour -> {src: dst}
    by_dst: list[dict[int, int]] = []  # colour -> {dst: src}

    def free_src(u: int) -> int:
        for c, m in enumerate(by_src):
            if u not in m:
                return c
        by_src.append({})
        by_dst.append({})
        return len(by_src) - 1

    def free_dst(v: int) -> int:
        for c, m in enumerate(by_dst):
            if v not in m:
                return c
        by_src.append({})
        by_dst.append({})
        return len(by_dst) - 1

    for u, v in edges:
        a, b = free_src(u), free_dst(v)
        if v in by_dst[a]:
            # Swap colours a <-> b along the path v -a- u1 -b- v2 -a- u2 ... (it cannot reach u,
            # which has no a-edge), freeing a at v.
            path: list[tuple[int, int, int]] = []
            node, colour, at_dst = v, a, True
            while True:
                if at_dst:
                    if node not in by_dst[colour]:
                        break
                    src = by_dst[colour][node]
                    path.append((src, node, colour))
                    node = src
                else:
                    if node not in by_src[colour]:
                        break
                    dst = by_src[colour][node]
                    path.append((node, dst, colour))
                    node = dst
                colour = b if colour == a else a
                at_dst = not at_dst
            for s, d, c in path:
                del by_src[c][s]
                del by_dst[c][d]
            for s, d, c in path:
                c2 = b if c == a else a
                by_src[c2][s] = d
                by_dst[c2][d] = s
        by_src[a][u] = v
        by_dst[a][v] = u
    return [tuple(sorted(m.items())) for m in by_src if m]


def from_neighbors(neighbors: Sequence[Sequence[int]], *, directed: bool = False) -> Topology:
    """A static topology from per-node neighbour lists (mlbench ``DecentralizedSGD(rank,
    neighbors)`` / ``DecentralizedAggregation``).

    Undirected (default): ``neighbors[i]`` are the nodes ``i`` exchanges with; the relation must
    be symmetric (mlbench does not check; an unmatched ``isend`` hangs). Weights are mlbench's
    ``1/(d_i + 1)`` at the receiver: row-stochastic, doubly stochastic only if every node has the
    same degree; call ``.metropolis()`` on an irregular graph.

    Directed (``directed=True``): ``neighbors[i]`` are the nodes ``i`` *sends* to. Weights are the
    sender's ``1/(d_out + 1)`` (fairscale ``UniformMixing``): column-stochastic, the push-sum
    convention (de-bias with the push-sum weight ``z = x / w``).

    The edges are packed into ``Δ`` permutations (``Δ`` = the largest degree) by a bipartite edge
    colouring, so one round costs ``Δ`` ``comm.permute`` calls.

    Raises:
      ValueError: on ``n < 2``, an out-of-range or repeated neighbour, a node listing itself, or
        (undirected) an asymmetric relation.
    """
    n = _check_n(len(neighbors), "from_neighbors")
    edges: list[Pair] = []
    for i, nb in enumerate(neighbors):
        nb = [_as_int(j, f"neighbors[{i}] entry") for j in nb]
        for j in nb:
            if not 0 <= j < n:
                raise ValueError(f"neighbors[{i}] contains {j}, out of range for n={n}")
            if j == i:
                raise ValueError(f"neighbors[{i}] contains {i} itself; allowed: other nodes only")
        if len(set(nb)) != len(nb):
            raise ValueError(f"neighbors[{i}]={nb} repeats a neighbour")
        edges += [(i, j) for j in nb]
    if not directed:
        es = set(edges)
        missing = [(i, j) for i, j in edges if (j, i) not in es]
        if missing:
            i, j = missing[0]
            raise ValueError(
                f"neighbors is not symmetric: {j} is in neighbors[{i}] but {i} is not in "
                f"neighbors[{j}]; fix the lists or pass directed=True"
            )
    perms = _edge_colouring(n, sorted(edges))
    convention = "sender" if directed else "receiver"
    name = "from_neighbors(directed)" if directed else "from_neighbors"
    return _static(n, perms, name, convention=convention)


# ---- fairscale graph classes --------------------------------------------------------------------


def _fairscale(
    name: str,
    n: int,
    peers_per_itr: int,
    fairscale_compat: bool,
    book: Callable[[int], list[int]],
    *,
    dynamic: bool = True,
) -> Topology:
    """Simulate fairscale's ``GraphManager``: per-rank phone books, ``peers_per_itr`` group indices
    advanced by ``peers_per_itr`` (mod the book length) after every round on dynamic graphs.
    Weights: ``UniformMixing``, ``1/(k+1)`` for self and for every slot."""
    k = _as_int(peers_per_itr, "peers_per_itr")
    if k < 1:
        raise ValueError(f"{name}: peers_per_itr={k} is invalid; allowed: 1 <= peers_per_itr")
    books = []
    for r in range(n):
        raw = [p % n for p in book(r)]
        if fairscale_compat:
            if r in raw:
                raise ValueError(
                    f"{name}(n={n}, peers_per_itr={k}, fairscale_compat=True): rank {r}'s phone "
                    "book contains itself (fairscale would build a 2-rank process group from one "
                    "rank and hang); use fairscale_compat=False or another n / peers_per_itr"
                )
            books.append(raw)
        else:
            books.append([p for i, p in enumerate(raw) if p != r and p not in raw[:i]])
    length = len(books[0])
    if any(len(b) != length for b in books):
        raise ValueError(f"{name}(n={n}): phone books of different lengths {[len(b) for b in books]}")
    if k > length:
        raise ValueError(
            f"{name}(n={n}): peers_per_itr={k} exceeds the {length} "
            f"{'' if fairscale_compat else 'distinct '}peers in each phone book; "
            f"allowed: 1 <= peers_per_itr <= {length}"
        )
    group = list(range(k))
    seen: set[tuple[int, ...]] = set()
    rounds = []
    w = 1.0 / (k + 1)
    while tuple(group) not in seen:
        seen.add(tuple(group))
        perms = tuple(tuple((r, books[r][g]) for r in range(n)) for g in group)
        rounds.append(Round(perms, tuple((w,) * n for _ in perms), (w,) * n))
        if not dynamic:
            break
        group = [(g + k) % length for g in group]
    label = name + ("(fairscale_compat)" if fairscale_compat else "")
    if k != 1:
        label += f"(peers_per_itr={k})"
    return Topology(n, tuple(rounds), name=label)


def dynamic_directed_exponential_graph(
    n: int, *, peers_per_itr: int = 1, fairscale_compat: bool = False
) -> Topology:
    """fairscale ``DynamicDirectedExponentialGraph``: phone book of rank ``r`` is
    ``r + 2^i, r − 2^i`` for ``i = 0 … ⌊log₂(n−1)⌋``; one slot per ``peers_per_itr``, rotating.

    Corrected (default): distinct peers only, e.g. ``n = 8``: ``[+1, −1, +2, −2, +4]`` (period 5).
    ``fairscale_compat=True`` keeps the duplicate ``r − 4 ≡ r + 4`` (F1): ``+1, −1, +2, −2, +4, +4``
    (period 6). Weights ``1/(k+1)``; every slot is a cyclic shift, so each round is doubly
    stochastic.
    """
    n = _check_n(n, "dynamic_directed_exponential_graph")
    levels = _floor_log(n - 1, 2, fairscale_compat)
    return _fairscale(
        "dynamic_directed_exponential_graph",
        n,
        peers_per_itr,
        fairscale_compat,
        lambda r: [p for i in range(levels + 1) for p in (r + 2**i, r - 2**i)],
    )


def npeer_dynamic_directed_exponential_graph(
    n: int, *, peers_per_itr: int = 1, fairscale_compat: bool = False
) -> Topology:
    """fairscale ``NPeerDynamicDirectedExponentialGraph`` (SGP's default graph): with
    ``k = peers_per_itr``, the phone book of ``r`` is ``r + j·(k+1)^i`` for
    ``i = 0 … ⌊log_{k+1}(n−1)⌋`` and ``j = 1 … k``; each round uses the next ``k`` entries.

    ``n = 8, k = 1``: rounds ``+1, +2, +4`` (period 3; exact averaging for ``n = 2^m``).
    ``n = 8, k = 2``: rounds ``{+1, +2}``, ``{+3, +6}``.
    Corrected (default): exact integer ``⌊log⌋``, repeated offsets (mod n) kept once and offsets
    ``≡ 0 (mod n)`` dropped. ``fairscale_compat=True`` uses ``int(math.log(n − 1, k + 1))`` (F2:
    ``n = 244, k = 2`` loses the ``3^5`` level) and keeps repeated offsets (F1); an offset
    ``≡ 0`` would make fairscale hang, so it raises.
    """
    n = _check_n(n, "npeer_dynamic_directed_exponential_graph")
    k = _as_int(peers_per_itr, "peers_per_itr")
    if k < 1:
        raise ValueError(
            f"npeer_dynamic_directed_exponential_graph: peers_per_itr={k} is invalid; allowed: >= 1"
        )
    levels = _floor_log(n - 1, k + 1, fairscale_compat)
    return _fairscale(
        "npeer_dynamic_directed_exponential_graph",
        n,
        k,
        fairscale_compat,
        lambda r: [r + j * (k + 1) ** i for i in range(levels + 1) for j in range(1, k + 1)],
    )


def _bipartite_book(r: int, n: int, distances: Sequence[int]) -> list[int]:
    """fairscale's bipartite rule: even ranks are passive; add ``r ± d`` only if both peers are on
    the other side."""
    out: list[int] = []
    passive = r % 2 == 0
    for d in distances:
        f, b = (r + d) % n, (r - d) % n
        if (not passive and f % 2 == 0 and b % 2 == 0) or (passive and f % 2 == 1 and b % 2 == 1):
            out += [f, b]
    return out


def dynamic_bipartite_exponential_graph(
    n: int, *, peers_per_itr: int = 1, fairscale_compat: bool = False
) -> Topology:
    """fairscale ``DynamicBipartiteExponentialGraph`` (for PushPull): distances ``d = 1`` and
    ``d = 1 + 2^i`` for ``i = 1 … ⌊log₂(n−1)⌋``; rank ``r`` adds ``r ± d`` only if both are on the
    other side (even ranks passive, odd active), i.e. ``d`` odd for even ``n``.

    ``n = 8`` compat (F1): offsets ``+1, −1, +3, −3, +5, −5`` = ``+1, +7, +3, +5, +5, +3`` (period 6);
    corrected: ``+1, +7, +3, +5`` (period 4).

    Raises:
      ValueError: for odd ``n`` (allowed: even ``n >= 2``).
    """
    n = _check_n(n, "dynamic_bipartite_exponential_graph", even=True)
    levels = _floor_log(n - 1, 2, fairscale_compat)
    distances = [1 if i == 0 else 1 + 2**i for i in range(levels + 1)]
    return _fairscale(
        "dynamic_bipartite_exponential_graph",
        n,
        peers_per_itr,
        fairscale_compat,
        lambda r: _bipartite_book(r, n, distances),
    )


def dynamic_directed_linear_graph(
    n: int, *, peers_per_itr: int = 1, fairscale_compat: bool = False
) -> Topology:
    """fairscale ``DynamicDirectedLinearGraph``: phone book ``r + i, r − i`` for odd ``i`` in
    ``1 … n−1``.

    ``n = 8`` compat (F1): ``+1, +7, +3, +5, +5, +3, +7, +1`` (period 8; every odd offset twice);
    corrected: ``+1, +7, +3, +5`` (period 4). Only odd offsets: for even ``n`` the union graph is
    bipartite (odd ↔ even ranks).
    """
    n = _check_n(n, "dynamic_directed_linear_graph")
    return _fairscale(
        "dynamic_directed_linear_graph",
        n,
        peers_per_itr,
        fairscale_compat,
        lambda r: [p for i in range(1, n, 2) for p in (r + i, r - i)],
    )


def dynamic_bipartite_linear_graph(
    n: int, *, peers_per_itr: int = 1, fairscale_compat: bool = False
) -> Topology:
    """fairscale ``DynamicBipartiteLinearGraph`` (for PushPull): ``r ± i`` for ``i = 1 … n−1`` with
    the bipartite rule of ``dynamic_bipartite_exponential_graph``; for even ``n`` the same schedule
    as ``dynamic_directed_linear_graph``.

    Raises:
      ValueError: for odd ``n`` (allowed: even ``n >= 2``).
    """
    n = _check_n(n, "dynamic_bipartite_linear_graph", even=True)
    return _fairscale(
        "dynamic_bipartite_linear_graph",
        n,
        peers_per_itr,
        fairscale_compat,
        lambda r: _bipartite_book(r, n, range(1, n)),
    )


def ring_graph(n: int, *, peers_per_itr: int = 1, fairscale_compat: bool = False) -> Topology:
    """fairscale ``RingGraph``: phone book ``r + 1, r − 1``, **static** (no rotation): always the
    first ``peers_per_itr`` entries. ``peers_per_itr=1`` is ``ring(n, directed=True)``,
    ``peers_per_itr=2`` is ``ring(n)`` (for ``n >= 3``).

    ``n = 2``: corrected phone book ``[1]`` (``peers_per_itr`` must be 1); compat keeps ``[1, 1]``
    (F1), so ``peers_per_itr=2`` sends to the same peer twice.
    """
    n = _check_n(n, "ring_graph")
    return _fairscale(
        "ring_graph", n, peers_per_itr, fairscale_compat, lambda r: [r + 1, r - 1], dynamic=False
    )
