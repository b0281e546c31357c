"""A Transport of world size 1, for optimizer and policy tests in one process."""

from __future__ import annotations

from hvdcompress.transports import Handle, Transport


class LocalTransport(Transport):
    """World size 1: a gather returns the local bytes, a sum the tensor itself; ``calls``
    counts the collectives started."""

    name = "local"

    def __init__(self) -> None:
        self.calls = 0

    def _done(self, value) -> Handle:
        self.calls += 1
        h = Handle()
        h._finish(value)
        return h

    def start_allgatherv(self, local):
        return self._done((local.clone(), [local.numel()]))

    def start_allreduce_sum(self, dense):
        return self._done(dense.clone())

    def allgather_object(self, obj):
        return [obj]
