"""Model configuration and named presets.

`ModelConfig` uses GPT-2's own field names (`n_layer`, `n_head`, `n_embd`, `block_size`,
`vocab_size`) so weights map to Hugging Face's without renaming. It is frozen and validated on
construction: a config that exists is a config that can be built.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import PurePath

# The GPT-2 BPE has 50,257 tokens (50,000 merges + 256 bytes + <|endoftext|>).
GPT2_VOCAB_SIZE = 50257
EOT_TOKEN = 50256
# 50257 rounded up to a multiple of 128: "nice numbers" make the LM-head matmul faster.
PADDED_VOCAB_SIZE = 50304

ATTN_IMPLS = ("sdpa", "sdpa_mask", "explicit")
MLP_ACTS = ("gelu_tanh", "relu2")
NORMS = ("layernorm", "rmsnorm")
SHAPE = {"shape": True}
"""ModelConfig field metadata: the field changes the weights (their shapes, or what they mean), so a
checkpoint with another value cannot be resumed (ModelConfig.shape_fields)."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The model's shape and its architecture options (each off by default: GPT-2 as released)."""

    n_layer: int = field(default=12, metadata=SHAPE)
    """Number of transformer blocks."""
    n_head: int = field(default=12, metadata=SHAPE)
    """Number of query heads."""
    n_kv_head: int | None = field(default=None, metadata=SHAPE)
    """Key/value heads (none: n_head; 1: multi-query).

    n_head (the default, none) is multi-head attention, 1 is multi-query, else grouped-query."""
    n_embd: int = field(default=768, metadata=SHAPE)
    """Width of the residual stream."""
    block_size: int = field(default=1024, metadata=SHAPE)
    """Maximum sequence length (learned positions)."""
    vocab_size: int = field(default=PADDED_VOCAB_SIZE, metadata=SHAPE)
    """Embedding rows (past 50,257: padding).

    Rows past the tokenizer's 50,257 are padding: never sampled, no probability."""
    bias: bool = field(default=True, metadata=SHAPE)
    """Biases in Linear and LayerNorm, as in GPT-2."""
    dropout: float = 0.0
    """Dropout on attention and residual branches.

    On the attention weights and the residual branches; 0 for pretraining."""
    attn_impl: str = "sdpa"
    """Attention kernel: sdpa, sdpa_mask or explicit.

    'sdpa' (is_causal, flash/memory-efficient), 'sdpa_mask' (SDPA with an explicit boolean mask) or 'explicit'
    (softmax(QK^T/sqrt(d) + mask)V). The last two exist for benchmarks."""
    # The architecture options below are each off by default (GPT-2 as released); --arch modern turns on
    # the set modded-nanogpt's speedrun uses (ARCHS, docs/modern.md).
    rope: bool = field(default=False, metadata=SHAPE)
    """Rotary positions instead of a learned table.

    Each head's queries and keys are rotated by position x rope_base^(-2i/head_dim), pairing dimension i with
    i + head_dim/2 (the RoFormer rotation in GPT-NeoX's and Llama's layout): the model has no
    transformer.wpe table. Needs an even head_dim."""
    rope_base: float = field(default=10000.0, metadata=SHAPE)
    """RoPE's frequency base (with --rope)."""
    qk_norm: bool = field(default=False, metadata=SHAPE)
    """RMS-normalise each head's queries and keys.

    x / sqrt(mean(x^2) + 1e-6) over each head's dimensions, no learned gain (modded-nanogpt's QK-norm), before
    RoPE and attention: bounds the attention logits."""
    mlp_act: str = field(default="gelu_tanh", metadata=SHAPE)
    """MLP activation: gelu_tanh or relu2.

    gelu_tanh is GPT-2's; relu2 is relu(x)^2 (So et al. 2021, "Primer"; modded-nanogpt's MLP)."""
    norm: str = field(default="layernorm", metadata=SHAPE)
    """Norms: layernorm (GPT-2) or rmsnorm.

    The blocks' and the final norm. rmsnorm: x / sqrt(mean(x^2) + 1e-6) with no learned gain or bias
    (modded-nanogpt's), so the model has no ln_1, ln_2, ln_f parameters."""
    tie_embeddings: bool = field(default=True, metadata=SHAPE)
    """Tie the LM head to the token embedding.

    false: the LM head is a weight of its own (lm_head.weight, V x n_embd more parameters) and the token
    embedding a lookup table only."""
    logit_softcap: float | None = field(default=None, metadata=SHAPE)
    """Cap logits at cap*tanh(logits/cap) (none: off).

    In the loss (both --loss-impl paths), evaluation and sampling alike (Gemma 2's soft-capping;
    modded-nanogpt's 15 at 124M)."""
    zero_init_proj: bool = False
    """Zero-initialise the output projections.

    attn.c_proj and mlp.c_proj of every block, and the untied LM head (modded-nanogpt's): each block starts
    as the identity. Only the initialisation: a checkpoint resumes either way."""
    doc_attention: bool = False
    """Attend within documents only.

    A token attends to the earlier tokens of its own document, documents being marked by the EOT token that
    opens each (data_prep writes [EOT] + text); plain causal attention also sees the documents before it in
    the window. FlexAttention on CUDA wherever attention is compiled (any --compile-scope, fsdp), an exact dense
    mask elsewhere (gpt2/model/documents.py).
    How the weights are trained, not what they hold: a checkpoint resumes either way and exports as GPT-2."""
    value_embeds: int = field(default=0, metadata=SHAPE)
    """Value-embedding tables (0: none).

    k token-indexed tables of n_kv_head x head_dim, each mixed into the values of two layers, the first k and
    the last k in U-net order (layer i and layer n_layer-k+i take table i; the middle layers none), as
    v = a * v + b * table[token] with a and b learned per layer from 0.5 (modded-nanogpt's records of 2024-12-04
    to 2024-12-17, which use 3). Lookups, no matmul: k x vocab_size x kv width more parameters, no more FLOPs.
    Needs 2k <= n_layer."""
    unet_skips: bool = field(default=False, metadata=SHAPE)
    """U-net skip connections between the blocks.

    The first n_layer // 2 blocks' outputs are kept and added, last first, to the inputs of the last n_layer // 2
    (block n_layer-1-i takes block i's), each scaled by a learned weight from 1 (modded-nanogpt's record of
    2024-11-10): n_layer // 2 more parameters (transformer.skip.weight)."""

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        refuse_non_finite(self)
        problems = model_config_problems(self)
        if problems:
            raise ValueError("invalid model config:\n  - " + "\n  - ".join(problems))

    @classmethod
    def shape_fields(cls) -> tuple[str, ...]:
        """The fields marked SHAPE, in declaration order: those a resumed checkpoint must match."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("shape"))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def qkv_dim(self) -> int:
        """Width of c_attn's output: the queries (n_embd) and n_kv_head keys and values."""
        return self.n_embd + 2 * self.n_kv_head * self.head_dim

    @property
    def mlp_dim(self) -> int:
        """Width of the MLP's hidden layer."""
        return 4 * self.n_embd

    def replace(self, **changes) -> ModelConfig:
        """A new validated config with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def refuse_non_finite(cfg) -> None:
    """Every float field finite, in one line naming the flag. Checked first and alone: the range checks
    below cannot catch nan (every comparison with it is false, so --grad-clip nan passed `>= 0` and then
    disabled clipping) or inf (--lr inf passed `> 0` and turned the weights to NaN), and would word the
    problem as a range. The one place for flags, --config files (TOML has nan and inf) and code alike."""
    bad = [
        f"--{f.name.replace('_', '-')} {getattr(cfg, f.name)}"
        for f in dataclasses.fields(cfg)
        if isinstance(getattr(cfg, f.name), float) and not math.isfinite(getattr(cfg, f.name))
    ]
    if bad:
        raise ValueError(f"{', '.join(bad)}: not a finite number; nan and inf are refused, give a number")


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
        p.append(
            f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}; "
            f"choose n_head among {[h for h in range(1, 65) if cfg.n_embd % h == 0]}"
        )
    if cfg.n_head % cfg.n_kv_head:
        p.append(
            f"n_head={cfg.n_head} is not divisible by n_kv_head={cfg.n_kv_head}; "
            f"n_kv_head must divide n_head (n_head for MHA, 1 for MQA)"
        )
    if cfg.vocab_size < GPT2_VOCAB_SIZE:
        p.append(
            f"vocab_size={cfg.vocab_size} is smaller than the GPT-2 tokenizer's {GPT2_VOCAB_SIZE} "
            f"tokens; use {GPT2_VOCAB_SIZE} or the padded {PADDED_VOCAB_SIZE}"
        )
    return p + _architecture_problems(cfg)


def _architecture_problems(cfg: ModelConfig) -> list[str]:
    """Dropout, attention, the MLP's activation, the norm, RoPE and the logit cap (sizes already checked)."""
    p = []
    if not 0.0 <= cfg.dropout < 1.0:
        p.append(f"dropout={cfg.dropout} must be in [0, 1)")
    if cfg.attn_impl not in ATTN_IMPLS:
        p.append(f"attn_impl={cfg.attn_impl!r} must be one of {ATTN_IMPLS}")
    if cfg.mlp_act not in MLP_ACTS:
        p.append(f"mlp_act={cfg.mlp_act!r} must be one of {MLP_ACTS}")
    if cfg.norm not in NORMS:
        p.append(f"norm={cfg.norm!r} must be one of {NORMS}")
    if cfg.rope and cfg.head_dim % 2:
        p.append(f"rope=True needs an even head_dim; n_embd={cfg.n_embd} / n_head={cfg.n_head} is {cfg.head_dim}")
    if not cfg.rope_base > 1:
        p.append(f"rope_base={cfg.rope_base} must be > 1")
    if cfg.logit_softcap is not None and not cfg.logit_softcap > 0:
        p.append(f"logit_softcap={cfg.logit_softcap} must be > 0, or none for no cap")
    k = cfg.value_embeds
    if not isinstance(k, int) or isinstance(k, bool) or k < 0 or 2 * k > cfg.n_layer:
        p.append(
            f"value_embeds={k!r} must be an integer from 0 to n_layer // 2 = {cfg.n_layer // 2}: each table feeds "
            "one of the first and one of the last layers"
        )
    return p


