"""Memory and compute planner: will this model train on this hardware, and how long will it take?

    python -m gpt2.plan --preset gpt2 --world-size 8 --gpu A100-40GB

plans the run `train_ddp.py --preset gpt2` makes on 8 such GPUs: the training preset's global batch
and budget (gpt2/config.py TRAIN_PRESETS) and its micro-batch (auto: the largest that fits and
divides); --micro-batch-size, --total-batch-size and --tokens override them.

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
               SDPA kernels ("flash") save only q, k, v, the output and a log-sum-exp
  logits       the LM head + loss peak, for the loss path the run uses (--loss-impl, choose_loss_impl):
               chunked, one chunk of rows' logits, fp32 softmax and gradients at a time (gpt2/loss.py);
               full, eager: the (B, T, V) logits, the fp32 log-probabilities cross-entropy saves, and
               inside its backward two more fp32 (B, T, V) gradients (loss_bytes counts both); full,
               compiled: the logits and their gradient in the matmul dtype (COMPILED_FULL_LOSS_BYTES)
The total is an upper bound on the step's peak: gradients are counted in full although, with
zero_grad(set_to_none=True) and one micro-step, they are allocated while activations are freed.

--parallel fsdp (FSDP2's fully_shard on each block, then the root; gpt2/fsdp.py) at world size W > 1:
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

import argparse
import contextlib
import dataclasses
import math
import os
import sys
from dataclasses import dataclass

import torch

from gpt2.config import (MODEL_PRESETS, PARALLELS, POSITION_EMBEDDING, TRAIN_PRESETS, ModelConfig, RunConfig,
                         TrainConfig, count_params_formula, describe_model, model_preset, param_count, weight_shapes)
from gpt2.flops import flops_per_token, format_flops, gpu_table_peak
from gpt2.precision import AUTOCAST_DTYPES, PLAN_DTYPES, from_short_name, plan_torch_dtype, short_name
from gpt2.schedule import grad_accum_steps

GIB = 1024 ** 3
# CUDA context, cuBLAS/NCCL workspaces and allocator fragmentation: memory a run never gets.
CUDA_RESERVE_BYTES = 2 * GIB

# Memory as torch.cuda.get_device_properties().total_memory reports it (a little under the label),
# and the data-sheet name flops.gpu_table_peak() matches.
GPUS: dict[str, tuple[float, str]] = {
    "A100-40GB": (39.4 * GIB, "NVIDIA A100-SXM4-40GB"),
    "A100-80GB": (79.1 * GIB, "NVIDIA A100-SXM4-80GB"),
    "H100-80GB": (79.1 * GIB, "NVIDIA H100 80GB HBM3"),
    "H200": (139.8 * GIB, "NVIDIA H200"),
    # A 24 GB card. 23.99 GiB is what CUDA reports as its total memory ("NVIDIA GeForce RTX 4090 (sm_89,
    # 22.434 GiB / 23.988 GiB available)", github.com/pc2/GPUInspector.jl/issues/11); its peak is the Ada
    # whitepaper's FP32-accumulate rate in gpt2/flops.py (165 TFLOP/s bf16).
    "RTX4090-24GB": (23.99 * GIB, "NVIDIA GeForce RTX 4090"),
}


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    """Shown in the summary."""
    memory_bytes: int
    """Total device memory of one GPU (for a CPU run: host RAM). On CUDA it also sizes the loss's
    chunks, as gpt2.loss.loss_chunk_logits does from the device's total_memory."""
    peak_flops: float | None
    """Dense peak FLOP/s of one device in the plan's dtype; None for a GPU without a data-sheet
    peak (gpt2.flops.device_peak_flops), which leaves the time estimates out."""
    device_type: str = "cuda"
    """'cuda' or 'cpu': autocast keeps different ops in fp32 on each."""
    reserve_bytes: int = CUDA_RESERVE_BYTES
    """Memory the run cannot use (CUDA context, workspaces, fragmentation)."""


def gpu_hardware(name: str, dtype: str) -> Hardware:
    """One of the GPUS by name, with its data-sheet peak for dtype."""
    memory, sheet_name = known_gpu(name)
    peak = gpu_table_peak(sheet_name, plan_torch_dtype(dtype), tf32=dtype == "tf32")
    return Hardware(name=name, memory_bytes=int(memory), peak_flops=peak)


def known_gpu(name: str) -> tuple[float, str]:
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; choose one of {list(GPUS)} or give "
                         f"--gpu-memory-gb and --gpu-peak-tflops")
    return GPUS[name]


def custom_hardware(gpu: str | None, dtype: str, *, memory_gb: float | None = None,
                    peak_tflops: float | None = None) -> Hardware:
    """--gpu NAME and/or --gpu-memory-gb/--gpu-peak-tflops (which override the named GPU's figures):
    the device `python -m gpt2.plan` and `train_ddp.py --dry-run` plan for."""
    if gpu is None and memory_gb is None:
        raise ValueError("name a GPU (--gpu, one of " + ", ".join(GPUS) + ") or give --gpu-memory-gb")
    if memory_gb is not None and not memory_gb > 0 or peak_tflops is not None and not peak_tflops > 0:
        raise ValueError(f"--gpu-memory-gb {memory_gb} and --gpu-peak-tflops {peak_tflops} must be > 0")
    hw = gpu_hardware(gpu, dtype) if gpu is not None else Hardware(name="custom", memory_bytes=0, peak_flops=None)
    return dataclasses.replace(
        hw, name="custom" if memory_gb is not None else hw.name,
        memory_bytes=int(memory_gb * GIB) if memory_gb is not None else hw.memory_bytes,
        peak_flops=peak_tflops * 1e12 if peak_tflops is not None else hw.peak_flops)


def gpu_native_bf16(gpu: str | None) -> bool:
    """Whether a GPUS entry has bf16 tensor cores (its data sheet lists a bf16 peak); a custom GPU
    (None) is assumed to be Ampere or newer, like every GPU a GPT-2 run is planned on today."""
    return gpu is None or gpu_table_peak(known_gpu(gpu)[1], torch.bfloat16) is not None


