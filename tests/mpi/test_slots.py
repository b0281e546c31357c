"""Keyed allgatherv / alltoallv on the mpi4py transport (hvdcompress.transports.slots):
the checks of tests/slots_cases.py, which the gloo ranks of tests/test_slots.py run too.

    mpirun -np 3 --oversubscribe python -m pytest --with-mpi tests/mpi/test_slots.py

Every check runs every collective on every rank and asserts afterwards (the deadlock rule
of tests/mpi/helpers.py).
"""

from __future__ import annotations

import pytest

from hvdcompress.transports import slots
from tests import slots_cases

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture
def transport(comm):
    from hvdcompress.transports import make_transport

    return make_transport("mpi4py")


@pytest.mark.parametrize("case", ["allgatherv", "alltoallv"])
def test_keyed_calls_give_the_same_bytes_in_one_round_when_they_fit(transport, comm, case):
    got = getattr(slots_cases, f"{case}_case")(transport, tag="first")
    assert all(got["same"]), got["same"]
    assert got["rounds"] == got["want_rounds"]
    assert got["rounds"][:6] == [2, 1, 1, 1, 2, 1]
    assert comm.allgather(got["rounds"]) == [got["rounds"]] * comm.size


def test_mpi_sends_the_remainders_exactly(transport):
    """MPI's Allgatherv takes a count per rank: a second round pads nothing."""
    got = slots_cases.allgatherv_case(transport, tag="exact")
    size, own = got["size"], got["own_caps"][0]
    wanted = -(-(100 + 7 * transport.rank) * 5 // 4)  # this rank's own slot: 5/4 of its length
    assert own == -(-wanted // 8) * 8
    assert got["sent"][1] == (size - 1) * (slots.HEADER + own)
    # the first call: headers, then this rank's own 100 + 7 * rank bytes to every other
    assert got["sent"][0] == (size - 1) * (slots.HEADER + 100 + 7 * transport.rank)


def test_a_forged_slot_header_raises_on_every_rank(transport):
    got = slots_cases.forged_case(transport, liar=1)
    assert got["huge"][:2] == ["length", 1]
    assert got["no_overflow_bit"][:2] == ["length", 1]
    assert got["alltoallv"][:2] == ["length", 1]
    assert got["after"] is True
