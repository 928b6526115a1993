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
