"""Draw a topology round: the graph (nodes on a circle, one arrow per edge) next to its mixing matrix.

Uses matplotlib's Agg canvas directly (no global backend switch, no display needed). matplotlib is
an optional dependency (``pip install optaxdist[bench]``); it is imported only when drawing.
"""

from __future__ import annotations

import math
import os

import numpy as np

from optaxdist.topology.base import Topology

__all__ = ["draw"]

_SLOT_COLORS = (
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:olive",
    "tab:cyan",
    "tab:gray",
)


def draw(topology: Topology, path: str | os.PathLike, round: int = 0, *, dpi: int = 110) -> None:
    """Write a PNG: round ``round`` of ``topology`` as a graph (left) and ``W`` as a heatmap (right).

    Left: nodes on a circle (node 0 at the top, increasing clockwise); an arrow ``j → i`` for every
    edge of the round, coloured by slot (one colour per ``comm.permute``); a peer repeated in one
    round (fairscale compat) gets one arrow per slot, drawn with increasing curvature. Right:
    ``W[i, j]`` (row ``i`` = what node ``i`` receives) with the values written in the cells for
    ``n <= 16``. The title gives the period and whether ``W`` is row/column/doubly stochastic.

    Example:
      >>> from optaxdist import topology as topo
      >>> topo.draw(topo.ring(8), "/tmp/ring.png")  # doctest: +SKIP
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch

    n = topology.n
    rnd = topology.round(round)
    w = topology.mixing_matrix(round)
    fig = Figure(figsize=(10.5, 5.0))
    FigureCanvasAgg(fig)
    ax_g, ax_w = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.15]})

    angles = [math.pi / 2 - 2 * math.pi * i / n for i in range(n)]
    pos = np.array([(math.cos(a), math.sin(a)) for a in angles])
    radius = 0.09 if n <= 16 else 0.05
    multiplicity: dict[tuple[int, int], int] = {}
    for s, perm in enumerate(rnd.perms):
        color = _SLOT_COLORS[s % len(_SLOT_COLORS)]
        for src, dst in perm:
            m = multiplicity.get((src, dst), 0)
            multiplicity[(src, dst)] = m + 1
            arrow = FancyArrowPatch(
                pos[src],
                pos[dst],
                arrowstyle="-|>",
                mutation_scale=12,
                color=color,
                lw=1.2,
                connectionstyle=f"arc3,rad={0.12 + 0.18 * m}",
                shrinkA=14,
                shrinkB=14,
                alpha=0.85,
            )
            ax_g.add_patch(arrow)
    for i, (x, y) in enumerate(pos):
        ax_g.add_patch(_circle(x, y, radius))
        ax_g.text(x, y, str(i), ha="center", va="center", fontsize=9 if n <= 16 else 6, zorder=4)
    ax_g.set_xlim(-1.3, 1.3)
    ax_g.set_ylim(-1.3, 1.3)
    ax_g.set_aspect("equal")
    ax_g.axis("off")
    slots = ", ".join(f"slot {s}" for s in range(rnd.num_slots)) if rnd.num_slots <= 6 else ""
    ax_g.set_title(
        f"round {round % topology.period} of {topology.period}"
        + (f"  ({rnd.num_slots} slots)" if rnd.num_slots else ""),
        fontsize=10,
    )
    if slots:
        handles = [
            FancyArrowPatch((0, 0), (1, 0), color=_SLOT_COLORS[s % len(_SLOT_COLORS)])
            for s in range(rnd.num_slots)
        ]
        ax_g.legend(
            handles,
            slots.split(", "),
            loc="lower center",
            ncol=min(rnd.num_slots, 6),
            fontsize=7,
            frameon=False,
            bbox_to_anchor=(0.5, -0.08),
        )

    im = ax_w.imshow(w, cmap="viridis", vmin=0.0, vmax=max(float(w.max()), 1e-12))
    fig.colorbar(im, ax=ax_w, fraction=0.046, pad=0.04)
    ax_w.set_xlabel("j (sender)")
    ax_w.set_ylabel("i (receiver)")
    ticks = list(range(n)) if n <= 16 else list(range(0, n, max(1, n // 8)))
    ax_w.set_xticks(ticks)
    ax_w.set_yticks(ticks)
    if n <= 16:
        for i in range(n):
            for j in range(n):
                if w[i, j]:
                    ax_w.text(
                        j,
                        i,
                        f"{w[i, j]:.2f}".lstrip("0"),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if w[i, j] < 0.6 * w.max() else "black",
                    )
    kinds = []
    if topology.is_doubly_stochastic(round):
        kinds.append("doubly stochastic")
    elif topology.is_row_stochastic(round):
        kinds.append("row-stochastic only")
    elif topology.is_column_stochastic(round):
        kinds.append("column-stochastic only")
    ax_w.set_title("W (x⁺ = W x): " + (kinds[0] if kinds else "not stochastic"), fontsize=10)
    fig.suptitle(f"{topology.name}, n = {n}", fontsize=12)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=dpi)


def _circle(x: float, y: float, r: float):
    from matplotlib.patches import Circle

    return Circle((x, y), r, facecolor="white", edgecolor="black", lw=1.2, zorder=3)