def value_embed_table(cfg: ModelConfig, layer: int) -> int | None:
    """The value-embedding table layer `layer` mixes into its values (ModelConfig.value_embeds), or None:
    the first k layers take tables 0..k-1 and the last k the same tables again, in the same order."""
    k, n = cfg.value_embeds, cfg.n_layer
    if layer < k:
        return layer
    if layer >= n - k:
        return layer - (n - k)
    return None


def unet_halves(cfg: ModelConfig) -> tuple[int, int]:
    """(skips, first decoder block) of unet_skips: the first n_layer // 2 blocks keep their outputs, which the
    last n_layer // 2 take, last first (block n_layer-1-i takes block i's; with an odd n_layer the middle block
    takes none). Weights: one per skip."""
    return cfg.n_layer // 2, cfg.n_layer - cfg.n_layer // 2


MODERN = dict(
    rope=True,
    qk_norm=True,
    mlp_act="relu2",
    norm="rmsnorm",
    tie_embeddings=False,
    logit_softcap=15.0,
    zero_init_proj=True,
    bias=False,
)
"""--arch modern's options (ARCHS below says why the cap is 15), which the speedrun presets build on."""


# Model shapes of the four OpenAI releases, plus a tiny model that trains in minutes on a CPU.
MODEL_PRESETS: dict[str, dict] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),  # 1558M
    "debug": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "speed": dict(n_layer=4, n_head=4, n_embd=128, block_size=64),  # nanoGPT's small Shakespeare model
    # The speed preset's shape with the modern architecture (MODERN) less the logit
    # soft-cap, and attention within documents: bench/time_to_loss.py's modern ablation says what each gives
    # (the cap cost 16% more s/step on a CPU at GPT-2's vocabulary for no fewer steps; docs/performance.md).
    "speedrun": {
        **dict(n_layer=4, n_head=4, n_embd=128, block_size=64),
        **MODERN,
        "logit_softcap": None,
        "doc_attention": True,
    },
    # GPT-2 124M's shape with the modern architecture (its soft-cap of 15 with it) and attention within documents:
    # the speedrun records' model at this size (docs/modern.md).
    "gpt2-speedrun": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, **MODERN, doc_attention=True),
}


# --arch NAME: the architecture options as one switch, at any size (a preset or flags give the shape).
# "modern" is the set of modded-nanogpt's speedrun records (docs/modern.md), each field also a flag of its own.
# logit_softcap=15: the speedrun lowered its cap from 30 to 15 at 124M (its record of 2025-01-04); the
# other records here are at that size too.
ARCHS: dict[str, dict] = {
    "gpt2": dict(
        rope=False,
        qk_norm=False,
        mlp_act="gelu_tanh",
        norm="layernorm",
        tie_embeddings=True,
        logit_softcap=None,
        zero_init_proj=False,
        bias=True,
    ),
    "modern": MODERN,
}
"""--arch's names and the ModelConfig fields each sets: gpt2 every option off (the defaults), modern on."""


def model_preset(name: str, **overrides) -> ModelConfig:
    """The named preset's ModelConfig, with optional field overrides."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
    return ModelConfig(**{**MODEL_PRESETS[name], **overrides})


def count_params_formula(cfg: ModelConfig) -> int:
    """N = V*h + T*h + L*(12h^2 + 13h) + 2h for the MHA/biased GPT-2 layout: a closed-form cross-check
    of param_count (tests/test_config.py; `python -m gpt2.plan` prints both).

    Embeddings (tied LM head counted once), positions, per block: attention 4h^2+4h, MLP 8h^2+5h,
    two LayerNorms 4h; then the final LayerNorm 2h. For GQA/MQA or bias=False it differs from the
    module; param_count is exact for every layout.
    """
    V, T, L, h = cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_embd
    return V * h + T * h + L * (12 * h * h + 13 * h) + 2 * h


POSITION_EMBEDDING = "transformer.wpe.weight"
TOKEN_EMBEDDING = "transformer.wte.weight"
LM_HEAD = "lm_head.weight"
"""The untied LM head's weight (tie_embeddings=False); tied, it is the token embedding and not listed."""


def lookup_tables(cfg: ModelConfig) -> tuple[str, ...]:
    """The weights only indexed, never multiplied: the position table (if any), the value embeddings and, when
    the LM head is untied, the token embedding (the head's matmul has its own weight). FLOPs and autocast copies leave
    them out (gpt2/plan/flops.py, gpt2/plan/memory.py)."""
    names = () if cfg.rope else (POSITION_EMBEDDING,)
    names += value_embed_names(cfg)
    return names if cfg.tie_embeddings else (*names, TOKEN_EMBEDDING)


