import math

import pytest
import torch
import torch.nn.functional as F

from gpt2.core.config import GPT2_VOCAB_SIZE, ModelConfig, count_params_formula, model_preset
from gpt2.model.gpt import GPT, KVCache, cut_at_stop, sample_next, unwrap


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{**dict(n_layer=2, n_head=4, n_embd=64, block_size=32), **overrides})


def make_model(cfg: ModelConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    # GPT-2 init zeroes biases and sets LayerNorms to identity; randomise them so a mix-up in
    # their handling would show in the comparisons below.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
    return model


def reference_attention(x, attn, n_head, n_kv_head, start=0):
    """softmax(QK^T/sqrt(d) + causal mask)V, head by head, from the module's own weights.

    x is the whole sequence (B, T, C); the output is for the queries at positions [start, T).
    """
    B, T, C = x.shape
    hd = C // n_head
    qkv = x @ attn.c_attn.weight.T + attn.c_attn.bias
    q, k, v = qkv.split([C, n_kv_head * hd, n_kv_head * hd], dim=-1)
    group = n_head // n_kv_head
    outs = []
    for h in range(n_head):
        kv = h // group  # query head h reads kv head h // group (repeat_interleave order)
        qh = q[:, start:, h * hd : (h + 1) * hd]
        kh, vh = k[:, :, kv * hd : (kv + 1) * hd], v[:, :, kv * hd : (kv + 1) * hd]
        scores = qh @ kh.transpose(1, 2) / math.sqrt(hd)  # (B, Tq, T)
        future = torch.arange(T)[None, :] > torch.arange(start, T)[:, None]
        scores = scores.masked_fill(future, float("-inf"))
        outs.append(torch.softmax(scores, dim=-1) @ vh)
    return torch.cat(outs, dim=-1) @ attn.c_proj.weight.T + attn.c_proj.bias


def test_gpt2_preset_has_124_439_808_params():
    cfg = model_preset("gpt2", vocab_size=GPT2_VOCAB_SIZE)
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == model.num_params() == 124_439_808
    assert count_params_formula(cfg) == 124_439_808


def test_param_formula_matches_module_for_padded_vocab():
    cfg = tiny()
    assert sum(p.numel() for p in GPT(cfg).parameters()) == count_params_formula(cfg)


HEADS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}


@pytest.mark.parametrize("impl", ["sdpa", "sdpa_mask", "explicit"])
@pytest.mark.parametrize("kind", sorted(HEADS))
def test_attention_equals_explicit_reference(kind, impl):
    n_head, n_kv_head = HEADS[kind]
    torch.manual_seed(1)
    attn = make_model(tiny(n_head=n_head, n_kv_head=n_kv_head, attn_impl=impl)).transformer.h[0].attn
    with torch.no_grad():
        attn.c_attn.bias.normal_()
        attn.c_proj.bias.normal_()
    x = torch.randn(2, 13, 64)
    with torch.no_grad():
        got = attn(x)
        want = reference_attention(x, attn, n_head, n_kv_head)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "sdpa_mask", "explicit"])
def test_attention_dropout_acts_in_training_only(impl):
    attn = make_model(tiny(dropout=0.5, attn_impl=impl)).transformer.h[0].attn
    attn.resid_dropout.p = 0.0  # isolate the dropout on the attention weights
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        want = reference_attention(x, attn, 4, 4)
        torch.testing.assert_close(attn.eval()(x), want, atol=1e-5, rtol=1e-5)
        attn.train()
        assert not torch.allclose(attn(x), want, atol=1e-3)


