"""The errors every rank raises alike (docs/wire-format.md, "Validation and errors").

``PayloadError`` and ``RankAgreementError`` are also importable from ``hvdcompress``;
``PayloadError`` from ``hvdcompress.wire`` as well.
"""

from __future__ import annotations


class RankAgreementError(RuntimeError):
    """Ranks disagree on what they will communicate (tensors, shapes, compressor...)."""


class PayloadError(ValueError):
    """A payload that cannot be decoded: corrupt, truncated, or not what the receiver expects.

    ``field`` names the header field (or "body") that failed; ``rank`` and ``tensor``
    say whose payload it was when the caller knows.
    """

    def __init__(
        self, field: str, message: str, *, rank: int | None = None, tensor: str | None = None
    ):
        self.field = field
        self.rank = rank
        self.tensor = tensor
        self.detail = message
        super().__init__(self._text())

    def _text(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"from rank {self.rank}")
        if self.tensor is not None:
            where.append(f"for tensor {str(self.tensor)!r}")  # a name, or a piece's key
        prefix = "payload " + " ".join(where) + ": " if where else "payload: "
        return f"{prefix}field {self.field!r}: {self.detail}"

    def locate(self, *, rank: int | None = None, tensor: str | None = None) -> PayloadError:
        """Fill in who sent the payload (if not known yet) and return self for re-raising."""
        if self.rank is None:
            self.rank = rank
        if self.tensor is None:
            self.tensor = tensor
        self.args = (self._text(),)
        return self


class DecodeOverflowError(PayloadError, OverflowError):
    """A payload whose decoded values overflow: a float32 value that is finite on the wire
    but infinite once computed or cast to the payload's dtype (float16 holds at most
    65504), while the header's non-finite flag is clear. Field ``"overflow"``; the
    message names the tensor when the caller knows it. Catch it as ``PayloadError`` or as
    ``OverflowError``."""

    def __init__(self, message: str, *, rank: int | None = None, tensor: str | None = None) -> None:
        super().__init__("overflow", message, rank=rank, tensor=tensor)
