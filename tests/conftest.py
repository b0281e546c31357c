"""Hypothesis profiles and the fixtures shared by the test modules (their helpers are in
tests/helpers.py; imported in the fixtures, so that collecting tests that do not need
hvdcompress does not import it)."""

import os

import pytest
from hypothesis import HealthCheck, settings

# CI runs thousands of mutation cases; local runs stay quick. HYPOTHESIS_PROFILE picks.
settings.register_profile(
    "ci",
    max_examples=3000,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def model():
    """The small seeded model of the optimizer and policy tests (helpers.small_model)."""
    from tests.helpers import small_model

    return small_model()


@pytest.fixture
def transport():
    """A fresh Transport of world size 1 that counts its collectives (helpers.LocalTransport)."""
    from tests.helpers import LocalTransport

    return LocalTransport()


@pytest.fixture
def one_rank_group(tmp_path):
    """A torch.distributed world of one rank (gloo, file store) for in-process checks of
    the DDP hook (tests/test_ddp_hook.py, tests/test_valid_inputs.py)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.fixture
def _ci_must_run_netns(request):
    """CI runs as root with iproute2: a network-namespace test that would skip fails."""
    pytest.fail(f"CI must run {request.module.__name__}, but: {request.module._SKIP}")
