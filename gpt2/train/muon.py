"""torch.optim.Muon with its Newton-Schulz iteration in a dtype chosen for the device.

torch 2.13's Muon always orthogonalises in bfloat16. That is right on GPUs and on CPUs with native
bf16 matmuls, but where bf16 is emulated (AVX2-only CPUs) it makes a Muon step of the 4-layer,
128-wide model take 0.90 s instead of 0.035 s in fp32, far more than the training step itself
(bench/muon_step.py --small --bf16, removed after a823994; docs/optimizers.md). This subclass keeps
torch's parameter groups,
hyper-parameters and state (one `momentum_buffer` per matrix, so checkpoints are torch's format) and
its update, term for term; only the dtype of the iteration is a parameter. With ns_dtype=bfloat16 it
computes exactly what torch.optim.Muon computes (tested bitwise). In fp32, a wide matrix's
iteration runs in its Gram form (`_gram_form`): the same polynomial, 37% fewer multiply-adds on
the 6-layer, 384-wide model's matrices.

Under DDP every rank holds the same all-reduced gradients and momentum, so every rank would run the
same Newton-Schulz iterations on the same matrices: W times the work for one result. Given a `Dist`
with several ranks, each matrix has one owner (`owners`: balanced by the iteration's FLOPs, decided
from the shapes alone, so every rank computes the same table); the owner orthogonalises it, one
all-gather per step hands every owner's results to every rank, and every rank applies the owner's
bits. The momentum update stays on every rank (elementwise, cheap) so the state, and checkpoints,
are unchanged. It is exact: the result is the one iteration a single process would run on the same
input, and the ranks cannot drift apart because they apply the same bytes. It is modded-nanogpt's
scheme.

Under FSDP (--parallel fsdp) each rank holds a row shard of every matrix, its gradient and its
momentum (DTensors). The momentum update stays sharded (elementwise); the Nesterov update of each
matrix is all-gathered (`full_tensor`, one matrix at a time, in the same order on every rank) for its
owner's Newton-Schulz, the owners' results are shared by the same one all-gather as under DDP, and
each rank applies the rows of its own shard. Newton-Schulz needs the whole matrix: its result is not
a row-wise function of the input. The inputs are bitwise DDP's, so the updates are too (tested).
Costs over DDP: one all-gather per matrix (about one forward's weight gather) and, transiently, the
shared results (the Muon matrices in ns_dtype once, as under DDP) on every rank.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor
from torch.optim._muon import _adjust_lr

from gpt2.core.compat import all_gather_into
from gpt2.core.config import MUON_ORTHOS as ORTHOGONALISERS  # --muon-ortho's choices
from gpt2.distributed.group import Dist, collective

POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
"""Polar Express's coefficients for 5 steps (Amsel, Persson, Musco, Gower, 2025: arXiv 2505.16932; computed with a
safety factor of 2e-2 and a cushion of 2, as modded-nanogpt's record of 2025-09-29 uses them): each step's
quintic is chosen for the singular values that step can still hold, so 5 steps take them closer to 1 than one
fixed quintic repeated does."""
POLAR_EXPRESS_SAFETY = 2e-2
"""The input is divided by its Frobenius norm x (1 + this): the coefficients assume singular values <= 1 with
this margin for the rounding of a 16-bit iteration."""


def newton_schulz(
    g: Tensor,
    coefficients: tuple[float, float, float] | tuple[tuple[float, float, float], ...],
    steps: int,
    eps: float,
    dtype: torch.dtype,
    *,
    safety: float | None = None,
) -> Tensor:
    """The quintic Newton-Schulz iteration of torch.optim.Muon (Keller Jordan's), in `dtype`: x <- a x + (b A + c A^2) x
    with A = x x^T, from g over its Frobenius norm.

    coefficients: one (a, b, c) for every step, or one per step (Polar Express, with safety: the norm scaled by
    1 + safety, as its coefficients assume). Returns an approximately orthogonal matrix U S' V^T (S' ~ 1) for
    g = U S V^T, in `dtype`.
    """
    per_step = per_step_coefficients(coefficients, steps)
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:  # iterate on the wide orientation: the Gram matrix is the smaller one
        x = x.T
    if safety is None:
        x = x.div(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    else:
        x = x.div(x.norm() * (1 + safety) + eps)
    if use_gram_form(tuple(x.shape), steps, dtype):
        x = _gram_form(x, per_step)
    else:
        for a, b, c in per_step:
            gram = x @ x.T
            update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def per_step_coefficients(coefficients, steps: int) -> list[tuple[float, float, float]]:
    """One (a, b, c) a step: a single triple repeated, or a sequence of exactly `steps` triples."""
    if len(coefficients) == 3 and all(isinstance(v, (int, float)) for v in coefficients):
        return [tuple(coefficients)] * steps
    if len(coefficients) != steps:
        raise ValueError(f"{len(coefficients)} coefficient triples for {steps} steps: give one a step, or one triple")
    return [tuple(c) for c in coefficients]


def _gram_form(x: Tensor, per_step: list[tuple[float, float, float]]) -> Tensor:
    """The same iteration, carried on the (m, m) Gram matrix of a wide (m, n) x.

    Each step is x <- M x with M = aI + bA + cA^2 and A = x x^T, a polynomial in A (each step's own a, b, c
    for Polar Express). All the M's are
    polynomials in the first A, so they commute with every A, and the next Gram matrix is
    M A M^T = M (M A). So the iterates are x_k = R_k x_0 with R_k = M_{k-1} ... M_0, and x_0 is
    multiplied only twice (A_0 and R x_0): 2 m^2 n + (4 steps - 3) m^3 multiply-adds instead of
    steps (2 m^2 n + m^3). Exact in exact arithmetic; in fp32 it is within ~1e-5 of the fp64
    iteration (tested), against ~1e-2 for torch's own bf16 iteration. This is "Gram Newton-Schulz"
    (Amsel, Chen, Dao, Zhang, 2026: tridao.me/blog/2026/gram-newton-schulz), who find that in half
    precision rounding gives A spurious negative eigenvalues that the products amplify, and restart
    the iteration from x to stabilise it; we use it only in fp32 and keep torch's loop in 16-bit.
    """
    gram = x @ x.T
    r = None
    for k, (a, b, c) in enumerate(per_step):
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        poly.diagonal().add_(a)
        r = poly if r is None else poly @ r
        if k < len(per_step) - 1:
            gram = poly @ (poly @ gram)
    return r @ x


def _multiply_adds(m: int, n: int, steps: int, gram: bool) -> int:
    return 2 * m * m * n + (4 * steps - 3) * m**3 if gram else steps * (2 * m * m * n + m**3)


def ns_flops(shape: tuple[int, ...], steps: int, dtype: torch.dtype) -> int:
    """Multiply-adds of newton_schulz on a matrix of this shape."""
    m, n = sorted(shape)
    return _multiply_adds(m, n, steps, use_gram_form((m, n), steps, dtype))


def use_gram_form(wide: tuple[int, int], steps: int, dtype: torch.dtype) -> bool:
    """fp32 (where it is accurate) and fewer multiply-adds: n > 1.5 m for 5 steps (the MLP's matrices
    and the stacked qkv, not the square attention projection)."""
    m, n = wide
    return dtype == torch.float32 and _multiply_adds(m, n, steps, True) < _multiply_adds(m, n, steps, False)


def owners(
    shapes: list[tuple[int, ...]], world_size: int, steps: int = 5, dtype: torch.dtype = torch.float32
) -> list[int]:
    """The rank that orthogonalises each matrix: largest first to the least-loaded rank (lowest on a tie)."""
    cost = [ns_flops(s, steps, dtype) for s in shapes]
    load, owner = [0] * world_size, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-cost[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[i], load[rank] = rank, load[rank] + cost[i]
    return owner


def gather_layout(numels: list[int], owner: list[int], world_size: int) -> tuple[list[list[int]], int]:
    """Each rank's matrices (their indices, in order) and the length every rank sends to the
    all-gather: the largest rank's total, so ranks owning less (or nothing) send padding."""
    mine = [[i for i, r in enumerate(owner) if r == rank] for rank in range(world_size)]
    return mine, max(sum(numels[i] for i in m) for m in mine)


