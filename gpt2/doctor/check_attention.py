"""The node check's attention section: which SDPA backends run alone on the model's q/k/v, how far each is
from fp32 softmax(QK^T)V, and which one the default dispatch runs (gpt2/doctor/sdpa_probe.py)."""

from __future__ import annotations

from gpt2.doctor.context import Context
from gpt2.doctor.results import NA, WARN, Section
from gpt2.doctor.sdpa_probe import probe


def attention(ctx: Context) -> Section:
    s = Section("attention")
    dtype = ctx.auto_precision().torch_dtype
    report = probe(ctx.scale.model, ctx.scale.ladder_batch, ctx.device, dtype)
    b, nh, t, hd = report.shape
    s.info("shape", f"q, k, v ({b}, {nh}, {t}, {hd}) {report.dtype}, causal: the model's CausalSelfAttention")
    for trial in report.trials:
        if trial.runs:
            s.check(
                f"{trial.name} alone",
                trial.agrees,
                f"runs; vs fp32 explicit: max rel diff {trial.rel_diff:.1e} (tolerance {report.tolerance:.0e})",
            )
        else:
            s.note(f"{trial.name} alone", f"does not run here: {trial.reason}", NA)
    picked = ", ".join(report.dispatched) or "none recognised"
    s.check("default dispatch (profiled)", bool(report.dispatched), f"{picked} ({', '.join(report.ops)})")
    if ctx.device.type == "cuda":
        s.info("CUDA kernels", ", ".join(k[:60] for k in report.kernels[:3]) or "none seen")
        if "math" in report.dispatched:  # not wrong, but slow and (B, nh, T, T) memory: say it loudly
            s.note("fused kernel", "the model's attention runs SDPA's math path on this GPU", WARN)
    s.data = report.to_dict()
    return s
