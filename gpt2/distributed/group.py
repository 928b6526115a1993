"""Distributed state: the only module that reads RANK / LOCAL_RANK / WORLD_SIZE.

`Dist` is made once in main() and passed explicitly to everything that needs it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as tdist

from gpt2.core.compat import set_default_timeout

T = TypeVar("T")


class CollectiveError(RuntimeError):
    """A collective operation failed: a peer died, or did not answer within the group's timeout."""


class CollectiveTrace:
    """The last collective this process entered (its name and sequence number) and whether it came
    back: what a hang dump (gpt2/distributed/hang.py) says of each rank. Every rank enters the same
    collectives in the same order, so equal sequence numbers mean the same operation on every rank,
    and a rank whose number is lower never arrived. Two assignments per collective: nothing to measure.

    on_failure: called with the failing collective's error before it is raised as a CollectiveError
    (the hang dump, when a run has installed one), so that every failure path dumps, the gradient
    all-reduce inside backward included."""

    def __init__(self) -> None:
        self.seq, self.name, self.done = 0, "", True
        self.on_failure = None

    def enter(self, what: str) -> None:
        self.seq, self.name, self.done = self.seq + 1, what, False


TRACE = CollectiveTrace()
"""This process's collective trace: one per process, as the default process group is."""


@contextlib.contextmanager
def collective(what: str):
    """Inside: process-group operations only, so a RuntimeError raised here is the group failing.

    gloo reports a dead peer ("Connection closed by peer") or an expired timeout as a plain
    RuntimeError, and NCCL as torch.distributed.DistBackendError (a RuntimeError): both become a
    CollectiveError here, where the operation is known, rather than by reading the message later.
    Out-of-memory is not a collective failure and passes through, nor is torch.compile failing
    (is_compile_failure): a DDP run's first forward and backward compile inside a collective's
    context (the bucket-settling step, the first gradient all-reduce), and a missing compiler
    reported as "another rank died" sent users to the wrong place.

    Each entry is recorded in TRACE (name, sequence number); a failure calls TRACE.on_failure first.
    """
    TRACE.enter(what)
    try:
        yield
    except (CollectiveError, torch.OutOfMemoryError):
        raise
    except RuntimeError as e:
        if is_compile_failure(e):
            raise
        if TRACE.on_failure is not None:
            TRACE.on_failure(e)
        first = str(e).splitlines()[0] if str(e) else ""
        raise CollectiveError(f"{what} failed ({type(e).__name__}: {first})") from e
    TRACE.done = True


def is_compile_failure(e: BaseException) -> bool:
    """Whether e is torch.compile failing to build its kernels (dynamo's backend; inductor: a C++
    compiler on a CPU, Triton and ptxas on CUDA), not the code it compiles: InductorError and other
    backend failures are BackendCompilerFailed; inductor's own errors are raised from its modules."""
    from torch._dynamo.exc import BackendCompilerFailed

    return isinstance(e, BackendCompilerFailed) or type(e).__module__.startswith("torch._inductor")


def compile_failure_message(e: BaseException) -> str:
    """The one line train_ddp.py prints for a compile failure: what failed and the fix."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return (
        f"torch.compile could not build the model's kernels ({first}): its compiler toolchain is missing or "
        "broken (inductor needs a working C++ compiler on a CPU, Triton and ptxas on CUDA). Fix it, or train "
        "uncompiled with --compile false"
    )


@dataclass(frozen=True)
class WorldInfo:
    """What torchrun (or SLURM through torchrun) told this process, before any process group."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int


def world_from_env(env=None) -> WorldInfo:
    env = os.environ if env is None else env
    world_size = int(env.get("WORLD_SIZE", 1))
    info = WorldInfo(
        rank=int(env.get("RANK", 0)),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        world_size=world_size,
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
    )
    if not (0 <= info.rank < info.world_size and 0 <= info.local_rank < info.local_world_size):
        raise ValueError(f"inconsistent launcher environment {info}; launch with torchrun or plain python")
    return info


