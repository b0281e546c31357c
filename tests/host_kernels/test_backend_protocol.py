"""The backend protocol (hvdcompress/backends/protocol.py), table-driven: both backends
implement every operation with the protocol's signature and nothing in two forms, and for
every operation the CUDA sources built for the host (kernels/cuda_host.h, run through
hvdcompress/backends/cuda/ by conftest.py's stand-in for CuPy) give the CPU library's bytes.

``CHECKED_BY`` names, for an operation, the check of tests/gpu that compares it with the CPU
backend on many inputs (the same checks run on a real GPU); the test runs it through
recording proxies and fails unless the check called the operation on both backends.
``SAME_CALL`` gives, for the others, arguments with which one call on each backend must
return the same bytes and leave the same bytes in its arguments; ``OWN_ANSWER`` the one
query whose answer is each backend's own. Every operation of the protocol is in exactly
one of the three tables."""

from __future__ import annotations

import copy
import inspect

import numpy as np
import pytest
import torch

from hvdcompress.backends import cpu as cpu_backend
from hvdcompress.backends import cuda as cuda_package
from hvdcompress.backends.protocol import OPERATIONS, Backend
from tests.gpu import test_buckets_gpu as buckets
from tests.gpu import test_threelc_gpu as threelc
from tests.gpu.conftest import Setup
from tests.host_kernels.conftest import HostLibrary, build_host_library

pytestmark = pytest.mark.host_kernels

# What only one device needs, beside the protocol (protocol.py's docstring).
EXTRAS = {
    "cpu": {"frame_write", "num_threads", "scale_for"},
    "cuda": {"length_prefixes", "gpu_unavailable_reason", "kernel_dir"},
}

CHECKED_BY = {
    "quantize": lambda s: threelc.check_building_blocks(s, [1, 7, 1000]),
    "quartic_encode": lambda s: threelc.check_building_blocks(s, [1, 7, 1000]),
    "zero_run_encode": lambda s: threelc.check_building_blocks(s, [1, 7, 1000]),
    "checksum_segments": threelc.check_checksum_segments,
    "store_checksums": threelc.check_checksum_segments,
    "frame_scan": buckets.check_frame_scan,
    "threelc_encode_segments": threelc.check_encode_segments,
    "threelc_decode_segments": lambda s: threelc.check_decode_segments(s, True),
    "sign_encode_segments": buckets.check_sign_segments,
    "sign_decode_segments": buckets.check_sign_segments,
    "efsign_sums_segments": buckets.check_sign_segments,
    "efsign_encode_segments": buckets.check_sign_segments,
    "qsgd_encode_segments": buckets.check_qsgd_segments,
    "qsgd_decode_segments": buckets.check_qsgd_segments,
    "terngrad_encode_segments": buckets.check_terngrad_segments,
    "dqsg_encode_segments": buckets.check_dqsg_segments,
    "dqsg_decode_segments": buckets.check_dqsg_segments,
    "digits_encode_segments": buckets.check_nested_segments,
    "digits_decode_segments": buckets.check_nested_segments,
    "topk_encode_segments": lambda s: buckets.check_topk_encode_segments(s, 0.05, 0.9),
    "topk_decode_segments": buckets.check_topk_segments,
    "topkq_select_segments": lambda s: buckets.check_topk_encode_segments(s, 0.05, signs=True),
    "topkq_write_segments": lambda s: buckets.check_topk_encode_segments(s, 0.05, signs=True),
    "topkq_decode_segments": lambda s: buckets.check_topk_segments(s, signs=True),
    "randomk_encode_segments": buckets.check_randomk_encode_segments,
    "randomk_decode_segments": buckets.check_randomk_segments,
    "gspar_encode_segments": buckets.check_gspar_encode_segments,
}


def _x(gen: torch.Generator, n: int = 3001) -> torch.Tensor:
    x = torch.randn(n, generator=gen)
    x[::7] = 0.0
    x[5] = -0.0
    return x


def _dqsg(gen):
    return cpu_backend.dqsg_quantize(_x(gen), 3, 64, 11, 0)


def _fine(gen: torch.Generator) -> torch.Tensor:
    """NDQSG's int8 fine indices k."""
    return torch.randint(-9, 10, (3001,), generator=gen).to(torch.int8)


