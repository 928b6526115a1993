# Shared by the sbatch scripts in slurm/ (sourced, defines functions only): finding the repository
# and environment, counting GPUs, the run directory, and turning a SLURM signal into a checkpoint and
# a requeue. Nothing here is specific to one script.
#
# How preemption and time limits work, end to end:
#  1. `#SBATCH --signal=B:USR1@120` makes SLURM send USR1 to the batch shell 120 s before the time
#     limit (`scancel --signal=USR1 --batch JOB` does the same by hand). Only the batch shell gets it.
#  2. The batch shell runs its launcher as `cmd & wait` so the trap runs at once (bash runs a trap
#     only when the foreground command returns), remembers the signal, and forwards it once. The
#     launcher is torchrun run as `python -m gpt2.launch` (see gpt2/launch.py): the same torchrun,
#     which on a stop signal prints one line instead of a traceback that would read like a crash.
#       - to torchrun as SIGTERM: torchrun forwards SIGTERM to every worker; it does not handle USR1
#         (before torch 2.9) and would simply die, orphaning the workers. torchrun itself is started
#         with USR1 ignored for the same reason, in case a USR1 reaches it directly.
#       - to srun as USR1: srun relays USR1 to every process of the step (each node's srun_task.sh
#         turns it into SIGTERM for its torchrun). A SIGTERM would make srun cancel the step instead.
#  3. Every rank stops at the next step boundary, rank 0 saves a checkpoint and then writes
#     OUT_DIR/requeue. torchrun's own exit code says nothing useful (1 whenever it was signalled, as
#     for a crash; gpt2.launch says 3 when that file confirms the stop), so the shell goes by that file
#     and by having been signalled.
#  4. USR1 and OUT_DIR/requeue: `scontrol requeue $SLURM_JOB_ID` (see gpt2_finish for the exceptions).
#     The job keeps its ID, hence its OUT_DIR, and the rerun passes `--resume auto`.
#  A SIGTERM to the batch shell (plain `scancel`, preemption with a grace time, the hard time limit)
#  is forwarded the same way so the trainer checkpoints, but is never requeued from here, even after
#  a USR1: SLURM or the user decided. A crash (no signal) is never requeued either.

gpt2_log() { echo "[slurm $(date -u +%H:%M:%S)] $*"; }
gpt2_die() { echo "[slurm $(date -u +%H:%M:%S)] ERROR: $*" >&2; exit 2; }

