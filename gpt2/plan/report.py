"""The planner's printed report: the plan, its memory lines, FSDP's accumulation verdict, the stop line."""

from __future__ import annotations

from gpt2.core.config import ARCHS, TRAIN_PRESETS, ModelConfig, TrainConfig
from gpt2.core.host_memory import CHECKPOINT_COPY_KEEP_BYTES, checkpoint_copy_kept
from gpt2.core.precision import AUTOCAST_DTYPES
from gpt2.plan.budget import STOP_MARGIN_S, WRITE_BYTES_PER_S, StopBudget, checkpoint_bytes
from gpt2.plan.flops import format_flops
from gpt2.plan.hardware import gib, human, usable_note
from gpt2.plan.memory import Memory, heap_slack, max_micro_batch_size, resident_total
from gpt2.plan.planner import Plan


def format_stop(p: Plan, write_bytes_per_s: float = WRITE_BYTES_PER_S) -> str:
    """One line: the checkpoint's size and the SLURM signal lead and grace it needs."""
    b = StopBudget(checkpoint_bytes(p.cfg, p.memory.optimizer_name), p.step_time_s or 0.0, write_bytes_per_s)
    step = f"{b.step_s:.1f} s step" if p.step_time_s is not None else "a step (no time estimate)"
    return (
        f"stop       checkpoint {b.checkpoint_bytes / 1e9:.2f} GB; a signal stop needs {step} + 2 writes at "
        f"{write_bytes_per_s / 1e9:g} GB/s ({b.writes_s:.1f} s) + {STOP_MARGIN_S} s: "
        f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT >= {b.grace_s}, sbatch --signal=B:USR1@{b.lead_s} or more"
    )


def arch_options(c: ModelConfig) -> str:
    """The architecture options that differ from GPT-2's (ARCHS["gpt2"]), as ' rope=True ...', or ''."""
    return "".join(f" {k}={getattr(c, k)}" for k, v in ARCHS["gpt2"].items() if getattr(c, k) != v)


def format_plan(p: Plan) -> str:
    """The planner's summary, as printed by `python -m gpt2.plan` and at trainer start-up."""
    c, m, hw = p.cfg, p.memory, p.hardware
    lines = [
        f"model      n_layer={c.n_layer} n_head={c.n_head} n_kv_head={c.n_kv_head} n_embd={c.n_embd} "
        f"block_size={c.block_size} vocab_size={c.vocab_size} attn_impl={c.attn_impl}{arch_options(c)}",
        f"params     {p.n_params:,} exact ({human(p.n_params)}); formula V*h + T*h + L*(12h^2+13h) + 2h "
        f"= {p.n_params_formula:,}" + (" (GPT-2's layout)" if arch_options(c) else ""),
        f"hardware   {p.world_size} x {hw.name}: {gib(hw.memory_bytes)}, peak "
        + (
            f"{format_flops(hw.peak_flops)} ({p.dtype}) each"
            if hw.peak_flops is not None
            else f"unknown ({p.dtype}: "
            + ("no data-sheet peak for this GPU)" if hw.device_type == "cuda" else "the measured peak was not usable)")
        ),
        f"batch      micro_batch_size={p.micro_batch_size} x seq_len={p.seq_len} x world_size={p.world_size}"
        f" = {p.tokens_per_micro_step:,} tokens/micro-step; total_batch_size={p.total_batch_size:,} "
        f"-> {p.grad_accum_steps} accumulation step(s)" + _batch_warmup(p),
        _memory_heading(p),
        f"  weights                {gib(m.weights)}  (fp32, 4 B/param{_per_shard(m)})",
    ]
    if m.autocast_weights:
        lines.append(f"  autocast {p.dtype} copies   {gib(m.autocast_weights)}  (matmul weights, saved for backward)")
    lines.append(f"  gradients              {gib(m.gradients)}  (fp32{_per_shard(m)})")
    flash_mark, explicit_mark = ("<-", "  ") if c.attn_impl != "explicit" else ("  ", "<-")
    if m.checkpointed:
        flash_mark = explicit_mark = "  "
    lines += [
        (
            f"  optimizer (AdamW)      {gib(m.optimizer)}  (two fp32 moments{_per_shard(m)})"
            if m.optimizer_name == "adamw"
            else f"  optimizer (Muon+AdamW) {gib(m.optimizer)}  (fp32 momentum per block matrix, two moments for the "
            f"rest{_per_shard(m)})"
        ),
        *_fsdp_lines(p),
        f"  activations, flash     {gib(m.activations_flash)} {flash_mark}",
        f"  activations, explicit  {gib(m.activations_explicit)} {explicit_mark} (stores B*nh*T*T probabilities)",
        f"  activations, full AC   {gib(m.activations_checkpointed)} {'<-' if m.checkpointed else '  '} "
        f"(activation checkpointing: block inputs + one block's, recomputed in backward)",
        f"  LM head + loss peak    {gib(m.logits)}  "
        + (
            "(chunked: never all B*T*V logits at once)"
            if m.chunked_loss
            else "(full logits: all B*T*V at once, F.cross_entropy)"
        ),
        *(
            [f"  last block's backward  {gib(m.block_backward)}  (above the loss's peak, every block's saved)"]
            if m.block_backward
            else []
        ),
        f"  total                  {gib(m.total)}  of {gib(p.usable_bytes)} usable {usable_note(hw)}",
        f"fits       {'yes' if p.fits else 'NO'}; largest micro_batch_size that fits: {p.max_micro_batch_size}",
        format_host(p),
        *([accum] if (accum := format_accumulation(p)) else []),
        f"compute    {human(p.flops_per_token)}FLOP/token (6N + 12*L*h*T); "
        + (
            f"at {p.mfu:.0%} MFU: {human(p.tokens_per_s)} tokens/s, {p.step_time_s:.3f} s/step"
            if p.tokens_per_s is not None
            else "no time estimate without a peak"
        ),
        *([_recompute_line(p)] if p.activation_checkpointing else []),
    ]
    if p.hours is not None:
        lines.append(
            f"budget     {human(p.tokens)} tokens: {p.tokens / p.total_batch_size:,.0f} steps, "
            f"{p.hours:.2f} h ({p.hours * p.world_size:.1f} device-hours)"
        )
    return "\n".join(lines)


