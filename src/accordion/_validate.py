"""Argument checks shared by the library's public entries."""

from __future__ import annotations

import numbers
from typing import Any


def check_int(name: str, value: Any, minimum: int) -> int:
    """Return ``value`` as an int if it is an integer >= ``minimum``; else raise
    ``TypeError`` (not an integer) or ``ValueError`` (too small), naming ``name``."""
    # bool is an int subclass, but True as a count or size is always a caller's mistake
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)
