"""The LM head's cross-entropy in chunks: the loss and its gradients without the (N, V) logits.

GPT.forward(x, y, return_logits=False), what training runs, calls `linear_cross_entropy` when the model's
loss_impl is chunked (--loss-impl; gpt2/plan/ choose_loss_impl picks it where the logits do not fit
comfortably). It computes
what `F.cross_entropy(F.linear(x, W, b).float(), y, ignore_index=-1)` computes, autocast included,
one chunk of rows at a time, with the gradients made in forward (a custom autograd Function; under
torch.compile one custom op, _chunked_op, so the compiler cannot hold every chunk at once) so that
backward has no LM-head matmul to redo. The chunk size is the device's rule (`loss_chunk_logits`),
which the planner (gpt2/plan/) counts too.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Most logits one chunk of `linear_cross_entropy` holds. Larger chunks keep the LM-head matmuls
# large; smaller ones lower the loss's peak memory. On a CPU 2**23 (32 MiB as fp32): chosen when each
# chunk allocated its own buffers, which glibc mapped afresh above that size (page faults costing a
# quarter of a small model's step). The buffers are now allocated once per call (_cross_entropy_chunks);
# the size stays, so fixed-seed CPU losses stay bit for bit what they were.
LOSS_CHUNK_LOGITS = {"cpu": 2**23}
LOSS_CHUNK_LOGITS_DEFAULT = 2**25
"""Devices with no rule of their own (neither CPU nor CUDA)."""

# On CUDA a chunk is sized from the device's total memory, as large as a fixed share allows. Each
# chunk, whatever its size, adds its (V, h) weight-gradient part to the fp32 sum: for GPT-2 it writes
# a 77 MB bf16 part and reads and writes the 154 MB fp32 grad_w, ~0.45 GB of traffic per chunk
# compiled (the fp32 cast fused into the add), ~0.75 GB eager. With 2**25-logit chunks the gpt2
# preset's micro-batch (64 x 1024 tokens) is 99 chunks: ~45 GB per micro-step, ~8% of an A100
# step, and 99 unrolled copies of the loop body for torch.compile to trace and compile. Chunks are
# sized at 16 bytes per logit under bf16 (LOSS_CHUNK_BYTES_PER_LOGIT: what a chunk held before its
# buffers were reused; now 10, the fp32 logits, logsumexp's exp and the bf16 twin, 8 in fp32:
# gpt2.plan.memory.loss_bytes), kept so chunk sizes and fixed-seed losses stay. With 1/16 of the memory
# per chunk that micro-batch is 10 chunks of 6,554 rows (3.1 GiB held, ~4.5 GB of grad_w traffic) on an
# 80 GB A100, 20 of 3,277 (1.5 GiB) on a 40 GB one, 34 of 1,928 (0.9 GiB) on a 24 GB card. A larger
# share saves little more traffic for memory a micro-batch could use. The count is also bounded:
# activations take ~0.32 GiB per 1024-token sequence, so any micro-batch that fits has at most
# ~35 chunks whatever the device (planner: 34 at B=215 on 80 GB, 29 at B=54 on 24 GB).
# Total memory, not free memory: it is the same on every rank and at every step, so all ranks chunk
# identically and a run's losses do not depend on what else happens to be allocated.
LOSS_CHUNK_MEMORY_SHARE = 16
"""On CUDA one chunk holds at most 1/LOSS_CHUNK_MEMORY_SHARE of the device's total memory."""
LOSS_CHUNK_BYTES_PER_LOGIT = 16
"""Bytes per logit a chunk is sized at (under bf16 it holds 10 since its buffers are reused; see above)."""


def loss_chunk_logits(device: torch.device | str, total_memory: int | None = None) -> int:
    """Most logits one loss chunk holds on device (see the comments above).

    On CUDA from total_memory, the device's total bytes (default: asked of the device; give it to
    get a pure function, as the planner does). Other devices have fixed sizes and ignore it.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return LOSS_CHUNK_LOGITS.get(device.type, LOSS_CHUNK_LOGITS_DEFAULT)
    if total_memory is None:
        total_memory = torch.cuda.get_device_properties(device).total_memory
    return max(1, total_memory // (LOSS_CHUNK_MEMORY_SHARE * LOSS_CHUNK_BYTES_PER_LOGIT))


def loss_chunks(n_rows: int, max_rows: int) -> tuple[int, int]:
    """(chunks, rows per chunk) for n_rows in equal chunks of at most max_rows rows: 2048 rows in
    4 x 512, not 3 x 667 + 47 (the last chunk may be shorter by less than one row per chunk)."""
    n_chunks = -(-n_rows // max_rows)
    return n_chunks, -(-n_rows // n_chunks)


def linear_cross_entropy(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    *,
    chunk_rows: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Mean cross-entropy of F.linear(x, weight, bias) against targets (-1 = ignored), in chunks.

    softcap (ModelConfig.logit_softcap): of softcap * tanh(F.linear(x, weight) / softcap) + bias instead,
    in fp32 (the bias after the cap, so that padded rows' -inf stays -inf), as GPT.head computes it.

    The maths of the model's plain path, `F.cross_entropy(logits.float(), targets,
    ignore_index=-1)`, autocast included (matmuls in the autocast dtype, softmax in fp32), without
    ever holding the (N, V) logits: each chunk of rows makes its logits, its loss and, when
    gradients are wanted, its gradients at once, so backward only scales what forward left. The
    full path keeps several (N, V) fp32 tensors (logits, log-probabilities, their gradients): for
    2,048 tokens and 50,304 entries that is 412 MB each, written and read again.
    """
    h = x.size(-1)
    x2, t = x.reshape(-1, h), targets.reshape(-1)
    if x2.size(0) != t.size(0):
        raise ValueError(f"{x2.size(0)} positions but {t.size(0)} targets; pass targets shaped like idx")
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    max_rows = chunk_rows or max(1, loss_chunk_logits(x.device) // weight.size(0))
    _, rows = loss_chunks(x2.size(0), max_rows)
    with torch.autocast(device_type, enabled=False):  # the dtypes are chosen explicitly below
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            if torch.compiler.is_compiling():  # one opaque op to the compiler (_chunked_op, below)
                return _chunked_op(x2, weight, bias, t, str(dtype).removeprefix("torch."), rows, softcap)[0]
            return _LinearCrossEntropy.apply(x2, weight, bias, t, dtype, rows, softcap)
        return _cross_entropy_chunks(x2, weight, bias, t, dtype, rows, grads=False, softcap=softcap)[0]


def _cross_entropy_chunks(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    dtype: torch.dtype,
    rows: int,
    *,
    grads: bool,
    softcap: float | None = None,
):
    """(loss, grad_x, grad_weight) of the mean loss; the gradients only with grads, else None.

    Matmuls run in `dtype` as autocast runs F.linear; logits are softmaxed in fp32. d loss / d
    logits is (softmax - onehot(target)) / n on counted rows and 0 on ignored ones. It is made in
    place over the chunk's logits (no one-hot, no second (rows, V) buffer), and ignored rows are
    zeroed on the narrow side (their x rows and their grad_x rows), not over all V columns.

    Where 1/n is applied matters in float16, whose smallest step is 6e-8: at initialisation a
    softmax entry is ~2e-5, and 2e-5 / n underflows to exactly 0 for n >= 1024 tokens, silently
    dropping every "push the other tokens down" term. So for float16 the gradient stays unscaled
    in the matmuls and 1/n is applied to their fp32 results. fp32 and bf16 have fp32's exponent
    range and fold 1/n in before the cast, as F.cross_entropy's backward does (bitwise the same).
    """
    w, b, valid, n, inv_n, late, starts = _chunk_setup(x, weight, bias, targets, dtype, rows)
    # Eager, every buffer the chunks use is allocated here, once, and reused: the fp32 logits (then the
    # softmax gradient), their matmul-dtype twin, logsumexp's exp(logits - max), the (V, h) weight-
    # gradient part, and the results that outlive a chunk. Allocated per chunk, on a CPU they came from
    # glibc's heap (a chunk is under its dynamic mmap threshold, LOSS_CHUNK_LOGITS), where each kept
    # result allocated among them (a chunk's grad_x rows, the running grad_w) pinned the freed (rows, V)
    # buffer below it: the process grew by about one chunk of logits per chunk, ~200 KB per token at
    # V = 50304, 8-15x the plan (issue 41). With the fixed threshold a CPU run sets
    # (gpt2.core.host_memory.return_freed_memory) each would be mapped and faulted in afresh per chunk.
    # Traced by torch.compile (the loss without gradients, eval's; with them the chunks run inside
    # _chunked_op, below), the plain operations: given `out=` tensors inductor ran every chunk's matmul
    # first to fill them (all chunks' logits at once).
    V, low, reuse = weight.size(0), dtype != torch.float32, not torch.compiler.is_compiling()
    shape = (min(rows, x.size(0)), V)
    buf = torch.empty(shape, dtype=torch.float32, device=x.device) if reuse else None
    buf_low = torch.empty(shape, dtype=dtype, device=x.device) if reuse and low else None
    tmp = torch.empty(shape, dtype=torch.float32, device=x.device) if reuse else None
    part = torch.empty(weight.shape, dtype=dtype, device=x.device) if reuse and grads else None
    losses = torch.empty(len(starts), dtype=torch.float32, device=x.device) if reuse else []
    grad_x = (torch.empty_like(x) if reuse else []) if grads else None
    grad_w = torch.empty(weight.shape, dtype=torch.float32, device=x.device) if reuse and grads else None
    for i, start in enumerate(starts):
        xs = x[start : start + rows].to(dtype)
        ts, vs = targets[start : start + rows], valid[start : start + rows]
        out = _rows(buf_low if low else buf, xs.size(0))  # None when traced: a new tensor
        if softcap is not None:  # the bias is added after the cap (_capped_chunk)
            out = torch.mm(xs, w.t(), out=out)
            chunk_loss, g = _capped_chunk(
                out, b, ts, vs, softcap, _rows(buf, xs.size(0)), _rows(tmp, xs.size(0)), grads
            )
        else:
            out = torch.mm(xs, w.t(), out=out) if b is None else torch.addmm(b, xs, w.t(), out=out)
            logits = out if not low else _rows(buf, xs.size(0)).copy_(out) if reuse else out.float()  # (rows, V)
            lse = _logsumexp(logits, _rows(tmp, xs.size(0)))
            picked = logits.gather(1, ts.clamp(min=0)[:, None]).squeeze(1)
            chunk_loss = torch.where(vs, lse - picked, 0.0).sum()
        if reuse:
            losses[i] = chunk_loss
        else:
            losses.append(chunk_loss)
        if grads:
            if softcap is None:
                g = _softmax_minus_onehot(logits, lse, ts, vs)
            if not late:
                g.mul_(inv_n)
            g = (out.copy_(g) if reuse else g.to(dtype)) if low else g  # in the matmul dtype
            keep = vs[:, None]
            gx = (g @ w).float() * (keep * inv_n) if late else (g @ w) * keep
            if reuse:
                grad_x[start : start + rows] = gx  # cast to x's dtype
            else:
                grad_x.append(gx.to(x.dtype))
            p = torch.mm(g.t(), xs * keep, out=part)  # (V, h); summed in fp32 over chunks
            if reuse:
                grad_w.copy_(p) if i == 0 else grad_w.add_(p)
            else:
                grad_w = p.float() if i == 0 else grad_w + p
    loss = (losses if reuse else torch.stack(losses)).sum() / n
    if not grads:
        return loss, None, None
    grad_x = grad_x if reuse else torch.cat(grad_x)
    return loss, grad_x, (grad_w * inv_n if late else grad_w).to(weight.dtype)


def _chunk_setup(x: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, dtype: torch.dtype, rows: int):
    """What every chunk shares: the weight and bias in the matmul dtype, the counted rows and their number n,
    1/n, whether 1/n is applied late (float16, see _cross_entropy_chunks) and the chunks' first rows."""
    valid = targets != -1
    n = valid.sum()
    b = None if bias is None else bias.to(dtype)
    return weight.to(dtype), b, valid, n, 1.0 / n, dtype == torch.float16, range(0, x.size(0), rows)


def _rows(buf: Tensor | None, n: int) -> Tensor | None:
    """The first n rows of a reused buffer, or None (no buffer: the operation allocates its own)."""
    return None if buf is None else buf[:n]


def _logsumexp(logits: Tensor, tmp: Tensor | None) -> Tensor:
    """torch.logsumexp(logits, dim=-1) with exp(logits - max) written into tmp rather than a (rows, V)
    temporary of its own; the same operations in the same order, so the same bits (max, a max of +-inf
    taken as 0, sum of exp(logits - max), log, + max). tmp None: torch.logsumexp itself."""
    if tmp is None:
        return torch.logsumexp(logits, dim=-1)
    m = logits.amax(dim=-1, keepdim=True)
    m.masked_fill_(m.abs() == float("inf"), 0)
    return torch.sub(logits, m, out=tmp).exp_().sum(dim=-1).log_().add_(m.squeeze(-1))


def _capped_chunk(
    out: Tensor,
    b: Tensor | None,
    targets: Tensor,
    valid: Tensor,
    cap: float,
    t_buf: Tensor | None,
    z_buf: Tensor | None,
    grads: bool,
) -> tuple[Tensor, Tensor | None]:
    """(the chunk's summed loss, d loss / d out or None) for the capped logits z = cap * tanh(out / cap) + b.

    In the chunk's two fp32 buffers, as the plain chunk uses them (so the planner's bytes per logit
    hold): t = tanh(out / cap) in t_buf, kept for the cap's derivative 1 - t^2; z in z_buf, which becomes
    exp(z - max), then the softmax, then its gradient. Traced (buffers None), the same maths out of place.
    Padded columns: z = -inf, softmax 0, and 1 - t^2 is finite, so their gradient is 0 (no nan).
    """
    reuse = t_buf is not None
    t = t_buf.copy_(out).div_(cap).tanh_() if reuse else torch.tanh(out.float() / cap)
    z = torch.mul(t, cap, out=z_buf) if reuse else t * cap
    if b is not None:
        z = z.add_(b) if reuse else z + b
    picked = z.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    m = z.amax(dim=-1, keepdim=True)  # finite: every row has unpadded columns, capped to [-cap, cap]
    e = z.sub_(m).exp_() if reuse else (z - m).exp()
    total = e.sum(dim=-1, keepdim=True)
    lse = total.log().squeeze(-1) + m.squeeze(-1)
    chunk_loss = torch.where(valid, lse - picked, 0.0).sum()
    if not grads:
        return chunk_loss, None
    probs = e.div_(total) if reuse else e / total
    if torch.compiler.is_compiling():  # as _softmax_minus_onehot: a where, not scatter_add_, traced
        hit = torch.arange(probs.size(1), device=probs.device)[None, :] == targets[:, None]
        return chunk_loss, torch.where(hit, probs - 1.0, probs) * (1 - t * t)
    g = probs.scatter_add_(1, targets.clamp(min=0)[:, None], -valid[:, None].float())
    return chunk_loss, g.mul_(t.square_().neg_().add_(1)) if reuse else g * (1 - t * t)


def _softmax_minus_onehot(logits: Tensor, lse: Tensor, targets: Tensor, valid: Tensor) -> Tensor:
    """softmax(logits) - onehot(target) on valid rows (softmax alone on ignored ones), fp32 (rows, V).

    Eager: in place over logits with one scatter_add_, so the chunk holds no second (rows, V) buffer
    (the planner's 16 bytes per logit, gpt2.plan.memory.loss_bytes, count exactly that). Compiled: a
    torch.where against the target's one-hot instead. Inductor has no lowering for scatter_add_ into
    a computed tensor: it falls back to aten.scatter_reduce_, which needs the fp32 softmax written out
    whole, then read again for the scaling and the cast, ~8 extra bytes of traffic per logit (issue
    39: ~5% of a gpt2-preset step on an H100). The where fuses exp, the subtraction, the scaling and
    the cast into one kernel. Both subtract exactly 1.0 at the target (x + -1.0 == x - 1.0 in IEEE),
    so they are the same numbers; tests/test_loss.py checks both and reads the generated code.
    """
    g = logits.sub_(lse[:, None]).exp_()  # softmax, in place: logits are not needed any more
    if torch.compiler.is_compiling():
        hit = torch.arange(g.size(1), device=g.device)[None, :] == targets[:, None]  # an ignored row's -1: none
        return torch.where(hit, g - 1.0, g)
    return g.scatter_add_(1, targets.clamp(min=0)[:, None], -valid[:, None].float())


class _LinearCrossEntropy(torch.autograd.Function):
    """The loss with its gradients computed in forward (no recomputed LM-head matmul)."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, dtype, rows, softcap):
        loss, grad_x, grad_w = _cross_entropy_chunks(x, weight, bias, targets, dtype, rows, grads=True, softcap=softcap)
        ctx.save_for_backward(grad_x, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_loss, grad_w * grad_loss, None, None, None, None, None


# Compiled, the loss with its gradients is one custom op: inside it the chunks run one after another, as
# eager, so the loss holds one chunk's buffers however many chunks there are. Traced whole, inductor's
# scheduler ran each chunk's input-gradient matmul after later chunks and kept every chunk's 16-bit
# logits and softmax gradient alive until then: at 50 chunks ~2 x (N, V) in bf16, more than the full
# loss compiled (measured on a CPU, tests/test_memory_plan.py), which the planner could only count. On
# CUDA each chunk is itself compiled (COMPILED_CHUNKS: the fused exp, one-hot, scaling and cast of
# _softmax_minus_onehot, issue 39); on a CPU the eager chunks with their reused buffers.
COMPILED_CHUNKS = {"cuda": True}
"""Device types whose chunks run as one compiled function each inside the op (else the eager chunks)."""


# Registered when this module is imported, as a class is defined (dynamo cannot trace a registration).
@torch.library.custom_op(
    "gpt2::linear_cross_entropy_grads",
    mutates_args=(),
    schema="(Tensor x, Tensor weight, Tensor? bias, Tensor targets, str dtype, int rows, float? softcap) "
    "-> (Tensor, Tensor, Tensor)",
)
def _chunked_op(
    x: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, dtype: str, rows: int, softcap: float | None
):
    """(x, weight, bias, targets, dtype's name, rows, softcap) -> (loss, grad_x, grad_weight), differentiable in x
    and weight through the two gradients."""
    if COMPILED_CHUNKS.get(x.device.type, False):
        return _compiled_chunks(x, weight, bias, targets, getattr(torch, dtype), rows, softcap)
    return _cross_entropy_chunks(x, weight, bias, targets, getattr(torch, dtype), rows, grads=True, softcap=softcap)


@_chunked_op.register_fake
def _op_fake(
    x: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, dtype: str, rows: int, softcap: float | None
):
    return x.new_empty((), dtype=torch.float32), torch.empty_like(x), torch.empty_like(weight)


def _op_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1], output[2])


def _op_backward(ctx, grad_loss, _grad_x, _grad_w):
    grad_x, grad_w = ctx.saved_tensors
    return grad_x * grad_loss, grad_w * grad_loss, None, None, None, None, None


_chunked_op.register_autograd(_op_backward, setup_context=_op_setup)

_CHUNK = None


def _compiled_chunks(
    x: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, dtype: torch.dtype, rows: int, softcap=None
):
    """_cross_entropy_chunks(grads=True), each chunk one call of a torch.compile'd _one_chunk."""
    global _CHUNK
    if _CHUNK is None:
        _CHUNK = torch.compile(_one_chunk)
    w, b, valid, n, inv_n, late, starts = _chunk_setup(x, weight, bias, targets, dtype, rows)
    losses = torch.empty(len(starts), dtype=torch.float32, device=x.device)
    grad_x = torch.empty_like(x)
    grad_w = torch.empty(weight.shape, dtype=torch.float32, device=x.device)
    for i, start in enumerate(starts):
        s = slice(start, start + rows)
        losses[i], grad_x[s], part = _CHUNK(x[s].to(dtype), w, b, targets[s], valid[s], inv_n, late, softcap)
        grad_w.copy_(part) if i == 0 else grad_w.add_(part)
    loss = losses.sum() / n
    return loss, grad_x, (grad_w * inv_n if late else grad_w).to(weight.dtype)


def _one_chunk(
    xs: Tensor, w: Tensor, b: Tensor | None, ts: Tensor, vs: Tensor, inv_n: Tensor, late: bool, softcap=None
):
    """One chunk of _cross_entropy_chunks' loop, traced: (its summed loss, its grad_x rows, its (V, h) part)."""
    if softcap is not None:
        chunk_loss, g = _capped_chunk(torch.mm(xs, w.t()), b, ts, vs, softcap, None, None, True)
    else:
        out = torch.mm(xs, w.t()) if b is None else torch.addmm(b, xs, w.t())
        logits = out.float()
        lse = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(1, ts.clamp(min=0)[:, None]).squeeze(1)
        chunk_loss = torch.where(vs, lse - picked, 0.0).sum()
        g = _softmax_minus_onehot(logits, lse, ts, vs)
    g = (g if late else g * inv_n).to(w.dtype)
    keep = vs[:, None]
    gx = (g @ w).float() * (keep * inv_n) if late else (g @ w) * keep
    return chunk_loss, gx, g.t() @ (xs * keep)
