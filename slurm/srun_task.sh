#!/bin/bash
# One srun task of train_multinode.sbatch: this node's torchrun agent (arguments are torchrun's).
# srun relays the batch shell's USR1 to every process of the step; here it becomes one SIGTERM to
# torchrun, which forwards it to its workers (see common.sh). Exits with torchrun's status.
# torchrun runs as `python -m gpt2.launch` (one line in the log on a stop, not a traceback), with
# the python gpt2_prepare found in the batch shell (srun passes the environment on).
set -uo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
gpt2_run_forwarding TERM "${GPT2_PYTHON:-python}" -m gpt2.launch "$@"
exit $?
