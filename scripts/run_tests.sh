#!/usr/bin/env bash
# Run the whole test suite with the venv made by scripts/setup.sh (make test runs this):
#   1. scripts/check_kernels.sh      nvcc compile of the CUDA kernels (when present)
#   2. pytest tests -x -q            unit, host-kernel, fuzz and GPU(-skip) tests, one process
#   3. mpirun -np 2 / -np 4 ... pytest --with-mpi tests/mpi    the MPI tests under real Open MPI
#      and mpirun -np 3 / -np 5 ... tests/mpi/test_twostage.py    odd world sizes (shards)
#   4. the native code under ASan + UBSan: host kernels, valid inputs, fuzz, frame mutations
# Every stage runs even after a failure; any failure fails the script. The last line is
# "run_tests: N passed, N failed, N skipped" (MPI tests counted once, from rank 0).
#
# Environment: HVDC_VENV (default .venv), HVDC_MPI_NPS (world sizes, default "2 4"),
# HVDC_MPI_ODD_NPS (world sizes of the two-stage exchange's tests, default "3 5"), HVDC_PYTEST_TIMEOUT
# (s, default 2400), HVDC_MPI_TIMEOUT (s, default 900; a rank that fails before a
# collective leaves the others waiting forever), PYTEST_ADDOPTS (extra pytest options).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VENV=${HVDC_VENV:-$ROOT/.venv}
case "$VENV" in /*) ;; *) VENV=$ROOT/$VENV ;; esac
PY=$VENV/bin/python
[[ -x $PY ]] || {
    echo "run_tests: no venv at $VENV: run scripts/setup.sh (or make setup) first" >&2
    exit 1
}
export PATH="$VENV/bin:$PATH" VIRTUAL_ENV=$VENV
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-$([[ -n ${CI:-} ]] && echo ci || echo dev)}
if [[ $(id -u) -eq 0 ]]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
NPS=${HVDC_MPI_NPS:-2 4}

REPORTS=$(mktemp -d)
trap 'rm -rf "$REPORTS"' EXIT
FAILED_STAGES=()
STAGE_LINES=()
START=$SECONDS

banner() { printf '\n=== run_tests: %s ===\n' "$*"; }
record() { # record NAME RC SECONDS
    local status=ok
    [[ $2 -eq 0 ]] || {
        status="FAILED (exit $2)"
        FAILED_STAGES+=("$1")
    }
    STAGE_LINES+=("$(printf '%-34s %-16s %5ss' "$1" "$status" "$3")")
}

# --- 1. kernels -------------------------------------------------------------------------
banner "kernels (scripts/check_kernels.sh)"
if [[ -f scripts/check_kernels.sh ]]; then
    t=$SECONDS
    rc=0
    bash scripts/check_kernels.sh || rc=$?
    record "kernels (nvcc)" "$rc" $((SECONDS - t))
else
    echo "scripts/check_kernels.sh not present: skipped"
    STAGE_LINES+=("$(printf '%-34s %-16s' "kernels (nvcc)" "not present")")
fi

# --- 2. pytest, one process -------------------------------------------------------------
banner "pytest tests (HYPOTHESIS_PROFILE=$HYPOTHESIS_PROFILE)"
t=$SECONDS
rc=0
# tests/mpi runs in stage 3 under mpirun; here its tests would only be skipped.
timeout -k 30 "${HVDC_PYTEST_TIMEOUT:-2400}" \
    "$PY" -m pytest tests -x -q -rs --ignore=tests/mpi --junitxml="$REPORTS/serial.xml" || rc=$?
if [[ $rc -eq 5 ]]; then
    echo "run_tests: pytest collected no tests: that is a failure here (we always have tests)" >&2
elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    echo "run_tests: pytest timed out after ${HVDC_PYTEST_TIMEOUT:-2400}s" >&2
fi
record "pytest tests" "$rc" $((SECONDS - t))

# --- 3. MPI tests under mpirun, at each world size of HVDC_MPI_NPS ---------------------
MPI_OPTS=()
if mpirun --version 2>/dev/null | grep -q "Open MPI"; then
    # Shared memory + self only (no network probing, no openib/UCX warnings), no CPU
    # binding (2 cores, maybe more ranks), no single-copy CMA (refused in containers).
    # shellcheck disable=SC2054 # "self,vader" is one argument
    MPI_OPTS+=(--oversubscribe --bind-to none
        --mca pml ob1 --mca btl self,vader --mca btl_vader_single_copy_mechanism none
        --mca mpi_yield_when_idle 1)
fi
# (world size, what to run, report tag): the whole of tests/mpi at HVDC_MPI_NPS, and the
# two-stage exchange (uneven shards, shards of 0 and 1 values) at odd sizes too.
MPI_RUNS=()
for NP in $NPS; do MPI_RUNS+=("$NP tests/mpi $NP"); done
for NP in ${HVDC_MPI_ODD_NPS:-3 5}; do MPI_RUNS+=("$NP tests/mpi/test_twostage.py ${NP}ts"); done
for RUN in "${MPI_RUNS[@]}"; do
    read -r NP TARGET TAG <<<"$RUN"
    banner "mpirun -np $NP pytest --with-mpi $TARGET"
    t=$SECONDS
    rc=0
    if [[ ! -e $TARGET ]]; then
        echo "run_tests: $TARGET is missing" >&2
        rc=5
    else
        # Each rank writes its own JUnit report. Rank 0 prints to the console, the others
        # to a log shown below if anything fails. -p no:cacheprovider keeps the ranks from
        # racing on .pytest_cache.
        # shellcheck disable=SC2016
        timeout -k 30 "${HVDC_MPI_TIMEOUT:-900}" mpirun -np "$NP" "${MPI_OPTS[@]}" bash -c '
            r=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}
            [[ $r == 0 ]] || exec >"$1/mpi$2-rank$r.log" 2>&1
            exec "$0" -m pytest --with-mpi "$3" -q -rs --color=no -p no:cacheprovider \
                --junitxml="$1/mpi$2-rank$r.xml"' "$PY" "$REPORTS" "$TAG" "$TARGET" || rc=$?
        if [[ $rc -eq 124 || $rc -eq 137 ]]; then
            echo "run_tests: MPI tests timed out after ${HVDC_MPI_TIMEOUT:-900}s (a rank stuck in a collective?)" >&2
        fi
        if [[ $rc -ne 0 ]]; then
            for f in "$REPORTS"/mpi"$TAG"-rank*.log; do
                [[ -f $f ]] || continue
                echo "--- output of ${f##*/} (last 80 lines) ---"
                tail -n 80 "$f"
            done
        fi
    fi
    record "mpi $TARGET (-np $NP)" "$rc" $((SECONDS - t))
