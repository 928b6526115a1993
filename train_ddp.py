"""Train GPT-2 on one process or many.

    torchrun --standalone --nproc_per_node=8 train_ddp.py --preset gpt2 --data-dir DIR --out-dir RUN
    python train_ddp.py --preset debug --data-dir DIR --out-dir RUN --device cpu
    python train_ddp.py --preset gpt2 --data-dir DIR --out-dir RUN --dry-run --world-size 32 --gpu A100-40GB

Exit codes:
    0  done; or, under torchrun, stopped by SIGTERM/SIGUSR1 after a checkpoint (see below)
    1  failed (a crash, non-finite losses, a collective timeout: a dead or hung peer)
    2  bad configuration, data or checkpoint, or a run directory another run holds (nothing was trained)
    3  stopped by SIGTERM/SIGUSR1 after writing a checkpoint, without torchrun: requeue, then
       --resume auto continues exactly
Under torchrun a stopped worker exits 0, not 3: torchrun turns any non-zero worker exit into its
own exit 1, and with --max-restarts it would restart the group into a new run rather than stop.
Whether launched by torchrun or not, a stop leaves RUN/requeue next to the checkpoint, and a batch
script requeues when that file exists (gpt2/distributed/preempt.py's docstring has the whole contract).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    return run(argv)[0]


def run(argv: list[str] | None = None) -> tuple[int, bool]:
    """main's work: its exit code, and whether this process started a process group (exit_rank)."""
    cfg, rehearsal = flags_first(argv)
    if rehearsal is not None:
        return dry_run(cfg, rehearsal), False
    from gpt2.distributed.group import setup, teardown, world_from_env
    from gpt2.distributed.preempt import EXIT_REQUEUE, stop_exit_code
    from gpt2.train.startup import run_guards, start
    from gpt2.train.trainer import train

    dist, agreed = None, False  # agreed: every rank ends the same way (teardown's barrier)
    try:
        info = world_from_env()
        try:  # everything a user can get wrong is checked before the process group starts
            device, shards = preflight(cfg, info)
        except ValueError as e:  # ShardError is one too
            return refuse_before_group(e, info), False  # no process group yet
        dist = setup(info, device, cfg.train.distributed.dist_timeout_s)
        with run_guards(cfg.train.ckpt.out_dir, dist) as stop_request:  # signals, the run directory's lock, hang dumps
            run = start(cfg, dist, shards=shards, stop_request=stop_request)  # from the config to the first step
            code = 0 if run is None else train(run)  # None: finished already (the quick start run a second time)
        agreed = True
        return (stop_exit_code() if code == EXIT_REQUEUE else code), True
    except Exception as e:
        failure = failure_of(e, cfg, dist)
        if failure is None:  # not one of ours: the traceback says more than a line would
            raise
        code, agreed, line = failure
        if line is not None:
            print(f"train_ddp.py: error: {line}", file=sys.stderr)
        return code, dist is not None
    finally:
        teardown(dist, agreed=agreed)


def flags_first(argv: list[str] | None):
    """The RunConfig and --dry-run's target from argv, before torch's import: a typo is one line at once, not
    after seconds (~25 s seen on a loaded machine); exits 2 with a message on bad flags or values. First of all,
    under torchrun, this worker stops (with a checkpoint) when the agent that started it dies."""
    import os

    launcher = os.getppid()
    from gpt2.distributed.preempt import stop_with_launcher

    stop_with_launcher(launcher)
    from gpt2.train.cli import parse_command

    return parse_command(argv)


def preflight(cfg, info):
    """The checks before the process group starts, (device, shards) or a ValueError: --deterministic (before
    CUDA's first use: cuBLAS reads its workspace setting then), the device, the data; and NCCL's Flight Recorder
    settings, which it reads when the group starts."""
    from gpt2.distributed.group import resolve_device
    from gpt2.train.startup import check_data

    if cfg.train.compute.deterministic:
        from gpt2.core import determinism

        determinism.enable()
    device = resolve_device(cfg.train.compute.device, info.local_rank)
    shards = check_data(cfg.train, cfg.model.block_size, info.world_size)
    if info.world_size > 1:
        from gpt2.distributed.hang import flight_recorder_env

        flight_recorder_env(cfg.train.ckpt.out_dir, device.type)
    return device, shards


def failure_of(e: Exception, cfg, dist) -> tuple[int, bool, str | None] | None:
    """An exception that ended the run -> (exit code, agreed, its one line or None for none): the first row of
    failure_table() it matches, or None (not one of ours: raised as it is). Agreed: every rank raised it alike
    (only rank 0 says it); not agreed: this rank failed alone, and its exit ends its peers' next collective."""
    rank = dist.rank if dist is not None else "?"
    for kinds, code, agreed, when, line in failure_table():
        if isinstance(e, kinds) and when(e):
            said = line(e, rank, cfg, dist)
            return code, agreed, said if (not agreed or dist is None or dist.is_main) else None
    return None


