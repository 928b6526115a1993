"""Attention within documents (gpt2/model/documents.py): the document numbers and masks against plain loops."""

import pytest
import torch
import torch.nn.functional as F

from gpt2.core.config import EOT_TOKEN
from gpt2.core.precision import Precision
from gpt2.model.documents import dense_mask, document_ids

E = EOT_TOKEN


def test_an_eot_starts_the_document_it_opens():
    idx = torch.tensor([[5, 6, E, 7, 8, E, E, 9], [E, 1, 2, 3, 4, 5, 6, 7]])
    assert document_ids(idx).tolist() == [[0, 0, 1, 1, 1, 2, 3, 3], [1, 1, 1, 1, 1, 1, 1, 1]]
    # continuing a cache whose last token was in document 4 (row 0) and 1 (row 1)
    assert document_ids(torch.tensor([[7, E], [E, 3]]), torch.tensor([4, 1])).tolist() == [[4, 5], [2, 2]]


def test_the_dense_mask_is_causal_within_documents():
    g = torch.Generator().manual_seed(0)
    docs_k = torch.randint(0, 2, (3, 12), generator=g).cumsum(1)
    for t_q in (12, 5, 1):  # a full sequence, a chunk after a cache, one new token
        docs_q = docs_k[:, -t_q:]
        got = dense_mask(docs_q, docs_k)
        assert got.shape == (3, 1, t_q, 12)
        for b in range(3):
            for i in range(t_q):
                for j in range(12):
                    allowed = j <= i + 12 - t_q and docs_k[b, j] == docs_q[b, i]
                    assert bool(got[b, 0, i, j]) == bool(allowed), (b, i, j)


