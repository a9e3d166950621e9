"""A character-level language model on the standard library's ``pydoc_data`` text (no download).

``pydoc_data.topics`` holds about 465k characters of English documentation. The text is cut into
non-overlapping windows of ``seq_len + 1`` characters (input and next-character target); the last
10% of the windows (in text order) are the test set. Shards: ``iid`` draws windows at random;
``skewed`` gives each replica a contiguous stretch of the text (different topics per replica, the
non-i.i.d. setting of DiLoCo).
"""

from __future__ import annotations

import hashlib

import flax.linen as nn
import jax
import numpy as np

from optaxdist.bench.data import Dataset


def pydoc_text() -> str:
    """The corpus: every ``pydoc_data.topics`` entry, in sorted key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def text_digest(text: str) -> str:
    """Short SHA-256 of the corpus (it varies slightly between Python versions)."""
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def load_charlm(seq_len: int = 64, test_fraction: float = 0.1) -> Dataset:
    """Windows of the pydoc text as a ``Dataset``: ``x`` (N, seq_len) int32 character ids,
    ``y`` (N, seq_len) the next characters; ``num_classes`` is the vocabulary size."""
    text = pydoc_text()
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    ids = np.fromiter((lookup[c] for c in text), np.int32, count=len(text))
    window = seq_len + 1
    n = len(ids) // window
    windows = ids[: n * window].reshape(n, window)
    n_test = max(1, int(round(test_fraction * n)))
    train, test = windows[:-n_test], windows[-n_test:]
    return Dataset(
        f"charlm[{text_digest(text)}]",
        train[:, :-1],
        train[:, 1:],
        test[:, :-1],
        test[:, 1:],
        len(vocab),
    )


class CharTransformer(nn.Module):
    """A small causal transformer: embeddings, ``layers`` pre-norm blocks, a linear head."""

    vocab_size: int
    seq_len: int = 64
    d_model: int = 64
    layers: int = 2
    heads: int = 4

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        t = tokens.shape[-1]
        x = nn.Embed(self.vocab_size, self.d_model)(tokens)
        x = x + self.param("position", nn.initializers.normal(0.02), (self.seq_len, self.d_model))[:t]
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.layers):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
            h = nn.LayerNorm()(x)
            x = x + nn.Dense(self.d_model)(nn.gelu(nn.Dense(4 * self.d_model)(h)))
        return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))
