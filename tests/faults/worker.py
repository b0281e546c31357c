"""A tiny training job that injects one fault on one rank (tests/faults/test_faults.py).

    mpirun -np 2 python tests/faults/worker.py --backend mpi4py --fault raise
    horovodrun -np 2 -H localhost:2 --gloo python tests/faults/worker.py --backend horovod ...

Faults, on rank ``--rank`` at step ``--step``:

* ``none``: no fault (the job must finish cleanly);
* ``exit``: ``os._exit(3)`` during backward, after the later layers' collectives started;
* ``kill``: SIGKILL to itself during backward (as ``exit``);
* ``between``: SIGKILL to itself between two steps (no collective of this rank pending);
* ``sysexit``: ``sys.exit(0)`` between two steps (a clean exit while the others go on);
* ``raise``: an exception out of the step (backward done, collectives in flight);
* ``frame``: the bucket frame it sends has a wrong length table (``lengths``) or is cut
  short inside its table (``truncated``): the transport's ``start_allgatherv`` is wrapped;
* ``stall``: sleeps ``--sleep`` seconds before its backward (the others wait in a
  collective);
* ``gil``: stops for good inside a C call that holds the GIL, during backward with
  collectives pending (as a rank stuck in a Horovod submit would); the other ranks take
  a stall shutdown time of 30 s, so that only the stuck rank's own timer ends the job
  quickly.

Every rank prints ``worker rank R step S`` after each step and ``worker rank R done`` at
the end; the argument ``--tag`` only marks the processes (the test looks for leftovers). SIGUSR1
prints every thread's stack (the test sends it to a job that hangs, before killing it).
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import hvdcompress  # noqa: E402


def corrupt_frame(frame: torch.Tensor, how: str) -> torch.Tensor:
    """A bucket frame (count, lengths, payloads) made invalid in its table."""
    frame = frame.clone()
    if how == "truncated":
        return frame[:12]  # the count and half a length: shorter than the table
    table = frame[8:16].view(torch.int64)  # first payload's length
    table += 1  # lengths no longer add up to the frame's size
    return frame


def hold_the_gil_for_good() -> None:
    ctypes.PyDLL(None).sleep(600)  # ctypes.PyDLL keeps the GIL through the call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="mpi4py")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--step", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--sleep", type=float, default=30.0)
    ap.add_argument("--frame", default="lengths", choices=["lengths", "truncated"])
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's view of a hang

    if args.fault == "gil" and os.environ.get("HOROVOD_RANK") != str(args.rank):
        os.environ["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = "30"

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )  # fmt: skip
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        model.named_parameters(),
        compression="3lc",
        backend=args.backend,
        fusion_threshold=0,  # one collective per tensor: faults land between collectives
    )
    transport = opt.transport
    rank = transport.rank
    faulty = rank == args.rank

    if faulty and args.fault == "frame":
        start = transport.start_allgatherv
        calls = {"n": 0}
        gathered = sum(b.compressed for b in opt.buckets)  # "auto" sends a few biases dense

        def start_allgatherv(local, **kw):  # kw: the call site's key
            calls["n"] += 1
            if calls["n"] > args.step * gathered:  # from step --step on
                local = corrupt_frame(local, args.frame)
            return start(local, **kw)

        transport.start_allgatherv = start_allgatherv

    if faulty and args.fault in ("exit", "kill", "gil"):

        def die(grad):
            if step == args.step:
                print(f"worker rank {rank}: fault {args.fault} in backward", flush=True)
                if args.fault == "exit":
                    os._exit(3)
                if args.fault == "gil":
                    hold_the_gil_for_good()
                os.kill(os.getpid(), signal.SIGKILL)
            return grad

        model[0].weight.register_hook(die)  # the last gradient: later buckets have started

    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        if faulty and step == args.step:
            if args.fault == "between":
                print(f"worker rank {rank}: fault kill between steps", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if args.fault == "sysexit":
                print(f"worker rank {rank}: fault sys.exit(0) between steps", flush=True)
                sys.exit(0)
            if args.fault == "stall":
                print(f"worker rank {rank}: stalling {args.sleep} s", flush=True)
                time.sleep(args.sleep)
        opt.zero_grad()
        x = torch.randn(8, 16, generator=g)
        model(x).square().mean().backward()
        if faulty and step == args.step and args.fault == "raise":
            raise RuntimeError(f"injected fault on rank {rank} at step {step}")
        opt.step()
        print(f"worker rank {rank} step {step}", flush=True)
    print(f"worker rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
