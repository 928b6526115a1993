"""torchrun without the traceback on a stop signal: `python -m gpt2.launch TORCHRUN_ARGS...`.

torchrun's agent turns SIGTERM (and SIGINT, SIGHUP, SIGQUIT) into a SignalException, shuts its
workers down (forwarding the signal, then SIGKILL after TORCH_ELASTIC_SHUTDOWN_TIMEOUT), and
re-raises it out of torch.distributed.run.main as a 30-line traceback. The slurm/ scripts stop every
preempted or timed-out job that way, so each checkpointed stop would read like a crash in the job
log. This prints one line instead and exits with the status torchrun exits with when signalled (1,
the status of an uncaught exception; see gpt2/dist/preempt.py), so nothing that goes by the status
changes. Everything else (arguments, output, failures and their exit codes) is torchrun's.
"""

from __future__ import annotations

import os
import signal
import sys

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.run import main as torchrun_main

EXIT_SIGNALLED = 1
"""torchrun's exit status when it is the process signalled: the scripts go by OUT_DIR/requeue instead."""


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        out_dir = os.environ.get("OUT_DIR", "OUT_DIR")
        print(f"torchrun: stopped by {name}; its workers were asked to stop and have exited "
              f"(a checkpointed stop leaves {out_dir}/requeue)", file=sys.stderr, flush=True)
        return EXIT_SIGNALLED
    return 0


if __name__ == "__main__":
    sys.exit(main())
