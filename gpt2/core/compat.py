"""The torch releases this project supports, and the one place where they differ.

A cluster keeps the torch its image or module has, so the code runs on every release from
TORCH_FLOOR to the newest (CI runs a compatibility subset on the floor and the newest). Where
releases differ, the code asks whether the function or argument exists, never compares version
strings: a backport or a nightly then does the right thing. The release named beside each
capability (FIRST_RELEASE) is documentation only, for the error a user reads.

Features that need more than the floor (`--optimizer muon`, `--parallel fsdp`) are refused with one
line naming the torch that is installed and the one the feature needs (missing_features), before any
process group starts; everything else works alike on every supported release.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import types

import torch
import torch.distributed as tdist

TORCH_FLOOR = "2.5"
"""The oldest torch release tested: scaled_dot_product_attention's enable_gqa (the model) is from 2.5."""

FIRST_RELEASE = {
    "muon": "2.9",  # torch.optim.Muon, whose parameter groups, state and update gpt2/train/muon.py keeps
    "fsdp": "2.6",  # torch.distributed.fsdp.fully_shard (FSDP2) public, with DTensor's src_data_rank
}
"""The first torch release with each optional feature's capability (for messages, never compared)."""


def torch_version() -> str:
    return torch.__version__.split("+")[0]


@functools.cache
def _has_param(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def ddp_no_buffer_sync() -> dict:
    """DDP's keyword that turns off the buffer broadcast before every forward (the weights and
    buffers are still synced once, at construction). torch 2.13 renamed it forward_sync_buffers and
    deprecated broadcast_buffers; older releases know only broadcast_buffers."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if _has_param(DDP.__init__, "forward_sync_buffers"):
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def all_gather_into(output: torch.Tensor, local: torch.Tensor) -> None:
    """Every rank's `local`, concatenated in rank order, into `output` (world x its size): torch
    2.13's all_gather_single, all_gather_into_tensor before it."""
    gather = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
    gather(output, local)


def set_default_timeout(timeout: datetime.timedelta) -> None:
    """The default process group's collective timeout from now on: torch.distributed.set_timeout
    where it exists (torch 2.15 deprecates the private _set_pg_timeout with a FutureWarning)."""
    public = getattr(tdist, "set_timeout", None)
    if public is not None:
        public(timeout)
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout  # what torchtitan uses after step 1

    _set_pg_timeout(timeout)


def fsdp_api() -> types.SimpleNamespace | None:
    """FSDP2's fully_shard, FSDPModule and MixedPrecisionPolicy, or None before they were public.

    torch 2.5 has a private FSDP2 (torch.distributed._composable.fsdp), not used: it requires CUDA
    ("FSDP requires CUDA for streams"), so it could not be tested on the CPU like every other path."""
    try:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    except ImportError:
        return None
    return types.SimpleNamespace(
        fully_shard=fully_shard, FSDPModule=FSDPModule, MixedPrecisionPolicy=MixedPrecisionPolicy
    )


def has_muon() -> bool:
    """torch.optim.Muon, whose groups, state format and update gpt2/train/muon.py subclasses."""
    if not hasattr(torch.optim, "Muon"):
        return False
    try:
        from torch.optim._muon import _adjust_lr  # noqa: F401  (the shape-adjusted lr gpt2/train/muon.py applies)
    except ImportError:
        return False
    return True


def feature_available(feature: str) -> bool:
    if feature == "muon":
        return has_muon()
    if feature == "fsdp":
        return fsdp_api() is not None
    raise KeyError(feature)


def missing_features(*, optimizer: str, parallel: str) -> list[str]:
    """One line for each asked-for feature this torch lacks: what needs it, the release that has it,
    and what to do instead."""
    asked = {
        "muon": ("--optimizer muon", optimizer == "muon", "use --optimizer adamw"),
        "fsdp": ("--parallel fsdp", parallel == "fsdp", "use --parallel ddp"),
    }
    return [
        f"{flag} needs torch >= {FIRST_RELEASE[feature]} ({_what(feature)}); this is torch {torch_version()}: "
        f"install a newer torch, or {instead}"
        for feature, (flag, wanted, instead) in asked.items()
        if wanted and not feature_available(feature)
    ]


def _what(feature: str) -> str:
    return {"muon": "torch.optim.Muon", "fsdp": "torch.distributed.fsdp.fully_shard"}[feature]


def inductor_deterministic() -> bool:
    """Turn on inductor's deterministic mode (no on-device benchmarking that changes numerics), where
    this torch's inductor has it (torch._inductor.config.deterministic, pytorch PR 163589 of autumn 2025;
    later releases also turn it on with torch.use_deterministic_algorithms); whether it did."""
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "deterministic"):
        return False
    inductor_config.deterministic = True
    return True


def inductor_deterministic_mode() -> bool | None:
    """Whether inductor's deterministic mode is on; None where this torch's inductor has none."""
    import torch._inductor.config as inductor_config

    return getattr(inductor_config, "deterministic", None)


def enable_compile_caches() -> list[str]:
    """Turn on inductor's FX graph cache and the AOT autograd cache where this torch has them (on by
    default in recent releases; a person's TORCHINDUCTOR_*_CACHE=0 is overridden only by this run's
    --compile-cache, which asked for them); the names of those turned on."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    on = []
    for config, name in ((inductor_config, "fx_graph_cache"), (functorch_config, "enable_autograd_cache")):
        if hasattr(config, name):
            setattr(config, name, True)
            on.append(name)
    return on


def default_store():
    """The default process group's key-value store (torchrun's TCPStore, under its prefixes): reachable
    while a peer hangs, since the torchrun agent serves it. torch has no public accessor for it."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def flight_recorder_vars(entries: int, dump_prefix: str) -> dict:
    """NCCL Flight Recorder's environment: a trace buffer of `entries` collectives, a dump on a
    collective timeout, written to `dump_prefix`<rank>. Older releases read only the
    TORCH_NCCL_* names (torch 2.5's Flight Recorder tutorial); newer ones read TORCH_FR_BUFFER_SIZE /
    TORCH_FR_DUMP_TEMP_FILE first and fall
    back to the TORCH_NCCL_* names (torch 2.13's libtorch has both). Both are set: an environment
    variable a release does not read costs nothing, and asking which it reads would mean a version test."""
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(entries),
        "TORCH_FR_BUFFER_SIZE": str(entries),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump_prefix,
        "TORCH_FR_DUMP_TEMP_FILE": dump_prefix,
    }
