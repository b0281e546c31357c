"""Fixtures of the MPI tests (run under mpirun, see scripts/run_tests.sh); the helpers
they share are in tests/mpi/helpers.py."""

import os

import pytest

# Horovod's hvd.add_process_set after hvd.init needs this (the hierarchical exchange's
# split, the parity tests' process sets): set at collection, before any test calls
# hvd.init.
os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"


@pytest.fixture
def comm():
    """MPI.COMM_WORLD. mpi4py is imported here, not at import time: collecting the MPI
    tests must not start MPI (without --with-mpi they are skipped before fixtures run)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.fixture
def hvd():
    """horovod.torch, initialised (the tests that use it are marked NEEDS_HOROVOD)."""
    import horovod.torch as hvd

    hvd.init()
    return hvd
