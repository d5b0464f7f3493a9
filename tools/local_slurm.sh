#!/usr/bin/env bash
# A real Slurm cluster on localhost for tests and the embedded default: munge, slurmctld and
# several `slurmd -N nK` (one per simulated node, distinct ports), all in a private directory.
#
#   tools/local_slurm.sh up       # install (apt, when root and missing), configure, start; idempotent
#   tools/local_slurm.sh status   # what runs, and sinfo
#   tools/local_slurm.sh down     # stop only the daemons this script started (by PID)
#   tools/local_slurm.sh env      # print the export line clients need
#
# Clients find the cluster through SLURM_CONF (printed by `up` and `env`):
#   export SLURM_CONF=$PWD/.local_slurm/slurm.conf; sbatch --wrap hostname
#
# Settings (environment): HPCRL_LOCAL_SLURM_DIR (default <repo>/.local_slurm),
# HPCRL_LOCAL_SLURM_ACCOUNTING=1 (also start MariaDB + slurmdbd on ports +1/+2 so sacct works;
# apt packages mariadb-server and slurmdbd; about 2 s more to start),
# HPCRL_LOCAL_SLURM_NODES (6: a 4-component hetjob with a 2-node trainer, plus a spare; hetjob components
# never share nodes), HPCRL_LOCAL_SLURM_PORT (16817; slurmd ports follow from +184).
# Tuned for tests (measured on Slurm 22.05): bf_interval=1 because only the backfill scheduler
# starts heterogeneous jobs; JobRequeue=1; SlurmdTimeout=10; cred_expire=10 (a requeued job
# otherwise waits 121 s); ReturnToService=1 (keeps an admin-downed node down).
#
# Seen here on 2026-11-23 (Slurm 22.05.8, Debian): `scontrol update nodename=nK state=down` under a
# running hetjob makes Slurm requeue every component by itself (running again ~11 s later); killing
# a node's slurmd instead makes slurmctld requeue the hetjob and then segfault in libslurmfull
# (dmesg). `up` restarts dead daemons, and the restarted slurmctld starts the job again.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${HPCRL_LOCAL_SLURM_DIR:-$REPO/.local_slurm}
NODES=${HPCRL_LOCAL_SLURM_NODES:-6}
CTLD_PORT=${HPCRL_LOCAL_SLURM_PORT:-16817}
SLURMD_PORT0=$((CTLD_PORT + 184))   # 17001 by default: n1 -> 17001, n2 -> 17002, ...
ACCOUNTING=${HPCRL_LOCAL_SLURM_ACCOUNTING:-0}
DBD_PORT=$((CTLD_PORT + 1))
DB_PORT=$((CTLD_PORT + 2))
CONF=$DIR/slurm.conf
MUNGE_SOCKET=$DIR/munge/munge.socket

say() { echo "local_slurm: $*" >&2; }

alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
    local missing=()
    command -v munged >/dev/null || missing+=(munge)
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    if [[ $ACCOUNTING == 1 ]]; then
        command -v mariadbd >/dev/null || missing+=(mariadb-server)
        command -v slurmdbd >/dev/null || missing+=(slurmdbd)
    fi
    ((${#missing[@]} == 0)) && return 0
    if [[ $(id -u) != 0 ]]; then
        say "missing ${missing[*]} and not root: install them (apt-get install ${missing[*]}) and retry"
        return 1
    fi
    say "installing ${missing[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >"$DIR/apt.log" 2>&1; then
        apt-get update -q >>"$DIR/apt.log" 2>&1
        apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$DIR/apt.log" 2>&1 \
            || { say "apt-get install failed; see $DIR/apt.log"; return 1; }
    fi
}

write_config() {
    local cpus=2 mem=4096 last=$((SLURMD_PORT0 + NODES - 1))
    mkdir -p "$DIR"/{munge,state,spool,run,log}
    chmod 700 "$DIR/munge"
    if [[ ! -s $DIR/munge/munge.key ]]; then
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    fi
    chmod 400 "$DIR/munge/munge.key"
    local accounting="AccountingStorageType=accounting_storage/none"
    if [[ $ACCOUNTING == 1 ]]; then
        accounting="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$MUNGE_SOCKET"
        # slurmdbd reads slurmdbd.conf from the directory of SLURM_CONF; it must be mode 600.
        cat >"$DIR/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=$(id -un)
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=hpcrl_acct
EOF
        chmod 600 "$DIR/slurmdbd.conf"
    fi
    cat >"$CONF.tmp" <<EOF
# Written by tools/local_slurm.sh: a ${NODES}-node cluster on localhost for tests.
ClusterName=hpcrl-local
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmUser=$(id -un)
SlurmdUser=$(id -un)
AuthType=auth/munge
CryptoType=crypto/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
$accounting
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobRequeue=1
SlurmdTimeout=10
ReturnToService=1
KillWait=3
MinJobAge=600
InactiveLimit=0
NodeName=n[1-$NODES] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$SLURMD_PORT0-$last] CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
}

start_daemons() {
    export SLURM_CONF=$CONF
    if ! alive "$DIR/run/munged.pid"; then
        munged --force --socket="$MUNGE_SOCKET" --key-file="$DIR/munge/munge.key" \
            --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
            --seed-file="$DIR/munge/munge.seed"
    fi
    if [[ $ACCOUNTING == 1 ]]; then start_accounting; fi
    if ! alive "$DIR/run/slurmctld.pid"; then
        slurmctld -f "$CONF"
        for _ in $(seq 50); do alive "$DIR/run/slurmctld.pid" && break; sleep 0.1; done
        if ! alive "$DIR/run/slurmctld.pid"; then
            say "slurmctld did not start (is port $CTLD_PORT taken? set HPCRL_LOCAL_SLURM_PORT):"
            tail -5 "$DIR/log/slurmctld.log" >&2 || true
            return 1
        fi
    fi
    for ((i = 1; i <= NODES; i++)); do
        alive "$DIR/run/slurmd.n$i.pid" || slurmd -N "n$i" -f "$CONF"
    done
}

start_accounting() {
    local db=$DIR/mysql socket=$DIR/run/mysql.sock deadline
    if [[ ! -d $db/mysql ]]; then
        mkdir -p "$db"
        mariadb-install-db --user="$(id -un)" --datadir="$db" --auth-root-authentication-method=normal \
            --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1
    fi
    if ! alive "$DIR/run/mysqld.pid"; then
        mariadbd --user="$(id -un)" --datadir="$db" --socket="$socket" --port="$DB_PORT" \
            --bind-address=127.0.0.1 --pid-file="$DIR/run/mysqld.pid" --log-error="$DIR/log/mariadb.log" \
            --innodb-buffer-pool-size=32M >/dev/null 2>&1 &
        deadline=$((SECONDS + 30))
        until mariadb --socket="$socket" -uroot -e "select 1" >/dev/null 2>&1; do
            ((SECONDS < deadline)) || { say "MariaDB did not start; see $DIR/log/mariadb.log"; return 1; }
            sleep 0.2
        done
        mariadb --socket="$socket" -uroot -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
            GRANT ALL ON *.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
    fi
    if ! alive "$DIR/run/slurmdbd.pid"; then
        SLURM_CONF=$CONF slurmdbd
        deadline=$((SECONDS + 30))
        until (: >"/dev/tcp/127.0.0.1/$DBD_PORT") 2>/dev/null; do
            ((SECONDS < deadline)) || { say "slurmdbd did not start; see $DIR/log/slurmdbd.log"; return 1; }
            sleep 0.2
        done
    fi
}

wait_ready() {
    local deadline=$((SECONDS + 60)) states
    while ((SECONDS < deadline)); do
        states=$(SLURM_CONF=$CONF sinfo -h -N -o '%T' 2>/dev/null | sort -u | tr '\n' ' ') || true
        if [[ -n $states && $states =~ ^((idle|mixed|allocated)[[:space:]]*)+$ ]]; then
            return 0
        fi
        # Nodes left DOWN by an earlier run come back on their own only when unresponsive.
        if [[ $states == *down* || $states == *drain* ]]; then
            SLURM_CONF=$CONF scontrol update nodename="n[1-$NODES]" state=resume 2>/dev/null || true
        fi
        sleep 0.5
    done
    say "nodes not idle after 60 s (states: ${states:-none}); logs in $DIR/log"
    return 1
}

up() {
    mkdir -p "$DIR"
    install_packages
    if alive "$DIR/run/slurmctld.pid" && [[ -f $CONF ]] && SLURM_CONF=$CONF sinfo -h >/dev/null 2>&1; then
        start_daemons   # restarts any slurmd that died
        wait_ready
        say "already up ($NODES nodes)"
    else
        write_config
        start_daemons
        wait_ready
        say "up: $NODES nodes n1..n$NODES on localhost, partition debug"
    fi
    echo "export SLURM_CONF=$CONF"
}

down() {
    local pidfile pid stopped=0
    for pidfile in "$DIR"/run/slurmd.*.pid "$DIR/run/slurmctld.pid" "$DIR/run/slurmdbd.pid" \
        "$DIR/run/mysqld.pid" "$DIR/run/munged.pid"; do
        [[ -f $pidfile ]] || continue
        pid=$(cat "$pidfile")
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid" && stopped=$((stopped + 1))
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
        fi
        rm -f "$pidfile"
    done
    say "stopped $stopped daemons"
}

status() {
    local pidfile
    for pidfile in "$DIR/run/munged.pid" "$DIR/run/mysqld.pid" "$DIR/run/slurmdbd.pid" \
        "$DIR/run/slurmctld.pid" "$DIR"/run/slurmd.*.pid; do
        [[ -f $pidfile ]] || continue
        if alive "$pidfile"; then echo "$(basename "$pidfile" .pid): running ($(cat "$pidfile"))";
        else echo "$(basename "$pidfile" .pid): dead"; fi
    done
    [[ -f $CONF ]] || { echo "not configured ($CONF missing)"; return 1; }
    SLURM_CONF=$CONF sinfo -N -o '%N %T %c %m' || return 1
}

case ${1:-} in
    up) up ;;
    down) down ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
