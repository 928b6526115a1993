"""--preset gpt2-speedrun (issue 76): modded-nanogpt's record of 2024-11-03 at GPT-2 124M's shape with the modern
architecture and attention within documents, and the next record's Muon momentum warmup
(--muon-momentum-warmup): the preset's values against the record's, its schedule against the record's get_lr
written out, the warmed momentum against a Muon made with that momentum, and a run of it at a tiny stand-in shape."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from _helpers import FP32_CPU, losses
from conftest import TINY_MODEL_FLAGS, run_trainer
from test_lr_groups import model, set_lr_to

from gpt2.core.config import OptimConfig
from gpt2.core.precision import FLOAT32
from gpt2.core.schedule import lr_at, momentum_at
from gpt2.train.cli import parse_config
from gpt2.train.optim import make_optimizer
from gpt2.train.trainer import set_muon_momentum

CPU = torch.device("cpu")
REQUIRED = ["--data-dir", "D", "--out-dir", "O"]


def record_get_lr(it: int, num_iterations: int = 4578, warmdown_iters: int = 1308) -> float:
    """The record's schedule multiplier (its train_gpt2.py get_lr, warmup_iters = 0), as written there."""
    if it < num_iterations - warmdown_iters:
        return 1.0
    return (num_iterations - it) / warmdown_iters


def record_momentum(step: int) -> float:
    """The record of 2024-11-06's Muon momentum warmup, as written there."""
    frac = min(step / 500, 1)
    return (1 - frac) * 0.85 + frac * 0.95


def test_the_preset_is_the_records_recipe():
    cfg = parse_config(["--preset", "gpt2-speedrun", *REQUIRED])
    m, t = cfg.model, cfg.train
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, m.vocab_size) == (12, 12, 768, 1024, 50304)
    assert (m.rope, m.qk_norm, m.mlp_act, m.norm, m.tie_embeddings, m.zero_init_proj, m.bias) == (
        True,
        True,
        "relu2",
        "rmsnorm",
        False,
        True,
        False,
    )
    assert m.doc_attention and m.logit_softcap == 15.0
    assert (t.batch.micro_batch_size, t.batch.total_batch_size) == ("auto", 8 * 64 * 1024)
    s, o = t.schedule, t.optim
    assert (s.max_steps, s.warmup_steps, s.decay_steps, s.min_lr) == (4578, 0, 1308, 0.0)
    assert (o.optimizer, o.muon_lr, o.muon_momentum, o.embed_lr, o.head_lr) == ("muon", 0.02, 0.95, 0.3, 0.002)
    assert (o.muon_momentum_warmup, o.muon_momentum_start) == (500, 0.85)
    assert (o.beta1, o.beta2, o.weight_decay, o.muon_weight_decay, o.grad_clip) == (0.9, 0.95, 0.0, 0.0, 0.0)


def test_its_schedule_is_the_records_step_for_step():
    s = parse_config(["--preset", "gpt2-speedrun", *REQUIRED]).train.schedule
    kw = dict(
        max_lr=1.0, min_lr=s.min_lr, warmup_steps=s.warmup_steps, max_steps=s.max_steps, decay_steps=s.decay_steps
    )
    for it in range(s.max_steps):
        assert lr_at(it, **kw) == pytest.approx(record_get_lr(it), abs=1e-12), it
    assert lr_at(0, **kw) == 1.0 and lr_at(s.max_steps - 1, **kw) == pytest.approx(1 / 1308)


@pytest.mark.parametrize("step", [0, 1, 250, 499, 500, 501, 4577])
def test_momentum_at_is_the_records_warmup(step):
    assert momentum_at(step, start=0.85, end=0.95, warmup_steps=500) == pytest.approx(record_momentum(step), abs=1e-15)
    assert momentum_at(step, start=0.85, end=0.95, warmup_steps=0) == 0.95  # no warmup: the flag's from step 0


def test_muon_steps_with_the_warmed_momentum_and_adamw_is_untouched():
    """After set_muon_momentum at step 100 (0.87), two steps update the weights exactly as a Muon made with
    that momentum does; AdamW's groups (betas, no momentum) are as they were."""
    WARMED = momentum_at(100, start=0.85, end=0.95, warmup_steps=500)
    configs = {
        "warmed": OptimConfig(optimizer="muon", muon_momentum_warmup=500, embed_lr=0.3, weight_decay=0.0),
        "fixed": OptimConfig(optimizer="muon", muon_momentum=WARMED, embed_lr=0.3, weight_decay=0.0),
    }
    runs = {}
    for name, cfg in configs.items():
        m = model(tie_embeddings=False)
        opt = make_optimizer(m, cfg, CPU, peak_lr=0.01, prec=FLOAT32)
        adamw_before = [dict(g) for g in opt.optimizers["adamw"].param_groups]
        if name == "warmed":
            set_muon_momentum(SimpleNamespace(step=100, optimizer=opt), cfg)
            assert [g["momentum"] for g in opt.optimizers["muon"].param_groups] == [WARMED] and WARMED == pytest.approx(
                0.87
            )
            assert [dict(g) for g in opt.optimizers["adamw"].param_groups] == adamw_before
        torch.manual_seed(1)
        for _ in range(2):
            set_lr_to(opt, peak=0.01)
            idx = torch.randint(0, 50257, (2, 16))
            _, loss = m(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
        runs[name] = {n: p.detach().clone() for n, p in m.named_parameters()}
    assert runs["warmed"].keys() == runs["fixed"].keys()
    for n in runs["warmed"]:
        assert torch.equal(runs["warmed"][n], runs["fixed"][n]), n


def test_a_warmup_or_start_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"muon_momentum_warmup=-1 must be >= 0 steps"):
        OptimConfig(muon_momentum_warmup=-1)
    with pytest.raises(ValueError, match=r"muon_momentum_start=1.0 in \[0, 1\)"):
        OptimConfig(muon_momentum_start=1.0)


def test_the_preset_trains_at_a_tiny_stand_in_on_a_cpu(tmp_path, shakespeare_shards):
    """Every piece of the recipe on (Muon with the momentum warmup, the embeddings' and head's rates, attention within
    documents, the modern blocks, the WSD schedule to 0), at 2 layers x 64 for 12 steps: it learns."""
    out = tmp_path / "run"
    done = run_trainer(
        [
            "--preset",
            "gpt2-speedrun",
            *TINY_MODEL_FLAGS,
            *FP32_CPU,
            *("--data-dir", str(shakespeare_shards), "--out-dir", str(out)),
            *("--micro-batch-size", "4", "--total-batch-size", "512", "--max-steps", "12", "--decay-steps", "4"),
            *("--muon-momentum-warmup", "4", "--eval-interval", "0", "--eval-tokens", "1024", "--ckpt-interval", "0"),
            *("--log-interval", "1"),
        ]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = losses(out)
    assert sorted(got) == list(range(1, 13))
    assert min(got[s] for s in range(10, 13)) < got[1] - 1.0, got
    optim = json.loads((out / "config.json").read_text())["config"]["train"]["optim"]
    assert (optim["optimizer"], optim["muon_momentum_warmup"], optim["embed_lr"], optim["head_lr"]) == (
        "muon",
        4,
        0.3,
        0.002,
    )
