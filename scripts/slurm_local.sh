#!/usr/bin/env bash
# A private single-node Slurm on this machine, for testing the batch scripts of slurm/
# against a real scheduler (tests/test_slurm.py uses it; so can you).
#
#   eval "$(scripts/slurm_local.sh start)"   # start munged, slurmctld, slurmd; sets SLURM_CONF
#   sbatch --ntasks-per-node=2 --gpus-per-node=0 --cpus-per-task=1 slurm/train_single_node.sbatch
#   scripts/slurm_local.sh status            # daemons, sinfo, squeue
#   scripts/slurm_local.sh stop              # cancel jobs, stop the daemons started by `start`
#   scripts/slurm_local.sh env               # just the `export SLURM_CONF=...` line
#
# Debian's slurm-wlm 22.05 and munge, no systemd, no cgroups, no slurmdbd (so no sacct:
# poll `scontrol show job ID`). Needs root: slurmd runs job steps as the submitting user,
# and munged must run as the munge user. Missing packages are installed with apt-get
# (root, apt, and HVDC_NO_APT unset). Everything else lives in one state directory: the
# config, spool, logs, pid files, and munged's socket, so that this Slurm does not touch a
# system one's files, and `stop` knows exactly which processes are its own.
#
# `start` is idempotent: when this state directory's daemons all answer, it leaves them
# as they are; otherwise it stops what is left of them and starts all three afresh (a cold
# slurmctld start: no job records from an earlier run). stdout carries only the export
# line (for eval); progress and errors go to stderr.
#
# Environment:
#   HVDC_SLURM_DIR      state directory (default /tmp/hvdc-slurm)
#   HVDC_SLURM_PORT     slurmctld port; slurmd uses PORT+1 (default 6817, Slurm's own)
#   HVDC_SLURM_CPUS     CPUs the node declares (default max(nproc, 4): 2-4 ranks fit on
#                       a 2-core machine; Slurm does not check them against the hardware
#                       with SlurmdParameters=config_overrides)
#   HVDC_SLURM_TIMEOUT  seconds to wait for the node to become idle (default 60)
#   HVDC_NO_APT         1: never run apt-get
set -euo pipefail

