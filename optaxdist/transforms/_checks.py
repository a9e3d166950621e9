"""Validation shared by the SGD-like local optimizers."""

from __future__ import annotations


def check_sgd_hyperparameters(
    *, momentum: float, dampening: float, weight_decay: float, nesterov: bool
) -> None:
    """torch.optim.SGD's rules: momentum ≥ 0, weight_decay ≥ 0, nesterov needs momentum > 0 and
    no dampening."""
    if momentum < 0:
        raise ValueError(f"momentum={momentum!r} must be ≥ 0")
    if weight_decay < 0:
        raise ValueError(f"weight_decay={weight_decay!r} must be ≥ 0")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov=True needs momentum > 0 and dampening == 0")
