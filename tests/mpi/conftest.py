"""Fixtures of the MPI tests (run under mpirun, see scripts/run_tests.sh); the helpers
they share are in tests/mpi/helpers.py."""

import pytest


@pytest.fixture
def comm():
    """MPI.COMM_WORLD. mpi4py is imported here, not at import time: collecting the MPI
    tests must not start MPI (without --with-mpi they are skipped before fixtures run)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD
