"""FSDP2 (`torch.distributed.fsdp.fully_shard`): each rank keeps 1/world_size of every weight,
gradient and optimizer moment, as torchtitan does for its data-parallel dimension.

Each transformer block is its own FSDP unit (its weights are all-gathered just before its forward
and backward and freed after), and the root unit holds the rest: the tied token embedding / LM head,
the position embedding and the final LayerNorm. The tied weight is one parameter of the root unit,
so it is sharded, gathered and reduced once. Parameters become DTensors sharded on dim 0; the
optimizer must be made after shard() so it steps the shards.
"""

from __future__ import annotations

import contextlib

import torch

from gpt2.dist import Dist
from gpt2.model import GPT


def shard(model: GPT, dist: Dist) -> GPT:
    """fully_shard each block, then the root, over all ranks (in place; returns the model)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(dist.device.type, (dist.world_size,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def no_grad_sync(model: torch.nn.Module):
    """Accumulate this micro-step's gradients unsharded, without the reduce-scatter (FSDP2's
    counterpart of DDP's no_sync): the last micro-step reduces the sum once."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def local_norm(norm: torch.Tensor) -> torch.Tensor:
    """clip_grad_norm_ over DTensor gradients returns a (replicated) DTensor: the plain tensor."""
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm
