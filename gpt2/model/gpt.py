"""GPT-2 as OpenAI shipped it: pre-LayerNorm blocks, tanh-GELU MLP, learned positions, tied
token embedding / LM head. Attention goes through `F.scaled_dot_product_attention`, with
optional grouped-query heads and a KV cache for generation.

ModelConfig's architecture options (each off by default, docs/modern.md) change parts of it: rotary
positions instead of the learned table (rope), RMS-normalised queries and keys (qk_norm), a ReLU^2 MLP
(mlp_act), parameter-free RMSNorm (norm), an untied LM head (tie_embeddings), soft-capped logits
(logit_softcap), zero-initialised output projections (zero_init_proj), value embeddings (value_embeds) and U-net
skip connections (unet_skips). Off, the model is the GPT-2 above: the same parameters, initialised by the same
random draws in the same order.

This module does no printing and knows nothing of torch.distributed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from gpt2.core.config import GPT2_VOCAB_SIZE, ModelConfig, param_count, unet_halves, value_embed_table
from gpt2.model import documents
from gpt2.model.fp8 import fp8_linear, logits_dtype
from gpt2.model.loss import linear_cross_entropy


class KVCache:
    """Keys and values of every layer for positions [0, pos), preallocated to block_size."""

    def __init__(self, cfg: ModelConfig, batch_size: int, *, device, dtype) -> None:
        shape = (cfg.n_layer, batch_size, cfg.n_kv_head, cfg.block_size, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0
        # doc_attention: each cached position's document number (gpt2/model/documents.py), so that new
        # queries see only their own document's keys.
        self.docs = torch.zeros(batch_size, cfg.block_size, dtype=torch.long, device=device)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, n_kv, T, hd) at [pos, pos+T); return all keys and values so far."""
        end = self.pos + k.size(2)
        self.k[layer, :, :, self.pos : end] = k
        self.v[layer, :, :, self.pos : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float = 0.0) -> Tensor:
    """softmax(QK^T / sqrt(d) + mask) V with a materialised (T_q, T_k) score matrix.

    q is (B, nh, Tq, hd); k, v are (B, nkv, Tk, hd) with nh a multiple of nkv. `mask` is boolean,
    True where attention is allowed. The reference the fused kernels are checked against.
    """
    groups = q.size(1) // k.size(1)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, nh, Tq, Tk)
    if mask is not None:
        att = att.masked_fill(~mask, float("-inf"))
    att = F.softmax(att, dim=-1)
    if dropout_p > 0:  # on the attention weights, as SDPA's dropout_p
        att = F.dropout(att, p=dropout_p)
    return att @ v  # (B, nh, Tq, hd)


RMS_EPS = 1e-6
"""rms_norm's epsilon (qk_norm, norm=rmsnorm): fixed rather than F.rms_norm's default, the input dtype's
machine epsilon, which under bf16 autocast would be 0.0078 on q and k."""


def rms_norm(x: Tensor) -> Tensor:
    """x / sqrt(mean(x^2) + RMS_EPS) over the last dimension, no learned gain (F.rms_norm: torch 2.4+)."""
    return F.rms_norm(x, (x.size(-1),), eps=RMS_EPS)


class RMSNorm(nn.Module):
    """norm=rmsnorm's ln_1, ln_2 and ln_f: rms_norm, no parameters (modded-nanogpt's)."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x)


def make_norm(cfg: ModelConfig) -> nn.Module:
    return RMSNorm() if cfg.norm == "rmsnorm" else nn.LayerNorm(cfg.n_embd, bias=cfg.bias)


def rope_tables(pos: Tensor, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """(cos, sin) of the rotation angles pos * base^(-2i/head_dim), i < head_dim/2: fp32 (T, head_dim/2).
    Made from the positions each forward (a KV cache's offset included), so there is no table to keep."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=pos.device) / head_dim)
    angles = pos.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


Rope = tuple[Tensor, Tensor] | None
"""The (cos, sin) of a forward's positions (rope_tables) with ModelConfig.rope, else None."""


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, T, heads, hd) with each pair (j, j + hd/2) rotated by its position's angle j, in fp32 (the
    angles of long positions need it), returned in x's dtype."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, hd/2): the same angle for every head
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