def device_hardware(device: torch.device | str, peak_flops: float | None, *,
                    processes_per_host: int = 1) -> Hardware:
    """The hardware a run is on: a CUDA device's memory, or for a CPU run this host's RAM shared
    by the processes_per_host ranks on it."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return Hardware(name=props.name, memory_bytes=props.total_memory, peak_flops=peak_flops)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware(name=f"cpu (1/{processes_per_host} of host RAM)" if processes_per_host > 1 else "cpu",
                    memory_bytes=ram // processes_per_host, peak_flops=peak_flops, device_type="cpu",
                    reserve_bytes=GIB // processes_per_host)


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
    """The one of the two above that the config's attn_impl uses."""
    logits: int
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
        return (self.weights + self.autocast_weights + self.gradients + self.optimizer + self.gathered
                + self.unit_gradients + self.accum_gradients)

    @property
    def total(self) -> int:
        return self.static + self.activations + self.logits


@dataclass(frozen=True, kw_only=True)
class Plan:
    cfg: ModelConfig
    micro_batch_size: int
    seq_len: int
    world_size: int
    dtype: str
    hardware: Hardware
    total_batch_size: int
    """Tokens per optimizer step over all devices."""
    tokens: int | None
    """Training budget in tokens, or None."""
    mfu: float
    """Assumed model FLOPs utilisation for the time estimates."""
    n_params: int
    n_params_formula: int
    memory: Memory
    max_micro_batch_size: int
    """Largest micro-batch whose total fits in hardware memory minus its reserve (0 if none)."""
    flops_per_token: float
    parallel: str = "ddp"
    """ddp or fsdp (TrainConfig.parallel): what memory counts (Memory.shards)."""

    @property
    def usable_bytes(self) -> int:
        return self.hardware.memory_bytes - self.hardware.reserve_bytes

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_bytes

    @property
    def rs_total(self) -> int:
        """FSDP: the total with a reduce-scatter per micro-step instead of no-sync accumulation (only the
        shards kept between micro-steps); the total itself otherwise."""
        return self.memory.total - self.memory.accum_gradients

    @property
    def tokens_per_micro_step(self) -> int:
        """Over all devices."""
        return self.micro_batch_size * self.seq_len * self.world_size

    @property
    def grad_accum_steps(self) -> int:
        return grad_accum_steps(self.total_batch_size, self.micro_batch_size, self.seq_len, self.world_size)

    @property
    def tokens_per_s(self) -> float | None:
        """All devices together, at the assumed MFU; None without a peak."""
        if self.hardware.peak_flops is None:
            return None
        return self.world_size * self.hardware.peak_flops * self.mfu / self.flops_per_token

    @property
    def step_time_s(self) -> float | None:
        return None if self.tokens_per_s is None else self.total_batch_size / self.tokens_per_s

    @property
    def hours(self) -> float | None:
        if self.tokens is None or self.tokens_per_s is None:
            return None
        return self.tokens / self.tokens_per_s / 3600


def plan(cfg: ModelConfig, *, micro_batch_size: int, hardware: Hardware, seq_len: int | None = None,
         world_size: int = 1, dtype: str = "bf16", total_batch_size: int | None = None,
         tokens: int | None = None, mfu: float = 0.4, optimizer: str = "adamw", chunked_loss: bool = True,
         parallel: str = "ddp", compiled: bool = False) -> Plan:
    """Memory per device, the largest micro-batch that fits, and time estimates. Pure arithmetic.

    total_batch_size defaults to one micro-step on every device (no accumulation); it must be a
    multiple of micro_batch_size * seq_len * world_size. chunked_loss: the loss path the memory
    counts; the largest micro-batch is always the chunked loss's (see choose_loss_impl). compiled:
    whether the model is compiled (the full loss's peak differs, loss_bytes).
    """
    seq_len = cfg.block_size if seq_len is None else seq_len
    problems = _plan_problems(cfg, micro_batch_size, seq_len, world_size, dtype, mfu, tokens, parallel)
    if problems:
        raise ValueError("invalid plan:\n  - " + "\n  - ".join(problems))
    if total_batch_size is None:
        total_batch_size = micro_batch_size * seq_len * world_size
    accum = grad_accum_steps(total_batch_size, micro_batch_size, seq_len, world_size)  # whole, else its error
    mem = memory(cfg, micro_batch_size, seq_len, world_size=world_size, dtype=dtype,
                 device_type=hardware.device_type, device_memory=hardware.memory_bytes, optimizer=optimizer,
                 chunked_loss=chunked_loss, parallel=parallel, accum_steps=accum, compiled=compiled)
    return Plan(cfg=cfg, micro_batch_size=micro_batch_size, seq_len=seq_len, world_size=world_size,
                dtype=dtype, hardware=hardware, total_batch_size=total_batch_size, tokens=tokens,
                mfu=mfu, n_params=param_count(cfg), n_params_formula=count_params_formula(cfg),
                memory=mem, flops_per_token=flops_per_token(cfg, seq_len), parallel=parallel,
                max_micro_batch_size=max_micro_batch_size(cfg, seq_len, hardware, world_size=world_size,
                                                          dtype=dtype, optimizer=optimizer, parallel=parallel,
                                                          total_batch_size=total_batch_size))


def _plan_problems(cfg, micro_batch_size, seq_len, world_size, dtype, mfu, tokens, parallel="ddp") -> list[str]:
    p = []
    if parallel not in PARALLELS:
        p.append(f"parallel={parallel!r} must be one of {PARALLELS}")
    if micro_batch_size < 1:
        p.append(f"micro_batch_size={micro_batch_size} must be >= 1")
    if not 1 <= seq_len <= cfg.block_size:
        p.append(f"seq_len={seq_len} must be in [1, block_size={cfg.block_size}]")
    if world_size < 1:
        p.append(f"world_size={world_size} must be >= 1")
    if dtype not in PLAN_DTYPES:
        p.append(f"dtype={dtype!r} must be one of {PLAN_DTYPES}")
    if not 0 < mfu <= 1:
        p.append(f"mfu={mfu} must be a fraction in (0, 1], e.g. 0.4")
    if tokens is not None and tokens < 1:
        p.append(f"tokens={tokens} must be positive")
    return p


# The plain loss compiled: inductor fuses the fp32 cast, log-softmax and the target pick into
# reductions over the matmul's output (a logsumexp per row; no fp32 (N, V) tensor is written), and
# AOTAutograd's partitioner saves the cheapest input of that fused region for backward, the logits in
# the matmul dtype, recomputing the softmax there. Backward's one fused kernel reads those logits and
# the per-row logsumexp and writes d loss / d logits already cast back to the matmul dtype (the
# backward of .float()), which the two LM-head matmuls read. Peak: the saved logits and their
# gradient, both alive in that kernel: 2 x the matmul dtype's bytes per logit (4 under bf16, 8 in
# fp32), against eager's s + 4 + 8 (14, 16). Measured by bench/compiled_loss_memory.py (the table
# in bench/README.md); rows and vectors (lse, targets) are ~1/V of that and not counted.
COMPILED_FULL_LOSS_BYTES = 2
"""Bytes per logit of the compiled full loss, in units of the matmul dtype's size (see above)."""