def value_embed_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The value-embedding tables' weights (ModelConfig.value_embeds): lookups, trained like the embeddings."""
    return tuple(f"transformer.ve.{j}.weight" for j in range(cfg.value_embeds))


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of `GPT(cfg)` by its state-dict name, with its shape, in the module's order (a tied
    LM head is the token embedding, so it is not listed again; an untied one comes last). The one description of the
    weights that the parameter count, the planner's weight and optimizer bytes and the checks derive
    from; tests/test_config.py checks it against the module."""
    return dict(_weight_shapes(cfg))


@functools.cache  # the planner asks for every micro-batch it tries; a gpt2-xl has 580 tensors
def _weight_shapes(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    h = cfg.n_embd
    # rmsnorm has no parameters (ModelConfig.norm): its modules hold nothing to list.
    norm = {} if cfg.norm == "rmsnorm" else {"weight": (h,), **({"bias": (h,)} if cfg.bias else {})}

    def linear(n_in: int, n_out: int) -> dict:
        return {"weight": (n_out, n_in), **({"bias": (n_out,)} if cfg.bias else {})}

    def block(i: int) -> dict:
        # value_embeds: a layer with a table has its two mixing weights, the attention module's own parameter,
        # which named_parameters lists before its submodules'.
        lambdas = {} if value_embed_table(cfg, i) is None else {"attn": {"v_lambdas": (2,)}}
        return {
            "ln_1": norm,
            **lambdas,
            "attn.c_attn": linear(h, cfg.qkv_dim),
            "attn.c_proj": linear(h, h),
            "ln_2": norm,
            "mlp.c_fc": linear(h, cfg.mlp_dim),
            "mlp.c_proj": linear(cfg.mlp_dim, h),
        }

    shapes = {TOKEN_EMBEDDING: (cfg.vocab_size, h)}
    if not cfg.rope:  # RoPE rotates q and k instead of adding a learned position
        shapes[POSITION_EMBEDDING] = (cfg.block_size, h)
    for i in range(cfg.n_layer):
        shapes |= {
            f"transformer.h.{i}.{module}.{kind}": shape
            for module, params in block(i).items()
            for kind, shape in params.items()
        }
    shapes |= {f"transformer.ln_f.{kind}": shape for kind, shape in norm.items()}
    # The options' own modules come after GPT-2's, in the order GPT registers them.
    shapes |= {name: (cfg.vocab_size, cfg.n_kv_head * cfg.head_dim) for name in value_embed_names(cfg)}
    if cfg.unet_skips:
        shapes["transformer.skip.weight"] = (unet_halves(cfg)[0],)
    if not cfg.tie_embeddings:
        shapes[LM_HEAD] = (cfg.vocab_size, h)
    return tuple(shapes.items())


@functools.cache  # pure in a frozen config; the planner counts at every micro-batch it tries
def param_count(cfg: ModelConfig, *, include_position: bool = True) -> int:
    """Exact parameter count of `GPT(cfg)` (a tied LM head counted once), for any layout and option: the
    one counter (GPT.num_params, the planner, FLOPs per token). include_position=False leaves out the
    position embeddings (a table lookup, no matmul: gpt2/plan/flops.py; none with rope)."""
    return sum(
        math.prod(shape) for name, shape in _weight_shapes(cfg) if include_position or name != POSITION_EMBEDDING
    )


DEVICES = ("auto", "cpu", "cuda")
OPTIMIZERS = ("adamw", "muon")
MUON_ORTHOS = ("newton_schulz", "polar_express")  # --muon-ortho: gpt2/train/muon.py
LOSS_IMPLS = ("auto", "chunked", "full")
COMPILE_SCOPES = ("model", "blocks")
PARALLELS = ("ddp", "fsdp")
ACTIVATION_CHECKPOINTING = ("auto", "none", "full")
VERIFY_DATA = ("quick", "auto", "full")


INVALID_TRAINING = "invalid training config:\n  - "


class TrainSection:
    """What every TrainConfig section is: made frozen, it refuses non-finite numbers first (refuse_non_finite
    says why), then its own problems(), in one error."""

    def problems(self) -> list[str]:
        return []

    def __post_init__(self) -> None:
        refuse_non_finite(self)
        problems = self.problems()
        if problems:
            raise ValueError(INVALID_TRAINING + "\n  - ".join(problems))


@dataclass(frozen=True, kw_only=True)
class DataConfig(TrainSection):
    """The token shards and the order a run reads them in."""

    data_dir: str = ""
    """Shard directory; A,B,...: a mixture of several.

    *train*.bin and *val*.bin token shards: data_prep's, or llm.c's and modded-nanogpt's. A,B,...: a mixture,
    each training sequence drawn from one of them at --data-weights (docs/data.md, "Mixtures"); each source
    is named by its directory's name in the log and metrics.jsonl (tokens/NAME, val_loss/NAME)."""
    data_weights: str = ""
    """Weights of the --data-dir sources: W1,W2.

    Each source's share of the training sequences: one positive number per directory of --data-dir, in its
    order, normalised to sum to 1 (a line says so when they do not). Needed with several directories; a
    resume may change them (the position in each source is kept, a line says so)."""
    data_weight_schedule: str = ""
    """Mixture weights from a step on: STEP:W1,W2.

    Entries separated by spaces or semicolons, each taking effect at optimizer step STEP (or N% of
    --max-steps: `90%:0.2,0.8` trains the last 10% of the steps at 0.2/0.8, "anneal on the high-quality
    part"); a weight may be 0 here. Each change is said in the log at its step and resumes exactly."""
    data_order: str = "shuffled"
    """Window order: shuffled or sequential.

    shuffled: each epoch visits every window of block_size+1 tokens once, in a random order (rows of a batch
    from all over the corpus); sequential: consecutive windows of the token stream, for corpora that are
    shuffled already. Validation is always the fixed first eval_tokens, in order."""
    verify_data: str = "auto"
    """Shard check at start-up: quick, auto or full.

    How much of the data start-up checks against data_prep's manifest.json and the vocabulary
    (gpt2/data/check.py): quick (every shard listed, with its split and token count; no reading), auto (quick,
    plus the sha256 and token ids of every shard when they total at most 1 GiB, else of the val shards) or
    full (every shard's sha256 and token ids). Every training batch's token ids are checked as it is loaded,
    whatever this says."""
    seed: int = 1337
    """Seed for initialisation and data order."""

    def problems(self) -> list[str]:
        p = []
        if self.verify_data not in VERIFY_DATA:
            p.append(f"verify_data={self.verify_data!r} must be one of {VERIFY_DATA}")
        if self.data_order not in ("shuffled", "sequential"):
            p.append(f"data_order={self.data_order!r} must be shuffled or sequential")
        return p + mixture_problems(self)

    @property
    def dirs(self) -> list[str]:
        """--data-dir's directories: one, or the sources of a mixture."""
        return data_dirs(self.data_dir)

    @property
    def names(self) -> list[str]:
        """Each source's name: its directory's (tokens/NAME, val_loss/NAME in metrics.jsonl)."""
        return [source_name(d) for d in self.dirs]

    @property
    def weights(self) -> tuple[float, ...]:
        """--data-weights normalised to sum to 1 (one source: (1.0,))."""
        if len(self.dirs) < 2:
            return (1.0,)
        return normalised(parse_weights(self.data_weights, "data_weights"))


def data_dirs(data_dir: str) -> list[str]:
    """The directories of a --data-dir value: one, or several comma-separated (a mixture)."""
    return [d.strip() for d in data_dir.split(",")] if data_dir.strip() else []


def source_name(directory: str) -> str:
    """A mixture source's name: its directory's last component (data/code/ -> code)."""
    return PurePath(directory.rstrip("/")).name or directory


def parse_weights(text: str, what: str, *, zero_ok: bool = False) -> list[float]:
    """W1,W2,... as floats, each finite and > 0 (>= 0 with zero_ok, at least one > 0): ValueError naming `what`."""
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise ValueError(f"{what}={text!r} must be comma-separated numbers, e.g. 0.75,0.25") from None
    bad = [w for w in weights if not math.isfinite(w) or w < 0 or (w == 0 and not zero_ok)]
    if bad:
        raise ValueError(
            f"{what}={text!r} has the weight {bad[0]:g}: every weight must be a finite number > 0"
            + (" (0 allowed here)" if zero_ok else "")
        )
    if not sum(weights) > 0:
        raise ValueError(f"{what}={text!r}: at least one weight must be > 0")
    return weights


def normalised(weights: list[float]) -> tuple[float, ...]:
    total = sum(weights)
    return tuple(w / total for w in weights)


