"""DDPHookState binds late: it is built before any process group exists (as Lightning and
Accelerate need), binds at register / bind / the first bucket, waits with a state loaded
before binding, serves one model only, ends its step at each optimizer step over its
parameters, and warns when an optimizer step ran but DDP never called the hook."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvdcompress
from hvdcompress.ddp import NEVER_CALLED


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def step(ddp, optimizer) -> None:
    optimizer.zero_grad()
    ddp(torch.randn(5, 8, generator=torch.Generator().manual_seed(1))).sum().backward()
    optimizer.step()


def test_a_state_is_built_before_any_process_group_and_says_it_is_unbound():
    assert not dist.is_initialized()
    state = hvdcompress.DDPHookState("3lc")
    assert not state.bound
    with pytest.raises(RuntimeError, match="not bound to a process group yet"):
        _ = state.transport
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        state.bind()


def test_a_state_loaded_before_binding_waits_and_is_checked_when_it_binds(tmp_path):
    model = net()
    saved = {"rank": 0, "size": 4, "compressor": "ThreeLC(sparsity=1.0)", "compressor_state": {}}
    state = hvdcompress.DDPHookState("3lc")
    state.load_state_dict(saved)  # no process group: kept for bind
    assert state.state_dict() == saved
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 's'}", rank=0, world_size=1)
    try:
        with pytest.raises(hvdcompress.CheckpointError, match="different world size"):
            state.register(DDP(model))
    finally:
        dist.destroy_process_group()


def test_register_binds_names_and_hooks_the_model(one_rank_group):
    model = net()
    ddp = DDP(model)
    state = hvdcompress.DDPHookState("3lc").register(ddp)
    assert state.bound and state.transport.size == 1
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # registered: no never-called warning
        step(ddp, optimizer)
    assert state.hook_calls >= 1
    assert state.last_stats.numel == sum(p.numel() for p in model.parameters())
    names = set(state.compressor.state_dict()["residuals"])
    assert names == {n for n, _ in model.named_parameters()}


def test_one_state_serves_one_model(one_rank_group):
    state = hvdcompress.DDPHookState("3lc")
    first = net()
    state.register(DDP(first))
    state.register(DDP(first))  # a new wrapper of the same module (a second fit)
    with pytest.raises(RuntimeError, match="registered on another model"):
        state.register(DDP(net()))
    with pytest.raises(TypeError, match="needs a DistributedDataParallel"):
        hvdcompress.DDPHookState("3lc").register(net())


def test_an_unnamed_state_hooked_on_two_models_is_refused_after_the_first_step(one_rank_group):
    state = hvdcompress.DDPHookState("3lc")
    a, b = DDP(net()), DDP(net())
    a.register_comm_hook(state, hvdcompress.ddp_hook)
    b.register_comm_hook(state, hvdcompress.ddp_hook)
    step(a, torch.optim.SGD(a.parameters(), lr=0.1))
    with pytest.raises(Exception, match="used by two models"):
        step(b, torch.optim.SGD(b.parameters(), lr=0.1))


def test_an_optimizer_step_the_hook_never_saw_warns_once(one_rank_group):
    model = net()
    ddp = DDP(model)  # the trap: the state exists, DDP never got the hook
    state = hvdcompress.DDPHookState("3lc", named_parameters=model.named_parameters())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(ddp, optimizer)
        step(ddp, optimizer)
    assert [str(w.message) for w in caught if "never called" in str(w.message)] == [NEVER_CALLED]
    assert state.hook_calls == 0


def test_only_an_optimizer_over_the_states_parameters_ends_its_step(one_rank_group):
    model, other = net(), net()
    ddp = DDP(model)
    state = hvdcompress.DDPHookState("3lc").register(ddp)
    ddp(torch.randn(5, 8)).sum().backward()
    pending = state.step_stats.numel
    assert pending > 0 and state.last_stats.numel == 0
    other(torch.randn(5, 8)).sum().backward()
    torch.optim.SGD(other.parameters(), lr=0.1).step()  # not this state's parameters
    assert state.last_stats.numel == 0 and state.step_stats.numel == pending
    torch.optim.SGD(ddp.parameters(), lr=0.1).step()
    assert state.last_stats.numel == pending and state.step_stats.numel == 0
