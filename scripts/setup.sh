#!/usr/bin/env bash
# Set up everything hvdcompress needs, from nothing, idempotently.
#
#   scripts/setup.sh            # what `make setup` / `make train` run
#   HVDC_TEST=1 scripts/setup.sh  # what `make test` / CI run (adds CuPy and Slurm, see below)
#
# Phases (each is skipped when its result is already there):
#   1. system packages (root + apt only): Open MPI, compilers, CMake, Fashion-MNIST;
#      elsewhere (a cluster node with `module load openmpi`), the MPI on PATH is used;
#   2. a virtual environment ($HVDC_VENV, default .venv) with pinned torch and the tools;
#   3. Horovod 0.28.1 built from source with MPI + Gloo + PyTorch (C++17 recipe of
#      shared/ENVIRONMENT.md), the built wheel cached under ~/.cache/hvdcompress/;
#   4. `pip install -e .` of this package (builds its C extension);
#   5. optional CuPy; 6. checks: `horovodrun --check-build` and a 2-rank mpi4py run.
#
# Environment:
#   HVDC_VENV        venv folder (default: <repo>/.venv); an existing venv is reused
#   HVDC_PYTHON      interpreter that creates the venv (default: python3, needs >= 3.10)
#   HVDC_TORCH_SPEC  torch requirement (default: torch==2.13.0, the CPU wheel of this
#                    kind of machine; pinned because a bare `torch` pulls a multi-GB CUDA
#                    build). On a GPU cluster set e.g. HVDC_TORCH_SPEC='torch==2.13.0'
#                    with your site's index in PIP_INDEX_URL / PIP_EXTRA_INDEX_URL.
#   HVDC_WITH_GPU    1: install cupy-cuda13x; 0: never; unset: only when HVDC_TEST=1
#   HVDC_TEST        1: set up for the test suite (make test, CI): also Slurm + munge (apt)
#   HVDC_NO_APT      1: never use apt-get, even as root
#   HVDC_CACHE_DIR   wheel cache (default: ${XDG_CACHE_HOME:-~/.cache}/hvdcompress)
#   HVDC_NO_CACHE    1: neither read nor write the Horovod wheel cache
#   HVDC_HOROVOD_DEBUG_INFO  1: build Horovod with -g (default: without, 20% faster)
#   HVDC_BUILD_JOBS  parallel compile jobs for Horovod (default 2)
#   CXX              C++ compiler for Horovod (default: g++ or c++ on PATH)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

