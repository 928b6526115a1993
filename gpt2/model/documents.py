"""Attention within documents: a token attends to the earlier tokens of its own document only.

The shards mark documents by a leading `<|endoftext|>` (data_prep/encode.py writes each document as
[EOT] + its tokens), so a training sequence, a window cut anywhere in the stream, holds the end of one
document, whole documents, and the start of another. Plain causal attention lets each token see the
documents before its own in the window: text it has nothing to do with, and a context that depends on
where the window was cut. With `ModelConfig.doc_attention` a token's keys are those at or before it with
the same document number, the count of EOTs up to and including its position (an EOT starts the
document it opens). The loader is unchanged: the mask comes from the tokens themselves.

Two exact ways to apply it, chosen per call (`doc_mask`):
- FlexAttention's block mask (torch.nn.attention.flex_attention, torch >= 2.5) on CUDA wherever attention
  runs compiled: the whole model compiled (the mask is then built inside the compiled forward), or each
  block compiled alone (--compile-scope blocks, and --parallel fsdp with --compile: GPT.forward is eager
  there, builds the BlockMask with create_block_mask and hands it to the compiled blocks, whose
  flex_attention is generated). Blocks wholly outside every document are skipped; attention saves what
  the fused SDPA kernels save (q, k, v, the output and a log-sum-exp), no (T, T) mask. Built eagerly,
  create_block_mask first evaluates the mask densely: ~10 bytes per (b, q, k) (measured on a CPU), 0.7 GB
  at 64 x 1,024 tokens, freed before the first block runs, so below the step's peak (not planned).
- Everywhere else (a CPU, eager CUDA, dropout while training, attn_impl=explicit, the KV cache's decoding):
  a dense boolean (B, 1, Tq, Tk) mask handed to scaled_dot_product_attention (or the explicit reference),
  which eager FlexAttention would only emulate, materialising the same scores. SDPA turns it into an
  additive mask of q's dtype in every layer and saves it: the planner counts that where it runs
  (gpt2/plan/memory.py activation_bytes, flex_applies).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

from gpt2.core.config import EOT_TOKEN


def document_ids(idx: Tensor, first: Tensor | None = None) -> Tensor:
    """(B, T) token ids -> (B, T) document numbers: EOTs up to and including each position, plus `first`
    ((B,) the number of the document the tokens continue, from a KV cache; 0 when none)."""
    docs = (idx == EOT_TOKEN).cumsum(dim=1)
    return docs if first is None else docs + first[:, None]


def dense_mask(doc_q: Tensor, doc_k: Tensor) -> Tensor:
    """Boolean (B, 1, Tq, Tk) mask, True where query i may attend to key j: j is not after i (the queries are
    the last Tq of the Tk positions) and both are in the same document."""
    t_q, t_k = doc_q.size(1), doc_k.size(1)
    rows = torch.arange(t_q, device=doc_q.device)[:, None] + (t_k - t_q)
    causal = torch.arange(t_k, device=doc_q.device)[None, :] <= rows
    return (causal & (doc_q[:, :, None] == doc_k[:, None, :]))[:, None]


FLEX_DEVICE_TYPES = ("cuda",)
"""Where FlexAttention's generated kernel is taken (a CPU's is not: the dense mask there is as exact, and the
CPU plans and exactness tests are measured with it). Tests add "cpu" to run the CUDA path's code here."""


def flex_applies(device_type: str, *, compiled: bool, dropout: bool = False, explicit: bool = False) -> bool:
    """Whether a full sequence's attention within documents takes FlexAttention's block mask: on a device of
    FLEX_DEVICE_TYPES, where attention runs compiled (compiled: the whole model, or each block alone), with no
    dropout on the attention weights (FlexAttention has none) and not the explicit reference attention. The
    one rule for the model (doc_mask) and the planner (gpt2/plan/memory.py), which counts the dense mask
    wherever this is False."""
    return device_type in FLEX_DEVICE_TYPES and compiled and not dropout and not explicit and _flex_importable()


def _flex_importable() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def flex_available(device: torch.device, *, blocks_compiled: bool = False) -> bool:
    """FlexAttention's generated kernel applies to this call: CUDA, torch has it, and attention runs compiled:
    the model is being compiled (this call is traced), or blocks_compiled (each block compiled alone: this
    call is eager, the attention it feeds is not). Eager FlexAttention materialises the scores: the dense
    mask is as exact and no slower."""
    return flex_applies(device.type, compiled=blocks_compiled or torch.compiler.is_compiling())


def block_mask(docs: Tensor):
    """FlexAttention's BlockMask for causal attention within documents of a full (B, T) sequence."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = docs.shape

    def within(b, h, q, k):
        return (k <= q) & (docs[b, q] == docs[b, k])

    return create_block_mask(within, B, None, T, T, device=docs.device)


def doc_mask(docs_q: Tensor, docs_k: Tensor, *, blocks_compiled: bool = False):
    """The mask attention takes for these document numbers: a BlockMask where FlexAttention runs (a full
    sequence whose attention runs compiled on CUDA: flex_available), else the dense boolean mask."""
    if docs_q.size(1) == docs_k.size(1) and flex_available(docs_q.device, blocks_compiled=blocks_compiled):
        return block_mask(docs_q)
    return dense_mask(docs_q, docs_k)


def flex_attention(q: Tensor, k: Tensor, v: Tensor, mask) -> Tensor:
    """q (B, nh, T, hd), k and v (B, nkv, T, hd) under a BlockMask (grouped-query heads enabled)."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    return flex(q, k, v, block_mask=mask, enable_gqa=q.size(1) != k.size(1))