@pytest.mark.parametrize("impl", ["sdpa", "sdpa_mask", "explicit"])
@pytest.mark.parametrize("kind", sorted(HEADS))
def test_kv_cache_multi_token_with_offset_equals_reference(kind, impl):
    n_head, n_kv_head = HEADS[kind]
    cfg = tiny(n_head=n_head, n_kv_head=n_kv_head, attn_impl=impl)
    attn = make_model(cfg).transformer.h[0].attn
    x = torch.randn(2, 11, 64)
    cache = KVCache(cfg, 2, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        attn(x[:, :5], cache)  # positions 0..4 into the cache
        cache.pos = 5  # GPT.forward advances the cache; the bare layer does not
        got = attn(x[:, 5:], cache)  # 6 queries at positions 5..10 over 11 keys
        want = reference_attention(x, attn, n_head, n_kv_head, start=5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "sdpa_mask", "explicit"])
def test_cached_forward_in_chunks_equals_full_forward(impl):
    cfg = tiny(n_kv_head=2, attn_impl=impl)
    model = make_model(cfg)
    idx = torch.randint(0, GPT2_VOCAB_SIZE, (2, 20))
    cache = KVCache(cfg, 2, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        full, _ = model(idx)
        chunks = [model(idx[:, a:b], kv_cache=cache)[0] for a, b in [(0, 7), (7, 8), (8, 15), (15, 20)]]
    assert cache.pos == 20
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=1e-5)


def test_forward_refuses_sequences_longer_than_block_size():
    model = GPT(tiny(block_size=8))
    with pytest.raises(ValueError, match="block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_fresh_model_loss_is_near_ln_vocab():
    torch.manual_seed(0)
    model = GPT(model_preset("debug"))
    idx = torch.randint(0, GPT2_VOCAB_SIZE, (4, 64))
    # Targets independent of the inputs: with targets == inputs the tied embedding makes the
    # model "copy" its input and the loss drops below ln(V).
    targets = torch.randint(0, GPT2_VOCAB_SIZE, (4, 64))
    with torch.no_grad():
        _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(GPT2_VOCAB_SIZE)) < 0.3, loss.item()


def test_ignore_index_targets_do_not_count():
    model = make_model(tiny())
    idx = torch.randint(0, GPT2_VOCAB_SIZE, (1, 10))
    targets = torch.randint(0, GPT2_VOCAB_SIZE, (1, 10))
    masked = targets.clone()
    masked[:, 5:] = -1
    with torch.no_grad():
        _, loss_masked = model(idx, masked)
        logits, _ = model(idx[:, :5])
    torch.testing.assert_close(loss_masked, F.cross_entropy(logits[0], targets[0, :5]))


def test_padded_vocab_has_zero_probability_and_zero_gradient():
    model = make_model(tiny())
    assert model.config.vocab_size > GPT2_VOCAB_SIZE
    idx = torch.randint(0, GPT2_VOCAB_SIZE, (2, 16))
    logits, loss = model(idx, torch.randint(0, GPT2_VOCAB_SIZE, (2, 16)))
    assert torch.isneginf(logits[..., GPT2_VOCAB_SIZE:]).all()
    assert torch.isfinite(logits[..., :GPT2_VOCAB_SIZE]).all()
    probs = F.softmax(logits.float(), dim=-1)
    assert (probs[..., GPT2_VOCAB_SIZE:] == 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 16))
    loss.backward()
    # No probability, no gradient: padded rows never move (inputs never use them either).
    grad = model.transformer.wte.weight.grad
    assert (grad[GPT2_VOCAB_SIZE:] == 0).all() and (grad[:GPT2_VOCAB_SIZE] != 0).any()


@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (1.0, None), (5.0, None), (1.0, 50)])
def test_padded_logits_are_never_sampled(temperature, top_k):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 50304, generator=gen)
    logits[:, GPT2_VOCAB_SIZE:] = 100.0  # even huge padded logits (no bias applied) are ignored
    tokens = sample_next(logits, temperature=temperature, top_k=top_k, generator=gen)
    assert tokens.shape == (256, 1)
    assert (tokens < GPT2_VOCAB_SIZE).all()


