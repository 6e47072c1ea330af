#!/usr/bin/env bash
# CI: install and start a one-node SLURM cluster on localhost (root only) for tests/e2e/test_slurm.py.
# Debian's packages: slurmctld + slurmd (the cluster), munge (its authentication), slurmdbd +
# MariaDB (job accounting: the test reads which jobs ran from `sacct`, which needs slurmdbd;
# without it sacct only answers "accounting storage is disabled").
# Exit 0: the cluster is up, or the packages could not be installed (then the reason is printed
# and written to $SLURM_UNAVAILABLE_FILE, which tests/e2e/test_slurm.py reports as its skip reason).
# Any other failure (a daemon that does not start) fails CI.
set -euo pipefail

CLUSTER=eaglepipe-ci
PARTITION=cpu
SLURM_UNAVAILABLE_FILE=/tmp/eaglepipe-slurm-unavailable
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server)
rm -f "$SLURM_UNAVAILABLE_FILE"

unavailable() {
    echo "SLURM unavailable, tests/e2e/test_slurm.py will be skipped: $1" | tee "$SLURM_UNAVAILABLE_FILE" >&2
    exit 0
}

if [ "$(id -u)" != 0 ]; then
    unavailable "installing SLURM needs root (.ci/slurm.sh ran as $(id -un))"
fi
installed() {
    [ "$(dpkg-query -W -f='${db:Status-Status}\n' "${PACKAGES[@]}" 2>/dev/null | grep -cx installed)" \
        = "${#PACKAGES[@]}" ]
}
if installed; then
    echo "SLURM packages already installed"
else
    log=$(mktemp)
    if ! { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        "${PACKAGES[@]}"; } >"$log" 2>&1; then
        tail -20 "$log" >&2
        unavailable "apt-get install ${PACKAGES[*]} failed: $(grep -E '^(E|Err):' "$log" | head -3 | tr '\n' ' ')"
    fi
    echo "installed ${PACKAGES[*]}: $(grep -E '^[0-9]+ upgraded' "$log")"
fi

# The node describes this machine; slurmd checks CPUs and memory against the hardware.
NODE=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024))

mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /run/mysqld
cat >/etc/slurm/slurm.conf <<EOF
# One-node cluster for CI (written by .ci/slurm.sh). No cgroups: linuxproc tracks job processes.
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
# (the default) squeue, the profile's status command, shows a finished job for this long
MinJobAge=300
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
# sacct shows the comment, where the executor plugin names the rule and wildcards of each job
AccountingStoreFlags=job_comment
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
cat >/etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdHost=$NODE
DbdAddr=127.0.0.1
SlurmUser=root
PidFile=/run/slurmdbd.pid
LogFile=/var/log/slurm/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
EOF
chmod 600 /etc/slurm/slurmdbd.conf

wait_for() {  # wait_for WHAT COMMAND...: retry for 60 s, then show the logs and fail
    local what=$1
    shift
    for _ in $(seq 60); do
        if "$@" >/dev/null 2>&1; then
            return 0
        fi
        sleep 1
    done
    echo "$what did not come up; logs:" >&2
    tail -n 30 /var/log/slurm/*.log >&2 || true
    exit 1
}

chown munge:munge /run/munge
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
wait_for munged munge -n
chown mysql:mysql /run/mysqld
pgrep -x mariadbd >/dev/null || { runuser -u mysql -- /usr/sbin/mariadbd --bind-address=127.0.0.1 \
    >/var/log/slurm/mariadb.log 2>&1 & }
wait_for MariaDB mariadb -u root -e "SELECT 1"
pgrep -x slurmdbd >/dev/null || /usr/sbin/slurmdbd
wait_for slurmdbd sacctmgr -n list cluster
sacctmgr -nP list cluster format=cluster | grep -qx "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER"
# The cluster starts empty. A CI run killed midway on this machine leaves its jobs in slurmctld's
# saved state and slurmd's spool: recovered as running, they hold the node ("mix") long after their
# processes are gone. So stop any daemons of an earlier run, and -c drops the saved jobs and node state.
for daemon in slurmd slurmctld; do
    pkill -x "$daemon" || true
    for _ in $(seq 30); do pgrep -x "$daemon" >/dev/null || break; sleep 1; done
done
rm -rf /var/spool/slurmd/*
/usr/sbin/slurmctld -c
wait_for slurmctld scontrol ping
/usr/sbin/slurmd
node_idle() { sinfo -h -n "$NODE" -o %t | grep -qx idle; }
wait_for "node $NODE" node_idle
sinfo
echo "SLURM $(sinfo -V) up: partition $PARTITION, node $NODE ($CPUS CPUs, $MEM_MB MB)"