def resolve_device(preference: str, local_rank: int) -> torch.device:
    """auto -> the CUDA device of this rank when CUDA is present, else cpu.

    This rank's device is cuda:LOCAL_RANK when the process sees the node's GPUs (torchrun), and the
    one visible GPU, cuda:0, whatever LOCAL_RANK is, when the scheduler gave each task its own
    through CUDA_VISIBLE_DEVICES (`srun --gpus-per-task=1`: every task sees one device). Refused only
    where several are visible and LOCAL_RANK has none of its own."""
    if preference == "auto":
        preference = "cuda" if torch.cuda.is_available() else "cpu"
    if preference == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda but no CUDA device is visible; use --device cpu or auto")
        count = torch.cuda.device_count()
        if count == 1:
            return torch.device("cuda", 0)
        if local_rank >= count:
            raise ValueError(
                f"LOCAL_RANK={local_rank} but only {count} CUDA devices are visible; "
                "set --nproc_per_node to the number of GPUs"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def single_process(device: torch.device | str = "cpu") -> Dist:
    """The Dist of one process without a process group (benchmarks, tests, rehearsals): rank 0 of 1."""
    return Dist(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device(device))


def setup(info: WorldInfo, device: torch.device, timeout_s: float) -> Dist:
    """Start the process group (NCCL on CUDA, gloo on CPU) when there is more than one rank."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if info.world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        store = _restart_store(os.environ, timeout)
        kwargs = {} if store is None else {"store": store, "rank": info.rank, "world_size": info.world_size}
        with collective("joining the process group"):
            tdist.init_process_group(
                backend=backend, timeout=timeout, device_id=device if device.type == "cuda" else None, **kwargs
            )
    return Dist(info.rank, info.local_rank, info.world_size, info.local_world_size, device)


def _restart_store(env, timeout: datetime.timedelta):
    """torchrun's store seen under a prefix of this restart round's own, or None outside torchrun.

    torchrun (torch 2.13) keeps one store for all the rounds of --max-restarts, so the workers of a
    restarted group read the dead group's addresses from it and fail ("Gloo connectFullMesh failed
    ... Connection refused"). A prefix per TORCHELASTIC_RESTART_COUNT keeps the rounds apart.
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = tdist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
    return tdist.PrefixStore(f"gpt2/restart_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def set_timeout(dist: Dist, seconds: float) -> None:
    """Change the default group's collective timeout from now on (local: no collective).

    Each rank calls it at the same point of the run, so ranks agree on the phase they are in.
    """
    if dist.is_distributed:
        set_default_timeout(datetime.timedelta(seconds=seconds))


def set_cpu_threads(dist: Dist, num_threads: int = 0) -> None:
    """On a CPU: num_threads torch threads, or (0) an equal share of the CPUs this process may use.

    The ranks of a node share its cores (torchrun alone gives each worker 1 thread). The CPUs are
    those of this process's affinity mask (a SLURM or taskset allocation), not the whole node's.
    The trainer and gpt2.eval both follow this one rule.
    """
    if dist.device.type == "cpu":
        torch.set_num_threads(num_threads or max(1, usable_cpus() // dist.local_world_size))


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (a SLURM or taskset allocation), not the node's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def compile_threads(cpus: int, local_world_size: int) -> int:
    """torch.compile workers for one rank: the node's usable CPUs shared among its local ranks, at least 1.

    inductor starts min(32, CPUs) compile workers in every process by default: 8 ranks of a
    32-core node would start 256, all compiling at once, and each also receives the signals a
    launcher relays to the process group (srun).
    """
    return max(1, cpus // max(1, local_world_size))


def set_compile_threads(dist: Dist) -> int:
    """Bound inductor's compile workers to this rank's share of the node (before the first compile).

    Set on torch._inductor.config, which inductor reads when it creates its worker pool (the first
    compilation), not TORCHINDUCTOR_COMPILE_THREADS: that variable is read once, when
    torch._inductor.config is first imported, which may already have happened.
    """
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = compile_threads(usable_cpus(), dist.local_world_size)
    return inductor_config.compile_threads


def teardown(dist: Dist | None, *, agreed: bool = False) -> None:
    """Destroy the process group. agreed: every rank is known to get here (a normal end, or an error
    every rank raised alike after a collective): the ranks first meet at a barrier, so no rank tears
    its connections down while a peer is still inside a collective, and the group's last work holds
    no tensors (an fsdp run's final sharded save ends in an all_gather_object; DDP's save already
    ends in a barrier). Not agreed (a peer died, a collective failed, an error on one rank): no
    barrier, which would only wait out the timeout for a rank that never comes. A barrier that
    fails (a peer gone since) changes nothing: the group is destroyed either way.

    Known remainder (torch 2.13 + Python 3.11, gloo): "terminate called without an active exception"
    at exit is a gloo worker thread (ProcessGroupGloo::runLoop) still destroying a finished
    all-gather whose tensors Python already dropped: their release needs the GIL, and a thread
    that asks for the GIL while the interpreter finalizes is ended by pthread_exit through C++
    frames that may not unwind (std::terminate). destroy_process_group does not join those threads
    (ProcessGroupGloo has no shutdown of its own), and barriers do not order it: a standalone
    fully_shard + dcp.save + all_gather_object + destroy aborted in 4 of 30 runs without a barrier,
    4 of 30 with one and 7 of 30 with two (core dump read with gdb). exit_after_group (below) is
    what prevents it: the entry point leaves without finalizing the interpreter.
    """
    if dist is None or not dist.is_distributed or not tdist.is_initialized():
        return
    if agreed:
        try:
            tdist.barrier()
        except RuntimeError:  # a peer that left after the collective that made us agree: nothing to wait for
            pass
    tdist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, dist: Dist, what: str = "all_reduce") -> torch.Tensor:
    if dist.is_distributed:
        with collective(what):
            tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
    return t


def barrier(dist: Dist) -> None:
    if dist.is_distributed:
        with collective("barrier"):
            tdist.barrier()


def all_gather_object(obj, dist: Dist) -> list:
    if not dist.is_distributed:
        return [obj]
    out = [None] * dist.world_size
    with collective("all_gather_object"):
        tdist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, dist: Dist):
    """Rank 0's obj on every rank."""
    if not dist.is_distributed:
        return obj
    box = [obj]
    with collective("broadcast_object"):
        tdist.broadcast_object_list(box, src=0)
    return box[0]


def rank0_decides(decide: Callable[[], T], dist: Dist, *, errors: tuple[type[Exception], ...] = ()) -> T:
    """Rank 0 runs decide() and every rank returns its value: "rank 0 decides, then broadcasts", written once.

    An exception of `errors` that decide() raises is raised on every rank instead (the same type and message),
    so no rank goes on alone and none waits in a collective for a rank that has failed. decide() must let
    nothing else escape: rank 0 would die before the broadcast the others wait in (until the timeout). Other
    ranks never call decide()."""
    outcome = None
    if dist.is_main:
        try:
            outcome = (None, decide())
        except errors as e:
            outcome = (e, None)  # rank 0 raises e itself, its traceback kept; the others an unpickled copy
    error, value = broadcast_object(outcome, dist)
    if error is not None:
        raise error
    return value


def exit_rank(code: int, grouped: bool) -> None:
    """A command's exit under torchrun or alone (train_ddp.py, gpt2.eval). grouped: this process
    started a process group, so gloo's threads may be live: exit_after_group. Without one (an error
    found before the group starts, which every rank finds alike and rank 0 prints) the interpreter
    exits normally: os._exit's faster exit let a silent rank 1 end first, and torchrun stopped rank 0
    before it printed the error (seen once under load in CI's test_cli)."""
    import sys

    if not grouped:
        sys.exit(code)
    try:
        world = world_from_env()
    except ValueError:
        sys.exit(code)
    exit_after_group(code, world)


def exit_after_group(code: int, info: WorldInfo) -> None:
    """End a rank of a multi-rank run with code, skipping the interpreter's finalization (os._exit).

    gloo's worker threads outlive destroy_process_group and may still be releasing a finished
    collective's tensors, which takes the GIL: a thread asking for it while Python finalizes is
    ended by pthread_exit through frames that cannot unwind, and the rank aborts with "terminate
    called without an active exception" (teardown's docstring has the measurement). Everything a
    run writes is closed or fsynced before here (metrics, W&B, checkpoints, RUN/requeue); only
    stdout and stderr are still buffered, so they are flushed first. One process (no group) exits
    normally.
    """
    import sys

    if info.world_size > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