# Print the number of trainer processes per node: GPUS_PER_NODE if set (CPU-only nodes, tests),
# else what SLURM allocated (--gpus-per-node / --gres), so the count is written only once.
gpt2_gpus_per_node() {
  local n=${GPUS_PER_NODE:-}
  if [[ -z $n && -n ${SLURM_GPUS_ON_NODE:-} ]]; then n=$SLURM_GPUS_ON_NODE; fi
  if [[ -z $n && -n ${SLURM_GPUS_PER_NODE:-} ]]; then n=${SLURM_GPUS_PER_NODE##*:}; fi  # "a100:8" -> 8
  if ! [[ $n =~ ^[0-9]+$ ]] || (( n < 1 )); then
    gpt2_die "no GPU count (GPUS_PER_NODE='${GPUS_PER_NODE:-}', SLURM_GPUS_ON_NODE='${SLURM_GPUS_ON_NODE:-}'):" \
             "request GPUs with --gpus-per-node=N, or on CPU-only nodes set GPUS_PER_NODE=N (processes per node)"
  fi
  echo "$n"
}

# Set REPO_DIR, GPT2_PYTHON (the environment's python, which runs the launcher), GPUS_PER_NODE,
# OUT_DIR and TRAIN_ARGS (the trainer's arguments: --out-dir and --num-threads, then the user's "$@",
# then --resume auto on a requeued run); cd to the repository; export the environment.
gpt2_prepare() {
  local arg
  for arg in "$@"; do
    if [[ $arg == --out-dir || $arg == --out-dir=* || $arg == --out_dir* ]]; then
      gpt2_die "do not pass --out-dir to the sbatch script: set OUT_DIR=... instead (it is also where a requeued run looks for its checkpoint)"
    fi
  done
  # sbatch runs a copy of the script from its spool directory, so the repository is found from the
  # submit directory, not from $0.
  REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
  [[ -f $REPO_DIR/train_ddp.py ]] \
    || gpt2_die "no train_ddp.py in '$REPO_DIR': submit from the repository root or set REPO_DIR=/path/to/gpt2-ddp"
  cd "$REPO_DIR" || gpt2_die "cannot cd to $REPO_DIR"
  # sbatch exports the submitting shell's environment, so an activated venv carries over; otherwise
  # VENV=/path/to/venv, or the repository's own .venv.
  if [[ -n ${VENV:-} ]]; then
    # shellcheck disable=SC1091
    source "$VENV/bin/activate" || gpt2_die "cannot activate VENV=$VENV"
  elif [[ -z ${VIRTUAL_ENV:-} && -f .venv/bin/activate ]]; then
    # shellcheck disable=SC1091
    source .venv/bin/activate
  fi
  # The launcher is `$GPT2_PYTHON -m gpt2.launch` (torchrun); exported for srun_task.sh on every node.
  # find_spec rather than importing torch: it answers in milliseconds.
  GPT2_PYTHON=$(command -v python || command -v python3)
  [[ -n $GPT2_PYTHON ]] \
    && "$GPT2_PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)' \
    || gpt2_die "no python with torch (${GPT2_PYTHON:-no python on PATH}): activate the Python environment" \
                "before sbatch, or set VENV=/path/to/venv"
  export GPT2_PYTHON

  GPUS_PER_NODE=$(gpt2_gpus_per_node) || exit 2
  export GPUS_PER_NODE
  # Same job ID after a requeue, so the rerun finds the checkpoints of the first run.
  OUT_DIR=${OUT_DIR:-${OUT_ROOT:-runs}/${SLURM_JOB_NAME:-gpt2}-${SLURM_JOB_ID:-local}}
  mkdir -p "$OUT_DIR" || gpt2_die "cannot create OUT_DIR=$OUT_DIR"
  export OUT_DIR
  GPT2_START_CHECKPOINT=$(gpt2_latest_checkpoint)  # gpt2_finish: did this run make progress?
  # OUT_DIR/requeue says "the last run stopped cleanly"; from now on only this run may say so (the
  # trainer also clears it, but a run killed during start-up would leave the old one).
  rm -f "$OUT_DIR/requeue"

  # Each rank's intra-op threads share the task's CPUs; torchrun would otherwise set 1.
  local cpus=${SLURM_CPUS_PER_TASK:-$(nproc)}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cpus / GPUS_PER_NODE > 0 ? cpus / GPUS_PER_NODE : 1 ))}
  # After forwarding SIGTERM torchrun waits this long for the workers before SIGKILL (default 30 s),
  # too short for a multi-GB checkpoint on a slow shared filesystem: a stop finishes its step, waits
  # for a background checkpoint write in flight and writes its own. Keep it below the --signal lead
  # time (120 s) so the requeue still happens before the time limit. Older torch ignores it (30 s).
  # The rule and a table per preset: docs/multinode.md, "SLURM"; `python -m gpt2.plan` prints a run's numbers.
  export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-90}

  # The trainer's default thread count divides os.cpu_count(), which under SLURM is the whole node's
  # cores, not the --cpus-per-task it was given: pass the allocation's share (a flag in "$@" wins).
  TRAIN_ARGS=(--out-dir "$OUT_DIR" --num-threads "$OMP_NUM_THREADS" "$@")
  if (( ${SLURM_RESTART_COUNT:-0} > 0 )); then
    # Last flag wins: a requeued run continues from its own newest checkpoint even if the first run
    # was started with --resume never or --resume PATH.
    TRAIN_ARGS+=(--resume auto)
  fi
  gpt2_log "job ${SLURM_JOB_ID:-none} (${SLURM_JOB_NAME:-}) restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-$(hostname)}:" \
           "${SLURM_NNODES:-1} node(s) x ${GPUS_PER_NODE} process(es), OMP_NUM_THREADS=${OMP_NUM_THREADS}, OUT_DIR=${OUT_DIR}"
}