def schedule_entries(text: str, n_sources: int) -> list[tuple[str, list[float]]]:
    """--data-weight-schedule's entries as (STEP or N%, weights), unresolved: ValueError on bad syntax."""
    entries = []
    for entry in text.replace(";", " ").split():
        when, sep, weights = entry.partition(":")
        if not sep:
            raise ValueError(f"data_weight_schedule entry {entry!r} must be STEP:W1,W2 (or N%:W1,W2)")
        number = when[:-1] if when.endswith("%") else when
        try:
            value = float(number) if when.endswith("%") else int(number)
        except ValueError:
            raise ValueError(
                f"data_weight_schedule entry {entry!r}: {when!r} must be a step or N% of max_steps"
            ) from None
        if value < 0 or (when.endswith("%") and value > 100):
            raise ValueError(f"data_weight_schedule entry {entry!r}: {when!r} must be a step >= 0 or 0%..100%")
        parsed = parse_weights(weights, f"data_weight_schedule entry {entry!r}", zero_ok=True)
        if len(parsed) != n_sources:
            raise ValueError(
                f"data_weight_schedule entry {entry!r} has {len(parsed)} weight(s) for {n_sources} --data-dir sources"
            )
        entries.append((when, parsed))
    return entries


def mixture_problems(data: DataConfig) -> list[str]:
    """The mixture flags: the sources' names distinct, one weight each, the schedule's syntax."""
    dirs = data.dirs
    if len(dirs) < 2 and not data.data_weight_schedule:
        if data.data_weights and len(data.data_weights.split(",")) != 1:
            return [f"data_weights={data.data_weights!r} gives several weights for one --data-dir source"]
        return []
    if any(not d for d in dirs):
        return [f"data_dir={data.data_dir!r} has an empty entry: name each source directory, A,B"]
    if len(dirs) < 2:
        return ["data_weight_schedule needs a mixture: several --data-dir directories, A,B"]
    p = []
    names = [source_name(d) for d in dirs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        same = [d for d in dirs if source_name(d) == twice[0]]
        p.append(
            f"data_dir names two sources {twice[0]!r} ({', '.join(same)}): a source is named by its directory's "
            "name in the log and metrics; rename one directory (or link it under another name)"
        )
    if not data.data_weights:
        p.append(
            f"data_dir names {len(dirs)} sources: pass --data-weights with {len(dirs)} weights, their shares of the "
            f"training sequences (e.g. --data-weights {','.join(['1'] * len(dirs))} for equal shares)"
        )
        return p
    try:
        weights = parse_weights(data.data_weights, "data_weights")
        if len(weights) != len(dirs):
            p.append(
                f"data_weights={data.data_weights!r} gives {len(weights)} weight(s) for the {len(dirs)} --data-dir "
                f"sources ({', '.join(names)}): one each, in --data-dir's order"
            )
        schedule_entries(data.data_weight_schedule, len(dirs))
    except ValueError as e:
        p.append(str(e))
    return p


@dataclass(frozen=True, kw_only=True)
class BatchConfig(TrainSection):
    """How many tokens a step takes, and in what pieces."""

    micro_batch_size: int | str = "auto"
    """Sequences per rank per micro-step, or auto.

    Sequences per rank per forward/backward; auto: the largest that the planner says fits the device and
    divides the global batch (logged with the plan)."""
    total_batch_size: int = 524_288
    """Tokens per optimizer step, over all ranks.

    Summed over all ranks and accumulation steps."""
    batch_warmup_steps: int = 0
    """Smaller batches for the first N steps (0: off).

    0: every step takes total_batch_size. N > 0: the first N steps take a growing part of it, in
    batch_warmup_stages equal stretches: 1/(stages+1), 2/(stages+1), ... of the tokens (fewer micro-steps on
    every rank, the same data order), then all of it (modded-nanogpt's batch size schedule)."""
    batch_warmup_stages: int = 3
    """The warmup's batch sizes: 3 takes 1/4, 2/4, 3/4.

    Each stage must be whole micro-steps: the micro-steps per rank divide by stages + 1."""

    def problems(self) -> list[str]:
        p = []
        mb = self.micro_batch_size
        if mb != "auto" and (not isinstance(mb, int) or isinstance(mb, bool) or mb < 1):
            p.append(f"micro_batch_size={mb!r} must be a positive integer or auto")
        p += _at_least(self, 1, "total_batch_size", "batch_warmup_stages") + _at_least(self, 0, "batch_warmup_steps")
        parts = self.batch_warmup_stages + 1
        if not p and self.batch_warmup_steps and self.total_batch_size % parts:
            alts = [str(d - 1) for d in range(2, 10) if self.total_batch_size % d == 0]
            p.append(
                f"batch_warmup_stages={self.batch_warmup_stages} grows the batch in steps of 1/{parts} of "
                f"total_batch_size={self.total_batch_size}, which does not divide by {parts}: pass "
                + (f"--batch-warmup-stages {' or '.join(alts)}, or " if alts else "")
                + f"a --total-batch-size that divides by {parts}"
            )
        return p


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig(TrainSection):
    """How long the run is and its learning rate at each step."""

    max_steps: int = 19_073
    """Optimizer steps to train for.

    The default: 19,073 x 524,288 tokens = 10B tokens."""
    lr: float = 6e-4
    """Peak learning rate, reached after warmup."""
    min_lr: float = 6e-5
    """Learning rate at the end of the decay."""
    warmup_steps: int = 715
    """Linear warmup steps."""
    decay_steps: int = 0
    """Steps of final linear decay (0: cosine decay).

    0: cosine decay from warmup to max_steps. N > 0: warmup-stable-decay: the peak lr until max_steps - N,
    then linear decay to min_lr over the last N steps."""

    def problems(self) -> list[str]:
        p = _at_least(self, 1, "max_steps") + _at_least(self, 0, "warmup_steps", "decay_steps")
        if not self.lr > 0:
            p.append(f"lr={self.lr} must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            p.append(f"min_lr={self.min_lr} must be between 0 and lr={self.lr}")
        return p


@dataclass(frozen=True, kw_only=True)
class OptimConfig(TrainSection):
    """The optimizer and its settings, and gradient clipping."""

    optimizer: str = "adamw"
    """adamw, or muon on the blocks' matrices.

    muon: Muon (torch.optim.Muon's update) on the 2-D weights inside the transformer blocks and AdamW (lr,
    betas, eps, weight_decay above) on embeddings, the tied LM head, biases and LayerNorm (gpt2/train/optim.py
    says why). Every group follows the same warmup and cosine schedule."""
    weight_decay: float = 0.1
    """AdamW weight decay, on 2-D weights only.

    Not on biases and LayerNorm."""
    beta1: float = 0.9
    """AdamW beta1 (momentum)."""
    beta2: float = 0.95
    """AdamW beta2.

    GPT-3 used 0.95: steadier than 0.999 on large batches."""
    eps: float = 1e-8
    """AdamW epsilon."""
    fused_adamw: bool = True
    """Use the fused AdamW kernel.

    One kernel per step; on CUDA, and on a CPU since torch 2.4."""
    muon_lr: float = 0.02
    """Muon's peak learning rate.

    Scaled by sqrt(max(1, out/in)) per matrix (Keller Jordan's rule as in torch's adjust_lr_fn="original"); it
    decays with the schedule like lr. 0.02 was the best of 0.01/0.02/0.04 in bench/optimizers.py's small shape
    and 0.01 in its medium one, each within 0.03 of the other (bench/README.md, "AdamW against Muon"); 0.02 is
    also Keller Jordan's default."""
    muon_momentum: float = 0.95
    """Muon's (Nesterov) momentum."""
    muon_ortho: str = "newton_schulz"
    """Muon's orthogonaliser.

    newton_schulz (torch.optim.Muon's quintic, 5 times) or polar_express: 5 quintics of their own (Amsel et al.
    2025, modded-nanogpt's record of 2025-09-29), the same FLOPs, singular values closer to 1 (gpt2/train/muon.py)."""
    muon_momentum_warmup: int = 0
    """Steps of Muon's momentum warmup (0: none).

    Linear from --muon-momentum-start at step 0 to --muon-momentum at this step (gpt2/core/schedule.py
    momentum_at); 0: --muon-momentum from the first step. modded-nanogpt's record of 2024-11-06 rises from 0.85
    to 0.95 over 500 steps."""
    muon_momentum_start: float = 0.85
    """Muon's momentum at step 0 of its warmup."""
    muon_weight_decay: float = 0.0
    """Muon's decoupled weight decay.

    p *= 1 - muon_lr * muon_weight_decay each step."""
    cautious_wd: bool = False
    """Decay only where Muon shrinks the weight.

    Cautious weight decay (Chen et al. 2025, arXiv 2510.12402; modded-nanogpt's record of 2025-11-10): the
    decay of --muon-weight-decay applies to the entries whose update has the weight's sign, and leaves the
    others alone. Needs --muon-weight-decay > 0 to do anything."""
    embed_lr: float | None = None
    """The embeddings' peak lr.

    None: --lr's. The token, position and value embeddings in AdamW groups of their own, on the same schedule (a
    share of lr each step, as Muon's groups are): modded-nanogpt's records train them far faster than the rest (0.3
    against the head's 0.002 at GPT-2 size, its record of 2024-11-03). Tied to the head, the one matrix
    takes embed_lr."""
    head_lr: float | None = None
    """An untied head's peak lr.

    None: --lr's. Needs --tie-embeddings false (tied, the head is the token embedding: --embed-lr)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: off).

    0 disables clipping; the norm is still logged."""

    def problems(self) -> list[str]:
        p = []
        if self.optimizer not in OPTIMIZERS:
            p.append(f"optimizer={self.optimizer!r} must be one of {OPTIMIZERS}")
        if self.muon_lr <= 0 or not 0 <= self.muon_momentum < 1 or self.muon_weight_decay < 0:
            p.append(
                f"muon_lr={self.muon_lr} must be > 0, muon_momentum={self.muon_momentum} in [0, 1) and "
                f"muon_weight_decay={self.muon_weight_decay} >= 0"
            )
        if self.muon_ortho not in MUON_ORTHOS:
            p.append(f"muon_ortho={self.muon_ortho!r} must be one of {MUON_ORTHOS}")
        if self.cautious_wd and self.optimizer != "muon":
            p.append("cautious_wd=True gates Muon's weight decay: add --optimizer muon, or drop --cautious-wd")
        if self.muon_momentum_warmup < 0 or not 0 <= self.muon_momentum_start < 1:
            p.append(
                f"muon_momentum_warmup={self.muon_momentum_warmup} must be >= 0 steps and "
                f"muon_momentum_start={self.muon_momentum_start} in [0, 1)"
            )
        for name in ("embed_lr", "head_lr"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                p.append(f"{name}={getattr(self, name)} must be > 0, or none for --lr's")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.eps <= 0:
            p.append("weight_decay and grad_clip must be >= 0 and eps > 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            p.append(f"beta1={self.beta1}, beta2={self.beta2} must be in [0, 1)")
        return p


@dataclass(frozen=True, kw_only=True)
class SpikeConfig(TrainSection):
    """Steps skipped, rolled back or stopped on: non-finite steps and loss spikes."""

    max_bad_steps: int = 3
    """Non-finite steps in a row (skipped) before a stop.

    Consecutive non-finite losses/gradient norms (each update skipped) before the run stops."""
    spike_guard: bool = True
    """Skip loss spikes; roll back after repeated ones.

    A step whose loss or gradient norm is far above the last --spike-window steps' (a z-score of their
    logs, on the device) has its update skipped; --spike-rollback-after such spikes within the window
    roll the run back to the newest checkpoint from before them, the data going on past them
    (docs/spike_guard.md). Costs a few tiny kernels per step; no host read."""
    spike_window: int = 100
    """Steps of history a spike is judged against.

    The guard judges from the step after its history holds this many healthy steps."""
    spike_loss_z: float = 6.0
    """z-score of the log loss that is a spike."""
    spike_norm_z: float = 6.0
    """z-score of the log grad norm that is a spike.

    A gradient-norm spike counts only with the loss's z-score above half of --spike-loss-z: the norm
    alone jumps in healthy early training."""
    spike_rollback_after: int = 3
    """Spikes within the window that roll back.

    That many spikes within the last --spike-window steps roll the run back to the newest checkpoint from
    before the first of them."""
    spike_max_rollbacks: int = 3
    """Rollbacks before the run stops with an error.

    Spikes that come back after this many rollbacks are not the data's alone: the run stops with one line."""

    def problems(self) -> list[str]:
        p = _at_least(self, 1, "max_bad_steps", "spike_rollback_after", "spike_max_rollbacks")
        if self.spike_window < 8:  # a standard deviation of fewer steps is noise itself
            p.append(f"spike_window={self.spike_window} must be >= 8")
        if not (self.spike_loss_z > 0 and self.spike_norm_z > 0):
            p.append(f"spike_loss_z={self.spike_loss_z} and spike_norm_z={self.spike_norm_z} must be > 0")
        return p


@dataclass(frozen=True, kw_only=True)
class ComputeConfig(TrainSection):
    """The device, precision, compilation and the memory choices."""

    device: str = "auto"
    """auto (CUDA if present, else CPU), cpu or cuda.

    Each rank uses cuda:LOCAL_RANK."""
    dtype: str = "auto"
    """Matmul dtype: auto, bfloat16, float16, float32.

    The autocast dtype: bfloat16, float16 (with a loss scaler) or float32 (no autocast). auto picks bf16 on
    GPUs with native bf16, fp16 on older GPUs, and on a CPU bf16 only where it measures faster than fp32
    (gpt2/plan/precision_choice.py says why). Weights and optimizer stay fp32."""
    tf32: bool = True
    """Allow TF32 matmuls on CUDA.

    No effect on a CPU."""
    compile: bool = True
    """torch.compile the model.

    With inductor, on CUDA and on a CPU."""
    compile_scope: str = "model"
    """What torch.compile compiles: model or blocks.

    model: the whole model as one region (torch.compile(model)); blocks: each transformer block alone and the
    final LayerNorm, LM head and loss as one more region (what --parallel fsdp always does), the embedding
    lookups between them eager: less compile time (docs/training.md measured 2.3-2.8x less on a CPU), the
    same losses. Sampling and HellaSwag then run the compiled blocks (a recompile per generated length).
    No effect without --compile."""
    autotune: bool = False
    """GEMM autotuning in the compiled regions.

    With --compile-scope blocks the transformer blocks only (the head and loss as without it); with model, the
    whole model (inductor's max_autotune_gemm). Each matmul shape is timed against Triton's candidate kernels
    at the first compile: minutes more compile time, for what docs/performance.md measured (no gain at 124M on
    an H200). No effect without --compile."""
    compile_cache: str = "auto"
    """torch.compile's cache: auto, off or a directory.

    auto: out_dir/compile-cache (a requeued or resumed run loads what the last start compiled instead of
    compiling again), or $TORCHINDUCTOR_CACHE_DIR where the environment sets it; a directory: shared by the
    runs that name it. A subdirectory per torch release, Python, Triton and device kind; a corrupt or
    foreign cache is cleared with one warning (gpt2/train/compile_cache.py, docs/performance.md)."""
    deterministic: bool = False
    """Bitwise-repeatable runs (slower).

    Deterministic algorithms (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG, inductor's
    deterministic mode; gpt2/core/determinism.py): two runs of one config on one machine give the same losses
    bit for bit, on a GPU too. Slower (deterministic attention and embedding backward): docs/training.md,
    "Deterministic runs"."""
    loss_impl: str = "auto"
    """LM-head loss: full, chunked or auto.

    full (F.cross_entropy over the (B, T, V) logits, the fastest compiled), chunked (gpt2/model/loss.py: never
    all the logits at once) or auto: full when the model is compiled, the planner's peak of the full-logits
    loss is at most 1/8 of the device's usable memory and the whole plan with it still fits, else chunked
    (gpt2/plan/ choose_loss_impl; logged with its reason). Both give the same loss and gradients to float
    rounding."""
    fp8_head: bool = False
    """The LM head's matmuls in FP8 (training only).

    torch._scaled_mm with one dynamic scale per tensor (gpt2/model/fp8.py): twice the BF16 rate on an
    H100/H200 for the largest matmul of a small model. Takes the full-logits loss; evaluation, sampling and
    export keep the exact head. Needs FP8 tensor cores (compute capability 8.9+) or, on a CPU, a torch with
    _scaled_mm there (slow: for tests). docs/performance.md has its A/B."""
    activation_checkpointing: str = "auto"
    """Recompute blocks: none, full or auto.

    none, full (every transformer block saves only its input and recomputes its forward in the backward: most
    of the activation memory for about a third more block FLOPs, which MFU does not count) or auto: full only
    where the run does not fit without it (no micro-batch fits, or the explicit --micro-batch-size's plan does
    not) and does with it, else none (gpt2/plan/ choose_activation_checkpointing; logged with its reason). A
    run-time choice: losses and gradients are the same, and checkpoints resume either way."""
    num_threads: int = 0
    """CPU threads per rank (0: cores / local ranks).

    Threads for intra-op parallelism; 0 shares this node's cores among its ranks."""
    pin_memory: bool = True
    """Pinned host buffers on CUDA.

    Pinned host buffers and non-blocking copies on CUDA; no effect on a CPU."""

    def problems(self) -> list[str]:
        from gpt2.core.precision import DTYPES  # here, not at the top: data_prep imports this module without torch

        p = _at_least(self, 0, "num_threads")
        if self.device not in DEVICES:
            p.append(f"device={self.device!r} must be one of {DEVICES}")
        if self.dtype not in DTYPES:
            p.append(f"dtype={self.dtype!r} must be one of {DTYPES}")
        if not self.compile_cache.strip():
            p.append("compile_cache='' must be auto, off or a directory")
        if self.compile_scope not in COMPILE_SCOPES:
            p.append(f"compile_scope={self.compile_scope!r} must be one of {COMPILE_SCOPES}")
        if self.loss_impl not in LOSS_IMPLS:
            p.append(f"loss_impl={self.loss_impl!r} must be one of {LOSS_IMPLS}")
        if self.fp8_head and self.loss_impl == "chunked":
            p.append("fp8_head=True computes the full logits: use --loss-impl full or auto with --fp8-head")
        if self.fp8_head and self.dtype == "float16":
            p.append("fp8_head=True with dtype=float16: the loss scaler's range and FP8's do not mix; use bfloat16")
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            p.append(
                f"activation_checkpointing={self.activation_checkpointing!r} must be one of {ACTIVATION_CHECKPOINTING}"
            )
        return p


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig(TrainSection):
    """The run directory, its checkpoints and how a run starts."""

    out_dir: str = ""
    """Run directory: checkpoints, metrics, logs.

    It holds metrics.jsonl, train.log, config.json, checkpoints/ and the loss curve."""
    ckpt_interval: int = 1000
    """Steps between checkpoints (0: the final only).

    One is always written at the end; 0 writes only that one."""
    keep_checkpoints: int = 3
    """How many recent checkpoints to keep."""
    async_ckpt: bool = True
    """Write periodic checkpoints in the background.

    Training stalls only while rank 0 copies the state to host memory (which then holds a second copy of it
    until the write ends). The final checkpoint and a signal stop's are always written before the run ends."""
    resume: str = "auto"
    """auto (the newest checkpoint), never, or a path.

    auto: the newest valid checkpoint in out_dir, else a fresh start; or a checkpoint path."""
    init_from: str = ""
    """Start a new run from trained weights.

    Step, optimizer, schedule, data position and run id start fresh. The weights: a Hugging Face GPT-2
    directory (`python -m gpt2.export`'s, or OpenAI's save_pretrained layout), a hub name (gpt2, gpt2-medium,
    gpt2-large, gpt2-xl; needs the network and huggingface_hub), or one of our checkpoints (step_*.pt, a
    sharded step_*/ directory, a run directory: its newest checkpoint). The model shape comes from the
    weights. A run directory holding this run's own checkpoint resumes it instead (--resume auto: a requeue
    with the same command continues; gpt2/train/init_from.py)."""

    def problems(self) -> list[str]:
        p = _at_least(self, 1, "keep_checkpoints") + _at_least(self, 0, "ckpt_interval")
        if self.resume in ("", None):
            p.append("resume must be auto, never, or a checkpoint path")
        if self.init_from and self.resume not in ("auto", "never"):
            p.append(
                f"init_from={self.init_from!r} starts a new run from weights and resume={self.resume!r} continues "
                "a run: pass one of them (a requeued --init-from run resumes its own checkpoint with --resume auto)"
            )
        return p


@dataclass(frozen=True, kw_only=True)
class EvalConfig(TrainSection):
    """Validation loss, HellaSwag and text samples during training."""

    eval_interval: int = 250
    """Steps between val evaluations (0: the end only).

    Validation-loss evaluations; 0 disables them except at the end."""
    eval_tokens: int = 10_485_760
    """Validation tokens per evaluation.

    The first eval_tokens of the val shards, the same on every run."""
    hellaswag_interval: int = 0
    """Steps between HellaSwag evaluations (0: none).

    And one at the end. Needs hellaswag_file."""
    hellaswag_file: str = ""
    """HellaSwag jsonl (downloaded there if missing).

    Rows of ctx, endings, label; rank 0 downloads the validation set there if it is missing."""
    sample_interval: int = 1000
    """Steps between text samples (0: none).

    Rank 0 prints them."""
    sample_tokens: int = 32
    """Tokens generated per sample."""
    sample_prompt: str = ""
    """Prompt for samples (none: <|endoftext|>)."""

    def problems(self) -> list[str]:
        p = _at_least(self, 1, "sample_tokens")
        p += _at_least(self, 0, "eval_interval", "eval_tokens", "sample_interval", "hellaswag_interval")
        if self.hellaswag_interval and not self.hellaswag_file:
            p.append("hellaswag_interval needs hellaswag_file: a HellaSwag jsonl path (downloaded there if missing)")
        return p


@dataclass(frozen=True, kw_only=True)
class LogConfig(TrainSection):
    """What the run writes about itself and where."""

    log_interval: int = 1
    """Steps between log lines and metrics.jsonl records."""
    verbose: bool = False
    """The whole start-up plan on the console too.

    The data check, loss path, peak, memory term by term, stop budget, network and epochs; without it the
    console gets a few lines and out_dir/train.log every line."""
    plot: bool = True
    """Write loss_curve.png at the end (matplotlib).

    In out_dir; needs matplotlib."""
    tensorboard: bool = False
    """Also log to TensorBoard in out_dir/tb.

    Needs tensorboard."""
    wandb_project: str = ""
    """Also log to this Weights & Biases project.

    Needs wandb."""

    def problems(self) -> list[str]:
        return _at_least(self, 1, "log_interval")


@dataclass(frozen=True, kw_only=True)
class DistributedConfig(TrainSection):
    """How ranks share the model and how long they wait for each other."""

    parallel: str = "ddp"
    """How the ranks share the model: ddp or fsdp.

    ddp (every rank holds all weights, gradients and optimizer state; gradients all-reduced) or fsdp
    (PyTorch's FSDP2 `fully_shard` on each block and the root: each rank holds 1/world_size of them and
    gathers a block's weights only while computing it; gpt2/distributed/fsdp.py). fsdp is for models whose
    state does not fit one device under DDP (`python -m gpt2.plan` says)."""
    ddp_bucket_cap_mb: float = 25.0
    """DDP's gradient bucket size in MiB.

    DDP's own default is 25. Each bucket's all-reduce starts as soon as backward has produced its gradients,
    also when compiled (one backward graph per bucket); the start-up bandwidth test times one bucket. At least
    1: torch.compile's first graph split is 1 MiB."""
    dist_timeout_s: float = 600.0
    """Collective timeout in the slow phases (s).

    The slow phases: start-up (process group, resume, the first step and its compilation) and every
    checkpoint, evaluation and sample plus the step after it. A dead peer raises an error (gloo) or aborts the
    process (NCCL) instead of hanging."""
    dist_step_timeout_s: float = 300.0
    """Collective timeout in steady training (s).

    Set after the first step: a peer that died or hangs mid-run is found this fast. It bounds how far ranks
    may drift apart within one step."""
    gc_interval: int = 50
    """Steps between Python GC runs (0: its own).

    After start-up the collector is frozen and turned off, and every rank collects at the same step
    every gc_interval steps (torchtitan's gc_freq): no rank pauses for a collection while the others
    wait for it at the next all-reduce (gpt2/train/gc_steps.py; docs/performance.md has the measurement)."""

    def problems(self) -> list[str]:
        p = []
        if self.parallel not in PARALLELS:
            p.append(f"parallel={self.parallel!r} must be one of {PARALLELS}")
        if not self.ddp_bucket_cap_mb >= 1:
            p.append(
                f"ddp_bucket_cap_mb={self.ddp_bucket_cap_mb} must be >= 1 (MiB): torch.compile splits the "
                "backward at DDP's buckets and its first split is 1 MiB"
            )
        if self.gc_interval < 0:
            p.append(f"gc_interval={self.gc_interval} must be >= 0 (0: Python's own garbage collection)")
        for name in ("dist_timeout_s", "dist_step_timeout_s"):
            if getattr(self, name) <= 0:
                p.append(f"{name}={getattr(self, name)} must be > 0")
        return p


TRAIN_SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "batch": BatchConfig,
    "schedule": ScheduleConfig,
    "optim": OptimConfig,
    "spike": SpikeConfig,
    "compute": ComputeConfig,
    "ckpt": CheckpointConfig,
    "eval": EvalConfig,
    "log": LogConfig,
    "distributed": DistributedConfig,
}
"""TrainConfig's sections by attribute, in --help's order: each is a heading of --help and may be a table of a
--config file ([optim] lr = 3e-4), and each validates itself; TrainConfig checks what spans two of them."""

SECTION_OF: dict[str, str] = {f.name: s for s, c in TRAIN_SECTIONS.items() for f in dataclasses.fields(c)}
"""Each training field (a flag's name: lr, parallel, ...) -> its section. The names are unique across sections,
so a flag, a preset entry or a flat config file names a field without its section."""


def _by_section(values: dict) -> dict[str, dict]:
    """Flat training fields (as flags name them) grouped by their section; TypeError naming unknown ones."""
    unknown = sorted(set(values) - set(SECTION_OF))
    if unknown:
        raise TypeError(f"unknown training fields {unknown}; see train_ddp.py --help")
    per_section: dict[str, dict] = {}
    for name, value in values.items():
        per_section.setdefault(SECTION_OF[name], {})[name] = value
    return per_section


def _sections(per_section: dict[str, dict], make) -> dict:
    """make(section, its values) for each section, every section's problems in one ValueError at once."""
    built, problems = {}, []
    for s, values in per_section.items():
        try:
            built[s] = make(s, values)
        except ValueError as e:
            if not str(e).startswith(INVALID_TRAINING):
                raise  # a non-finite number: its own one line
            problems += str(e).removeprefix(INVALID_TRAINING).split("\n  - ")
    if problems:
        raise ValueError(INVALID_TRAINING + "\n  - ".join(problems))
    return built


def _at_least(section, low: int, *names: str) -> list[str]:
    return [f"{n}={getattr(section, n)} must be >= {low}" for n in names if getattr(section, n) < low]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How to train: one section per --help heading, each a frozen dataclass that validates itself.

    Parts take the section they need (SpikeGuard(tc.spike), make_optimizer(..., tc.optim, ...)). The flag
    vocabulary is flat (--lr, --parallel): TrainConfig.of(**flags) and replace(**flags) place each name in its
    section (SECTION_OF), and a config written flat by an older version (config.json, a checkpoint, a --config
    file) loads through from_dict."""

    data: DataConfig = field(default_factory=DataConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __post_init__(self) -> None:
        for name, cls in TRAIN_SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"TrainConfig.{name} must be a {cls.__name__}, got {getattr(self, name)!r}")
        problems = cross_section_problems(self)
        if problems:
            raise ValueError(INVALID_TRAINING + "\n  - ".join(problems))

    @classmethod
    def of(cls, **values) -> TrainConfig:
        """From flat field names (as flags and presets give them), every problem of every section at once."""
        per_section = _by_section(values)
        every = {s: per_section.get(s, {}) for s in TRAIN_SECTIONS}
        return cls(**_sections(every, lambda s, v: TRAIN_SECTIONS[s](**v)))

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        """A TrainConfig from to_dict()'s sections or a flat dict (what versions before the sections wrote)."""
        return cls.of(**train_values(data))

    def replace(self, **changes) -> TrainConfig:
        """A new validated config with these fields (flat names, as flags) changed: each section they are in is
        replaced and checks itself, the others are kept as they are (valid already), then the checks across
        sections run. The planner changes one or two fields of thousands of candidates: no whole-config rebuild."""
        changed = _sections(_by_section(changes), lambda s, v: dataclasses.replace(getattr(self, s), **v))
        return dataclasses.replace(self, **changed)

    def flat(self) -> dict:
        """Every field by its flag's name, in --help's order."""
        return {
            f.name: getattr(getattr(self, s), f.name)
            for s in TRAIN_SECTIONS
            for f in dataclasses.fields(getattr(self, s))
        }

    def to_dict(self) -> dict:
        return {s: dataclasses.asdict(getattr(self, s)) for s in TRAIN_SECTIONS}


def train_values(data: dict) -> dict:
    """The flat {field: value} of a saved training config, sectioned (to_dict) or flat (before the sections);
    unvalidated, so a record with fields this version no longer has can still be compared."""
    flat = {}
    for key, value in data.items():
        if key in TRAIN_SECTIONS and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def weight_changes(tc: TrainConfig) -> list[tuple[int, tuple[float, ...]]]:
    """The mixture's weights by step: [(0, --data-weights), (STEP, weights), ...] normalised, N% resolved
    against --max-steps (rounded down), in step order. One source: [(0, (1.0,))]."""
    data = tc.data
    changes = [(0, data.weights)]
    if len(data.dirs) < 2:
        return changes
    for when, weights in schedule_entries(data.data_weight_schedule, len(data.dirs)):
        step = int(float(when[:-1]) * tc.schedule.max_steps // 100) if when.endswith("%") else int(when)
        changes.append((step, normalised(weights)))
    return changes


def cross_section_problems(tc: TrainConfig) -> list[str]:
    """What no one section can see: settings of two sections that cannot go together."""
    p = []
    if tc.data.data_weight_schedule:
        steps = [s for s, _ in weight_changes(tc)[1:]]
        if steps != sorted(set(steps)):
            p.append(
                f"data_weight_schedule={tc.data.data_weight_schedule!r} takes effect at steps {steps} (with "
                f"max_steps={tc.schedule.max_steps}): give its entries in increasing step order, one per step"
            )
    if tc.compute.fp8_head and tc.distributed.parallel == "fsdp":
        p.append("fp8_head=True with parallel=fsdp is not supported (the head's weight is sharded); use ddp")
    return p + fsdp_problems(tc)


def fsdp_problems(tc: TrainConfig) -> list[str]:
    """What --parallel fsdp cannot train (refused at any world size, so a config that starts on one
    process does not fail later on eight)."""
    if tc.distributed.parallel != "fsdp":
        return []
    p = []
    if tc.compute.dtype == "float16":
        # fp16 needs a loss scaler whose inf/NaN check sees every rank's shard of the gradients;
        # torch's GradScaler checks only this rank's, so ranks could disagree on skipping a step.
        p.append(
            "dtype=float16 is not supported with parallel=fsdp (the loss scaler would check only "
            "this rank's gradient shards): use --dtype bfloat16 (or float32), or --parallel ddp for fp16"
        )
    return p


def tied_head_lr_problem(tie_embeddings: bool, optim: OptimConfig) -> str | None:
    """--head-lr asks for the head's own AdamW group, which a tied head cannot have (it is the token
    embedding); checked with the flags (gpt2/train/cli.py) and where the groups are made (gpt2/train/optim.py)."""
    if optim.head_lr is None or not tie_embeddings:
        return None
    return (
        f"--head-lr {optim.head_lr:g} needs an untied LM head (--tie-embeddings false): tied, the head is the "
        "token embedding, whose rate --embed-lr sets"
    )


@dataclass(frozen=True)
class RunConfig:
    """Everything a training run needs: the model and how to train it."""

    model: ModelConfig
    train: TrainConfig

    def to_dict(self) -> dict:
        return {"model": dataclasses.asdict(self.model), "train": self.train.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> RunConfig:
        """to_dict()'s inverse; also reads the flat training configs written before the sections."""
        return cls(ModelConfig(**data["model"]), TrainConfig.from_dict(data["train"]))


SPEED_RECIPE = dict(
    micro_batch_size=16,
    total_batch_size=1024,
    optimizer="muon",
    lr=4e-3,
    min_lr=4e-4,
    warmup_steps=5,
    max_steps=200,
    dtype="float32",
    compile=False,
    eval_interval=25,
    eval_tokens=8192,
    sample_interval=50,
    log_interval=10,
    ckpt_interval=50,
)
"""--preset speed's training settings (the comment at TRAIN_PRESETS["speed"]); --preset speedrun starts from them."""

# Training presets: model shape plus the training recipe that goes with it. The GPU presets' micro-batch
# is "auto": the largest the planner (gpt2/plan/) says fits the device and divides the global batch at
# the run's world size. A fixed number cannot be right everywhere: 64 x 1024 x W divides 524,288 only
# for W <= 8, and 64 sequences of gpt2 do not fit a 24 GB or 40 GB card. `python -m gpt2.plan --preset X`
# reads the same table, so the planner and the trainer plan the same run.
TRAIN_PRESETS: dict[str, dict] = {
    # GPT-2 124M: 524,288 tokens/step (on 8 A100-80GB: 64 x 1024 x 8 ranks, no accumulation), 10B
    # tokens, max lr 6e-4 with 715 warmup steps and cosine decay to 10%.
    "gpt2": dict(
        micro_batch_size="auto", total_batch_size=524_288, max_steps=19_073, lr=6e-4, min_lr=6e-5, warmup_steps=715
    ),
    "gpt2-medium": dict(
        micro_batch_size="auto", total_batch_size=524_288, max_steps=19_073, lr=3e-4, min_lr=3e-5, warmup_steps=715
    ),
    "gpt2-large": dict(
        micro_batch_size="auto", total_batch_size=524_288, max_steps=19_073, lr=2.5e-4, min_lr=2.5e-5, warmup_steps=715
    ),
    "gpt2-xl": dict(
        micro_batch_size="auto", total_batch_size=524_288, max_steps=19_073, lr=2e-4, min_lr=2e-5, warmup_steps=715
    ),
    # Trains in minutes on 2 CPU cores: 8 x 128 tokens per rank, 2,048 tokens per step.
    "debug": dict(
        micro_batch_size=8,
        total_batch_size=2048,
        max_steps=150,
        lr=1e-3,
        min_lr=1e-4,
        warmup_steps=20,
        eval_interval=50,
        eval_tokens=8192,
        sample_interval=100,
        log_interval=10,
        ckpt_interval=50,
        compile=False,
    ),
    # nanoGPT's small Shakespeare model and batch (16 x 64 tokens), with a recipe made to reach nanoGPT's
    # 200-step val loss sooner: Muon on the block matrices, AdamW's part at 4e-3, a 5-step warmup, the
    # recipe's cosine to step 200. `python bench/time_to_loss.py` adds them one at a time (its ablation;
    # docs/performance.md says how far each got); a 100-step horizon and warmup-stable-
    # decay (--decay-steps) were tried on top and left out: no fewer steps to the target.
    "speed": SPEED_RECIPE,
    # The speed recipe on the speedrun architecture, its learning rates and warmup re-tuned (bench/time_to_loss.py's
    # modern ablation): AdamW's part (embeddings, the untied head) at 8e-3, Muon at 0.01, a 2-step warmup; the
    # cosine to step 200 kept (a 40- or 50-step horizon gave no fewer steps to the target).
    "speedrun": {**SPEED_RECIPE, "lr": 8e-3, "min_lr": 8e-4, "muon_lr": 0.01, "warmup_steps": 2},
    # modded-nanogpt's record of 2024-11-03 (UntieEmbed: 3.2762 val loss on FineWeb at step 4,578, its log in
    # docs/modern.md), with the next record's Muon momentum warmup: 524,288 tokens a step, Adam (0.9, 0.95) on the
    # token embedding at 0.3 and the untied head at 0.002, Muon at 0.02 with momentum 0.95, no weight decay, no
    # warmup, constant, then linear to 0 over the last 1,308 steps; no clipping (the record has none). lr is
    # AdamW's rate for any other parameter (this architecture has none: no biases, rms_norm without weights).
    "gpt2-speedrun": dict(
        micro_batch_size="auto",
        total_batch_size=524_288,
        max_steps=4578,
        lr=0.02,
        min_lr=0.0,
        warmup_steps=0,
        decay_steps=1308,
        optimizer="muon",
        muon_lr=0.02,
        muon_momentum=0.95,
        muon_momentum_warmup=500,
        muon_momentum_start=0.85,
        embed_lr=0.3,
        head_lr=0.002,
        weight_decay=0.0,
        grad_clip=0.0,
        eval_interval=125,
    ),
    # Fine-tuning trained weights on a small corpus (needs --init-from; the shape comes from the weights):
    # nanoGPT's finetune_shakespeare.py recipe (lr 3e-5, few steps, frequent evaluation) with a short warmup
    # and warmup-stable-decay: 3e-5 held, then linear to 3e-6 over the last 20 steps. 32,768 tokens per
    # step (32 x 1024, nanoGPT's 1 x 32 accumulation). docs/finetune.md runs it.
    "finetune": dict(
        micro_batch_size="auto",
        total_batch_size=32_768,
        max_steps=100,
        lr=3e-5,
        min_lr=3e-6,
        warmup_steps=5,
        decay_steps=20,
        eval_interval=10,
        eval_tokens=1_048_576,
        sample_interval=50,
        log_interval=1,
        ckpt_interval=50,
        keep_checkpoints=2,
    ),
}


TRAIN_ONLY_PRESETS = ("finetune",)
"""Presets of TRAIN_PRESETS with no MODEL_PRESETS shape: the shape comes from --init-from's weights."""


def describe_model(cfg: ModelConfig) -> str:
    """The preset a shape is (e.g. 'gpt2-xl'), else its shape fields: how errors name the model."""
    for name, shape in MODEL_PRESETS.items():
        if ModelConfig(**shape) == cfg:
            return name
    return f"the model n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} block_size={cfg.block_size}"
