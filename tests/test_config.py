import dataclasses

import pytest
import torch

from gpt2.core.config import (
    ARCHS,
    GPT2_VOCAB_SIZE,
    MODEL_PRESETS,
    PADDED_VOCAB_SIZE,
    ModelConfig,
    count_params_formula,
    model_preset,
    param_count,
    weight_shapes,
)
from gpt2.model.gpt import GPT

# ---- ModelConfig ----

# Parameter counts Hugging Face reports for the four OpenAI releases (vocab 50,257).
HF_PARAM_COUNTS = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200}


@pytest.mark.parametrize("name", sorted(HF_PARAM_COUNTS))
def test_preset_param_counts_match_hugging_face(name):
    cfg = model_preset(name, vocab_size=GPT2_VOCAB_SIZE)
    assert count_params_formula(cfg) == HF_PARAM_COUNTS[name]
    with torch.device("meta"):
        assert sum(p.numel() for p in GPT(cfg).parameters()) == param_count(cfg) == HF_PARAM_COUNTS[name]


def test_presets_default_to_padded_vocab_and_mha():
    for name in MODEL_PRESETS:
        cfg = model_preset(name)
        assert cfg.vocab_size == PADDED_VOCAB_SIZE == 50304 and PADDED_VOCAB_SIZE % 128 == 0
        assert (
            cfg.n_kv_head == cfg.n_head
            and cfg.bias == (name not in ("speedrun", "gpt2-speedrun"))
            and cfg.attn_impl == "sdpa"
        )
        assert cfg.head_dim * cfg.n_head == cfg.n_embd


def test_debug_preset_is_tiny():
    assert count_params_formula(model_preset("debug")) < 8_000_000


def test_preset_overrides_and_unknown_preset():
    assert model_preset("gpt2", n_kv_head=4).n_kv_head == 4
    with pytest.raises(ValueError, match="unknown preset 'gpt3'.*gpt2-medium"):
        model_preset("gpt3")


def test_config_is_frozen_and_replace_validates():
    cfg = ModelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_layer = 3
    assert cfg.replace(n_layer=3).n_layer == 3 and cfg.n_layer == 12
    with pytest.raises(ValueError, match="n_head=5"):
        cfg.replace(n_head=5)
    with pytest.raises(TypeError):
        ModelConfig(12)  # keyword-only: positional shapes are too easy to get in the wrong order


def test_to_dict_round_trips():
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=16)
    assert ModelConfig(**cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(n_embd=100, n_head=12), "n_embd=100 is not divisible by n_head=12; choose n_head among"),
        (dict(n_head=12, n_kv_head=5), "n_head=12 is not divisible by n_kv_head=5"),
        (dict(vocab_size=50000), "vocab_size=50000 is smaller than the GPT-2 tokenizer's 50257"),
        (dict(dropout=1.0), r"dropout=1.0 must be in \[0, 1\)"),
        (dict(dropout=-0.1), r"dropout=-0.1 must be in \[0, 1\)"),
        (dict(attn_impl="flash"), "attn_impl='flash' must be one of"),
        (dict(n_layer=0), "n_layer=0 must be a positive integer"),
        (dict(block_size=-1), "block_size=-1 must be a positive integer"),
        (dict(n_embd=768.0), "n_embd=768.0 must be a positive integer"),
        (dict(n_head=True), "n_head=True must be a positive integer"),
        (dict(mlp_act="swiglu"), "mlp_act='swiglu' must be one of"),
        (dict(norm="batchnorm"), "norm='batchnorm' must be one of"),
        (dict(rope=True, n_embd=36, n_head=4), "rope=True needs an even head_dim; n_embd=36 / n_head=4 is 9"),
        (dict(rope_base=1.0), "rope_base=1.0 must be > 1"),
        (dict(logit_softcap=0.0), "logit_softcap=0.0 must be > 0, or none for no cap"),
    ],
)
def test_invalid_model_config_is_refused_with_the_fix(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ValueError) as err:
        ModelConfig(n_embd=100, n_head=12, vocab_size=100, dropout=2.0, attn_impl="x")
    text = str(err.value)
    for fragment in ("n_embd=100", "vocab_size=100", "dropout=2.0", "attn_impl='x'"):
        assert fragment in text


def test_mqa_and_gqa_shapes_are_accepted():
    assert ModelConfig(n_head=12, n_kv_head=1).n_kv_head == 1
    assert ModelConfig(n_head=12, n_kv_head=4).n_kv_head == 4
    assert ModelConfig(vocab_size=GPT2_VOCAB_SIZE).vocab_size == GPT2_VOCAB_SIZE


def test_ddp_bucket_cap_below_one_mib_is_refused_with_the_reason():
    from gpt2.core.config import TrainConfig

    assert TrainConfig.of(ddp_bucket_cap_mb=1).distributed.ddp_bucket_cap_mb == 1
    with pytest.raises(ValueError, match=r"ddp_bucket_cap_mb=0.5 must be >= 1 \(MiB\): torch.compile splits"):
        TrainConfig.of(ddp_bucket_cap_mb=0.5)


def test_loss_impl_is_validated_and_defaults_to_auto():
    from gpt2.core.config import TrainConfig

    assert TrainConfig().compute.loss_impl == "auto"
    assert TrainConfig.of(loss_impl="full").compute.loss_impl == "full"
    with pytest.raises(ValueError, match=r"loss_impl='fused' must be one of \('auto', 'chunked', 'full'\)"):
        TrainConfig.of(loss_impl="fused")


# ---- the one parameter counter and the weights it counts ----

