#!/usr/bin/env python
"""Coverage-guided fuzzing (atheris, libFuzzer) of the receive path and of checkpoint
loading, for a chosen number of minutes per target; a local tool, not a CI stage
(docs/checkpoints-and-faults.md, "Fuzzing the load paths").

Targets (scripts/_bench/fuzz_targets.py, which says what each input means and what a
finding is; tests/fuzz/test_coverage_targets.py runs them over their seeds without
atheris):

    frame       one payload decoded by a receiver (``check_decode`` of tests/fuzz), a
                payload of a bucket frame or a whole frame (``decode_frame`` against the
                per-payload path), for every codec configuration of the registry
    checkpoint  checkpoint files (``decode_checkpoint``), forged files with a valid digest
                (``torch.load(weights_only=True)``) and edited optimizer states
                (``check_optimizer_state``, ``DistributedOptimizer.load_state_dict``)

The hvdcompress modules are instrumented (``atheris.instrument_imports``): coverage of the
Python parsing and checks guides the mutations. The C library is not instrumented. Its
memory errors are caught by replaying the corpus the fuzzer grew under the sanitizer
build of CI stage 4 (scripts/run_tests.sh); ASan aborts at the first report:

    python scripts/fuzz_coverage.py --target all --minutes 5      # grows fuzz-findings/corpus
    HVDC_SANITIZE=address,undefined \\
    LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \\
    ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \\
    python scripts/fuzz_coverage.py --replay fuzz-findings/corpus/*

Fuzzing itself under that preload runs, but blind: gcc's libasan then provides the
coverage symbols, and atheris reports no coverage (cov 0). Coverage together with ASan
needs atheris built from source with clang (its ``asan_with_fuzzer.so``).

Each target runs in its own process (libFuzzer ends the process that runs it) on the
corpus ``--corpus``/<target>, seeded with valid inputs of every codec and optimizer and
kept between runs (libFuzzer adds what reaches new coverage). A finding (a target's
exception, an input slower than ``--timeout`` seconds, the process over ``--rss-limit-mb``)
stops that target; its input is written to ``--out`` as ``<target>-crash-<sha1>``
(``-timeout-``, ``-oom-``) and replays with ``--replay FILE`` (in this process, no
atheris needed; ``--replay DIR/corpus/frame`` replays a whole corpus). The summary gives, per
target, the seconds, executions, coverage (libFuzzer's ``cov`` edges and ``ft``
features, of the instrumented Python), corpus size and findings; the exit status is 1
when any target found something.

    python scripts/fuzz_coverage.py --target all --minutes 3 --seed 1
    python scripts/fuzz_coverage.py --replay fuzz-findings/checkpoint-crash-<sha1>
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import time
from pathlib import Path

TARGETS = ("frame", "checkpoint")
_STATS = re.compile(r"cov: (\d+) ft: (\d+) corp: (\d+)/")
_FINAL = re.compile(r"stat::number_of_executed_units: (\d+)")
_ARTIFACT = re.compile(r"Test unit written to (\S+)")
_REASON = re.compile(
    r"(ERROR: libFuzzer: .*|=== Uncaught Python exception: ===|^\w+(Error|Ran|Work)\b.*)"
)


def _targets():
    try:  # python scripts/fuzz_coverage.py: scripts/ is first on sys.path
        from _bench import fuzz_targets
    except ModuleNotFoundError:  # loaded by file path from the repository root
        from scripts._bench import fuzz_targets
    return fuzz_targets


def seed(corpus: Path, target: str) -> int:
    """Write ``target``'s seed inputs into ``corpus`` (named by their sha1); returns how
    many the corpus holds."""
    corpus.mkdir(parents=True, exist_ok=True)
    for data in _targets().seed_corpus(target):
        path = corpus / hashlib.sha1(data).hexdigest()
        if not path.exists():
            path.write_bytes(data)
    return sum(1 for _ in corpus.iterdir())


def worker(target: str, out: Path, libfuzzer_args: list[str]) -> None:
    """Fuzz ``target`` in this process (never returns: libFuzzer exits). A target's
    exception saves the input here first (libFuzzer may not get to, e.g. when its timer
    signal comes while it unwinds)."""
    import atheris

    with atheris.instrument_imports(include=["hvdcompress"]):
        import hvdcompress.backends.cpu  # noqa: F401 - imported lazily by the frame writer

        fuzz_targets = _targets()
    fuzz = fuzz_targets.TARGETS[target]

    def one_input(data: bytes) -> None:
        try:
            fuzz(data)
        except BaseException:
            path = out / f"{target}-crash-{hashlib.sha1(data).hexdigest()}"
            path.write_bytes(data)
            print(f"fuzz_coverage: Test unit written to {path}", file=sys.stderr, flush=True)
            raise

    atheris.Setup([sys.argv[0], *libfuzzer_args], one_input)
    atheris.Fuzz()


def run_target(args, target: str) -> dict:
    corpus = args.corpus / target
    seeds = seed(corpus, target)
    args.out.mkdir(parents=True, exist_ok=True)
    flags = [
        f"-max_total_time={max(1, round(60 * args.minutes))}",
        f"-seed={args.seed}",
        f"-timeout={args.timeout}",
        f"-rss_limit_mb={args.rss_limit_mb}",
        f"-artifact_prefix={args.out}/{target}-",
        "-print_final_stats=1",
        str(corpus),
    ]
    script = str(Path(__file__).resolve())
    cmd = [sys.executable, script, "--worker", target, str(args.out), "--", *flags]
    row = {"target": target, "seeds": seeds, "executions": 0, "cov": 0, "ft": 0, "corpus": 0}
    row.update(findings=[], reason=[])
    log = (args.out / f"{target}.log").open("w")
    t = time.time()
    with subprocess.Popen(cmd, stderr=subprocess.STDOUT, stdout=subprocess.PIPE, text=True) as p:
        for line in p.stdout:
            log.write(line)
            if not args.quiet:
                sys.stderr.write(line)
            if m := _STATS.search(line):
                row["cov"], row["ft"], row["corpus"] = map(int, m.groups())
            if m := re.match(r"#(\d+)\s", line):
                row["executions"] = max(row["executions"], int(m.group(1)))
            if m := _FINAL.search(line):
                row["executions"] = int(m.group(1))
            if (m := _ARTIFACT.search(line)) and m.group(1) not in row["findings"]:
                row["findings"].append(m.group(1))
            if (m := _REASON.search(line)) and len(row["reason"]) < 4:
                row["reason"].append(m.group(0).strip()[:300])
    log.close()
    row["seconds"] = round(time.time() - t, 1)
    row["status"] = p.returncode
    if p.returncode != 0 and not row["findings"]:
        row["findings"].append(f"(exit status {p.returncode}, no input saved: see {log.name})")
    return row


def replay(paths: list[Path]) -> int:
    """Run saved inputs through their target in this process, without atheris: findings
    (named ``<target>-...``) or corpus folders (``.../<target>/``, every file in them).
    Under the sanitizer build this checks the C library on everything the fuzzer kept."""
    fuzz_targets = _targets()
    count = 0
    for path in paths:
        files = sorted(path.iterdir()) if path.is_dir() else [path]
        name = path.name if path.is_dir() else path.name.split("-", 1)[0]
        if name not in TARGETS:
            raise SystemExit(f"{path}: not a <target>-... finding or a corpus folder <target>/")
        for f in files:
            fuzz_targets.TARGETS[name](f.read_bytes())
            count += 1
    print(f"replayed {count} inputs: all handled as documented")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1], Path(argv[2]), argv[4:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=[*TARGETS, "all"], default="all")
    ap.add_argument("--minutes", type=float, default=5.0, help="per target (default 5)")
    ap.add_argument("--seed", type=int, default=0, help="libFuzzer's random seed")
    ap.add_argument("--corpus", type=Path, help="corpus root, one folder per target "
                    "(default: OUT/corpus), seeded from every codec's valid inputs")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("fuzz-findings"),
                    help="findings and logs (default ./fuzz-findings)")  # fmt: skip
    ap.add_argument("--timeout", type=int, default=10, help="an input slower than this: a hang")
    ap.add_argument("--rss-limit-mb", type=int, default=4096, help="a process over it: a finding")
    ap.add_argument("--quiet", action="store_true", help="libFuzzer's output to the log only")
    ap.add_argument("--replay", type=Path, nargs="+", metavar="PATH",
                    help="run saved findings or corpus folders through their target")  # fmt: skip
    args = ap.parse_args(argv)
    if args.replay:
        return replay(args.replay)
    args.corpus = args.corpus or args.out / "corpus"
    rows = [run_target(args, t) for t in (TARGETS if args.target == "all" else [args.target])]
    print("\n| target | seconds | executions | cov | ft | corpus (seeds) | findings |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        found = len(r["findings"])
        print(
            f"| {r['target']} | {r['seconds']} | {r['executions']} | {r['cov']} | {r['ft']} "
            f"| {r['corpus']} ({r['seeds']}) | {found} |"
        )
    for r in rows:
        for f in r["findings"]:
            print(f"{r['target']}: finding {f}")
            for why in r["reason"]:
                print(f"    {why}")
    return 1 if any(r["findings"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
