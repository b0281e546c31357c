"""Slotted collectives: a keyed allgatherv / alltoallv in one round in the steady state
(docs/design.md, "Rounds per bucket").

A variable-size collective needs every receiver to know how many bytes come its way;
done plainly that is a round of sizes before the round of data. Here the sizes travel
with the data instead: a call site (``key``, the same on every rank, e.g. a bucket and
its stage) remembers a *capacity*, and each rank sends fixed-size slots of an 8-byte
header (``length << 1 | overflow``, little-endian int64) and the payload's first
``capacity`` bytes, zero-padded. When every payload fits, that was the only round.
When one does not, every rank that must take part in a second round learns it from the
headers (an allgather's headers reach every rank; in an alltoall the overflow bit is the
*sender's*: set in all its slots when any of its parts overflows, so every rank sees it),
and the second round moves the remainders, sized from the known lengths. Correctness
never depends on the guess: a first call at a key has capacity 0 (headers only, then the
payloads: today's two rounds).

The capacity is a function of what both ends of a slot saw, so every rank holds the same
one with no extra communication: ``MARGIN`` (5/4) times the largest length of the last
``WINDOW`` calls at the key (per sender for allgatherv, which every rank sees; per sender
and receiver pair for alltoallv, which both ends see), rounded up to ``ALIGN`` bytes, at
most ``MAX_CAPACITY`` (64 KiB: larger payloads travel as overflow, sized exactly, where
a round's latency is small beside their transfer time and padding would cost more). It
grows at once with a payload that did not fit and shrinks once ``WINDOW`` calls have been
smaller, so the padding does not stay at a high-water mark. MPI gathers each slot at its
own size; torch.distributed's all_gather takes equal sizes, so there every slot is padded
to the largest (as the data round before keys was padded to the largest payload).

Headers are checked before anything is allocated from them: a negative word, a length
past ``MAX_LENGTH``, or one past the capacity without the overflow bit (a length its slot
cannot hold) raises ``PayloadError`` (field ``"length"``, naming the sender). An
allgather's headers are the same on every rank, so every rank raises it, before any
second round; in an alltoall the receiver raises it after the second round (whose
occurrence every rank decides alike from the overflow bits, and whose sizes both ends
take from the header as sent: a sender sends exactly the remainder it announced, none
for a header that fails the checks), so no rank is left waiting.

Capacities are state of the transport: the functions here run on the thread that runs
its collectives, in collective order, which is the same on every rank.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from hvdcompress.errors import PayloadError

HEADER = 8  # bytes of a slot's header
MARGIN = (5, 4)  # capacity over the largest recent length: 1.25
ALIGN = 8  # capacities are multiples of this (slots stay 8-byte aligned)
WINDOW = 8  # calls at a key whose lengths set its capacity
# bytes; larger payloads send the rest in a second round, sized exactly: a slot is padded
# to the largest of its recent lengths (x 1.25), and on a slow link padding a megabyte
# costs far more than a round (measured: the 10 M MLP's two-stage 3LC at 100 Mbit/s sent
# 7.53 MB a step with 16 MiB slots, 4.87 MB with 64 KiB; docs/design.md)
MAX_CAPACITY = 64 << 10
MAX_LENGTH = (1 << 31) - 1  # the most bytes one slot may announce (MPI's int counts)


@dataclass
class Wire:
    """What a collective put on the wire, as its transport measured it: bytes this rank
    sent to and received from other ranks (None: the payload estimate of
    ``transports.base._sent_and_received`` stands) and rounds (underlying collectives)."""

    rounds: int
    sent: int | None = None
    received: int | None = None


class _Recent:
    """The lengths of the last ``WINDOW`` calls of one slot; its capacity follows them."""

    def __init__(self) -> None:
        self.lengths: deque[int] = deque(maxlen=WINDOW)

    @property
    def capacity(self) -> int:
        if not self.lengths:
            return 0
        wanted = -(-max(self.lengths) * MARGIN[0] // MARGIN[1])  # rounded up
        return min(MAX_CAPACITY, -(-wanted // ALIGN) * ALIGN)


class Capacities:
    """The capacity of every slot: by operation, key, and sender (allgatherv) or sender
    and receiver (alltoallv)."""

    def __init__(self) -> None:
        self._slots: dict[tuple, _Recent] = {}

    def slot(self, op: str, key, pair: tuple[int, ...] | None = None) -> _Recent:
        """The slot's recent lengths; with ``key`` None a fresh one, not kept (capacity 0:
        the sizes, then the data, every time)."""
        if key is None:
            return _Recent()
        return self._slots.setdefault((op, key, pair), _Recent())

    def capacity(self, op: str, key, pair: tuple[int, ...] | None = None) -> int:
        found = self._slots.get((op, key, pair))
        return 0 if found is None else found.capacity


def capacities(transport) -> Capacities:
    """The transport's capacities (made at first use)."""
    return transport.__dict__.setdefault("_slot_capacities", Capacities())