def format_host(p: Plan) -> str:
    """One line: what rank 0's host holds beside the run for its background checkpoints (gpt2/ckpt/writer.py), a
    copy of the state that is kept and pinned up to CHECKPOINT_COPY_KEEP_BYTES, and pageable and held only while
    a write is in flight above it; none where checkpoints are written synchronously."""
    if p.memory.shards > 1:
        return (
            "host       no checkpoint copy: fsdp's sharded checkpoints are written synchronously by every rank "
            "(--async-ckpt applies to .pt checkpoints)"
        )
    if not p.run.train.ckpt.async_ckpt:
        return "host       no checkpoint copy: --async-ckpt false writes each checkpoint synchronously"
    size = checkpoint_bytes(p.cfg, p.memory.optimizer_name)
    pinned, kept = checkpoint_copy_kept(size, cuda=p.hardware.device_type == "cuda")
    how = (
        f"{'pinned, ' if pinned else ''}kept from the first save to the end of the run"
        if kept
        else f"pageable, held only while a write is in flight: over {gib(CHECKPOINT_COPY_KEEP_BYTES)}, it is not kept"
    )
    return (
        f"host       rank 0's copy of the state for a background checkpoint (--async-ckpt): {gib(size)} ({how}); "
        "the other ranks hold none"
    )


def _recompute_line(p: Plan) -> str:
    share = p.recompute_flops_per_token / p.flops_per_token
    return (
        f"recompute  activation checkpointing full: +{human(p.recompute_flops_per_token)}FLOP/token "
        f"(+{share:.0%}) recomputed, not in MFU; the estimate above spends {p.mfu:.0%} of the peak on both, "
        f"so the run's logged MFU would be {p.model_mfu:.0%}"
    )