VENV=${HVDC_VENV:-$ROOT/.venv}
case "$VENV" in /*) ;; *) VENV=$ROOT/$VENV ;; esac
PYTHON=${HVDC_PYTHON:-python3}
TORCH_SPEC=${HVDC_TORCH_SPEC:-torch==2.13.0}
HOROVOD_VERSION=0.28.1
CACHE_DIR=${HVDC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdcompress}
BUILD_DIR=$ROOT/.build # git-ignored: build logs, the compiler wrapper

# Tools for development and tests. ruff is pinned so that `ruff format --check` does not
# change verdict when ruff releases a new style; the rest float.
PY_PACKAGES=(numpy tqdm mpi4py pytest pytest-mpi hypothesis "ruff==0.17.6" "import-linter==2.16" tensorboard matplotlib)
APT_PACKAGES=(openmpi-bin libopenmpi-dev dataset-fashion-mnist g++ make cmake)
if [[ ${HVDC_TEST:-0} == 1 ]]; then
    # tests/test_slurm.py submits slurm/*.sbatch to a private single-node Slurm that
    # scripts/slurm_local.sh starts (about 15 MB; apt does not start the daemons).
    APT_PACKAGES+=(slurmctld slurmd slurm-client slurm-wlm-basic-plugins munge)
    # tests/test_bench_network.py: network namespaces and tc rate limits
    APT_PACKAGES+=(iproute2)
fi
FMNIST_DIR=/usr/share/datasets/fashion-mnist

export DEBIAN_FRONTEND=noninteractive
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

START=$SECONDS
PHASE_NAMES=()
PHASE_TIMES=()
_phase_name=""
_phase_start=0
SKIPPED=() # what this run could not do, printed again at the end

log() { printf '[setup] %s\n' "$*"; }
warn() { printf '[setup] WARNING: %s\n' "$*" >&2; }
die() {
    printf '[setup] ERROR: %s\n' "$*" >&2
    exit 1
}
phase() { # phase NAME: close the previous phase's timer, start a new one
    phase_end
    _phase_name=$1
    _phase_start=$SECONDS
    printf '\n[setup] === %s ===\n' "$1"
}
phase_end() {
    if [[ -n $_phase_name ]]; then
        PHASE_NAMES+=("$_phase_name")
        PHASE_TIMES+=($((SECONDS - _phase_start)))
        _phase_name=""
    fi
}
on_error() {
    local rc=$?
    printf '[setup] ERROR: failed with exit code %s during phase "%s" (line %s)\n' \
        "$rc" "${_phase_name:-?}" "${BASH_LINENO[0]}" >&2
    exit "$rc"
}
trap on_error ERR

is_root() { [[ $(id -u) -eq 0 ]]; }

# ---------------------------------------------------------------------------------------
phase "system packages"
USE_APT=0
if [[ ${HVDC_NO_APT:-0} == 1 ]]; then
    log "HVDC_NO_APT=1: not using apt-get"
elif ! command -v apt-get >/dev/null 2>&1; then
    log "no apt-get on this machine: not installing system packages"
elif ! is_root; then
    log "not root: not running apt-get"
else
    USE_APT=1
fi

if [[ $USE_APT == 1 ]]; then
    missing=()
    for p in "${APT_PACKAGES[@]}"; do
        if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
            missing+=("$p")
        fi
    done
    if ((${#missing[@]})); then
        log "apt-get install ${missing[*]}"
        apt-get update -q
        apt-get install -y -q --no-install-recommends "${missing[@]}"
    else
        log "already installed: ${APT_PACKAGES[*]}"
    fi
else
    SKIPPED+=("system packages (no root/apt): using whatever MPI and compilers are on PATH")
fi

MPICC=$(command -v mpicc || true)
MPIRUN=$(command -v mpirun || true)
[[ -n $MPICC && -n $MPIRUN ]] || die "no mpicc/mpirun on PATH. As root on Debian/Ubuntu this \
script installs Open MPI itself; on a cluster, load an MPI first (e.g. 'module load openmpi') \
and run it again."
REAL_CXX=${CXX:-$(command -v g++ || command -v c++ || true)}
[[ -n $REAL_CXX ]] || die "no C++ compiler (g++ or c++) on PATH and CXX is not set"
REAL_CXX=$(command -v "$REAL_CXX" || echo "$REAL_CXX")
command -v "$REAL_CXX" >/dev/null 2>&1 || die "C++ compiler '$REAL_CXX' not found"
log "MPI: $MPICC ($("$MPIRUN" --version 2>/dev/null | head -n1 || echo 'version unknown'))"
log "C++ compiler: $REAL_CXX ($("$REAL_CXX" --version | head -n1))"
if [[ $USE_APT != 1 ]]; then
    log "no apt: using MPI from $MPICC"
fi

if [[ -f $FMNIST_DIR/train-images-idx3-ubyte.gz ]]; then
    log "Fashion-MNIST: $FMNIST_DIR"
else
    msg="Fashion-MNIST not installed: set HVDC_DATA_DIR to a folder holding"
    msg+=" train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz"
    msg+=" and t10k-labels-idx1-ubyte.gz (Debian: apt-get install dataset-fashion-mnist)"
    log "$msg"
    SKIPPED+=("$msg")
fi

# ---------------------------------------------------------------------------------------
phase "virtual environment"
if [[ -e $VENV && ! -x $VENV/bin/python ]]; then
    die "$VENV exists but has no bin/python: not a venv. Remove it or set HVDC_VENV."
fi
if [[ -x $VENV/bin/python ]]; then
    "$VENV/bin/python" -c 'import sys' 2>/dev/null ||
        die "$VENV/bin/python does not run (venv of a removed interpreter?): rm -rf $VENV"
    log "reusing venv $VENV ($("$VENV/bin/python" --version))"
else
    command -v "$PYTHON" >/dev/null 2>&1 || die "no '$PYTHON' to create the venv (set HVDC_PYTHON)"
    log "creating venv $VENV with $(command -v "$PYTHON") ($("$PYTHON" --version))"
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
    die "$VENV has Python $("$VENV/bin/python" --version); hvdcompress needs >= 3.10"
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV=$VENV
PY=$VENV/bin/python
PIP=("$PY" -m pip)
# pip, minus the "Location 'file:///...' is ignored" lines that a machine-wide pip config
# pointing at absent local indexes prints for every package (noise, not errors).
pip_install() {
    local rc=0
    "${PIP[@]}" install "$@" 2>&1 | { grep -v "^ *WARNING: Location 'file:.*is ignored" || true; } || rc=$?
    return "$rc"
}

# setuptools/wheel are needed in the venv itself: Horovod and this package are built with
# --no-build-isolation (isolation would fetch another, possibly CUDA, torch).
REQS=("$TORCH_SPEC" "${PY_PACKAGES[@]}" "setuptools>=64" wheel)
# Fast path for re-runs: every requirement already installed at a matching version (read
# from the installed metadata: no import, no index query), so pip is not run.
reqs_satisfied() { # reqs_satisfied SPEC...
    "$PY" - "$@" >/dev/null 2>&1 <<'PYEOF'
import sys
from importlib.metadata import version

from packaging.requirements import Requirement

for spec in sys.argv[1:]:
    req = Requirement(spec)
    if not req.specifier.contains(version(req.name), prereleases=True):
        sys.exit(1)
PYEOF
}
if reqs_satisfied "${REQS[@]}"; then
    log "already installed: ${REQS[*]}"
else
    log "pip install ${REQS[*]}"
    pip_install -q "${REQS[@]}"
fi
"$PY" -c 'import torch, numpy, mpi4py; print("[setup] torch", torch.__version__, "| numpy", numpy.__version__, "| mpi4py", mpi4py.__version__)'

# ---------------------------------------------------------------------------------------
phase "horovod"
horovod_ok() {
    "$PY" - <<EOF >/dev/null 2>&1
import horovod, horovod.torch
assert horovod.__version__ == "$HOROVOD_VERSION", horovod.__version__
EOF
}

if horovod_ok; then
    log "horovod $HOROVOD_VERSION with PyTorch already importable in the venv: not rebuilding"
else
    mkdir -p "$BUILD_DIR"
    # The C++17 wrapper: Horovod's CMake asks for C++11/14, PyTorch >= 2.1 headers need 17.
    # It also drops -g (Horovod builds RelWithDebInfo): measured here, 20% less CPU time
    # (514 s against 645 s), 1.8 GB instead of 2.4 GB per compiler, and a 1.2 MB wheel
    # instead of 20 MB. HVDC_HOROVOD_DEBUG_INFO=1 keeps the debug info.
    DEBUG_INFO=${HVDC_HOROVOD_DEBUG_INFO:-0}
    if [[ $DEBUG_INFO == 1 ]]; then drop_g=""; else drop_g="-g | -g1 | -g2 | -g3 | -ggdb) ;;"; fi
    WRAPPER=$BUILD_DIR/cxx17
    cat >"$WRAPPER" <<EOF
#!/usr/bin/env bash
# Generated by scripts/setup.sh: runs $REAL_CXX with any -std=c++11/14 raised to c++17.
args=()
for a in "\$@"; do
    case "\$a" in
        -std=c++11 | -std=c++14 | -std=gnu++11 | -std=gnu++14 | -std=c++1y | -std=gnu++1y) args+=(-std=c++17) ;;
        $drop_g
        *) args+=("\$a") ;;
    esac
done
exec "$REAL_CXX" "\${args[@]}"
EOF
    chmod +x "$WRAPPER"

    if ! command -v cmake >/dev/null 2>&1; then
        log "no cmake on PATH: pip install cmake into the venv"
        pip_install -q cmake
    fi
    log "cmake: $(command -v cmake) ($(cmake --version | head -n1))"

    # The wheel depends on the Python, torch and MPI it was built against: key the cache.
    # shellcheck disable=SC2016
    key_src="$("$PY" -c 'import sys, torch; print(sys.version, torch.__version__)')
$("$MPIRUN" --version 2>/dev/null | head -n1) $MPICC
$("$REAL_CXX" --version | head -n1) debug_info=$DEBUG_INFO"
    key=$(printf '%s' "$key_src" | sha256sum | cut -c1-16)
    WHEEL_DIR=$CACHE_DIR/horovod-$HOROVOD_VERSION-$key
    installed=0
    if [[ ${HVDC_NO_CACHE:-0} != 1 ]] && compgen -G "$WHEEL_DIR/horovod-*.whl" >/dev/null; then
        whl=$(compgen -G "$WHEEL_DIR/horovod-*.whl" | head -n1)
        log "installing cached wheel $whl"
        if pip_install -q --force-reinstall --no-deps "$whl" &&
            pip_install -q "$whl" && horovod_ok; then
            installed=1
        else
            warn "cached wheel does not work here: removing it and building from source"
            rm -rf "$WHEEL_DIR"
        fi
    fi
    if [[ $installed == 0 ]]; then
        LOG=$BUILD_DIR/horovod-build.log
        TMP_WHEELS=$(mktemp -d)
        log "building horovod==$HOROVOD_VERSION from source (4-12 min on 2 cores, ~9 CPU-minutes; log: $LOG)"
        # MAKEFLAGS is set (not inherited from a calling make: its jobserver is not ours).
        if ! env CXX="$WRAPPER" \
            CMAKE_POLICY_VERSION_MINIMUM=3.5 \
            HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
            HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
            MAKEFLAGS=-j"${HVDC_BUILD_JOBS:-2}" \
            "${PIP[@]}" wheel --no-build-isolation --no-cache-dir --no-deps -v \
            -w "$TMP_WHEELS" "horovod==$HOROVOD_VERSION" >"$LOG" 2>&1; then
            tail -n 60 "$LOG" >&2
            die "Horovod build failed; full log: $LOG"
        fi
        whl=$(compgen -G "$TMP_WHEELS/horovod-*.whl" | head -n1)
        # Installs the wheel and its pure-Python dependencies (cloudpickle, psutil, ...).
        pip_install -q --force-reinstall --no-deps "$whl"
        pip_install -q "$whl"
        horovod_ok || die "horovod built but 'import horovod.torch' fails: $("$PY" -c 'import horovod.torch' 2>&1 | tail -n 3)"
        if [[ ${HVDC_NO_CACHE:-0} != 1 ]]; then
            if mkdir -p "$WHEEL_DIR" && cp "$whl" "$WHEEL_DIR/" &&
                printf '%s\n' "$key_src" >"$WHEEL_DIR/KEY"; then
                log "cached the wheel in $WHEEL_DIR"
            else
                warn "could not cache the wheel in $WHEEL_DIR"
            fi
        fi
        rm -rf "$TMP_WHEELS"
    fi
fi

# ---------------------------------------------------------------------------------------
phase "hvdcompress (pip install -e .)"
# No build isolation: the C extension builds against the venv's setuptools (and torch,
# if setup.py uses it) instead of fetching a fresh torch into an isolated env.
pip_install -q --no-build-isolation --no-deps -e "$ROOT"
"$PY" -c 'import hvdcompress, sys; print("[setup] hvdcompress imports from", hvdcompress.__path__[0])' ||
    die "'import hvdcompress' fails after pip install -e ."

# ---------------------------------------------------------------------------------------
if [[ ${HVDC_TEST:-0} == 1 ]]; then
    phase "integrations (setup.cfg extras: lightning, accelerate)"
    # tests/test_lightning.py and tests/test_accelerate.py run the real packages, at the
    # versions the extras pin (read from setup.cfg, so they are written once).
    mapfile -t EXTRA_REQS < <("$PY" - "$ROOT/setup.cfg" <<'PYEOF'
import configparser
import sys

cfg = configparser.ConfigParser()
cfg.read(sys.argv[1])
for extra in ("lightning", "accelerate"):
    print(cfg["options.extras_require"][extra].strip())
PYEOF
    )
    if reqs_satisfied "${EXTRA_REQS[@]}"; then
        log "already installed: ${EXTRA_REQS[*]}"
    else
        pip_install -q "${EXTRA_REQS[@]}" || die "pip install ${EXTRA_REQS[*]} failed"
    fi
fi

# ---------------------------------------------------------------------------------------
phase "cupy (optional)"
# CuPy in test runs (HVDC_TEST=1, i.e. make test and CI): yes. The delicate GPU-skip path
# is not "CuPy is missing" (an ImportError any test can catch) but "CuPy imports, yet
# every kernel compile/launch fails with cudaErrorInsufficientDriver", which is what a
# machine without a GPU or driver sees with CuPy installed, and what a user who ran
# HVDC_WITH_GPU=1 on a login node gets. Only with CuPy installed does CI check that the
# GPU tests detect that and skip with a reason instead of erroring, and that the CUDA
# backend module at least imports. It costs about 320 MB (with NVRTC) and under a minute,
# small against the 25-minute CI budget. HVDC_WITH_GPU=0 opts out.
WITH_GPU=${HVDC_WITH_GPU:-}
if [[ -z $WITH_GPU ]]; then
    if [[ ${HVDC_TEST:-0} == 1 ]]; then WITH_GPU=1; else WITH_GPU=0; fi
fi
if [[ $WITH_GPU == 1 ]]; then
    # NVRTC is the compiler CuPy uses for the RawKernels at run time; from pip it needs no
    # CUDA toolkit and no GPU, so without a GPU the NVRTC compile test of kernels/ runs
    # too (about 140 MB more).
    REQS=(cupy-cuda13x "nvidia-cuda-nvrtc==13.*")
    if reqs_satisfied "${REQS[@]}"; then
        log "already installed: ${REQS[*]}"
    else
        log "pip install ${REQS[*]}"
        pip_install -q "${REQS[@]}"
    fi
else
    log "not installing CuPy (HVDC_WITH_GPU=1 installs cupy-cuda13x): GPU tests will skip"
fi

# ---------------------------------------------------------------------------------------
phase "checks"
MPI_ENV=()
if is_root; then
    # Open MPI refuses to start as root without these two.
    MPI_ENV=(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)
fi
log "horovodrun --check-build"
env "${MPI_ENV[@]}" horovodrun --check-build
log "mpirun -np 2 (mpi4py hello)"
# shellcheck disable=SC2016
env "${MPI_ENV[@]}" timeout 120 "$MPIRUN" -np 2 --oversubscribe --bind-to none \
    "$PY" -c 'from mpi4py import MPI; c = MPI.COMM_WORLD; s = c.allreduce(c.rank + 1); assert s == c.size * (c.size + 1) // 2, s; print(f"[setup] mpi4py rank {c.rank}/{c.size} ok, sum {s}", flush=True)' ||
    die "a 2-rank mpi4py program does not run under $MPIRUN"
phase_end

printf '\n[setup] done in %ss. Phases:\n' $((SECONDS - START))
for i in "${!PHASE_NAMES[@]}"; do
    printf '[setup]   %-32s %5ss\n' "${PHASE_NAMES[$i]}" "${PHASE_TIMES[$i]}"
done
for s in "${SKIPPED[@]}"; do
    printf '[setup] skipped: %s\n' "$s"
done
log "venv: $VENV (activate: source $VENV/bin/activate)"
