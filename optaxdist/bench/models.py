"""The model trained by the benchmark: a small Flax (linen) MLP classifier, and its loss."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


class MLP(nn.Module):
    """Dense layers with ReLU, then a linear classifier head producing logits."""

    hidden: Sequence[int] = (128, 128)
    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.num_classes)(x)


def logits_of(model: nn.Module, params, x: jax.Array) -> jax.Array:
    """float32 logits; floating-point inputs are cast to the parameters' dtype first, so bfloat16
    parameters compute in bfloat16 (the loss is taken in float32, as in mixed-precision training)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jax.tree.leaves(params)[0].dtype)
    return model.apply({"params": params}, x).astype(jnp.float32)


def cross_entropy(model: nn.Module, params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of ``model`` on the batch ``(x, y)``."""
    return optax.softmax_cross_entropy_with_integer_labels(logits_of(model, params, x), y).mean()


def accuracy(model: nn.Module, params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Fraction of ``x`` classified as ``y``."""
    return jnp.mean((jnp.argmax(logits_of(model, params, x), -1) == y).astype(jnp.float32))


def evaluate_in_batches(
    model: nn.Module, params, x: np.ndarray, y: np.ndarray, batch: int = 256
) -> tuple[jax.Array, jax.Array]:
    """``(cross_entropy, accuracy)`` of ``model`` on ``(x, y)``, ``batch`` examples at a time
    (``lax.map``): the activations of one batch in memory, not of the whole set (a transformer on
    8192 windows at once held gigabytes). The last batch is padded and its padding weighs 0."""
    pad = -len(y) % batch

    def batches(a):
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)])
        return jnp.asarray(a.reshape(-1, batch, *a.shape[1:]))

    def sums(xyw):
        xb, yb, wb = xyw
        logits = logits_of(model, params, xb)
        w = jnp.broadcast_to(wb.reshape(wb.shape + (1,) * (yb.ndim - 1)), yb.shape)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
        hits = (jnp.argmax(logits, -1) == yb).astype(jnp.float32)
        return jnp.sum(loss * w), jnp.sum(hits * w), jnp.sum(w)

    weights = np.ones(len(y), np.float32)  # the padding batches() adds weighs 0
    loss, hits, count = (jnp.sum(s) for s in jax.lax.map(sums, (batches(x), batches(y), batches(weights))))
    return loss / count, hits / count


def init_params(model: nn.Module, num_features: int, seed: int = 0):
    """Parameters of ``model`` for inputs with ``num_features`` features."""
    return model.init(jax.random.key(seed), jnp.zeros((1, num_features), jnp.float32))["params"]
