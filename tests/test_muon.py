"""--optimizer muon: Muon on the blocks' matrices, AdamW on the rest, with everything AdamW has
(DDP, accumulation, clipping, fp16's scaler, checkpoints and exact resume, the planner)."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch
from _helpers import (
    assert_same_state,
    built,
    hold_after_step,
    inject_nan,
    launch,
    load_ckpt,
    losses,
    optimizer_of,
    patched_train_script,
    release_run,
    run,
    tiny_run_flags,
    wait_for_step,
)
from conftest import TINY_MODEL_FLAGS, run_trainer

from gpt2.core.compat import has_muon
from gpt2.core.config import ModelConfig, RunConfig, TrainConfig
from gpt2.model.gpt import GPT
from gpt2.train.optim import Optimizers, split_params

if has_muon():  # torch >= 2.9: gpt2/train/muon.py subclasses torch.optim.Muon
    from gpt2.train.muon import Muon, newton_schulz

pytestmark = pytest.mark.torch_feature("muon")
CPU = torch.device("cpu")


def tiny_model(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, **kw))


def test_every_parameter_is_in_exactly_one_group_and_muon_gets_only_block_matrices():
    model = tiny_model()
    opt = optimizer_of(model, TrainConfig.of(data_dir="d", out_dir="o", optimizer="muon"), CPU)
    assert isinstance(opt, Optimizers) and set(opt.optimizers) == {"adamw", "muon"}
    groups = {name: [p for g in o.param_groups for p in g["params"]] for name, o in opt.optimizers.items()}
    everything = [p for ps in groups.values() for p in ps]
    assert len({id(p) for p in everything}) == len(everything) == len(list(model.parameters()))
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = sorted(names[id(p)] for p in groups["muon"])
    assert muon_names == sorted(
        f"transformer.h.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )
    assert all(p.dim() == 2 for p in groups["muon"])
    # The tied embedding / LM head, the position embedding, biases and LayerNorm stay on AdamW.
    adamw = {id(p) for p in groups["adamw"]}
    assert id(model.transformer.wte.weight) in adamw and model.lm_head.weight is model.transformer.wte.weight
    assert id(model.transformer.wpe.weight) in adamw
    assert not any(p.dim() < 2 for p in groups["muon"])


def test_split_params_and_plain_adamw_is_unchanged():
    model = tiny_model()
    muon, adamw = split_params(model)
    assert len(muon) + len(adamw) == len(list(model.parameters()))
    opt = optimizer_of(model, TrainConfig.of(data_dir="d", out_dir="o"), CPU)
    assert type(opt) is torch.optim.AdamW  # the default builds exactly what it built before


def test_our_muon_is_torchs_bit_for_bit_in_bf16_and_close_in_fp32():
    torch.manual_seed(0)
    shapes = [(96, 32), (32, 32), (32, 128)]
    params = {k: [torch.nn.Parameter(torch.randn(*s)) for s in shapes] for k in ("torch", "bf16", "fp32")}
    for k in ("bf16", "fp32"):
        for p, q in zip(params[k], params["torch"]):
            p.data.copy_(q.data)
    opts = {
        "torch": torch.optim.Muon(params["torch"], lr=0.02, weight_decay=0.1),
        "bf16": Muon(params["bf16"], lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16),
        "fp32": Muon(params["fp32"], lr=0.02, weight_decay=0.1, ns_dtype=torch.float32),
    }
    for _ in range(3):
        grads = [torch.randn(*s) for s in shapes]
        for k, ps in params.items():
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opts[k].step()
    for a, b, c in zip(params["torch"], params["bf16"], params["fp32"]):
        assert torch.equal(a, b)
        assert (a - c).abs().max() < 0.02 * 3 * 2  # bf16 vs fp32 iteration: within a fraction of an update
        assert not torch.equal(a, c)
    assert opts["bf16"].state_dict()["state"][0].keys() == {"momentum_buffer"}


def test_newton_schulz_orthogonalises():
    torch.manual_seed(0)
    for shape in [(64, 16), (16, 64)]:
        o = newton_schulz(torch.randn(*shape), (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32)
        s = torch.linalg.svdvals(o)
        assert o.shape == shape and 0.5 < s.min() and s.max() < 1.5  # U S' V^T with S' ~ 1


@pytest.mark.parametrize("shape", [(384, 1152), (1536, 384), (128, 512)])
def test_gram_form_is_the_same_iteration_with_fewer_flops(shape):
    """fp32's Gram form against the plain iteration in fp64, on a gradient-like spectrum (singular
    values over 4 decades): ~1e-5 apart, where torch's own bf16 iteration is ~1e-2 away."""
    from gpt2.train.muon import ns_flops, use_gram_form

    coefficients = (3.4445, -4.775, 2.0315)
    torch.manual_seed(0)
    u, s, v = torch.linalg.svd(torch.randn(*shape), full_matrices=False)
    g = u @ torch.diag(s * torch.logspace(0, -4, s.numel())) @ v
    wide = tuple(sorted(shape))
    assert use_gram_form(wide, 5, torch.float32)
    assert not use_gram_form(wide, 5, torch.bfloat16) and not use_gram_form((384, 384), 5, torch.float32)
    exact = newton_schulz(g, coefficients, 5, 1e-7, torch.float64)  # fp64: the plain loop
    gram = newton_schulz(g, coefficients, 5, 1e-7, torch.float32)
    assert gram.shape == g.shape and gram.dtype == torch.float32
    assert (gram.double() - exact).abs().max() < 1e-4
    assert (newton_schulz(g, coefficients, 5, 1e-7, torch.bfloat16).double() - exact).abs().max() > 1e-3
    m, n = wide
    assert (
        ns_flops(shape, 5, torch.float32)
        < 0.75 * ns_flops(shape, 5, torch.float64)
        == 0.75 * 5 * (2 * m * m * n + m**3)
    )


