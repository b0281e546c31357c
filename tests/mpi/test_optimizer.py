"""hvdcompress.DistributedOptimizer across real MPI ranks (run under mpirun, 2 and 4 ranks).

    mpirun -np 2 python -m pytest --with-mpi tests/mpi/test_optimizer.py -q
    mpirun -np 4 --oversubscribe python -m pytest --with-mpi tests/mpi/test_optimizer.py -q

Backends: "mpi4py" always; "horovod" when horovod.torch imports (skipped otherwise, with
the reason). Deadlock rule as in test_allgather_threelc.py: every rank runs the same
collectives; per-rank failures are gathered and reported after the last collective.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util

import pytest
import torch

import hvdcompress
from hvdcompress.optimizer import RankAgreementError
from hvdcompress.wire import PayloadError

pytestmark = pytest.mark.mpi(min_size=2)

HAVE_HOROVOD = importlib.util.find_spec("horovod") is not None
BACKENDS = [
    "mpi4py",
    pytest.param(
        "horovod",
        marks=pytest.mark.skipif(not HAVE_HOROVOD, reason="horovod is not installed"),
    ),
]


def _comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _init_backend(backend: str) -> None:
    if backend == "horovod":
        import horovod.torch as hvd

        hvd.init()


class ManySmall(torch.nn.Module):
    """Several layers of different shapes (some tiny) so buckets hold several tensors."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(4 * 6 * 6 if i == 0 else width, width) for i in range(depth)]
        )
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        x = torch.relu(self.conv(x)).flatten(1)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _model(seed: int = 0, **kw) -> ManySmall:
    torch.manual_seed(seed)
    return ManySmall(**kw)


_TEACHER = torch.randn(64, 3, generator=torch.Generator().manual_seed(7))