# Run "$@" in the background and wait for it, forwarding the first USR1/TERM this shell receives to
# it as signal $1 (once: a second SIGTERM to torchrun aborts its graceful shutdown). Returns the
# command's exit status; sets GPT2_GOT_USR1 / GPT2_GOT_TERM.
gpt2_run_forwarding() {
  GPT2_FORWARD=$1
  shift
  GPT2_GOT_USR1="" GPT2_GOT_TERM="" GPT2_FORWARDED="" GPT2_CHILD=""
  trap 'gpt2_on_signal USR1' USR1
  trap 'gpt2_on_signal TERM' TERM
  if [[ $GPT2_FORWARD == TERM ]]; then
    # The child is torchrun: ignoring USR1 survives exec, and the trainer installs its own handler.
    ( trap '' USR1; exec "$@" ) &
  else
    "$@" &
  fi
  GPT2_CHILD=$!
  if [[ -n $GPT2_GOT_USR1$GPT2_GOT_TERM ]]; then gpt2_forward; fi  # signalled while starting
  # `wait` returns early (status > 128) whenever a trapped signal arrives; wait until the child is
  # gone, then once more: bash remembers the child's exit status.
  while kill -0 "$GPT2_CHILD" 2>/dev/null; do wait "$GPT2_CHILD"; done
  wait "$GPT2_CHILD"
}

gpt2_on_signal() {
  if [[ $1 == USR1 ]]; then GPT2_GOT_USR1=1; else GPT2_GOT_TERM=1; fi
  gpt2_log "got SIG$1"
  gpt2_forward
}

gpt2_forward() {
  [[ -n $GPT2_CHILD && -z $GPT2_FORWARDED ]] || return 0
  GPT2_FORWARDED=1
  gpt2_log "forwarding SIG$GPT2_FORWARD to pid $GPT2_CHILD ($(ps -o comm= -p "$GPT2_CHILD" 2>/dev/null)) so every rank checkpoints and stops"
  kill -s "$GPT2_FORWARD" "$GPT2_CHILD" 2>/dev/null || true
}

# Exit the batch script. Requeue only when all of these hold: this shell got USR1 (the time limit, or
# `scancel --signal=USR1 --batch`); the trainer confirmed a clean stop by writing OUT_DIR/requeue
# after its checkpoint (torchrun's exit code cannot say it: see gpt2/distributed/preempt.py); no SIGTERM came
# too (a job being cancelled can still be requeued while it completes, measured on 22.05, so a
# `scancel` during the stop would be undone); and a requeued run made progress (when start-up takes
# longer than the time before the signal, requeueing would loop forever: measured with --time=1
# --signal=B:USR1@40). A stop that is not requeued exits 3, so the job shows as failed, not done.
gpt2_finish() {
  local rc=$1 latest
  if [[ -z ${GPT2_GOT_USR1:-} || -z ${SLURM_JOB_ID:-} ]]; then
    gpt2_log "launcher exited with $rc"
    exit "$rc"
  fi
  latest=$(gpt2_latest_checkpoint)
  if [[ ! -f $OUT_DIR/requeue ]]; then
    if (( rc == 0 )); then
      gpt2_log "got USR1, but training finished (no $OUT_DIR/requeue): done"
      exit 0
    fi
    gpt2_log "got USR1, but the trainer did not confirm a clean stop (no $OUT_DIR/requeue; launcher exit $rc):" \
             "not requeueing. Resubmit with OUT_DIR=$OUT_DIR to resume from $latest"
    exit "$rc"
  fi
  if [[ -n ${GPT2_GOT_TERM:-} ]]; then
    gpt2_log "stopped on USR1, but a SIGTERM followed (scancel, preemption or the hard time limit):" \
             "not requeueing. Resubmit with OUT_DIR=$OUT_DIR to resume from $latest"
    exit 3
  fi
  if (( ${SLURM_RESTART_COUNT:-0} > 0 )) && [[ $latest == "${GPT2_START_CHECKPOINT:-none}" ]]; then
    gpt2_log "stopped on USR1 with no checkpoint newer than the one this run started from ($latest):" \
             "not requeueing, it would loop without progress. Give the job more time than start-up plus" \
             "the --signal lead (sbatch --time), then resubmit with OUT_DIR=$OUT_DIR"
    exit 3
  fi
  gpt2_log "stopped on USR1, clean stop confirmed by $OUT_DIR/requeue ($(head -c 300 "$OUT_DIR/requeue"));" \
           "requeueing job $SLURM_JOB_ID"
  if scontrol requeue "$SLURM_JOB_ID"; then
    exit 0
  fi
  gpt2_log "scontrol requeue failed (submitted with --no-requeue?); resubmit with OUT_DIR=$OUT_DIR to resume"
  exit 3
}

gpt2_latest_checkpoint() {
  local latest=$OUT_DIR/checkpoints/latest
  if [[ -L $latest ]]; then readlink "$latest"
  elif [[ -f $latest ]]; then head -c 200 "$latest"
  else echo "none"
  fi
}