SHAPES = {
    "mha": {},
    "gqa": dict(n_kv_head=2),
    "mqa": dict(n_kv_head=1),
    "no_bias": dict(bias=False),
    "gqa_no_bias_unpadded": dict(n_kv_head=2, bias=False, vocab_size=GPT2_VOCAB_SIZE),
    "rope": dict(rope=True),
    "untied": dict(tie_embeddings=False),
    "rmsnorm": dict(norm="rmsnorm"),
    "modern": dict(ARCHS["modern"], n_kv_head=2),
    "value_unet": dict(ARCHS["modern"], n_kv_head=2, value_embeds=1, unet_skips=True),
}


@pytest.mark.parametrize("layout", sorted(SHAPES))
def test_weight_shapes_and_param_count_are_the_modules(layout):
    """config.weight_shapes lists GPT(cfg)'s parameters, names, order and shapes; param_count (also what
    GPT.num_params returns) is their size, for every head layout and with or without biases."""
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, **SHAPES[layout])
    model = GPT(cfg)
    params = dict(model.named_parameters())  # the tied LM head once, as the embedding
    assert weight_shapes(cfg) == {name: tuple(p.shape) for name, p in params.items()}
    assert list(weight_shapes(cfg)) == list(params)
    assert param_count(cfg) == sum(p.numel() for p in params.values()) == model.num_params()
    assert param_count(cfg, include_position=False) == param_count(cfg) - (not cfg.rope) * cfg.block_size * cfg.n_embd
    assert (count_params_formula(cfg) == param_count(cfg)) == (layout == "mha")  # the closed form: MHA with biases


def test_param_count_of_each_option_against_gpt2s():
    """What each option adds or takes away, in closed form: rope no (T, h) position table, an untied head
    V*h, rmsnorm no norm parameters (2 per block and the final one, h weights and h biases each)."""
    cfg = ModelConfig(n_layer=3, n_head=4, n_embd=32, block_size=16)
    V, T, L, h, n = cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_embd, param_count(cfg)
    assert param_count(cfg.replace(rope=True)) == n - T * h
    assert param_count(cfg.replace(tie_embeddings=False)) == n + V * h
    assert param_count(cfg.replace(norm="rmsnorm")) == n - (2 * L + 1) * 2 * h
    for unchanged in (dict(qk_norm=True), dict(mlp_act="relu2"), dict(logit_softcap=15.0), dict(zero_init_proj=True)):
        assert param_count(cfg.replace(**unchanged)) == n, unchanged
    # value_embeds: k tables as wide as the values (n_kv_head x head_dim) and two mixing weights in each of the 2k
    # layers that take one; unet_skips: a weight per skip, n_layer // 2 of them (one with 3 layers).
    assert param_count(cfg.replace(value_embeds=1)) == n + V * h + 2 * 2
    assert param_count(cfg.replace(value_embeds=1, n_kv_head=1)) == param_count(cfg.replace(n_kv_head=1)) + V * 8 + 4
    assert param_count(cfg.replace(unet_skips=True)) == n + 1
    assert "lm_head.weight" in weight_shapes(cfg.replace(tie_embeddings=False))
    assert "transformer.wpe.weight" not in weight_shapes(cfg.replace(rope=True))


def test_weight_shapes_cannot_be_changed_through_the_cache():
    cfg = model_preset("debug")
    weight_shapes(cfg)["transformer.wte.weight"] = (1, 1)
    assert weight_shapes(cfg)["transformer.wte.weight"] == (cfg.vocab_size, cfg.n_embd)


def test_shape_fields_are_the_marked_fields():
    """What a resumed checkpoint must match, from the field markers (the trainer's compatibility check)."""
    assert ModelConfig.shape_fields() == (
        "n_layer",
        "n_head",
        "n_kv_head",
        "n_embd",
        "block_size",
        "vocab_size",
        "bias",
        "rope",
        "rope_base",
        "qk_norm",
        "mlp_act",
        "norm",
        "tie_embeddings",
        "logit_softcap",
        "value_embeds",
        "unet_skips",
    )
    assert {f.name for f in dataclasses.fields(ModelConfig)} - set(ModelConfig.shape_fields()) == {
        "dropout",
        "attn_impl",
        "zero_init_proj",  # the initialisation only: the weights mean the same either way
        "doc_attention",  # which tokens attend to which while training: the weights hold the same layout
    }


@pytest.mark.parametrize(
    "cls, field",
    [
        ("TrainConfig", "grad_clip"),
        ("TrainConfig", "lr"),
        ("TrainConfig", "eps"),
        ("TrainConfig", "dist_timeout_s"),
        ("ModelConfig", "dropout"),
    ],
)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_floats_are_refused_in_one_line_naming_the_flag(cls, field, value):
    """--grad-clip nan passed `>= 0` (every comparison with nan is false) and disabled clipping; --lr inf
    passed `> 0` and turned the weights to NaN. Every float field, in one check."""
    from gpt2.core.config import TrainConfig

    with pytest.raises(ValueError) as err:
        (TrainConfig.of if cls == "TrainConfig" else ModelConfig)(**{field: value})
    flag = "--" + field.replace("_", "-")
    assert str(err.value) == f"{flag} {value}: not a finite number; nan and inf are refused, give a number"


def test_every_float_field_is_checked_for_finiteness():
    from gpt2.core.config import TRAIN_SECTIONS

    floats = {
        name: cls
        for cls in (ModelConfig, *TRAIN_SECTIONS.values())
        for f in dataclasses.fields(cls)
        if f.type == "float"
        for name in [f.name]
    }
    assert (
        len(floats) == 18
    )  # dropout, rope_base, lr, min_lr, muon_momentum_start, ..., dist_step_timeout_s, spike_loss_z, spike_norm_z
    for name, cls in floats.items():
        with pytest.raises(ValueError, match="not a finite number"):
            cls(**{name: float("inf")})
