#!/usr/bin/env python
"""How scripts/train.py ends under each launcher: N runs per (launcher, ranks), each with
a timeout; counts the runs whose exit status is not 0 and the runs whose output (stdout
or stderr, any rank) has a line of a native abort or memory fault (``terminate called``,
``Aborted``, ``core dumped``, ``Segmentation fault``, ``double free``, ``corrupted``),
and prints those lines.

    python scripts/exit_tally.py                                  # 30 runs of each case
    python scripts/exit_tally.py --runs 5 --cases torchrun:4 mpirun:2 --json tally.json

Cases are ``LAUNCHER:RANKS`` with LAUNCHER ``torchrun`` (``--launcher torchrun``: DDP with
hvdcompress.ddp_hook over gloo), ``mpirun`` (``--backend mpi4py``) or ``horovodrun``
(``--backend horovod``); the default is each launcher with 2 and 4 ranks. Every run trains
a few steps on synthetic data with one thread per rank (``--steps``, ``--train-arg``).
The runs of one case follow each other; the cases run in the order given, or interleaved
with ``--interleave`` (one run of each case per round). Exit status: 1 when any run failed
or printed such a line, else 0 (docs/checkpoints-and-faults.md, "Clean exits").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "scripts" / "train.py"
PY = sys.executable

ABORT = re.compile(r"terminate called|Aborted|core dumped|Segmentation fault|double free|corrupted")
LAUNCHERS = ("torchrun", "mpirun", "horovodrun")
DEFAULT_CASES = [f"{launcher}:{n}" for launcher in LAUNCHERS for n in (2, 4)]
TRAIN_ARGS = ["--dataset", "synthetic", "--synthetic-size", "512", "--width", "4",
              "--batch-size", "16", "--no-progress", "--threads", "1",
              "--compression", "3lc"]  # fmt: skip


def parse_case(text: str) -> tuple[str, int]:
    launcher, _, ranks = text.partition(":")
    if launcher not in LAUNCHERS or not ranks.isdigit() or int(ranks) < 1:
        raise argparse.ArgumentTypeError(
            f"expected LAUNCHER:RANKS with LAUNCHER one of {', '.join(LAUNCHERS)}, got {text!r}"
        )
    return launcher, int(ranks)


def command(launcher: str, ranks: int, train_args: list[str]) -> list[str]:
    """The command line of one run (the launchers' flags as in tests/)."""
    if launcher == "torchrun":
        return [PY, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={ranks}", str(TRAIN), "--launcher", "torchrun",
                *train_args]  # fmt: skip
    if launcher == "mpirun":
        return ["mpirun", "--oversubscribe", "--bind-to", "none", "--mca",
                "mpi_yield_when_idle", "1", "-np", str(ranks), PY, str(TRAIN),
                "--backend", "mpi4py", *train_args]  # fmt: skip
    horovodrun = shutil.which("horovodrun") or str(Path(PY).with_name("horovodrun"))
    return [horovodrun, "-np", str(ranks), "-H", f"localhost:{ranks}", PY, str(TRAIN),
            "--backend", "horovod", *train_args]  # fmt: skip


def environment() -> dict:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")  # no CMA in containers
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PATH"] = f"{Path(PY).parent}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}:{env.get('PYTHONPATH', '')}"
    return env


def run_once(cmd: list[str], timeout: float, env: dict) -> dict:
    """One run: exit status (None: timed out), seconds, the offending lines."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
            stdin=subprocess.DEVNULL, errors="replace",
        )  # fmt: skip
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc = None
        out = "".join(
            s.decode(errors="replace") if isinstance(s, bytes) else (s or "")
            for s in (err.stdout, err.stderr)
        )
    lines = [line for line in out.splitlines() if ABORT.search(line)]
    result = {"rc": rc, "seconds": round(time.monotonic() - t0, 2), "abort_lines": lines}
    if rc != 0:
        result["tail"] = out[-2000:]
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=30, help="runs per case (default 30)")
    p.add_argument(
        "--cases", nargs="+", type=parse_case, default=None, metavar="LAUNCHER:RANKS",
        help=f"default: {' '.join(DEFAULT_CASES)}",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=4, help="training steps per run (default 4)")
    p.add_argument(
        "--train-arg", action="append", default=[], metavar="ARG",
        help="extra argument of train.py, repeatable (--train-arg=--width=8)",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per run (default 180)")
    p.add_argument("--interleave", action="store_true", help="one run of each case per round")
    p.add_argument("--json", default=None, help="write every run's result here")
    p.add_argument("--quiet", action="store_true", help="no line per run")
    args = p.parse_args(argv)
    if args.runs < 1 or args.steps < 1 or args.timeout <= 0:
        p.error("--runs and --steps must be >= 1, --timeout > 0")
    cases = args.cases or [parse_case(c) for c in DEFAULT_CASES]
    train_args = [*TRAIN_ARGS, "--steps", str(args.steps), *args.train_arg]
    env = environment()

    results: dict[str, list[dict]] = {f"{la}:{n}": [] for la, n in cases}
    order = (
        [c for _ in range(args.runs) for c in cases]
        if args.interleave
        else [c for c in cases for _ in range(args.runs)]
    )
    for launcher, ranks in order:
        key = f"{launcher}:{ranks}"
        r = run_once(command(launcher, ranks, train_args), args.timeout, env)
        results[key].append(r)
        if not args.quiet:
            status = "timeout" if r["rc"] is None else f"rc {r['rc']}"
            print(f"{key:<14} run {len(results[key]):>3}: {status} {r['seconds']:6.1f} s"
                  f"{'  ABORT LINE' if r['abort_lines'] else ''}", flush=True)  # fmt: skip
        for line in r["abort_lines"]:
            print(f"  {key}: {line}", flush=True)
        if r["rc"] != 0 and not args.quiet:
            print("  " + r.get("tail", "")[-600:].replace("\n", "\n  "), flush=True)

    print(f"\n{'case':<14} {'runs':>5} {'rc!=0':>6} {'abort':>6} {'mean s':>7}")
    bad = 0
    summary = {}
    for key, rs in results.items():
        failed = sum(r["rc"] != 0 for r in rs)
        aborted = sum(bool(r["abort_lines"]) for r in rs)
        mean = sum(r["seconds"] for r in rs) / max(len(rs), 1)
        bad += failed + aborted
        summary[key] = {"runs": len(rs), "rc_nonzero": failed, "abort_lines": aborted}
        print(f"{key:<14} {len(rs):>5} {failed:>6} {aborted:>6} {mean:>7.1f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"train_args": train_args, "summary": summary, "runs": results}, indent=1)
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
