#!/usr/bin/env bash
# Stop the cluster started by up.sh, by the pids in its pidfiles (slurmd, slurmctld, munged).
set -uo pipefail

STATE=${DRAFTFLOW_SLURM_STATE:-/tmp/draftflow-slurm}

stop() {
    local pidfile=$1
    [[ -f $pidfile ]] || return 0
    local pid
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 1 20); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    rm -f "$pidfile"
}

stop "$STATE/slurmd.pid"
stop "$STATE/slurmctld.pid"
# Only the munged that up.sh started (its pid copied into the state directory).
stop "$STATE/munged.pid"
echo "SLURM stopped"
