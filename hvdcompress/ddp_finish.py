"""The DDP hook's finishing of one DDP bucket (``hvdcompress.ddp``): its started parts'
exchanges finished in order, the stats accounted, the hook's future completed with the
buffer or the first error, a ``PayloadError`` named with the bucket's tensors and
remembered for ``hvdcompress.payload_error`` (DDP keeps only its text)."""

from __future__ import annotations

from hvdcompress.adapter_core import StepAccount
from hvdcompress.errors import PayloadError, remember


class FinishBucket:
    """Finish the started parts of one DDP bucket, in order, then complete the hook's
    future with the buffer (or the first error: the other parts still finish, without
    decoding, so that every collective they started ends on every rank)."""

    def __init__(self, account: StepAccount, size: int, started: list, buffer, future) -> None:
        self.account, self.size = account, size  # the state's step account and world size
        self.started, self.buffer, self.future = started, buffer, future

    def __call__(self) -> None:
        try:
            result = self._finish()
        except BaseException as err:  # noqa: BLE001 - never leave DDP waiting
            result = err
        if not self.future.done():
            self.future.set_result(result)

    def _finish(self):
        account = self.account
        scale = 1.0 / self.size
        error = None
        for part, comp, exchange, flight, start_s in self.started:
            try:
                exchange.finish(part, comp, flight, scale, decode=error is None)
            except BaseException as err:  # noqa: BLE001 - the future carries it
                error = error or err
            account.started(flight.grads, start_s)  # encode (inline: the collectives too)
            account.finished(flight)
        if error is not None and isinstance(error, PayloadError):
            names = [n for part, *_ in self.started for n in part.names]
            error = PayloadError(
                error.field,
                f"{error.detail} (DDP bucket of {len(names)} tensors: {', '.join(names[:4])}"
                f"{', ...' if len(names) > 4 else ''})",
                rank=error.rank,
                tensor=error.tensor,
            )
            remember(error)  # DDP keeps only its text: hvdcompress.payload_error finds it
        return self.buffer if error is None else error
