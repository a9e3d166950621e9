"""Print the topology table (stochasticity, spectral gaps) and optionally draw every topology.

python -m optaxdist.topology                      # the table for n = 8 (docs/topology.md)
python -m optaxdist.topology --n 16
python -m optaxdist.topology --draw docs/img/topology
"""

from __future__ import annotations

import argparse
import os

from optaxdist.topology import graphs as g
from optaxdist.topology.base import Topology
from optaxdist.topology.draw import draw


def catalog(n: int = 8) -> dict[str, Topology]:
    """Every constructor at size ``n`` (even ``n``), keyed by a file-name-friendly label."""
    out = {
        "ring": g.ring(n),
        "ring_directed": g.ring(n, directed=True),
        "exponential": g.exponential(n),
        "exponential_directed": g.exponential(n, directed=True),
        "torus": g.torus(n),
        "complete": g.complete(n),
        "star": g.star(n),
        "star_metropolis": g.star(n).metropolis(),
    }
    fs = {
        "npeer_dynamic_directed_exponential_graph": g.npeer_dynamic_directed_exponential_graph,
        "dynamic_directed_exponential_graph": g.dynamic_directed_exponential_graph,
        "dynamic_bipartite_exponential_graph": g.dynamic_bipartite_exponential_graph,
        "dynamic_directed_linear_graph": g.dynamic_directed_linear_graph,
        "dynamic_bipartite_linear_graph": g.dynamic_bipartite_linear_graph,
        "ring_graph": g.ring_graph,
    }
    for label, make in fs.items():
        out[label] = make(n)
        out[label + "_compat"] = make(n, fairscale_compat=True)
    out["npeer_dynamic_directed_exponential_graph_k2"] = g.npeer_dynamic_directed_exponential_graph(
        n, peers_per_itr=2
    )
    return out


def table(n: int = 8) -> str:
    """A markdown table of every topology in ``catalog(n)``."""
    rows = [
        "| topology | period | slots/round | row | col | doubly | regular | gap (period) "
        "| gap (per round) | gap (expected) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    yes = {True: "yes", False: "no"}
    for t in catalog(n).values():
        slots = sorted({r.num_slots for r in t.rounds})
        rows.append(
            f"| `{t.name}` | {t.period} | {','.join(map(str, slots))} | {yes[t.is_row_stochastic()]} "
            f"| {yes[t.is_column_stochastic()]} | {yes[t.is_doubly_stochastic()]} "
            f"| {yes[t.is_regular()]} | {t.spectral_gap():.4f} "
            f"| {t.spectral_gap(mode='per_round'):.4f} | {t.spectral_gap(mode='expected'):.4f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m optaxdist.topology",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--n", type=int, default=8, help="number of nodes (even; default 8)")
    p.add_argument("--draw", metavar="DIR", help="write <label>.png for every topology into DIR")
    args = p.parse_args(argv)
    print(table(args.n))
    if args.draw:
        os.makedirs(args.draw, exist_ok=True)
        for label, t in catalog(args.n).items():
            draw(t, os.path.join(args.draw, f"{label}.png"))
        sgp = g.npeer_dynamic_directed_exponential_graph(args.n)
        for r in range(1, sgp.period):
            draw(
                sgp,
                os.path.join(args.draw, f"npeer_dynamic_directed_exponential_graph_round{r}.png"),
                round=r,
            )


if __name__ == "__main__":
    main()