def test_planner_counts_muons_state_as_allocated():
    from gpt2.plan.memory import optimizer_bytes

    model = tiny_model()
    cfg = RunConfig(model.config, TrainConfig.of(data_dir="d", out_dir="o", optimizer="muon", fused_adamw=False))
    opt = optimizer_of(model, cfg.train, CPU)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    allocated = sum(t.nbytes for s in opt.state.values() for t in s.values() if t.dim() > 0)
    assert allocated == optimizer_bytes(model.config, "muon")
    assert optimizer_bytes(model.config, "muon") < optimizer_bytes(model.config, "adamw")


def test_checkpoint_of_one_optimizer_is_refused_by_the_other():
    from gpt2.ckpt import checkpoint as ckpt
    from gpt2.train.state import check_compatible

    class Log:
        def info(self, msg):
            pass

    model = tiny_model()
    for saved_kind, now_kind in (("adamw", "muon"), ("muon", "adamw")):
        tc = TrainConfig.of(data_dir="d", out_dir="o", optimizer=saved_kind)
        saved = {
            "config": RunConfig(model.config, tc).to_dict(),
            "tokenizer": "gpt2",
            "optimizer": optimizer_of(model, tc, CPU).state_dict(),
        }
        now = RunConfig(model.config, TrainConfig.of(data_dir="d", out_dir="o", optimizer=now_kind))
        with pytest.raises(
            ckpt.CheckpointError,
            match=f"trained with --optimizer {saved_kind}, this run asks for "
            f"--optimizer {now_kind}.*Resume with --optimizer {saved_kind}",
        ):
            check_compatible(saved, now, Log())


MUON = ["--optimizer", "muon", "--muon-lr", "0.02"]


def test_two_ranks_equal_one_rank_with_accumulation_under_muon(tmp_path, shakespeare_shards):
    common = [*tiny_run_flags(shakespeare_shards, max_steps=8, ckpt_interval=0), *MUON]
    two = run([*common, "--out-dir", str(tmp_path / "two")], nproc=2, log_dir=tmp_path / "log2")
    one = run([*common, "--out-dir", str(tmp_path / "one")], nproc=1, log_dir=tmp_path / "log1")
    assert two.proc.returncode == 0 and one.proc.returncode == 0, two.output() + one.output()
    a, b = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in a:
        assert a[step] == pytest.approx(b[step], abs=1e-5), (step, a[step], b[step])
    assert a[8] < a[1] - 0.1