def test_top_k_samples_only_the_top_k():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, GPT2_VOCAB_SIZE, generator=gen)
    top = torch.topk(logits, 3).indices
    tokens = sample_next(logits, temperature=1.0, top_k=3, generator=gen)
    assert (tokens == top).any(dim=1).all()
    greedy = sample_next(logits, temperature=0.0, top_k=None, generator=None)
    assert torch.equal(greedy[:, 0], logits.argmax(-1))


@pytest.mark.parametrize("n_kv_head", [4, 1])
@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (1.0, 20)])
def test_cached_generation_equals_uncached(temperature, top_k, n_kv_head):
    # Prompt 5 + 30 new tokens runs past block_size=16, so the cache's rebuild is exercised too.
    model = make_model(tiny(block_size=16, n_kv_head=n_kv_head))
    prompt = torch.randint(0, GPT2_VOCAB_SIZE, (2, 5))
    outs = []
    for use_cache in (True, False):
        gen = torch.Generator().manual_seed(123)
        outs.append(
            model.generate(prompt, 30, temperature=temperature, top_k=top_k, generator=gen, use_cache=use_cache)
        )
    assert outs[0].shape == (2, 35)
    assert torch.equal(outs[0][:, :5], prompt)
    assert torch.equal(outs[0], outs[1])
    assert (outs[0] < GPT2_VOCAB_SIZE).all()


def test_cached_generation_from_prompt_longer_than_block():
    model = make_model(tiny(block_size=8))
    prompt = torch.randint(0, GPT2_VOCAB_SIZE, (1, 12))
    cached = model.generate(prompt, 6, temperature=0.0, use_cache=True)
    uncached = model.generate(prompt, 6, temperature=0.0, use_cache=False)
    assert torch.equal(cached, uncached)


EOT = 50256


class EndsAt(GPT):
    """A GPT whose greedy choice is token 7 until row b's ends[b]-th new token, which is EOT (50256)."""

    def __init__(self, cfg: ModelConfig, ends: list[int]) -> None:
        super().__init__(cfg)
        self.ends, self.calls = ends, 0

    def forward(self, idx, targets=None, *, kv_cache=None, return_logits=True):
        logits, loss = super().forward(idx, targets, kv_cache=kv_cache)
        forced = torch.full_like(logits[:, -1], -1e4)
        for b, end in enumerate(self.ends):
            forced[b, EOT if self.calls >= end else 7] = 0.0
        self.calls += 1
        return torch.cat([logits[:, :-1], forced[:, None]], dim=1), loss


def test_generation_stops_each_row_at_its_own_end_of_text_and_all_early():
    model = EndsAt(tiny(), ends=[1, 3])
    out = model.generate(torch.tensor([[EOT], [EOT]]), 20, temperature=0.0, stop_token=EOT)
    # row 0 ended after one token and stays ended; generation stops once row 1 ends too (4 steps, not 20)
    assert out[:, 1:].tolist() == [[7, EOT, EOT, EOT], [7, 7, 7, EOT]]
    assert [cut_at_stop(row, EOT) for row in out[:, 1:].tolist()] == [[7], [7, 7, 7]]
    assert cut_at_stop([1, 2], EOT) == [1, 2]
    # without stop_token the tokens run on to max_new_tokens, as before
    assert EndsAt(tiny(), ends=[1]).generate(torch.tensor([[EOT]]), 5, temperature=0.0).size(1) == 6


def test_generate_needs_a_prompt():
    with pytest.raises(ValueError, match="at least one prompt token"):
        GPT(tiny()).generate(torch.zeros(1, 0, dtype=torch.long), 3)


