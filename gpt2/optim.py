"""AdamW with weight decay on 2-D weights only (matmul weights and embeddings), as in GPT-2/3."""

from __future__ import annotations

import torch

from gpt2.config import TrainConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    # Biases and LayerNorm gains are 1-D: decaying them towards 0 only hurts.
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    # One kernel per step instead of ~10 small ops per tensor (CUDA, and CPU since torch 2.4).
    fused = cfg.fused_adamw and device.type in ("cuda", "cpu")
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, fused=fused or None)
