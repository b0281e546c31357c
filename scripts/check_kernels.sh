#!/usr/bin/env bash
# Compile every kernels/*.cu with nvcc for each target architecture (default sm_80 and
# sm_90) to a cubin, with the options the CUDA backend gives NVRTC at run time
# (NVRTC_OPTIONS of hvdcompress/_native.py, which nvcc spells the same) and all warnings
# as errors, and print each kernel's registers, spills and stack from
# `nvcc --resource-usage`. Fails on any compile error or warning.
#
#   scripts/check_kernels.sh                 # skips with a message when nvcc is absent
#   REQUIRE_NVCC=1 scripts/check_kernels.sh  # nvcc absent is an error
#
# Environment: NVCC (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc),
# HVDC_CUDA_ARCHS (default "80 90"), REQUIRE_NVCC, PYTHON (default python3; it only reads
# hvdcompress/_native.py, which needs nothing beyond the standard library).
# The kernels' logic is tested without nvcc or a GPU by tests/host_kernels/ (g++ host
# build); this script only checks that the CUDA compiler accepts them cleanly.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

NVCC=${NVCC:-$(command -v nvcc || true)}
if [[ -z $NVCC && -x /usr/local/cuda/bin/nvcc ]]; then
    NVCC=/usr/local/cuda/bin/nvcc
fi
if [[ -z $NVCC ]]; then
    if [[ ${REQUIRE_NVCC:-0} == 1 ]]; then
        echo "check_kernels: ERROR: nvcc not found (PATH, NVCC, /usr/local/cuda/bin) and REQUIRE_NVCC=1" >&2
        exit 1
    fi
    echo "check_kernels: SKIPPED: nvcc not found (PATH, NVCC, /usr/local/cuda/bin);" \
        "set REQUIRE_NVCC=1 to make this an error"
    exit 0
fi

shopt -s nullglob
SOURCES=(kernels/*.cu)
if ((${#SOURCES[@]} == 0)); then
    echo "check_kernels: ERROR: no kernels/*.cu found" >&2
    exit 1
fi
read -r -a ARCHS <<<"${HVDC_CUDA_ARCHS:-80 90}"
PY=${PYTHON:-python3}
if ! OPTIONS_TEXT=$("$PY" hvdcompress/_native.py nvrtc); then
    echo "check_kernels: ERROR: cannot read NVRTC_OPTIONS with $PY hvdcompress/_native.py" >&2
    exit 1
fi
mapfile -t OPTIONS <<<"$OPTIONS_TEXT"

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

echo "check_kernels: $("$NVCC" --version | tail -n 2 | head -n 1); options: ${OPTIONS[*]}"
failed=0
printf '%-34s %-6s %9s %12s %11s %7s\n' kernel arch registers spill_stores spill_loads stack
for src in "${SOURCES[@]}"; do
    for arch in "${ARCHS[@]}"; do
        log=$TMP/$(basename "$src" .cu)-sm_$arch.log
        rc=0
        "$NVCC" -cubin -arch="sm_$arch" "${OPTIONS[@]}" --resource-usage -Werror all-warnings \
            -o "$TMP/out.cubin" "$src" >"$log" 2>&1 || rc=$?
        if ((rc != 0)) || grep -qi 'warning' "$log"; then
            echo "check_kernels: FAILED: $src for sm_$arch (exit $rc):" >&2
            cat "$log" >&2
            failed=1
            continue
        fi
        # ptxas prints, per kernel: "Compiling entry function 'NAME' for 'sm_XX'", then
        # "N bytes stack frame, N bytes spill stores, N bytes spill loads" and "Used N
        # registers".
        awk -v arch="sm_$arch" '
            /Compiling entry function/ { match($0, /function .[^'"'"']*/); name = substr($0, RSTART + 10, RLENGTH - 10) }
            /bytes stack frame/ { stack = $(NF - 11); stores = $(NF - 7); loads = $(NF - 3) }
            /Used [0-9]+ registers/ {
                for (i = 1; i <= NF; i++) if ($i == "Used") regs = $(i + 1)
                printf "%-34s %-6s %9s %12s %11s %7s\n", name, arch, regs, stores, loads, stack
            }' "$log"
    done
done

if ((failed)); then
    echo "check_kernels: FAILED" >&2
    exit 1
fi
echo "check_kernels: OK (${#SOURCES[@]} source(s) for$(printf ' sm_%s' "${ARCHS[@]}"))"
