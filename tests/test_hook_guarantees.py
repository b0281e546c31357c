"""What the DDP hook keeps of the user's guarantees, in-process on a one-rank gloo world
(the timeout and the arguments: tests/faults/test_stalled_rank.py,
tests/test_public_arguments.py; the README's recipe run 20 times: tests/test_clean_exits.py):

* ``DDPHookState.close()`` / its with-block ends the hook's threads and frees its own
  process groups at that point, and the hook refuses buckets afterwards; an exception in
  the block leaves the state as it is (no barrier that waits for a rank that is gone).
* ``hvdcompress.payload_error`` finds the ``PayloadError`` behind the ``RuntimeError``
  DDP raises (DDP carries only the text), in an exception chain, or not at all.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvdcompress
from hvdcompress import errors
from hvdcompress.errors import PayloadError


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def _step(ddp) -> None:
    ddp(torch.randn(5, 8)).sum().backward()


def _hook_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("hvdcompress"))


def _groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def test_the_with_block_ends_the_hooks_threads_and_frees_its_groups(one_rank_group):
    groups = _groups()
    ddp = DDP(_net())
    with hvdcompress.DDPHookState("3lc").register(ddp) as state:
        _step(ddp)
        assert state.overlapping
        assert _hook_threads() == [
            "hvdcompress-ddp-finish", "hvdcompress-torch-dist", "hvdcompress-torch-dist"
        ]  # fmt: skip
        assert _groups() == groups + 2  # the two threaded transports' own groups
    assert _hook_threads() == [] and _groups() == groups
    with pytest.raises(RuntimeError, match="this DDPHookState is closed"):
        _step(ddp)
    state.close()  # idempotent


def test_an_exception_in_the_block_leaves_the_state_open(one_rank_group):
    ddp = DDP(_net())
    with pytest.raises(KeyError):
        with hvdcompress.DDPHookState("3lc").register(ddp) as state:
            _step(ddp)
            raise KeyError("the training loop failed")
    assert len(_hook_threads()) == 3  # the exception, not close(), ends the job
    _step(ddp)  # still usable
    state.close()
    assert _hook_threads() == []


def test_close_before_binding_and_without_overlap(one_rank_group):
    hvdcompress.DDPHookState("3lc").close()  # nothing bound: nothing to do
    ddp = DDP(_net())
    state = hvdcompress.DDPHookState("3lc", overlap=False).register(ddp)
    _step(ddp)
    groups = _groups()
    state.close()  # inline: the groups are the user's, left alone
    assert _groups() == groups and not dist.distributed_c10d._world.pg_map == {}


def test_payload_error_finds_the_error_itself_and_in_a_chain():
    err = PayloadError("body", "truncated", rank=2, tensor="w")
    assert hvdcompress.payload_error(err) is err
    try:
        try:
            raise err
        except PayloadError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert hvdcompress.payload_error(outer) is err
    assert hvdcompress.payload_error(RuntimeError("gloo: connection reset")) is None
    assert hvdcompress.payload_error(ValueError("field 'body'")) is None


def test_payload_error_finds_a_remembered_error_by_its_text_in_ddps_runtime_error():
    err = errors.remember(PayloadError("frame", "length table off by one", rank=1))
    ddp_text = f"Got the following error when running the callback: PayloadError: {err}"
    found = hvdcompress.payload_error(RuntimeError(ddp_text))
    assert found is err and (found.rank, found.field) == (1, "frame")
    other = PayloadError("frame", "another", rank=3)  # never raised by a hook here
    assert hvdcompress.payload_error(RuntimeError(f"PayloadError: {other}")) is None


def test_only_the_last_sixteen_errors_are_remembered():
    first = errors.remember(PayloadError("body", "the very first", rank=0))
    for k in range(16):
        errors.remember(PayloadError("body", f"later {k}", rank=0))
    assert hvdcompress.payload_error(RuntimeError(str(first))) is None
    assert len(errors._RAISED) == 16