SAME_CALL = {
    "uniform": lambda gen: (2**40 + 3, 3001),
    "bitpack": lambda gen: (torch.randint(0, 2**5, (3001,), generator=gen).to(torch.uint8), 5),
    "bitunpack": lambda gen: (
        cpu_backend.bitpack(torch.randint(0, 2**5, (3001,), generator=gen).to(torch.uint8), 5),
        3001,
        5,
    ),
    "chunk_sums": lambda gen: (_x(gen), 1024, True),
    "nonfinite": lambda gen: (_x(gen).index_fill_(0, torch.tensor([2999]), float("inf")),),
    "quartic_decode": lambda gen: (
        cpu_backend.quartic_encode(torch.randint(-1, 2, (3001,), generator=gen).to(torch.int8)),
        3001,
    ),
    "zero_run_decode": lambda gen: (
        cpu_backend.zero_run_encode(
            cpu_backend.quartic_encode(torch.zeros(3001, dtype=torch.int8))
        ),
        601,
    ),
    "dqsg_quantize": lambda gen: (_x(gen), 3, 64, 11, 2),
    "dqsg_dequantize": lambda gen: (*_dqsg(gen), 64, 11, torch.ones(3001), True),
    "ndqsg_coset": lambda gen: (_fine(gen), 3, 2),
    "ndqsg_side_decode": lambda gen: (
        cpu_backend.ndqsg_coset(_fine(gen), 3, 0).view(torch.int8),
        _dqsg(torch.Generator().manual_seed(5))[1],
        _x(gen),
        3,
        64,
        11,
        torch.zeros(3001),
        False,
        _fine(torch.Generator().manual_seed(5)),
    ),
    "topk_select": lambda gen: (_x(gen), 97),
    "dgc_update": lambda gen: (_x(gen), _x(gen), _x(gen), 0.9),
    "gspar_round": lambda gen: (_x(gen).abs(), 0.8, 1024),
    "gspar_draw": lambda gen: (_x(gen), 0.8, 77, True, 300.0),
}


# Answers that are each backend's own, about itself, not bytes: whether its codec threads cut
# a tensor of n elements (the bucket ops' bytes do not depend on it: the checks above).
OWN_ANSWER = {"splits": (1, 1 << 22, 1 << 26)}


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    return build_host_library(HostLibrary, "host_primitives.cpp", "sign.cu", tmp_path_factory)


class Recording:
    """A backend whose protocol operations note their names in ``called`` when run."""

    def __init__(self, backend, called: set) -> None:
        self._backend, self._called = backend, called

    def __getattr__(self, name: str):
        value = getattr(self._backend, name)
        if name not in OPERATIONS:
            return value

        def run(*args, **kwargs):
            self._called.add(name)
            return value(*args, **kwargs)

        return run


def _bytes(value):
    """Everything a result or argument holds, as comparable plain data (tensors as dtype,
    shape and raw bytes: -0.0 and NaN payloads count)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return ("tensor", str(t.dtype), tuple(t.shape), t.view(torch.uint8).numpy().tobytes())
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [_bytes(v) for v in value]
    if isinstance(value, float):
        return "float", np.float64(value).tobytes()
    return value


def test_both_tables_together_name_every_operation_once():
    tables = [set(CHECKED_BY), set(SAME_CALL), set(OWN_ANSWER)]
    assert sum(map(len, tables)) == len(set().union(*tables))
    assert sorted(set().union(*tables)) == sorted(OPERATIONS)


@pytest.mark.parametrize("name", ["cpu", "cuda"])
def test_every_backend_implements_the_whole_protocol_in_one_form(name):
    backend = {"cpu": cpu_backend, "cuda": cuda_package}[name]
    assert isinstance(backend, Backend)
    for op in OPERATIONS:
        want = inspect.signature(getattr(Backend, op))
        want = want.replace(parameters=list(want.parameters.values())[1:])  # no self
        got = inspect.signature(getattr(backend, op))
        assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == [
            (p.name, p.kind, p.default) for p in want.parameters.values()
        ], f"{name}.{op}{got} is not the protocol's {op}{want}"
    public = {
        n for n, v in vars(backend).items() if not n.startswith("_") and inspect.isfunction(v)
    }
    assert public - set(OPERATIONS) - EXTRAS[name] == set()
    # no operation in two forms: nothing beside an op's bucket form ("X" and "X_segments")
    assert {
        op[: -len("_segments")] for op in OPERATIONS if op.endswith("_segments")
    } & public == set()


@pytest.mark.parametrize("op", sorted(CHECKED_BY))
def test_operation_checked_on_the_host_built_cuda_against_the_cpu(cuda_on_host, op):
    on_cuda, on_cpu = set(), set()
    setup = Setup(
        Recording(cuda_on_host.backend, on_cuda),
        Recording(cpu_backend, on_cpu),
        torch.device("cpu"),
    )
    CHECKED_BY[op](setup)
    assert op in on_cuda and op in on_cpu, f"the check ran {op} on {on_cuda=} {on_cpu=}"


@pytest.mark.parametrize("op", sorted(SAME_CALL))
def test_operation_gives_the_cpu_bytes_on_the_host_built_cuda(cuda_on_host, op):
    args = SAME_CALL[op](torch.Generator().manual_seed(3))
    on_cpu, on_cuda = copy.deepcopy(args), copy.deepcopy(args)
    want = getattr(cpu_backend, op)(*on_cpu)
    got = getattr(cuda_on_host.backend, op)(*on_cuda)
    assert _bytes(got) == _bytes(want)
    assert _bytes(on_cuda) == _bytes(on_cpu)  # what each left in its arguments


@pytest.mark.parametrize("op", sorted(OWN_ANSWER))
def test_own_answers_are_plain_answers_on_both_backends(cuda_on_host, op):
    for n in OWN_ANSWER[op]:
        assert isinstance(getattr(cpu_backend, op)(n), bool)
        assert getattr(cuda_on_host.backend, op)(n) is False  # no host threads on a GPU
