"""hvdcompress.DistributedOptimizer across real MPI ranks (run under mpirun, 2 and 4 ranks).

    mpirun -np 2 python -m pytest --with-mpi tests/mpi/test_optimizer.py -q
    mpirun -np 4 --oversubscribe python -m pytest --with-mpi tests/mpi/test_optimizer.py -q

Backends: "mpi4py" always; "horovod" when horovod.torch imports (skipped otherwise, with
the reason). Deadlock rule as in tests/mpi/helpers.py: every rank runs the same
collectives; per-rank failures are gathered and reported after the last collective.
Checkpoints are in test_checkpoint.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import hvdcompress
from hvdcompress import framing
from hvdcompress.optimizer import RankAgreementError
from hvdcompress.wire import PayloadError
from tests.mpi.helpers import batch, digest, make_model, train, wrap

pytestmark = pytest.mark.mpi(min_size=2)


HAVE_HOROVOD = importlib.util.find_spec("horovod") is not None
BACKENDS = [
    "mpi4py",
    pytest.param(
        "horovod",
        marks=pytest.mark.skipif(not HAVE_HOROVOD, reason="horovod is not installed"),
    ),
]


def _init_backend(backend: str) -> None:
    if backend == "horovod":
        import horovod.torch as hvd

        hvd.init()


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_path_equals_mean_of_individually_decoded_payloads(backend, comm):
    _init_backend(backend)
    rank, size = comm.rank, comm.size
    model = make_model()
    opt = wrap(
        model,
        hvdcompress.Compression.threelc(sparsity=1.5),
        backend=backend,
        exchange="allgather",  # the two-stage exchange: tests/mpi/test_twostage.py
    )
    x, y = batch(rank, 0)
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
    digests = comm.allgather(digest(result.values()))
    assert len(set(digests)) == 1, "ranks hold different averaged gradients"
    assert any(not torch.equal(local[n], result[n]) for n in local)


def test_fusion_one_collective_per_bucket_same_result(comm):
    grads = {}
    stats = {}
    for threshold in (None, 0):
        model = make_model()
        opt = wrap(model, "3lc", fusion_threshold=threshold, exchange="allgather")
        x, y = batch(comm.rank, 0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        grads[threshold] = [p.grad.clone() for p in model.parameters()]
        stats[threshold] = (opt.last_stats.collectives, len(opt.buckets))
    n_params = len(list(make_model().parameters()))
    assert stats[None] == (1, 1), stats
    assert stats[0] == (n_params, n_params), stats
    assert all(torch.equal(a, b) for a, b in zip(grads[None], grads[0], strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compression", ["none", "fp16", "bf16"])
def test_summable_matches_manual_allreduce_after_steps(compression, backend, comm):
    _init_backend(backend)
    size = comm.size
    model = make_model()
    opt = wrap(model, compression, fusion_threshold=2048, backend=backend)
    assert len(opt.buckets) > 1
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    wire = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[compression]
    for step in range(5):
        train(model, opt, comm.rank, 1, start=step)
        x, y = batch(comm.rank, step)
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
def test_none_matches_horovod_distributed_optimizer(comm):
    import horovod.torch as hvd

    hvd.init()
    ours = make_model()
    opt = wrap(ours, hvdcompress.Compression.none)
    theirs = make_model()
    hopt = hvd.DistributedOptimizer(
        torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9),
        named_parameters=theirs.named_parameters(),
        compression=hvdcompress.Compression.none,
    )
    train(ours, opt, comm.rank, 5)
    train(theirs, hopt, comm.rank, 5)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        if comm.size == 2:  # a + b, then * 0.5: one rounding, whatever the algorithm
            assert torch.equal(a, b), f"{name}: max diff {(a - b).abs().max()}"
        else:  # MPI may add 4 ranks' values in another order than Horovod's fused buffer
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_50_steps_of_3lc_leave_identical_parameters_on_every_rank(backend, comm):
    _init_backend(backend)
    model = make_model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = wrap(model, "3lc", fusion_threshold=4096, backend=backend)
    losses = train(model, opt, comm.rank, 50)
    digests = comm.allgather(digest(model.parameters()))
    assert len(set(digests)) == 1, f"parameters differ across ranks: {digests}"
    assert any(not torch.equal(a, b) for a, b in zip(start, model.parameters(), strict=True))
    assert sum(losses[-10:]) < sum(losses[:10]), losses


@pytest.mark.parametrize("what", ["shape", "order", "dtype", "compressor", "missing_tensor"])
def test_ranks_that_disagree_get_an_error_on_every_rank(what, comm):
    odd = comm.rank == comm.size - 1
    model = make_model(width=17 if (odd and what == "shape") else 16)
    named = list(model.named_parameters())
    if odd and what == "order":
        named = named[::-1]
    if odd and what == "dtype":
        model.head.half()  # a dtype 3lc supports: the agreement check must catch it
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


def test_corrupt_payload_raises_on_every_rank_naming_sender_and_tensor(comm, monkeypatch):
    bad_rank = 1
    model = make_model()
    opt = wrap(model, "3lc", fusion_threshold=0, exchange="allgather")  # two-stage: its own
    target = "layers.1.weight"
    if comm.rank == bad_rank:
        real = framing.compress_bucket

        def corrupt(comp, tensors, names):  # one tensor a bucket: its payload ends the frame
            frame, ctxs = real(comp, tensors, names)
            if comp is opt.compressor and names == [target]:
                frame = frame.clone()
                frame[-1] ^= 0x5A
            return frame, ctxs

        monkeypatch.setattr(framing, "compress_bucket", corrupt)
    x, y = batch(comm.rank, 0)
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


def test_backward_passes_per_step_accumulates_before_communicating(comm):
    model = make_model()
    opt = wrap(model, "none", backward_passes_per_step=2)
    ref = make_model()
    for micro in range(2):
        x, y = batch(comm.rank, micro)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        if micro == 0:
            assert opt.last_stats.collectives == 0 and not opt._in_flight
    opt.synchronize()
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        summed = comm.allreduce(r.grad.numpy())
        torch.testing.assert_close(p.grad, torch.from_numpy(summed) / comm.size, msg=name)
    x, y = batch(comm.rank, 3)
    opt.zero_grad()
    for _ in range(2):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="backward_passes_per_step"):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()  # every rank made the same calls: ends the round cleanly


@pytest.mark.skipif(not HAVE_HOROVOD, reason="horovod is not installed")
def test_horovod_transport_gathers_where_horovod_moves_the_bytes():
    """HorovodTransport's allgatherv of a different number of bytes on each rank (none on
    rank 1) gives every rank's bytes and counts; it gathers host bytes, and device bytes
    exactly when Horovod was built with GPU support."""
    import horovod.torch as hvd

    from hvdcompress.transports.horovod import HorovodTransport

    hvd.init()
    t = HorovodTransport()
    rank, size = t.rank, t.size
    counts = [0 if r == 1 else 7 * r + 3 for r in range(size)]
    mine = torch.full((counts[rank],), rank + 1, dtype=torch.uint8)
    gathered, sizes = t.start_allgatherv(mine).wait()
    gpu_built = bool(hvd.cuda_built() or hvd.rocm_built())
    assert sizes == counts
    want = torch.cat([torch.full((n,), r + 1, dtype=torch.uint8) for r, n in enumerate(counts)])
    assert torch.equal(gathered, want)
    assert t.moves_on(torch.device("cpu"))
    assert t.moves_on(torch.device("cuda", 0)) == gpu_built
