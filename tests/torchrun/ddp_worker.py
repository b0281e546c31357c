"""One rank of tests/test_ddp_hook.py, under torchrun (gloo): DDP with hvdcompress.ddp_hook.

    torchrun --standalone --nproc_per_node 2 tests/torchrun/ddp_worker.py OUT_DIR

Writes OUT_DIR/rank<r>.json with what the test asserts: the largest difference between
DDP's own allreduce and ddp_hook with compression none; the parameter digests of a 3LC
run on every rank; whether resuming from each rank's own hook state equals the
uninterrupted run; the warnings of loading rank 0's state.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvdcompress


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Linear(16, 3)
    )


TEACHER = torch.randn(6, 3, generator=torch.Generator().manual_seed(7))


def data(rank: int, step: int):
    """Per-rank batches with learnable labels (a fixed linear teacher)."""
    x = torch.randn(12, 6, generator=torch.Generator().manual_seed(100 * step + rank))
    return x, (x @ TEACHER).argmax(1)


def digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(
    compression,
    steps: int,
    start: int = 0,
    model=None,
    state=None,
    saved=None,
    exchange="auto",
    link_cost=None,
):
    """DDP with ddp_hook and hvdcompress.hooked_optimizer (compression None: DDP's own
    allreduce and plain SGD); ``saved``: an optimizer state_dict to load first."""
    rank = dist.get_rank()
    net = model if model is not None else make_net()
    ddp = DDP(net, bucket_cap_mb=0.001)  # several buckets
    if compression is not None:
        if state is None:
            state = hvdcompress.DDPHookState(
                compression,
                named_parameters=net.named_parameters(),
                exchange=exchange,
                link_cost=link_cost,
                tuning=None,  # the first guess for good: resumes are exact (tuning_worker)
            )
        ddp.register_comm_hook(state, hvdcompress.ddp_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    if compression is not None:
        opt = hvdcompress.hooked_optimizer(opt, state)
    if saved is not None:
        opt.load_state_dict(saved)
    losses = []
    for step in range(start, start + steps):
        x, y = data(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return net, opt, state, losses


def corrupt_step(exchange: str) -> str | None:
    """One step in which rank 1 sends bucket frames whose length table is off by one
    (its transport's start wrapped); the error each rank's backward raises, and what
    ``hvdcompress.payload_error`` finds in it (rank, field, tensor)."""
    net = make_net()
    ddp = DDP(net, bucket_cap_mb=0.001)
    state = hvdcompress.DDPHookState(
        "3lc", named_parameters=net.named_parameters(), exchange=exchange, tuning=None
    ).register(ddp)
    transport = state.transport

    def off_by_one(frame: torch.Tensor) -> torch.Tensor:
        frame = frame.clone()
        frame[8:16].view(torch.int64).add_(1)  # the first payload's length
        return frame

    if dist.get_rank() == 1 and exchange == "twostage":
        start = transport.start_alltoallv
        transport.start_alltoallv = lambda parts, **kw: start(
            [p if j == 1 else off_by_one(p) for j, p in enumerate(parts)], **kw
        )
    elif dist.get_rank() == 1:
        start = transport.start_allgatherv
        transport.start_allgatherv = lambda frame, **kw: start(off_by_one(frame), **kw)
    x, y = data(dist.get_rank(), 0)
    try:
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
    except Exception as err:  # what the test asserts on
        found = hvdcompress.payload_error(err)  # DDP's RuntimeError -> the PayloadError
        where = None if found is None else [found.rank, found.field, found.tensor]
        return f"{type(err).__name__}: {err}", where
    return None, None


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    stock, _, _, _ = train(None, 4)
    hooked, _, _, _ = train("none", 4)
    none_diff = max(
        float((a - b).abs().max())
        for a, b in zip(stock.parameters(), hooked.parameters(), strict=True)
    )
    full, _, full_state, losses = train("3lc", 30)
    residual_names = sorted(full_state.compressor.state_dict()["residuals"])

    # resume: each rank its own state
    first, first_opt, first_state, _ = train("3lc", 12)
    # the optimizer's state_dict carries the hook state (hooked_optimizer)
    saved = copy.deepcopy({"model": first.state_dict(), "opt": first_opt.state_dict()})
    saved["hook"] = saved["opt"]["hvdcompress"]
    net2 = make_net()
    net2.load_state_dict(saved["model"])
    state = hvdcompress.DDPHookState("3lc", named_parameters=net2.named_parameters(), tuning=None)
    with warnings.catch_warnings(record=True) as own_warnings:
        warnings.simplefilter("always")
        net2, opt2, state, _ = train(
            "3lc", 18, start=12, model=net2, state=state, saved=saved["opt"]
        )

    # the two-stage exchange, asked for: bit-identical, and an exact resume although DDP
    # rebuilds its buckets in the resumed process (shards planned per tensor)
    staged, _, staged_state, staged_losses = train("3lc", 30, exchange="twostage")
    kinds = sorted({e.kind for e in staged_state.reducer.exchanges.values()})
    first2, first2_opt, _, _ = train("3lc", 12, exchange="twostage")
    saved2 = copy.deepcopy({"model": first2.state_dict(), "opt": first2_opt.state_dict()})
    net3 = make_net()
    net3.load_state_dict(saved2["model"])
    state3 = hvdcompress.DDPHookState(
        "3lc", named_parameters=net3.named_parameters(), exchange="twostage", tuning=None
    )
    net3, _, _, _ = train("3lc", 18, start=12, model=net3, state=state3, saved=saved2["opt"])
    staged_digests = [None] * size
    dist.all_gather_object(staged_digests, digest(staged))
    # "auto" by the link's measured seconds: calibrated at the first bucket, the same
    # exchanges on every rank
    timed, _, timed_state, timed_losses = train("3lc", 20, link_cost="measure")
    timed_digests = [None] * size
    dist.all_gather_object(timed_digests, digest(timed))

    # the hierarchical exchange on 2 nodes of 2 (size 4): finished on the finisher thread
    # (overlap) it leaves the same parameters as run all inline, on every rank
    hier = {}
    if size == 4:
        os.environ["HVDC_RANKS_PER_NODE"] = "2"
        for overlap in (True, False):
            net4 = make_net()
            state4 = hvdcompress.DDPHookState(
                "3lc", named_parameters=net4.named_parameters(), exchange="hierarchical",
                tuning=None, overlap=overlap,
            )  # fmt: skip
            net4, _, state4, losses4 = train("3lc", 16, model=net4, state=state4)
            hier_kinds = sorted({e.kind for e in state4.reducer.exchanges.values() if e})
            hier[overlap] = {
                "digest": digest(net4),
                "kinds": hier_kinds,
                "overlapping": state4.overlapping,
                "loss_first": sum(losses4[:4]) / 4,
                "loss_last": sum(losses4[-4:]) / 4,
            }
            del state4
        del os.environ["HVDC_RANKS_PER_NODE"]
    hier_digests = [None] * size
    dist.all_gather_object(hier_digests, hier.get(True, {}).get("digest"))

    # rank 0's hook state on every rank
    rank0 = [saved["hook"]]
    dist.broadcast_object_list(rank0, src=0)
    other = hvdcompress.DDPHookState("3lc", named_parameters=make_net().named_parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load_state_dict(rank0[0])
    digests = [None] * size
    dist.all_gather_object(digests, digest(full))
    corrupt = {mode: corrupt_step(mode) for mode in ("allgather", "twostage")}
    found = {mode: where for mode, (_, where) in corrupt.items()}
    corrupt = {mode: text for mode, (text, _) in corrupt.items()}
    dist.barrier()  # every rank came out of the failed steps
    result = {
        "rank": rank,
        "size": size,
        "none_max_diff": none_diff,
        "digests_3lc": digests,
        "loss_first": sum(losses[:5]) / 5,
        "loss_last": sum(losses[-5:]) / 5,
        "residual_names": residual_names,
        "resume_equal": digest(full) == digest(net2),
        "own_state_warnings": [str(w.message) for w in own_warnings],
        "rank0_state_warnings": [str(w.message) for w in caught],
        "rank0_residuals_after": len(other.compressor.state_dict()["residuals"]),
        "bits_per_value": full_state.last_stats.bits_per_value,
        "overlapping": full_state.overlapping,
        "corrupt_errors": corrupt,
        "corrupt_found": found,
        "twostage_kinds": kinds,
        "twostage_digests": staged_digests,
        "twostage_loss_first": sum(staged_losses[:5]) / 5,
        "twostage_loss_last": sum(staged_losses[-5:]) / 5,
        "twostage_pieces": sorted(staged_state.compressor.state_dict()["residuals"]),
        "twostage_resume_equal": digest(staged) == digest(net3),
        "hierarchical": {str(k): v for k, v in hier.items()},
        "hierarchical_digests": hier_digests,
        "timed_digests": timed_digests,
        "timed_link_cost": type(timed_state.link_cost).__name__,
        "timed_kinds": sorted({e.kind for e in timed_state.reducer.exchanges.values() if e}),
        "timed_loss_first": sum(timed_losses[:5]) / 5,
        "timed_loss_last": sum(timed_losses[-5:]) / 5,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    # DDP's reducers hold the process group: gone before it is destroyed
    del net2, opt2, state, other, full_state, staged_state, state3, timed_state
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