def failure_table() -> list[tuple]:
    """The exit codes (module docstring) by exception, first match wins: (types, code, agreed, when, line)."""
    from torch.distributed import DistError

    from gpt2.ckpt.writer import CheckpointWriteError
    from gpt2.distributed.group import CollectiveError, compile_failure_message, is_compile_failure
    from gpt2.train.spike_guard import SpikeGuardError
    from gpt2.train.trainer import NonFiniteError

    def always(_):
        return True

    def said(e, rank, cfg, dist):
        return str(e)

    def compile_failed(e, rank, cfg, dist):
        return f"rank {rank}: {compile_failure_message(e)}"

    def run_dir(e, rank, cfg, dist):
        return run_dir_failure(e, cfg, dist)

    return [
        # found after start-up alike on every rank (a CheckpointError, a model that does not fit)
        (ValueError, 2, True, always, said),
        ((NonFiniteError, SpikeGuardError, CheckpointWriteError), 1, True, always, said),
        # a peer died (connection closed) or hangs (--dist-timeout-s expired): saying so beats a bare traceback
        ((CollectiveError, DistError), 1, False, always, collective_failure),
        # rank 0 writing into RUN after it became read-only, full or forbidden mid-run: one line, not the error
        # chained to the lock's removal
        (OSError, 1, False, lambda e: e.errno is not None, run_dir),
        # a rank on a node without the compiler fails alone; its peers wait in their first collective until then
        (RuntimeError, 1, False, is_compile_failure, compile_failed),
    ]


def collective_failure(e, rank, cfg, dist) -> str:
    d = cfg.train.distributed
    return (
        f"rank {rank}: a collective operation failed ({(str(e).splitlines() or [type(e).__name__])[0]}); another "
        f"rank died, or did not answer within --dist-step-timeout-s {d.dist_step_timeout_s:g} (steady training) or "
        f"--dist-timeout-s {d.dist_timeout_s:g} (start-up, checkpoints, evaluation): its own log says why. "
        "Restarting (torchrun --max-restarts, a requeue) with --resume auto continues from the newest checkpoint"
    )


PEER_REFUSAL_GRACE_S = 20.0
"""How long a rank other than 0 that refuses before the process group waits for its launcher to end it."""


def refuse_before_group(e: ValueError, info) -> int:
    """A refusal found before the process group starts (a device, the data): exit 2 with one line, rank 0's.

    Every rank checks the same flags and files, so rank 0 finds the same problem and says it. A rank other
    than 0 waits for the launcher to end it when rank 0 exits (torchrun stops the other workers at the first
    failure): exiting at once let torchrun stop rank 0 before it had written its line, and the job said
    nothing (seen on a loaded 2-core machine). A rank whose problem is its own (a node that lacks the data)
    says it, with its rank, after PEER_REFUSAL_GRACE_S, while rank 0 waits for it at the group's start."""
    if info.rank != 0:
        import time

        time.sleep(PEER_REFUSAL_GRACE_S)
        print(f"train_ddp.py: error: rank {info.rank}: {e}", file=sys.stderr)
        return 2
    print(f"train_ddp.py: error: {e}", file=sys.stderr)
    return 2


def run_dir_failure(e: OSError, cfg, dist) -> str:
    """An OSError of the run in one line: the file and the system's words, what to do, and whether
    RUN/run.lock stays behind (a read-only RUN: the next start takes it over, its holder having exited)."""
    from pathlib import Path

    from gpt2.ckpt.rundir import LOCK

    out_dir = cfg.train.ckpt.out_dir
    rank = dist.rank if dist is not None else "?"
    lock = Path(out_dir) / LOCK
    stays = f"; {lock} could not be removed: the next start takes it over" if lock.exists() else ""
    return (
        f"rank {rank}: {e.filename or out_dir}: {e.strerror or e}; make --out-dir {out_dir} writable (or free "
        f"space) and rerun with --resume auto: it continues from the newest checkpoint{stays}"
    )


def dry_run(cfg, rehearsal) -> int:
    """--dry-run (gpt2/train/dryrun.py): 0, or 2 with the one-line error a real run would stop with."""
    from gpt2.distributed.group import world_from_env
    from gpt2.train.dryrun import rehearse

    main_rank = world_from_env().rank == 0  # under torchrun every rank rehearses, rank 0 prints
    try:
        return rehearse(cfg, rehearsal, out=print if main_rank else (lambda *_: None))
    except ValueError as e:  # ShardError and CheckpointError are ValueErrors too
        if main_rank:
            print(f"train_ddp.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    outcome = run()  # first: a flag's typo is reported before torch is imported
    from gpt2.distributed.group import exit_rank

    exit_rank(*outcome)
