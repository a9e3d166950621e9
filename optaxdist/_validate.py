"""Argument checks shared by every part of the library. It imports nothing from optaxdist, so the
communicators, compressors and transforms can all use it."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer: a Python or NumPy int, not a bool."""
    return isinstance(value, numbers.Integral) and not is_bool(value)


def is_bool(value: Any) -> bool:
    """Whether ``value`` is a bool: Python's or NumPy's."""
    return isinstance(value, (bool, np.bool_))


def check_int(name: str, value: Any, low: int = 0, high: int | None = None) -> int:
    """``value`` must be an integer (``is_int``) in ``[low, high)``; returned as a Python int."""
    if not is_int(value) or value < low or (high is not None and value >= high):
        allowed = f"≥ {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{name}={value!r} must be an int {allowed}")
    return int(value)


def check_bools(**flags: Any) -> None:
    """Every flag must be a bool (Python's or NumPy's)."""
    for name, flag in flags.items():
        if not is_bool(flag):
            raise ValueError(f"{name}={flag!r} must be a bool")
