"""The optimizer: AdamW (GPT-2/3's recipe), or Muon on the blocks' matrices with AdamW on the rest.

AdamW decays 2-D weights only (matmul weights and embeddings), as in GPT-2/3: biases and LayerNorm
gains are 1-D, and decaying them towards 0 only hurts.

--optimizer muon splits the parameters by what Muon is for. Its update is an orthogonalised
matrix: every direction of a hidden layer's input/output map moves by about the same amount, which
is meaningful for a matrix that maps activations to activations. So the 2-D weights inside the
transformer blocks (attention qkv and output, MLP in and out: ~85M of GPT-2 small's 124M) go to
Muon. Everything else stays on AdamW: the token embedding is a lookup table whose rows are updated
independently (and tied to the LM head, whose update scale is that of the logits), the position
embedding and the value embeddings likewise, and biases, LayerNorm gains and the value-embedding and U-net
mixing weights are vectors, which Muon does not define. An untied
LM head (ModelConfig.tie_embeddings=False, lm_head.weight) is outside the blocks, so AdamW's too: it maps
to the logits, not to hidden activations. This is the split of modded-nanogpt's speedrun records and of
torch.optim.Muon's documentation.
"""

from __future__ import annotations

import torch

from gpt2.core.config import OptimConfig, tied_head_lr_problem
from gpt2.core.precision import Precision
from gpt2.distributed.group import Dist
from gpt2.plan.precision_choice import cuda_native_bf16


def param_groups(model: torch.nn.Module, weight_decay: float, optim: OptimConfig | None = None, peak_lr: float = 1.0):
    """AdamW's groups: 2-D weights decayed, the rest not; then the embeddings' and the head's own groups where
    --embed-lr or --head-lr sets them (after the two, so a run without them has today's groups exactly)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return adamw_groups(named, weight_decay, optim, peak_lr)


def adamw_groups(named, weight_decay: float, optim: OptimConfig | None, peak_lr: float) -> list[dict]:
    own = own_lr_groups(named, optim, peak_lr, weight_decay)
    taken = {id(p) for g in own for p in g["params"]}
    rest = [p for _, p in named if id(p) not in taken]
    groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
    ]
    if own or optim is not None and optim.optimizer == "muon":
        for g in groups:
            g["lr_scale"] = 1.0
    return groups + own


EMBEDDINGS = ("transformer.wte.weight", "transformer.wpe.weight")
VALUE_EMBEDDINGS = "transformer.ve."  # ModelConfig.value_embeds' tables: lookups, trained as the embeddings
HEAD = "lm_head.weight"


def is_embedding(name: str) -> bool:
    return name in EMBEDDINGS or name.startswith(VALUE_EMBEDDINGS)


def own_lr_groups(named, optim: OptimConfig | None, peak_lr: float, weight_decay: float) -> list[dict]:
    """The groups --embed-lr and --head-lr ask for, each with its lr as a share of the schedule's peak (the
    trainer sets lr * lr_scale every step); [] where neither is set. A tied head is the token embedding,
    named once (as transformer.wte.weight): --head-lr needs an untied one."""
    if optim is None:
        return []
    if problem := tied_head_lr_problem(HEAD not in {n for n, _ in named}, optim):
        raise ValueError(problem)
    out = []
    for lr, wanted in ((optim.embed_lr, is_embedding), (optim.head_lr, lambda name: name == HEAD)):
        params = [p for n, p in named if wanted(n)]
        if lr is not None and params:
            out.append({"params": params, "weight_decay": weight_decay, "lr_scale": lr / peak_lr})
    return out


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """A 2-D weight inside a transformer block (not an embedding, the LM head, a bias or a LayerNorm)."""
    return p.dim() == 2 and ".h." in f".{name}"


def split_params(model: torch.nn.Module) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """(muon, adamw) named parameters: every trainable parameter in exactly one of them."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # tied weights appear once
    return [(n, p) for n, p in named if is_muon_param(n, p)], [(n, p) for n, p in named if not is_muon_param(n, p)]


class Optimizers:
    """Several optimizers stepping as one: what the trainer, the GradScaler and checkpoints see.

    param_groups is every inner optimizer's groups (the same dicts), so the schedule and
    GradScaler.unscale_ reach every parameter; each group's "lr_scale" multiplies the schedule's lr.
    """

    def __init__(self, **optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers.values() for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for o in self.optimizers.values() for p, s in o.state.items()}

    def step(self, closure=None) -> None:
        for o in self.optimizers.values():
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers.values():
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": {name: o.state_dict() for name, o in self.optimizers.items()}}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("optimizers", {})
        if set(saved) != set(self.optimizers):
            raise ValueError(
                f"the saved optimizer state holds {sorted(saved) or 'one AdamW'}, this run {sorted(self.optimizers)}"
            )
        for name, o in self.optimizers.items():
            o.load_state_dict(saved[name])


def optimizer_kind(state: dict) -> str:
    """adamw or muon: which optimizer a saved optimizer state_dict belongs to."""
    return "muon" if "optimizers" in state else "adamw"


def make_adamw(params, optim: OptimConfig, lr: float, device: torch.device) -> torch.optim.AdamW:
    # One kernel per step instead of ~10 small ops per tensor (CUDA, and CPU since torch 2.4).
    fused = optim.fused_adamw and device.type in ("cuda", "cpu")
    return torch.optim.AdamW(params, lr=lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, fused=fused or None)


def make_optimizer(
    model: torch.nn.Module,
    optim: OptimConfig,
    device: torch.device,
    *,
    peak_lr: float,
    prec: Precision,
    dist: Dist | None = None,
):
    """The run's optimizer. peak_lr is the schedule's (Muon's groups scale it to muon_lr), prec the run's
    precision (Muon's Newton-Schulz dtype on a CPU); `dist` (several ranks) spreads Muon's
    orthogonalisation over them (gpt2/train/muon.py)."""
    if optim.optimizer == "adamw":
        return make_adamw(param_groups(model, optim.weight_decay, optim, peak_lr), optim, peak_lr, device)
    from gpt2.train.muon import Muon

    muon, adamw = split_params(model)
    # Newton-Schulz in bf16 where bf16 is native (as torch does), else fp32: emulated bf16 is ~40x
    # slower on a CPU, and fp16's range is too narrow for the iteration's Gram matrices. Decided from
    # what every rank agrees on (the GPU model; on a CPU the run's dtype, which rank 0 chose), never
    # from a per-rank measurement: ranks orthogonalising in different dtypes would drift apart.
    native = cuda_native_bf16(device) if device.type == "cuda" else prec.dtype == "bfloat16"
    ns_dtype = torch.bfloat16 if native else torch.float32
    return Optimizers(
        adamw=make_adamw(adamw_groups(adamw, optim.weight_decay, optim, peak_lr), optim, peak_lr, device),
        muon=Muon(
            [{"params": [p for _, p in muon], "lr_scale": optim.muon_lr / peak_lr}],
            lr=optim.muon_lr,
            momentum=optim.muon_momentum,
            weight_decay=optim.muon_weight_decay,
            nesterov=True,
            adjust_lr_fn="original",
            ns_dtype=ns_dtype,
            dist=dist,
            ortho=optim.muon_ortho,
            cautious_wd=optim.cautious_wd,
        ),
    )
