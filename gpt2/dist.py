"""Distributed state: the only module that reads RANK / LOCAL_RANK / WORLD_SIZE.

`Dist` is made once in main() and passed explicitly to everything that needs it.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist


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
    info = WorldInfo(rank=int(env.get("RANK", 0)), local_rank=int(env.get("LOCAL_RANK", 0)),
                     world_size=world_size, local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)))
    if not (0 <= info.rank < info.world_size and 0 <= info.local_rank < info.local_world_size):
        raise ValueError(f"inconsistent launcher environment {info}; launch with torchrun or plain python")
    return info


def resolve_device(preference: str, local_rank: int) -> torch.device:
    """auto -> cuda:LOCAL_RANK when CUDA is present, else cpu."""
    if preference == "auto":
        preference = "cuda" if torch.cuda.is_available() else "cpu"
    if preference == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda but no CUDA device is visible; use --device cpu or auto")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices; "
                             "set --nproc_per_node to the number of GPUs")
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

    @property
    def device_type(self) -> str:
        return self.device.type


def setup(info: WorldInfo, device: torch.device, timeout_s: float) -> Dist:
    """Start the process group (NCCL on CUDA, gloo on CPU) when there is more than one rank."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if info.world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        store = _restart_store(os.environ, timeout)
        kwargs = {} if store is None else {"store": store, "rank": info.rank, "world_size": info.world_size}
        tdist.init_process_group(backend=backend, timeout=timeout,
                                 device_id=device if device.type == "cuda" else None, **kwargs)
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
        from torch.distributed.distributed_c10d import _set_pg_timeout  # what torchtitan uses after step 1

        _set_pg_timeout(datetime.timedelta(seconds=seconds))


def teardown(dist: Dist | None) -> None:
    if dist is not None and dist.is_distributed and tdist.is_initialized():
        tdist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, dist: Dist) -> torch.Tensor:
    if dist.is_distributed:
        tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
    return t


def all_reduce_mean(t: torch.Tensor, dist: Dist) -> torch.Tensor:
    return all_reduce_sum(t, dist).div_(dist.world_size) if dist.is_distributed else t


def barrier(dist: Dist) -> None:
    if dist.is_distributed:
        tdist.barrier()


def all_gather_object(obj, dist: Dist) -> list:
    if not dist.is_distributed:
        return [obj]
    out = [None] * dist.world_size
    tdist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, dist: Dist):
    """Rank 0's obj on every rank."""
    if not dist.is_distributed:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]
