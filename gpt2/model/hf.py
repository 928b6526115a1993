"""Import and export of Hugging Face `GPT2LMHeadModel` weights.

Our parameter names are GPT-2's, so the mapping is only about layout: Hugging Face keeps the four
projection matrices in `Conv1D` modules, whose weight is (in, out), the transpose of our
`nn.Linear`'s (out, in); and our embedding may carry padded vocab rows that Hugging Face's does not.

`transformers` is not imported here (it is an optional extra); `safetensors` is imported only
when a directory is written or read.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch
from torch import Tensor

from gpt2.core.atomic import give_plain_mode
from gpt2.core.config import EOT_TOKEN, GPT2_VOCAB_SIZE, PADDED_VOCAB_SIZE, ModelConfig
from gpt2.model.gpt import GPT, unwrap

# Weights stored as Conv1D (in, out) by Hugging Face: transposed on the way in and out.
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers older GPT-2 checkpoints carry (the causal mask and its fill value): not weights.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")
# Every OpenAI GPT-2 release uses 64-dimensional heads; the head count is not visible in the tensors.
GPT2_HEAD_DIM = 64
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def to_hf_state_dict(model: GPT) -> dict[str, Tensor]:
    """Our model's weights under GPT2LMHeadModel's names and layout (detached copies).

    The embedding is cut back to the tokenizer's 50,257 rows; `lm_head.weight` is the same tensor
    as `transformer.wte.weight`, as in Hugging Face's tied model.
    """
    model = unwrap(model)
    _check_exportable(model.config)
    sd = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        tensor = tensor.detach()
        if name.endswith(CONV1D_SUFFIXES):
            tensor = tensor.t()
        elif name == "transformer.wte.weight":
            tensor = tensor[:GPT2_VOCAB_SIZE]
        sd[name] = tensor.contiguous().clone()
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return sd


HF_SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
"""The ModelConfig.shape_fields GPT2Config can express (our padded vocab rows are cut off on export).
Every other shape field must keep the value GPT-2's layout gives it, or the model cannot be exported."""


def _check_exportable(cfg: ModelConfig) -> None:
    gpt2_layout = ModelConfig(**{name: getattr(cfg, name) for name in HF_SHAPE_FIELDS})
    problems = [
        _not_exportable(cfg, name, getattr(gpt2_layout, name))
        for name in ModelConfig.shape_fields()
        if getattr(cfg, name) != getattr(gpt2_layout, name) and not (name == "rope_base" and not cfg.rope)
    ]
    if problems:
        raise ValueError("model cannot be exported as GPT2LMHeadModel:\n  - " + "\n  - ".join(problems))


def _not_exportable(cfg: ModelConfig, name: str, gpt2_value) -> str:
    """Why a shape field's value has no GPT2Config equivalent, and the value that would export."""
    if name == "n_kv_head":
        return (
            f"n_kv_head={cfg.n_kv_head} differs from n_head={cfg.n_head}: Hugging Face GPT-2 "
            f"has no grouped-query/multi-query attention; train with n_kv_head=n_head to export"
        )
    if name == "bias":
        return "bias=False: Hugging Face GPT-2 always has biases; train with bias=True to export"
    if name in WHAT_GPT2_HAS:
        flag = "--" + name.replace("_", "-")
        return (
            f"this model uses {name}={getattr(cfg, name)!r}, which Hugging Face's GPT-2 layout cannot hold "
            f"(it has {WHAT_GPT2_HAS[name]}); train with {flag} {str(gpt2_value).lower()} (or without --arch modern)"
            " to export"
        )
    return (
        f"{name}={getattr(cfg, name)!r}: Hugging Face GPT-2 has no such setting; train with "
        f"{name}={gpt2_value!r} to export"
    )


WHAT_GPT2_HAS = {
    "rope": "a learned position table, no rotary positions",
    "rope_base": "no rotary positions",
    "qk_norm": "no normalisation of queries and keys",
    "mlp_act": "the tanh GELU only",
    "norm": "LayerNorm with a gain and a bias",
    "tie_embeddings": "the LM head tied to the token embedding; this export writes no separate head",
    "logit_softcap": "no cap on the logits",
    "value_embeds": "no value embeddings",
    "unet_skips": "no skip connections between blocks",
}
"""The architecture options (ModelConfig, docs/modern.md) GPT2LMHeadModel has no setting for: what it has instead."""


def hf_config_dict(cfg: ModelConfig) -> dict:
    """The GPT2Config fields (config.json) describing a model of this shape."""
    _check_exportable(cfg)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": GPT2_VOCAB_SIZE,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",  # the tanh GELU our MLP uses
        "layer_norm_epsilon": 1e-5,  # torch's LayerNorm default, which ours use
        "initializer_range": 0.02,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "bos_token_id": EOT_TOKEN,
        "eos_token_id": EOT_TOKEN,
        "use_cache": True,
    }