STATE=${HVDC_SLURM_DIR:-/tmp/hvdc-slurm}
case "$STATE" in /*) ;; *) STATE=$PWD/$STATE ;; esac
CONF=$STATE/slurm.conf
PORT=${HVDC_SLURM_PORT:-6817}
TIMEOUT=${HVDC_SLURM_TIMEOUT:-60}
MUNGE_DIR=$STATE/munge # munged's socket, pid, log, seed: owned by the munge user
SOCK=$MUNGE_DIR/munge.socket
MUNGE_KEY=/etc/munge/munge.key # the Debian location: the key is the same machine-wide
PACKAGES=(slurmctld slurmd slurm-client slurm-wlm-basic-plugins munge)
# The node name must be what slurmd finds for itself (the short host name); its address is
# given, so the name needs no DNS entry.
NODE=$(hostname -s 2>/dev/null || hostname)

log() { printf '[slurm_local] %s\n' "$*" >&2; }
die() {
    printf '[slurm_local] ERROR: %s\n' "$*" >&2
    exit 1
}

# pid_of NAME: the pid in NAME's pid file if that process is alive and really is NAME
# (a stale pid file can name a pid that was reused by something else).
pid_of() {
    local file pid comm
    case "$1" in
        munged) file=$MUNGE_DIR/munged.pid ;;
        *) file=$STATE/$1.pid ;;
    esac
    [[ -r $file ]] || return 1
    pid=$(tr -dc 0-9 <"$file")
    [[ -n $pid ]] || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1 # (kill -0 fails for non-root)
    [[ $comm == "$1" ]] || return 1
    echo "$pid"
}

# Slurm client commands against this Slurm, never against a system one.
sl() { SLURM_CONF=$CONF "$@"; }

node_state() { sl timeout 10 sinfo -h -N -n "$NODE" -o '%t' 2>/dev/null | head -n1; }

# Whether the slurmctld that answers on our port is ours (not another Slurm's on the same
# port): its StateSaveLocation is our directory.
ctld_is_ours() {
    local dir
    dir=$(sl timeout 10 scontrol show config 2>/dev/null |
        awk -F' = ' '$1 ~ /^StateSaveLocation / {print $2}')
    [[ $dir == "$STATE/ctld" ]]
}

# died NAME: NAME wrote its pid file (do_stop removed any old one) but is gone.
died() {
    local file=$STATE/$1.pid
    [[ -s $file ]] && ! pid_of "$1" >/dev/null
}

all_up() {
    pid_of munged >/dev/null && pid_of slurmctld >/dev/null && pid_of slurmd >/dev/null &&
        [[ -f $CONF ]] && ctld_is_ours && [[ $(node_state) =~ ^(idle|mix|alloc) ]]
}

# port_busy PORT: something listens on 127.0.0.1:PORT (bash's /dev/tcp, no ss/netstat).
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

print_env() { printf 'export SLURM_CONF=%s\n' "$CONF"; }

log_tails() {
    local f
    for f in "$STATE/log/start.log" "$STATE/log/slurmctld.log" "$STATE/log/slurmd.log" \
        "$MUNGE_DIR/munged.log"; do
        [[ -f $f ]] || continue
        printf -- '--- %s (last 20 lines) ---\n' "$f" >&2
        tail -n 20 "$f" >&2
    done
}

# ---------------------------------------------------------------------------------------
install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' ||
            missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    if [[ ${HVDC_NO_APT:-0} == 1 ]] || ! command -v apt-get >/dev/null 2>&1; then
        # Without apt (or told not to use it), binaries on PATH are fine too.
        command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
            command -v sbatch >/dev/null && command -v munged >/dev/null && return 0
        die "missing packages ${missing[*]} and no apt-get to install them (or HVDC_NO_APT=1)"
    fi
    log "apt-get install ${missing[*]}"
    # No systemd here: the packages' postinst scripts cannot start the daemons, and we do
    # not want them to (we start private ones below).
    DEBIAN_FRONTEND=noninteractive apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        "${missing[@]}" >&2
}

# The munge key is machine-wide (/etc/munge, as Debian's package has it). munged refuses
# a key or key directory that others can read or write, so: dir 0700, key 0600, both
# owned by the munge user.
munge_key() {
    id munge >/dev/null 2>&1 || die "no 'munge' user: is the munge package installed?"
    mkdir -p /etc/munge
    chown munge:munge /etc/munge
    chmod 0700 /etc/munge
    if [[ ! -s $MUNGE_KEY ]]; then
        log "creating $MUNGE_KEY"
        if command -v mungekey >/dev/null 2>&1; then
            mungekey --create --keyfile="$MUNGE_KEY" --force
        else
            dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
        fi
    fi
    chown munge:munge "$MUNGE_KEY"
    chmod 0600 "$MUNGE_KEY"
}

start_munged() {
    # A private munged on a socket of our own (slurm.conf's AuthInfo points every Slurm
    # daemon and client at it): a system munged, running or not, is left alone. /run/munge
    # is created anyway, since the munge tools look there by default.
    mkdir -p /run/munge "$MUNGE_DIR" "$STATE/log"
    chown munge:munge /run/munge "$MUNGE_DIR"
    chmod 0755 /run/munge "$MUNGE_DIR" # clients (any job user) must reach the socket
    rm -f "$SOCK" "$SOCK.lock"
    # Every daemon starts with stdin/stdout/stderr away from the caller's (a caller that
    # captures our output, like pytest, would otherwise wait for the daemons to exit) and
    # without fd 9 (the lock below: a daemon holding it would block every later call).
    runuser -u munge -- munged --socket="$SOCK" --pid-file="$MUNGE_DIR/munged.pid" \
        --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed" \
        </dev/null >>"$STATE/log/start.log" 2>&1 9>&- ||
        {
            log_tails
            die "munged did not start (log above)"
        }
    local i
    for ((i = 0; i < 50; i++)); do
        if munge -n -S "$SOCK" 2>/dev/null | unmunge -S "$SOCK" >/dev/null 2>&1; then
            return 0
        fi
        sleep 0.2
    done
    log_tails
    die "munged started but a credential does not round-trip on $SOCK"
}

write_conf() {
    local cpus=${HVDC_SLURM_CPUS:-$(($(nproc) > 4 ? $(nproc) : 4))}
    mkdir -p "$STATE/ctld" "$STATE/d" "$STATE/log"
    cat >"$CONF" <<EOF
# Written by scripts/slurm_local.sh: one node, everything in $STATE.
ClusterName=hvdc
# Address given: no name lookup needed for the controller or the node.
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCK
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
# No cgroups (containers, no systemd): processes tracked through /proc, no binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Debian's Open MPI has no Slurm PMI, only PMIx (see slurm/README.md).
MpiDefault=pmix
# Reject a job that can never run (e.g. asking for GPUs this node lacks) at sbatch time
# instead of leaving it PENDING forever.
EnforcePartLimits=ALL
# No slurmdbd, so no sacct: keep finished jobs in slurmctld for an hour, to be read with
# scontrol show job.
MinJobAge=3600
# The node comes up as soon as its slurmd registers, also after a restart.
ReturnToService=2
# Declared CPUs are used as they are (may exceed the cores: more ranks than cores).
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    chmod 0644 "$CONF"
}

# kill_daemon NAME: TERM, wait up to 10 s, then KILL.
kill_daemon() {
    local pid i
    pid=$(pid_of "$1") || return 0
    log "stopping $1 (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.2
    done
    log "$1 (pid $pid) ignored SIGTERM for 10 s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
}

# Step daemons of our slurmd: slurmstepd detaches from slurmd, so a job still running when
# slurmd stops would outlive it. Ours are the ones whose environment has our SLURM_CONF
# (slurmd was started with it and they inherit it).
our_stepds() {
    local p
    for p in /proc/[0-9]*; do
        [[ $(cat "$p/comm" 2>/dev/null) == slurmstepd ]] || continue
        tr '\0' '\n' <"$p/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$CONF" &&
            echo "${p#/proc/}"
    done
    return 0
}

do_stop() {
    local i pids
    if pid_of slurmctld >/dev/null && pid_of munged >/dev/null; then
        # Cancel jobs first, so that their processes end with them.
        if [[ -n $(sl timeout 10 squeue -h -o %i 2>/dev/null) ]]; then
            log "cancelling jobs: $(sl squeue -h -o %i | paste -sd' ')"
            sl timeout 10 scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
            sl timeout 10 scancel --quiet --state=PENDING 2>/dev/null || true
            for ((i = 0; i < 50; i++)); do
                [[ -z $(sl timeout 10 squeue -h -o %i 2>/dev/null) ]] && break
                sleep 0.2
            done
        fi
    fi
    kill_daemon slurmd
    kill_daemon slurmctld
    pids=$(our_stepds)
    if [[ -n $pids ]]; then
        log "killing leftover slurmstepd: $(echo "$pids" | paste -sd' ')"
        # shellcheck disable=SC2086 # one pid per word
        kill -KILL $pids 2>/dev/null || true
    fi
    kill_daemon munged
    rm -f "$STATE/slurmd.pid" "$STATE/slurmctld.pid" "$MUNGE_DIR/munged.pid"
}

do_start() {
    install_packages
    for cmd in slurmctld slurmd sbatch sinfo munged munge unmunge runuser; do
        command -v "$cmd" >/dev/null 2>&1 || die "'$cmd' not found on PATH"
    done
    if all_up; then
        log "already running (node $NODE $(node_state), state in $STATE)"
        print_env
        return 0
    fi
    # Whatever is left of an earlier start (a crashed daemon, a stale pid file) goes first.
    do_stop
    mkdir -p "$STATE/log"
    chmod 0755 "$STATE"
    : >"$STATE/log/start.log"
    local p
    for p in "$PORT" $((PORT + 1)); do
        port_busy "$p" && die "port $p is in use (another Slurm? see 'ss -ltnp'): \
set HVDC_SLURM_PORT to a free pair of ports (PORT and PORT+1)"
    done
    munge_key
    start_munged
    write_conf
    log "starting slurmctld and slurmd (config $CONF, port $PORT)"
    # -c: a cold start, no jobs or node state from an earlier run of this directory.
    SLURM_CONF=$CONF slurmctld -c -f "$CONF" </dev/null >>"$STATE/log/start.log" 2>&1 9>&- || {
        log_tails
        die "slurmctld did not start (log above)"
    }
    SLURM_CONF=$CONF slurmd -f "$CONF" -N "$NODE" </dev/null >>"$STATE/log/start.log" 2>&1 9>&- || {
        log_tails
        do_stop
        die "slurmd did not start (log above)"
    }
    local t0=$SECONDS state=""
    while ((SECONDS - t0 < TIMEOUT)); do
        # The daemons must still be alive (one that cannot bind its port exits at once),
        # and the node state must come from our slurmctld.
        if died slurmctld || died slurmd; then
            log "slurmctld or slurmd exited during start-up"
            break
        fi
        state=$(node_state)
        if [[ $state == idle ]] && ctld_is_ours; then
            log "node $NODE idle after $((SECONDS - t0)) s (state in $STATE)"
            print_env
            return 0
        fi
        sleep 0.5
    done
    log "node $NODE is '${state:-not reported}' after $((SECONDS - t0)) s, not idle"
    log_tails
    do_stop
    die "Slurm did not come up: logs above (and in $STATE/log); stopped what was started"
}

do_status() {
    local name pid rc=0
    for name in munged slurmctld slurmd; do
        if pid=$(pid_of "$name"); then
            printf '%-10s running (pid %s)\n' "$name" "$pid"
        else
            printf '%-10s not running\n' "$name"
            rc=3
        fi
    done
    if [[ $rc -eq 0 ]]; then
        printf 'config     %s\n' "$CONF"
        sl timeout 10 sinfo -N || rc=3
        sl timeout 10 squeue || rc=3
    fi
    return "$rc"
}

# One start or stop at a time per state directory (e.g. a test's start and a user's
# stop). status and env only read, and work without root.
lock() {
    mkdir -p "$STATE"
    exec 9>"$STATE/.lock"
    flock -w 300 9 || die "another slurm_local.sh holds $STATE/.lock for 300 s"
}

case "${1:-}" in
    start)
        [[ $(id -u) -eq 0 ]] || die "start needs root (slurmd runs jobs as their users; \
munged runs as the munge user). Run it as root, or use a real cluster."
        lock
        do_start
        ;;
    stop)
        [[ $(id -u) -eq 0 ]] || die "stop needs root (the daemons run as root and munge)"
        lock
        do_stop
        log "stopped"
        ;;
    status) do_status ;;
    env) print_env ;;
    *)
        sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2
        exit 2
        ;;
esac
