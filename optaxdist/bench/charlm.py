"""A character-level language model on text the standard library ships (no download).

Two corpora: ``charlm``, ``pydoc_data.topics`` (about 465k characters of English documentation,
which a 6000-step run of the benchmark reads 60 times over), and ``pysrc``, the standard library's
own Python source without its tests (about 12 M characters, read about twice in 6000 steps: a
train loss that is not memorization). The text is cut into non-overlapping windows of
``seq_len + 1`` characters (input and next-character target); the last 10% of the windows (in
text order) are the test set. Shards: ``iid`` draws windows at random; ``skewed`` gives each
replica a contiguous stretch of the text (different topics, or modules, per replica: the
non-i.i.d. setting of DiLoCo).
"""

from __future__ import annotations

import hashlib
import re
import sysconfig
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np

from optaxdist.bench.data import Dataset


def pydoc_text() -> str:
    """The corpus: every ``pydoc_data.topics`` entry, in sorted key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


# directories of the standard library left out of ``pysrc``: tests, installed packages, caches
NOT_SOURCE = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
OTHER = "\x7f"  # ``pysrc``: every character outside printable ASCII, tab and newline


def stdlib_source_text() -> str:
    """The corpus of ``pysrc``: every ``.py`` file of the standard library outside its test
    directories, in sorted path order, separated by a blank line; characters outside printable
    ASCII, tab and newline read as one symbol (``OTHER``)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not NOT_SOURCE & set(p.relative_to(root).parts[:-1]))
    text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
    return re.sub(r"[^\t\n -~]", OTHER, text)  # keeps printable ASCII (space to tilde), tab, newline


def text_digest(text: str) -> str:
    """Short SHA-256 of the corpus (it varies slightly between Python versions)."""
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def load_charlm(seq_len: int = 64, test_fraction: float = 0.1, corpus: str = "charlm") -> Dataset:
    """Windows of a corpus (``"charlm"``: the pydoc text, ``"pysrc"``: the standard library's
    source) as a ``Dataset``: ``x`` (N, seq_len) int32 character ids, ``y`` (N, seq_len) the next
    characters; ``num_classes`` is the vocabulary size."""
    text = pydoc_text() if corpus == "charlm" else stdlib_source_text()
    codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)  # one code point per character
    present = np.zeros(int(codes.max()) + 1, bool)
    present[codes] = True
    ids = (np.cumsum(present, dtype=np.int32) - 1)[codes]  # the rank of each character's code point
    window = seq_len + 1
    n = len(ids) // window
    windows = ids[: n * window].reshape(n, window)
    n_test = max(1, int(round(test_fraction * n)))
    train, test = windows[:-n_test], windows[-n_test:]
    return Dataset(
        f"{corpus}[{text_digest(text)}]",
        train[:, :-1],
        train[:, 1:],
        test[:, :-1],
        test[:, 1:],
        int(present.sum()),  # the vocabulary: the distinct characters
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