@pytest.mark.slow  # ~45 s; kill -9 and bitwise resume with AdamW are in the default suite
def test_kill_9_and_resume_with_muon_is_bitwise_continues_on_one_rank_and_adamw_flag_is_refused(
    tmp_path, shakespeare_shards
):
    flags = [*tiny_run_flags(shakespeare_shards, max_steps=8, ckpt_interval=3), *MUON]
    ref = run([*flags, "--out-dir", str(tmp_path / "ref")], nproc=2, log_dir=tmp_path / "ref_log")
    assert ref.proc.returncode == 0, ref.output()
    run_dir = tmp_path / "run"
    release = tmp_path / "release"
    job = launch(
        [*flags, "--out-dir", str(run_dir)],
        nproc=2,
        log_dir=tmp_path / "log",
        max_restarts=1,
        script=patched_train_script(tmp_path, hold_after_step(5, release)),
    )
    try:
        wait_for_step(job, run_dir, 5)  # the ranks wait there: the run cannot end before the kill
        os.kill(job.workers()[1], signal.SIGKILL)
        release_run(job, release)
        assert job.wait() == 0, job.output()
    finally:
        job.kill()
    assert "resumed from" in job.stdout and "at step 3" in job.stdout, job.output()
    assert losses(run_dir) == losses(tmp_path / "ref")
    assert_same_state(load_ckpt(run_dir, 8), load_ckpt(tmp_path / "ref", 8))
    # The same run directory continued with AdamW: refused before anything is trained.
    again = run_trainer([*tiny_run_flags(shakespeare_shards, max_steps=10, ckpt_interval=3), "--out-dir", str(run_dir)])
    assert again.returncode == 2 and "trained with --optimizer muon" in again.stderr, again.stderr
    assert max(losses(run_dir)) == 8
    # The 2-rank step-3 checkpoint continued on one process (2 accumulation steps, no spreading).
    other = tmp_path / "other" / "checkpoints"
    other.mkdir(parents=True)
    for suffix in (".pt", ".json"):
        (other / f"step_00000003{suffix}").write_bytes(
            (tmp_path / "ref" / "checkpoints" / f"step_00000003{suffix}").read_bytes()
        )
    one = run_trainer([*flags, "--out-dir", str(other.parent)])
    assert one.returncode == 0 and "resume: world size 2 -> 1" in one.stdout, one.stderr
    got, want = losses(other.parent), losses(tmp_path / "ref")
    assert sorted(got) == list(range(4, 9))
    for step in got:
        assert got[step] == pytest.approx(want[step], abs=1e-5), step


@pytest.mark.slow
def test_fp16_scaler_clipping_and_the_nonfinite_guard_work_with_muon(tmp_path, shakespeare_shards, monkeypatch):
    inject_nan(monkeypatch, 1)
    from gpt2.distributed.group import Dist
    from gpt2.train.cli import parse_config
    from gpt2.train.run_log import RunLog
    from gpt2.train.trainer import train_step

    cfg = parse_config(
        [
            *TINY_MODEL_FLAGS,
            "--device",
            "cpu",
            "--compile",
            "false",
            "--dtype",
            "float16",
            "--data-dir",
            str(shakespeare_shards),
            "--out-dir",
            str(tmp_path),
            "--micro-batch-size",
            "2",
            "--total-batch-size",
            "128",
            "--max-steps",
            "4",
            "--grad-clip",
            "0.5",
            *MUON,
        ]
    )
    dist = Dist(rank=0, local_rank=0, world_size=1, local_world_size=1, device=CPU)
    parts = built(cfg, dist, RunLog(dist, tmp_path))
    before = {n: p.detach().clone() for n, p in parts.model.named_parameters()}
    outs = [train_step(parts, cfg.train, dist, False) for _ in range(3)]
    assert [o["skipped"] for o in outs] == [False, True, False]  # step 1's NaN loss: no update at all
    assert all(math.isfinite(o["loss"]) for o in (outs[0], outs[2]))
    moved = {n for n, p in parts.model.named_parameters() if not torch.equal(p, before[n])}
    assert "transformer.h.0.mlp.c_fc.weight" in moved and "transformer.wte.weight" in moved  # both optimizers
    assert parts.scaler.is_enabled() and parts.scaler.get_scale() > 0


def test_newton_schulz_dtype_follows_the_runs_agreed_dtype_not_a_per_rank_measurement(monkeypatch):
    import gpt2.plan.matmul_peak

    monkeypatch.setattr(gpt2.plan.matmul_peak, "matmul_rate", lambda *a, **k: pytest.fail("measured on this rank"))
    monkeypatch.setattr(gpt2.plan.matmul_peak, "peak_rates", lambda *a, **k: pytest.fail("measured on this rank"))
    model = tiny_model()
    for dtype, expected in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float32)):
        opt = optimizer_of(model, TrainConfig.of(data_dir="d", out_dir="o", optimizer="muon", dtype=dtype), CPU)
        assert opt.optimizers["muon"].ns_dtype == expected


