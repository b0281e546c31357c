"""3LC payloads exchanged between real MPI ranks (run under mpirun, see scripts/run_tests.sh).

    mpirun -np 2 --oversubscribe python -m pytest --with-mpi tests/mpi -q

Each rank compresses a different tensor (its own size, shape, sparsity; the last rank an
all-zero tensor), the uint8 payloads of different lengths are allgathered with mpi4py
(``Allgather`` of the sizes, then ``Allgatherv``), and every rank decodes every payload
from its header alone (``comp.decode``). The sender's own decode of its payload is the
reference: each rank allgathers a digest of it, and every receiver must reproduce it bit
for bit.

Deadlock rule: a rank that fails before a collective would leave the others waiting in
it forever. So every step that could fail on one rank only is caught, the collectives
always run on every rank, and the assertions come after the last collective.
"""

from __future__ import annotations

import traceback

import numpy as np
import pytest
import torch

import hvdcompress
from hvdcompress.wire import PayloadError
from tests.mpi.helpers import digest

pytestmark = pytest.mark.mpi(min_size=2)

SPARSITIES = (1.75, 1.0, 1.5, 1.9)


def _sparsity(rank: int) -> float:
    return SPARSITIES[rank % len(SPARSITIES)]


def _tensor_for(rank: int, size: int) -> tuple[torch.Tensor, float]:
    """A different tensor per rank: shape, length and sparsity vary; the last rank's is zero."""
    sparsity = _sparsity(rank)
    if rank == size - 1:
        return torch.zeros(13, 7, dtype=torch.float32), sparsity
    gen = torch.Generator().manual_seed(20240 + rank)
    numel = 4096 + 1531 * rank + 3  # not a multiple of 5 (quartic groups) nor of 8
    x = torch.randn(numel, generator=gen, dtype=torch.float32)
    # Mostly small values with a few large ones, so many elements quantise to zero and
    # the zero-run stage has runs to compress; each rank a different mix.
    x[:: 97 + rank] *= 25.0
    x[numel // 3 : numel // 3 + 500 + 100 * rank] = 0.0
    if rank % 2 == 1:
        return x.reshape(1, numel), sparsity
    return x, sparsity


def _try(fn):
    """(result, None) or (None, 'traceback text'): failures must not skip a collective."""
    try:
        return fn(), None
    except Exception:  # reported after the collectives
        return None, traceback.format_exc()


def _allgatherv_uint8(MPI, comm, local: np.ndarray) -> list[np.ndarray]:
    """Allgather uint8 arrays of different lengths: sizes first, then Allgatherv."""
    local = np.ascontiguousarray(local, dtype=np.uint8)
    sizes = np.zeros(comm.size, dtype=np.int64)
    comm.Allgather(np.array([local.size], dtype=np.int64), sizes)
    displs = np.zeros(comm.size, dtype=np.int64)
    displs[1:] = np.cumsum(sizes)[:-1]
    recv = np.empty(int(sizes.sum()), dtype=np.uint8)
    comm.Allgatherv(
        [local, MPI.UNSIGNED_CHAR],
        [recv, (sizes.astype(int).tolist(), displs.astype(int).tolist()), MPI.UNSIGNED_CHAR],
    )
    return [recv[d : d + s].copy() for d, s in zip(displs.tolist(), sizes.tolist(), strict=True)]


def _check_all_ok(comm, err: str | None, what: str) -> None:
    """Collective: fail on every rank (with every rank's error) if any rank failed."""
    errors = comm.allgather(err)
    bad = {r: e for r, e in enumerate(errors) if e is not None}
    if bad:
        pytest.fail(
            f"{what} failed on rank(s) {sorted(bad)}:\n"
            + "\n".join(f"--- rank {r} ---\n{e}" for r, e in bad.items())
        )


def _local_payload(rank: int, size: int):
    x, sparsity = _tensor_for(rank, size)
    comp = hvdcompress.get_compressor("3lc", sparsity=sparsity)
    payload, ctx = comp.compress(x, f"grad.rank{rank}")
    assert isinstance(payload, torch.Tensor), type(payload)
    assert payload.dtype == torch.uint8 and payload.dim() == 1, (payload.dtype, payload.shape)
    local_decompress = comp.decompress(payload, ctx)
    local_decode = comp.decode(payload)
    return x, sparsity, payload.contiguous().cpu(), local_decompress, local_decode


def test_allgather_threelc_payloads_decode_bit_exact_on_every_rank(comm):
    from mpi4py import MPI

    rank, size = comm.rank, comm.size

    local, err = _try(lambda: _local_payload(rank, size))
    _check_all_ok(comm, err, "compressing the local tensor")
    x, sparsity, payload, local_decompress, local_decode = local

    # The sender's reference: the digest of its own decode of its own payload.
    ref_digests = comm.allgather(digest([local_decode]))
    payloads = _allgatherv_uint8(MPI, comm, payload.numpy())

    # Every rank decodes every payload with a fresh compressor of its own (no ctx, no
    # state shared with the sender): the header must carry shape, dtype and scale. It is
    # configured as agreed with the sender (same sparsity): decode checks that agreement.
    def decode_all():
        return [
            digest(
                [
                    hvdcompress.get_compressor("3lc", sparsity=_sparsity(r)).decode(
                        torch.from_numpy(p), rank=r
                    )
                ]
            )
            for r, p in enumerate(payloads)
        ]

    my_digests, err = _try(decode_all)
    _check_all_ok(comm, err, "decoding the gathered payloads")
    all_digests = comm.allgather(my_digests)
    sizes = comm.allgather(int(payload.numel()))

    # --- assertions: no collectives below this line ---
    assert len(set(sizes)) == size, f"payload lengths should all differ: {sizes}"
    assert [p.size for p in payloads] == sizes
    assert payloads[rank].tobytes() == payload.numpy().tobytes(), "own payload came back changed"
    for r in range(size):
        assert my_digests[r] == ref_digests[r], (
            f"rank {rank} decoded rank {r}'s payload differently from rank {r} itself"
        )
    assert all(d == all_digests[0] for d in all_digests), "ranks disagree on the decoded tensors"

    # The sender's two local paths agree, with the original shape and dtype.
    assert local_decompress.shape == x.shape and local_decompress.dtype == x.dtype
    assert digest([local_decompress]) == digest([local_decode]), "decompress(ctx) != decode()"

    # 3LC error bound: q = rint(a / S) with S = sparsity * max|x| gives |x - S q| <= S / 2.
    if rank == size - 1:
        assert torch.count_nonzero(local_decode) == 0, "an all-zero tensor must decode to zeros"
    else:
        bound = 0.5 * sparsity * float(x.abs().max())
        err_max = float((local_decode.float() - x).abs().max())
        assert err_max <= bound * (1 + 1e-5), (err_max, bound)
        assert torch.count_nonzero(local_decode) > 0


def _corruptions(p: np.ndarray) -> dict[str, np.ndarray]:
    magic = p.copy()
    magic[0] ^= 0xFF
    version = p.copy()
    version[4] = 0xEE
    body = p.copy()
    body[-1] ^= 0x5A  # last byte of the body: caught by the checksum (or the body parser)
    return {
        "magic": magic,
        "version": version,
        "truncated": p[: len(p) - 3].copy(),
        "body": body,
        "header_only": p[:10].copy(),
    }


EXPECTED_FIELDS = {
    "magic": {"magic"},
    "version": {"version", "checksum"},
    "truncated": {"length", "body_len"},
    "header_only": {"length"},
    "body": None,  # any named field (checksum or body); it must say which
    "other_sparsity": {"sparsity"},
}


def test_corrupted_payload_from_another_rank_raises_payload_error_naming_the_field(comm):
    from mpi4py import MPI

    rank, size = comm.rank, comm.size

    local, err = _try(lambda: _local_payload(rank, size))
    _check_all_ok(comm, err, "compressing the local tensor")
    payloads = _allgatherv_uint8(MPI, comm, local[2].numpy())

    peer = (rank + 1) % size  # corrupt what a peer sent, as a receiver would see it
    receiver = hvdcompress.get_compressor("3lc", sparsity=_sparsity(peer))
    # A receiver whose compressor disagrees with the sender's (another sparsity).
    other = next(s for s in SPARSITIES if s != _sparsity(peer))
    disagreeing = hvdcompress.get_compressor("3lc", sparsity=other)
    cases = [(kind, bad, receiver) for kind, bad in _corruptions(payloads[peer]).items()]
    cases.append(("other_sparsity", payloads[peer].copy(), disagreeing))
    results = {}
    for kind, bad, comp in cases:
        try:
            out = comp.decode(torch.from_numpy(bad), rank=peer, name="grad.peer")
        except ValueError as e:
            results[kind] = e
        except Exception as e:  # any other type is the failure
            results[kind] = AssertionError(f"{type(e).__name__} instead of ValueError: {e}")
        else:
            results[kind] = AssertionError(f"decoded without error to {tuple(out.shape)}")
    # Keep the ranks in step before asserting (nothing collective follows, but a rank that
    # fails early must not leave another in a later test's collective alone).
    comm.Barrier()

    for kind, e in results.items():
        assert not isinstance(e, AssertionError), f"{kind}: {e}"
        assert isinstance(e, PayloadError), f"{kind}: {type(e).__name__}: {e}"
        assert isinstance(e.field, str) and e.field, f"{kind}: no field named: {e}"
        assert e.field in str(e), f"{kind}: message does not name field {e.field!r}: {e}"
        assert f"rank {peer}" in str(e), f"{kind}: message does not name the sender: {e}"
        allowed = EXPECTED_FIELDS[kind]
        if allowed is not None:
            assert e.field in allowed, f"{kind}: field {e.field!r}, expected one of {allowed}"