def test_init_follows_gpt2():
    torch.manual_seed(0)
    model = GPT(model_preset("debug"))
    n_layer = model.config.n_layer
    assert model.lm_head.weight is model.transformer.wte.weight
    assert abs(model.transformer.wte.weight.std().item() - 0.02) < 1e-3
    block = model.transformer.h[0]
    assert abs(block.mlp.c_fc.weight.std().item() - 0.02) < 1e-3
    scaled = 0.02 / math.sqrt(2 * n_layer)
    assert abs(block.attn.c_proj.weight.std().item() - scaled) < 0.05 * scaled
    assert abs(block.mlp.c_proj.weight.std().item() - scaled) < 0.05 * scaled
    assert (block.attn.c_attn.bias == 0).all() and (block.ln_1.weight == 1).all()


def _train_step(model, idx, targets):
    _, loss = model(idx, targets)
    loss.backward()
    return loss


def test_forward_backward_under_torch_compile():
    torch.manual_seed(0)
    cfg = tiny(n_layer=1, block_size=16)
    model = GPT(cfg)
    compiled = torch.compile(model)
    idx = torch.randint(0, GPT2_VOCAB_SIZE, (2, 16))
    targets = torch.randint(0, GPT2_VOCAB_SIZE, (2, 16))
    loss = _train_step(compiled, idx, targets)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    eager_loss = _train_step(model, idx, targets)
    torch.testing.assert_close(loss, eager_loss, atol=1e-4, rtol=1e-4)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-4, rtol=1e-3, msg=name)
    # Saved through unwrap(), the compiled model's state dict has plain keys.
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    assert list(unwrap(compiled).state_dict()) == list(model.state_dict())


def test_forward_backward_under_bf16_autocast():
    torch.manual_seed(0)
    model = GPT(tiny())
    idx = torch.randint(0, GPT2_VOCAB_SIZE, (2, 16))
    targets = torch.randint(0, GPT2_VOCAB_SIZE, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(idx, targets)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert abs(loss.item() - math.log(GPT2_VOCAB_SIZE)) < 0.3
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    assert torch.isneginf(logits[..., GPT2_VOCAB_SIZE:]).all()


def test_unwrap_removes_ddp_and_compile_prefixes(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = GPT(tiny(n_layer=1))
    plain_keys = list(model.state_dict())
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ddp = DDP(model)
        assert all(k.startswith("module.") for k in ddp.state_dict())
        wrapped = {"ddp": ddp, "ddp(compile)": DDP(torch.compile(model)), "compile(ddp)": torch.compile(DDP(model))}
        for name, w in wrapped.items():
            assert unwrap(w) is model, name
            keys = list(unwrap(w).state_dict())
            assert keys == plain_keys, name
            assert not any(k.startswith(("module.", "_orig_mod.")) for k in keys), name
    finally:
        dist.destroy_process_group()
    assert unwrap(model) is model


def test_the_kv_cache_is_kept_in_the_autocast_dtype_and_generates_the_same_tokens(monkeypatch):
    """Under autocast c_attn's keys and values are already bf16: a bf16 cache holds the same values in
    half the memory (an fp32 one doubled the cache's traffic per generated token). Same tokens as an
    fp32 cache; fp32 without autocast."""
    from gpt2.model.gpt import KVCache

    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)).eval()
    made = []
    plain_init = KVCache.__init__

    def recording(self, *args, **kwargs):
        made.append(kwargs["dtype"])
        plain_init(self, *args, **kwargs)

    monkeypatch.setattr(KVCache, "__init__", recording)
    idx = torch.tensor([[50256, 11, 12]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = model.generate(idx, 20, temperature=0.0)  # past block_size: the cache is rebuilt too
        n_half = len(made)
        monkeypatch.setattr(GPT, "_cache_dtype", lambda self: torch.float32)
        full = model.generate(idx, 20, temperature=0.0)
    monkeypatch.undo()
    assert n_half > 1 and set(made[:n_half]) == {torch.bfloat16} and set(made[n_half:]) == {torch.float32}
    assert torch.equal(half, full)
    made.clear()
    monkeypatch.setattr(KVCache, "__init__", recording)
    model.generate(idx, 2, temperature=0.0)
    assert made == [torch.float32]