def _batch_warmup(p) -> str:
    """The batch line's tail for --batch-warmup-steps: its stages' micro-steps (the first of each rank's)."""
    b = p.run.train.batch
    if not b.batch_warmup_steps:
        return ""
    n = b.batch_warmup_stages + 1
    steps = ", ".join(str(p.grad_accum_steps * j // n) for j in range(1, n))
    stretches = f"{b.batch_warmup_stages} equal stretches"
    return f"; steps 0-{b.batch_warmup_steps - 1} warm up with {steps} of them ({stretches})"


def _memory_heading(p: Plan) -> str:
    if p.memory.shards > 1:
        return (
            f"memory per device (FSDP over {p.world_size} ranks: each holds a 1/{p.world_size} shard of every "
            f"parameter, dim 0 padded to a multiple of {p.world_size}; `--parallel ddp` keeps it all on every rank):"
        )
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
    lines = [
        f"  gathered weights       {gib(m.gathered)}  ({dtype}: the root unit (tied wte/LM head, wpe, ln_f) "
        f"all step + 2 blocks, one prefetched)",
        f"  unsharded gradients    {gib(m.unit_gradients)}  (one block's before its reduce-scatter, the root's "
        f"through backward; the tied wte's is the loss term's)",
    ]
    if m.accum_gradients:
        lines.append(
            f"  no-sync gradients      {gib(m.accum_gradients)}  (fp32, whole model unsharded: kept between "
            f"the {p.grad_accum_steps} micro-steps)"
        )
    return lines


def format_accumulation(p: Plan) -> str | None:
    """FSDP with accumulation: which way the plan counts it, and when the other way is what fits."""
    m = p.memory
    if not m.accum_gradients:
        return None
    usable = p.usable_bytes
    largest = max_micro_batch_size(p.run, p.hardware, world_size=p.world_size, accumulate=False)
    rs = f"a reduce-scatter per micro-step would keep only the shards: {gib(p.rs_total)}, largest micro-batch {largest}"
    if p.fits:
        verdict = "fits as counted"
    elif p.rs_total <= usable:
        verdict = (
            "does NOT fit with no-sync but WOULD with a reduce-scatter per micro-step (the trainer uses "
            "no-sync); or fewer micro-steps: a larger micro-batch, a smaller --total-batch-size or more ranks"
        )
    else:
        verdict = "fits neither way"
    return f"accumulate FSDP no-sync (counted): {gib(m.total)}; {rs}. {verdict}"


def plan_line(p, log_path, *, shown: bool, held: int | None = None, probe: int | None = None) -> str:
    """The plan in one console line (the start-up's, gpt2/train/startup.py check_memory): memory against the
    device, the estimated speed, where the rest is. shown: --verbose printed the whole plan above it. held: on
    a CPU, what this process holds now (Python, torch, the loaders, the libraries' first use: check_memory
    warms them up first): the plan counts what training adds to it, a user reads the sum (`/usr/bin/time -v`'s
    maximum resident set, per process), so the line gives the sum and its parts (gpt2.plan.memory.resident_total).
    probe: what the start-up's probes (the loss path's, auto's micro-batch's) grew by in this start (a new
    shape), counted where it is above training's own; they run on rank 0 alone, so with several ranks the line
    gives rank 0's total apart."""
    speed = (
        "no time estimate (no peak FLOP/s)"
        if p.step_time_s is None
        else f"~{p.step_time_s:.3g} s/step at {p.mfu:.0%} MFU"
    )
    where = "above" if shown else f"in {log_path} (--verbose prints it)"
    if held is None:
        memory = f"{gib(p.memory.total)} of {gib(p.usable_bytes)} usable per rank"
    else:
        heap = heap_slack(p.cfg.n_layer, p.cfg.n_embd, p.micro_batch_size * p.seq_len)
        total = resident_total(p.memory.total, held, heap=heap)
        rank0 = resident_total(p.memory.total, held, probe, heap=heap)
        several = rank0 != total and p.world_size > 1
        whose = "rank 0's" if several else "the"
        probed = "" if rank0 == total else f"; {whose} probes' {gib(probe)} at this first run of the shape"
        each = (
            f"{gib(total)} resident per rank, {gib(rank0)} on rank 0" if several else f"{gib(rank0)} resident per rank"
        )
        memory = (
            f"{each} ({gib(p.memory.total)} to train + {gib(heap)} the heap keeps, of "
            f"{gib(p.usable_bytes)} usable, + {gib(held)} held before it: Python, torch, the data{probed})"
        )
    return f"plan       {memory}, {speed}; the whole plan is {where}"


def gpu_recipe_on_cpu(tc: TrainConfig, p) -> str | None:
    """On a CPU, the gpt2 recipe's batch or evaluation (TrainConfig's defaults, what a run without --preset
    gets): one line with the plan's time for it and the debug preset as the CPU-sized recipe, else None.

    The defaults stay the recipe's whatever the device, so a flag means the same on a laptop and on the
    cluster it rehearses (a dry run plans the same run); a CPU run is told instead, before any step."""
    recipe, debug = TrainConfig(), TRAIN_PRESETS["debug"]
    parts = []
    if tc.batch.total_batch_size >= recipe.batch.total_batch_size:
        pace = (
            "no time estimate without a peak"
            if p.step_time_s is None or p.hours is None
            else f"~{_duration(p.step_time_s)} each, {_duration(p.hours * 3600)} for "
            f"{tc.schedule.max_steps:,} steps at the "
            "plan's estimate"
        )
        parts.append(f"{tc.batch.total_batch_size:,}-token steps ({pace})")
    if tc.eval.eval_tokens >= recipe.eval.eval_tokens:
        parts.append(f"{tc.eval.eval_tokens:,} tokens per evaluation")
    if p.hardware.device_type != "cpu" or not parts:
        return None
    return (
        f"recipe: the gpt2 recipe's {' and '.join(parts)} on a CPU (the defaults without --preset); for a "
        f"CPU-sized run pass --preset debug ({debug['total_batch_size']:,}-token steps, {debug['eval_tokens']:,} "
        "eval tokens) or set --total-batch-size and --eval-tokens"
    )


def _duration(seconds: float) -> str:
    return (
        f"{seconds:.0f} s"
        if seconds < 120
        else f"{seconds / 60:.0f} min"
        if seconds < 7200
        else f"{seconds / 3600:.1f} h"
    )
