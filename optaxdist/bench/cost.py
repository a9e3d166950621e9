r"""An α-β (latency-bandwidth) model of the time the collectives of one step take on a network.

Pure functions of Python numbers and ledger kinds. A collective moving a buffer of ``S`` bytes
between ``n`` replicas costs ``steps × α + bytes_on_the_busiest_link / B`` with the link's latency
``α`` and bandwidth ``B``:

=====================  ==================================  ===================================
collective             bandwidth term                      latency term
=====================  ==================================  ===================================
all-reduce (ring)      :math:`2(n-1)/n \cdot S/B`          :math:`2(n-1)\,\alpha`
all-gather (ring)      :math:`(n-1) \cdot S/B`             :math:`(n-1)\,\alpha`
reduce-scatter (ring)  :math:`(n-1)/n \cdot S/B`           :math:`(n-1)\,\alpha`
all-to-all (pairwise)  :math:`(n-1)/n \cdot S/B`           :math:`(n-1)\,\alpha`
permute (one peer)     :math:`S/B`                         :math:`\alpha`
broadcast (pipelined)  :math:`S/B`                         :math:`(n-1)\,\alpha`
=====================  ==================================  ===================================

``S`` is the *payload* as the ledger records it (``optaxdist.accounting``): the buffer one replica
hands to the collective (for an all-gather, its own contribution, so the gathered result is
``n·S``; for an all-to-all, its whole buffer, of which ``1/n`` stays with it). A flat ring over
replicas spread on several nodes is bound by its slowest link: with one node the model uses the
intra-node link (``nvlink``), with more than one the network's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from optaxdist.accounting import Kind


class Network(NamedTuple):
    """A link: bandwidth in bytes per second (per direction) and per-message latency in seconds."""

    name: str
    bandwidth: float
    latency: float


NETWORKS: dict[str, Network] = {
    "10GbE": Network("10GbE", 1.25e9, 50e-6),
    "100Gb": Network("100Gb", 12.5e9, 5e-6),
    "400Gb": Network("400Gb", 50e9, 3e-6),
    "nvlink": Network("nvlink", 450e9, 1e-6),
}


class _Shape(NamedTuple):
    """What one member of a group of ``n`` sends for a payload of 1 byte, and in how many steps."""

    wire: Callable[[int], float]
    steps: Callable[[int], int]


_MODELS = {
    "all_reduce": _Shape(lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1)),
    "all_gather": _Shape(lambda n: n - 1, lambda n: n - 1),
    "reduce_scatter": _Shape(lambda n: (n - 1) / n, lambda n: n - 1),
    "all_to_all": _Shape(lambda n: (n - 1) / n, lambda n: n - 1),
    "permute": _Shape(lambda n: 1, lambda n: 1),
    "broadcast": _Shape(lambda n: 1, lambda n: n - 1),
}


def get_network(network: str | Network) -> Network:
    """The ``Network`` named ``network`` (one of ``NETWORKS``), or ``network`` itself."""
    if isinstance(network, Network):
        return network
    try:
        return NETWORKS[network]
    except KeyError:
        raise ValueError(f"network={network!r}; allowed: {tuple(NETWORKS)}") from None


def link_for(network: str | Network, nodes: int) -> Network:
    """The link that bounds a flat ring: ``nvlink`` inside one node, ``network`` across nodes."""
    if not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes={nodes!r} must be a positive int")
    return NETWORKS["nvlink"] if nodes == 1 else get_network(network)


def collective_of(kind: Kind | str) -> str:
    """The collective behind a ledger ``Kind``, or a bare collective name (``"all_reduce"``)."""
    name = kind.collective if isinstance(kind, Kind) else kind
    if name not in _MODELS:
        raise ValueError(f"no cost model for {kind!r}: a ledger Kind or one of {sorted(_MODELS)}")
    return name


def collective_time(kind: Kind | str, payload_bytes: float, n: int, network: str | Network) -> float:
    """Modelled seconds for one collective of ledger ``kind`` with ``payload_bytes`` among ``n``.

    Args:
      kind: a ledger ``Kind`` or a bare collective name (``"all_reduce"``).
      payload_bytes: the buffer one replica hands to the collective (the ledger's payload).
      n: number of replicas taking part; a group of one costs nothing.
      network: a ``Network`` or a name in ``NETWORKS``; this function does not apply the
        one-node rule of ``link_for``.

    Returns:
      Seconds, per the table in this module's docstring.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be a positive int")
    if payload_bytes < 0:
        raise ValueError(f"payload_bytes={payload_bytes!r} must be non-negative")
    if n == 1:
        return 0.0
    net = get_network(network)
    shape = _MODELS[collective_of(kind)]
    return shape.steps(n) * net.latency + wire_bytes(kind, payload_bytes, n) / net.bandwidth


def wire_bytes(kind: Kind | str, payload_bytes: float, n: int) -> float:
    """Bytes one member sends for one collective of ledger ``kind`` among ``n`` (the bandwidth
    column of the table in this module's docstring, times the link's bandwidth)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be a positive int")
    return 0.0 if n == 1 else _MODELS[collective_of(kind)].wire(n) * float(payload_bytes)


def group_and_link(kind: Kind, n: int, nodes: int, network: str | Network) -> tuple[int, Network]:
    """Members and link of the group a ledger kind runs in, for ``n`` replicas on ``nodes`` nodes:
    node-local kinds use ``nvlink`` among ``n / nodes``; cross-node kinds the network among
    ``nodes``; the rest a flat ring over all ``n`` bound by ``link_for(network, nodes)``."""
    if kind.scope == "local":
        return n // nodes, NETWORKS["nvlink"]
    if kind.scope == "model":  # inside a replica, like the model's own FSDP / TP traffic: not modelled
        return 1, NETWORKS["nvlink"]
    if kind.scope == "cross":
        return nodes, link_for(network, nodes)
    return n, link_for(network, nodes)


def comm_time_per_step(
    by_kind: Mapping[Kind, tuple[int, int]],
    steps: int,
    n: int,
    network: str | Network | Mapping[str, Network],
    *,
    nodes: int | None = None,
) -> float:
    """Modelled communication seconds per step from ledger totals ``{kind: (collectives, bytes)}``.

    Sum over kinds of (events per step) × ``collective_time(kind, bytes per event, members, link)``.
    Without ``nodes`` every kind runs over all ``n`` replicas on ``network``; with ``nodes`` the
    group and link come from ``group_and_link``. ``network`` may also map each collective
    (``"all_reduce"``, ...) to its own link (``fit_links``); ``nodes`` is then ignored.
    """
    if steps < 1:
        raise ValueError(f"steps={steps!r} must be positive")
    total = 0.0
    for kind, (events, nbytes) in by_kind.items():
        if not events:
            continue
        if isinstance(network, Mapping):  # one link per collective, e.g. fitted per kind
            members, link = n, network[collective_of(kind)]
        else:
            members, link = (n, network) if nodes is None else group_and_link(kind, n, nodes, network)
        total += events / steps * collective_time(kind, nbytes / events, members, link)
    return total


def step_time(
    compute_s: float,
    by_kind: Mapping[Kind, tuple[int, int]],
    steps: int,
    n: int,
    network: str | Network | Mapping[str, Network],
    *,
    nodes: int | None = None,
) -> float:
    """Modelled seconds per step: ``compute_s`` plus ``comm_time_per_step``, except the collectives
    that overlap the computation (kinds labelled ``overlapped_…``, e.g. Streaming DiLoCo's
    ``overlap=True``), which take ``max(compute, their time)``."""
    overlapped = {k: v for k, v in by_kind.items() if k.label.startswith("overlapped")}
    rest = {k: v for k, v in by_kind.items() if k not in overlapped}
    hidden = comm_time_per_step(overlapped, steps, n, network, nodes=nodes)
    return max(compute_s, hidden) + comm_time_per_step(rest, steps, n, network, nodes=nodes)


def split_bytes(by_kind: Mapping[Kind, tuple[int, int]], nodes: int) -> tuple[int, int]:
    """``(intra-node, inter-node)`` payload bytes: node-local kinds are intra-node; cross-node kinds
    inter-node; flat kinds cross nodes whenever there is more than one node."""
    intra = inter = 0
    for kind, (_, nbytes) in by_kind.items():
        if kind.scope in ("local", "model") or (kind.scope == "world" and nodes == 1):
            intra += nbytes
        else:
            inter += nbytes
    return intra, inter


def fit_links(samples: Mapping[str, Sequence[tuple[float, float]]], n: int) -> dict[str, Network]:
    """Latency and bandwidth per collective, fitted to measured ``(payload bytes, seconds)`` samples
    of each collective among ``n`` by least squares on ``seconds = steps·α + wire bytes / B``.

    Collectives without samples get the all-reduce's link. Returns ``{collective: Network}`` for
    ``comm_time_per_step``.
    """
    links: dict[str, Network] = {}
    for collective, points in samples.items():
        if len(points) < 2:
            raise ValueError(f"{collective}: a fit needs at least 2 samples, got {len(points)}")
        shape = _MODELS[collective_of(collective)]
        wire = np.asarray([wire_bytes(collective, s, n) for s, _ in points])
        seconds = np.asarray([t for _, t in points])
        per_byte, fixed = np.polyfit(wire, seconds, 1)
        links[collective] = Network(
            f"fitted {collective}", 1.0 / max(per_byte, 1e-15), max(fixed, 0.0) / shape.steps(n)
        )
    if "all_reduce" not in links:
        raise ValueError("fit_links needs all_reduce samples (the default for the other collectives)")
    return {c: links.get(c, links["all_reduce"]) for c in _MODELS}
