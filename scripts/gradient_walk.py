#!/usr/bin/env python
"""Trace one gradient from the backward hook to ``p.grad`` and count the layer reversals.

One process (an mpi4py world of one rank), one parameter tensor, 3LC on the gather path
(or ``--compression``): two warm-up steps, then one traced step. Every call into and
return out of a function of the ``hvdcompress`` package on the main thread is recorded
(``sys.setprofile``); each module is given its layer, top to bottom:

    0 the adapters and the reducer (optimizer, ddp, reducer, buckets, stats, compression)
    1 exchange, policies
    2 compressors, transports
    3 wire, codecs, the backend dispatch (backends/__init__.py)
    4 backends (CPU C library, CUDA kernels)

The walk is the sequence of layers the running code is in, consecutive repeats merged;
a reversal is a turn in it (down then up, or up then down). Printed: the modules in
visiting order, the files touched and the number of reversals.

    python scripts/gradient_walk.py                  # 3lc
    python scripts/gradient_walk.py --compression topk --show
    python scripts/gradient_walk.py --ddp            # the DDP hook's path (gloo, one rank)

``--ddp`` traces the same step through ``torch.nn.parallel.DistributedDataParallel`` with
``hvdcompress.ddp_hook`` registered (a gloo process group of one rank): from the hook to
the future it returns; DDP copies the buffer into ``p.grad``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

import torch

import hvdcompress

PACKAGE = Path(hvdcompress.__file__).resolve().parent
LAYERS = [
    ("backends/__init__.py", 3),  # the backend protocol and device dispatch, no math
    ("backends/records.py", 3),  # plain records, no math
    ("backends/", 4),
    ("codecs/", 3),
    ("wire", 3),
    ("compressors/", 2),
    ("transports/", 2),
    ("exchange", 1),
    ("policies/", 1),
    ("", 0),  # optimizer/, ddp/, reducer.py, buckets.py, stats.py, compression.py
]


# The four concepts of docs/design.md as layers: the wrapper; the exchange with the
# transport it drives; the compressors; the bytes (wire format, codec math, backends).
COARSE = {0: 0, 1: 1, 2: 2, 3: 3, 4: 3}
COARSE_TRANSPORT = 1


def layer_of(path: str) -> tuple[str, int] | None:
    try:
        rel = Path(path).resolve().relative_to(PACKAGE).as_posix()
    except ValueError:
        return None
    for prefix, layer in LAYERS:
        if rel.startswith(prefix):
            return rel, layer
    return None


def accessors() -> set:
    """Code objects of the package's properties: reading a record's field (a header's
    ``numel``, a bucket's ``device``) moves no control between layers, so it is skipped."""
    codes = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("hvdcompress"):
            continue
        for obj in vars(module).values():
            if isinstance(obj, type) and obj.__module__ == name:
                for attr in vars(obj).values():
                    if isinstance(attr, property) and attr.fget is not None:
                        codes.add(attr.fget.__code__)
    return codes


def trace_step(step) -> list[tuple[str, int]]:
    """(module, layer) of the code running after each call and return, merged."""
    events: list[tuple[str, int]] = []
    main = threading.main_thread()
    skip = accessors()

    def profile(frame, event, arg):
        if threading.current_thread() is not main or event not in ("call", "return"):
            return
        if frame.f_code in skip:
            return
        where = frame if event == "call" else frame.f_back
        while where is not None:
            found = layer_of(where.f_code.co_filename)
            if found is not None:
                if not events or events[-1] != found:
                    events.append(found)
                return
            where = where.f_back

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return events


def reversals(layers: list[int]) -> int:
    merged = [x for i, x in enumerate(layers) if i == 0 or layers[i - 1] != x]
    turns = 0
    for a, b, c in zip(merged, merged[1:], merged[2:], strict=False):
        turns += (b - a) * (c - b) < 0
    return turns


def optimizer_step(args):
    """One step of ``DistributedOptimizer`` (an mpi4py world of one rank)."""
    weight = torch.nn.Parameter(torch.randn(args.numel))
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD([weight], lr=0.01),
        [("w", weight)],
        compression=args.compression,
        backend="mpi4py",
    )

    def step():
        opt.zero_grad()
        (weight * torch.randn(args.numel)).sum().backward()
        opt.step()

    return step


def ddp_step(args):
    """One step of a DDP model whose comm hook is ``hvdcompress.ddp_hook`` (gloo, one rank)."""
    import torch.distributed as dist

    store = dist.FileStore(tempfile.mkstemp(prefix="gradient_walk.")[1], 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model = torch.nn.Linear(args.numel, 1, bias=False)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = hvdcompress.DDPHookState(args.compression, named_parameters=model.named_parameters())
    ddp.register_comm_hook(state, hvdcompress.ddp_hook)
    opt = hvdcompress.hooked_optimizer(torch.optim.SGD(ddp.parameters(), lr=0.01), state)
    x = torch.randn(4, args.numel)

    def step():
        opt.zero_grad()
        ddp(x).sum().backward()
        opt.step()

    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", default="3lc")
    parser.add_argument("--numel", type=int, default=10_000)
    parser.add_argument("--show", action="store_true", help="print every step of the walk")
    parser.add_argument("--ddp", action="store_true", help="the DDP hook's path (gloo, one rank)")
    parser.add_argument(
        "--coarse",
        action="store_true",
        help="four layers: wrapper; exchange + transport; compressors; wire + codecs + backends",
    )
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    step = ddp_step(args) if args.ddp else optimizer_step(args)
    for _ in range(2):  # warm-up: residuals and library loaded
        step()
    walk = trace_step(step)
    if args.coarse:
        walk = [
            (m, COARSE_TRANSPORT if m.startswith("transports") else COARSE[layer])
            for m, layer in walk
        ]
    files = sorted({m for m, _ in walk})
    modules = [m for m, _ in walk]
    if args.show:
        for m, layer in walk:
            print(f"  {'  ' * layer}{m}")
    order = [m for i, m in enumerate(modules) if m not in modules[:i]]
    path = "the DDP hook" if args.ddp else "DistributedOptimizer"
    print(f"compression {args.compression} through {path}: one tensor, one traced step")
    print(f"modules in visiting order: {' -> '.join(order)}")
    layers = [layer for _, layer in walk]
    merged = [x for i, x in enumerate(layers) if i == 0 or layers[i - 1] != x]
    print(f"layers: {' '.join(map(str, merged))}")
    print(f"files: {len(files)}; layer changes: {len(merged) - 1}; "
          f"reversals: {reversals(layers)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
