#!/usr/bin/env bash
# One command for a machine with a GPU (no Horovod, no network, nothing pip-installed):
#   1. the environment (GPU, torch, CuPy, NVRTC) and a kernel compile/load probe;
#   2. python -m pytest -m gpu tests/gpu -v   (CUDA backend vs CPU backend: 3LC and the
#      shared primitives, whole payloads of every compressor that uses them);
#   3. python scripts/bench_codec.py --device cuda     (codec throughput vs memcpy);
#   4. python scripts/bench_codec.py --overhead --device cuda  (a 160-tensor bucket's
#      launch sequences against one tensor of the same size).
# The package is used from this checkout (PYTHONPATH=<repo>, kernels from kernels/), the
# CPU backend's C library compiled on first use into $HVDC_CACHE. Logs, the pytest JUnit
# XML and the benchmark JSON go to $OUT when set (the device tool's output folder), else
# to results/gpu_check/ in the repo. Stays under 8 minutes: pytest is limited to
# HVDC_GPU_TEST_TIMEOUT s (default 300), the benchmark to HVDC_GPU_BENCH_TIMEOUT s
# (default 120), the overhead benchmark to HVDC_GPU_OVERHEAD_TIMEOUT s (default 60).
# Exit status: non-zero if a stage failed.
#
# Environment: PYTHON (default python3), OUT, HVDC_GPU_TEST_TIMEOUT, HVDC_GPU_OVERHEAD_TIMEOUT,
# HVDC_GPU_BENCH_TIMEOUT, HVDC_BENCH_SIZES (default "1e5 1e6 1e7 1e8").
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
DEST=${OUT:-$ROOT/results/gpu_check}
mkdir -p "$DEST"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export HVDC_CACHE=${HVDC_CACHE:-${TMPDIR:-/tmp}/hvdcompress-cache}  # not in $OUT
START=$SECONDS
STATUS=()
fail=0

stage() { printf '\n=== gpu_check: %s (%ss) ===\n' "$1" $((SECONDS - START)); }
record() { # record NAME RC
    if [[ $2 -eq 0 ]]; then STATUS+=("$1: ok"); else
        STATUS+=("$1: FAILED (exit $2)")
        fail=1
    fi
}

stage "environment"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 ||
        echo "nvidia-smi not available"
    "$PY" - <<'EOF' 2>&1
import platform, sys
print("python", sys.version.split()[0], platform.machine())
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs",
          round(p.total_memory / 2**30), "GiB")
try:
    import cupy
    print("cupy", cupy.__version__)
    from cupy_backends.cuda.libs import nvrtc
    print("nvrtc", nvrtc.getVersion())
except Exception as exc:
    print("cupy/nvrtc:", type(exc).__name__, exc)
from hvdcompress.backends import cuda
print("kernels from", cuda.kernel_dir())
print("gpu_unavailable_reason:", cuda.gpu_unavailable_reason())
EOF
} | tee "$DEST/gpu_env.txt"
record environment "${PIPESTATUS[0]}"

stage "pytest -m gpu tests/gpu"
timeout -k 10 "${HVDC_GPU_TEST_TIMEOUT:-300}" \
    "$PY" -m pytest -m gpu tests/gpu -v -rs -p no:cacheprovider \
    --junitxml="$DEST/pytest_gpu.xml" 2>&1 | tee "$DEST/pytest_gpu.log"
rc=${PIPESTATUS[0]}
# -m gpu where every test skipped (no usable GPU) is a failure of this check.
if [[ $rc -eq 0 ]] && ! grep -Eq '[0-9]+ passed' "$DEST/pytest_gpu.log"; then
    echo "gpu_check: no GPU test ran (all skipped?)" >&2
    rc=5
fi
record "pytest gpu" "$rc"

stage "bench_codec --device cuda"
if [[ -f scripts/bench_codec.py ]]; then
    read -r -a SIZES <<<"${HVDC_BENCH_SIZES:-1e5 1e6 1e7 1e8}"
    timeout -k 10 "${HVDC_GPU_BENCH_TIMEOUT:-120}" \
        "$PY" scripts/bench_codec.py --device cuda --sizes "${SIZES[@]}" \
        --json "$DEST/bench_codec_cuda.json" 2>&1 | tee "$DEST/bench_codec_cuda.log"
    record "bench cuda" "${PIPESTATUS[0]}"
    stage "bench_codec --overhead --device cuda"
    timeout -k 10 "${HVDC_GPU_OVERHEAD_TIMEOUT:-60}" \
        "$PY" scripts/bench_codec.py --overhead --device cuda \
        --cases 3lc terngrad signsgd efsignsgd qsgd dqsg dqsg:levels=1 ndqsg \
        topk:ratio=0.01 topkq dgc gspar \
        --json "$DEST/bench_overhead_cuda.json" 2>&1 | tee "$DEST/bench_overhead_cuda.log"
    record "bench overhead cuda" "${PIPESTATUS[0]}"
else
    echo "scripts/bench_codec.py not present: skipped"
    STATUS+=("bench cuda: not present")
fi

printf '\n=== gpu_check: summary (%ss) ===\n' $((SECONDS - START))
printf '  %s\n' "${STATUS[@]}" | tee "$DEST/gpu_check_summary.txt"
echo "gpu_check: files in $DEST"
exit "$fail"