done

# --- 4. the native code under AddressSanitizer + UndefinedBehaviorSanitizer --------------
# kernels/*.c rebuilt with -fsanitize=address,undefined -fno-sanitize-recover=all
# (HVDC_SANITIZE, hvdcompress/backends/cpu/_library.py; the host builds of kernels/*.cu
# too, tests/host_kernels/conftest.py), the runtimes preloaded into Python: the host-kernel
# tests, the valid-input matrix, the fuzz tests and a short frame-mutation run. Any report
# ends the process with a non-zero status (its text on stderr: pytest -s). Not counted in
# the totals below (the same tests ran in stage 2).
banner "sanitizers (address, undefined)"
t=$SECONDS
rc=0
if [[ ${HVDC_SANITIZE_STAGE:-1} == 1 ]] && ASAN_LIB=$(gcc -print-file-name=libasan.so) \
    && UBSAN_LIB=$(gcc -print-file-name=libubsan.so) && [[ -f $ASAN_LIB && -f $UBSAN_LIB ]]; then
    (
        export HVDC_SANITIZE=address,undefined LD_PRELOAD="$ASAN_LIB $UBSAN_LIB"
        export ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1
        "$PY" -m pytest -x -q -s -p no:cacheprovider tests/host_kernels tests/test_valid_inputs.py \
            tests/fuzz
        "$PY" scripts/fuzz_payloads.py --per-codec 2000 --seed 1
    ) || rc=$?
    record "sanitizers (asan, ubsan)" "$rc" $((SECONDS - t))
else
    echo "run_tests: sanitizer stage skipped (HVDC_SANITIZE_STAGE=0, or gcc has no libasan/libubsan)"
    STAGE_LINES+=("$(printf '%-34s %-16s' "sanitizers (asan, ubsan)" "skipped")")
fi

# --- summary ----------------------------------------------------------------------------
counts=$("$PY" - "$REPORTS" <<'EOF'
import sys, pathlib, xml.etree.ElementTree as ET

def count(path):
    t = f = s = 0
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
    for su in suites:
        t += int(su.get("tests", 0))
        f += int(su.get("failures", 0)) + int(su.get("errors", 0))
        s += int(su.get("skipped", 0))
    return t, f, s

d = pathlib.Path(sys.argv[1])
total = [0, 0, 0]
empty = []
for name in ["serial.xml"] + sorted(p.name for p in d.glob("mpi*-rank0.xml")):
    p = d / name
    if not p.exists():
        continue
    t, f, s = count(p)
    if t == 0:
        empty.append(name)
    total = [total[0] + t - f - s, total[1] + f, total[2] + s]
# Other ranks' failures count too (a rank can fail where rank 0 passes).
for p in sorted(d.glob("mpi*-rank*.xml")):
    if not p.name.endswith("-rank0.xml"):
        total[1] += count(p)[1]
print(*total, ",".join(empty) or "-")
EOF
) || counts="0 0 0 -"
read -r n_pass n_fail n_skip empty <<<"$counts"
if [[ $empty != "-" ]]; then
    echo "run_tests: no tests ran in: $empty" >&2
    FAILED_STAGES+=("no tests in $empty")
fi

printf '\n=== run_tests: stages (%ss in all) ===\n' $((SECONDS - START))
printf '  %s\n' "${STAGE_LINES[@]}"
if ((${#FAILED_STAGES[@]})); then
    # A stage can fail without a failed test case (crash, timeout, no tests): count it.
    ((n_fail == 0)) && n_fail=${#FAILED_STAGES[@]}
    echo "run_tests: FAILED stages: ${FAILED_STAGES[*]}"
    echo "run_tests: $n_pass passed, $n_fail failed, $n_skip skipped"
    exit 1
fi
echo "run_tests: $n_pass passed, $n_fail failed, $n_skip skipped"