def test_flex_attentions_block_mask_equals_the_dense_mask():
    """The CUDA path's BlockMask against the dense mask, both exact: eager FlexAttention on this CPU."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    from gpt2.model.documents import block_mask, flex_attention

    g = torch.Generator().manual_seed(1)
    B, H, KV, T, D = 2, 4, 2, 32, 8
    q = torch.randn(B, H, T, D, generator=g)
    k, v = (torch.randn(B, KV, T, D, generator=g) for _ in range(2))
    docs = (torch.rand(B, T, generator=g) < 0.15).cumsum(1)
    assert hasattr(flex, "create_block_mask")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention says it is a reference implementation
        got = flex_attention(q, k, v, block_mask(docs))
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=dense_mask(docs, docs)
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def tiny(**options):
    from gpt2.core.config import ModelConfig

    return ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=32, vocab_size=50304, **options)


def model(cfg, seed=0):
    from gpt2.model.gpt import GPT

    torch.manual_seed(seed)
    return GPT(cfg, loss_impl="full").eval()


def test_one_document_attends_as_plain_causal_attention():
    """No EOT after the first position: every token is in one document, the mask is the causal one."""
    idx = torch.randint(0, 50000, (2, 32), generator=torch.Generator().manual_seed(0))
    idx[:, 0] = E
    plain, masked = model(tiny()), model(tiny(doc_attention=True))
    masked.load_state_dict(plain.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(masked(idx)[0], plain(idx)[0])


@pytest.mark.parametrize("attn_impl", ["sdpa", "explicit"])
def test_a_later_document_sees_nothing_of_the_one_before(attn_impl):
    """With rotary positions (relative) a document packed after another gives the logits it gives alone: no
    attention crosses the boundary. Without the mask it does not (the test can fail)."""
    g = torch.Generator().manual_seed(1)
    first, second = torch.randint(0, 50000, (1, 13), generator=g), torch.randint(0, 50000, (1, 19), generator=g)
    first[0, 0] = second[0, 0] = E
    packed = torch.cat([first, second], dim=1)
    m = model(tiny(rope=True, doc_attention=True, attn_impl=attn_impl))
    with torch.no_grad():
        alone, together = m(second)[0][..., :50257], m(packed)[0][:, 13:, :50257]  # the padding: -inf
        torch.testing.assert_close(together, alone, atol=2e-5, rtol=1e-4)
        m.config = m.config.replace(doc_attention=False)  # the same weights, attention across documents
        assert (m(packed)[0][:, 13:, :50257] - alone).abs().max() > 1e-3


def test_the_kv_cache_decodes_as_the_full_forward_across_documents():
    from gpt2.model.gpt import KVCache

    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 50000, (2, 24), generator=g)
    idx[0, [0, 5, 17]] = E
    idx[1, [0, 11]] = E
    m = model(tiny(rope=True, doc_attention=True))
    with torch.no_grad():
        full = m(idx)[0]
        cache = KVCache(m.config, 2, device="cpu", dtype=torch.float32)
        steps = [m(idx[:, :7], kv_cache=cache)[0]]  # a prompt, then one token at a time
        steps += [m(idx[:, t : t + 1], kv_cache=cache)[0] for t in range(7, 24)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-4)


def test_doc_attention_trains_resumes_either_way_and_exports_as_gpt2():
    """Not a shape field: a checkpoint resumes with or without it, and the GPT-2 layout holds the weights."""
    from gpt2.core.config import ModelConfig
    from gpt2.model.hf import hf_config_dict

    assert "doc_attention" not in ModelConfig.shape_fields()
    hf_config_dict(tiny(doc_attention=True).replace(n_kv_head=4))  # no refusal (GQA aside)
    m = model(tiny(doc_attention=True))
    m.train()
    idx = torch.randint(0, 50000, (2, 32), generator=torch.Generator().manual_seed(3))
    idx[:, [0, 9, 20]] = E
    _, loss = m(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters() if p.requires_grad)


def test_the_planner_counts_the_dense_document_mask_as_measured():
    """What autograd saves with doc_attention on a CPU beyond plain causal attention: the additive mask SDPA
    makes of the boolean one, per layer (saved_tensors_hooks), against activation_bytes' difference."""
    from gpt2.model.gpt import GPT
    from gpt2.plan.memory import activation_bytes

    def saved(cfg, B=4):
        torch.manual_seed(0)
        m = GPT(cfg, loss_impl="full")
        idx = torch.randint(0, 50000, (B, cfg.block_size))
        idx[:, ::7] = E
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(idx, idx)
        return sum(storages.values())

    cfg = tiny().replace(n_kv_head=4, block_size=64)
    on = cfg.replace(doc_attention=True)
    measured = saved(on) - saved(cfg)
    planned = activation_bytes(on, 4, 64, prec=Precision.from_key("fp32"), device_type="cpu") - activation_bytes(
        cfg, 4, 64, prec=Precision.from_key("fp32"), device_type="cpu"
    )
    assert measured == planned == 2 * 4 * 4 * 64 * 64  # 2 layers x fp32 x B x T x T


def test_every_compile_scope_takes_the_block_mask_on_cuda_and_eager_the_dense_one(monkeypatch):
    """Issue 75: FlexAttention was taken only while the whole model was being compiled, so --compile-scope blocks
    and --parallel fsdp (each block compiled, GPT.forward eager) got the dense (B, 1, T, T) mask on a GPU. Now
    wherever attention runs compiled on CUDA. This CPU stands for CUDA (FLEX_DEVICE_TYPES); nothing compiles."""
    from torch.nn.attention.flex_attention import BlockMask

    from gpt2.model import documents
    from gpt2.train.build import compile_sharded

    assert documents.flex_applies("cuda", compiled=True) and not documents.flex_applies("cuda", compiled=False)
    assert not documents.flex_applies("cpu", compiled=True)  # a CPU keeps the dense mask, compiled or not
    assert not documents.flex_applies("cuda", compiled=True, dropout=True)  # FlexAttention has no dropout
    assert not documents.flex_applies("cuda", compiled=True, explicit=True)
    monkeypatch.setattr(documents, "FLEX_DEVICE_TYPES", ("cuda", "cpu"))
    idx = torch.randint(0, 50000, (2, 32), generator=torch.Generator().manual_seed(4))
    idx[:, [0, 9]] = E
    m = model(tiny(doc_attention=True)).train()
    assert isinstance(m.document_mask(idx, None), torch.Tensor)  # eager: the dense mask
    compile_sharded(m)  # what --compile-scope blocks and --parallel fsdp do (lazy: nothing is compiled here)
    assert isinstance(m.document_mask(idx, None), BlockMask)
    explicit = model(tiny(doc_attention=True, attn_impl="explicit"))
    explicit.compiled_blocks = True
    assert isinstance(explicit.document_mask(idx, None), torch.Tensor)  # the reference stays the reference


