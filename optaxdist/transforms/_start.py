"""Checking that replicas start identical: shared by the transforms that average parameters."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from optaxdist.accounting import CommLedger, payload_bytes, per_replica
from optaxdist.comm.base import Communicator
from optaxdist.parallel.harness import replicas_identical

CHECK_KIND = "broadcast[start check]"


def start_kinds(check_start: bool, params: Any) -> dict[str, int]:
    """Ledger kind of the one-time check: a broadcast of the parameters plus a 4-byte agreement."""
    return {CHECK_KIND: payload_bytes(params) + 4} if check_start else {}


def _raise_if_different(same) -> None:
    if not np.all(same):
        raise ValueError(
            "replicas do not start from identical parameters: make them identical first with "
            "optaxdist.broadcast_from_root (inside the step) or by initialising every replica "
            "from the same seed"
        )


def check_identical_start(
    check_start: bool, params: Any, step: jax.Array, ledger: CommLedger, comm: Communicator
) -> CommLedger:
    """On step 0, raise ``ValueError`` on every replica together if the replicas' parameters
    differ. One broadcast of the parameters and one int32 agreement, at step 0 only."""
    if not check_start:
        return ledger

    def first(led):
        # Under vmap with a batched step counter both branches run: re-test the step here.
        ok = replicas_identical(params, comm=comm) | (step != 0)
        jax.debug.callback(_raise_if_different, ok)
        return per_replica(led.record(CHECK_KIND), comm)

    return jax.lax.cond(step == 0, first, lambda led: per_replica(led, comm), ledger)