def from_hf_state_dict(
    sd: dict[str, Tensor], *, vocab_size: int = PADDED_VOCAB_SIZE, n_head: int | None = None, **overrides
) -> GPT:
    """A GPT holding the weights of a GPT2LMHeadModel (or GPT2Model) state dict.

    n_layer, n_embd and block_size come from the tensors. The head count does not show in them:
    pass n_head (load_hf_dir reads it from config.json); by default it is n_embd // 64, which holds
    for all four OpenAI releases. The embedding is zero-padded to vocab_size rows; those rows get a
    -inf logit in the model, so they never carry probability. Other ModelConfig fields (dropout,
    attn_impl) may be given as overrides.
    """
    shape, ours = convert_hf_state_dict(sd, vocab_size=vocab_size)
    clashes = [
        f"{k}={overrides[k]} (the weights have {k}={v})"
        for k, v in shape.items()
        if k in overrides and overrides[k] != v
    ]
    if clashes:
        raise ValueError(f"overrides contradict the weights: {', '.join(clashes)}; drop them")
    overrides = {k: v for k, v in overrides.items() if k not in shape}
    cfg = ModelConfig(**shape, n_head=n_head or shape["n_embd"] // GPT2_HEAD_DIM, vocab_size=vocab_size, **overrides)
    model = GPT(cfg)
    check_keys(model.state_dict(), ours)
    model.load_state_dict(ours)
    return model


def convert_hf_state_dict(
    sd: dict[str, Tensor], *, vocab_size: int = PADDED_VOCAB_SIZE
) -> tuple[dict[str, int], dict[str, Tensor]]:
    """A GPT2LMHeadModel (or GPT2Model) state dict under our names and layout, building no model:
    (the shape the tensors show: n_layer, n_embd, block_size; the state dict). The Conv1D weights are
    transposed views and the embedding is zero-padded to vocab_size rows, so the result costs one
    embedding's copy beside sd (--init-from loads it into the model it has built: gpt2/train/init_from.py).
    """
    sd = _strip_prefixes(sd)
    wte, wpe = sd["transformer.wte.weight"], sd["transformer.wpe.weight"]
    n_embd = wte.size(1)
    layers = {int(m.group(1)) for k in sd if (m := re.match(r"transformer\.h\.(\d+)\.", k))}
    shape = dict(n_layer=len(layers), n_embd=n_embd, block_size=wpe.size(0))
    if wte.size(0) < GPT2_VOCAB_SIZE or wte.size(0) > vocab_size:
        raise ValueError(
            f"the checkpoint's embedding has {wte.size(0)} rows; it must have at least the "
            f"tokenizer's {GPT2_VOCAB_SIZE} and at most vocab_size={vocab_size}"
        )
    ours = {}
    for name, tensor in sd.items():
        if name.endswith(CONV1D_SUFFIXES):
            tensor = tensor.t()
        elif name == "transformer.wte.weight":
            tensor = torch.cat([tensor, tensor.new_zeros(vocab_size - tensor.size(0), n_embd)])
        ours[name] = tensor
    ours["lm_head.weight"] = ours["transformer.wte.weight"]
    return shape, ours


def _strip_prefixes(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Keys under `transformer.`, whether saved from GPT2LMHeadModel or (like the hub's `gpt2`)
    from a bare GPT2Model; drops mask buffers and the tied LM head (the embedding is the source)."""
    out = {}
    for key, tensor in sd.items():
        if key.endswith(IGNORED_SUFFIXES) or key == "lm_head.weight":
            continue
        out[key if key.startswith("transformer.") else "transformer." + key] = tensor
    for key in ("transformer.wte.weight", "transformer.wpe.weight"):
        if key not in out:
            raise ValueError(f"not a GPT-2 state dict: {key} is missing (keys start {sorted(sd)[:5]})")
    if "lm_head.weight" in sd and not torch.equal(
        sd["lm_head.weight"], sd.get("transformer.wte.weight", sd.get("wte.weight"))
    ):
        raise ValueError(
            "lm_head.weight differs from the token embedding: this model has an untied "
            "LM head, which GPT-2 (and this model) does not support"
        )
    return out


def check_keys(expected: dict[str, Tensor], got: dict[str, Tensor]) -> None:
    problems = [f"missing {k}" for k in expected if k not in got]
    problems += [f"unexpected {k}" for k in got if k not in expected]
    problems += [
        f"{k}: shape {tuple(got[k].shape)}, expected {tuple(v.shape)}"
        for k, v in expected.items()
        if k in got and got[k].shape != v.shape
    ]
    if problems:
        raise ValueError(
            "state dict does not match a GPT-2 of the shape its embeddings imply:\n  - " + "\n  - ".join(problems[:20])
        )


class MissingExtraError(ImportError):
    """An optional extra of pyproject.toml is not installed; the message names the pip command."""


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as e:
        raise MissingExtraError(
            "reading and writing Hugging Face directories needs safetensors, which is not "
            "installed: pip install -e '.[hf]' in the repository (or pip install "
            "safetensors)"
        ) from e
    return safetensors.torch


def save_hf_dir(model: GPT, out_dir: str | os.PathLike) -> Path:
    """Write config.json and model.safetensors that GPT2LMHeadModel.from_pretrained(out_dir) loads.

    Both files are written into a temporary directory beside out_dir first: a new out_dir appears
    whole by one rename; in an existing one each file is replaced atomically, weights before config.
    """
    st = _safetensors()
    model = unwrap(model)
    sd = to_hf_state_dict(model)
    del sd["lm_head.weight"]  # tied: safetensors refuses shared tensors, and HF re-ties it on load
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Not mkdtemp: its 0700 mode would survive the rename; mkdir honours the user's umask.
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        st.save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # safetensors (0.8) creates the file 0600 whatever the umask, so a teammate could not load
        # the export: give it the mode a plain open() would have.
        give_plain_mode(tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(hf_config_dict(model.config), indent=2) + "\n")
        if not out.exists():
            os.rename(tmp, out)
            return out
        for name in ("model.safetensors", "config.json"):
            os.replace(tmp / name, out / name)
        # Another export format left here would be loaded in preference by some readers.
        for stale in ("pytorch_model.bin", "model.safetensors.index.json"):
            (out / stale).unlink(missing_ok=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_hf_dir(path: str | os.PathLike, *, vocab_size: int = PADDED_VOCAB_SIZE, **overrides) -> GPT:
    """A GPT from a local Hugging Face GPT-2 directory (e.g. one downloaded from the hub).

    Reads config.json when present (head count, and a check that the architecture is the one we
    implement) and model.safetensors, a sharded model.safetensors.index.json, or pytorch_model.bin.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory; pass the folder holding config.json and the weights")
    config_file = path / "config.json"
    if config_file.is_file():
        hf_cfg = json.loads(config_file.read_text())
        check_hf_config(hf_cfg, config_file)
        overrides.setdefault("n_head", hf_cfg.get("n_head"))
    return from_hf_state_dict(read_weights(path), vocab_size=vocab_size, **overrides)


def check_hf_config(hf: dict, where: Path) -> None:
    """Refuse configs whose maths differs from our model instead of loading them silently wrong."""
    expect = {
        "model_type": "gpt2",
        "layer_norm_epsilon": 1e-5,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "add_cross_attention": False,
    }
    problems = [f"{k}={hf[k]!r} (need {v!r})" for k, v in expect.items() if k in hf and hf[k] != v]
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        problems.append(f"activation_function={hf['activation_function']!r} (need the tanh GELU 'gelu_new')")
    if hf.get("n_inner") not in (None, 4 * hf.get("n_embd", 0)):
        problems.append(f"n_inner={hf['n_inner']} (need None or 4*n_embd)")
    if problems:
        raise ValueError(f"{where} describes a model this GPT cannot represent: " + "; ".join(problems))


def read_weights(path: Path) -> dict[str, Tensor]:
    if (path / "model.safetensors").is_file():
        return _read_file(path / "model.safetensors")
    if (path / "model.safetensors.index.json").is_file():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        sd = {}
        for shard in sorted(set(index["weight_map"].values())):
            sd.update(_read_file(path / shard))
        return sd
    if (path / "pytorch_model.bin").is_file():
        return _read_file(path / "pytorch_model.bin")
    raise ValueError(f"no weights in {path}: expected one of {', '.join(WEIGHT_FILES)}")


def _read_file(file: Path) -> dict[str, Tensor]:
    """One weights file. A damaged one (a cut-off download) raises what its reader raises (safetensors'
    SafetensorError "header too small", a pickle or zip error): a ValueError naming the file instead."""
    st = _safetensors() if file.suffix == ".safetensors" else None  # its ImportError stays itself
    try:
        if st is not None:
            return st.load_file(str(file))
        # weights_only: a .bin is a pickle, and loading an untrusted one must not run code.
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - the readers' error types differ by version; all mean "unreadable"
        raise ValueError(
            f"{file}: unreadable ({type(e).__name__}: {' '.join(str(e).split())[:200]}); the file is "
            "damaged or incomplete: download or export it again"
        ) from None
