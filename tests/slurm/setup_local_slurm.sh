#!/usr/bin/env bash
# Bring up a real one-node SLURM on this machine (Debian's slurmctld + slurmd + munge, run as root,
# no systemd) so tests/test_slurm.py can submit the very sbatch files users submit.
#
# Idempotent: a second run with everything up only checks it; a changed config restarts the daemons.
#   bash tests/slurm/setup_local_slurm.sh          # install if missing, configure, start, wait for idle
#   bash tests/slurm/teardown_local_slurm.sh       # stop the daemons (add --purge to remove the config)
#
# Exit status: 0 when the node is up and accepting jobs; 77 (the automake/pytest "skip" convention)
# when this machine cannot host it (not root, packages not installable); anything else, including a
# slurm.conf this script did not write (a real cluster's: never overwritten), is a failure. The reason is always the last line on stderr.
set -euo pipefail

SKIP=77
CONF=/etc/slurm/slurm.conf
# Marks the files this script owns; without it we refuse to touch an existing (real) SLURM config.
MARKER="# Written by gpt2-ddp tests/slurm/setup_local_slurm.sh"
PARTITION=${SLURM_LOCAL_PARTITION:-local}
NODE=$(hostname -s)
LOG_DIR=/var/log/slurm
STATE_DIR=/var/lib/slurm

say() { echo "setup_local_slurm: $*" >&2; }
skip() { say "SKIP: $*"; exit "$SKIP"; }
die() { say "ERROR: $*"; exit 1; }

[[ $(id -u) -eq 0 ]] || skip "needs root (it installs packages and runs slurmctld/slurmd as root)"

install_packages() {
  local pkgs=(slurmctld slurmd slurm-client munge)
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
     && command -v sbatch >/dev/null && command -v munged >/dev/null; then
    return 0
  fi
  command -v apt-get >/dev/null || skip "slurm is not installed and there is no apt-get to install it"
  say "installing ${pkgs[*]}"
  # Not the slurm-wlm metapackage: it pulls 43 packages; these four are all a one-node cluster needs.
  local apt=(apt-get install -y -q --no-install-recommends "${pkgs[@]}")
  if ! DEBIAN_FRONTEND=noninteractive "${apt[@]}" >/tmp/setup_local_slurm.apt.log 2>&1; then
    # Stale package lists are the usual cause; refresh only then (an update costs a download).
    DEBIAN_FRONTEND=noninteractive apt-get update -q >>/tmp/setup_local_slurm.apt.log 2>&1 || true
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" >>/tmp/setup_local_slurm.apt.log 2>&1 \
      || skip "apt-get cannot install ${pkgs[*]} (see /tmp/setup_local_slurm.apt.log)"
  fi
}

# Print the slurm.conf for this machine. The node layout comes from `slurmd -C` so it matches the
# hardware exactly (a mismatch drains the node); RealMemory is 90% of MemTotal for the same reason.
render_conf() {
  local layout mem_mb
  layout=$(slurmd -C | head -n1 | sed -E 's/^NodeName=[^ ]+ //; s/ RealMemory=[0-9]+//')
  mem_mb=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
  cat <<EOF
$MARKER
# A one-node test cluster; remove with: bash tests/slurm/teardown_local_slurm.sh --purge
ClusterName=gpt2ddp-local
# An IP next to the name: with a name that does not resolve every daemon retries for 10 s and fails.
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job may not start again until its old credential expires (default 120 s).
AuthInfo=cred_expire=10
StateSaveLocation=${STATE_DIR}/slurmctld
SlurmdSpoolDir=${STATE_DIR}/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
SlurmdLogFile=${LOG_DIR}/slurmd.log
# No cgroups here (containers, no systemd): track processes by parent pid, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Look at the queue every 5 s instead of 60 s, so a requeued job restarts in ~15 s.
SchedulerParameters=sched_interval=5,bf_interval=5
JobRequeue=1
# A node that restarts with the daemons comes back by itself instead of staying DOWN.
ReturnToService=2
MpiDefault=none
NodeName=${NODE} NodeAddr=127.0.0.1 ${layout} RealMemory=${mem_mb} State=UNKNOWN
PartitionName=${PARTITION} Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP
EOF
}

# Write the config; print "changed" when it differs from what is there.
write_conf() {
  local new
  new=$(render_conf)
  if [[ -f $CONF ]] && ! grep -qF "$MARKER" "$CONF"; then
    die "$CONF exists and was not written by this script; refusing to overwrite a real SLURM config" \
        "(run the tests with -m 'not slurm' on this machine)"
  fi
  if [[ -f $CONF ]] && [[ "$(cat "$CONF")" == "$new" ]]; then
    return 0
  fi
  mkdir -p "$(dirname "$CONF")" "$LOG_DIR" "$STATE_DIR/slurmctld" "$STATE_DIR/slurmd"
  printf '%s\n' "$new" >"$CONF.tmp" && mv "$CONF.tmp" "$CONF"
  echo changed
}

pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    return 0
  fi
  # munged refuses to run as root and needs its socket directory owned by the munge user.
  install -d -o munge -g munge -m 0755 /run/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
  fi
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "munged did not come up (see /var/log/munge/munged.log)"
}

stop_pidfile() {  # stop the daemon whose pid is in $1, waiting for it to exit
  local pidfile=$1 pid
  pid_alive "$pidfile" || return 0
  pid=$(cat "$pidfile")
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}

start_slurm() {
  local changed=$1
  if [[ $changed == changed ]]; then
    # cred_expire and the node layout are read only at start-up; `scontrol reconfigure` is not enough.
    stop_pidfile /run/slurmd.pid
    stop_pidfile /run/slurmctld.pid
  fi
  if ! pid_alive /run/slurmctld.pid; then
    say "starting slurmctld"
    slurmctld || die "slurmctld failed to start (see $LOG_DIR/slurmctld.log)"
  fi
  if ! pid_alive /run/slurmd.pid; then
    say "starting slurmd"
    slurmd || die "slurmd failed to start (see $LOG_DIR/slurmd.log)"
  fi
}

# A trailing '*' (not responding) is kept on purpose: "idle*" is not ready.
node_state() { sinfo -h -n "$NODE" -o %T 2>/dev/null | head -n1 || true; }

wait_for_node() {
  local state=""
  for _ in $(seq 120); do
    state=$(node_state)
    case $state in
      idle|mixed|allocated|completing) say "node $NODE is $state"; return 0 ;;
      drained|draining|down)
        # Left over from an earlier run (e.g. the daemons were killed): put it back in service.
        scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  sinfo -N -l >&2 || true
  die "node $NODE did not become idle within 60 s (state '${state}'; see $LOG_DIR/slurmd.log)"
}

install_packages
changed=$(write_conf)
start_munge
start_slurm "$changed"
wait_for_node