class Muon(torch.optim.Muon):
    """Momentum, then orthogonalisation of the (Nesterov) update, decoupled weight decay and a
    shape-adjusted lr: torch.optim.Muon's step with the iteration in `ns_dtype`."""

    def __init__(
        self,
        params,
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
        dist: Dist | None = None,
        ortho: str = "newton_schulz",
        cautious_wd: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(params, **kwargs)
        if ortho not in ORTHOGONALISERS:
            raise ValueError(f"ortho={ortho!r} must be one of {ORTHOGONALISERS}")
        self.ns_dtype = ns_dtype
        self.dist = dist if dist is not None and dist.is_distributed else None
        self.ortho = ortho
        # An attribute, not a group key: a saved state's groups replace these ones on load, and older ones lack it.
        self.cautious_wd = cautious_wd

    def orthogonalise(self, update: Tensor, group: dict) -> Tensor:
        """The group's Newton-Schulz (its ns_coefficients, ns_steps and eps, as torch's), or Polar Express's."""
        if self.ortho == "polar_express":
            steps = len(POLAR_EXPRESS)
            return newton_schulz(update, POLAR_EXPRESS, steps, group["eps"], self.ns_dtype, safety=POLAR_EXPRESS_SAFETY)
        return newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            lr, momentum = float(group["lr"]), group["momentum"]
            rank, world = (self.dist.rank, self.dist.world_size) if self.dist else (0, 1)
            owner = owners([tuple(p.shape) for p in params], world, group["ns_steps"], self.ns_dtype)
            ortho: list[Tensor | None] = [None] * len(params)
            for i, (grad, buf) in enumerate(zip(grads, bufs)):
                buf.lerp_(grad, 1 - momentum)
                sharded = _is_dtensor(grad)
                if owner[i] == rank or sharded:  # a shard is gathered by every rank: the same collectives
                    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                    if sharded:
                        with collective("gathering a sharded matrix for Muon"):
                            update = update.full_tensor()
                if owner[i] == rank:
                    ortho[i] = self.orthogonalise(update, group)
                    if world == 1:  # apply at once: one matrix's update alive at a time
                        self._apply(group, params[i], ortho[i], lr)
                        ortho[i] = None
                update = None  # one gathered matrix alive at a time on the ranks that do not own it
            if world > 1 and params:
                self._share(group, params, ortho, owner, rank, world, lr)
        return loss

    def _share(
        self,
        group: dict,
        params: list[Tensor],
        ortho: list[Tensor | None],
        owner: list[int],
        rank: int,
        world: int,
        lr: float,
    ) -> None:
        """Every owner's updates to every rank in one all-gather, then each applied on every rank.

        One collective per step whatever the world size: one broadcast per owner was up to W
        latency-bound calls one after another (48-64 at 64 ranks). Each rank sends its updates
        packed in owner-table order, padded to the largest rank's share (all-gather takes equal
        sizes), so the gathered buffer holds all of them: about the Muon matrices' size in
        ns_dtype (more with padding at many ranks), allocated after backward has freed the
        activations, so below the step's peak memory, and freed at the end of the step.
        """
        mine, length = gather_layout([p.numel() for p in params], owner, world)
        device = params[0].device
        send = torch.empty(length, dtype=self.ns_dtype, device=device)
        offset = 0
        for i in mine[rank]:
            n = params[i].numel()
            send[offset : offset + n].copy_(ortho[i].reshape(-1))
            ortho[i], offset = None, offset + n
        send[offset:].zero_()  # the padding: sent, never read
        gathered = torch.empty(world * length, dtype=self.ns_dtype, device=device)
        with collective("sharing Muon's orthogonalised updates"):
            all_gather_into(gathered, send)
        for src in range(world):
            sizes = [params[i].numel() for i in mine[src]]
            parts = gathered[src * length : src * length + sum(sizes)].split(sizes)
            for i, part in zip(mine[src], parts):
                self._apply(group, params[i], part.view(params[i].shape), lr)

    def _apply(self, group: dict, param: Tensor, ortho: Tensor, lr: float) -> None:
        """The update of a whole matrix, or (FSDP) of this rank's shard of it: the same rows of the
        whole orthogonalised matrix as the shard's (sliced here, no communication). cautious_wd: the decay
        only where the update (param -= scale * ortho) has the weight's sign, so shrinks it too."""
        scale = _adjust_lr(lr, group["adjust_lr_fn"], param.shape)  # the whole matrix's shape
        if _is_dtensor(param):
            from torch.distributed.tensor import distribute_tensor

            ortho = distribute_tensor(ortho, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param = param.to_local()  # a view: updated in place
        decay = lr * group["weight_decay"]
        if self.cautious_wd and decay:
            param.sub_(param * (ortho * param >= 0) * decay)
        else:
            param.mul_(1 - decay)
        param.add_(ortho, alpha=-scale)


def _is_dtensor(t: Tensor) -> bool:
    """Whether t is a DTensor (an FSDP shard), without importing torch.distributed.tensor: that import is ~0.7 s
    of every process's start-up, and where nothing has imported it (no FSDP) no tensor can be one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)
