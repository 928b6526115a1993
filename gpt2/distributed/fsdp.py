"""FSDP2 (`torch.distributed.fsdp.fully_shard`): each rank keeps 1/world_size of every weight,
gradient and optimizer moment, as torchtitan does for its data-parallel dimension.

Each transformer block is its own FSDP unit (its weights are all-gathered just before its forward
and backward and freed after), and the root unit holds the rest: the tied token embedding / LM head,
the position embedding and the final LayerNorm. The tied weight is one parameter of the root unit,
so it is sharded, gathered and reduced once. Parameters become DTensors sharded on dim 0; the
optimizer must be made after shard() so it steps the shards.

Every forward of a sharded model is a collective (each unit all-gathers its weights), so anything
that runs the model (evaluation, sampling, HellaSwag) must run on every rank with the same number of
forwards; rank 0 alone would wait forever for the others' share of the weights.
"""

from __future__ import annotations

import contextlib

import torch

from gpt2.core.compat import fsdp_api
from gpt2.core.precision import FLOAT32, Precision
from gpt2.distributed.group import Dist
from gpt2.model.gpt import GPT


def mixed_precision(prec: Precision, device: torch.device):
    """FSDP2's MixedPrecisionPolicy for --dtype on CUDA, or None (fp32 everywhere, or CPU autocast).

    On CUDA with bf16 the gathered weights are cast to bf16 once per unit (param_dtype): the
    all-gather moves half the bytes and the matmuls run in bf16, while the sharded master weights,
    the optimizer and the gradient reduce-scatter stay fp32 (reduce_dtype: a sum of W bf16 gradients
    would lose the low bits of every update). torchtitan's default. The trainer's autocast stays on
    around the forward: ops autocast keeps in fp32 (softmax, log-softmax, the loss) still get fp32.
    On CPU the policy is not used: autocast over fp32 shards computes the same maths as DDP's autocast
    (fp32 weights gathered, bf16 matmuls, fp32 gradients reduced), which is what the 2-rank gloo
    tests compare; the bandwidth a bf16 gather saves matters on GPUs, not in a CPU test.
    float16 never gets here: TrainConfig refuses it with fsdp (see train_config_problems).

    What this policy computes differently from DDP on CUDA (stated here, shown on CPU by emulating the
    policy's casts in tests/test_fsdp.py): every parameter is gathered in bf16, the embedding tables
    and LayerNorm gains too, and each unit's floating inputs are cast to bf16 (cast_forward_inputs).
    So the residual stream is bf16 from the embedding on (wte(idx) + wpe(pos) of bf16 tables), each
    residual add rounds to bf16, and LayerNorm (fp32 under autocast) normalises bf16 inputs with
    bf16-rounded gains. DDP's autocast keeps the residual stream, the embeddings and the gains in fp32
    and rounds only the matmuls' inputs; the matmuls agree (autocast casts DDP's fp32 weights to the
    same bf16 values the gather makes). cast_forward_inputs=False alone would not close the gap: the
    bf16 embedding tables make the stream bf16 anyway. Closing it means gathering the root unit
    (embeddings, ln_f) and the LayerNorms in fp32 (units of their own, or no param_dtype at all: 2x
    the all-gather bytes), with the planner's gathered bytes and autocast copies following. Not done:
    a bf16 residual stream is what torchtitan's FSDP default trains too, and the CPU tests (no policy)
    check fsdp against DDP bitwise, not this.
    """
    api = fsdp_api()  # None on a torch without FSDP2 (only --parallel ddp runs there)
    if api is None or device.type != "cuda" or prec.dtype not in ("bfloat16", "float16"):
        return None
    return api.MixedPrecisionPolicy(param_dtype=prec.torch_dtype, reduce_dtype=torch.float32)


def gathered_param_bytes(prec: Precision, device: torch.device) -> int:
    """Bytes per parameter an all-gather moves: the policy's param_dtype, else the fp32 shards'."""
    policy = mixed_precision(prec, device)
    return 4 if policy is None else torch.empty((), dtype=policy.param_dtype).element_size()


def shard(model: GPT, dist: Dist, prec: Precision = FLOAT32) -> GPT:
    """fully_shard each block, then the root, over all ranks (in place; returns the model)."""
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = fsdp_api().fully_shard  # present: missing_features refused --parallel fsdp before here

    mesh = init_device_mesh(dist.device.type, (dist.world_size,))
    policy = mixed_precision(prec, dist.device)
    kwargs = {"mp_policy": policy} if policy is not None else {}
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    api = fsdp_api()  # None on a torch without FSDP2, where nothing can be sharded
    return api is not None and isinstance(model, api.FSDPModule)


