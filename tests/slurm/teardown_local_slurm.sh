#!/usr/bin/env bash
# Stop what tests/slurm/setup_local_slurm.sh started (slurmd, slurmctld, munged), by their pid files.
#   bash tests/slurm/teardown_local_slurm.sh           # stop the daemons; config and packages stay
#   bash tests/slurm/teardown_local_slurm.sh --purge   # also remove our slurm.conf and saved job state
# Packages are left installed (removing them is `apt-get remove slurmctld slurmd slurm-client munge`).
set -euo pipefail

CONF=/etc/slurm/slurm.conf
MARKER="# Written by gpt2-ddp tests/slurm/setup_local_slurm.sh"

say() { echo "teardown_local_slurm: $*" >&2; }
[[ $(id -u) -eq 0 ]] || { say "needs root"; exit 1; }
if [[ -f $CONF ]] && ! grep -qF "$MARKER" "$CONF"; then
  say "$CONF was not written by setup_local_slurm.sh; leaving this machine's SLURM alone"
  exit 1
fi

stop_pidfile() {  # stop the daemon whose pid is in $1, waiting up to 10 s before SIGKILL
  local pidfile=$1 pid
  [[ -s $pidfile ]] || return 0
  pid=$(cat "$pidfile")
  kill -0 "$pid" 2>/dev/null || { rm -f "$pidfile"; return 0; }
  say "stopping $(basename "$pidfile" .pid) (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$pidfile"
}

stop_pidfile /run/slurmd.pid
stop_pidfile /run/slurmctld.pid
stop_pidfile /run/munge/munged.pid

if [[ ${1:-} == --purge ]]; then
  rm -f "$CONF"
  rm -rf /var/lib/slurm/slurmctld/* /var/lib/slurm/slurmd/*
  say "removed $CONF and the saved job state"
fi
