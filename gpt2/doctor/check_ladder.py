"""The node check's opt-in ladder section: bench/ladder.py's rungs (gpt2/doctor/acceleration.py) at the
GPT-2 124M shape, tokens/s and MFU beside build-nanogpt's A100."""

from __future__ import annotations

import dataclasses
import math

from gpt2.doctor.acceleration import DOC_A100_TOKENS_PER_S, LADDER, initial_peaks, run_ladder, without_bf16
from gpt2.doctor.context import Context
from gpt2.doctor.results import NA, Section


def ladder(ctx: Context) -> Section:
    s = Section("ladder")
    prec, device, sc = ctx.auto_precision(), ctx.device, ctx.scale
    rungs, skip = LADDER, {}
    if prec.dtype != "bfloat16":  # e.g. a CPU whose bf16 is slower than fp32: the rungs after it in fp32
        rungs, skip = without_bf16(LADDER, f"n/a: --dtype auto picks {prec.dtype} here")
    if device.type != "cuda":
        skip["tf32"] = f"n/a on {device.type} (a mode of NVIDIA's tensor cores)"
    peaks = initial_peaks(device)
    results = run_ladder(
        list(rungs),
        sc.model,
        sc.ladder_batch,
        device,
        steps=sc.ladder_steps,
        warmup=sc.ladder_warmup,
        peaks=peaks,
        skip=skip,
        progress=lambda m: ctx.say("ladder: " + m),
    )
    m = sc.model
    s.info(
        "shape",
        f"{m.n_layer} layers x {m.n_embd}, block {m.block_size}, micro-batch {sc.ladder_batch}; "
        f"median of {sc.ladder_steps} interleaved steps; A100: build-nanogpt's (124M, 16 x 1024)",
    )
    prev = None
    for r in results:
        doc = DOC_A100_TOKENS_PER_S[r.rung.name]
        label = f"{r.rung.name}: {r.rung.switch}"
        if r.tokens_per_s is None:
            s.note(label, f"{r.note}; A100 {doc:,} tokens/s", NA)
            continue
        step_up = f" ({r.tokens_per_s / prev:.2f}x)" if prev else ""
        prev = r.tokens_per_s
        mfu = "n/a" if r.mfu_own is None else f"{r.mfu_own:.1%}"
        s.check(
            label,
            math.isfinite(r.first_loss),
            f"{r.tokens_per_s:,.0f} tokens/s{step_up}, MFU {mfu} ({r.own_peak_name}), {r.ms_per_step:.0f} ms/step; "
            f"A100 {doc:,} tokens/s",
        )
    s.data = {
        "peaks": peaks,
        "rungs": [
            {**dataclasses.asdict(r), "a100_tokens_per_s": DOC_A100_TOKENS_PER_S[name]}
            for r in results
            if (name := r.rung.name)
        ],
    }
    return s
