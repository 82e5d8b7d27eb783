#!/usr/bin/env bash
# Configure and start a one-node SLURM cluster on loopback (root, no systemd):
# node "localhost" with 8 fake GPUs (character devices), job completion log without a database.
# Usage: .ci/slurm/up.sh   (state, logs and pidfiles in $DRAFTFLOW_SLURM_STATE)
set -euo pipefail

STATE=${DRAFTFLOW_SLURM_STATE:-/tmp/draftflow-slurm}
NUM_GPUS=${DRAFTFLOW_SLURM_GPUS:-8}
# More CPUs and memory than the host has (config_overrides): the test jobs are tiny and should
# run side by side even with the profile's production-sized requests.
NUM_CPUS=${DRAFTFLOW_SLURM_CPUS:-64}
MEM_MB=${DRAFTFLOW_SLURM_MEM_MB:-64000}
# slurm.conf must be at /etc/slurm: the job step plugin drops SLURM_CONF before its inner srun.
CONF_DIR=/etc/slurm

if [[ $(id -u) -ne 0 ]]; then
    echo "up.sh must run as root (it writes $CONF_DIR and starts daemons)" >&2
    exit 1
fi
if [[ -f $STATE/slurmctld.pid ]] && kill -0 "$(cat "$STATE/slurmctld.pid")" 2>/dev/null; then
    echo "SLURM is already running (state in $STATE)"
    exit 0
fi

mkdir -p "$STATE/ctld" "$STATE/d" "$CONF_DIR"
CONTROLLER=$(hostname -s)

# Fake GPUs: gres.conf accepts only character devices (195 = the NVIDIA major number).
GPU_FILES=()
for ((i = 0; i < NUM_GPUS; i++)); do
    dev=/dev/draftflow-gpu$i
    [[ -c $dev ]] || mknod "$dev" c 195 "$i"
    GPU_FILES+=("$dev")
done

cat >"$CONF_DIR/slurm.conf" <<CONF
# Written by draftflow .ci/slurm/up.sh: a one-node test cluster.
ClusterName=draftflow
SlurmctldHost=$CONTROLLER(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without a default each job claims all memory and jobs run one at a time.
DefMemPerCPU=500
# Keep finished jobs visible to squeue (the status command without a database) for an hour.
MinJobAge=3600
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
# Every finished job gets a line here: the test's proof that jobs went through SLURM.
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/jobcomp.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
GresTypes=gpu
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$NUM_CPUS RealMemory=$MEM_MB Gres=gpu:$NUM_GPUS State=UNKNOWN
# The partition names profiles/slurm/config.yaml uses, both on the one node.
PartitionName=cpu Nodes=localhost Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=localhost MaxTime=INFINITE State=UP
CONF

{
    echo "AutoDetect=off"
    for ((i = 0; i < NUM_GPUS; i++)); do
        echo "NodeName=localhost Name=gpu File=/dev/draftflow-gpu$i"
    done
} >"$CONF_DIR/gres.conf"

# munged runs as user munge and needs its socket directory.
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
[[ -f /etc/munge/munge.key ]] || mungekey --create --keyfile=/etc/munge/munge.key
chown munge:munge /etc/munge/munge.key
chmod 400 /etc/munge/munge.key
if ! { [[ -f /run/munge/munged.pid ]] && kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; }; then
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
    cp /run/munge/munged.pid "$STATE/munged.pid"
fi

/usr/sbin/slurmctld -c
/usr/sbin/slurmd -N localhost

# Wait until the node takes jobs.
for _ in $(seq 1 60); do
    if sinfo -h -N -o '%t' 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
        sinfo -N -o '%N %t %c %m %G'
        echo "SLURM is up (state, logs, pidfiles in $STATE)"
        exit 0
    fi
    sleep 1
done
echo "SLURM did not become ready; logs:" >&2
tail -n 30 "$STATE/slurmctld.log" "$STATE/slurmd.log" >&2 || true
exit 1
