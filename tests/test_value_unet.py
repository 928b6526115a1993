"""Issue 76's architecture options: value embeddings (--value-embeds K) and U-net skip connections (--unet-skips),
against a forward written out plainly from modded-nanogpt's records (2024-11-10, 2024-12-04 to 2024-12-17), with
what they add to the optimizer's groups and the planner's memory."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gpt2.core.config import ModelConfig, OptimConfig, param_count
from gpt2.core.precision import FLOAT32, Precision
from gpt2.model.gpt import GPT
from gpt2.plan.memory import activation_bytes
from gpt2.train.optim import make_optimizer

CPU = torch.device("cpu")
V = 50257


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(n_layer=3, n_head=4, n_kv_head=2, n_embd=32, block_size=16), **kw})


def reference_logits(m: GPT, idx: torch.Tensor) -> torch.Tensor:
    """GPT-2 (learned positions, LayerNorm, tanh GELU, tied head) with both options, one line per rule: layer i
    mixes table i (i < k) or table i-(n-k) (i >= n-k) into its values as a*v + b*table; block n-1-i (for the last
    n//2 blocks) adds w * block i's output to its input."""
    cfg, t = m.config, m.transformer
    n, k, half, C, T = cfg.n_layer, cfg.value_embeds, cfg.n_layer // 2, cfg.n_embd, idx.size(1)
    kv, hd = cfg.n_kv_head * cfg.head_dim, cfg.head_dim
    x = t.wte(idx) + t.wpe(torch.arange(T))
    tables = [table(idx) for table in t.ve] if k else []
    outputs = []
    for i, block in enumerate(t.h):
        if cfg.unet_skips and i >= n - half:
            x = x + t.skip.weight[i - (n - half)] * outputs[n - 1 - i]
        q, key, v = block.attn.c_attn(block.ln_1(x)).split([C, kv, kv], dim=-1)
        table = i if i < k else i - (n - k) if i >= n - k else None
        if table is not None:
            v = block.attn.v_lambdas[0] * v + block.attn.v_lambdas[1] * tables[table]
        q = q.view(1, T, cfg.n_head, hd).transpose(1, 2)
        key, v = (z.view(1, T, cfg.n_kv_head, hd).transpose(1, 2).repeat_interleave(2, dim=1) for z in (key, v))
        scores = (q @ key.transpose(-2, -1)) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, T, C)
        x = x + block.attn.c_proj(y)
        x = x + block.mlp.c_proj(F.gelu(block.mlp.c_fc(block.ln_2(x)), approximate="tanh"))
        if i < half:
            outputs.append(x)
    return t.ln_f(x) @ t.wte.weight[:V].T


OPTIONS = [dict(value_embeds=1), dict(unet_skips=True), dict(value_embeds=1, unet_skips=True)]


@pytest.mark.parametrize("options", OPTIONS)
def test_the_forward_is_the_rule_written_out(options):
    torch.manual_seed(0)
    m = GPT(tiny(n_layer=5, **options)).eval()
    with torch.no_grad():  # mixing weights away from their initial values, so each one shows
        for name, p in m.named_parameters():
            if "v_lambdas" in name or "skip" in name:
                p.uniform_(-1.0, 2.0)
    idx = torch.randint(0, V, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(m(idx)[0][..., :V], reference_logits(m, idx), rtol=1e-4, atol=1e-4)


def test_off_by_their_weights_the_options_are_gpt2_and_leave_its_draws_alone():
    """Built from one seed, GPT-2's weights are the same draws with or without the options (their modules come
    last); with a = 1, b = 0 and the skip weights 0 the model computes GPT-2's logits."""
    torch.manual_seed(0)
    plain = GPT(tiny())
    torch.manual_seed(0)
    m = GPT(tiny(value_embeds=1, unet_skips=True))
    extra = set(m.state_dict()) - set(plain.state_dict())
    lambdas = {f"transformer.h.{i}.attn.v_lambdas" for i in (0, 2)}  # 3 layers, 1 table: the first and the last
    assert extra == {"transformer.ve.0.weight", "transformer.skip.weight", *lambdas}
    for name, w in plain.state_dict().items():
        assert torch.equal(m.state_dict()[name], w), name
    assert param_count(m.config) == sum(p.numel() for p in m.parameters())
    idx = torch.randint(0, V, (2, 16))
    with torch.no_grad():
        assert not torch.allclose(m(idx)[0], plain(idx)[0])  # at their initial values they change the output
        for i in (0, 2):
            m.transformer.h[i].attn.v_lambdas.copy_(torch.tensor([1.0, 0.0]))
        m.transformer.skip.weight.zero_()
        torch.testing.assert_close(m(idx)[0][..., :V], plain(idx)[0][..., :V], rtol=0, atol=1e-6)


def test_gradients_reach_every_new_weight_and_checkpointing_keeps_them():
    cfg = tiny(value_embeds=1, unet_skips=True)
    idx = torch.randint(0, V, (2, 16))
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        m = GPT(cfg, activation_checkpointing=checkpointed)
        m(idx, idx, return_logits=False)[1].backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert all(g is not None and g.abs().sum() > 0 for g in grads[0].values())
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7)


