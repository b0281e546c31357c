"""Keyed allgatherv / alltoallv checks (hvdcompress.transports.slots) that run on every
rank of a real world: the gloo worker (tests/torchrun/slots_worker.py, launched by
tests/test_slots.py) and the MPI tests (tests/mpi/test_slots.py) share them.

Each check returns a JSON-able dict of what this rank saw; the callers assert on it (the
same on every rank: a rank that failed alone would leave the others waiting, so the
checks run every collective on every rank and report, never raise mid-way).
"""

from __future__ import annotations

import contextlib

import torch

from hvdcompress.errors import PayloadError
from hvdcompress.transports import slots

# Lengths at one key, call by call (plus 7 * rank, or 5 * destination for alltoallv):
# the first call (no capacity yet), steady calls inside the 1.25 margin, an outgrown one,
# empty payloads, and then small ones for longer than the window (the capacity shrinks).
LENGTHS = [100, 110, 90, 120, 400, 380, 0, 60, 55, 50, 52, 48, 50, 51, 49, 50, 50, 50]


def payload(rank: int, call: int, dst: int = 0) -> torch.Tensor:
    n = LENGTHS[call] + (7 * rank + 5 * dst if LENGTHS[call] else 0)
    g = torch.Generator().manual_seed(10_000 * call + 100 * rank + dst)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def expected_rounds(series: list[list[int]]) -> list[int]:
    """The rounds of each call, ``series[k][c]`` the length slot k (an allgatherv's sender,
    an alltoallv's sender-receiver pair) carries in call c, from the rule of
    docs/design.md ("Rounds per bucket"): a slot's capacity is 5/4 of its largest length
    of the last 8 calls, rounded up to 8 bytes; a call is one round when every slot fits."""
    rounds = []
    for c in range(len(series[0])):
        fits = True
        for lengths in series:
            cap = 0
            if c:
                wanted = -(-max(lengths[max(0, c - 8) : c]) * 5 // 4)  # 5/4, rounded up
                cap = -(-wanted // 8) * 8
            fits = fits and lengths[c] <= cap
        rounds.append(1 if fits else 2)
    return rounds


def allgatherv_case(t, tag: str = "") -> dict:
    """Every call at one key gives exactly the bytes of the key-less path; rounds, bytes
    and the capacity as they went. ``tag``: a fresh key on a transport used before."""
    size, rank = t.size, t.rank
    same, rounds, sent, caps, own = [], [], [], [], []
    before = t.traffic.rounds
    for call in range(len(LENGTHS)):
        mine = payload(rank, call)
        h = t.start_allgatherv(mine, key=("case", "allgatherv", tag))
        gathered, sizes = h.wait()
        plain, plain_sizes = t.start_allgatherv(mine).wait()  # today's path
        want = [payload(r, call) for r in range(size)]
        same.append(
            sizes == [w.numel() for w in want] == plain_sizes
            and torch.equal(gathered, torch.cat(want))
            and torch.equal(gathered, plain)
        )
        rounds.append(h.rounds)
        sent.append(h.sent_bytes)
        held = slots.capacities(t)
        each = [held.capacity("allgatherv", ("case", "allgatherv", tag), (r,)) for r in range(size)]
        caps.append(max(each))
        own.append(each[rank])
    calls = range(len(LENGTHS))
    series = [[payload(r, c).numel() for c in calls] for r in range(size)]
    return {
        "same": same, "rounds": rounds, "want_rounds": expected_rounds(series), "sent": sent,
        "caps": caps, "own_caps": own, "traffic_rounds": t.traffic.rounds - before,
        "size": size,
    }  # fmt: skip


def alltoallv_case(t, tag: str = "") -> dict:
    """As allgatherv_case, for parts of a different length to each destination."""
    size, rank = t.size, t.rank
    same, rounds = [], []
    for call in range(len(LENGTHS)):
        parts = [payload(rank, call, dst) for dst in range(size)]
        h = t.start_alltoallv(parts, key=("case", "alltoallv", tag))
        got = h.wait()
        plain = t.start_alltoallv(parts).wait()
        want = [payload(src, call, rank) for src in range(size)]
        triples = zip(got, want, plain, strict=True)
        same.append(all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in triples))
        rounds.append(h.rounds)
    calls = range(len(LENGTHS))
    pairs = [(s, d) for s in range(size) for d in range(size)]
    series = [[payload(s, c, d).numel() for c in calls] for s, d in pairs]
    return {"same": same, "rounds": rounds, "want_rounds": expected_rounds(series)}


@contextlib.contextmanager
def forged_header(word: int):
    """This rank's slot headers say ``word`` (a forged length prefix) while inside."""
    real = slots._header

    def forged(length: int, overflow: bool) -> torch.Tensor:
        return torch.tensor([word], dtype=torch.int64).view(torch.uint8)

    slots._header = forged
    try:
        yield
    finally:
        slots._header = real


def forged_case(t, liar: int) -> dict:
    """Rank ``liar`` forges its slot headers: a huge length (2**61: an allocation of it
    would fail), and in the steady state a length past its capacity without the overflow
    bit. What each rank raised, then whether a later call at the same key still works."""
    out = {}
    key = ("case", "forged")
    t.start_allgatherv(payload(t.rank, 0), key=key).wait()  # capacities of 128 or more
    for name, word in (("huge", (1 << 61) << 1 | 1), ("no_overflow_bit", 1000 << 1)):
        try:
            with forged_header(word) if t.rank == liar else contextlib.nullcontext():
                t.start_allgatherv(payload(t.rank, 1), key=key).wait()
            out[name] = None
        except PayloadError as err:
            out[name] = [err.field, err.rank, str(err)]
    # alltoallv: the liar's headers reach every rank, each raises it (after any second round)
    try:
        with forged_header((1 << 61) << 1) if t.rank == liar else contextlib.nullcontext():
            t.start_alltoallv([payload(t.rank, 1, d) for d in range(t.size)], key=key).wait()
        out["alltoallv"] = None
    except PayloadError as err:
        out["alltoallv"] = [err.field, err.rank, str(err)]
    gathered, _ = t.start_allgatherv(payload(t.rank, 2), key=("case", "after")).wait()
    out["after"] = torch.equal(gathered, torch.cat([payload(r, 2) for r in range(t.size)]))
    return out
