"""torch.optim.Muon with its Newton-Schulz iteration in a dtype chosen for the device.

torch 2.13's Muon always orthogonalises in bfloat16. That is right on GPUs and on CPUs with native
bf16 matmuls, but where bf16 is emulated (AVX2-only CPUs) it makes a Muon step of the 4-layer,
128-wide model take 0.92 s instead of 0.05 s in fp32, far more than the training step itself
(measured: `python bench/optimizers.py --ns-cost`). This subclass keeps torch's parameter groups,
hyper-parameters and state (one `momentum_buffer` per matrix, so checkpoints are torch's format) and
its update, term for term; only the dtype of the iteration is a parameter. With ns_dtype=bfloat16 it
computes exactly what torch.optim.Muon computes (tested bitwise).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim._muon import _adjust_lr


def newton_schulz(g: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> Tensor:
    """The quintic Newton-Schulz iteration of torch.optim.Muon (Keller Jordan's), in `dtype`.

    Returns an approximately orthogonal matrix U S' V^T (S' ~ 1) for g = U S V^T, in `dtype`.
    """
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:  # iterate on the wide orientation: the Gram matrix is the smaller one
        x = x.T
    x = x.div(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """Momentum, then orthogonalisation of the (Nesterov) update, decoupled weight decay and a
    shape-adjusted lr: torch.optim.Muon's step with the iteration in `ns_dtype`."""

    def __init__(self, params, *, ns_dtype: torch.dtype = torch.bfloat16, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

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
            for param, grad, buf in zip(params, grads, bufs):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                       self.ns_dtype)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss
