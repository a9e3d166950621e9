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
permute (one peer)     :math:`S/B`                         :math:`\alpha`
broadcast (pipelined)  :math:`S/B`                         :math:`(n-1)\,\alpha`
=====================  ==================================  ===================================

``S`` is the *payload* as the ledger records it (``optaxdist.accounting``): the buffer one replica
hands to the collective (for an all-gather, its own contribution, so the gathered result is
``n·S``). A flat ring over replicas spread on several nodes is bound by its slowest link: with one
node the model uses the intra-node link (``nvlink``), with more than one the network's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

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


def _all_reduce(s: float, n: int, net: Network) -> float:
    return 2 * (n - 1) / n * s / net.bandwidth + 2 * (n - 1) * net.latency


def _all_gather(s: float, n: int, net: Network) -> float:
    return (n - 1) * s / net.bandwidth + (n - 1) * net.latency


def _reduce_scatter(s: float, n: int, net: Network) -> float:
    return (n - 1) / n * s / net.bandwidth + (n - 1) * net.latency


def _permute(s: float, n: int, net: Network) -> float:
    return s / net.bandwidth + net.latency


def _broadcast(s: float, n: int, net: Network) -> float:
    return s / net.bandwidth + (n - 1) * net.latency


_MODELS = {
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "permute": _permute,
    "broadcast": _broadcast,
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
    model = _MODELS[collective_of(kind)]
    if n == 1:
        return 0.0
    return model(float(payload_bytes), n, get_network(network))


def group_and_link(kind: Kind, n: int, nodes: int, network: str | Network) -> tuple[int, Network]:
    """Members and link of the group a ledger kind runs in, for ``n`` replicas on ``nodes`` nodes:
    node-local kinds use ``nvlink`` among ``n / nodes``; cross-node kinds the network among
    ``nodes``; the rest a flat ring over all ``n`` bound by ``link_for(network, nodes)``."""
    if kind.scope == "local":
        return n // nodes, NETWORKS["nvlink"]
    if kind.scope == "cross":
        return nodes, link_for(network, nodes)
    return n, link_for(network, nodes)


def comm_time_per_step(
    by_kind: Mapping[Kind, tuple[int, int]],
    steps: int,
    n: int,
    network: str | Network,
    *,
    nodes: int | None = None,
) -> float:
    """Modelled communication seconds per step from ledger totals ``{kind: (collectives, bytes)}``.

    Sum over kinds of (events per step) × ``collective_time(kind, bytes per event, members, link)``.
    Without ``nodes`` every kind runs over all ``n`` replicas on ``network``; with ``nodes`` the
    group and link come from ``group_and_link``.
    """
    if steps < 1:
        raise ValueError(f"steps={steps!r} must be positive")
    total = 0.0
    for kind, (events, nbytes) in by_kind.items():
        if not events:
            continue
        members, link = (n, network) if nodes is None else group_and_link(kind, n, nodes, network)
        total += events / steps * collective_time(kind, nbytes / events, members, link)
    return total


def split_bytes(by_kind: Mapping[Kind, tuple[int, int]], nodes: int) -> tuple[int, int]:
    """``(intra-node, inter-node)`` payload bytes: node-local kinds are intra-node; cross-node kinds
    inter-node; flat kinds cross nodes whenever there is more than one node."""
    intra = inter = 0
    for kind, (_, nbytes) in by_kind.items():
        if kind.scope == "local" or (kind.scope == "world" and nodes == 1):
            intra += nbytes
        else:
            inter += nbytes
    return intra, inter