def causal_mask(t_q: int, t_k: int, device) -> Tensor:
    """Boolean (t_q, t_k) mask for queries that are the last t_q of t_k positions."""
    offset = t_k - t_q
    rows = torch.arange(t_q, device=device)[:, None] + offset
    return torch.arange(t_k, device=device)[None, :] <= rows


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.attn_impl = cfg.attn_impl
        self.dropout = cfg.dropout
        self.qk_norm = cfg.qk_norm
        # q, k, v in one matmul; for MHA this is exactly GPT-2's c_attn (n_embd -> 3*n_embd).
        self.c_attn = nn.Linear(cfg.n_embd, cfg.qkv_dim, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_projection = True  # scaled init, see GPT._init_weights
        self.c_proj.zero_init = cfg.zero_init_proj
        self.resid_dropout = nn.Dropout(cfg.dropout)
        if value_embed_table(cfg, layer) is not None:
            # value_embeds: v = a * v + b * value embedding, (a, b) from (0.5, 0.5) as modded-nanogpt's.
            self.v_lambdas = nn.Parameter(torch.full((2,), 0.5))

    def forward(
        self, x: Tensor, kv_cache: KVCache | None = None, rope: Rope = None, docs=None, ve: Tensor | None = None
    ) -> Tensor:
        """rope: the (cos, sin) of these positions (rope_tables) with ModelConfig.rope, else None. docs: the
        documents' mask with ModelConfig.doc_attention (attend), else None. ve: this layer's value embedding of
        the tokens (B, T, n_kv_head * head_dim) with ModelConfig.value_embeds, else None."""
        B, T, C = x.shape
        kv_dim = self.n_kv_head * self.head_dim
        q, k, v = self.c_attn(x).split([C, kv_dim, kv_dim], dim=2)
        q = q.view(B, T, self.n_head, self.head_dim)  # (B, T, nh, hd)
        k = k.view(B, T, self.n_kv_head, self.head_dim)  # (B, T, nkv, hd)
        # QK-norm and RoPE in the (B, T, heads, hd) layout: new q and k laid out as c_attn's output is, so
        # SDPA's output is too and the .contiguous() below stays free (rotated in (B, heads, T, hd), it
        # cost a copy of the attention output, saved by c_proj: measured with saved_tensors_hooks).
        if self.qk_norm:  # before the rotation, as modded-nanogpt; a rotation keeps the norm either way
            q, k = rms_norm(q), rms_norm(k)
        if rope is not None:  # the cache then holds rotated keys: each is rotated once, at its own position
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hd), (B, nkv, T, hd)
        if ve is not None:  # in v's dtype: an fp32 table would make v, and what SDPA saves, fp32 under autocast
            v = self.v_lambdas[0].to(v.dtype) * v + self.v_lambdas[1].to(v.dtype) * ve.to(v.dtype)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, k, v)
        y = self.attend(q, k, v, docs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, docs=None) -> Tensor:
        """docs: with doc_attention, the documents' mask (gpt2/model/documents.py doc_mask): a FlexAttention
        BlockMask or a dense boolean (B, 1, Tq, Tk) one, causality included."""
        t_q, t_k = q.size(2), k.size(2)
        gqa = self.n_kv_head != self.n_head
        dropout_p = self.dropout if self.training else 0.0
        if docs is not None and not isinstance(docs, Tensor):
            return documents.flex_attention(q, k, v, docs)
        if docs is not None:
            if self.attn_impl == "explicit":
                return explicit_attention(q, k, v, docs, dropout_p)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=docs, dropout_p=dropout_p, enable_gqa=gqa)
        if self.attn_impl == "sdpa" and t_q in (t_k, 1):
            # No mask is ever built: is_causal for a full sequence, nothing to hide for one new
            # query that sits after every cached key.
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=t_q == t_k and t_q > 1, enable_gqa=gqa
            )
        mask = causal_mask(t_q, t_k, q.device)
        if self.attn_impl == "explicit":
            return explicit_attention(q, k, v, mask, dropout_p)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.mlp_dim, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.mlp_dim, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_projection = True
        self.c_proj.zero_init = cfg.zero_init_proj
        self.dropout = nn.Dropout(cfg.dropout)
        self.relu2 = cfg.mlp_act == "relu2"

    def forward(self, x: Tensor) -> Tensor:
        h = self.c_fc(x)
        # GPT-2 used the tanh approximation of GELU; keep it so released weights behave the same.
        h = F.relu(h).square() if self.relu2 else F.gelu(h, approximate="tanh")
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, checkpointed: bool = False) -> None:
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg)
        # Activation checkpointing (--activation-checkpointing full): a plain attribute fixed before
        # fully_shard and torch.compile see the block, as torchtitan wraps each block before both. The
        # checkpoint sits inside forward, so FSDP2's hooks on this module stay outside it (the
        # recompute gathers nothing twice), a compiled block traces it as one checkpointed region,
        # and parameter and state-dict names stay those of the plain model (checkpoints load either way).
        self.checkpointed = checkpointed

    def forward(
        self, x: Tensor, kv_cache: KVCache | None = None, rope: Rope = None, docs=None, ve: Tensor | None = None
    ) -> Tensor:
        if self.checkpointed and torch.is_grad_enabled():
            # Saves only x (B, T, h); backward reruns the block's forward for what it needs (the
            # RNG state is restored first, so dropout draws the same mask).
            return checkpoint(self._forward, x, kv_cache, rope, docs, ve, use_reentrant=False)
        return self._forward(x, kv_cache, rope, docs, ve)

    def _forward(
        self, x: Tensor, kv_cache: KVCache | None, rope: Rope = None, docs=None, ve: Tensor | None = None
    ) -> Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, rope, docs, ve)
        return x + self.mlp(self.ln_2(x))