def test_the_tables_train_as_embeddings_and_the_mixing_weights_as_vectors_never_under_muon():
    torch.manual_seed(0)
    m = GPT(tiny(value_embeds=1, unet_skips=True))
    optim = OptimConfig(optimizer="muon", embed_lr=0.3, weight_decay=0.1)
    opt = make_optimizer(m, optim, CPU, peak_lr=0.01, prec=FLOAT32)
    name = {id(p): n for n, p in m.named_parameters()}
    muon = {name[id(p)] for g in opt.optimizers["muon"].param_groups for p in g["params"]}
    assert muon and all(".h." in n and n.endswith(".weight") and "lambdas" not in n for n in muon)
    adamw = opt.optimizers["adamw"].param_groups
    embed = next(g for g in adamw if g["lr_scale"] == pytest.approx(30.0))
    tables = {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ve.0.weight"}
    assert {name[id(p)] for p in embed["params"]} == tables
    vectors = {name[id(p)] for g in adamw if g["weight_decay"] == 0.0 for p in g["params"]}
    assert {"transformer.skip.weight", "transformer.h.0.attn.v_lambdas", "transformer.h.2.attn.v_lambdas"} <= vectors


def saved_bytes(cfg: ModelConfig, dtype: str, B: int = 2) -> int:
    torch.manual_seed(0)
    m = GPT(cfg, loss_impl="full")
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    idx = torch.randint(0, V, (B, cfg.block_size))
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        m(idx, idx)
    return sum(storages.values())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_planner_counts_what_the_value_embeddings_save(dtype):
    """What autograd saves with value_embeds beyond the plain model (saved_tensors_hooks, parameters and their
    autocast copies aside), against activation_bytes' difference: within 25% and never below. The U-net skips
    save one residual more with an even n_layer (the first decoder block's input is its own skip) and none with an
    odd one."""
    cfg = tiny(n_layer=4)
    prec = Precision.from_key(dtype)
    planned = {c: activation_bytes(c, 2, 16, prec=prec, device_type="cpu") for c in (cfg, cfg.replace(value_embeds=2))}
    measured_ve = saved_bytes(cfg.replace(value_embeds=2), dtype) - saved_bytes(cfg, dtype)
    extra_ve = planned[cfg.replace(value_embeds=2)] - planned[cfg]
    assert measured_ve <= extra_ve <= 1.25 * measured_ve
    for n_layer in (4, 5):
        plain = cfg.replace(n_layer=n_layer)
        on = plain.replace(unet_skips=True)
        extra = activation_bytes(on, 2, 16, prec=prec, device_type="cpu") - activation_bytes(
            plain, 2, 16, prec=prec, device_type="cpu"
        )
        assert saved_bytes(on, dtype) - saved_bytes(plain, dtype) == extra == (n_layer % 2 == 0) * 2 * 16 * 32 * 4


def test_impossible_values_are_one_line_each():
    with pytest.raises(ValueError, match=r"value_embeds=3 must be an integer from 0 to n_layer // 2 = 2"):
        tiny(n_layer=4, value_embeds=3)
    with pytest.raises(ValueError, match=r"value_embeds=-1 must be"):
        tiny(value_embeds=-1)
    from gpt2.model.hf import hf_config_dict

    with pytest.raises(ValueError, match=r"value_embeds=1.*no value embeddings.*--value-embeds 0"):
        hf_config_dict(tiny(n_head=4, n_kv_head=4, value_embeds=1))
