import json

import pytest
import torch
import transformers

from gpt2.core.config import GPT2_VOCAB_SIZE, ModelConfig
from gpt2.model.gpt import GPT
from gpt2.model.hf import from_hf_state_dict, hf_config_dict, load_hf_dir, save_hf_dir, to_hf_state_dict

SHAPE = dict(n_layer=2, n_head=4, n_embd=64, block_size=32)


def randomise(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random values in every tensor, biases and LayerNorms included, so no mapping error hides
    behind GPT-2's zero biases and unit LayerNorm weights."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


def ours(**overrides) -> GPT:
    torch.manual_seed(0)
    return randomise(GPT(ModelConfig(**{**SHAPE, **overrides})))


def hf_model() -> transformers.GPT2LMHeadModel:
    cfg = transformers.GPT2Config(
        vocab_size=GPT2_VOCAB_SIZE,
        n_positions=SHAPE["block_size"],
        n_embd=SHAPE["n_embd"],
        n_layer=SHAPE["n_layer"],
        n_head=SHAPE["n_head"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return randomise(transformers.GPT2LMHeadModel(cfg), seed=1)


def tokens(T: int = 24) -> torch.Tensor:
    return torch.randint(0, GPT2_VOCAB_SIZE, (2, T), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def our_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    return model(idx)[0][..., :GPT2_VOCAB_SIZE]


@torch.no_grad()
def hf_logits(model, idx: torch.Tensor) -> torch.Tensor:
    return model(idx).logits


def test_export_has_hugging_face_names_shapes_and_tying():
    model = ours()
    sd = to_hf_state_dict(model)
    expected = hf_model().state_dict()
    assert list(sd) == list(expected)  # same names, same order
    for name, tensor in expected.items():
        assert sd[name].shape == tensor.shape, name
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
    # Conv1D layout: our Linear weight transposed; the padded rows are cut off.
    ref = model.transformer.h[1].mlp.c_fc.weight
    assert torch.equal(sd["transformer.h.1.mlp.c_fc.weight"], ref.T)
    assert torch.equal(sd["transformer.wte.weight"], model.transformer.wte.weight[:GPT2_VOCAB_SIZE])
    # Copies: editing the export leaves the model alone.
    sd["transformer.ln_f.bias"].zero_()
    assert model.transformer.ln_f.bias.abs().sum() > 0


def test_ours_to_transformers_gives_the_same_logits():
    model = ours()
    hf = hf_model()
    hf.load_state_dict(to_hf_state_dict(model), strict=True)
    idx = tokens()
    torch.testing.assert_close(hf_logits(hf, idx), our_logits(model, idx), atol=1e-4, rtol=0)


@pytest.mark.parametrize("vocab_size", [50304, GPT2_VOCAB_SIZE])
def test_transformers_to_ours_gives_the_same_logits(vocab_size):
    hf = hf_model()
    model = from_hf_state_dict(hf.state_dict(), vocab_size=vocab_size, n_head=SHAPE["n_head"]).eval()
    assert model.config == ModelConfig(**SHAPE, vocab_size=vocab_size)
    idx = tokens()
    logits = model(idx)[0]
    torch.testing.assert_close(logits[..., :GPT2_VOCAB_SIZE], hf_logits(hf, idx), atol=1e-4, rtol=0)
    assert torch.isneginf(logits[..., GPT2_VOCAB_SIZE:]).all()
    assert (model.transformer.wte.weight[GPT2_VOCAB_SIZE:] == 0).all()  # padded rows are zero
    assert model.lm_head.weight is model.transformer.wte.weight


def test_export_then_import_is_exact():
    model = ours()
    back = from_hf_state_dict(to_hf_state_dict(model), n_head=SHAPE["n_head"])
    for (name, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        expect = a.clone()
        if name in ("transformer.wte.weight", "lm_head.weight"):
            expect[GPT2_VOCAB_SIZE:] = 0  # padded rows are not exported
        assert torch.equal(expect, b), name


def test_saved_directory_loads_in_transformers(tmp_path):
    model = ours()
    out = save_hf_dir(model, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temporary directory left
    hf, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # re-tied
    assert (hf.config.n_layer, hf.config.n_head, hf.config.n_embd, hf.config.n_positions) == (2, 4, 64, 32)
    assert hf.config.vocab_size == GPT2_VOCAB_SIZE and hf.config.activation_function == "gelu_new"
    idx = tokens()
    torch.testing.assert_close(hf_logits(hf.eval(), idx), our_logits(model, idx), atol=1e-4, rtol=0)
    # And back through our own loader, head count read from config.json.
    back = load_hf_dir(out)
    assert back.config.n_head == SHAPE["n_head"]
    torch.testing.assert_close(our_logits(back.eval(), idx), our_logits(model, idx), atol=0, rtol=0)


def test_safetensors_holds_the_tied_tensor_once(tmp_path):
    from safetensors import safe_open

    save_hf_dir(ours(), tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys
    assert json.loads((tmp_path / "config.json").read_text()) == hf_config_dict(ours().config)


def test_saving_over_an_existing_export_replaces_it(tmp_path):
    first, second = ours(), randomise(GPT(ModelConfig(**SHAPE)), seed=5)
    save_hf_dir(first, tmp_path / "x")
    (tmp_path / "x" / "pytorch_model.bin").write_bytes(b"stale")
    (tmp_path / "x" / "README.md").write_text("kept")
    save_hf_dir(second, tmp_path / "x")
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["x"]
    idx = tokens()
    torch.testing.assert_close(our_logits(load_hf_dir(tmp_path / "x").eval(), idx), our_logits(second, idx))


def test_loads_a_hub_style_pytorch_bin(tmp_path):
    # The hub's original `gpt2` weights were saved from GPT2Model: no `transformer.` prefix, no
    # lm_head, and the old causal-mask buffers `attn.bias` / `attn.masked_bias`.
    hf = hf_model()
    sd = dict(hf.transformer.state_dict())
    for i in range(SHAPE["n_layer"]):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    hf.config.to_json_file(str(tmp_path / "config.json"))
    model = load_hf_dir(tmp_path, dropout=0.1).eval()
    assert model.config.dropout == 0.1 and model.config.vocab_size == 50304
    idx = tokens()
    torch.testing.assert_close(our_logits(model, idx), hf_logits(hf, idx), atol=1e-4, rtol=0)


def test_gpt2_head_count_is_the_default_without_config():
    # 64-dim heads in every OpenAI release (768 wide -> 12 heads): n_embd // 64 without being told.
    sd = to_hf_state_dict(GPT(ModelConfig(n_layer=1, n_head=2, n_embd=128, block_size=8)))
    assert from_hf_state_dict(sd).config.n_head == 2
    assert from_hf_state_dict(sd, n_head=8).config.n_head == 8


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(n_kv_head=2), "n_kv_head=2 differs from n_head=4.*n_kv_head=n_head to export"),
        (dict(n_kv_head=1), "no grouped-query/multi-query attention"),
        (dict(bias=False), "bias=False: Hugging Face GPT-2 always has biases"),
    ],
)
def test_unexportable_models_are_refused(fields, message, tmp_path):
    model = GPT(ModelConfig(**SHAPE, **fields))
    with pytest.raises(ValueError, match=message):
        to_hf_state_dict(model)
    with pytest.raises(ValueError, match=message):
        save_hf_dir(model, tmp_path / "out")
    assert not any(tmp_path.iterdir())


def test_bad_inputs_are_refused_with_the_fix(tmp_path):
    sd = to_hf_state_dict(ours())
    with pytest.raises(ValueError, match="block_size=64 \\(the weights have block_size=32\\)"):
        from_hf_state_dict(sd, n_head=4, block_size=64)
    with pytest.raises(ValueError, match="at most vocab_size=50000"):
        from_hf_state_dict(sd, n_head=4, vocab_size=50000)
    untied = dict(sd, **{"lm_head.weight": sd["lm_head.weight"] + 1})
    with pytest.raises(ValueError, match="untied LM head"):
        from_hf_state_dict(untied, n_head=4)
    extra = dict(sd, **{"transformer.h.0.crossattention.c_attn.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="unexpected transformer.h.0.crossattention"):
        from_hf_state_dict(extra, n_head=4)
    missing = {k: v for k, v in sd.items() if k != "transformer.h.1.ln_2.bias"}
    with pytest.raises(ValueError, match="missing transformer.h.1.ln_2.bias"):
        from_hf_state_dict(missing, n_head=4)
    with pytest.raises(ValueError, match="not a GPT-2 state dict: transformer.wpe.weight is missing"):
        from_hf_state_dict({"transformer.wte.weight": sd["transformer.wte.weight"]})
    with pytest.raises(ValueError, match="no weights in .*model.safetensors"):
        load_hf_dir(tmp_path)
    with pytest.raises(ValueError, match="is not a directory"):
        load_hf_dir(tmp_path / "nope")


def test_configs_with_other_maths_are_refused(tmp_path):
    save_hf_dir(ours(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(activation_function="relu", scale_attn_by_inverse_layer_idx=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx=True.*activation_function='relu'"):
        load_hf_dir(tmp_path)


def test_exportability_is_derived_from_the_shape_fields(monkeypatch):
    """Every ModelConfig.shape_fields entry GPT2Config cannot express must keep GPT-2's value: a new shape
    field is checked without touching gpt2/model/hf.py (simulated here by marking dropout as one)."""
    from gpt2.model import hf

    assert set(hf.HF_SHAPE_FIELDS) < set(ModelConfig.shape_fields())
    model = GPT(ModelConfig(**SHAPE, dropout=0.1))
    to_hf_state_dict(model)  # dropout is not a shape field: exported (as resid_pdrop etc.)
    shape_fields = ModelConfig.shape_fields()
    monkeypatch.setattr(ModelConfig, "shape_fields", classmethod(lambda cls: (*shape_fields, "dropout")))
    with pytest.raises(
        ValueError,
        match=r"dropout=0.1: Hugging Face GPT-2 has no such setting; train with "
        r"dropout=0.0 to export",
    ):
        to_hf_state_dict(model)


@pytest.mark.parametrize(
    "name, damage",
    [("model.safetensors", b"\x01\x00"), ("model.safetensors", None), ("pytorch_model.bin", b"not a zip")],
)
def test_a_damaged_weights_file_is_refused_naming_it(tmp_path, name, damage):
    """A cut-off download: safetensors raised its own SafetensorError ("header too small"), not a
    ValueError, so the tools showed a traceback."""
    out = save_hf_dir(ours(), tmp_path / "hf")
    file = out / name
    if name == "pytorch_model.bin":
        (out / "model.safetensors").unlink()
    file.write_bytes(damage if damage is not None else (out / name).read_bytes()[:1000])
    with pytest.raises(ValueError) as err:
        load_hf_dir(out)
    assert str(err.value).startswith(f"{file}: unreadable (") and "download or export it again" in str(err.value)
