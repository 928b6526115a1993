"""--embed-lr and --head-lr (issue 76: modded-nanogpt's records train the embeddings at 0.3 and the head at 0.002
at GPT-2 size): their AdamW groups, the schedule's lr applied to them, and what a resume allows."""

from __future__ import annotations

import pytest
import torch
from test_checkpoint import Log, run_config

from gpt2.ckpt import checkpoint as ckpt
from gpt2.core.config import ModelConfig, OptimConfig, ScheduleConfig
from gpt2.core.precision import FLOAT32
from gpt2.model.gpt import GPT
from gpt2.train.cli import parse_config
from gpt2.train.optim import make_optimizer
from gpt2.train.state import check_compatible
from gpt2.train.trainer import set_lr

CPU = torch.device("cpu")


def model(**changes) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, **changes))


def groups_of(opt) -> list[dict]:
    """Each group's parameter ids and its settings but lr, in order (AdamW's, then Muon's)."""
    return [
        {"ids": [id(p) for p in g["params"]], **{k: v for k, v in g.items() if k not in ("params", "lr")}}
        for g in opt.param_groups
    ]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_unset_they_leave_todays_groups_exactly(optimizer):
    """A run without either flag has the groups it had before them: the same parameters in the same order with
    the same settings, so its updates and its checkpoints' optimizer state are today's."""
    m = model()
    opt = make_optimizer(m, OptimConfig(optimizer=optimizer), CPU, peak_lr=1e-3, prec=FLOAT32)
    params = [p for p in m.parameters() if p.requires_grad]
    if optimizer == "adamw":  # the plain groups, as gpt2/train/optim.py wrote them before the flags
        assert [g["ids"] for g in groups_of(opt)] == [
            [id(p) for p in params if p.dim() >= 2],
            [id(p) for p in params if p.dim() < 2],
        ]
        assert all("lr_scale" not in g for g in opt.param_groups)
    else:
        assert [g.get("lr_scale") for g in opt.param_groups] == [1.0, 1.0, 0.02 / 1e-3]
    assert sorted(i for g in groups_of(opt) for i in g["ids"]) == sorted(id(p) for p in params)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_set_the_embeddings_and_the_head_get_their_own_groups(optimizer):
    m = model(tie_embeddings=False)
    optim = OptimConfig(optimizer=optimizer, embed_lr=0.3, head_lr=0.002, weight_decay=0.1)
    opt = make_optimizer(m, optim, CPU, peak_lr=0.01, prec=FLOAT32)
    groups = groups_of(opt)
    embed = [id(m.transformer.wte.weight), id(m.transformer.wpe.weight)]
    head = [id(m.lm_head.weight)]
    by_ids = {tuple(g["ids"]): g for g in groups}
    assert by_ids[tuple(embed)]["lr_scale"] == pytest.approx(30.0) and by_ids[tuple(embed)]["weight_decay"] == 0.1
    assert by_ids[tuple(head)]["lr_scale"] == pytest.approx(0.2)
    ids = [i for g in groups for i in g["ids"]]
    assert len(ids) == len(set(ids)) == sum(1 for p in m.parameters() if p.requires_grad)  # each once
    for p in (m.transformer.wte.weight, m.lm_head.weight):  # not in the decayed 2-D group as well
        assert id(p) not in groups[0]["ids"]
    set_lr_to(opt, peak=0.01)
    lrs = {tuple(g["ids"]): g["lr"] for g in groups_of_with_lr(opt)}
    assert lrs[tuple(embed)] == pytest.approx(0.3) and lrs[tuple(head)] == pytest.approx(0.002)
    if optimizer == "muon":
        assert groups[-1]["lr_scale"] == pytest.approx(optim.muon_lr / 0.01)  # Muon's own, as before


def groups_of_with_lr(opt) -> list[dict]:
    return [{"ids": [id(p) for p in g["params"]], "lr": g["lr"]} for g in opt.param_groups]


def set_lr_to(opt, *, peak: float) -> None:
    """The trainer's set_lr at the end of warmup (the schedule's peak)."""

    class Parts:
        optimizer = opt
        step = 10

    set_lr(Parts(), ScheduleConfig(lr=peak, min_lr=peak / 10, warmup_steps=10, max_steps=100))


def test_the_first_adamw_step_moves_the_embedding_by_its_own_rate():
    """A plainly written reference: AdamW's first step moves each element with a gradient by lr (its bias-corrected
    m / sqrt(v) is the gradient's sign), less the decay. The token embedding at --embed-lr 0.5 moves by 0.5, the
    blocks at --lr 0.01 by 0.01."""
    m = model(tie_embeddings=False)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = make_optimizer(m, OptimConfig(embed_lr=0.5, weight_decay=0.0), CPU, peak_lr=0.01, prec=FLOAT32)
    set_lr_to(opt, peak=0.01)
    idx = torch.randint(0, 50257, (2, 16))
    _, loss = m(idx, idx)
    loss.backward()
    opt.step()
    moved = (m.transformer.wte.weight.detach() - before["transformer.wte.weight"]).abs()
    rows = torch.unique(idx)
    assert moved[rows].max() == pytest.approx(0.5, rel=1e-3) and moved[rows].median() == pytest.approx(0.5, rel=1e-3)
    fc = "transformer.h.0.mlp.c_fc.weight"
    assert (dict(m.named_parameters())[fc].detach() - before[fc]).abs().max() == pytest.approx(0.01, rel=1e-3)


def test_a_head_lr_with_a_tied_head_is_one_line_naming_the_flag(capsys):
    """Refused with the flags (also by --dry-run, before any process starts) and where the groups are made."""
    with pytest.raises(ValueError, match=r"--head-lr 0.002 needs an untied LM head \(--tie-embeddings false\)"):
        make_optimizer(model(), OptimConfig(head_lr=0.002), CPU, peak_lr=0.01, prec=FLOAT32)
    with pytest.raises(SystemExit):
        parse_config(["--preset", "gpt2", "--head-lr", "0.002", "--data-dir", "D", "--out-dir", "O"])
    assert "--head-lr 0.002 needs an untied LM head" in capsys.readouterr().err
    untied = parse_config(
        ["--preset", "gpt2", "--arch", "modern", "--head-lr", "0.002", "--data-dir", "D", "--out-dir", "O"]
    )
    assert untied.train.optim.head_lr == 0.002


def test_a_resume_may_change_their_values_but_not_whether_they_are_set():
    saved = {"config": run_config(embed_lr=0.3).to_dict(), "tokenizer": "gpt2"}
    log = Log()
    check_compatible(saved, run_config(embed_lr=0.2), log)  # a new value: the groups are the same
    assert "resume: embed_lr changed from 0.3 to 0.2" in log.lines
    with pytest.raises(ckpt.CheckpointError, match=r"--embed-lr: set in one of the checkpoint and this run"):
        check_compatible(saved, run_config(), Log())
    plain = {"config": run_config(tie_embeddings=False).to_dict(), "tokenizer": "gpt2"}
    with pytest.raises(ckpt.CheckpointError, match=r"--head-lr: set in one .*--resume never"):
        check_compatible(plain, run_config(head_lr=0.002, tie_embeddings=False), Log())


def test_a_value_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match=r"embed_lr=0.0 must be > 0, or none for --lr's"):
        OptimConfig(embed_lr=0.0)