def loss_bytes(cfg: ModelConfig, tokens: int, *, dtype: str = "bf16", chunked: bool = True,
               device_type: str = "cuda", device_memory: int | None = None, compiled: bool = False) -> int:
    """Peak bytes of the LM head + cross-entropy for `tokens` positions.

    chunked (what the trainer runs: gpt2.loss.linear_cross_entropy): one chunk of rows at a time
    holds its logits in the matmul dtype and in fp32, the fp32 softmax and its gradient (fp32, then
    in the matmul dtype); the finished input gradient (fp32, tokens x h) and the fp32 weight
    gradient with the chunk's part being added to it stay. Plain (`_, loss = model(x, y)`), eager:
    the logits the model returns stay alive, cross-entropy saves fp32 log-probs, and its backward
    makes two fp32 gradients of that size (s + 4 + 8 bytes per logit, s the matmul dtype's size).
    Plain, compiled (COMPILED_FULL_LOSS_BYTES): 2 * s bytes per logit.

    The chunk is the one the model will use: on CUDA it is sized from device_memory (the device's
    total bytes, Hardware.memory_bytes), which is then required.
    """
    from gpt2.loss import loss_chunk_logits, loss_chunks

    s = 2 if dtype in AUTOCAST_DTYPES else 4
    V, h = cfg.vocab_size, cfg.n_embd
    if not chunked:
        return tokens * V * (COMPILED_FULL_LOSS_BYTES * s if compiled else s + 4 + 8)
    if device_type == "cuda" and device_memory is None:
        raise ValueError("loss_bytes needs device_memory on cuda: the loss's chunk size depends on it")
    _, rows = loss_chunks(tokens, max(1, loss_chunk_logits(device_type, device_memory) // V))
    return rows * V * (2 * s + 12) + tokens * h * 4 + 2 * V * h * 4


def memory(cfg: ModelConfig, micro_batch_size: int, seq_len: int, *, world_size: int = 1,
           dtype: str = "bf16", device_type: str = "cuda", chunked_loss: bool = True,
           device_memory: int | None = None, optimizer: str = "adamw", parallel: str = "ddp",
           accum_steps: int = 1, compiled: bool = False) -> Memory:
    """Bytes per device for one training micro-step (see the module docstring). device_memory is the
    device's total bytes, which sizes the loss's chunks on CUDA (see loss_bytes). parallel: ddp or
    fsdp; accum_steps > 1 under fsdp adds the no-sync gradients."""
    n = param_count(cfg)
    autocast = dtype in AUTOCAST_DTYPES
    flash = activation_bytes(cfg, micro_batch_size, seq_len, dtype=dtype, device_type=device_type,
                             flash=True)
    explicit = activation_bytes(cfg, micro_batch_size, seq_len, dtype=dtype, device_type=device_type,
                                flash=False)
    logits = loss_bytes(cfg, micro_batch_size * seq_len, dtype=dtype, chunked=chunked_loss, device_type=device_type,
                        device_memory=device_memory, compiled=compiled)
    mem = Memory(
        weights=4 * n,
        autocast_weights=2 * matmul_weight_count(cfg) if autocast else 0,
        gradients=4 * n,  # also DDP's buckets: gradient_as_bucket_view=True makes them one storage
        optimizer=optimizer_bytes(cfg, optimizer),
        activations_flash=flash,
        activations_explicit=explicit,
        activations=explicit if cfg.attn_impl == "explicit" else flash,
        logits=logits,
        optimizer_name=optimizer,
        chunked_loss=chunked_loss,
    )
    if parallel not in PARALLELS:
        raise ValueError(f"parallel={parallel!r} must be one of {PARALLELS}")
    if parallel == "ddp" or world_size == 1:  # fsdp at world size 1: the trainer does not shard
        return mem
    return fsdp_memory(mem, cfg, world_size, dtype=dtype, device_type=device_type, optimizer=optimizer,
                       accum_steps=accum_steps)


def fsdp_memory(mem: Memory, cfg: ModelConfig, world_size: int, *, dtype: str, device_type: str, optimizer: str,
                accum_steps: int) -> Memory:
    """DDP's memory made FSDP's over world_size ranks: the state sharded (padded), plus what is unsharded
    in flight (module docstring). Activations and the loss are unchanged."""
    shapes = weight_shapes(cfg)
    policy = dtype in AUTOCAST_DTYPES and device_type == "cuda"  # the mixed-precision policy: bf16/fp16 params
    s = 2 if policy else 4
    root = {k: v for k, v in shapes.items() if ".h." not in f".{k}"}
    block = {k: v for k, v in shapes.items() if k.startswith("transformer.h.0.")}
    root_n = gathered_elements(root.values(), world_size)
    block_n = gathered_elements(block.values(), world_size)
    tied_n = gathered_elements([shapes["transformer.wte.weight"]], world_size)  # its gradient: in loss_bytes
    return dataclasses.replace(
        mem, shards=world_size,
        weights=4 * sharded_elements(shapes.values(), world_size),
        gradients=4 * sharded_elements(shapes.values(), world_size),
        optimizer=optimizer_bytes(cfg, optimizer, world_size=world_size),
        autocast_weights=0 if policy else mem.autocast_weights,
        gathered=s * (root_n + min(2, cfg.n_layer) * block_n),
        unit_gradients=s * (root_n - tied_n) + (s + 4) * block_n,
        accum_gradients=4 * gathered_elements(shapes.values(), world_size) if accum_steps > 1 else 0)


def shard_rows(rows: int, world_size: int) -> int:
    """Rows of dim 0 in each rank's FSDP2 shard: torch.chunk's largest chunk, to which FSDP2 pads all."""
    return -(-rows // world_size)


def sharded_elements(shapes, world_size: int) -> int:
    """Elements one rank holds of these parameters under FSDP2 (padding included); at world size 1, all."""
    return sum(shard_rows(s[0], world_size) * math.prod(s[1:]) for s in shapes)


def gathered_elements(shapes, world_size: int) -> int:
    """Elements of these parameters all-gathered: world_size padded shards each (the all-gather's output)."""
    return world_size * sharded_elements(shapes, world_size)


def optimizer_bytes(cfg: ModelConfig, optimizer: str = "adamw", *, world_size: int = 1) -> int:
    """AdamW: two fp32 moments per parameter. Muon: one fp32 momentum per block matrix, AdamW's two
    for the rest (embeddings, biases, LayerNorm; gpt2/optim.py). world_size > 1: one rank's FSDP
    shards of them (the moments are shaped like the sharded parameters, padding included)."""
    if optimizer not in ("adamw", "muon"):
        raise ValueError(f"optimizer={optimizer!r} must be adamw or muon")
    shapes = weight_shapes(cfg)
    if optimizer == "adamw":
        return 8 * sharded_elements(shapes.values(), world_size)
    muon = [s for name, s in shapes.items() if len(s) == 2 and ".h." in f".{name}"]  # as block_matrix_count
    rest = [s for name, s in shapes.items() if not (len(s) == 2 and ".h." in f".{name}")]
    return 8 * sharded_elements(rest, world_size) + 4 * sharded_elements(muon, world_size)


WRITE_BYTES_PER_S = 1e9
"""The write speed the SLURM stop budget assumes (README, "SLURM"): 1 GB/s, a parallel filesystem's
share for one writer; measure yours (bench/checkpoint_stall.py prints it) and pass --write-gb-s."""
STOP_MARGIN_S = 30
"""Start-up of the save, the processes' exit and torchrun's own handling, on top of step and writes."""
REQUEUE_MARGIN_S = 30
"""Between torchrun's grace and the signal lead: the batch shell's `scontrol requeue` after it exits."""


def checkpoint_bytes(cfg: ModelConfig, optimizer: str = "adamw") -> int:
    """Bytes of a checkpoint: fp32 weights and the optimizer state (config, RNG and loader add KBs)."""
    return 4 * param_count(cfg) + optimizer_bytes(cfg, optimizer)


@dataclass(frozen=True)
class StopBudget:
    """What a stop signal needs before torchrun's grace runs out (gpt2/preempt.py, slurm/common.sh)."""
    checkpoint_bytes: int
    step_s: float
    write_bytes_per_s: float

    @property
    def writes_s(self) -> float:
        """A background write may just have started: the stop waits for it, then writes its own."""
        return 2 * self.checkpoint_bytes / self.write_bytes_per_s

    @property
    def grace_s(self) -> int:
        """TORCH_ELASTIC_SHUTDOWN_TIMEOUT at least: finish the step, both writes, a margin."""
        return int(-(-(self.step_s + self.writes_s + STOP_MARGIN_S) // 1))

    @property
    def lead_s(self) -> int:
        """sbatch --signal=B:USR1@lead at least: the grace, then the requeue."""
        return self.grace_s + REQUEUE_MARGIN_S


def format_stop(p: Plan, write_bytes_per_s: float = WRITE_BYTES_PER_S) -> str:
    """One line: the checkpoint's size and the SLURM signal lead and grace it needs."""
    b = StopBudget(checkpoint_bytes(p.cfg, p.memory.optimizer_name), p.step_time_s or 0.0, write_bytes_per_s)
    step = f"{b.step_s:.1f} s step" if p.step_time_s is not None else "a step (no time estimate)"
    return (f"stop       checkpoint {b.checkpoint_bytes / 1e9:.2f} GB; a signal stop needs {step} + 2 writes at "
            f"{write_bytes_per_s / 1e9:g} GB/s ({b.writes_s:.1f} s) + {STOP_MARGIN_S} s: "
            f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT >= {b.grace_s}, sbatch --signal=B:USR1@{b.lead_s} or more")


def matmul_weight_count(cfg: ModelConfig) -> int:
    """Elements of every weight that goes through a matmul (autocast keeps a bf16 copy of each): every
    matrix of config.weight_shapes but the position embedding (a lookup; the token embedding is also
    the tied LM head)."""
    return sum(math.prod(s) for name, s in weight_shapes(cfg).items() if len(s) == 2 and name != POSITION_EMBEDDING)


def block_matrix_count(cfg: ModelConfig) -> int:
    """Elements of the matrices inside the transformer blocks: what Muon updates (gpt2/optim.py
    is_muon_param: 2-D and under .h.)."""
    return sum(math.prod(s) for name, s in weight_shapes(cfg).items() if len(s) == 2 and ".h." in f".{name}")


def activation_bytes(cfg: ModelConfig, batch: int, seq_len: int, *, dtype: str = "bf16",
                     device_type: str = "cuda", flash: bool = True) -> int:
    """Bytes autograd saves for backward outside the loss: embeddings, blocks, final LayerNorm.

    s is the matmul dtype's size. Under autocast the residual stream and LayerNorms stay fp32, so
    every LayerNorm saves a 4-byte input plus fp32 mean and rstd per token.
    """
    s = 2 if dtype in AUTOCAST_DTYPES else 4
    h, nh, L, T = cfg.n_embd, cfg.n_head, cfg.n_layer, seq_len
    qkv_out = cfg.qkv_dim
    layer_norm = 4 * h + 8
    mlp = s * h + s * cfg.mlp_dim + s * cfg.mlp_dim  # inputs of c_fc, GELU, c_proj
    if flash:
        # SDPA saves the (views of the) c_attn output as q, k, v, its output and a log-sum-exp
        # per head. Fused kernels write the output as (B, T, nh, hd), so the .contiguous() before
        # c_proj is free and c_proj saves that same storage.
        attn = s * h + s * qkv_out + s * h + 4 * nh
        per_layer_mask = 0
    else:
        # explicit_attention saves contiguous q, k (k expanded to n_head under GQA), v and the
        # softmax output; no SDPA output copy. CUDA autocast runs softmax in fp32 and then the
        # AV matmul saves its own bf16 copy of the probabilities: 4 + 2 bytes. CPU autocast
        # keeps softmax in bf16.
        probs = 6 if (dtype in AUTOCAST_DTYPES and device_type == "cuda") else s
        attn = s * h + 3 * s * h + probs * nh * T + s * h
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
            dropout += nh * T * 12 + (3 * s * h if dtype in AUTOCAST_DTYPES else 0)
    per_token_layer = 2 * layer_norm + attn + mlp + dropout
    per_token_rest = 8 + 8 + layer_norm + s * h  # token ids, targets, ln_f, LM-head input
    per_token_rest += (h if device_type == "cuda" else 4 * h) if cfg.dropout > 0 else 0  # embedding's
    return batch * T * (L * per_token_layer + per_token_rest) + L * per_layer_mask


def max_micro_batch_size(cfg: ModelConfig, seq_len: int, hardware: Hardware, *, world_size: int = 1,
                         dtype: str = "bf16", optimizer: str = "adamw", parallel: str = "ddp",
                         total_batch_size: int | None = None, accumulate: bool | None = None) -> int:
    """Largest micro-batch whose total fits in memory minus the reserve (0: not even one sequence).

    Memory grows with the micro-batch (activations linearly; the chunked loss by at most one chunk),
    so the largest fitting size is found by doubling and then bisecting. Under fsdp, a micro-batch
    that needs accumulation also holds the no-sync gradients: the search assumes accumulation, then
    the one micro-batch without it (all of a rank's total_batch_size sequences at once, if that
    divides) is tried on its own. accumulate=False counts no no-sync gradients at any size (a
    reduce-scatter per micro-step: the alternative the plan reports).
    """
    usable = hardware.memory_bytes - hardware.reserve_bytes

    def fits(b: int, accum: int = 2 if accumulate is not False else 1) -> bool:
        return memory(cfg, b, seq_len, world_size=world_size, dtype=dtype, device_type=hardware.device_type,
                      device_memory=hardware.memory_bytes, optimizer=optimizer, parallel=parallel,
                      accum_steps=accum).total <= usable

    whole = None  # the micro-batch with no accumulation, when there is one
    if total_batch_size is not None and total_batch_size % (seq_len * world_size) == 0:
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


def auto_micro_batch_size(cfg: ModelConfig, seq_len: int, hardware: Hardware, *, world_size: int,
                          total_batch_size: int, dtype: str, optimizer: str = "adamw", parallel: str = "ddp") -> int:
    """--micro-batch-size auto: the largest micro-batch that fits (max_micro_batch_size) and divides
    the global batch, so that accumulation stays a whole number of micro-steps."""
    grad_accum_steps(total_batch_size, 1, seq_len, world_size)  # some micro-batch divides: else its error
    fits = max_micro_batch_size(cfg, seq_len, hardware, world_size=world_size, dtype=dtype, optimizer=optimizer,
                                parallel=parallel, total_batch_size=total_batch_size)
    if fits == 0:
        raise ValueError(does_not_fit(cfg, seq_len, hardware, world_size=world_size, dtype=dtype, optimizer=optimizer,
                                      parallel=parallel))
    seqs = total_batch_size // (seq_len * world_size)  # sequences per rank per optimizer step
    return max(b for b in range(1, min(fits, seqs) + 1) if seqs % b == 0)


def does_not_fit(cfg: ModelConfig, seq_len: int, hardware: Hardware, *, world_size: int, dtype: str,
                 optimizer: str = "adamw", parallel: str = "ddp") -> str:
    """The one message for a model that cannot train even one sequence per device: which model, where,
    what it needs against what there is, and the changes that would make it fit."""
    def one(**change) -> Memory:
        kw = dict(world_size=world_size, dtype=dtype, device_type=hardware.device_type,
                  device_memory=hardware.memory_bytes, optimizer=optimizer, parallel=parallel, accum_steps=2)
        return memory(cfg, 1, seq_len, **{**kw, **change})

    need, usable = one(), hardware.memory_bytes - hardware.reserve_bytes
    sharded = parallel == "fsdp" and world_size > 1
    options = ["a smaller model (a smaller --preset, or --n-layer/--n-embd)"]
    if not sharded and world_size > 1 and one(parallel="fsdp").total <= usable:
        options.append(f"--parallel fsdp (state sharded over the {world_size} ranks: {_gib(one(parallel='fsdp').total)})")
    if parallel == "fsdp" and world_size == 1:
        options.append("several ranks (--parallel fsdp shards over the ranks; one process holds everything)")
    if sharded and need.accum_gradients and need.total - need.accum_gradients <= usable:
        options.append(f"no gradient accumulation (FSDP's no-sync keeps {_gib(need.accum_gradients)} of unsharded "
                       f"gradients between micro-steps: a smaller --total-batch-size or more ranks)")
    if need.static <= usable:  # the micro-batch's own memory is what overflows: shorter or 16-bit helps
        options.append("a shorter --block-size")
        if dtype not in AUTOCAST_DTYPES:
            options.append("--dtype bfloat16")
    if optimizer == "adamw" and one(optimizer="muon").total <= usable:
        options.append(f"--optimizer muon (one moment per block matrix: {_gib(one(optimizer='muon').total)})")
    options.append("a device with more memory" if not sharded else "more ranks or a device with more memory")
    state = ("which DDP keeps whole on every rank however many there are" if not sharded else
             f"each rank's 1/{world_size} shard plus the gathered units and unsharded gradients FSDP holds")
    return (f"{describe_model(cfg)} does not fit on {hardware.name} ({_gib(hardware.memory_bytes)}) with "
            f"{'FSDP' if sharded else 'DDP'} at world size {world_size}: micro_batch_size=1 needs {_gib(need.total)} "
            f"per device ({_gib(need.static)} of weights, gradients and {optimizer} state, {state}) but "
            f"{_gib(usable)} is usable ({_gib(hardware.reserve_bytes)} reserved); use "
            + ", ".join(options[:-1]) + f" or {options[-1]}")


# --loss-impl auto takes the full-logits loss when its peak (loss_bytes(chunked=False)) is at most
# 1/FULL_LOSS_MEMORY_SHARE of the device's usable memory and the whole plan with it still fits.
# Why a share at all, when "the plan fits" is also checked: the full path's peak is four (B, T, V)
# tensors made and freed every micro-step, the largest single term of the plan, so an error in the
# estimate or the allocator's fragmentation around such blocks costs most there; a CPU's "device"
# is host RAM that the page cache, the data loader and other processes share. At 1/8 an estimate
# wrong by a whole (B, T, V) fp32 tensor (a quarter of the fp32 peak) costs at most 1/32 of the
# memory, and 7/8 stays for everything else. Why not less: at 1/16 the
# W1 workload (6 x 384, micro-batch 8 x 256, fp32: 1.54 GiB of full-logits peak, 6.8% of the
# 22.5 GiB a 23.5 GiB host leaves usable) would stay chunked and pay the chunk loop's ~1.3x
# compiled LM-head time (issue 23, bench/loss.py); 1/8 takes the full loss there and on the quick start, and keeps the chunked
# one where the logits are large, e.g. the gpt2 preset at 64 x 1024 under bf16 compiled (12.3 GiB,
# 16% of an 80 GB A100; at 16 x 1024 it is 3.1 GiB and takes nanoGPT's one fused cross-entropy, where
# eager's 14 bytes per logit, 10.7 GiB, would chunk it). Order: the micro-batch is chosen first (auto: the largest that fits with the
# chunked loss, as before), then the loss path for that micro-batch. The micro-batch is the larger
# lever (fewer accumulation steps, larger matmuls) and the chunked loss is what lets it grow, so a
# joint choice would trade micro-batch for logits; and this way --loss-impl never changes the
# micro-batch, so the two paths run the same batch maths and agree to rounding. Uncompiled runs
# (--compile false: the debug preset, the quick start) take the full loss where it fits only when
# it measured clearly faster on this CPU at the run's shape (gpt2/loss_probe.py: faster at 384 wide,
# slower at 128 wide on one CPU; the crossover moves with the CPU); unmeasured, the chunked one.
FULL_LOSS_MEMORY_SHARE = 8
"""auto picks the full-logits loss when its peak is at most 1/FULL_LOSS_MEMORY_SHARE of usable memory."""


@dataclass(frozen=True)
class LossChoice:
    """The loss path a run takes ('full' or 'chunked') and why, as logged and written to config.json."""
    impl: str
    reason: str

    def describe(self) -> str:
        """The start-up line."""
        what = ("full logits: F.cross_entropy over the (B, T, V) logits" if self.impl == "full" else
                "chunked: gpt2/loss.py's linear_cross_entropy, never all (B, T, V) logits at once")
        return f"loss       {what} ({self.reason})"

    def to_dict(self) -> dict:
        return {"impl": self.impl, "reason": self.reason}


def choose_loss_impl(cfg: ModelConfig, requested: str, *, micro_batch_size: int, hardware: Hardware,
                     world_size: int = 1, dtype: str = "bf16", optimizer: str = "adamw", compiled: bool = True,
                     seq_len: int | None = None, parallel: str = "ddp", accum_steps: int = 1,
                     measure_eager=None) -> LossChoice:
    """The loss path for a micro-batch already chosen (see FULL_LOSS_MEMORY_SHARE). requested: the
    TrainConfig.loss_impl, auto, chunked or full; compiled: TrainConfig.compile. Uncompiled, auto takes
    the full loss only where it also fits and measure_eager() (gpt2.loss_probe.EagerLossTimes of this
    CPU at this shape, asked only then) found it clearly faster; with nothing to measure (None: a GPU, a
    rehearsal for other hardware), the chunked one.
    An explicit full that cannot fit the device's whole memory is refused, as check_fits refuses an
    explicit micro-batch (same threshold); one that only exceeds the share or the reserve is taken,
    and the reason says so."""
    seq_len = cfg.block_size if seq_len is None else seq_len
    if requested == "chunked":
        return LossChoice("chunked", "--loss-impl chunked")
    if requested not in ("auto", "full"):
        raise ValueError(f"loss_impl={requested!r} must be auto, chunked or full")
    # What the full loss really holds: compiled, inductor's fused loss (COMPILED_FULL_LOSS_BYTES);
    # uncompiled, eager's several (B, T, V) tensors.
    peak = loss_bytes(cfg, micro_batch_size * seq_len, dtype=dtype, chunked=False, compiled=compiled)
    total = memory(cfg, micro_batch_size, seq_len, world_size=world_size, dtype=dtype,
                   device_type=hardware.device_type, device_memory=hardware.memory_bytes, optimizer=optimizer,
                   chunked_loss=False, parallel=parallel, accum_steps=accum_steps, compiled=compiled).total
    usable = hardware.memory_bytes - hardware.reserve_bytes
    share = usable // FULL_LOSS_MEMORY_SHARE
    logits = f"full-logits peak {_gib(peak)} at micro-batch {micro_batch_size}"
    if requested == "full":
        if total > hardware.memory_bytes:
            raise ValueError(f"--loss-impl full: the plan with the {logits} needs {_gib(total)} per device but "
                             f"{hardware.name} has {_gib(hardware.memory_bytes)}; use --loss-impl chunked (or "
                             f"auto), or a smaller --micro-batch-size")
        over = [] if peak <= share else [f"above the 1/{FULL_LOSS_MEMORY_SHARE} share auto allows"]
        over += [] if total <= usable else [f"plan {_gib(total)} over the {_gib(usable)} usable"]
        return LossChoice("full", f"--loss-impl full; {logits}" + (f", {' and '.join(over)}" if over else ""))
    if peak > share:
        return LossChoice("chunked", f"auto: {logits} > 1/{FULL_LOSS_MEMORY_SHARE} of {_gib(usable)} usable")
    if total > usable:
        return LossChoice("chunked", f"auto: {logits} is within 1/{FULL_LOSS_MEMORY_SHARE} of {_gib(usable)} "
                                     f"usable but the plan with it, {_gib(total)}, does not fit")
    fits = f"{logits} <= 1/{FULL_LOSS_MEMORY_SHARE} of {_gib(usable)} usable, plan with it {_gib(total)} fits"
    if not compiled:
        if measure_eager is None:
            return LossChoice("chunked", f"auto: uncompiled and not measured on {hardware.name}, the chunked loss "
                                         "(the faster one uncompiled at small widths, bench/eager_loss.py)")
        eager_times = measure_eager()
        if not eager_times.full_is_faster:
            return LossChoice("chunked", f"auto: uncompiled, {eager_times.describe()}")
        return LossChoice("full", f"auto: {fits}; uncompiled, {eager_times.describe()}")
    return LossChoice("full", f"auto: {fits}; the faster path compiled")


def plan_run(cfg: RunConfig, hardware: Hardware, *, world_size: int, tokens: int | None = None,
             mfu: float = 0.4) -> Plan:
    """The plan of a training run: what the trainer logs at start-up, `train_ddp.py --dry-run` prints and
    `python -m gpt2.plan --preset X` shows, from one RunConfig. cfg.train.dtype is resolved (not auto);
    micro_batch_size may be auto (auto_micro_batch_size) and loss_impl too (choose_loss_impl, for that
    micro-batch); tokens default to max_steps x total_batch_size."""
    tc = cfg.train
    dtype = short_name(tc.dtype, tf32=tc.tf32 and hardware.device_type == "cuda")
    mb = tc.micro_batch_size
    if mb == "auto":
        mb = auto_micro_batch_size(cfg.model, cfg.model.block_size, hardware, world_size=world_size,
                                   total_batch_size=tc.total_batch_size, dtype=dtype, optimizer=tc.optimizer,
                                   parallel=tc.parallel)
    accum = grad_accum_steps(tc.total_batch_size, mb, cfg.model.block_size, world_size)
    loss = choose_loss_impl(cfg.model, tc.loss_impl, micro_batch_size=mb, hardware=hardware, world_size=world_size,
                            dtype=dtype, optimizer=tc.optimizer, compiled=tc.compile, parallel=tc.parallel,
                            accum_steps=accum)
    return plan(cfg.model, micro_batch_size=mb, hardware=hardware, world_size=world_size, dtype=dtype,
                total_batch_size=tc.total_batch_size, mfu=mfu, optimizer=tc.optimizer, parallel=tc.parallel,
                chunked_loss=loss.impl == "chunked", compiled=tc.compile,
                tokens=tc.max_steps * tc.total_batch_size if tokens is None else tokens)


def measured_peak_bytes(fn, device: torch.device | str) -> int:
    """Peak bytes allocated while fn() runs, above what was allocated when it started.

    CUDA: the caching allocator's max_memory_allocated. CPU: the CPU allocator's own allocation
    and free events as torch.profiler records them (profile_memory=True), replayed in time order:
    real tensors and workspaces, transients included, unlike RSS (which also moves with glibc's
    caching and page faults) or the tensors saved for backward (which miss the transients).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with _quiet_kineto(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


KINETO_QUIET_LEVEL = "6"
"""Above kineto's highest log level, USDT (5): kineto (torch.profiler's backend) logs "USDT: ...
profiler_start" and "profiler_stop" to stderr on every profile, at a level above ERROR, so no level
keeps its errors and drops those lines."""


@contextlib.contextmanager
def _quiet_kineto():
    """KINETO_LOG_LEVEL for the profiler's first start in this process, when kineto reads it once.

    Our profile only counts allocations, so kineto's own logging is noise to a user; a level the
    user set is left alone, and the variable is removed again afterwards.
    """
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = KINETO_QUIET_LEVEL
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


def check_fits(p: Plan) -> None:
    """Refuse a plan that clearly cannot fit (total above the device's whole memory).

    A plan that only overflows the reserve is allowed: the reserve is an estimate and the run
    finds out at its first step.
    """
    if p.memory.total <= p.hardware.memory_bytes:
        return
    if p.max_micro_batch_size == 0:
        raise ValueError(does_not_fit(p.cfg, p.seq_len, p.hardware, world_size=p.world_size, dtype=p.dtype,
                                      optimizer=p.memory.optimizer_name, parallel=p.parallel))
    b = p.max_micro_batch_size
    fix = f"use --micro-batch-size {b} or less (auto: the largest that fits and divides)"
    accumulating = max_micro_batch_size(p.cfg, p.seq_len, p.hardware, world_size=p.world_size, dtype=p.dtype,
                                        optimizer=p.memory.optimizer_name, parallel=p.parallel)
    if accumulating < b:  # fsdp: b is the micro-batch without accumulation, which keeps no no-sync gradients
        fix = f"use --micro-batch-size {b} (one micro-step: no unsharded gradients kept)" + (
            f" or, accumulating, {accumulating} or less" if accumulating else
            ": with accumulation not even 1 fits (FSDP's no-sync keeps the whole model's gradients unsharded)")
    per_total = b * p.seq_len * p.world_size
    if p.total_batch_size % per_total == 0 and p.total_batch_size > per_total:
        fix += f" (the same total batch with {p.total_batch_size // per_total} accumulation steps)"
    raise ValueError(f"micro_batch_size={p.micro_batch_size} needs {_gib(p.memory.total)} per device "
                     f"but {p.hardware.name} has {_gib(p.hardware.memory_bytes)}; {fix}")


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:g}"


def format_plan(p: Plan) -> str:
    """The planner's summary, as printed by `python -m gpt2.plan` and at trainer start-up."""
    c, m, hw = p.cfg, p.memory, p.hardware
    lines = [
        f"model      n_layer={c.n_layer} n_head={c.n_head} n_kv_head={c.n_kv_head} n_embd={c.n_embd} "
        f"block_size={c.block_size} vocab_size={c.vocab_size} attn_impl={c.attn_impl}",
        f"params     {p.n_params:,} exact ({_human(p.n_params)}); formula V*h + T*h + L*(12h^2+13h) + 2h "
        f"= {p.n_params_formula:,}",
        f"hardware   {p.world_size} x {hw.name}: {_gib(hw.memory_bytes)}, peak "
        + (f"{format_flops(hw.peak_flops)} ({p.dtype}) each" if hw.peak_flops is not None
           else f"unknown ({p.dtype}: " + ("no data-sheet peak for this GPU)" if hw.device_type == "cuda"
                                              else "the measured peak was not usable)")),
        f"batch      micro_batch_size={p.micro_batch_size} x seq_len={p.seq_len} x world_size={p.world_size}"
        f" = {p.tokens_per_micro_step:,} tokens/micro-step; total_batch_size={p.total_batch_size:,} "
        f"-> {p.grad_accum_steps} accumulation step(s)",
        _memory_heading(p),
        f"  weights                {_gib(m.weights)}  (fp32, 4 B/param{_per_shard(m)})",
    ]
    if m.autocast_weights:
        lines.append(f"  autocast {p.dtype} copies   {_gib(m.autocast_weights)}  (matmul weights, saved for backward)")
    lines.append(f"  gradients              {_gib(m.gradients)}  (fp32{_per_shard(m)})")
    flash_mark, explicit_mark = ("<-", "  ") if c.attn_impl != "explicit" else ("  ", "<-")
    lines += [
        (f"  optimizer (AdamW)      {_gib(m.optimizer)}  (two fp32 moments{_per_shard(m)})" if m.optimizer_name == "adamw"
         else f"  optimizer (Muon+AdamW) {_gib(m.optimizer)}  (fp32 momentum per block matrix, two moments for the "
              f"rest{_per_shard(m)})"),
        *_fsdp_lines(p),
        f"  activations, flash     {_gib(m.activations_flash)} {flash_mark}",
        f"  activations, explicit  {_gib(m.activations_explicit)} {explicit_mark} (stores B*nh*T*T probabilities)",
        f"  LM head + loss peak    {_gib(m.logits)}  "
        + ("(chunked: never all B*T*V logits at once)" if m.chunked_loss else
           "(full logits: all B*T*V at once, F.cross_entropy)"),
        f"  total                  {_gib(m.total)}  of {_gib(p.usable_bytes)} usable "
        f"({_gib(hw.reserve_bytes)} reserved)",
        f"fits       {'yes' if p.fits else 'NO'}; largest micro_batch_size that fits: {p.max_micro_batch_size}",
        *([accum] if (accum := format_accumulation(p)) else []),
        f"compute    {_human(p.flops_per_token)}FLOP/token (6N + 12*L*h*T); "
        + (f"at {p.mfu:.0%} MFU: {_human(p.tokens_per_s)} tokens/s, {p.step_time_s:.3f} s/step"
           if p.tokens_per_s is not None else "no time estimate without a peak"),
    ]
    if p.hours is not None:
        lines.append(f"budget     {_human(p.tokens)} tokens: {p.tokens / p.total_batch_size:,.0f} steps, "
                     f"{p.hours:.2f} h ({p.hours * p.world_size:.1f} device-hours)")
    return "\n".join(lines)


def _memory_heading(p: Plan) -> str:
    if p.memory.shards > 1:
        return (f"memory per device (FSDP over {p.world_size} ranks: each holds a 1/{p.world_size} shard of every "
                f"parameter, dim 0 padded to a multiple of {p.world_size}; `--parallel ddp` keeps it all on every rank):")
    if p.parallel == "fsdp":
        return "memory per device (--parallel fsdp at world size 1: nothing to shard, the plain model):"
    return "memory per device:"


def _per_shard(m: Memory) -> str:
    return f", 1/{m.shards} shard" if m.shards > 1 else ""


def _fsdp_lines(p: Plan) -> list[str]:
    """FSDP's unsharded memory in flight, and how gradient accumulation is counted (module docstring)."""
    m = p.memory
    if m.shards == 1:
        return []
    dtype = p.dtype if p.dtype in AUTOCAST_DTYPES and p.hardware.device_type == "cuda" else "fp32"  # the policy
    lines = [f"  gathered weights       {_gib(m.gathered)}  ({dtype}: the root unit (tied wte/LM head, wpe, ln_f) "
             f"all step + 2 blocks, one prefetched)",
             f"  unsharded gradients    {_gib(m.unit_gradients)}  (one block's before its reduce-scatter, the root's "
             f"through backward; the tied wte's is the loss term's)"]
    if m.accum_gradients:
        lines.append(f"  no-sync gradients      {_gib(m.accum_gradients)}  (fp32, whole model unsharded: kept between "
                     f"the {p.grad_accum_steps} micro-steps)")
    return lines


def format_accumulation(p: Plan) -> str | None:
    """FSDP with accumulation: which way the plan counts it, and when the other way is what fits."""
    m = p.memory
    if not m.accum_gradients:
        return None
    usable = p.usable_bytes
    largest = max_micro_batch_size(p.cfg, p.seq_len, p.hardware, world_size=p.world_size, dtype=p.dtype,
                                   optimizer=m.optimizer_name, parallel=p.parallel, accumulate=False)
    rs = (f"a reduce-scatter per micro-step would keep only the shards: {_gib(p.rs_total)}, largest micro-batch "
          f"{largest}")
    if p.fits:
        verdict = "fits as counted"
    elif p.rs_total <= usable:
        verdict = ("does NOT fit with no-sync but WOULD with a reduce-scatter per micro-step (the trainer uses "
                   "no-sync); or fewer micro-steps: a larger micro-batch, a smaller --total-batch-size or more ranks")
    else:
        verdict = "fits neither way"
    return f"accumulate FSDP no-sync (counted): {_gib(m.total)}; {rs}. {verdict}"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m gpt2.plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2", choices=sorted(MODEL_PRESETS))
    for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, help="override the preset's " + name)
    ap.add_argument("--attn-impl", choices=("sdpa", "sdpa_mask", "explicit"))
    ap.add_argument("--block-size", type=int, help="sequence length (default: the preset's)")
    ap.add_argument("--micro-batch-size", type=_int_or_auto, default="auto",
                    help="sequences per device per micro-step (default auto, as the training presets)")
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--dtype", default="bf16", choices=PLAN_DTYPES)
    ap.add_argument("--gpu", default="A100-80GB", choices=list(GPUS))
    ap.add_argument("--gpu-memory-gb", type=float, help="custom device memory in GiB (overrides --gpu)")
    ap.add_argument("--gpu-peak-tflops", type=float, help="custom peak TFLOP/s in --dtype (overrides --gpu)")
    ap.add_argument("--total-batch-size", type=int,
                    help="tokens per optimizer step (default: the training preset's, e.g. 524288 for gpt2)")
    ap.add_argument("--tokens", type=float,
                    help="training budget in tokens, e.g. 10e9 (default: the preset's max_steps x total batch)")
    ap.add_argument("--mfu", type=float, default=0.4, help="assumed MFU for time estimates (default 0.4)")
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"), help="what the optimizer state counts")
    ap.add_argument("--parallel", default="ddp", choices=PARALLELS,
                    help="ddp (every rank holds everything) or fsdp (state sharded over --world-size ranks)")
    ap.add_argument("--write-gb-s", type=float, default=WRITE_BYTES_PER_S / 1e9,
                    help="checkpoint write speed for the SLURM stop budget (default 1 GB/s)")
    ap.add_argument("--loss-impl", default="auto", choices=("auto", "chunked", "full"),
                    help="the loss path the memory counts (default auto: as train_ddp.py chooses it)")
    return ap


def _int_or_auto(text: str) -> int | str:
    return "auto" if text == "auto" else int(text)


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The run `train_ddp.py --preset P` would make (TRAIN_PRESETS[P]), with the flags' overrides."""
    overrides = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size",
                                                "attn_impl", "block_size") if getattr(args, k) is not None}
    cfg = model_preset(args.preset, **overrides)
    train = {**TRAIN_PRESETS.get(args.preset, {}), "micro_batch_size": args.micro_batch_size,
             "optimizer": args.optimizer, "loss_impl": args.loss_impl, "parallel": args.parallel}
    train["dtype"], train["tf32"] = from_short_name(args.dtype)
    if args.total_batch_size is not None:
        train["total_batch_size"] = args.total_batch_size
    if args.world_size < 1:
        raise ValueError(f"world_size={args.world_size} must be >= 1")
    hw = custom_hardware(args.gpu, args.dtype, memory_gb=args.gpu_memory_gb, peak_tflops=args.gpu_peak_tflops)
    tokens = None if args.tokens is None else int(args.tokens)
    return plan_run(RunConfig(cfg, TrainConfig(**train)), hw, world_size=args.world_size, tokens=tokens,
                    mfu=args.mfu)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        p = plan_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_plan(p))
    print(format_stop(p, args.write_gb_s * 1e9))
    if p.memory.total > p.hardware.memory_bytes:
        try:
            check_fits(p)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
