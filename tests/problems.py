"""Tiny problems with hand-derivable gradients, shared by the algorithm tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DIM_IN, DIM_OUT, BATCH = 3, 2, 5


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(size=(DIM_IN, DIM_OUT)).astype(np.float32),
        "b": rng.normal(size=(DIM_OUT,)).astype(np.float32),
    }


def replica_data(n: int, steps: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Per-step, per-replica least-squares batches: x (steps, n, B, in), y (steps, n, B, out)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, n, BATCH, DIM_IN)).astype(np.float32)
    y = rng.normal(size=(steps, n, BATCH, DIM_OUT)).astype(np.float32)
    return x, y


def loss_fn(params, x, y):
    pred = x @ params["w"] + params["b"]
    return 0.5 * jnp.mean(jnp.sum((pred - y) ** 2, axis=-1))


grad_fn = jax.grad(loss_fn)


def np_grad(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """The same gradient in NumPy (float64): d/dw = xᵀ r / B, d/db = Σ r / B with r = xw + b − y."""
    w, b = params["w"].astype(np.float64), params["b"].astype(np.float64)
    r = x.astype(np.float64) @ w + b - y
    return {"w": x.T @ r / len(x), "b": r.sum(0) / len(x)}
