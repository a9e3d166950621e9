"""``SoloComm``: a group of one replica, for code written against a communicator run without one."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from optaxdist.comm.base import Communicator


@dataclasses.dataclass(frozen=True)
class SoloComm(Communicator):
    """A group of one: every collective is the identity (an all-gather adds the leading axis).

    Useful to run or time a transform on one device without a named axis (no ``vmap``/``shard_map``
    needed); the ledgers still count what a one-member group would send.
    """

    @property
    def size(self) -> int:
        return 1

    def index(self) -> jax.Array:
        return jnp.zeros((), jnp.int32)

    def _psum(self, x):
        return x

    def _all_gather(self, x):
        return x[None]

    def _permute(self, x, perm):
        return x if (0, 0) in perm else jnp.zeros_like(x)

    def _packs_permutes(self) -> bool:
        return False  # nothing is sent

    def _psum_scatter(self, x):
        return x

    def _all_to_all(self, x):
        return x