def _unkeyed(wire: Wire, key) -> None:
    """Without a key the bytes stay counted as before keys (the payloads, as every
    transport counts them: ``transports.base._sent_and_received``); the rounds are real."""
    if key is None:
        wire.sent = wire.received = None


def _extra(word: int, capacity: int) -> int:
    """The bytes a header announces past its slot: what the second round carries (none
    for a header ``_check`` refuses, on the sender as on the receiver)."""
    if _check(word, capacity, 0, None) is not None:
        return 0
    return max(0, (word >> 1) - capacity)


def _fit(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` cut or zero-padded to ``n`` bytes (what a header announced: its sender sends
    exactly that, so that the second round's sizes match on both ends)."""
    if t.numel() >= n:
        return t[:n]
    return torch.cat([t, torch.zeros(n - t.numel(), dtype=t.dtype, device=t.device)])


def _header(length: int, overflow: bool) -> torch.Tensor:
    word = np.array([(length << 1) | int(overflow)], dtype="<i8")
    return torch.from_numpy(word.view(np.uint8).copy())


def _read(heads: torch.Tensor, count: int) -> list[int]:
    """The ``count`` header words of ``heads`` (``count * HEADER`` bytes, any device)."""
    raw = heads.reshape(-1).cpu().numpy().tobytes()
    return np.frombuffer(raw, dtype="<i8", count=count).tolist()


def _check(word: int, capacity: int, sender: int, overflow_bit: bool | None) -> str | None:
    """What is wrong with a header (None: nothing); ``overflow_bit``: what its bit must be
    (an allgather's: the length past the capacity), None where only the implication
    "past the capacity, so the bit is set" holds (an alltoall's sender-wide bit)."""
    if word < 0:
        return f"slot header {word} is negative"
    length, bit = word >> 1, bool(word & 1)
    if length > MAX_LENGTH:
        return f"slot announces {length} bytes, more than the most a slot may ({MAX_LENGTH})"
    if length > capacity and not bit:
        return f"slot announces {length} bytes, past its capacity {capacity}, without overflow"
    if overflow_bit is not None and bit != overflow_bit:
        return f"slot of {length} bytes (capacity {capacity}) has a wrong overflow bit"
    return None


def allgatherv(local: torch.Tensor, caps: Capacities, key, rank: int, size: int, gather):
    """Every rank's ``local`` (1-D uint8), in rank order: (concatenated bytes, lengths,
    ``Wire``). ``gather(t, counts)``: the allgather of ``t``, whose length on rank r is
    ``counts[r]``, concatenated, with the bytes it sent and received (a transport whose
    allgather takes equal sizes only pads to the largest). Each rank's slot has the
    capacity of its own recent lengths, which every rank sees."""
    slot = [caps.slot("allgatherv", key, (r,)) for r in range(size)]
    cap = [s.capacity for s in slot]
    n = local.numel()
    head = min(n, cap[rank])
    mine = torch.zeros(HEADER + cap[rank], dtype=torch.uint8, device=local.device)
    mine[:HEADER] = _header(n, n > cap[rank]).to(local.device)
    mine[HEADER : HEADER + head] = local[:head]
    first, sent, received = gather(mine, [HEADER + c for c in cap])
    rows = first.split([HEADER + c for c in cap])
    words = _read(torch.cat([row[:HEADER] for row in rows]), size)
    for sender, word in enumerate(words):  # the same bytes on every rank: all raise alike
        wrong = _check(word, cap[sender], sender, (word >> 1) > cap[sender])
        if wrong is not None:
            raise PayloadError("length", f"allgatherv: {wrong}", rank=sender)
    lengths = [w >> 1 for w in words]
    wire = Wire(rounds=1, sent=sent, received=received)
    extra = [max(0, length - c) for length, c in zip(lengths, cap, strict=True)]
    tails: list[torch.Tensor] = []
    if any(extra):
        rest, sent, received = gather(_fit(local[head:], extra[rank]), extra)
        tails = list(rest.split(extra))
        wire.rounds, wire.sent, wire.received = 2, wire.sent + sent, wire.received + received
    for s, length in zip(slot, lengths, strict=True):
        s.lengths.append(length)
    _unkeyed(wire, key)
    parts = []
    for r, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        parts.append(row[HEADER : HEADER + min(length, cap[r])])
        if extra[r]:
            parts.append(tails[r])
    return torch.cat(parts), lengths, wire


def alltoallv(parts: list[torch.Tensor], caps: Capacities, key, rank: int, exchange, device):
    """What each rank sent to this one (``parts[j]`` goes to rank j), in rank order, and
    the ``Wire``. ``exchange(send, send_counts, recv_counts)``: the alltoallv of the bytes
    ``send`` (parts of ``send_counts`` bytes, one per rank) into the concatenation of
    ``recv_counts`` bytes from each rank."""
    size = len(parts)
    out_slots = [caps.slot("alltoallv", key, (rank, j)) for j in range(size)]
    in_slots = [caps.slot("alltoallv", key, (i, rank)) for i in range(size)]
    cap_out = [s.capacity for s in out_slots]
    cap_in = [s.capacity for s in in_slots]
    lens_out = [p.numel() for p in parts]
    overflow = any(n > c for n, c in zip(lens_out, cap_out, strict=True))
    heads = [_header(n, overflow) for n in lens_out]
    # the second round's parts follow what this rank announced, as its receivers read it
    words_out = _read(torch.cat(heads), size)
    extra_out = [_extra(w, c) for w, c in zip(words_out, cap_out, strict=True)]
    send = torch.zeros(sum(cap_out) + HEADER * size, dtype=torch.uint8, device=device)
    at = 0
    for part, n, cap, head in zip(parts, lens_out, cap_out, heads, strict=True):
        send[at : at + HEADER] = head.to(device)
        send[at + HEADER : at + HEADER + min(n, cap)] = part[: min(n, cap)].to(device)
        at += HEADER + cap
    recv_counts = [HEADER + c for c in cap_in]
    recv = exchange(send, [HEADER + c for c in cap_out], recv_counts)
    slots_in = list(recv.split(recv_counts))
    words = _read(torch.cat([s[:HEADER] for s in slots_in]), size)
    error = None
    for sender, (word, cap) in enumerate(zip(words, cap_in, strict=True)):
        wrong = _check(word, cap, sender, None)
        if wrong is not None and error is None:
            error = PayloadError("length", f"alltoallv: {wrong}", rank=sender)
    extra_in = [_extra(w, c) for w, c in zip(words, cap_in, strict=True)]
    lens_in = [min(max(w, 0) >> 1, c) + e for w, c, e in zip(words, cap_in, extra_in, strict=True)]
    others = [j for j in range(size) if j != rank]
    sent = sum(HEADER + cap_out[j] for j in others)
    received = sum(recv_counts[i] for i in others)
    wire = Wire(rounds=1, sent=sent, received=received)
    tails: list[torch.Tensor | None] = [None] * size
    if any(w & 1 for w in words):  # some rank overflowed: every rank sees its bit
        rest = [
            _fit(p[c:], e).to(device) for p, c, e in zip(parts, cap_out, extra_out, strict=True)
        ]
        got = exchange(torch.cat(rest), extra_out, extra_in)
        tails = list(got.split(extra_in))
        wire.rounds = 2
        wire.sent += sum(extra_out[j] for j in others)
        wire.received += sum(extra_in[i] for i in others)
    if error is not None:  # after the second round, which the others may wait in
        raise error
    for j, n in enumerate(lens_out):
        out_slots[j].lengths.append(n)
    for i, n in enumerate(lens_in):
        if i != rank:  # this rank's own slot is in both lists: counted once
            in_slots[i].lengths.append(n)
    _unkeyed(wire, key)
    got = []
    for i, n in enumerate(lens_in):
        piece = slots_in[i][HEADER : HEADER + min(n, cap_in[i])]
        got.append(piece if tails[i] is None or not extra_in[i] else torch.cat([piece, tails[i]]))
    return got, wire