def test_owners_balance_the_iterations_flops_and_are_the_same_table_everywhere():
    from gpt2.train.muon import ns_flops, owners

    shapes = [(1152, 384), (384, 384), (1536, 384), (384, 1536)] * 6  # the medium shape's six blocks
    assert owners(shapes, 1) == [0] * 24
    for world in (2, 3, 8):
        table = owners(shapes, world)
        assert table == owners(list(shapes), world) and set(table) == set(range(world))
        load = [sum(ns_flops(s, 5, torch.float32) for s, r in zip(shapes, table) if r == rank) for rank in range(world)]
        assert max(load) - min(load) <= max(ns_flops(s, 5, torch.float32) for s in shapes)  # within one matrix
    assert owners([(8, 8)], 4) == [0]  # more ranks than matrices: the rest own nothing


@pytest.mark.parametrize(
    "ns_dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)], ids=["fp32", "bf16"]
)
def test_spread_orthogonalisation_is_bitwise_the_single_process_step(tmp_path, ns_dtype):
    """On 2 and 3 ranks, each rank orthogonalises only the matrices it owns and receives the rest in
    one all-gather per step: the parameters and momentum are bit for bit what one process computes,
    on every rank."""
    from _helpers import MUON_SHAPES, muon_spread_worker, spawn_ranks

    from gpt2.train.muon import owners

    for w in (1, 2, 3):
        (tmp_path / str(w)).mkdir()
        spawn_ranks(muon_spread_worker, (w, str(tmp_path / f"pg{w}"), str(tmp_path / str(w)), ns_dtype), nprocs=w)
    ref = torch.load(tmp_path / "1" / "rank0.pt")
    assert len(ref["calls"]) == 3 * len(MUON_SHAPES) and ref["collectives"] == [[]] * 3  # one process: none
    for world in (2, 3):
        table = owners(MUON_SHAPES, world)
        for rank in range(world):
            got = torch.load(tmp_path / str(world) / f"rank{rank}.pt")
            assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"])), (world, rank)
            for i in range(len(MUON_SHAPES)):
                assert torch.equal(
                    got["state"]["state"][i]["momentum_buffer"], ref["state"]["state"][i]["momentum_buffer"]
                )
            mine = sorted(s for s, r in zip(MUON_SHAPES, table) if r == rank)
            assert sorted(got["calls"]) == sorted(mine * 3) and 0 < len(mine) < len(MUON_SHAPES)  # its share only
            assert got["collectives"] == [["all_gather_single"]] * 3  # one per step, whatever the world size


def test_gather_layout_pads_every_rank_to_the_largest_share():
    from gpt2.train.muon import gather_layout, owners

    shapes = [(8, 8), (4, 4), (2, 2)]
    table = owners(shapes, 4)
    assert table == [0, 1, 2]  # rank 3 owns nothing
    mine, length = gather_layout([a * b for a, b in shapes], table, 4)
    assert mine == [[0], [1], [2], []] and length == 64
    assert gather_layout([6, 5, 4], [1, 0, 1], 2) == ([[1], [0, 2]], 10)


def polar_express_reference(g: torch.Tensor) -> torch.Tensor:
    """Polar Express as its paper writes it (arXiv 2505.16932, 5 steps, safety factor 2e-2), plainly, in fp64."""
    from gpt2.train.muon import POLAR_EXPRESS

    x = g.double()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() * 1.02 + 1e-7)
    for a, b, c in POLAR_EXPRESS:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(384, 1152), (1152, 384), (128, 128)])
