"""``Topology``: a gossip graph as static data (per-round permutations and mixing weights).

A topology over ``n`` replicas is a periodic schedule of ``period`` *rounds*. Training step ``t``
uses round ``t mod period``. A round is a tuple of *slots*; each slot is one static permutation
``((src, dst), ...)`` — every member sends at most once and receives at most once — so a slot
lowers to exactly one ``comm.permute(tree, perm)`` (``lax.ppermute`` under ``vmap``/``shard_map``,
``sendrecv`` under MPI). A node with ``k`` out-peers in a round appears as a source in ``k`` slots.

Mixing convention (used everywhere in this package): the round's mixing matrix ``W`` acts on the
stacked replica values as ``x⁺ = W x``::

    x⁺_i = W[i, i] x_i + Σ_{(j → i) in the round} W[i, j] x_j

so **row i is what node i receives** (its new value) and **column j is what node j sends** (how its
old value is spread). Then

* row-stochastic (``W 1 = 1``): every new value is a weighted average of old ones; constants are
  fixed points (averaging consensus, D-PSGD);
* column-stochastic (``1ᵀ W = 1ᵀ``): ``Σ_i x_i`` is conserved (mass-preserving; push-sum / SGP
  applies the same column-stochastic ``W`` to the numerator ``x`` and the weight ``w`` and reads
  ``z = x / w``);
* doubly stochastic: both; repeated mixing drives every ``x_i`` to the exact average.

Each edge carries one weight ``W[dst, src]``. Because a slot sends from and to each member at most
once, that weight can be looked up by the *receiver* (``receive_weights``: scale what arrives) or by
the *sender* (``send_weights``: scale before sending, as push-sum does); both give the same ``W``.

References:
  * Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms? A Case Study for
    Decentralized Parallel Stochastic Gradient Descent", NeurIPS 2017 (D-PSGD).
  * Assran et al., "Stochastic Gradient Push for Distributed Deep Learning", ICML 2019 (SGP).
  * Xiao & Boyd, "Fast linear iterations for distributed averaging", 2004 (Metropolis–Hastings
    weights, spectral gap as the consensus rate).
  * fairscale ``experimental/nn/data_parallel/gossip/graph_manager.py`` and ``mixing_manager.py``.
  * BlueFog ``bluefog/common/topology_util.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Pair = tuple[int, int]
Permutation = tuple[Pair, ...]

__all__ = ["Permutation", "Round", "Topology"]


def _as_int(x: object, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int | np.integer):
        raise TypeError(f"{what} must be an int, got {x!r}")
    return int(x)


@dataclass(frozen=True)
class Round:
    """One gossip round: ``k`` slots (static permutations), their edge weights, the self weights.

    Attributes:
      perms: ``k`` permutations, each a tuple of ``(src, dst)`` pairs; within one permutation every
        member is a source at most once and a destination at most once (what ``comm.permute``
        needs). ``src == dst`` is not allowed: a node's own value enters through ``self_weights``.
      weights: aligned with ``perms``: ``weights[s][e]`` is ``W[dst, src]`` for the pair
        ``perms[s][e]``.
      self_weights: ``W[i, i]`` for every node ``i`` (length ``n``).
    """

    perms: tuple[Permutation, ...]
    weights: tuple[tuple[float, ...], ...]
    self_weights: tuple[float, ...]

    def __post_init__(self) -> None:
        perms = tuple(tuple((_as_int(s, "src"), _as_int(d, "dst")) for s, d in perm) for perm in self.perms)
        weights = tuple(tuple(float(w) for w in ws) for ws in self.weights)
        object.__setattr__(self, "perms", perms)
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "self_weights", tuple(float(w) for w in self.self_weights))
        if len(weights) != len(perms):
            raise ValueError(f"got {len(perms)} permutations but {len(weights)} weight tuples")
        for s, (perm, ws) in enumerate(zip(perms, weights)):
            if len(ws) != len(perm):
                raise ValueError(f"slot {s}: {len(perm)} pairs but {len(ws)} weights")

    @property
    def num_slots(self) -> int:
        """Number of permutations (``comm.permute`` calls) in this round."""
        return len(self.perms)


@dataclass(frozen=True)
class Topology:
    """A gossip topology over ``n`` nodes as static data: a periodic tuple of ``Round`` s.

    Frozen and hashable, so it can be a static argument of ``jax.jit`` and a field of a frozen
    transform configuration. Round ``t`` means ``rounds[t % period]`` everywhere.

    Build one with the constructors in ``optaxdist.topology`` (``ring``, ``exponential``, ``torus``,
    ``complete``, ``star``, ``from_neighbors`` and the fairscale graph classes), or directly.

    Example:
      >>> from optaxdist import topology as topo
      >>> t = topo.ring(4, directed=True)
      >>> t.rounds[0].perms
      (((0, 1), (1, 2), (2, 3), (3, 0)),)
      >>> t.peers(0, node=0)
      ([1], [3])
      >>> t.is_doubly_stochastic()
      True
    """

    n: int
    rounds: tuple[Round, ...]
    name: str = field(default="topology", compare=True)

    def __post_init__(self) -> None:
        n = _as_int(self.n, "n")
        if n < 1:
            raise ValueError(f"n={n}: a topology needs at least one node")
        rounds = tuple(self.rounds)
        if not rounds:
            raise ValueError("rounds is empty: a topology needs at least one round (period >= 1)")
        for r, rnd in enumerate(rounds):
            if not isinstance(rnd, Round):
                raise TypeError(f"rounds[{r}] must be a Round, got {type(rnd).__name__}")
            if len(rnd.self_weights) != n:
                raise ValueError(f"round {r}: {len(rnd.self_weights)} self weights for n={n} nodes")
            for s, (perm, ws) in enumerate(zip(rnd.perms, rnd.weights)):
                srcs = [p[0] for p in perm]
                dsts = [p[1] for p in perm]
                for src, dst in perm:
                    if not (0 <= src < n and 0 <= dst < n):
                        raise ValueError(f"round {r} slot {s}: pair {(src, dst)} out of range for n={n}")
                    if src == dst:
                        raise ValueError(
                            f"round {r} slot {s}: self pair {(src, dst)}; a node's own value enters "
                            "through self_weights"
                        )
                if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
                    raise ValueError(
                        f"round {r} slot {s}: {perm} must send from and to each node at most once"
                    )
                if any(not math.isfinite(w) or w < 0 for w in ws):
                    raise ValueError(f"round {r} slot {s}: weights {ws} must be finite and >= 0")
            if any(not math.isfinite(w) or w < 0 for w in rnd.self_weights):
                raise ValueError(f"round {r}: self weights must be finite and >= 0")
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "rounds", rounds)

    # ---- schedule -----------------------------------------------------------------------------

    @property
    def period(self) -> int:
        """Number of distinct rounds; step ``t`` uses round ``t % period``."""
        return len(self.rounds)

    def round(self, t: int) -> Round:
        """The ``Round`` used at step ``t`` (``rounds[t % period]``)."""
        t = _as_int(t, "round")
        if t < 0:
            raise ValueError(f"round={t} must be >= 0")
        return self.rounds[t % self.period]

    def perms(self, round: int = 0) -> tuple[Permutation, ...]:
        """The round's permutations, one ``comm.permute(tree, perm)`` each."""
        return self.round(round).perms

    def peers(self, round: int, node: int) -> tuple[list[int], list[int]]:
        """``(out_peers, in_peers)`` of ``node`` in ``round``, in slot order (duplicates kept).

        ``out_peers`` are the nodes ``node`` sends to, ``in_peers`` the nodes it receives from —
        fairscale's ``GraphManager.get_peers`` order.
        """
        node = _as_int(node, "node")
        if not 0 <= node < self.n:
            raise ValueError(f"node={node} out of range for n={self.n}")
        out, inn = [], []
        for perm in self.round(round).perms:
            for s, d in perm:
                if s == node:
                    out.append(d)
                if d == node:
                    inn.append(s)
        return out, inn

    # ---- weights and matrices -----------------------------------------------------------------

    def receive_weights(self, round: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``(self_w, slot_w)`` indexed by the receiver: ``self_w[i] = W[i, i]`` (shape ``(n,)``),
        ``slot_w[s, i] = W[i, src]`` for the pair ``(src, i)`` of slot ``s`` (0 where ``i`` receives
        nothing in that slot), shape ``(num_slots, n)``.

        Gossip with receiver weights: ``x⁺ = self_w[me]·x + Σ_s slot_w[s, me]·permute(x, perm_s)``.
        """
        rnd = self.round(round)
        slot_w = np.zeros((rnd.num_slots, self.n))
        for s, (perm, ws) in enumerate(zip(rnd.perms, rnd.weights)):
            for (_, d), w in zip(perm, ws):
                slot_w[s, d] = w
        return np.asarray(rnd.self_weights, dtype=np.float64), slot_w

    def send_weights(self, round: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``(self_w, slot_w)`` indexed by the sender: ``slot_w[s, j] = W[dst, j]`` for the pair
        ``(j, dst)`` of slot ``s`` (0 where ``j`` sends nothing). Push-sum scales before sending:
        ``x⁺ = self_w[me]·x + Σ_s permute(slot_w[s, me]·x, perm_s)``.
        """
        rnd = self.round(round)
        slot_w = np.zeros((rnd.num_slots, self.n))
        for s, (perm, ws) in enumerate(zip(rnd.perms, rnd.weights)):
            for (src, _), w in zip(perm, ws):
                slot_w[s, src] = w
        return np.asarray(rnd.self_weights, dtype=np.float64), slot_w

    def mixing_matrix(self, round: int = 0) -> np.ndarray:
        """The round's ``n × n`` mixing matrix ``W`` with ``x⁺ = W x`` (row ``i`` = what node ``i``
        receives, column ``j`` = what node ``j`` sends). Parallel edges (a peer repeated in one
        round, fairscale compat) add up."""
        rnd = self.round(round)
        w = np.diag(np.asarray(rnd.self_weights, dtype=np.float64))
        for perm, ws in zip(rnd.perms, rnd.weights):
            for (s, d), x in zip(perm, ws):
                w[d, s] += x
        return w

    def period_matrix(self) -> np.ndarray:
        """``M = W_{P-1} ⋯ W_1 W_0``: the mixing of one whole period (``x ← M x``)."""
        m = np.eye(self.n)
        for t in range(self.period):
            m = self.mixing_matrix(t) @ m
        return m

    def expected_matrix(self) -> np.ndarray:
        """``W̄ = (1/P) Σ_t W_t``: the expected mixing matrix when the round is drawn uniformly."""
        return sum(self.mixing_matrix(t) for t in range(self.period)) / self.period

    def _rounds(self, round: int | None) -> list[int]:
        return list(range(self.period)) if round is None else [round]

    def is_row_stochastic(self, round: int | None = None, *, atol: float = 1e-12) -> bool:
        """``W 1 = 1`` for the round (``None``: for every round of the period)."""
        return all(
            np.allclose(self.mixing_matrix(t).sum(axis=1), 1.0, rtol=0, atol=atol)
            for t in self._rounds(round)
        )

    def is_column_stochastic(self, round: int | None = None, *, atol: float = 1e-12) -> bool:
        """``1ᵀ W = 1ᵀ`` for the round (``None``: for every round of the period)."""
        return all(
            np.allclose(self.mixing_matrix(t).sum(axis=0), 1.0, rtol=0, atol=atol)
            for t in self._rounds(round)
        )

    def is_doubly_stochastic(self, round: int | None = None, *, atol: float = 1e-12) -> bool:
        """Row- and column-stochastic (``None``: every round). Then gossip preserves the average
        and, on a connected schedule, drives every node to it."""
        return self.is_row_stochastic(round, atol=atol) and self.is_column_stochastic(round, atol=atol)

    def spectral_gap(
        self,
        round: int | None = None,
        *,
        mode: Literal["period", "per_round", "expected"] = "period",
    ) -> float:
        """``1 − σ₂(A)``, with ``σ₂`` the second largest singular value of a mixing matrix ``A``.

        ``A`` is:

        * ``round=t``: the round's ``W_t``;
        * ``mode="period"`` (default): the period product ``M = W_{P-1} ⋯ W_0``;
        * ``mode="per_round"``: also ``M``, reported per round: ``1 − σ₂(M)^{1/P}``, so that
          schedules with different periods compare (a static graph gives the same as ``"period"``);
        * ``mode="expected"``: the mean ``W̄ = (1/P) Σ_t W_t`` (rounds drawn at random).

        For a doubly stochastic ``A``, ``σ₂(A) = ‖A − 11ᵀ/n‖₂`` and
        ``‖A x − x̄1‖ ≤ σ₂(A) ‖x − x̄1‖``: the gap is the guaranteed fraction of disagreement
        removed by one application (1 = exact averaging, 0 = no guaranteed progress). For
        matrices that are not doubly stochastic the number is still computed but is not a
        consensus rate (use ``metropolis()`` or push-sum). ``σ₂ < 1e-12`` counts as 0 (exact
        averaging up to rounding). ``n = 1`` gives 1.
        """
        if round is not None:
            a = self.mixing_matrix(round)
        elif mode in ("period", "per_round"):
            a = self.period_matrix()
        elif mode == "expected":
            a = self.expected_matrix()
        else:
            raise ValueError(f"mode={mode!r}; allowed: 'period', 'per_round', 'expected'")
        if self.n == 1:
            return 1.0
        sigma = np.linalg.svd(a, compute_uv=False)
        s2 = float(min(max(sigma[1], 0.0), 1.0))
        if s2 < 1e-12:  # exact averaging up to rounding: keep the per-round root from inflating it
            s2 = 0.0
        if round is None and mode == "per_round":
            s2 = s2 ** (1.0 / self.period)
        return 1.0 - s2

    # ---- graph properties ---------------------------------------------------------------------

    def _counts(self, round: int) -> np.ndarray:
        """``C[i, j]`` = number of edges ``j → i`` in the round."""
        c = np.zeros((self.n, self.n), dtype=np.int64)
        for perm in self.round(round).perms:
            for s, d in perm:
                c[d, s] += 1
        return c

    def is_symmetric(self, round: int | None = None) -> bool:
        """Every edge ``i → j`` of the round has its reverse ``j → i`` (an undirected round)."""
        return all(np.array_equal(c, c.T) for c in (self._counts(t) for t in self._rounds(round)))

    def is_regular(self) -> bool:
        """Every round, every node has the same in- and out-degree (fairscale's
        ``is_regular_graph``: then uniform weights are doubly stochastic and SGP's push-sum weight
        stays 1)."""
        for t in range(self.period):
            c = self._counts(t)
            deg = set(c.sum(axis=0).tolist()) | set(c.sum(axis=1).tolist())
            if len(deg) > 1:
                return False
        return True

    def is_strongly_connected(self) -> bool:
        """The union of all rounds' edges is strongly connected (needed for consensus)."""
        adj = sum(self._counts(t) for t in range(self.period)) > 0
        for mat in (adj, adj.T):
            seen = {0}
            todo = [0]
            while todo:
                i = todo.pop()
                for j in np.nonzero(mat[:, i])[0].tolist():
                    if j not in seen:
                        seen.add(j)
                        todo.append(j)
            if len(seen) != self.n:
                return False
        return True

    def is_bipartite(self) -> bool:
        """The union of all rounds' edges (as an undirected graph) is 2-colourable."""
        adj = sum(self._counts(t) for t in range(self.period))
        adj = (adj + adj.T) > 0
        color = [-1] * self.n
        for start in range(self.n):
            if color[start] >= 0:
                continue
            color[start] = 0
            todo = [start]
            while todo:
                i = todo.pop()
                for j in np.nonzero(adj[i])[0].tolist():
                    if color[j] < 0:
                        color[j] = 1 - color[i]
                        todo.append(j)
                    elif color[j] == color[i]:
                        return False
        return True

    # ---- reweighting --------------------------------------------------------------------------

    def metropolis(self) -> Topology:
        """The same edges with Metropolis–Hastings weights (Xiao & Boyd 2004), per round:

        ``W[i, j] = 1 / (1 + max(d_i, d_j))`` for every edge ``j → i``, ``W[i, i] = 1 − Σ_j W[i, j]``,

        where ``d_i`` is node ``i``'s degree in that round. ``W`` is symmetric and doubly stochastic
        for any undirected graph, regular or not (uniform ``1/(d+1)`` weights are doubly stochastic
        only on regular graphs). Every round must be undirected (``is_symmetric``).

        Raises:
          ValueError: if a round has an edge without its reverse.
        """
        rounds = []
        for t, rnd in enumerate(self.rounds):
            c = self._counts(t)
            if not np.array_equal(c, c.T):
                i, j = (int(v) for v in np.argwhere(c != c.T)[0])
                raise ValueError(
                    f"metropolis() needs undirected rounds; round {t} of {self.name!r} has "
                    f"{c[i, j]} edge(s) {j} -> {i} but {c[j, i]} edge(s) {i} -> {j}. "
                    "For a directed graph use column-stochastic (push-sum) weights instead."
                )
            deg = c.sum(axis=1)
            weights = tuple(tuple(1.0 / (1.0 + max(deg[s], deg[d])) for s, d in perm) for perm in rnd.perms)
            received = np.zeros(self.n)
            for perm, ws in zip(rnd.perms, weights):
                for (_, d), w in zip(perm, ws):
                    received[d] += w
            rounds.append(Round(rnd.perms, weights, tuple((1.0 - received).tolist())))
        return Topology(self.n, tuple(rounds), name=f"{self.name} (metropolis)")

    def __repr__(self) -> str:
        slots = sorted({r.num_slots for r in self.rounds})
        return f"Topology(name={self.name!r}, n={self.n}, period={self.period}, slots={slots})"


def uniform_round(
    n: int, perms: Sequence[Sequence[Pair]], *, convention: Literal["receiver", "sender"]
) -> Round:
    """A round with uniform weights ``1/(d + 1)``.

    ``convention="receiver"`` uses the receiver's in-degree ``d`` (row-stochastic; mlbench
    ``DecentralizedAggregation``, fairscale ``UniformMixing`` on its regular graphs);
    ``convention="sender"`` uses the sender's out-degree (column-stochastic; push-sum). Both are
    doubly stochastic on regular rounds.
    """
    perms = tuple(tuple((int(s), int(d)) for s, d in p) for p in perms)
    indeg = [0] * n
    outdeg = [0] * n
    for perm in perms:
        for s, d in perm:
            outdeg[s] += 1
            indeg[d] += 1
    if convention == "receiver":
        weights = tuple(tuple(1.0 / (indeg[d] + 1) for _, d in p) for p in perms)
        self_w = tuple(1.0 / (indeg[i] + 1) for i in range(n))
    elif convention == "sender":
        weights = tuple(tuple(1.0 / (outdeg[s] + 1) for s, _ in p) for p in perms)
        self_w = tuple(1.0 / (outdeg[i] + 1) for i in range(n))
    else:
        raise ValueError(f"convention={convention!r}; allowed: 'receiver', 'sender'")
    return Round(perms, weights, self_w)
