"""Checks of the public API's boolean, numeric and enumerated arguments, shared by every
adapter (``DDPHookState``, ``DistributedOptimizer``, the policies, the integrations).

Each check returns the value in its canonical type or raises with a message that names
the argument, what it accepts and what it got. Why strict: Python takes any object as a
truth value, so ``overlap="no"`` would silently mean True, and ``int(2.7)`` silently 2.
The exception types are those the optimizer raised before these checks were shared:
a boolean of another type is a ``TypeError``; a number of another type or out of its
range, and a value outside a set of choices, a ``ValueError``.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = ["boolean", "choice", "integer", "number"]


def boolean(name: str, value) -> bool:
    """``value`` as a bool: True or False (numpy's bool too), nothing else."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be a bool (True or False), got {value!r}")


def integer(
    name: str, value, low: int | None = None, high: int | None = None, unit: str = ""
) -> int:
    """``value`` as an int in ``[low, high]`` (either end open when None). An integral
    float (``1024.0``) is taken; a bool, a fraction, a string or None is not."""
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value != int(value)
    ):
        raise ValueError(f"{name} must be an int{_range(low, high)}{unit}, got {value!r}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be an int{_range(low, high)}{unit}, got {value!r}")
    return value


def number(
    name: str, value, low: float | None = None, high: float | None = None, *, open_low: bool = False
) -> float:
    """``value`` as a finite float in ``[low, high]`` (``open_low``: ``(low, high]``)."""
    ok = (
        not isinstance(value, (bool, np.bool_))
        and isinstance(value, numbers.Real)
        and math.isfinite(value)
    )
    if ok:
        value = float(value)
        ok = (low is None or (value > low if open_low else value >= low)) and (
            high is None or value <= high
        )
    if not ok:
        where = _range(low, high, open_low)
        raise ValueError(f"{name} must be a finite number{where}, got {value!r}")
    return value


def choice(name: str, value, choices) -> object:
    """``value`` if it is one of ``choices`` (compared by equality, hashable or not)."""
    try:
        ok = any(value == c and type(value) is type(c) for c in choices)
    except Exception:  # noqa: BLE001 - an object whose == raises is not a choice
        ok = False
    if not ok:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def _range(low, high, open_low: bool = False) -> str:
    if low is not None and high is not None:
        return f" in {'(' if open_low else '['}{low}, {high}]"
    if low is not None:
        return f" {'>' if open_low else '>='} {low}"
    if high is not None:
        return f" <= {high}"
    return ""