def test_polar_express_is_the_papers_iteration_and_ends_closer_to_orthogonal(shape):
    """--muon-ortho polar_express: ours (the Gram form in fp32 for the wide and tall matrices, the plain loop for
    the square one) against the paper's loop in fp64; and on a gradient-like spectrum (singular values over 3
    decades) its singular values end closer to 1 than Newton-Schulz's after the same 5 steps (its published effect)."""
    from gpt2.train.muon import POLAR_EXPRESS, POLAR_EXPRESS_SAFETY

    torch.manual_seed(0)
    u, s, v = torch.linalg.svd(torch.randn(*shape), full_matrices=False)
    g = u @ torch.diag(s * torch.logspace(0, -3, s.numel())) @ v
    want = polar_express_reference(g)
    exact = newton_schulz(g, POLAR_EXPRESS, 5, 1e-7, torch.float64, safety=POLAR_EXPRESS_SAFETY)
    assert (exact - want).abs().max() < 1e-10
    ours = newton_schulz(g, POLAR_EXPRESS, 5, 1e-7, torch.float32, safety=POLAR_EXPRESS_SAFETY)
    assert ours.shape == g.shape and (ours.double() - want).abs().max() < 1e-4
    ns = newton_schulz(g, (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float64)
    off = {name: (torch.linalg.svdvals(o) - 1).abs().mean().item() for name, o in (("pe", want), ("ns", ns))}
    assert off["pe"] < 0.8 * off["ns"], off


def test_the_flag_reaches_muon_and_a_wrong_name_is_refused():
    from gpt2.core.config import OptimConfig
    from gpt2.core.precision import FLOAT32
    from gpt2.train.muon import POLAR_EXPRESS, POLAR_EXPRESS_SAFETY
    from gpt2.train.optim import make_optimizer

    model = tiny_model()
    opt = make_optimizer(
        model, OptimConfig(optimizer="muon", muon_ortho="polar_express"), CPU, peak_lr=0.01, prec=FLOAT32
    )
    muon = opt.optimizers["muon"]
    assert muon.ortho == "polar_express"
    g = torch.randn(96, 32)
    assert torch.equal(
        muon.orthogonalise(g, muon.param_groups[0]),
        newton_schulz(g, POLAR_EXPRESS, 5, 1e-7, muon.ns_dtype, safety=POLAR_EXPRESS_SAFETY),
    )
    plain = make_optimizer(tiny_model(), OptimConfig(optimizer="muon"), CPU, peak_lr=0.01, prec=FLOAT32).optimizers[
        "muon"
    ]
    assert plain.ortho == "newton_schulz"  # the default: torch's iteration, as before
    with pytest.raises(ValueError, match=r"muon_ortho='polar' must be one of \('newton_schulz', 'polar_express'\)"):
        OptimConfig(muon_ortho="polar")


def test_cautious_weight_decay_decays_only_where_the_update_shrinks_the_weight():
    """--cautious-wd against the rule written out (arXiv 2510.12402, modded-nanogpt's record of 2025-11-10):
    p <- p - lr*wd*p*[ortho*p >= 0] - scale*ortho, on a matrix whose update has the weight's sign at some entries
    and not at others; off, every entry decays (the default step, unchanged)."""
    from gpt2.core.config import OptimConfig
    from gpt2.train.muon import _adjust_lr

    torch.manual_seed(0)
    p0, g = torch.randn(48, 16), torch.randn(48, 16)
    lr, wd, momentum = 0.05, 0.5, 0.95

    def one_step(cautious: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
        p = torch.nn.Parameter(p0.clone())
        muon = Muon(
            [p], lr=lr, momentum=momentum, weight_decay=wd, nesterov=True, adjust_lr_fn="original",
            ns_dtype=torch.float32, cautious_wd=cautious,
        )  # fmt: skip
        p.grad = g.clone()
        muon.step()
        group = muon.param_groups[0]
        update = g.lerp((1 - momentum) * g, momentum)  # Nesterov's first step from an empty buffer
        return p.detach(), muon.orthogonalise(update, group), group

    got, ortho, group = one_step(True)
    scale = _adjust_lr(lr, "original", p0.shape)
    shrinks = ortho * p0 >= 0
    assert 0.2 < shrinks.float().mean() < 0.8  # both kinds of entry are there
    want = torch.where(shrinks, p0 * (1 - lr * wd), p0) - scale * ortho
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    plain, _, _ = one_step(False)
    torch.testing.assert_close(plain, p0 * (1 - lr * wd) - scale * ortho, rtol=0, atol=1e-6)
    assert not torch.allclose(plain[~shrinks], got[~shrinks])
    torch.testing.assert_close(plain[shrinks], got[shrinks], rtol=0, atol=1e-6)
    assert make_muon_from_flags(cautious_wd=True).cautious_wd and not make_muon_from_flags().cautious_wd
    with pytest.raises(ValueError, match=r"cautious_wd=True gates Muon's weight decay: add --optimizer muon"):
        OptimConfig(cautious_wd=True)


def make_muon_from_flags(**optim):
    from gpt2.core.config import OptimConfig
    from gpt2.core.precision import FLOAT32
    from gpt2.train.optim import make_optimizer

    cfg = OptimConfig(optimizer="muon", **optim)
    return make_optimizer(tiny_model(), cfg, CPU, peak_lr=0.01, prec=FLOAT32).optimizers["muon"]
