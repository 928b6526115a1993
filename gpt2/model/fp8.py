"""The LM head's matmuls in FP8 (--fp8-head, opt-in): `torch._scaled_mm` with one scale per tensor.

At GPT-2 124M the LM head is the largest single matmul of the step (768 x 50304 per token, forward and
two in the backward: 27% of the model's matmul FLOPs). An H100/H200 multiplies FP8 at twice its BF16
rate, so this head is where FP8 pays most and risks least (modded-nanogpt's records do the same; the
blocks stay BF16). Per-tensor dynamic scaling: each operand is divided by amax / FP8_MAX before the cast,
so its largest element lands on the format's largest value, and `_scaled_mm` multiplies the scales back
in FP32 accumulation. Activations and weights in e4m3 (3 mantissa bits); the loss's gradient in e5m2
(2 mantissa bits, a wider range: the softmax's gradient spans many decades). The weight's gradient comes
out in FP32 (it accumulates into the FP32 master weights), the input's in the logits' dtype.

Only training's loss takes this path (gpt2/model/gpt.py, with gradients on): evaluation, sampling and
export use the exact BF16/FP32 head, so a validation loss is comparable with and without the option.
"""

from __future__ import annotations

import torch
from torch import Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9) and Hopper (9.0) and later; an A100 (8.0) has none."""


def to_fp8(t: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """t in dtype scaled so that its largest magnitude is the format's largest, and the FP32 scale
    (t ~= result * scale). An all-zero t gets a tiny scale, not a division by zero."""
    top = torch.finfo(dtype).max
    scale = (t.detach().abs().amax().float() / top).clamp(min=1e-30)
    return (t.float() / scale).clamp(-top, top).to(dtype), scale


def _mm(a: Tensor, b: Tensor, sa: Tensor, sb: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a @ b with a row-major and b column-major, as `_scaled_mm` requires. On a CPU, where FP8 runs for the tests
    alone, the same maths in fp32 (every FP8 value is exact there): torch's own CPU kernel took 57-69 s for one
    (256 x 64) @ (64 x 50,304) head matmul on a Xeon with AMX (torch 2.13, 1 thread) against 0.05 s in fp32, and
    fast on an EPYC, so a 4-step test ran 10 minutes or seconds by the CPU CI drew. tests/test_fp8_head.py holds
    the two to agree."""
    if a.device.type == "cpu":
        return ((a.float() @ b.float()) * (sa * sb)).to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)


class _FP8Linear(torch.autograd.Function):
    """x @ w.T in FP8 forward and backward (the module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, out_dtype: torch.dtype) -> Tensor:
        x2 = x.reshape(-1, x.size(-1))
        xq, xs = to_fp8(x2, E4M3)
        wq, ws = to_fp8(w, E4M3)
        ctx.save_for_backward(xq, xs, wq, ws)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        out = _mm(xq, wq.t(), xs, ws, out_dtype)  # wq.t() is column-major as it stands
        return out.view(*x.shape[:-1], w.size(0))

    @staticmethod
    def backward(ctx, grad: Tensor):
        xq, xs, wq, ws = ctx.saved_tensors
        gq, gs = to_fp8(grad.reshape(-1, grad.size(-1)), E5M2)
        grad_x = _mm(gq, wq.t().contiguous().t(), gs, ws, grad.dtype)  # (N, V) @ (V, C)
        grad_w = _mm(gq.t().contiguous(), xq.t().contiguous().t(), gs, xs, torch.float32)  # (V, N) @ (N, C)
        return grad_x.view(ctx.x_shape).to(ctx.x_dtype), grad_w, None


def fp8_linear(x: Tensor, w: Tensor, out_dtype: torch.dtype) -> Tensor:
    """x (..., C) @ w (V, C).T in FP8 with per-tensor scales, the result in out_dtype; differentiable
    in both x and w."""
    return _FP8Linear.apply(x, w, out_dtype)


def logits_dtype(device_type: str) -> torch.dtype:
    """The dtype the plain head's logits have here: autocast's (BF16 on the runs that take FP8) or FP32."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.float32


SCALED_MM_MULTIPLE = 16
"""torch._scaled_mm on CUDA needs its inner dimension and both of its second operand's to be multiples of 16
(torch/_meta_registrations.py _check_scaled_mm_sizes; a CPU does not check them). The head's three matmuls put
there: n_embd and vocab_size (the forward, (N, C) @ (C, V), and the input's gradient, (N, V) @ (V, C)) and
the micro-step's tokens N = micro_batch_size x block_size (the weight's gradient, (V, N) @ (N, C))."""


def fp8_shape_problem(cfg, micro_batch_size: int | None = None) -> str | None:
    """Why --fp8-head cannot run at this model's shape (cfg: ModelConfig) and micro-batch (None: not yet known,
    the tokens are not checked), in one line naming the fix; None: every dimension _scaled_mm requires is a
    multiple of SCALED_MM_MULTIPLE. The same rule on every device, so a CPU rehearsal refuses what a GPU would."""
    m = SCALED_MM_MULTIPLE
    bad = [f"{name}={getattr(cfg, name)}" for name in ("n_embd", "vocab_size") if getattr(cfg, name) % m]
    tokens = None if micro_batch_size is None else micro_batch_size * cfg.block_size
    if tokens is not None and tokens % m:
        bad.append(f"micro_batch_size x block_size = {micro_batch_size} x {cfg.block_size} = {tokens} tokens")
    if not bad:
        return None
    return (
        f"--fp8-head: torch._scaled_mm needs multiples of {m} in the LM head's matmuls, and {' and '.join(bad)} "
        f"{'is' if len(bad) == 1 else 'are'} not: use an --n-embd and a --vocab-size that are multiples of {m} "
        f"(GPT-2's padded 50304 is), a --micro-batch-size whose product with --block-size is, or drop --fp8-head"
    )


def fp8_problem(device: torch.device | str | None) -> str | None:
    """Why --fp8-head cannot run on device (None: it can). A CUDA device needs FP8 tensor cores; elsewhere
    (a CPU) `_scaled_mm` must exist in this torch: it runs there for tests, slowly."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            return (
                f"--fp8-head needs FP8 tensor cores (compute capability 8.9+: H100, H200, L4, L40); "
                f"{name} is {cap[0]}.{cap[1]}: drop --fp8-head"
            )
        return None
    try:
        one = torch.ones((), device=device)
        a = torch.zeros(16, 16, device=device).to(E4M3)
        _mm(a, a.t(), one, one, torch.float32)
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"--fp8-head: torch {torch.__version__} has no FP8 matmul on {device.type} ({first}): drop --fp8-head"
    return None