def value_embedding(cfg: ModelConfig) -> nn.Embedding:
    """One value-embedding table (value_embeds): a value per token, as wide as one layer's values. Made without
    drawing (nn.Embedding's own init would), and drawn by GPT after every other weight: GPT-2's draws stay
    GPT-2's, a tied LM head's included (drawn when apply reaches lm_head, after the tables' modules)."""
    kv = cfg.n_kv_head * cfg.head_dim
    table = nn.Embedding(cfg.vocab_size, kv, _weight=torch.empty(cfg.vocab_size, kv))
    table.drawn_last = True
    return table


class UNetSkipWeights(nn.Module):
    """unet_skips' weights, one per skip connection, from 1: a module of its own so that the state-dict name
    (transformer.skip.weight) sits after GPT-2's."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


LOSS_IMPLS = ("chunked", "full")


class GPT(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        loss_impl: str = "chunked",
        activation_checkpointing: bool = False,
        fp8_head: bool = False,
    ) -> None:
        super().__init__()
        if loss_impl not in LOSS_IMPLS:
            raise ValueError(f"loss_impl={loss_impl!r} must be one of {LOSS_IMPLS} (the trainer resolves auto)")
        if fp8_head and loss_impl != "full":
            raise ValueError("fp8_head=True computes the full logits: it needs loss_impl='full'")
        self.config = cfg
        # fp8_head (--fp8-head): training's loss multiplies the LM head in FP8 (gpt2/model/fp8.py); with
        # gradients off (evaluation, sampling) the head stays exact.
        self.fp8_head = fp8_head
        # How forward(x, y, return_logits=False) computes the loss: a plain attribute, fixed before
        # torch.compile traces the model, so the compiled graph has one path (no graph break, no
        # recompilation). The trainer sets it from the planner's choice (gpt2/plan/ choose_loss_impl).
        self.loss_impl = loss_impl
        # Whether each block is compiled alone (--compile-scope blocks, --parallel fsdp; set by gpt2/train/
        # build.py compile_sharded): forward then runs eager while attention runs compiled, so doc_attention's
        # mask is FlexAttention's BlockMask there too (gpt2/model/documents.py flex_available).
        self.compiled_blocks = False
        # activation_checkpointing: every block recomputes its forward in the backward (Block.checkpointed;
        # the trainer resolves --activation-checkpointing, gpt2/plan/ choose_activation_checkpointing).
        # Modules are made (and so initialised, by _init_weights) in GPT-2's order; an option only leaves
        # one out (wpe with rope) or adds one at the end (an untied lm_head).
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                **({} if cfg.rope else {"wpe": nn.Embedding(cfg.block_size, cfg.n_embd)}),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(Block(cfg, i, checkpointed=activation_checkpointing) for i in range(cfg.n_layer)),
                ln_f=make_norm(cfg),
                # The options' own modules after GPT-2's, so that without them every draw is GPT-2's.
                **({"ve": nn.ModuleList(map(value_embedding, [cfg] * cfg.value_embeds))} if cfg.value_embeds else {}),
                **({"skip": UNetSkipWeights(unet_halves(cfg)[0])} if cfg.unet_skips else {}),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        else:
            self.lm_head.zero_init = cfg.zero_init_proj  # as modded-nanogpt: the logits start at 0
        # Padded vocab rows get a -inf logit, added inside the LM-head matmul: they never carry
        # probability (loss, evaluation) and are never sampled, at no extra pass over the logits.
        if cfg.vocab_size > GPT2_VOCAB_SIZE:
            bias = torch.zeros(cfg.vocab_size)
            bias[GPT2_VOCAB_SIZE:] = float("-inf")
            self.register_buffer("logit_bias", bias, persistent=False)
        else:
            self.logit_bias = None
        self.apply(self._init_weights)
        for table in self.transformer.ve if cfg.value_embeds else ():
            nn.init.normal_(table.weight, mean=0.0, std=0.02)  # as the token embedding

    def _init_weights(self, module: nn.Module) -> None:
        # GPT-2 init: N(0, 0.02); projections into the residual stream scaled by 1/sqrt(2*n_layer)
        # so the residual's variance does not grow with depth; biases zero. zero_init_proj: those
        # projections (and an untied head) zero, drawing nothing from the RNG.
        if isinstance(module, nn.Linear) and getattr(module, "zero_init", False):
            nn.init.zeros_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "residual_projection", False):
                std /= math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding) and not getattr(module, "drawn_last", False):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Parameters counted once each (the tied embedding/LM head is one tensor): config.param_count,
        the one counter, which tests check against self.parameters()."""
        return param_count(self.config)

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, *, kv_cache: KVCache | None = None, return_logits: bool = True
    ) -> tuple[Tensor | None, Tensor | None]:
        """idx (B, T) token ids -> logits (B, T, vocab_size) and, with targets, the mean loss.

        Targets equal to -1 are ignored. With a kv_cache, idx holds the tokens after position
        kv_cache.pos and the cache advances past them. With targets and return_logits=False the
        logits returned are None (what training wants) and the loss takes self.loss_impl's path:
        chunked, `linear_cross_entropy` (same maths, no (B, T, vocab) logits kept), or full, the
        plain path below.
        """
        B, T = idx.shape
        start = kv_cache.pos if kv_cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds block_size={self.config.block_size}")
        pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx)
        rope = None
        if self.config.rope:
            rope = rope_tables(pos, self.config.head_dim, self.config.rope_base)
        else:
            x = x + self.transformer.wpe(pos)
        x = self.transformer.drop(x)
        docs = self.document_mask(idx, kv_cache) if self.config.doc_attention else None
        x = self.blocks(x, idx, kv_cache, rope, docs)
        if kv_cache is not None:
            kv_cache.pos += T
        if targets is not None and not return_logits:
            return None, self.head_loss(x, targets)
        x = self.transformer.ln_f(x)
        logits = self.head(x) if targets is not None else self.exact_logits(x)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1), ignore_index=-1)
        return (logits if return_logits else None), loss

    def blocks(self, x: Tensor, idx: Tensor, kv_cache: KVCache | None, rope, docs) -> Tensor:
        """Every block in turn, with each layer's value embedding (value_embeds) and the U-net skips (unet_skips)."""
        tables = [table(idx) for table in self.transformer.ve] if self.config.value_embeds else []
        encoder, decoder = unet_halves(self.config) if self.config.unet_skips else (0, 0)
        kept = []
        for i, block in enumerate(self.transformer.h):
            if encoder and i >= decoder:  # the last `encoder` blocks take the first ones' outputs, last first
                x = x + self.transformer.skip.weight[i - decoder].to(x.dtype) * kept.pop()
            j = value_embed_table(self.config, i) if tables else None
            x = block(x, kv_cache, rope, docs, None if j is None else tables[j])
            if i < encoder:
                kept.append(x)
        return x

    def document_mask(self, idx: Tensor, kv_cache: KVCache | None):
        """doc_attention's mask for these tokens (gpt2/model/documents.py): their document numbers, continuing
        the cache's last one and written into it, against every key's so far. FlexAttention has no dropout
        and the explicit attention is the reference that materialises the scores: with either, the dense mask."""
        if kv_cache is None:
            ids = documents.document_ids(idx)
            if (self.training and self.config.dropout > 0) or self.config.attn_impl == "explicit":
                return documents.dense_mask(ids, ids)
            return documents.doc_mask(ids, ids, blocks_compiled=self.compiled_blocks)
        start, end = kv_cache.pos, kv_cache.pos + idx.size(1)
        first = kv_cache.docs[:, start - 1] if start > 0 else None
        kv_cache.docs[:, start:end] = documents.document_ids(idx, first)
        return documents.dense_mask(kv_cache.docs[:, start:end], kv_cache.docs[:, :end])

    def head_loss(self, x: Tensor, targets: Tensor) -> Tensor:
        """The final LayerNorm, the LM head and the mean loss of the blocks' output x, by self.loss_impl's
        path, without returning logits: what training and evaluation run after the blocks. Its own
        method so that a model whose blocks are compiled one by one (--parallel fsdp) can compile
        this part too (gpt2/train/trainer.py compile_sharded)."""
        x = self.transformer.ln_f(x)
        if self.loss_impl == "chunked":
            return linear_cross_entropy(
                x, self.lm_head.weight, self.logit_bias, targets, softcap=self.config.logit_softcap
            )
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1), ignore_index=-1)

    def head(self, x: Tensor) -> Tensor:
        """The full logits of the final LayerNorm's output x: in FP8 while training with fp8_head (soft-capped
        like the exact head's), else exact_logits."""
        if self.fp8_head and torch.is_grad_enabled():
            return self._cap_and_mask(fp8_linear(x, self.lm_head.weight, logits_dtype(x.device.type)))
        return self.exact_logits(x)

    def exact_logits(self, x: Tensor) -> Tensor:
        """The LM head's logits of x, soft-capped with logit_softcap: what evaluation and sampling read."""
        if self.config.logit_softcap is None:
            return F.linear(x, self.lm_head.weight, self.logit_bias)
        return self._cap_and_mask(F.linear(x, self.lm_head.weight))

    def _cap_and_mask(self, logits: Tensor) -> Tensor:
        """cap * tanh(logits / cap) in fp32 (logit_softcap), then the padded rows' -inf: after the cap, which
        would turn -inf into -cap and give the padding probability."""
        cap = self.config.logit_softcap
        if cap is not None:
            logits = cap * torch.tanh(logits.float() / cap)
        return logits if self.logit_bias is None else logits + self.logit_bias.to(logits.dtype)

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        stop_token: int | None = None,
    ) -> Tensor:
        """Append up to max_new_tokens sampled tokens to idx (B, T). temperature=0 is greedy. With
        stop_token, a row that sampled it is padded with it and generation ends once every row has:
        cut each row at its first stop_token (cut_at_stop)."""
        new = list(
            self.generate_stream(
                idx,
                max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                generator=generator,
                use_cache=use_cache,
                stop_token=stop_token,
            )
        )
        return torch.cat([idx, *new], dim=1)

    @torch.no_grad()
    def generate_stream(
        self,
        idx: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        stop_token: int | None = None,
    ) -> Iterator[Tensor]:
        """Yield each new (B, 1) token as it is sampled (so text can be shown as it comes).

        stop_token (the end-of-text token 50256 for text samples): once a row has sampled it, that
        row yields stop_token from then on, and the generator returns when every row has: a sample
        ends where the model ended its text, and a batch stops early when all its samples have.

        With use_cache, keys and values are kept between steps. Positions are absolute (learned, or
        rotary: the cache holds rotated keys), so once the sequence outgrows block_size the window
        shifts and the cache is rebuilt from the last block_size tokens: exactly the context uncached
        generation sees.
        """
        if idx.size(1) == 0:
            raise ValueError("generate needs at least one prompt token (e.g. the EOT token 50256)")
        block = self.config.block_size
        cache = None
        done = torch.zeros(idx.size(0), 1, dtype=torch.bool, device=idx.device)
        for _ in range(max_new_tokens):
            if not use_cache:
                logits, _ = self(idx[:, -block:])
            elif cache is None or cache.pos >= block:
                cache = KVCache(self.config, idx.size(0), device=self.lm_head.weight.device, dtype=self._cache_dtype())
                logits, _ = self(idx[:, -block:], kv_cache=cache)
            else:
                logits, _ = self(idx[:, -1:], kv_cache=cache)
            next_tok = sample_next(logits[:, -1, :].float(), temperature=temperature, top_k=top_k, generator=generator)
            if stop_token is not None:
                next_tok = next_tok.masked_fill(done, stop_token)  # an ended row stays ended
                done |= next_tok == stop_token
            idx = torch.cat([idx, next_tok], dim=1)
            yield next_tok
            if stop_token is not None and bool(done.all()):
                return

    def _cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype: under autocast the keys and values come out of c_attn in the autocast
        dtype, so an fp32 cache would hold the same values at twice the memory and traffic; SDPA
        under autocast reads them in that dtype either way."""
        device_type = self.lm_head.weight.device.type
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return self.lm_head.weight.dtype


def cut_at_stop(tokens: list[int], stop_token: int) -> list[int]:
    """The tokens before the first stop_token (all of them if there is none)."""
    return tokens[: tokens.index(stop_token)] if stop_token in tokens else tokens


TOP_K = 200  # sampling's top-k unless told otherwise: the trainer's samples and gpt2.sample (nanoGPT's)


def sample_next(logits: Tensor, *, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
    """(B, V) logits -> (B, 1) token ids. Padded-vocab logits are -inf and so never chosen."""
    logits = logits[:, :GPT2_VOCAB_SIZE]
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain GPT inside DDP and/or torch.compile wrappers.

    Save and load state dicts through this: a DDP-wrapped model prefixes every key with `module.`
    and a compiled one with `_orig_mod.`, and such checkpoints do not load into a plain model.
    """
    model = getattr(model, "module", model)  # DDP
    return getattr(model, "_orig_mod", model)  # torch.compile
