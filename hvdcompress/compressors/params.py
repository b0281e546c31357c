"""The valid values of a compressor's constructor parameters (``Param``) and the ones the
seeded compressors share. Below both the compressors and their registry, which import it."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Param:
    """The valid values of one constructor parameter: a numeric interval (``low`` /
    ``high``, either end open or unbounded) of ``kind`` "float" or "int", or "bool".

    The constructor stays the authority (it raises ValueError naming the range); the
    declaration is what ``available()`` prints and what the registry tests check the
    constructor against (values outside the interval must raise)."""

    low: float | None = None
    high: float | None = None
    kind: str = "float"  # "float", "int" or "bool"
    low_open: bool = False
    high_open: bool = False
    doc: str = ""
    optional: bool = False  # None is also valid (the constructor resolves it)

    def describe(self) -> str:
        if self.kind == "bool":
            text = "bool or None" if self.optional else "bool"
            return f"{text}, {self.doc}" if self.doc else text
        lo = "-inf" if self.low is None else _num(self.low)
        hi = "inf" if self.high is None else _num(self.high)
        left = "(" if self.low_open or self.low is None else "["
        right = ")" if self.high_open or self.high is None else "]"
        text = f"{self.kind} in {left}{lo}, {hi}{right}"
        return f"{text}, {self.doc}" if self.doc else text

    def accepts(self, value) -> bool:
        """Whether ``value`` is valid: the right type (a bool is not a number, a string
        is nothing; an int kind takes integral numbers only) and inside the interval."""
        if value is None:
            return self.optional
        if self.kind == "bool":
            return isinstance(value, (bool, np.bool_)) or (
                isinstance(value, numbers.Integral) and value in (0, 1)
            )
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            return False
        if self.kind == "int" and (
            not isinstance(value, numbers.Integral)
            and not (math.isfinite(value) and float(value).is_integer())
        ):
            return False
        v = float(value) if self.kind == "float" else value
        if self.kind == "float" and math.isnan(v):
            return False
        if self.low is not None and (v < self.low or (self.low_open and v == self.low)):
            return False
        if self.high is not None and (v > self.high or (self.high_open and v == self.high)):
            return False
        return self.kind == "int" or self.high is not None or math.isfinite(v)

    def check(self, owner: str, param: str, value):
        """``value`` if ``accepts(value)``, else ValueError naming the valid values."""
        if not self.accepts(value):
            raise ValueError(f"{owner} {param} must be {self.describe()}, got {value!r}")
        return value

    def outside(self) -> list:
        """Values just outside the interval (what a constructor must refuse)."""
        if self.kind == "bool":
            return []
        out = []
        ends = ((self.low, True, self.low_open), (self.high, False, self.high_open))
        for end, is_low, is_open in ends:
            if end is None:
                continue
            if is_open:
                out.append(int(end) if self.kind == "int" else float(end))
            elif self.kind == "int":
                out.append(int(end) - 1 if is_low else int(end) + 1)
            else:
                out.append(math.nextafter(float(end), -math.inf if is_low else math.inf))
        return out


def _num(value: float) -> str:
    if isinstance(value, int) and abs(value) >= 2**20 and (value + 1) & value == 0:
        return f"2**{value.bit_length()} - 1"
    if isinstance(value, int) and abs(value) >= 2**20 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    return repr(value)


# Parameters shared by the seeded compressors (counter-based random numbers, see
# hvdcompress.compressors.stochastic): declared once here.
SEED = Param(0, 2**64 - 1, kind="int", doc="the shared random stream")
RANK = Param(0, 2**32 - 1, kind="int", doc="set by the optimizer (bind)")
FLAG = Param(kind="bool")
