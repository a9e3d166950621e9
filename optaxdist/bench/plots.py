"""Figures of a benchmark record (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os
from typing import Any

# Synchronous algorithms often give identical curves: vary the style so none hides another.
_STYLES = ("-", "--", ":", "-.")
_MARKERS = (".", "x", "+", "o", "^")


def plot_curves(record: dict[str, Any], out: str, tag: str) -> list[str]:
    """Write train loss vs step, vs bytes sent per replica, and vs modelled time; return paths.

    Algorithms that send nothing (``single``) are left out of the loss-vs-bytes figure.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from optaxdist.bench.run import EVAL_LIMIT

    cm = record["cost_model"]
    n_train = record["dataset"]["train"]
    measured_on = "whole train set" if n_train <= EVAL_LIMIT else f"{EVAL_LIMIT} of {n_train} train examples"
    title = (
        f"{record['dataset']['name']}, {record['config']['replicas']} replicas, "
        f"{record['config']['shards']} shards"
    )
    figures = {
        "loss_vs_step": ("step", lambda r: r["curve"]["step"]),
        "loss_vs_bytes": ("MB sent per replica", lambda r: [b / 1e6 for b in r["curve"]["bytes"]]),
        "loss_vs_modelled_time": (
            f"modelled time (s) on {cm['network']}, {cm['nodes']} nodes",
            lambda r: [s * r["modelled_s_per_step"] for s in r["curve"]["step"]],
        ),
    }
    paths = []
    for name, (xlabel, xs) in figures.items():
        fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
        for i, r in enumerate(record["results"]):
            if name == "loss_vs_bytes" and not r["bytes_per_replica"]:
                continue
            ax.plot(
                xs(r),
                r["curve"]["train_loss"],
                label=r["algorithm"],
                linestyle=_STYLES[i % len(_STYLES)],
                marker=_MARKERS[i % len(_MARKERS)],
                markersize=3,
                alpha=0.85,
            )
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"train loss ({measured_on})")
        ax.set_yscale("log")
        if name == "loss_vs_bytes":  # the rows' bytes span orders of magnitude
            ax.set_xscale("log", nonpositive="mask")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out, f"{tag}_{name}.png")
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
