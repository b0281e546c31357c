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

    def renamed(self, rank: int) -> PayloadError:
        """Self, naming ``rank`` instead (a sub-group's index as the job's global rank)."""
        self.rank = rank
        self.args = (self._text(),)
        return self

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


# The last PayloadErrors the DDP hook raised on this rank, by text (``payload_error``).
_RAISED: dict[str, PayloadError] = {}
_RAISED_KEPT = 16


def remember(error: PayloadError) -> PayloadError:
    """Keep ``error`` for ``payload_error`` (the DDP hook calls it before DDP turns the
    error into text); the oldest of more than 16 are dropped. Returns ``error``."""
    _RAISED.pop(str(error), None)
    _RAISED[str(error)] = error
    while len(_RAISED) > _RAISED_KEPT:
        del _RAISED[next(iter(_RAISED))]
    return error


def payload_error(error: BaseException) -> PayloadError | None:
    """The ``PayloadError`` behind ``error``, or None when it is not a payload failure.

    DDP carries an error of a comm hook's future through C++ as a ``RuntimeError`` that
    holds only its text, so ``except hvdcompress.PayloadError`` never catches one raised
    in ``hvdcompress.ddp_hook``. This finds it: ``error`` itself, an error in its
    ``__cause__`` / ``__context__`` chain, or the PayloadError this rank's hook raised
    whose text ``error``'s text holds (the object itself, with ``rank``, ``tensor`` and
    ``field``; every rank decodes every payload, so every rank's hook raised its own)::

        try:
            loss.backward()
        except RuntimeError as err:
            if (bad := hvdcompress.payload_error(err)) is not None:
                print(f"corrupt payload from rank {bad.rank}, tensor {bad.tensor}")
            raise
    """
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        if isinstance(error, PayloadError):
            return error
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    for link in chain:
        text = str(link)
        for known_text, known in reversed(_RAISED.items()):  # the newest first
            if known_text in text:
                return known
    return None