@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager-flex", "compiled-blocks"]
)
def test_the_block_mask_path_gives_the_dense_references_loss(monkeypatch, compiled):
    """The path the blocks scope and fsdp now take on a GPU, run on this CPU: the BlockMask built eagerly in
    GPT.forward, handed to FlexAttention (eager: its reference implementation; compiled: each block compiled
    alone, as compile_sharded does, inductor generating FlexAttention's CPU kernel). The loss is the dense
    mask's to float rounding. Forward only: torch has no FlexAttention backward on a CPU (the GPU test below
    trains it). Compiled without rope: torch 2.13's CPU FlexAttention template gives wrong outputs (off by ~1)
    when q and k are new buffers (rope's) and v a view of c_attn's output, which a CPU never runs (the dense
    mask there); the GPU test below runs rope compiled on CUDA."""
    import warnings

    from gpt2.model import documents
    from gpt2.train.build import compile_sharded

    cfg = tiny(doc_attention=True, rope=not compiled)
    idx = torch.randint(0, 50000, (2, 33), generator=torch.Generator().manual_seed(5))
    idx[:, [0, 7, 20]] = E
    idx[1, 11] = E
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    with torch.no_grad():
        want = model(cfg)(x, y, return_logits=False)[1]
    monkeypatch.setattr(documents, "FLEX_DEVICE_TYPES", ("cuda", "cpu"))
    flex = model(cfg)
    if compiled:
        torch._dynamo.reset()
        compile_sharded(flex)
    else:
        flex.compiled_blocks = True
    seen = []
    real = documents.flex_attention
    monkeypatch.setattr(documents, "flex_attention", lambda *a: seen.append(1) or real(*a))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # eager FlexAttention says it is a reference implementation
        got = flex(x, y, return_logits=False)[1]
    assert seen  # FlexAttention ran (or was traced) in both blocks
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("scope", ["model", "blocks"])
def test_on_cuda_every_compile_scope_trains_doc_attention_as_the_dense_mask(scope):
    """The GPU check's (gpu-tests): FlexAttention's generated kernel, the whole model compiled or each block
    alone (--compile-scope blocks, fsdp's), with rope, against the dense mask eager: the same loss and
    gradients to fp32 rounding (TF32 off)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32  # a torch setting, not an attribute monkeypatch can restore
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        compare_on_cuda(scope)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def compare_on_cuda(scope: str) -> None:
    from gpt2.train.build import compile_sharded

    cfg = tiny(doc_attention=True, rope=True).replace(n_embd=64, block_size=256)
    idx = torch.randint(0, 50000, (4, 257), generator=torch.Generator().manual_seed(6))
    idx[:, ::37] = E
    idx = idx.cuda()
    dense = model(cfg).train().cuda()
    want_loss, want = loss_and_grads(dense, idx)
    flex = model(cfg).train().cuda()
    torch._dynamo.reset()
    if scope == "blocks":
        from torch.nn.attention.flex_attention import BlockMask

        compile_sharded(flex)
        assert isinstance(flex.document_mask(idx[:, :-1], None), BlockMask)  # the path under test, not the dense one
        call = flex
    else:
        call = torch.compile(flex)
    got_loss, got = loss_and_grads(call, idx, named=flex)
    torch.testing.assert_close(got_loss, want_loss, atol=1e-4, rtol=1e-4)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=1e-4, rtol=1e-3, msg=name)


def loss_and_grads(m, idx, named=None):
    named = m if named is None else named
    named.zero_grad(set_to_none=True)
    _, loss = m(idx[:, :-1].contiguous(), idx[:, 1:].contiguous(), return_logits=False)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in named.named_parameters()}


def test_the_planner_counts_the_dense_mask_wherever_it_runs_and_none_where_flexattention_does():
    """Issue 75: the plan counted the dense mask only off CUDA, so an eager GPU run (and before the fix, the blocks
    scope and fsdp, which took the dense mask there) was under-planned by L x B x T x T x 2 bytes (bf16): 2.4 GiB
    at gpt2 with 16 x 1,024 tokens. Now: the dense mask wherever it runs (a CPU, eager CUDA, dropout), nothing
    where FlexAttention does (CUDA, compiled under any scope, fsdp's included)."""
    from gpt2.core.config import MODEL_PRESETS, ModelConfig
    from gpt2.core.precision import BFLOAT16
    from gpt2.plan.hardware import gpu_hardware
    from gpt2.plan.memory import memory, run_config

    hw = gpu_hardware("H100-80GB", BFLOAT16)
    base = ModelConfig(**MODEL_PRESETS["gpt2"])
    B, T, L = 16, 1024, base.n_layer

    def extra(world: int = 1, parallel: str = "ddp", **train) -> int:
        def act(cfg):
            run = run_config(cfg, B, prec=BFLOAT16, world_size=world, parallel=parallel, **train)
            return memory(run, hw, world_size=world).activations

        return act(base.replace(doc_attention=True)) - act(base)

    mask = L * B * T * T * 2
    assert extra(compile=False) == mask  # eager CUDA: SDPA's additive bf16 mask, per layer
    assert extra(compile=True) == 0  # the whole model compiled
    assert extra(compile=True, compile_scope="blocks") == 0
    assert extra(world=2, parallel="fsdp", compile=True) == 0  # fsdp compiles each block
    assert extra(world=2, parallel="fsdp", compile=False) == mask
    dropout = base.replace(dropout=0.1)
    with_dropout = memory(run_config(dropout.replace(doc_attention=True), B, compile=True), hw).activations
    assert with_dropout - memory(run_config(dropout, B, compile=True), hw).activations == mask


@pytest.mark.slow
def test_the_start_up_says_how_much_of_the_attention_mfu_counts_the_mask_skips(tmp_path, shakespeare_shards):
    """Issue 75: MFU counts attention as the full T x T; with --doc-attention the start-up's `documents` line
    (train.log, --verbose) gives the share the mask keeps on this data and the share of the counted FLOPs it skips."""
    import re
    import subprocess
    import sys

    from conftest import REPO

    flags = ["--preset", "speedrun", "--data-dir", str(shakespeare_shards), "--out-dir", str(tmp_path / "run")]
    done = subprocess.run(
        [sys.executable, "train_ddp.py", *flags, "--dry-run", "--verbose"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = re.search(
        r"^documents  --doc-attention keeps ([\d.]+)% of causal attention's .* windows of 64\); MFU counts "
        r"attention as the full T x T: of the FLOPs it counts the mask skips ([\d.]+)%, beside",
        done.stdout,
        re.M,
    )
    assert line and 0 < float(line[1]) < 100 and 0 < float(line[2]) < 1, done.stdout[-3000:]
    plain = subprocess.run(
        [sys.executable, "train_ddp.py", *flags, "--dry-run", "--verbose", "--doc-attention", "false"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert plain.returncode == 0 and "--doc-attention keeps" not in plain.stdout, plain.stderr[-2000:]
