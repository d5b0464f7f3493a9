#!/usr/bin/env bash
# A real Slurm cluster on this machine for tests and the embedded default: munge, slurmctld and
# several `slurmd -N nK` (one per simulated node), all in a private directory.
#
#   tools/local_slurm.sh up          # install (apt, when root and missing), configure, start; idempotent
#   tools/local_slurm.sh status      # what runs, each node's address and namespace, and sinfo
#   tools/local_slurm.sh down        # stop the daemons this script started (by PID), remove its network
#   tools/local_slurm.sh env         # print the export line clients need
#   tools/local_slurm.sh cut nK      # network fault: take node nK's link down ...
#   tools/local_slurm.sh mend nK     # ... and up again (resumed if Slurm marked it DOWN meanwhile)
#   tools/local_slurm.sh slow nK 100mbit | slow nK off   # a token-bucket (tbf) limit on nK's link
#   tools/local_slurm.sh poweroff nK # power loss: cut nK's link, freeze then kill everything on it
#   tools/local_slurm.sh poweron nK  # ... and back: link up, slurmd started, node resumed
#
# Clients find the cluster through SLURM_CONF (printed by `up` and `env`):
#   export SLURM_CONF=$PWD/.local_slurm/slurm.conf; sbatch --wrap hostname
#
# Nodes as separate hosts (the default where the machine allows it: root, `ip netns`, `unshare`):
# node nK runs in a network, UTS and mount namespace of its own (namespace hpcrl<C>n<K>), with
# hostname nK and address 198.18.C.K/24 on eth0, a veth joined to the host bridge hpcrl<C>br
# (198.18.C.254/24, the nodes' default route), where slurmctld is reached. C is a per-cluster index
# (from the port: (PORT - 16817) / 100, the next free one if another cluster holds it), so the
# suite's two clusters get distinct namespaces, bridges and subnets. 198.18.0.0/15 is reserved for
# network benchmarks and never routed. Each node sees a hosts file of its own (bind-mounted on
# /etc/hosts in its mount namespace: its cluster's nodes, and this host's name -> the bridge); the
# host gets the nodes' names in /etc/hosts between `# hpcrl-local-slurm <C> begin/end` (when two
# clusters are up, the host resolves nK to the first block's address; nodes always to their own
# cluster's). 127.0.0.1 on a node is that node's own loopback. /tmp stays shared (tests read job
# output from there). Where namespaces cannot be made, the nodes share localhost as before
# (NodeAddr=127.0.0.1, distinct ports), saying why on stderr; HPCRL_LOCAL_SLURM_NETNS=0 forces that
# mode, =1 makes it an error instead. A running cluster keeps the mode it was started in.
# Enter a node by hand: nsenter --net=/var/run/netns/hpcrl<C>n<K> bash
# Not `ip netns exec` for slurmd: it remounts /sys, and slurmd then fails on /sys/fs/cgroup.
#
# Settings (environment): HPCRL_LOCAL_SLURM_DIR (default <repo>/.local_slurm),
# HPCRL_LOCAL_SLURM_ACCOUNTING=1 (also start MariaDB + slurmdbd on ports +1/+2 so sacct works;
# apt packages mariadb-server and slurmdbd; about 2 s more to start),
# HPCRL_LOCAL_SLURM_NODES (6: a 4-component hetjob with a 2-node trainer, plus a spare; hetjob components
# never share nodes), HPCRL_LOCAL_SLURM_PORT (16817; slurmd ports follow from +184),
# HPCRL_LOCAL_SLURM_NETNS (auto | 1 | 0, see above),
# HPCRL_LOCAL_SLURM_GPUS (0: CPU-only nodes, the default; N: N fake GPUs per node, 4 suggested, see below).
#
# Fake GPUs (HPCRL_LOCAL_SLURM_GPUS=N): every node gets `Gres=gpu:N` (slurm.conf has GresTypes=gpu)
# backed by character devices <dir>/dev/nK/nvidia0..N-1 (mknod c 195 <minor>, minors distinct per
# node), listed per node in <dir>/gres.conf with AutoDetect=off. Slurm then allocates them as real
# GPUs and sets CUDA_VISIBLE_DEVICES per task: `srun -n2 --gpus-per-task=1` gives 0 and 1,
# `--gres=gpu:2` gives 0,1. Nothing opens the files; there is no CUDA. mknod needs root. A GPU node
# also claims 2 CPUs per GPU (Slurm accepts more than the host has with config_overrides, and binds
# nothing with task/none), so GPU tasks can ask for CPUs as on a real node. `up` on a
# cluster started with another GPU count stops it and starts it again with the one asked for.
# Tuned for tests (measured on Slurm 22.05): bf_interval=1 because only the backfill scheduler
# starts heterogeneous jobs; JobRequeue=1; SlurmdTimeout=10; cred_expire=5 (a requeued job
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
NETNS_WANTED=${HPCRL_LOCAL_SLURM_NETNS:-auto}
GPUS=${HPCRL_LOCAL_SLURM_GPUS:-0}
[[ $GPUS =~ ^[0-9]+$ ]] || { echo "local_slurm: HPCRL_LOCAL_SLURM_GPUS must be 0 or a count, got '$GPUS'" >&2; exit 2; }
GPUS=$((10#$GPUS))
DBD_PORT=$((CTLD_PORT + 1))
DB_PORT=$((CTLD_PORT + 2))
CONF=$DIR/slurm.conf
MUNGE_SOCKET=$DIR/munge/munge.socket
NETDIR=$DIR/net                     # index (the cluster's C) and the nodes' hosts files
LOCK=/tmp/hpcrl-local-slurm.lock    # one for all clusters: index choice and /etc/hosts edits
NETNS_MARK="# hpcrl-local-slurm netns"
C=""                                # set by net_init when the nodes are namespaced

say() { echo "local_slurm: $*" >&2; }

alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# ---- names of the namespaced network, all derived from the cluster index C ----
bridge() { echo "hpcrl${C}br"; }
ns() { echo "hpcrl${C}n$1"; }          # network namespace of node n$1 ...
veth() { echo "hpcrl${C}n$1"; }        # ... and the host end of its veth pair (eth0 inside)
node_addr() { echo "198.18.$C.$1"; }
bridge_addr() { echo "198.18.$C.254"; }
owner_tag() { echo "hpcrl-local-slurm:$DIR"; }   # the bridge's alias: which cluster made it
short_host() { local h; h=$(uname -n); echo "${h%%.*}"; }

# GPUs per node of a configured cluster (0 when its slurm.conf names none).
conf_gpus() { [[ -f $CONF ]] && sed -n 's/^NodeName=.* Gres=gpu:\([0-9]*\).*$/\1/p' "$CONF" | head -1 | grep . || echo 0; }

# The fake GPUs' device files and gres.conf (GPU mode only). Minor numbers: node K has
# (K-1)*N .. K*N-1, so no two nodes share a device.
write_gres() {
    local i j f dev lines="AutoDetect=off"
    rm -rf "$DIR/dev"   # made again: another GPU count or node count may have left other files
    for ((i = 1; i <= NODES; i++)); do
        dev=$DIR/dev/n$i
        mkdir -p "$dev"
        for ((j = 0; j < GPUS; j++)); do
            f=$dev/nvidia$j
            mknod "$f" c 195 $(((i - 1) * GPUS + j)) || { say "mknod $f failed (fake GPUs need root)"; return 1; }
        done
        lines+=$'\n'"NodeName=n$i Name=gpu File=$dev/nvidia[0-$((GPUS - 1))]"
    done
    printf '%s\n' "$lines" >"$DIR/gres.conf"
}

# C of a running or configured namespaced cluster ("" when its nodes share localhost).
conf_index() { [[ -f $CONF ]] && sed -n "s/^$NETNS_MARK \([0-9]*\)$/\1/p" "$CONF" | head -1 || true; }

locked() {  # run "$@" holding the lock shared by every cluster of this script
    local fd
    exec {fd}>"$LOCK"
    flock -w 60 "$fd" || { say "could not take $LOCK"; return 1; }
    "$@"
    local rc=$?
    exec {fd}>&-
    return $rc
}

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
    if [[ $NETNS_WANTED != 0 && $(id -u) == 0 ]]; then
        { command -v ip && command -v tc; } >/dev/null || missing+=(iproute2)
        { command -v nsenter && command -v unshare && command -v flock; } >/dev/null || missing+=(util-linux)
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

# Why the nodes cannot be namespaced here (empty when they can): tries exactly what `up` does.
netns_unavailable() {
    [[ $(id -u) == 0 ]] || { echo "not root"; return; }
    local cmd
    for cmd in ip tc nsenter unshare flock; do
        command -v "$cmd" >/dev/null || { echo "$cmd missing"; return; }
    done
    local p=hpcrlp$$ why=""
    if ! ip netns add "$p" 2>/dev/null; then echo "ip netns add failed"; return; fi
    if ! ip link add "${p}b" type bridge 2>/dev/null; then why="cannot make a bridge"
    elif ! ip link add "${p}v" type veth peer name eth0 netns "$p" 2>/dev/null; then why="cannot make veth pairs"
    elif ! nsenter --net="/var/run/netns/$p" unshare --uts --mount --propagation slave \
        sh -c 'mount --bind /dev/null /etc/hosts && echo probe >/proc/sys/kernel/hostname' 2>/dev/null; then
        why="unshare --uts --mount or a bind mount on /etc/hosts failed"
    fi
    ip link del "${p}v" 2>/dev/null || true
    ip link del "${p}b" 2>/dev/null || true
    ip netns del "$p" 2>/dev/null || true
    echo "$why"
}

# Choose C (under the lock): the recorded one, else (PORT - 16817) / 100 mod 250, moving on while
# another cluster's bridge, namespaces or hosts block holds it.
choose_index() {
    local c tries taken
    if [[ -f $NETDIR/index ]]; then c=$(cat "$NETDIR/index")
    else c=$(( ((CTLD_PORT - 16817) / 100 % 250 + 250) % 250 )); fi
    for ((tries = 0; tries < 250; tries++, c = (c + 1) % 250)); do
        taken=""
        if ip link show "hpcrl${c}br" >/dev/null 2>&1; then
            [[ $(cat "/sys/class/net/hpcrl${c}br/ifalias" 2>/dev/null) == "hpcrl-local-slurm:$DIR" ]] || taken=1
        elif ip netns list 2>/dev/null | grep -Eq "^hpcrl${c}n[0-9]+( |$)" \
            || grep -q "^# hpcrl-local-slurm $c begin$" /etc/hosts 2>/dev/null; then
            taken=1
        fi
        if [[ -z $taken ]]; then
            mkdir -p "$NETDIR"
            echo "$c" >"$NETDIR/index"
            C=$c
            return 0
        fi
    done
    say "no free cluster index for the namespaced network"
    return 1
}

# The nodes' network: bridge, namespaces, veth pairs, hosts files. Creates only what is missing,
# so `up` on a running cluster leaves a `cut` or `slow` link as it is.
ensure_network() {
    local br i n v addr
    br=$(bridge)
    if ! ip link show "$br" >/dev/null 2>&1; then
        ip link add "$br" type bridge
        ip link set "$br" alias "$(owner_tag)"
    fi
    ip addr replace "$(bridge_addr)/24" dev "$br"
    ip link set "$br" up
    write_hosts_files
    for ((i = 1; i <= NODES; i++)); do
        n=$(ns "$i") v=$(veth "$i") addr=$(node_addr "$i")
        if [[ ! -e /var/run/netns/$n ]]; then
            ip netns add "$n"
            ip link del "$v" 2>/dev/null || true   # its other end is in an older, unnamed namespace
        fi
        nsenter --net="/var/run/netns/$n" ip link set lo up
        if ! ip link show "$v" >/dev/null 2>&1; then
            ip link add "$v" type veth peer name eth0 netns "$n"
            ip link set "$v" master "$br"
            ip link set "$v" up
        fi
        nsenter --net="/var/run/netns/$n" sh -c "ip addr replace $addr/24 dev eth0 && ip link set eth0 up &&
            ip route replace default via $(bridge_addr) dev eth0"
    done
}

# Each node's /etc/hosts (bind-mounted in its mount namespace) and this host's block in /etc/hosts.
write_hosts_files() {
    local i f nodes="" block
    for ((i = 1; i <= NODES; i++)); do nodes+="$(node_addr "$i") n$i"$'\n'; done
    for ((i = 1; i <= NODES; i++)); do
        f=$NETDIR/hosts.n$i
        # Written in place (not renamed): a running node's bind mount holds this file's inode.
        printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n%s %s\n%s' \
            "$(bridge_addr)" "$(short_host)" "$nodes" >"$f"
    done
    # No name server: the host's is unreachable from a node's network, and every lookup the hosts file
    # cannot answer (the AAAA half of resolving a node's own name, as c10d and gloo do) then waited
    # 2 x 5 s for it - 10 s in every rendezvous. With none, glibc asks the node's own loopback, which
    # refuses at once. A real cluster's DNS answers; this keeps the imitation from adding waits.
    printf '# hpcrl local cluster node: names come from /etc/hosts only\noptions timeout:1 attempts:1\n' \
        >"$NETDIR/resolv.conf"
    block="# hpcrl-local-slurm $C begin"$'\n'"$nodes# hpcrl-local-slurm $C end"
    locked hosts_block "$block"
}

hosts_block() {  # replace this cluster's block in /etc/hosts with $1 ("" removes it); in place
    local begin="# hpcrl-local-slurm $C begin" end="# hpcrl-local-slurm $C end" new
    new=$(awk -v b="$begin" -v e="$end" '$0 == b {skip = 1} !skip {print} $0 == e {skip = 0}' /etc/hosts)
    [[ -n $1 ]] && new+=$'\n'"$1"
    [[ $new == "$(cat /etc/hosts)" ]] && return 0
    printf '%s\n' "$new" >/etc/hosts
}

# Everything ensure_network made for index C, whatever is left of it; idempotent. Processes still
# in a node's namespace (tasks of a killed slurmd, their slurmstepds) are stopped first.
teardown_network() {
    [[ -n $C ]] || return 0
    local br n v names pid pids=""
    br=$(bridge)
    if ip link show "$br" >/dev/null 2>&1 && [[ $(cat "/sys/class/net/$br/ifalias" 2>/dev/null) != "$(owner_tag)" ]]; then
        say "bridge $br belongs to another cluster ($(cat "/sys/class/net/$br/ifalias" 2>/dev/null)); left alone"
        return 0
    fi
    names=$(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^hpcrl${C}n[0-9]+$" || true)
    for n in $names; do pids+=" $(ip netns pids "$n" 2>/dev/null | tr '\n' ' ')"; done
    if [[ -n ${pids// /} ]]; then
        kill $pids 2>/dev/null || true
        for _ in $(seq 30); do alive_pids $pids || break; sleep 0.1; done
        for pid in $pids; do kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null; done
    fi
    for n in $names; do ip netns del "$n" 2>/dev/null || true; done
    for v in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 \
        | grep -E "^hpcrl${C}(n[0-9]+|br)$" || true); do
        ip link del "$v" 2>/dev/null || true
    done
    locked hosts_block ""
    rm -f "$NETDIR"/hosts.n* "$NETDIR/resolv.conf"
}

# Decide how a cluster that is not running yet starts: sets C (namespaced) or leaves it empty.
net_init() {
    local why
    C=""
    if [[ $NETNS_WANTED == 0 ]]; then
        say "nodes share localhost (HPCRL_LOCAL_SLURM_NETNS=0)"
    else
        why=$(netns_unavailable)
        if [[ -z $why ]]; then
            locked choose_index
        elif [[ $NETNS_WANTED == 1 ]]; then
            say "HPCRL_LOCAL_SLURM_NETNS=1 but nodes cannot have network namespaces here: $why"
            return 1
        else
            say "nodes share localhost (no network namespaces here: $why; they need root, ip netns and unshare)"
        fi
    fi
    if [[ -z $C && -f $NETDIR/index ]]; then   # an earlier namespaced run left something behind
        C=$(cat "$NETDIR/index")
        teardown_network
        rm -f "$NETDIR/index"
        C=""
    fi
}

write_config() {
    local cpus=2 mem=4096 last=$((SLURMD_PORT0 + NODES - 1)) i nodes ctld_host acct_host=localhost where
    local gres="" gres_types="" where_gpus=""
    mkdir -p "$DIR"/{munge,state,spool,run,log}
    if ((GPUS > 0)); then
        write_gres
        gres=" Gres=gpu:$GPUS"
        cpus=$((2 * GPUS))   # more than the host has: SlurmdParameters=config_overrides, TaskPlugin=task/none
        gres_types=$'\n'"GresTypes=gpu"
        where_gpus=", $GPUS fake GPUs each"
    else
        rm -rf "$DIR/gres.conf" "$DIR/dev"
    fi
    chmod 700 "$DIR/munge"
    if [[ ! -s $DIR/munge/munge.key ]]; then
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    fi
    chmod 400 "$DIR/munge/munge.key"
    if [[ -n $C ]]; then
        # The real host name, reached at the bridge address; each node at its own address.
        ctld_host="$(short_host)($(bridge_addr))"
        acct_host=$(bridge_addr)   # sacct inside a job talks to slurmdbd from the node
        where="each in its own network namespace"
        nodes="$NETNS_MARK $C"
        for ((i = 1; i <= NODES; i++)); do
            nodes+=$'\n'"NodeName=n$i NodeHostname=n$i NodeAddr=$(node_addr "$i") Port=$((SLURMD_PORT0 + i - 1)) CPUs=$cpus RealMemory=$mem$gres State=UNKNOWN"
        done
    else
        ctld_host=localhost
        where="on localhost"
        nodes="NodeName=n[1-$NODES] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$SLURMD_PORT0-$last] CPUs=$cpus RealMemory=$mem$gres State=UNKNOWN"
    fi
    local accounting="AccountingStorageType=accounting_storage/none"
    if [[ $ACCOUNTING == 1 ]]; then
        accounting="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$acct_host
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$MUNGE_SOCKET"
        # slurmdbd reads slurmdbd.conf from the directory of SLURM_CONF; it must be mode 600.
        cat >"$DIR/slurmdbd.conf" <<EOC
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
EOC
        chmod 600 "$DIR/slurmdbd.conf"
    fi
    cat >"$CONF.tmp" <<EOC
# Written by tools/local_slurm.sh: a ${NODES}-node cluster for tests, nodes $where$where_gpus.
ClusterName=hpcrl-local
SlurmctldHost=$ctld_host
SlurmctldPort=$CTLD_PORT
SlurmUser=$(id -un)
SlurmdUser=$(id -un)
AuthType=auth/munge
CryptoType=crypto/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=5
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
JobRequeue=1$gres_types
SlurmdTimeout=10
ReturnToService=1
KillWait=3
MinJobAge=600
InactiveLimit=0
$nodes
PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP
EOC
    mv "$CONF.tmp" "$CONF"
}

start_slurmd() {  # node number
    local i=$1
    if [[ -z $C ]]; then
        slurmd -N "n$i" -f "$CONF"
        return
    fi
    # Own network (nsenter), own hostname (UTS), own /etc/hosts and /etc/resolv.conf (bind mounts in a
    # private mount namespace; propagation slave, so the node still sees what the host mounts later).
    nsenter --net="/var/run/netns/$(ns "$i")" unshare --uts --mount --propagation slave \
        sh -c 'mount --bind "$1" /etc/hosts && mount --bind "$4" /etc/resolv.conf &&
               echo "$2" >/proc/sys/kernel/hostname && exec slurmd -N "$2" -f "$3"' \
        sh "$NETDIR/hosts.n$i" "n$i" "$CONF" "$NETDIR/resolv.conf"
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
        alive "$DIR/run/slurmd.n$i.pid" || start_slurmd "$i"
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

where() {
    if [[ -n $C ]]; then echo "in network namespaces hpcrl${C}n*, $(node_addr 1)..$NODES/24, bridge $(bridge)"
    else echo "on localhost"; fi
}

up() {
    local pidfile slurmd_alive=""
    mkdir -p "$DIR"
    install_packages
    local had
    had=$(conf_gpus)
    if [[ $had != "$GPUS" ]] && { alive "$DIR/run/slurmctld.pid" || compgen -G "$DIR/run/slurmd.*.pid" >/dev/null; }; then
        say "restarting: the cluster was started with $had GPUs per node, HPCRL_LOCAL_SLURM_GPUS asks for $GPUS"
        down
    fi
    for pidfile in "$DIR"/run/slurmd.*.pid; do alive "$pidfile" && slurmd_alive=1; done
    if alive "$DIR/run/slurmctld.pid" && [[ -f $CONF ]] && SLURM_CONF=$CONF sinfo -h >/dev/null 2>&1; then
        C=$(conf_index)   # a running cluster keeps its mode
        if [[ -n $C ]]; then ensure_network; fi
        start_daemons   # restarts any slurmd that died
        wait_ready
        say "already up ($NODES nodes $(where))"
    else
        if [[ -n $slurmd_alive && -f $CONF ]]; then
            C=$(conf_index)   # slurmctld died under live slurmds: restart it in the same mode
            if [[ -n $C ]]; then mkdir -p "$NETDIR"; echo "$C" >"$NETDIR/index"; fi
        else
            net_init
        fi
        if [[ -n $C ]]; then ensure_network; fi
        write_config
        start_daemons
        wait_ready
        say "up: $NODES nodes n1..n$NODES $(where), partition debug"
    fi
    echo "export SLURM_CONF=$CONF"
}

alive_pids() { local pid; for pid in "$@"; do kill -0 "$pid" 2>/dev/null && return 0; done; return 1; }

stop() {  # pidfile...: SIGTERM to all at once, then wait (slurmd takes ~2 s, slurmctld ~5 s); the count
    local pidfile pid pids=() n=0
    for pidfile in "$@"; do
        [[ -f $pidfile ]] || continue
        pid=$(cat "$pidfile")
        rm -f "$pidfile"
        kill "$pid" 2>/dev/null && pids+=("$pid") && n=$((n + 1))
    done
    for _ in $(seq 100); do
        alive_pids "${pids[@]}" || break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null; done
    echo "$n"
}

down() {
    local stopped
    # Nodes and controller together, then accounting, then its database and munge.
    stopped=$(($(stop "$DIR"/run/slurmd.*.pid "$DIR/run/slurmctld.pid") + $(stop "$DIR/run/slurmdbd.pid")
        + $(stop "$DIR/run/mysqld.pid" "$DIR/run/munged.pid")))
    C=$(cat "$NETDIR/index" 2>/dev/null || true)
    [[ -n $C ]] || C=$(conf_index)
    if [[ -n $C ]]; then
        teardown_network
        rm -f "$NETDIR/index"
        say "stopped $stopped daemons; removed namespaces hpcrl${C}n*, their links, bridge $(bridge) and hosts entries"
    else
        say "stopped $stopped daemons"
    fi
}

status() {
    local pidfile i v state rate
    for pidfile in "$DIR/run/munged.pid" "$DIR/run/mysqld.pid" "$DIR/run/slurmdbd.pid" \
        "$DIR/run/slurmctld.pid" "$DIR"/run/slurmd.*.pid; do
        [[ -f $pidfile ]] || continue
        if alive "$pidfile"; then echo "$(basename "$pidfile" .pid): running ($(cat "$pidfile"))";
        else echo "$(basename "$pidfile" .pid): dead"; fi
    done
    [[ -f $CONF ]] || { echo "not configured ($CONF missing)"; return 1; }
    C=$(conf_index)
    if [[ -n $C ]]; then
        echo "network: bridge $(bridge) $(bridge_addr)/24 ($(cat "/sys/class/net/$(bridge)/operstate" 2>/dev/null || echo missing))"
        for ((i = 1; i <= $(grep -c '^NodeName=' "$CONF"); i++)); do
            v=$(veth "$i")
            state=$(cat "/sys/class/net/$v/operstate" 2>/dev/null || echo missing)
            [[ $state == down ]] && state="down (cut)"
            [[ -e /var/run/netns/$(ns "$i") ]] || state="$state, namespace missing"
            rate=$(tc qdisc show dev "$v" 2>/dev/null | grep -o 'tbf .* rate [^ ]*' | awk '{print $NF}' || true)
            echo "n$i $(node_addr "$i") netns $(ns "$i") link $state${rate:+ rate $rate}"
        done
    else
        echo "network: nodes share localhost (127.0.0.1)"
    fi
    SLURM_CONF=$CONF sinfo -N -o '%N %T %c %m' || return 1
}

# cut / mend / slow act on node nK's veth pair: the host end (and, for slow, eth0 inside too).
# Power loss of node K, as the rest of the cluster sees one: its link goes down first (so no FIN or
# RST leaves it: peers see silence, not closed connections), then every process in its network
# namespace - slurmd, its slurmstepds, the tasks and all their descendants (vLLM's engine
# processes carry no SLURM_* variables, but they live in the node's namespace) - is frozen with
# SIGSTOP until no new one appears, so none reports its own end, and then killed. slurmd stays
# dead: Slurm notices the node after SlurmdTimeout and marks it DOWN.
poweroff() {  # node number
    local k=$1 n pids all=() round
    n=$(ns "$k")
    ip link set "$(veth "$k")" down
    for round in $(seq 20); do
        mapfile -t pids < <(ip netns pids "$n" 2>/dev/null)
        local new=()
        for pid in "${pids[@]}"; do [[ " ${all[*]} " == *" $pid "* ]] || new+=("$pid"); done
        ((${#new[@]})) || break
        kill -STOP "${new[@]}" 2>/dev/null || true
        all+=("${new[@]}")
    done
    ((${#all[@]})) && kill -KILL "${all[@]}" 2>/dev/null || true
    rm -f "$DIR/run/slurmd.n$k.pid"
    say "n$k powered off (link $(veth "$k") down, ${#all[@]} processes frozen, then killed)"
}

poweron() {  # node number
    local k=$1
    ip link set "$(veth "$k")" up
    export SLURM_CONF=$CONF
    alive "$DIR/run/slurmd.n$k.pid" || start_slurmd "$k"
    resume "$k"  # DOWN after the loss; idle if not yet noticed
    say "n$k powered on (link up, slurmd started, node resumed)"
}

# Node K back in service if Slurm marked it DOWN; nothing to do (and nothing said) if it is not.
resume() {  # node number
    SLURM_CONF=$CONF scontrol update nodename="n$1" state=resume 2>/dev/null || true
}

# The link up again. A node Slurm marked DOWN while it was cut off is resumed, as after a power-on; with
# ReturnToService=1 Slurm would do so itself only once a later ping reaches it (30-40 s measured), and
# the fault matrix's next case would wait for the node.
mend() {  # node number
    ip link set "$(veth "$1")" up
    resume "$1"
    say "n$1 reconnected (link $(veth "$1") up)"
}

node_link() {
    C=$(conf_index)
    [[ -n $C ]] || { say "nodes of $CONF share localhost: $1 needs namespaced nodes"; exit 1; }
    [[ ${2:-} =~ ^n([0-9]+)$ ]] || { say "usage: $0 $1 nK${3:+ $3}"; exit 2; }
    K=${BASH_REMATCH[1]}
    ip link show "$(veth "$K")" >/dev/null 2>&1 || { say "no link $(veth "$K") for ${2}"; exit 1; }
}

slow() {  # node rate: a tbf limit both ways on the node's link; rate "off" removes it
    local v n rate=$2 bits burst
    v=$(veth "$K") n=/var/run/netns/$(ns "$K")
    if [[ $rate == off ]]; then
        tc qdisc del dev "$v" root 2>/dev/null || true
        nsenter --net="$n" tc qdisc del dev eth0 root 2>/dev/null || true
        say "n$K: link at full speed"
        return
    fi
    [[ $rate =~ ^([0-9]+)(bit|kbit|mbit|gbit)$ ]] || { say "rate like 100mbit, 1gbit or 500kbit; got $rate"; exit 2; }
    case ${BASH_REMATCH[2]} in bit) bits=1 ;; kbit) bits=1000 ;; mbit) bits=1000000 ;; gbit) bits=1000000000 ;; esac
    bits=$((BASH_REMATCH[1] * bits))
    burst=$((bits / 8 / 100))   # 10 ms at that rate, at least a few full-size packets
    ((burst >= 32768)) || burst=32768
    tc qdisc replace dev "$v" root tbf rate "$rate" burst "$burst" latency 100ms
    nsenter --net="$n" tc qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" latency 100ms
    say "n$K: link limited to $rate each way (tbf, burst $burst bytes)"
}

case ${1:-} in
    up) up ;;
    down) down ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    cut) node_link cut "${2:-}"; ip link set "$(veth "$K")" down; say "n$K cut off (link $(veth "$K") down)" ;;
    mend) node_link mend "${2:-}"; mend "$K" ;;
    slow) node_link slow "${2:-}" RATE; [[ -n ${3:-} ]] || { say "usage: $0 slow nK RATE|off"; exit 2; }; slow "$2" "$3" ;;
    poweroff) node_link poweroff "${2:-}"; poweroff "$K" ;;
    poweron) node_link poweron "${2:-}"; poweron "$K" ;;
    *) echo "usage: $0 up|down|status|env|cut nK|mend nK|slow nK RATE|off|poweroff nK|poweron nK" >&2; exit 2 ;;
esac