def _batch(rank: int, step: int, n: int = 16):
    """Per-rank, per-step inputs with learnable labels (a fixed linear teacher)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 1, 8, 8, generator=g)
    return x, (x.flatten(1) @ _TEACHER).argmax(1)


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _train(model, opt, rank: int, steps: int, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        x, y = _batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _wrap(model, backend, compression, **kw):
    return hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(),
        compression=compression,
        backend=backend,
        **kw,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_path_equals_mean_of_individually_decoded_payloads(backend):
    _init_backend(backend)
    comm = _comm()
    rank, size = comm.rank, comm.size
    model = _model()
    opt = _wrap(model, backend, hvdcompress.Compression.threelc(sparsity=1.5))
    x, y = _batch(rank, 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.synchronize()
    result = {n: p.grad.clone() for n, p in model.named_parameters()}

    # Reference: a fresh compressor makes the same payloads; every payload decoded alone.
    ref_comp = hvdcompress.get_compressor("3lc", sparsity=1.5)
    mine = {n: ref_comp.compress(g, n)[0].numpy().tobytes() for n, g in local.items()}
    everyone = comm.allgather(mine)
    decoder = hvdcompress.get_compressor("3lc", sparsity=1.5)
    for name, got in result.items():
        acc = torch.zeros(got.numel(), dtype=torch.float32)
        for r in range(size):
            payload = torch.frombuffer(bytearray(everyone[r][name]), dtype=torch.uint8)
            acc += decoder.decode(payload).reshape(-1).float()
        expected = (acc * (1.0 / size)).view_as(got)
        assert torch.equal(got, expected), f"{name}: max diff {(got - expected).abs().max()}"
    assert opt.last_stats.collectives == len(opt.buckets)
    assert opt.last_stats.bits_per_value < 8, opt.last_stats.bits_per_value
    digests = comm.allgather(_digest(result.values()))
    assert len(set(digests)) == 1, "ranks hold different averaged gradients"
    assert any(not torch.equal(local[n], result[n]) for n in local)


def test_fusion_one_collective_per_bucket_same_result():
    comm = _comm()
    grads = {}
    stats = {}
    for threshold in (None, 0):
        model = _model()
        opt = _wrap(model, "mpi4py", "3lc", fusion_threshold=threshold)
        x, y = _batch(comm.rank, 0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        grads[threshold] = [p.grad.clone() for p in model.parameters()]
        stats[threshold] = (opt.last_stats.collectives, len(opt.buckets))
    n_params = len(list(_model().parameters()))
    assert stats[None] == (1, 1), stats
    assert stats[0] == (n_params, n_params), stats
    assert all(torch.equal(a, b) for a, b in zip(grads[None], grads[0], strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compression", ["none", "fp16", "bf16"])
def test_summable_matches_manual_allreduce_after_steps(compression, backend):
    _init_backend(backend)
    comm = _comm()
    size = comm.size
    model = _model()
    opt = _wrap(model, backend, compression, fusion_threshold=2048)
    assert len(opt.buckets) > 1
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    wire = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[compression]
    for step in range(5):
        _train(model, opt, comm.rank, 1, start=step)
        x, y = _batch(comm.rank, step)
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        for p in ref.parameters():
            every = comm.allgather(p.grad.to(wire))
            total = every[0]
            for g in every[1:]:  # summed in the wire dtype, each add rounded, as the op does
                total = (total.float() + g.float()).to(wire)
            p.grad.copy_(total.float() * (1.0 / size))
        ref_opt.step()
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        if compression == "none" and size == 2:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=name)
    assert opt.last_stats.bits_per_value == {"none": 32, "fp16": 16, "bf16": 16}[compression]


@pytest.mark.skipif(not HAVE_HOROVOD, reason="horovod is not installed")
def test_none_matches_horovod_distributed_optimizer():
    import horovod.torch as hvd

    hvd.init()
    comm = _comm()
    ours = _model()
    opt = _wrap(ours, "mpi4py", hvdcompress.Compression.none)
    theirs = _model()
    hopt = hvd.DistributedOptimizer(
        torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9),
        named_parameters=theirs.named_parameters(),
        compression=hvdcompress.Compression.none,
    )
    _train(ours, opt, comm.rank, 5)
    _train(theirs, hopt, comm.rank, 5)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        if comm.size == 2:  # a + b, then * 0.5: one rounding, whatever the algorithm
            assert torch.equal(a, b), f"{name}: max diff {(a - b).abs().max()}"
        else:  # MPI may add 4 ranks' values in another order than Horovod's fused buffer
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_50_steps_of_3lc_leave_identical_parameters_on_every_rank(backend):
    _init_backend(backend)
    comm = _comm()
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = _wrap(model, backend, "3lc", fusion_threshold=4096)
    losses = _train(model, opt, comm.rank, 50)
    digests = comm.allgather(_digest(model.parameters()))
    assert len(set(digests)) == 1, f"parameters differ across ranks: {digests}"
    assert any(not torch.equal(a, b) for a, b in zip(start, model.parameters(), strict=True))
    assert sum(losses[-10:]) < sum(losses[:10]), losses


def _resume_run(comm, split: int | None, steps: int, load_compressor: bool = True):
    model = _model()
    opt = _wrap(model, "mpi4py", "3lc")
    if split is None:
        _train(model, opt, comm.rank, steps)
        return model, opt
    _train(model, opt, comm.rank, split)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    del model, opt
    model = _model(seed=123)  # different init: everything must come from the checkpoint
    opt = _wrap(model, "mpi4py", "3lc")
    model.load_state_dict(saved["model"])
    if not load_compressor:
        saved["opt"].pop("hvdcompress")
    opt.load_state_dict(saved["opt"])
    _train(model, opt, comm.rank, steps - split, start=split)
    return model, opt


def test_resume_from_checkpoint_equals_uninterrupted():
    comm = _comm()
    full, full_opt = _resume_run(comm, None, 12)
    resumed, _ = _resume_run(comm, 5, 12)
    no_residual, _ = _resume_run(comm, 5, 12, load_compressor=False)
    residuals = full_opt.compressor.state_dict()["residuals"]
    assert any(float(e.abs().max()) > 0 for e in residuals.values())
    assert _digest(full.parameters()) == _digest(resumed.parameters())
    # The residuals matter: dropping them must change the result, or this test proves nothing.
    assert _digest(full.parameters()) != _digest(no_residual.parameters())


def test_checkpoint_of_another_rank_is_refused():
    comm = _comm()
    model = _model()
    opt = _wrap(model, "mpi4py", "3lc")
    _train(model, opt, comm.rank, 1)
    states = comm.allgather(opt.state_dict())
    other = states[(comm.rank + 1) % comm.size]
    with pytest.raises(ValueError, match="saved by rank"):
        opt.load_state_dict(other)


@pytest.mark.parametrize("what", ["shape", "order", "dtype", "compressor", "missing_tensor"])
def test_ranks_that_disagree_get_an_error_on_every_rank(what):
    comm = _comm()
    odd = comm.rank == comm.size - 1
    model = _model(width=17 if (odd and what == "shape") else 16)
    named = list(model.named_parameters())
    if odd and what == "order":
        named = named[::-1]
    if odd and what == "dtype":
        model.head.double()
        named = list(model.named_parameters())
    if odd and what == "missing_tensor":
        model.head.bias.requires_grad_(False)
    compression = hvdcompress.Compression.threelc(
        sparsity=1.5 if (odd and what == "compressor") else 1.0
    )
    err = None
    try:
        hvdcompress.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named,
            compression=compression,
            backend="mpi4py",
        )
    except RankAgreementError as e:
        err = str(e)
    errors = comm.allgather(err)
    assert all(e is not None for e in errors), f"not every rank raised: {errors}"
    assert f"ranks [{comm.size - 1}]" in err, err
    assert "first difference" in err, err


def test_corrupt_payload_raises_on_every_rank_naming_sender_and_tensor():
    comm = _comm()
    bad_rank = 1
    model = _model()
    opt = _wrap(model, "mpi4py", "3lc", fusion_threshold=0)
    target = "layers.1.weight"
    if comm.rank == bad_rank:
        real = opt.compressor.compress

        def corrupt(tensor, name):
            payload, ctx = real(tensor, name)
            if name == target:
                payload = payload.clone()
                payload[-1] ^= 0x5A
            return payload, ctx

        opt.compressor.compress = corrupt
    x, y = _batch(comm.rank, 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    err = None
    try:
        opt.synchronize()
    except PayloadError as e:
        err = e
    errors = comm.allgather(None if err is None else (err.rank, err.tensor, str(err)))
    assert all(e is not None for e in errors), f"not every rank raised: {errors}"
    assert all(e[0] == bad_rank and e[1] == target for e in errors), errors
    assert f"from rank {bad_rank}" in errors[0][2] and target in errors[0][2]
    # The ranks are still in step: a following collective completes.
    assert comm.allreduce(1) == comm.size


def test_backward_passes_per_step_accumulates_before_communicating():
    comm = _comm()
    model = _model()
    opt = _wrap(model, "mpi4py", "none", backward_passes_per_step=2)
    ref = _model()
    for micro in range(2):
        x, y = _batch(comm.rank, micro)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        if micro == 0:
            assert opt.last_stats.collectives == 0 and not opt._in_flight
    opt.synchronize()
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        summed = comm.allreduce(r.grad.numpy())
        torch.testing.assert_close(p.grad, torch.from_numpy(summed) / comm.size, msg=name)
    x, y = _batch(comm.rank, 3)
    opt.zero_grad()
    for _ in range(2):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="backward_passes_per_step"):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()  # every rank made the same calls: ends the round cleanly
