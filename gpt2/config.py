"""Model configuration and named presets.

`ModelConfig` uses GPT-2's own field names (`n_layer`, `n_head`, `n_embd`, `block_size`,
`vocab_size`) so weights map to Hugging Face's without renaming. It is frozen and validated on
construction: a config that exists is a config that can be built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# The GPT-2 BPE has 50,257 tokens (50,000 merges + 256 bytes + <|endoftext|>).
GPT2_VOCAB_SIZE = 50257
EOT_TOKEN = 50256
# 50257 rounded up to a multiple of 128: "nice numbers" make the LM-head matmul faster.
PADDED_VOCAB_SIZE = 50304

ATTN_IMPLS = ("sdpa", "sdpa_mask", "explicit")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    n_layer: int = 12
    """Number of transformer blocks."""
    n_head: int = 12
    """Number of query heads."""
    n_kv_head: int | None = None
    """Key/value heads: n_head (default) is multi-head, 1 is multi-query, else grouped-query."""
    n_embd: int = 768
    """Width of the residual stream."""
    block_size: int = 1024
    """Maximum sequence length (number of learned positions)."""
    vocab_size: int = PADDED_VOCAB_SIZE
    """Embedding rows. Rows past the tokenizer's 50,257 are padding: never sampled, no probability."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers, as in GPT-2."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches (0 for pretraining)."""
    attn_impl: str = "sdpa"
    """Attention kernel: 'sdpa' (is_causal, flash/memory-efficient), 'sdpa_mask' (SDPA with an explicit
    boolean mask) or 'explicit' (softmax(QK^T/sqrt(d) + mask)V). The last two exist for benchmarks."""

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        problems = model_config_problems(self)
        if problems:
            raise ValueError("invalid model config:\n  - " + "\n  - ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def replace(self, **changes) -> "ModelConfig":
        """A new validated config with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def model_config_problems(cfg: ModelConfig) -> list[str]:
    """Every problem with a model config, so the user can fix them all at once."""
    p = []
    for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "vocab_size"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            p.append(f"{name}={value!r} must be a positive integer")
    if p:
        return p
    if cfg.n_embd % cfg.n_head:
        p.append(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}; "
                 f"choose n_head among {[h for h in range(1, 65) if cfg.n_embd % h == 0]}")
    if cfg.n_head % cfg.n_kv_head:
        p.append(f"n_head={cfg.n_head} is not divisible by n_kv_head={cfg.n_kv_head}; "
                 f"n_kv_head must divide n_head (n_head for MHA, 1 for MQA)")
    if cfg.vocab_size < GPT2_VOCAB_SIZE:
        p.append(f"vocab_size={cfg.vocab_size} is smaller than the GPT-2 tokenizer's {GPT2_VOCAB_SIZE} "
                 f"tokens; use {GPT2_VOCAB_SIZE} or the padded {PADDED_VOCAB_SIZE}")
    if not 0.0 <= cfg.dropout < 1.0:
        p.append(f"dropout={cfg.dropout} must be in [0, 1)")
    if cfg.attn_impl not in ATTN_IMPLS:
        p.append(f"attn_impl={cfg.attn_impl!r} must be one of {ATTN_IMPLS}")
    return p


# Model shapes of the four OpenAI releases, plus a tiny model that trains in minutes on a CPU.
MODEL_PRESETS: dict[str, dict] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),          # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),   # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),      # 1558M
    "debug": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
}


def model_preset(name: str, **overrides) -> ModelConfig:
    """The named preset's ModelConfig, with optional field overrides."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
    return ModelConfig(**{**MODEL_PRESETS[name], **overrides})


def count_params_formula(cfg: ModelConfig) -> int:
    """N = V*h + T*h + L*(12h^2 + 13h) + 2h for the MHA/biased GPT-2 layout.

    Embeddings (tied LM head counted once), positions, per block: attention 4h^2+4h, MLP 8h^2+5h,
    two LayerNorms 4h; then the final LayerNorm 2h. For GQA/MQA or bias=False the exact count from
    the module differs; use `GPT.num_params()` for that.
    """
    V, T, L, h = cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_embd
    return V * h + T * h + L * (12 * h * h + 13 * h) + 2 * h
