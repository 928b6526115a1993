"""The architecture options of ModelConfig (docs/modern.md), each against a reference written plainly here,
and what reaches them: the KV cache, the loss paths, the optimizers, the planner, checkpoints, export."""

import math

import pytest
import torch
import torch.nn.functional as F
from _helpers import optimizer_of

from gpt2.core.config import ARCHS, GPT2_VOCAB_SIZE, ModelConfig, param_count
from gpt2.core.precision import Precision
from gpt2.model.gpt import GPT, RMS_EPS, KVCache, apply_rope, rms_norm, rope_tables

MODERN = ARCHS["modern"]


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{**dict(n_layer=2, n_head=4, n_embd=64, block_size=32), **overrides})


def made(cfg: ModelConfig, seed: int = 0, **kwargs) -> GPT:
    """GPT(cfg) with every weight random (zero-initialised projections too: a zero c_proj would hide the
    attention and MLP from every comparison below)."""
    torch.manual_seed(seed)
    model = GPT(cfg, **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            if p.abs().max() == 0:
                p.normal_(0.0, 0.02)
    return model.eval()


def batch(seed: int = 1, B: int = 2, T: int = 32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, GPT2_VOCAB_SIZE, (B, T), generator=g), torch.randint(
        0, GPT2_VOCAB_SIZE, (B, T), generator=g
    )


# ---- off by default: GPT-2 as before ----

GPT2_NAMES = [
    "transformer.wte.weight",
    "transformer.wpe.weight",
    *[
        f"transformer.h.0.{m}.{k}"
        for m in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
        for k in ("weight", "bias")
    ],
    "transformer.ln_f.weight",
    "transformer.ln_f.bias",
    "lm_head.weight",
]


def test_the_default_model_is_gpt2_as_before():
    """Defaults: GPT-2's state-dict names in order, the same weights and losses as every option spelled out
    off (ARCHS["gpt2"], what --arch gpt2 sets), and the loss the code gave before the options existed
    (10.81675910949707 at this seed and batch, chunked and full alike; measured at commit 3c4e739, bitwise
    equal there and after, on this CPU: the tolerance is for other machines' kernels)."""
    assert list(GPT(tiny(n_layer=1)).state_dict()) == GPT2_NAMES
    cfg = tiny()
    assert cfg == tiny(**ARCHS["gpt2"])
    idx, y = batch()
    for impl in ("chunked", "full"):
        torch.manual_seed(0)
        default = GPT(cfg, loss_impl=impl)
        torch.manual_seed(0)
        spelled_out = GPT(ModelConfig(**{**cfg.to_dict(), **ARCHS["gpt2"]}), loss_impl=impl)
        assert all(torch.equal(a, b) for a, b in zip(default.state_dict().values(), spelled_out.state_dict().values()))
        losses = [m(idx, y, return_logits=False)[1] for m in (default, spelled_out)]
        assert torch.equal(losses[0], losses[1])
        assert losses[0].item() == pytest.approx(10.81675910949707, rel=1e-6), impl
        losses[0].backward()
        assert default.transformer.wpe.weight.grad is not None  # learned positions, trained


# ---- each option against its formula ----


def test_rope_rotates_each_pair_by_position_times_its_frequency():
    """apply_rope(rope_tables) against the rotation written out: pair (j, j + hd/2) of position p turned by
    p * base^(-2j/hd), in a plain loop."""
    B, T, H, hd, base, start = 2, 5, 3, 8, 10000.0, 7
    x = torch.randn(B, T, H, hd)
    pos = torch.arange(start, start + T)
    got = apply_rope(x, *rope_tables(pos, hd, base))
    want = torch.empty_like(x)
    for t in range(T):
        for j in range(hd // 2):
            theta = (start + t) * base ** (-2 * j / hd)
            a, b = x[:, t, :, j], x[:, t, :, j + hd // 2]
            want[:, t, :, j] = a * math.cos(theta) - b * math.sin(theta)
            want[:, t, :, j + hd // 2] = a * math.sin(theta) + b * math.cos(theta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rope_scores_depend_on_the_distance_only():
    """What RoPE is for: q_m . k_n depends on m - n, not on m and n."""
    hd = 16
    q, k = torch.randn(1, 1, 1, hd), torch.randn(1, 1, 1, hd)

    def score(m, n):
        qm = apply_rope(q, *rope_tables(torch.tensor([m]), hd, 10000.0))
        kn = apply_rope(k, *rope_tables(torch.tensor([n]), hd, 10000.0))
        return (qm * kn).sum()

    torch.testing.assert_close(score(3, 1), score(20, 18), atol=1e-5, rtol=1e-5)


def test_rms_norm_is_x_over_its_root_mean_square():
    x = torch.randn(3, 7, 16) * 5
    torch.testing.assert_close(rms_norm(x), x / torch.sqrt((x * x).mean(-1, keepdim=True) + RMS_EPS))


def reference_attention(x, attn, cfg: ModelConfig):
    """The attention block written out: c_attn, per-head QK-norm, RoPE in a loop, causal softmax, c_proj."""
    B, T, C = x.shape
    hd, group = cfg.head_dim, cfg.n_head // cfg.n_kv_head
    qkv = F.linear(x, attn.c_attn.weight, attn.c_attn.bias)
    q, k, v = qkv.split([C, cfg.n_kv_head * hd, cfg.n_kv_head * hd], dim=-1)

    def prepare(z, heads):
        z = z.view(B, T, heads, hd)
        if cfg.qk_norm:
            z = z / torch.sqrt((z * z).mean(-1, keepdim=True) + RMS_EPS)
        if cfg.rope:
            out = z.clone()
            for t in range(T):
                for j in range(hd // 2):
                    c, s = math.cos(t * cfg.rope_base ** (-2 * j / hd)), math.sin(t * cfg.rope_base ** (-2 * j / hd))
                    out[:, t, :, j] = z[:, t, :, j] * c - z[:, t, :, j + hd // 2] * s
                    out[:, t, :, j + hd // 2] = z[:, t, :, j] * s + z[:, t, :, j + hd // 2] * c
            z = out
        return z

    q, k, v = prepare(q, cfg.n_head), prepare(k, cfg.n_kv_head), v.view(B, T, cfg.n_kv_head, hd)
    heads = []
    for h in range(cfg.n_head):
        scores = q[:, :, h] @ k[:, :, h // group].transpose(-1, -2) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(scores.softmax(-1) @ v[:, :, h // group])
    return F.linear(torch.cat(heads, dim=-1), attn.c_proj.weight, attn.c_proj.bias)


@pytest.mark.parametrize("options", [dict(rope=True), dict(qk_norm=True), dict(rope=True, qk_norm=True, n_kv_head=2)])
def test_attention_with_rope_and_qk_norm_equals_the_reference(options):
    cfg = tiny(**options, block_size=12)
    model = made(cfg)
    attn = model.transformer.h[0].attn
    x = torch.randn(2, 12, cfg.n_embd)
    rope = rope_tables(torch.arange(12), cfg.head_dim, cfg.rope_base) if cfg.rope else None
    with torch.no_grad():
        torch.testing.assert_close(attn(x, None, rope), reference_attention(x, attn, cfg), atol=1e-5, rtol=1e-4)


def test_relu2_mlp_is_relu_squared():
    mlp = made(tiny(mlp_act="relu2")).transformer.h[0].mlp
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        want = F.linear(
            torch.relu(F.linear(x, mlp.c_fc.weight, mlp.c_fc.bias)) ** 2, mlp.c_proj.weight, mlp.c_proj.bias
        )
        torch.testing.assert_close(mlp(x), want)


def test_rmsnorm_norms_have_no_parameters_and_are_the_formula():
    model = made(tiny(norm="rmsnorm"))
    assert not [n for n in dict(model.named_parameters()) if ".ln_" in n]
    x = torch.randn(2, 5, 64)
    torch.testing.assert_close(model.transformer.ln_f(x), x / torch.sqrt((x * x).mean(-1, keepdim=True) + RMS_EPS))


@pytest.mark.parametrize("impl", ["chunked", "full"])
def test_softcap_logits_and_loss_are_the_formula(impl):
    """Logits cap * tanh(raw / cap) with the padded rows still -inf; the loss of both paths and its gradients
    those of F.cross_entropy over the capped logits."""
    cap = 2.0  # small, so that the cap bites at init scale
    model = made(tiny(logit_softcap=cap), loss_impl=impl)
    with torch.no_grad():
        model.lm_head.weight.mul_(200)  # raw logits of several units: tanh far from linear
    idx, y = batch(T=16)
    y[0, :3] = -1
    blocks_out = torch.randn(2, 16, 64)
    x = model.transformer.ln_f(blocks_out)  # what head_loss computes from the blocks' output
    raw = F.linear(x, model.lm_head.weight)
    capped = cap * torch.tanh(raw / cap)
    capped = torch.cat([capped[..., :GPT2_VOCAB_SIZE], torch.full_like(capped[..., GPT2_VOCAB_SIZE:], -math.inf)], -1)
    logits = model.exact_logits(x)
    torch.testing.assert_close(logits, capped)
    assert logits[..., :GPT2_VOCAB_SIZE].abs().max() <= cap and raw.abs().max() > 3 * cap
    want = F.cross_entropy(capped.view(-1, capped.size(-1)), y.view(-1), ignore_index=-1)
    got = model.head_loss(blocks_out, y)
    torch.testing.assert_close(got, want)
    g_got = torch.autograd.grad(got, model.lm_head.weight, retain_graph=True)[0]
    g_want = torch.autograd.grad(want, model.lm_head.weight)[0]
    torch.testing.assert_close(g_got, g_want, atol=1e-6, rtol=1e-4)


def test_softcap_chunked_equals_full_under_bf16_autocast():
    cfg = tiny(logit_softcap=15.0, tie_embeddings=False)
    idx, y = batch()
    losses, grads = [], []
    for impl in ("chunked", "full"):
        model = made(cfg, loss_impl=impl).train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx, y, return_logits=False)
        loss.backward()
        losses.append(loss)
        grads.append(model.lm_head.weight.grad)
    torch.testing.assert_close(losses[0], losses[1], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-4, rtol=0.05)


def test_the_fp8_head_applies_the_softcap_too():
    from gpt2.model.fp8 import fp8_problem

    if fp8_problem("cpu") is not None:
        pytest.skip(fp8_problem("cpu"))
    model = made(tiny(logit_softcap=1.0), loss_impl="full", fp8_head=True).train()
    with torch.no_grad():
        model.lm_head.weight.mul_(200)
    logits = model.head(torch.randn(2, 8, 64))  # gradients on: the FP8 matmul
    assert logits[..., :GPT2_VOCAB_SIZE].abs().max() <= 1.0 and torch.isinf(logits[..., GPT2_VOCAB_SIZE:]).all()


def test_an_untied_head_is_a_parameter_of_its_own():
    model = made(tiny(tie_embeddings=False)).train()
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert "lm_head.weight" in dict(model.named_parameters())
    assert param_count(model.config) == sum(p.numel() for p in model.parameters()) == model.num_params()
    idx, y = batch()
    model(idx, y)[1].backward()
    assert not torch.equal(model.lm_head.weight.grad, model.transformer.wte.weight.grad)


@pytest.mark.parametrize("tied", [True, False])
def test_zero_init_projections_are_zero_at_init(tied):
    torch.manual_seed(0)
    model = GPT(tiny(zero_init_proj=True, tie_embeddings=tied))
    for block in model.transformer.h:
        assert not block.attn.c_proj.weight.any() and not block.mlp.c_proj.weight.any()
        assert block.mlp.c_fc.weight.std() > 0.01  # the others as GPT-2's
    assert model.lm_head.weight.any() == tied  # a tied head is the embedding: not zeroed
    assert model.transformer.wte.weight.std() > 0.01


# ---- every option on at once ----


def test_all_options_forward_and_backward_in_fp32_and_bf16():
    idx, y = batch()
    for autocast in (False, True):
        model = GPT(tiny(**MODERN, n_kv_head=2)).train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits, loss = model(idx, y)
        assert abs(loss.item() - math.log(GPT2_VOCAB_SIZE)) < 1e-3  # zero head: uniform over the real tokens
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        assert model.lm_head.weight.grad.abs().sum() > 0


@pytest.mark.slow  # ~18 s on 2 shared CPU cores
def test_all_options_under_torch_compile():
    cfg = tiny(**MODERN, n_layer=1, block_size=16)
    idx, y = batch(T=16)
    model = made(cfg).train()
    _, loss = torch.compile(model)(idx, y, return_logits=False)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    _, eager = model(idx, y, return_logits=False)
    eager.backward()
    torch.testing.assert_close(loss, eager, atol=1e-4, rtol=1e-4)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize("options", [dict(rope=True), dict(MODERN, n_kv_head=2)], ids=["rope", "all"])
def test_incremental_decoding_with_the_kv_cache_gives_the_full_forwards_logits(options):
    cfg = tiny(**options)
    model = made(cfg)
    idx, _ = batch(T=20)
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(cfg, 2, device="cpu", dtype=torch.float32)
        pieces = [model(idx[:, :7], kv_cache=cache)[0]]  # a prompt, then one token at a time
        pieces += [model(idx[:, t : t + 1], kv_cache=cache)[0] for t in range(7, 20)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_cached_generation_equals_uncached_past_the_block():
    model = made(tiny(**MODERN, block_size=16))
    idx, _ = batch(T=10)
    kw = dict(temperature=0.0)
    torch.testing.assert_close(
        model.generate(idx, 12, use_cache=True, **kw), model.generate(idx, 12, use_cache=False, **kw)
    )


# ---- optimizers ----


@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("muon", marks=pytest.mark.torch_feature("muon"))])
def test_both_optimizers_train_every_option(optimizer):
    from gpt2.core.config import TrainConfig
    from gpt2.train.optim import split_params

    model = GPT(tiny(**MODERN, n_kv_head=2)).train()
    if optimizer == "muon":
        muon, adamw = split_params(model)
        assert "lm_head.weight" in dict(adamw) and "transformer.wte.weight" in dict(adamw)
        assert all(".h." in f".{n}" for n, _ in muon)
    tc = TrainConfig.of(optimizer=optimizer, lr=3e-3, muon_lr=0.02, dtype="float32")
    opt = optimizer_of(model, tc, torch.device("cpu"))
    for group in opt.param_groups:
        group["lr"] = group.get("lr_scale", 1.0) * tc.schedule.lr
    idx, y = batch(T=16)
    losses = []
    for _ in range(6):
        _, loss = model(idx, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 0.5, losses


# ---- the planner ----


def test_the_untied_head_adds_its_weight_gradient_and_moments_but_no_flops():
    from gpt2.plan.flops import flops_per_token
    from gpt2.plan.hardware import Hardware
    from gpt2.plan.memory import memory, run_config

    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=64)
    untied = cfg.replace(tie_embeddings=False)
    Vh = cfg.vocab_size * cfg.n_embd
    assert param_count(untied) == param_count(cfg) + Vh
    assert flops_per_token(untied) == flops_per_token(cfg)  # the embedding is a lookup once untied
    hw = Hardware(name="test", memory_bytes=80 * 2**30, peak_flops=1e15)
    for optimizer, state in (("adamw", 8), ("muon", 8)):  # the head is AdamW's under Muon too
        a, b = (
            memory(run_config(m, 4, prec=Precision.from_key("bf16"), optimizer=optimizer), hw) for m in (cfg, untied)
        )
        assert b.weights - a.weights == 4 * Vh and b.gradients - a.gradients == 4 * Vh
        assert b.optimizer - a.optimizer == state * Vh
        assert b.autocast_weights == a.autocast_weights  # one matrix for the head's matmul either way


def test_rope_drops_the_position_table_and_saves_rotated_q_and_k():
    from gpt2.plan.flops import flops_per_token
    from gpt2.plan.memory import activation_bytes

    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=64)
    rope = cfg.replace(rope=True)
    assert param_count(rope) == param_count(cfg) - cfg.block_size * cfg.n_embd
    assert flops_per_token(rope) == flops_per_token(cfg)  # the table was a lookup: never counted
    for dtype, s in (("bf16", 2), ("fp32", 4)):
        extra = activation_bytes(rope, 3, 64, prec=Precision.from_key(dtype)) - activation_bytes(
            cfg, 3, 64, prec=Precision.from_key(dtype)
        )
        assert extra == 3 * 64 * cfg.n_layer * s * 2 * cfg.n_embd  # q and k, MHA


def test_the_planner_counts_what_a_block_saves_with_qk_norm_and_rope():
    """qk_bytes against saved_tensors_hooks on one block, eager, fp32 and bf16 autocast: the planner's
    per-token difference is the measured one (RoPE's (T, hd/2) tables aside)."""
    from gpt2.plan.memory import activation_bytes

    def saved(cfg, autocast):
        model = GPT(cfg)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(2, 64, cfg.n_embd, requires_grad=True)
        rope = rope_tables(torch.arange(64), cfg.head_dim, cfg.rope_base) if cfg.rope else None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model.transformer.h[0](x * 1.0, None, rope)
        if cfg.rope:
            storages.pop(rope[0].untyped_storage().data_ptr(), None)
            storages.pop(rope[1].untyped_storage().data_ptr(), None)
        return sum(storages.values())

    base = ModelConfig(n_layer=1, n_head=4, n_kv_head=2, n_embd=64, block_size=64)
    for options in (dict(rope=True), dict(qk_norm=True), dict(rope=True, qk_norm=True)):
        cfg = base.replace(**options)
        for autocast, dtype in ((False, "fp32"), (True, "bf16")):
            measured = saved(cfg, autocast) - saved(base, autocast)
            planned = activation_bytes(
                cfg, 2, 64, prec=Precision.from_key(dtype), device_type="cpu"
            ) - activation_bytes(base, 2, 64, prec=Precision.from_key(dtype), device_type="cpu")
            assert planned == measured, (options, dtype)


def test_softcap_adds_its_tanh_to_the_full_loss_only():
    from gpt2.plan.memory import SOFTCAP_FULL_LOSS_BYTES, loss_bytes

    cfg, capped = ModelConfig(), ModelConfig(logit_softcap=15.0)
    full = dict(chunked=False, device_type="cpu")
    assert loss_bytes(capped, 1024, **full) - loss_bytes(cfg, 1024, **full) == 1024 * cfg.vocab_size * 4
    assert SOFTCAP_FULL_LOSS_BYTES == 4
    assert loss_bytes(capped, 1024, device_type="cpu") == loss_bytes(cfg, 1024, device_type="cpu")


# ---- checkpoints, export, the command line ----


def test_a_checkpoint_from_before_the_options_loads_as_gpt2_and_refuses_other_options():
    from gpt2.train.state import check_compatible

    old = {k: v for k, v in tiny().to_dict().items() if k in GPT2_CONFIG_KEYS}  # what checkpoints recorded
    assert ModelConfig(**old) == tiny()

    class Log:
        def info(self, message):
            pass

    from gpt2.core.config import RunConfig, TrainConfig

    saved = {"config": {"model": old, "train": {}}, "optimizer_kind": "adamw", "tokenizer": "gpt2"}
    check_compatible(saved, RunConfig(tiny(), TrainConfig()), Log())
    for option in (dict(rope=True), dict(tie_embeddings=False), dict(logit_softcap=30.0), dict(qk_norm=True)):
        with pytest.raises(ValueError, match=f"{next(iter(option))}: checkpoint"):
            check_compatible(saved, RunConfig(tiny(**option), TrainConfig()), Log())
    check_compatible(saved, RunConfig(tiny(zero_init_proj=True), TrainConfig()), Log())  # init only


GPT2_CONFIG_KEYS = (
    "n_layer",
    "n_head",
    "n_kv_head",
    "n_embd",
    "block_size",
    "vocab_size",
    "bias",
    "dropout",
    "attn_impl",
)


def test_a_modern_checkpoint_loads_samples_and_scores_and_export_refuses_it_in_one_line(tmp_path, capsys):
    from gpt2.ckpt import checkpoint as ckpt
    from gpt2.ckpt.load import load_any
    from gpt2.export import main as export_main
    from gpt2.train.scoring import score_endings

    model = made(tiny(**MODERN))
    ckpt.save_checkpoint(
        tmp_path,
        1,
        {"model": model.state_dict(), "config": {"model": model.config.to_dict(), "train": {}}, "tokenizer": "gpt2"},
        keep=1,
    )
    loaded, _ = load_any(tmp_path)
    assert loaded.config == model.config
    idx, _ = batch(T=12)
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx)[0], model(idx)[0])
    assert loaded.generate(idx[:1, :4], 5, temperature=0.0).shape == (1, 9)
    mask = torch.ones_like(idx)
    score_endings(loaded, idx, mask)  # HellaSwag's scoring: the model's own logits
    assert export_main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "this model uses rope=True, which Hugging Face's GPT-2 layout cannot hold" in err[0]
    assert "tie_embeddings=False" in err[0] and "logit_softcap=15.0" in err[0] and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("option", sorted(set(MODERN) - {"zero_init_proj", "bias"}))
def test_export_refuses_each_option_by_name(option):
    from gpt2.model.hf import to_hf_state_dict

    with pytest.raises(ValueError, match=f"this model uses {option}="):
        to_hf_state_dict(GPT(tiny(**{option: MODERN[option]})))


def test_export_keeps_a_zero_initialised_gpt2():
    from gpt2.model.hf import to_hf_state_dict

    assert "lm_head.weight" in to_hf_state_dict(GPT(tiny(zero_init_proj=True)))


def test_an_untied_head_survives_a_sharded_checkpoint(tmp_path):
    from gpt2.ckpt import dcp as dcp_io

    model = made(tiny(tie_embeddings=False))
    opt = torch.optim.AdamW(model.parameters())
    dcp_io.save_dcp(model, opt, tmp_path / "step")
    fresh = GPT(tiny(tie_embeddings=False))
    dcp_io.load_weights(fresh, tmp_path / "step")
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    assert torch.equal(fresh.transformer.wte.weight, model.transformer.wte.weight)
    assert fresh.lm_head.weight is not fresh.transformer.wte.weight


BASE = ["--data-dir", "d", "--out-dir", "o"]


def test_arch_modern_sets_the_set_and_single_flags_override_it(tmp_path):
    from gpt2.train.cli import parse_config

    cfg = parse_config([*BASE, "--preset", "debug", "--arch", "modern"]).model
    assert {k: getattr(cfg, k) for k in MODERN} == MODERN and cfg.n_layer == 4  # the preset's shape
    cfg = parse_config([*BASE, "--arch", "modern", "--logit-softcap", "none", "--tie-embeddings", "true"]).model
    assert cfg.logit_softcap is None and cfg.tie_embeddings and cfg.rope
    assert parse_config([*BASE, "--rope", "--mlp-act", "relu2", "--logit-softcap", "30"]).model == ModelConfig(
        rope=True, mlp_act="relu2", logit_softcap=30.0
    )
    toml = tmp_path / "c.toml"
    toml.write_text('arch = "modern"\nlogit_softcap = 30\n')
    cfg = parse_config([*BASE, "--config", str(toml)]).model
    assert cfg.rope and cfg.logit_softcap == 30.0
    toml.write_text('logit_softcap = "none"\n')
    assert parse_config([*BASE, "--arch", "modern", "--config", str(toml)]).model.logit_softcap is None
    assert parse_config([*BASE, "--arch", "gpt2"]).model == ModelConfig()