@contextlib.contextmanager
def no_grad_sync(model: torch.nn.Module):
    """Accumulate this micro-step's gradients unsharded, without the reduce-scatter (FSDP2's
    counterpart of DDP's no_sync): the last micro-step reduces the sum once."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


NORM_CHUNK = 1 << 22
"""Elements per fp64 partial sum in grad_norm: bounds the fp64 temporary at 32 MiB per tensor."""


def _locals(grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradients split into (whole tensors, local tensors of FSDP shards (DTensors)): one pass and one
    import per step, not per gradient (the step's host time: _chunks)."""
    from torch.distributed.tensor import DTensor, Replicate

    whole, shards = [], []
    for t in grads:
        if isinstance(t, DTensor):
            assert not any(isinstance(p, Replicate) for p in t.placements), t.placements  # 1-D FSDP mesh: Shard(0)
            shards.append(t.to_local())
        else:
            whole.append(t)
    return whole, shards


def _chunks(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors as grad_norm sums them: a contiguous tensor of at most NORM_CHUNK elements as itself
    (its norm is its flat view's, bit for bit: the reduction runs over the same memory in the same
    order), any other as its flat view's NORM_CHUNK-element chunks. No view ops for the common case:
    GPT-2 124M has 148 gradients, one chunk each but the embedding's; a reshape and a split each, and
    a second pass for the shards, made the clip's host time 3.1 ms against torch's 0.6 (this CPU,
    bench/step_overhead.py), and at micro-batch 12 on an H200 the device waited on the host
    (docs/performance.md, "On a GPU")."""
    out: list[torch.Tensor] = []
    for t in tensors:
        if t.numel() <= NORM_CHUNK and t.is_contiguous():
            out.append(t)
        else:
            out.extend(t.reshape(-1).split(NORM_CHUNK))
    return out


def grad_norm(grads: list[torch.Tensor], dist: Dist) -> torch.Tensor:
    """The global L2 norm of the gradients (fp32 scalar), plain or FSDP-sharded, accumulated in fp64.

    Why not clip_grad_norm_'s own norm: an fp32 norm over a 50304 x n_embd gradient loses ~1e-4 of
    its value on a CPU (measured: the embedding's norm 0.28301 fp32 vs 0.28303 fp64), and it loses it
    differently over a shard than over the whole tensor, so DDP and FSDP would clip by and log norms
    1e-4 apart. Squares summed in fp64 (chunks of NORM_CHUNK) are exact to ~1e-12, so the norm no
    longer depends on how the gradient is split. Under FSDP each rank sums its shards' squares
    (shards are disjoint and unpadded in to_local) and one all-reduce adds them; DDP's gradients are
    whole and equal on every rank, so no communication.

    One torch._foreach_norm over every chunk (fp64 out, so fp64 accumulation: CUDA's multi-tensor
    kernel casts each element as it loads it) instead of one norm kernel, one square and one add
    per tensor: a handful of launches instead of hundreds. On a CPU _foreach_norm is the same
    vector_norm per chunk, whose fp64 temporaries NORM_CHUNK still bounds. The squares are summed
    in chunk order (a left fold, as the per-tensor loop did) by cumsum's last element, so a model
    whose tensors are one chunk each gets bitwise the old sum; a larger one differs from it by the
    fp64 rounding of a re-associated sum (~1e-16 relative), far below the fp32 result's last bit.
    """
    return _norm_of(*_locals(grads), dist, grads[0].device if grads else dist.device)


def _norm_of(whole: list[torch.Tensor], shards: list[torch.Tensor], dist: Dist, device: torch.device) -> torch.Tensor:
    from gpt2.distributed.group import all_reduce_sum

    # Only the kinds present are summed (x + 0 is x bitwise): plain DDP gradients launch no zeros and no
    # add for the shards they do not have (the step's launches: bench/step_overhead.py).
    total = _sum_of_squares(_chunks(whole), device) if whole or not shards else None
    if shards:
        sharded = _sum_of_squares(_chunks(shards), device)
        if dist.is_distributed:
            all_reduce_sum(sharded, dist)
        total = sharded if total is None else total + sharded
    return total.sqrt().float()


def _sum_of_squares(chunks: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of the chunks' squared L2 norms, fp64, in chunk order (grad_norm's docstring)."""
    if not chunks:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(chunks, 2, dtype=torch.float64)
    return torch.stack(norms).square().cumsum(0)[-1]


@torch.no_grad()
def clip_grad_norm(params, max_norm: float, dist: Dist) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for plain or FSDP-sharded gradients, with grad_norm's norm:
    every gradient (every shard, on every rank) is scaled by the same min(1, max_norm / (norm + 1e-6)),
    in one _foreach_mul_ (the shards in place: to_local() is a view of each). Returns the norm before
    clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    whole, shards = _locals(grads)
    norm = _norm_of(whole, shards, dist, grads[0].device if grads else dist.device)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # clip_grad_norm_'s formula
    if grads:
        torch._foreach_mul_(whole + shards, coef)
    return norm
