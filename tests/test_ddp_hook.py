"""hvdcompress.ddp_hook under torchrun (gloo, 2 and 4 ranks): DDP's own allreduce equals
the hook with compression none; 3LC leaves bit-identical parameters on every rank and
trains; resuming from each rank's own hook state equals the uninterrupted run; rank 0's
state loads on the other ranks without its residuals, with the warning. The ranks run
tests/torchrun/ddp_worker.py and report in JSON. Also scripts/train.py --launcher torchrun,
and in-process checks on a one-rank gloo world (the hook's decoded gradient, residuals of
unknown parameters refused)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hvdcompress.buckets import PieceKey

WORKER = Path(__file__).parent / "torchrun" / "ddp_worker.py"
# a native abort at exit (docs/checkpoints-and-faults.md, "Clean exits")
NATIVE_ABORT = re.compile(r"terminate called|Aborted|core dumped|Segmentation fault")


@pytest.fixture(scope="module", params=[2, 4], ids=["np2", "np4"])
def reports(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"ddp{request.param}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={request.param}", str(WORKER), str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    written = sorted(f.name for f in out.iterdir())
    assert done.returncode == 0, f"{written}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(request.param)]


def test_hook_with_compression_none_equals_ddps_allreduce(reports):
    for r in reports:
        assert r["none_max_diff"] <= 1e-6, r


def test_3lc_hook_leaves_bit_identical_parameters_and_trains(reports):
    digests = reports[0]["digests_3lc"]
    assert len(digests) == reports[0]["size"] and len(set(digests)) == 1
    assert reports[0]["loss_last"] < reports[0]["loss_first"]
    assert reports[0]["residual_names"] == ["0.bias", "0.weight", "2.bias", "2.weight",
                                            "3.bias", "3.weight"]  # fmt: skip
    assert all(r["overlapping"] for r in reports)  # gloo: buckets finish on the finisher
    assert 0 < reports[0]["bits_per_value"] < 8


def test_twostage_hook_leaves_bit_identical_parameters_trains_and_resumes_exactly(reports):
    r0 = reports[0]
    assert r0["twostage_kinds"] == ["twostage"]
    assert len(set(r0["twostage_digests"])) == 1 and len(r0["twostage_digests"]) == r0["size"]
    assert r0["twostage_loss_last"] < r0["twostage_loss_first"]
    for r in reports:
        # residuals of the pieces each rank sends, and "@owner" ones of those it owns
        pieces = [PieceKey.parse(n) for n in r["twostage_pieces"]]
        assert all(pieces) and any(n.endswith("@owner") for n in r["twostage_pieces"])
        assert {m.name for m in pieces} == {"0.bias", "0.weight", "2.bias", "2.weight",
                                               "3.bias", "3.weight"}  # fmt: skip
        assert r["twostage_resume_equal"], r["rank"]


def test_hierarchical_hook_with_overlap_equals_it_inline_bit_for_bit(reports):
    """4 ranks as 2 nodes of 2 (HVDC_RANKS_PER_NODE): the hook's hierarchical exchange
    finished on the finisher thread (overlap) leaves the parameters of the all-inline
    run, bit for bit, the same on every rank, and trains."""
    if reports[0]["size"] != 4:  # 2 ranks make no nodes of several ranks: not run
        assert all(r["hierarchical"] == {} for r in reports)
        return
    for r in reports:
        hier = r["hierarchical"]
        assert hier["True"]["overlapping"] and not hier["False"]["overlapping"]
        assert hier["True"]["kinds"] == hier["False"]["kinds"] == ["hierarchical"]
        assert hier["True"]["digest"] == hier["False"]["digest"], r["rank"]
        assert hier["True"]["loss_last"] < hier["True"]["loss_first"]
    assert len(set(reports[0]["hierarchical_digests"])) == 1


def test_hook_chooses_by_the_measured_link_the_same_on_every_rank(reports):
    r0 = reports[0]
    assert r0["timed_link_cost"] == "LinkCost"  # fitted at bind
    assert len(set(r0["timed_digests"])) == 1 and len(r0["timed_digests"]) == r0["size"]
    assert r0["timed_loss_last"] < r0["timed_loss_first"]
    assert all(r["timed_kinds"] == r0["timed_kinds"] for r in reports)


def test_hook_state_resumes_exactly_from_each_ranks_own_state(reports):
    for r in reports:
        assert r["resume_equal"], r["rank"]
        assert r["own_state_warnings"] == []


def test_rank0_hook_state_loads_elsewhere_without_its_residuals(reports):
    for r in reports:
        if r["rank"] == 0:
            assert r["rank0_state_warnings"] == []
        else:
            (message,) = r["rank0_state_warnings"]
            assert "saved by rank 0" in message and "restarts from zero" in message
            assert r["rank0_residuals_after"] == 0


def test_train_py_under_torchrun_trains_with_the_hook_and_prints_progress_lines(tmp_path):
    """scripts/train.py --launcher torchrun (2 ranks, synthetic data); rank 0's stderr is
    a pipe here, so progress comes as plain lines, not a carriage-return bar."""
    script = Path(__file__).parents[1] / "scripts" / "train.py"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(script), "--launcher", "torchrun", "--compression", "3lc", "--dataset",
        "synthetic", "--synthetic-size", "1024", "--batch-size", "32", "--epochs", "2",
        "--progress-every", "0.001", "--checkpoint", str(tmp_path / "ckpt"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not NATIVE_ABORT.search(done.stdout + done.stderr), done.stderr[-3000:]
    summary = [line for line in done.stdout.splitlines() if line.startswith("summary:")]
    assert len(summary) == 1 and "backend torch.distributed compression 3lc" in summary[0]
    fields = summary[0].split()
    first = float(fields[fields.index("first_loss") + 1])
    last = float(fields[fields.index("last_loss") + 1])
    assert last < first
    progress = [line for line in done.stderr.splitlines() if line.startswith("progress: step")]
    assert progress and progress[-1].startswith("progress: step 32/32 (100%)")
    assert "\r" not in done.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir())  # one file per rank


def test_hook_state_refuses_residuals_of_unknown_parameters(one_rank_group):
    import torch

    import hvdcompress

    model = torch.nn.Linear(4, 3)
    state = hvdcompress.DDPHookState("3lc", named_parameters=model.named_parameters())
    saved = state.state_dict()
    saved["compressor_state"] = {
        **saved["compressor_state"],
        "residuals": {"no.such.weight": torch.zeros(12)},
    }
    with pytest.raises(hvdcompress.CheckpointError, match="no.such.weight"):
        state.load_state_dict(saved)


def test_hook_on_one_rank_writes_the_decoded_gradient_into_the_bucket(one_rank_group):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvdcompress

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 2))
    x = torch.randn(5, 8)
    model(x).sum().backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ddp = DDP(model)
    state = hvdcompress.DDPHookState("3lc", named_parameters=model.named_parameters())
    ddp.register_comm_hook(state, hvdcompress.ddp_hook)
    ddp(x).sum().backward()
    reference = hvdcompress.get_compressor("3lc")
    for n, p in model.named_parameters():
        payload, ctx = reference.compress(local[n], n)
        assert torch.equal(p.grad, reference.decompress(payload, ctx)), n
    assert state.step_stats.numel == sum(p.numel() for p in model.parameters())


def test_a_corrupt_frame_in_the_hooks_future_fails_every_ranks_backward_by_name(reports):
    """Rank 1 sends frames whose length table is off by one (ddp_worker.corrupt_step):
    every rank's backward raises (no hang) with the PayloadError's text, naming rank 1
    and the bucket's tensors; DDP carries it across C++ as a RuntimeError."""
    for r in reports:
        for mode in ("allgather", "twostage"):
            error = r["corrupt_errors"][mode]
            assert error.startswith("RuntimeError:"), error
            assert "PayloadError: payload from rank 1: field 'frame'" in error, error
            assert "DDP bucket of" in error and "0.weight" in error, error
        assert "stage 1 (reduce-scatter)" in r["corrupt_errors"]["twostage"]


def test_payload_error_finds_the_payload_error_behind_ddps_runtime_error(reports):
    """hvdcompress.payload_error(err) on the RuntimeError DDP raised: the PayloadError
    object this rank's hook raised, with the sending rank and the field."""
    for r in reports:
        for mode in ("allgather", "twostage"):
            assert r["corrupt_found"][mode] == [1, "frame", None], (mode, r["corrupt_found"])


def test_a_closed_threaded_transport_frees_its_group_and_refuses_collectives(one_rank_group):
    """close() destroys the transport's own group and drops its reference, so the group's
    gloo threads end there, not at interpreter shutdown (docs/checkpoints-and-faults.md,
    "Clean exits"); a collective afterwards is a clear error, not one on another group."""
    import gc
    import weakref

    import torch.distributed as dist

    from hvdcompress.transports.torch_dist import TorchDistTransport

    transport = TorchDistTransport(dist.group.WORLD, threaded=True)
    assert transport.sum_floats([1.0, 2.0]) == [1.0, 2.0]
    group = weakref.ref(transport.group)
    transport.close()
    gc.collect()
    assert group() is None  # nothing holds the destroyed group: freed at close()
    with pytest.raises(RuntimeError, match="transport is closed"):
        transport.sum_floats([1.0])
    transport.close()  # idempotent
