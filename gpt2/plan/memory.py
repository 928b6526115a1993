"""Bytes per device of a training run, by what holds them.

Memory is per GPU, counted from what this code base actually keeps alive (checked against the
CPU allocator in tests/test_plan.py):
  weights      fp32 master parameters, 4N bytes; under bf16 autocast also the bf16 copy of every
               matmul weight, which autocast makes once per forward and autograd saves for backward
  gradients    fp32, 4N; DDP's all-reduce buckets add nothing: the trainer passes
               gradient_as_bucket_view=True, so the gradients are views into the buckets
  optimizer    AdamW's two fp32 moments, 8N; with Muon (--optimizer muon) one fp32 momentum buffer
               for each block matrix (4 bytes each) and AdamW's 8 bytes for everything else
  activations  what autograd saves for backward in the embeddings, blocks and final LayerNorm;
               "explicit" attention also saves the (B, nh, T, T) attention probabilities, fused
               SDPA kernels ("flash") save only q, k, v, the output and a log-sum-exp; with activation
               checkpointing (--activation-checkpointing full) each block saves only its fp32 input and
               one block's activations are alive at a time, while it is recomputed in the backward
  logits       the LM head + loss peak, for the loss path the run uses (--loss-impl, choose_loss_impl)
               and its compilation, as training calls it (`model(x, y, return_logits=False)`: no logits
               returned and kept): chunked, one chunk of rows' buffers, allocated once per micro-step and
               reused (gpt2/model/loss.py); full, eager, 12 bytes per logit (cross-entropy's fp32
               log-probabilities and, in its backward, two fp32 gradients); full, compiled, the logits in
               the matmul dtype with their gradient written over them on a CPU, beside them counted on CUDA
               (COMPILED_FULL_LOSS_BYTES); chunked, compiled, as eager (one opaque op to the compiler);
               --fp8-head, the full loss with the e5m2 copies of its gradient (FP8_COPY_BYTES; eager, under
               the loss's own 12 bytes per logit). loss_bytes counts each.
  last block's backward
               on a CPU without activation checkpointing, where the loss's peak is the smaller: the last block's
               backward transients beside every block's activations (block_backward_bytes); a narrow model at a
               large micro-batch (the debug preset at 1,024 x 128 tokens). Not counted on CUDA (not measured there).
The total is the step's peak within the plan's error (PLAN_ERROR, the margin --micro-batch-size auto
keeps): measured against the CPU process's resident peak over a grid of widths, micro-batches, loss
paths and compilation (tests/test_memory_plan.py). Gradients are counted in full although, with
zero_grad(set_to_none=True) and one micro-step, they are allocated while activations are freed.

--parallel fsdp (FSDP2's fully_shard on each block, then the root; gpt2/distributed/fsdp.py) at world size W > 1:
  weights, gradients, optimizer
               each parameter's 1/W shard: FSDP2 cuts dim 0 into W chunks padded to ceil(d0/W) rows,
               so a rank holds ceil(d0/W) x the other dims (rank 0's real shard, the largest)
  gathered     the unsharded weights in flight, in the compute dtype (bf16/fp16 under the mixed-
               precision policy on CUDA, else fp32), padded: the root unit's (tied embedding/LM head,
               wpe, ln_f) for the whole forward and backward (the root is not resharded until the
               end), and two blocks: the one computing and the next, prefetched (FSDP2 all-gathers
               one unit ahead in forward and backward)
  unsharded gradients
               the root's unsharded gradient through the whole backward (the LM head's part comes
               first, the embedding's last) but for the tied weight's, which is the fp32 weight
               gradient the LM head + loss term already counts; and one block's before its
               reduce-scatter, with the fp32 reduce-scatter input copied from it
  no-sync gradients
               gradient accumulation (several micro-steps) skips the reduce-scatter on all but the last
               micro-step (FSDP2's set_requires_gradient_sync(False), as the trainer does): every
               unit's UNSHARDED fp32 gradient then stays between micro-steps, the whole model's 4N
               bytes per rank. A reduce-scatter per micro-step would keep only the shards; the plan
               says when that choice is the difference between fitting and not (Plan.rs_total).
  autocast copies
               under the CUDA policy the gathered weights are already bf16: none. Without the policy
               (CPU autocast), autocast's bf16 copies of the gathered weights are saved for backward,
               as under DDP (the whole model's matmul weights).
At world size 1 the trainer does not shard (no process group): the plan is DDP's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from gpt2.core.config import (
    LM_HEAD,
    PARALLELS,
    TOKEN_EMBEDDING,
    ModelConfig,
    RunConfig,
    TrainConfig,
    describe_model,
    lookup_tables,
    param_count,
    weight_shapes,
)
from gpt2.core.host_memory import MMAP_THRESHOLD_BYTES
from gpt2.core.precision import BFLOAT16, Precision
from gpt2.core.schedule import grad_accum_steps
from gpt2.model import documents
from gpt2.plan.hardware import Hardware, gib, usable_note


@dataclass(frozen=True, kw_only=True)
class Memory:
    """Bytes per device, by what holds them."""

    weights: int
    autocast_weights: int
    gradients: int
    optimizer: int
    activations_flash: int
    activations_explicit: int
    activations: int
    """What the run holds: the one of the two above that the config's attn_impl uses, or, checkpointed,
    activations_checkpointed."""
    activations_checkpointed: int = 0
    """With activation checkpointing (for the config's attn_impl): block inputs and one block's activations."""
    checkpointed: bool = False
    """Whether `activations` counts activation checkpointing (not a byte count)."""
    logits: int
    block_backward: int = 0
    """CPU, without activation checkpointing: how far the last block's backward rises above the loss's peak, with
    every block's activations still saved (block_backward_bytes); 0 where the loss's peak is the higher."""
    optimizer_name: str = "adamw"
    """Which optimizer `optimizer` counts (not a byte count)."""
    chunked_loss: bool = True
    """Which loss path `logits` counts: the chunked loss, or the full (B, T, V) logits."""
    shards: int = 1
    """1: every rank holds everything (DDP, or fsdp at world size 1); W: FSDP over W ranks, and
    weights, gradients and optimizer are each rank's padded 1/W shards (module docstring)."""
    gathered: int = 0
    """FSDP: unsharded weights in flight (the root unit's and two blocks', compute dtype)."""
    unit_gradients: int = 0
    """FSDP: the root's unsharded gradient through the backward and one block's before its reduce-scatter."""
    accum_gradients: int = 0
    """FSDP with accumulation: the whole model's unsharded fp32 gradients kept by no-sync between micro-steps."""

    @property
    def static(self) -> int:
        """Independent of the micro-batch."""
        return (
            self.weights
            + self.autocast_weights
            + self.gradients
            + self.optimizer
            + self.gathered
            + self.unit_gradients
            + self.accum_gradients
        )

    @property
    def total(self) -> int:
        return self.static + self.activations + self.logits + self.block_backward


PLAN_ERROR = 0.25
"""How far a training step's measured peak may be from the plan's total: tests/test_memory_plan.py holds the
plan to it on a CPU (the process's resident peak, over widths, micro-batches, loss paths and compilation).
--micro-batch-size auto keeps that much headroom (AUTO_HEADROOM), and the trainer warns when its first step
peaks higher than the plan allows (gpt2/train/memory_watch.py)."""
AUTO_HEADROOM = 1 + PLAN_ERROR
"""--micro-batch-size auto takes a micro-batch only where total x AUTO_HEADROOM fits the usable memory: a
plan that is PLAN_ERROR low still fits."""


# A CPU process's resident peak is more than its tensors at their peak (Memory.total, which the CPU allocator's
# own events match to the MiB at 4 x 128 and 4 x 256 wide with gradient accumulation): glibc's heap, which serves
# every block under the mmap threshold (4 MiB, gpt2.core.host_memory.return_freed_memory), gives back only what
# is free at its top. The blocks freed between a step's tensors stay resident as holes that later allocations do
# not all fill. Two parts, both measured by bench/plan_resident.py (docs/training.md):
# - the small tensors of any shape (biases, norm statistics, small weights' gradients, the autograd graph):
#   13-48 MiB of free heap (mallinfo2) after a few steps of the debug preset's shapes (at 1 MiB activations and
#   less), up to 48 MiB after 40 steps (it grows over the first ~12 steps, then stays): CPU_HEAP_SLACK_BYTES;
# - where one activation (micro-batch x block x n_embd in fp32) is under the threshold, the activations
#   themselves come from the heap, and the holes grow with them and with the depth: at 4 x 256 wide, 8 x 256
#   tokens (2 MiB activations) the peak passed the flat 64 MiB by 26 MiB, at 6 x 384 (3 MiB) by 113 MiB,
#   about 3 and 6 activations a layer: HEAP_HOLES_PER_LAYER counts 8.
# It does not otherwise grow with the model or the micro-batch (larger blocks are mapped and unmapped on their own).
CPU_HEAP_SLACK_BYTES = 64 * 2**20
"""What glibc's heap keeps resident beyond the live tensors of a CPU training process for its small tensors
(above): the most measured (48 MiB) and a margin."""
HEAP_HOLES_PER_LAYER = 8
"""Activations' worth of heap holes per layer where one activation is under the mmap threshold (above)."""


def heap_slack(n_layer: int, n_embd: int, tokens_per_micro_step: int) -> int:
    """What glibc's heap keeps beside the live tensors of a CPU training step (the comment above): counted in the
    CPU plan line's resident total (resident_total), not in Memory.total, so the micro-batch search, the fit
    check and the GPU plan do not take it."""
    activation = tokens_per_micro_step * n_embd * 4
    in_heap = activation if activation < MMAP_THRESHOLD_BYTES else 0
    return CPU_HEAP_SLACK_BYTES + HEAP_HOLES_PER_LAYER * n_layer * in_heap


def resident_total(train: int, held: int, probe: int | None = None, *, heap: int = CPU_HEAP_SLACK_BYTES) -> int:
    """A CPU process's resident peak as planned (the start-up's plan line): what it held when it planned
    (after gpt2.plan.measure.warm_up: the libraries' first use) plus the larger of training's growth (train:
    Memory.total, and heap for the heap's holes, heap_slack) and the loss probe's measured growth (probe:
    a resident peak of its own, holes and all; None where it did not run in this process)."""
    return held + max(train + heap, probe or 0)


# The plain loss compiled: inductor fuses the fp32 cast, log-softmax and the target pick into
# reductions over the matmul's output (a logsumexp per row; no fp32 (N, V) tensor is written), and
# AOTAutograd's partitioner saves the cheapest input of that fused region for backward, the logits in
# the matmul dtype, recomputing the softmax there. Backward's one fused kernel reads those logits and
# the per-row logsumexp and writes d loss / d logits, already cast back to the matmul dtype, over them
# (inductor reuses the saved buffer, which nothing reads after): on a CPU one (N, V) buffer in the
# matmul dtype, 4.00 bytes per logit in fp32 and 1.78 under bf16 (bench/compiled_loss_memory.py, the
# table in bench/README.md), which the process's resident peak confirms (tests/test_memory_plan.py).
# On CUDA it is not measured yet: the planner counts the logits and their gradient apart there, in case
# its kernels do not write over the saved logits. Rows and vectors (lse, targets) are ~1/V and not counted.
COMPILED_FULL_LOSS_BYTES = {"cpu": 1, "cuda": 2}
"""Bytes per logit of the compiled full loss, in units of the matmul dtype's size, by device type (above)."""


# The chunked loss compiled is one custom op (gpt2/model/loss.py, _chunked_op): its chunks run one after
# another inside it, as eager, so it holds one chunk's buffers compiled or not. Traced whole, as before,
# inductor ran each chunk's input-gradient matmul after later chunks under 16-bit autocast and kept every
# chunk's logits and softmax gradient: 805 MB at 8,192 tokens (50 chunks) on a CPU, then ~1.6 GB once the
# one-hot became a fused torch.where; the op makes the count the eager one again.
def loss_bytes(
    cfg: ModelConfig,
    tokens: int,
    *,
    prec: Precision = BFLOAT16,
    chunked: bool = True,
    device_type: str = "cuda",
    device_memory: int | None = None,
    compiled: bool = False,
    fp8: bool = False,
) -> int:
    """Peak bytes of the LM head + cross-entropy for `tokens` positions, beyond the weights, their
    gradients and the activations that reach the LM head (counted elsewhere). s: the matmul dtype's size.
    fp8: the head's matmuls in FP8 (--fp8-head, the full loss only; FP8_COPY_BYTES).

    chunked (gpt2.model.loss.linear_cross_entropy, what --loss-impl chunked runs), its forward: one
    chunk of rows' buffers, reused by every chunk: the fp32 logits (then the softmax gradient), the
    exp(logits - max) its logsumexp sums, and under autocast the logits' matmul-dtype twin (4 + 4
    [+ s] bytes per logit); the (V, h) weight-gradient part in the matmul dtype and its fp32 sum;
    the input gradient, fp32 (tokens x h). Its backward scales the two gradients it saved: one more
    of each, the weight's becoming the gradient the plan already counts. The larger of the two.
    Plain (full), eager: the logits (s, dropped after the fp32 copy cross-entropy takes, 4), the fp32
    log-probabilities (4) in forward; the log-probabilities and two fp32 gradients of that size in
    backward, the peak: 12 bytes per logit whatever the dtype. Plain, compiled
    (COMPILED_FULL_LOSS_BYTES): s bytes per logit on a CPU, 2 * s elsewhere. Chunked, compiled: as eager
    (the chunks run inside one custom op, above; `compiled` only matters to the plain loss).

    The chunk is the one the model will use: on CUDA it is sized from device_memory (the device's
    total bytes, Hardware.memory_bytes), which is then required.
    """
    from gpt2.model.loss import loss_chunk_logits, loss_chunks

    s = prec.matmul_bytes
    V, h = cfg.vocab_size, cfg.n_embd
    if not chunked:
        per_logit = COMPILED_FULL_LOSS_BYTES.get(device_type, 2) * s if compiled else EAGER_FULL_LOSS_BYTES
        if fp8 and compiled:  # eager, the FP8 head's copies stay under the loss's own 12 bytes (FP8_COPY_BYTES)
            per_logit = max(per_logit, s + FP8_COPY_BYTES.get(device_type, 2))
        return tokens * V * (per_logit + (SOFTCAP_FULL_LOSS_BYTES if cfg.logit_softcap is not None else 0))
    if fp8:
        raise ValueError("loss_bytes: fp8=True computes the full logits (chunked=False)")
    if device_type == "cuda" and device_memory is None:
        raise ValueError("loss_bytes needs device_memory on cuda: the loss's chunk size depends on it")
    _, rows = loss_chunks(tokens, max(1, loss_chunk_logits(device_type, device_memory) // V))
    rows = min(rows, tokens)
    forward = rows * V * (4 + 4 + (s if s < 4 else 0)) + V * h * (s + 4) + tokens * h * 4
    backward = 2 * tokens * h * 4 + V * h * 4
    return max(forward, backward)


EAGER_FULL_LOSS_BYTES = 12
"""Bytes per logit of the plain loss uncompiled, fp32 or under autocast (loss_bytes)."""
# The FP8 head (--fp8-head, gpt2/model/fp8.py) with the full loss. Its backward quantises the loss's (N, V)
# gradient g: abs(g) for the amax, g.float(), the scaled copy, the clamped copy, then the e5m2 gradient and its
# transposed copy (the weight gradient's operand), each (N, V): 6.6 GB each in fp32 at 32 x 1,024 tokens.
# - Eager, they come one or two at a time after cross-entropy's backward has freed its fp32 buffers: at most g
#   and two fp32 copies, 2 + 4 + 4 bytes per logit under bf16 autocast (4 + 4 + 4 in fp32), not above the eager
#   loss's own 12. Measured with the CPU allocator's events, _scaled_mm replaced by an op that allocates its
#   output alone (as on CUDA; a CPU's own emulates it through fp32 copies), head + cross-entropy at 2,048 x 4,096
#   logits: 11.86 bytes per logit with FP8, 11.81 (fp32) and 11.91 (bf16) without (tests/test_memory_plan.py
#   holds it). Nothing added.
# - Compiled, inductor fuses the abs and amax into one reduction and the scaling, clamp and cast into the kernel
#   that writes the e5m2 gradient, but _scaled_mm is an extern kernel: its operands (the e5m2 gradient and its
#   transposed copy, 1 byte each) exist beside the matmul-dtype gradient written over the saved logits: s + 2
#   bytes per logit, never counted below the plain compiled loss. On a CPU, bf16, the same stand-in op: 2.89
#   bytes per logit against the plain loss's 2.27 (s + 1 counted). On an H200 (docs/performance.md, the fourth
#   lease, 2026-11-28, bench/sizes.py rows at 64 x 1,024 tokens, compiled, bf16) the FP8 head peaked at 35,691 MiB
#   and the plain full loss at 29,666 MiB: 1.9 bytes per logit apart (1.9 at 32 x 1,024 too: 18,935 and 15,950),
#   s + 2 = 4 for FP8, which is the plain loss's count on CUDA (2s, COMPILED_FULL_LOSS_BYTES; the plain runs
#   peaked 0.83-0.84x their plan there).
# The saved e4m3 input and weight (1 byte per element) and the weight's transient fp32 copies in the forward
# are (N + V) x h, not per logit: not counted.
FP8_COPY_BYTES = {"cpu": 1, "cuda": 2}
"""Bytes per logit the FP8 head's e5m2 gradient copies hold beside the compiled full loss's gradient (above)."""
SOFTCAP_FULL_LOSS_BYTES = 4
"""Bytes per logit logit_softcap adds to the full loss: the fp32 tanh its backward keeps (12 -> 16 measured
eager on a CPU, fp32 and bf16, with gpt2.plan.measure). Compiled it is counted too, not measured. The chunked
loss holds its softcap in the buffers it has (gpt2/model/loss.py _capped_chunk): nothing more."""


def run_config(
    model: ModelConfig, micro_batch_size: int | str, *, prec: Precision = BFLOAT16, world_size: int = 1, **train
) -> RunConfig:
    """The RunConfig a bench or test sizing a bare model plans: in prec (its dtype and TF32), these TrainConfig
    fields, and by default a global
    batch of one micro-step on each of world_size ranks (no accumulation) and no torch.compile (the plain
    model a bench measures)."""
    if "total_batch_size" not in train:
        train["total_batch_size"] = micro_batch_size * model.block_size * world_size
    train.setdefault("compile", False)
    return RunConfig(
        model, TrainConfig.of(dtype=prec.dtype, tf32=prec.tf32, micro_batch_size=micro_batch_size, **train)
    )


def memory(
    cfg: RunConfig,
    hardware: Hardware,
    *,
    world_size: int = 1,
    micro_batch_size: int | None = None,
    accum_steps: int | None = None,
    checkpointed: bool | None = None,
) -> Memory:
    """Bytes per device for one training micro-step of cfg on hardware (see the module docstring): the
    sequence is cfg.model.block_size long, the dtype the TrainConfig's on hardware's device type, the
    optimizer, parallelism, loss path (chunked unless loss_impl is full) and compilation the TrainConfig's.
    What varies per call: micro_batch_size (default the TrainConfig's, which must then be a number),
    accum_steps (default: what total_batch_size makes of it; > 1 under fsdp adds the no-sync gradients),
    checkpointed (default: activation_checkpointing is full). The device's total bytes size the loss's
    chunks on CUDA (see loss_bytes)."""
    tc, model = cfg.train, cfg.model
    micro_batch_size = tc.batch.micro_batch_size if micro_batch_size is None else micro_batch_size
    seq_len = model.block_size
    if accum_steps is None:
        accum_steps = grad_accum_steps(tc.batch.total_batch_size, micro_batch_size, seq_len, world_size)
    checkpointed = tc.compute.activation_checkpointing == "full" if checkpointed is None else checkpointed
    prec = Precision.of_config(tc.compute, hardware.device_type)
    device_type, device_memory = hardware.device_type, hardware.memory_bytes
    optimizer, parallel, chunked_loss, compiled = (
        tc.optim.optimizer,
        tc.distributed.parallel,
        tc.compute.loss_impl != "full",
        tc.compute.compile,
    )
    n = param_count(model)
    autocast = prec.autocasts
    where = dict(prec=prec, device_type=device_type, compiled=compiled)
    flash = activation_bytes(model, micro_batch_size, seq_len, flash=True, **where)
    explicit = activation_bytes(model, micro_batch_size, seq_len, flash=False, **where)
    saved = activation_bytes(
        model, micro_batch_size, seq_len, flash=model.attn_impl != "explicit", checkpointed=True, **where
    )
    logits = loss_bytes(
        model,
        micro_batch_size * seq_len,
        prec=prec,
        chunked=chunked_loss,
        device_type=device_type,
        device_memory=device_memory,
        compiled=compiled,
        fp8=tc.compute.fp8_head and not chunked_loss,
    )
    backward = 0
    if device_type == "cpu" and not checkpointed:  # CUDA's plan is as measured on H100/H200 (block_backward_bytes)
        attn = model.attn_impl != "explicit"
        active = flash if attn else explicit
        peak = block_backward_bytes(model, micro_batch_size, seq_len, prec=prec, device_type=device_type, flash=attn)
        backward = max(0, peak - active - logits)
    mem = Memory(
        weights=4 * n,
        autocast_weights=2 * matmul_weight_count(model) if autocast else 0,
        gradients=4 * n,  # also DDP's buckets: gradient_as_bucket_view=True makes them one storage
        optimizer=optimizer_bytes(model, optimizer),
        activations_flash=flash,
        activations_explicit=explicit,
        activations=saved if checkpointed else explicit if model.attn_impl == "explicit" else flash,
        activations_checkpointed=saved,
        checkpointed=checkpointed,
        logits=logits,
        block_backward=backward,
        optimizer_name=optimizer,
        chunked_loss=chunked_loss,
    )
    if parallel not in PARALLELS:
        raise ValueError(f"parallel={parallel!r} must be one of {PARALLELS}")
    if parallel == "ddp" or world_size == 1:  # fsdp at world size 1: the trainer does not shard
        return mem
    return fsdp_memory(
        mem, model, world_size, prec=prec, device_type=device_type, optimizer=optimizer, accum_steps=accum_steps
    )


def fsdp_memory(
    mem: Memory,
    cfg: ModelConfig,
    world_size: int,
    *,
    prec: Precision,
    device_type: str,
    optimizer: str,
    accum_steps: int,
) -> Memory:
    """DDP's memory made FSDP's over world_size ranks: the state sharded (padded), plus what is unsharded
    in flight (module docstring). Activations and the loss are unchanged."""
    policy = prec.autocasts and device_type == "cuda"  # the mixed-precision policy: bf16/fp16 params
    s = 2 if policy else 4
    sharded, gathered, root_n, block_n, tied_n = _fsdp_elements(cfg, world_size)
    return dataclasses.replace(
        mem,
        shards=world_size,
        weights=4 * sharded,
        gradients=4 * sharded,
        optimizer=optimizer_bytes(cfg, optimizer, world_size=world_size),
        autocast_weights=0 if policy else mem.autocast_weights,
        gathered=s * (root_n + min(2, cfg.n_layer) * block_n),
        unit_gradients=s * (root_n - tied_n) + (s + 4) * block_n,
        accum_gradients=4 * gathered if accum_steps > 1 else 0,
    )


@functools.cache  # the planner's micro-batch search asks for the same model's counts at every size it tries
def _fsdp_elements(cfg: ModelConfig, world_size: int) -> tuple[int, int, int, int, int]:
    """(one rank's shard of every parameter, all of them gathered, the root module's gathered (embeddings,
    final norm, an untied head), one block's gathered, the LM head weight's gathered) in elements."""
    shapes = weight_shapes(cfg)
    root = [v for k, v in shapes.items() if ".h." not in f".{k}"]
    block = [v for k, v in shapes.items() if k.startswith("transformer.h.0.")]
    head = TOKEN_EMBEDDING if cfg.tie_embeddings else LM_HEAD  # the LM head's weight
    return (
        sharded_elements(shapes.values(), world_size),
        gathered_elements(shapes.values(), world_size),
        gathered_elements(root, world_size),
        gathered_elements(block, world_size),
        gathered_elements([shapes[head]], world_size),  # its gradient: in loss_bytes
    )


def shard_rows(rows: int, world_size: int) -> int:
    """Rows of dim 0 in each rank's FSDP2 shard: torch.chunk's largest chunk, to which FSDP2 pads all."""
    return -(-rows // world_size)


def sharded_elements(shapes, world_size: int) -> int:
    """Elements one rank holds of these parameters under FSDP2 (padding included); at world size 1, all."""
    return sum(shard_rows(s[0], world_size) * math.prod(s[1:]) for s in shapes)


def gathered_elements(shapes, world_size: int) -> int:
    """Elements of these parameters all-gathered: world_size padded shards each (the all-gather's output)."""
    return world_size * sharded_elements(shapes, world_size)


@functools.cache  # pure in a frozen config; the planner asks thousands of times
def optimizer_bytes(cfg: ModelConfig, optimizer: str = "adamw", *, world_size: int = 1) -> int:
    """AdamW: two fp32 moments per parameter. Muon: one fp32 momentum per block matrix, AdamW's two
    for the rest (embeddings, biases, LayerNorm; gpt2/train/optim.py). world_size > 1: one rank's FSDP
    shards of them (the moments are shaped like the sharded parameters, padding included)."""
    if optimizer not in ("adamw", "muon"):
        raise ValueError(f"optimizer={optimizer!r} must be adamw or muon")
    shapes = weight_shapes(cfg)
    if optimizer == "adamw":
        return 8 * sharded_elements(shapes.values(), world_size)
    muon = [s for name, s in shapes.items() if len(s) == 2 and ".h." in f".{name}"]  # as block_matrix_count
    rest = [s for name, s in shapes.items() if not (len(s) == 2 and ".h." in f".{name}")]
    return 8 * sharded_elements(rest, world_size) + 4 * sharded_elements(muon, world_size)


@functools.cache  # pure in a frozen config; the planner asks thousands of times
def matmul_weight_count(cfg: ModelConfig) -> int:
    """Elements of every weight that goes through a matmul (autocast keeps a bf16 copy of each): every
    matrix of config.weight_shapes but the lookup tables (the position embedding; the token embedding
    too when the LM head is untied, else it is the head)."""
    lookups = lookup_tables(cfg)
    return sum(math.prod(s) for name, s in weight_shapes(cfg).items() if len(s) == 2 and name not in lookups)


@functools.cache  # pure in a frozen config; the planner asks thousands of times
def block_matrix_count(cfg: ModelConfig) -> int:
    """Elements of the matrices inside the transformer blocks: what Muon updates (gpt2/train/optim.py
    is_muon_param: 2-D and under .h.)."""
    return sum(math.prod(s) for name, s in weight_shapes(cfg).items() if len(s) == 2 and ".h." in f".{name}")


def activation_bytes(
    cfg: ModelConfig,
    batch: int,
    seq_len: int,
    *,
    prec: Precision = BFLOAT16,
    device_type: str = "cuda",
    flash: bool = True,
    checkpointed: bool = False,
    compiled: bool = False,
) -> int:
    """Bytes autograd saves for backward outside the loss: embeddings, blocks, final LayerNorm.

    compiled: attention runs compiled (the whole model or each block: any --compile-scope, fsdp's too), which
    with doc_attention on CUDA takes FlexAttention's block mask (documents.flex_applies) instead of the dense one.

    s is the matmul dtype's size. Under autocast the residual stream and LayerNorms stay fp32, so
    every LayerNorm saves a 4-byte input plus fp32 mean and rstd per token.

    checkpointed (activation checkpointing, gpt2/model/gpt.py Block): each block saves only its input,
    the fp32 residual stream (4h bytes per token), and its own activations exist for one block at a
    time: in the forward while it runs, in the backward while it is recomputed and differentiated.
    So L blocks' activations become L inputs plus one block's activations (and its causal mask), plus
    that block's backward transients, which the uncheckpointed count leaves out as small beside L blocks.
    """
    s = prec.matmul_bytes
    h, nh, L, T = cfg.n_embd, cfg.n_head, cfg.n_layer, seq_len
    qkv_out = cfg.qkv_dim
    layer_norm = 4 * h + (4 if cfg.norm == "rmsnorm" else 8)  # its input, and rstd (LayerNorm: and the mean)
    # Inputs of c_fc, GELU, c_proj; relu2 saves as many (relu its output, which square saves as its input).
    mlp = s * h + s * cfg.mlp_dim + s * cfg.mlp_dim
    qk = qk_bytes(cfg, s)
    if flash:
        # SDPA saves the (views of the) c_attn output as q, k, v, its output and a log-sum-exp
        # per head. Fused kernels write the output as (B, T, nh, hd), so the .contiguous() before
        # c_proj is free and c_proj saves that same storage.
        attn = s * h + s * qkv_out + s * h + 4 * nh + qk
        per_layer_mask = 0
    else:
        # explicit_attention saves contiguous q, k (k expanded to n_head under GQA), v and the
        # softmax output; no SDPA output copy. CUDA autocast runs softmax in fp32 and then the
        # AV matmul saves its own bf16 copy of the probabilities: 4 + 2 bytes. CPU autocast
        # keeps softmax in bf16.
        probs = 6 if (prec.autocasts and device_type == "cuda") else s
        # (q and k made by qk_norm or RoPE replace the contiguous copies counted here: only the norm's own.)
        attn = s * h + 3 * s * h + probs * nh * T + s * h + qk_bytes(cfg, s, new_qk=False)
        per_layer_mask = T * T  # the boolean causal mask, built per layer
    # Dropout (0 in pretraining): CUDA saves a 1-byte boolean mask per element; CPU saves a mask
    # in the input's dtype. Explicit attention also saves the dropped probabilities. Fused SDPA
    # on CUDA regenerates its mask from the RNG state; on CPU it falls back to the math kernel,
    # which keeps about 12 bytes per attention element and, under autocast, another copy of
    # q, k, v (measured with saved_tensors_hooks).
    dropout = 0
    if cfg.dropout > 0:
        cuda = device_type == "cuda"
        dropout = 2 * h * (1 if cuda else s)
        if not flash:
            dropout += nh * T * ((1 if cuda else s) + s)
        elif not cuda:
            dropout += nh * T * 12 + (3 * s * h if prec.autocasts else 0)
    per_token_layer = 2 * layer_norm + attn + mlp + dropout
    flex = documents.flex_applies(device_type, compiled=compiled, dropout=cfg.dropout > 0, explicit=not flash)
    if cfg.doc_attention and not flex:
        # The dense document mask (gpt2/model/documents.py): SDPA turns the boolean (B, 1, T, T) into an additive
        # mask of q's dtype in every layer and saves it (measured with saved_tensors_hooks on a CPU: s bytes per
        # element per layer; on CUDA, eager, the memory-efficient kernel takes the same additive mask and saves it
        # for its backward). Wherever FlexAttention runs (CUDA, attention compiled under any --compile-scope or
        # fsdp), its block mask is a few bytes per 128 x 128 block and attention saves what flash does: not counted.
        per_token_layer += s * T
    per_token_rest = 8 + 8 + layer_norm + s * h  # token ids, targets, ln_f, LM-head input
    # value_embeds: a layer with a table saves the mixed values SDPA takes (where it took a view of c_attn's output)
    # and, for its mixing weight, the table's values: under autocast a copy cast to v's dtype per layer, else the
    # fp32 lookup itself, one per table (measured with saved_tensors_hooks, tests/test_value_unet.py).
    # Checkpointed, each table's fp32 lookup is an input every checkpoint keeps, and one layer's exist at a time.
    kv = cfg.n_kv_head * cfg.head_dim
    value_layers = 2 * cfg.value_embeds
    per_value_layer = 2 * s * kv if prec.autocasts else s * kv
    tables = 0 if prec.autocasts else cfg.value_embeds * 4 * kv
    lambdas = value_layers * 2 * s if prec.autocasts else 0  # the mixing weights cast, per layer
    # unet_skips: with an even n_layer the first decoder block takes its own input as its skip, so that input is
    # saved by the skip's product and the sum by the block: one fp32 residual more (odd: the middle block has none).
    per_token_rest += 4 * h if cfg.unet_skips and cfg.n_layer % 2 == 0 else 0
    per_token_rest += (h if device_type == "cuda" else 4 * h) if cfg.dropout > 0 else 0  # embedding's
    if checkpointed:
        # With so little saved, the backward's own transients in the block being differentiated show: the
        # gradient arriving at its output (fp32 residual) and the MLP hidden's gradient (4h wide). Measured
        # against the CPU allocator's peak in tests/test_activation_checkpointing.py.
        backward = 4 * h + s * cfg.mlp_dim
        values = cfg.value_embeds * 4 * kv + min(value_layers, 1) * per_value_layer
        return (
            batch * T * (L * 4 * h + per_token_layer + backward + per_token_rest + values)
            + min(L, 1) * per_layer_mask
            + lambdas
        )
    values = value_layers * per_value_layer + tables
    return batch * T * (L * per_token_layer + per_token_rest + values) + L * per_layer_mask + lambdas


def block_backward_bytes(
    cfg: ModelConfig,
    batch: int,
    seq_len: int,
    *,
    prec: Precision = BFLOAT16,
    device_type: str = "cuda",
    flash: bool = True,
) -> int:
    """Bytes alive in the backward of the last block, without activation checkpointing (the gradients aside): every
    block's saved activations and the token ids and targets (activation_bytes), the final LayerNorm's and the LM
    head's saved inputs freed by then, and the block's own transients: the fp32 gradient arriving at its output
    and its MLP hidden's gradient (as activation_bytes counts them for a checkpointed block).

    Where the loss's peak is small beside them, this is the step's peak: at the debug preset's 4 x 128 wide with
    1,024 x 128 tokens the CPU allocator's events peaked in the last block's MLP backward 37 MiB above activations
    + loss (the loss's chunk is fixed, these grow with the tokens), the (V, h) gradient of the tied weight beside
    it; counted so, the plan is within 5 MiB of it (bench/plan_resident.py's debug-1024 row). On CUDA the loss's
    chunk is sized from the device's memory and the plan was measured as it is: not counted there (memory)."""
    s = prec.matmul_bytes
    h = cfg.n_embd
    saved = activation_bytes(cfg, batch, seq_len, prec=prec, device_type=device_type, flash=flash)
    freed = batch * seq_len * ((4 * h + 8) + s * h)  # ln_f's input, mean and rstd; the LM head's input
    return saved - freed + batch * seq_len * (4 * h + s * cfg.mlp_dim)


def qk_bytes(cfg: ModelConfig, s: int, *, new_qk: bool = True) -> int:
    """Bytes per token and layer that qk_norm and RoPE add to what attention saves (s: the matmul dtype's
    size), measured with saved_tensors_hooks on a CPU, eager: new q and k (s each element), which SDPA saves
    in place of c_attn's views (new_qk); for qk_norm, F.rms_norm's fp32 rstd per head and, under autocast, the
    fp32 copy of its 16-bit input that it saves. RoPE's cos and sin are (T, head_dim/2), once per forward:
    not counted."""
    kv = cfg.n_kv_head * cfg.head_dim
    extra = s * (cfg.n_embd + kv) if new_qk and (cfg.rope or cfg.qk_norm) else 0
    if cfg.qk_norm:
        extra += 4 * (cfg.n_head + cfg.n_kv_head) + (4 * (cfg.n_embd + kv) if s < 4 else 0)
    return extra


def max_micro_batch_size(
    cfg: RunConfig,
    hardware: Hardware,
    *,
    world_size: int = 1,
    accumulate: bool | None = None,
    checkpointed: bool | None = None,
    headroom: float = 1.0,
) -> int:
    """Largest micro-batch of cfg whose total (times headroom: AUTO_HEADROOM for auto) fits the usable memory
    (Hardware.usable_bytes; 0: not even one sequence), counted with the chunked loss uncompiled (sizing).

    Memory grows with the micro-batch (activations linearly; the chunked loss by at most one chunk),
    so the largest fitting size is found by doubling and then bisecting. Under fsdp, a micro-batch
    that needs accumulation also holds the no-sync gradients: the search assumes accumulation, then
    the one micro-batch without it (all of a rank's total_batch_size sequences at once, if that
    divides) is tried on its own. accumulate=True assumes accumulation at every size (not that one);
    accumulate=False counts no no-sync gradients at any size (a reduce-scatter per micro-step: the
    alternative the plan reports). checkpointed: default, activation_checkpointing is full.
    """
    usable, sized, seq_len = hardware.usable_bytes, sizing(cfg), cfg.model.block_size

    def fits(b: int, accum: int = 2 if accumulate is not False else 1) -> bool:
        return (
            memory(
                sized, hardware, world_size=world_size, micro_batch_size=b, accum_steps=accum, checkpointed=checkpointed
            ).total
            * headroom
            <= usable
        )

    whole = None  # the micro-batch with no accumulation, when there is one
    total_batch_size = cfg.train.batch.total_batch_size
    if accumulate is None and total_batch_size % (seq_len * world_size) == 0:
        whole = total_batch_size // (seq_len * world_size)
    if not fits(1):
        return whole if whole is not None and fits(whole, 1) else 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return whole if whole is not None and whole > lo and fits(whole, 1) else lo


def sizing(cfg: RunConfig) -> RunConfig:
    """cfg as the micro-batch search and the does-not-fit message count it: the chunked loss (which counts the
    same compiled or not). Why not the run's loss path: the loss is chosen after the micro-batch, for it
    (gpt2/plan/loss_choice.py), and the chunked loss is the one every micro-batch can take; but for the FP8
    head, which multiplies the whole logits at once at every micro-batch: then the full loss with its FP8
    copies (loss_bytes), so that auto never takes a micro-batch whose FP8 head does not fit. The compilation
    stays the run's: it decides what the full loss holds, and with doc_attention on CUDA whether attention
    saves the dense mask (activation_bytes)."""
    if cfg.train.compute.fp8_head:
        return RunConfig(cfg.model, cfg.train.replace(loss_impl="full"))
    return RunConfig(cfg.model, cfg.train.replace(loss_impl="chunked"))


def does_not_fit(cfg: RunConfig, hardware: Hardware, *, world_size: int) -> str:
    """The one message for a model that cannot train even one sequence per device: which model, where,
    what it needs against what there is, and the changes that would make it fit."""
    tc = cfg.train
    checkpointed = tc.compute.activation_checkpointing == "full"
    prec, optimizer, parallel = (
        Precision.of_config(tc.compute, hardware.device_type),
        tc.optim.optimizer,
        tc.distributed.parallel,
    )

    def one(checkpointed: bool = checkpointed, **change) -> Memory:
        run = sizing(RunConfig(cfg.model, tc.replace(**change)))
        return memory(
            run, hardware, world_size=world_size, micro_batch_size=1, accum_steps=2, checkpointed=checkpointed
        )

    need, usable = one(), hardware.usable_bytes
    sharded = parallel == "fsdp" and world_size > 1
    options = ["a smaller model (a smaller --preset, or --n-layer/--n-embd)"]
    if not sharded and world_size > 1 and not tc.compute.fp8_head and one(parallel="fsdp").total <= usable:
        options.append(
            f"--parallel fsdp (state sharded over the {world_size} ranks: {gib(one(parallel='fsdp').total)})"
        )
    if parallel == "fsdp" and world_size == 1:
        options.append("several ranks (--parallel fsdp shards over the ranks; one process holds everything)")
    if sharded and need.accum_gradients and need.total - need.accum_gradients <= usable:
        options.append(
            f"no gradient accumulation (FSDP's no-sync keeps {gib(need.accum_gradients)} of unsharded "
            f"gradients between micro-steps: a smaller --total-batch-size or more ranks)"
        )
    if not checkpointed and one(checkpointed=True).total <= usable:
        options.append(
            f"--activation-checkpointing full (blocks recomputed in the backward: {gib(one(checkpointed=True).total)})"
        )
    if need.static <= usable:  # the micro-batch's own memory is what overflows: shorter or 16-bit helps
        options.append("a shorter --block-size")
        if not prec.autocasts:
            options.append("--dtype bfloat16")
    if optimizer == "adamw" and one(optimizer="muon").total <= usable:
        options.append(f"--optimizer muon (one moment per block matrix: {gib(one(optimizer='muon').total)})")
    options.append("a device with more memory" if not sharded else "more ranks or a device with more memory")
    state = (
        "which DDP keeps whole on every rank however many there are"
        if not sharded
        else f"each rank's 1/{world_size} shard plus the gathered units and unsharded gradients FSDP holds"
    )
    return (
        f"{describe_model(cfg.model)} does not fit on {hardware.name} ({gib(hardware.memory_bytes)}) with "
        f"{'FSDP' if sharded else 'DDP'} at world size {world_size}: micro_batch_size=1 needs {gib(need.total)} "
        f"per device ({gib(need.static)} of weights, gradients and {optimizer} state, {state}) but "
        f"{gib(usable)} is usable {usable_note(hardware)}; use " + ", ".join(options[:-1]) + f" or {options[-1]}"
    )
