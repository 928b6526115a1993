"""A trained GPT from wherever it is: one of our checkpoints or a Hugging Face GPT-2 directory.

What `python -m gpt2.sample`, `gpt2.eval` and `gpt2.export` load. Our checkpoints (gpt2/ckpt/checkpoint.py's
format) may be named as a step_*.pt file, a sharded checkpoint's step_*/ directory (--parallel fsdp;
read in this one process, no process group), a run directory or its checkpoints/ directory (the
newest valid checkpoint); a Hugging Face directory holds config.json and weights (gpt2/model/hf.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from gpt2.ckpt import dcp as dcp_io
from gpt2.ckpt.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    is_checkpoint,
    latest_valid,
    load_checkpoint,
    resolve_resume,
)
from gpt2.core.config import ModelConfig
from gpt2.model.gpt import GPT
from gpt2.model.hf import WEIGHT_FILES, load_hf_dir


def load_model(path: str | Path, device: str | torch.device = "cpu"):
    """A GPT from a checkpoint file or run directory, in eval mode, plus the checkpoint dict."""
    ckpt_path = resolve_resume(str(path), Path(path))  # verifies (hashes) the file it returns
    return _model_from(ckpt_path, device, verify=False)


def _model_from(file: Path, device, *, verify: bool):
    """The GPT in checkpoint file, and the checkpoint dict; verify: hash it first (False: already done,
    each checkpoint is hashed once per load)."""
    state = load_checkpoint(file, verify=verify)
    model = GPT(ModelConfig(**state["config"]["model"]))
    if state.get("sharded"):
        dcp_io.load_weights(model, file)
    else:
        model.load_state_dict(state["model"])
    return model.to(device).eval(), state


def load_any(path: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, dict]:
    """A GPT in eval mode from our checkpoint (file, run dir, checkpoints dir) or a Hugging Face dir.

    Returns (model, info): info["source"] is "checkpoint" or "hf", info["path"] the file or directory
    loaded, info["step"] the training step of our checkpoints. Raises CheckpointError (a ValueError)
    saying what is wrong and what to pass instead.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"--checkpoint {path}: no such file or directory; pass a step_*.pt file, "
            "a sharded step_*/ directory, a run directory (--out-dir of train_ddp.py) or a "
            "Hugging Face GPT-2 directory"
        )
    if path.is_dir() and not _is_run_dir(path) and not is_checkpoint(path):
        return _load_hf(path, device)
    # A run directory's newest valid checkpoint is verified while it is chosen; a file is verified as it loads.
    file, verified = (path, False) if is_checkpoint(path) else (_newest_valid(path), True)
    try:
        model, state = _model_from(file, device, verify=not verified)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        # Weights that do not fit the saved config (RuntimeError from load_state_dict), a config with
        # fields this version does not know (TypeError), or a dict that is not a training state.
        raise CheckpointError(
            f"--checkpoint {file}: incompatible with this program's GPT ({type(e).__name__}: {_one_line(e)})"
        ) from None
    if state.get("tokenizer") != "gpt2":
        raise CheckpointError(
            f"--checkpoint {file}: trained with tokenizer {state.get('tokenizer')!r}; "
            "only the GPT-2 BPE ('gpt2') is supported"
        )
    return model, {"source": "checkpoint", "path": str(file), "step": state.get("step")}


def _is_run_dir(path: Path) -> bool:
    return (path / "checkpoints").is_dir() or path.name == "checkpoints"


def _newest_valid(path: Path) -> Path:
    run_dir = path.parent if path.name == "checkpoints" else path
    found = latest_valid(run_dir)  # warns about each checkpoint it skips
    if found is None:
        raise CheckpointError(
            f"--checkpoint {path}: no valid checkpoint in {checkpoint_dir(run_dir)} (none "
            "there, or each lacks its .json sidecar or fails its checksum); pass a step_*.pt "
            "file or another run directory"
        )
    return found


def _load_hf(path: Path, device) -> tuple[GPT, dict]:
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise CheckpointError(
            f"--checkpoint {path}: neither a run directory (no checkpoints/ in it) nor a "
            f"Hugging Face directory (none of {', '.join(WEIGHT_FILES)})"
        )
    try:
        model = load_hf_dir(path)
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"--checkpoint {path}: cannot load as Hugging Face GPT-2: {_one_line(e)}") from None
    return model.to(device).eval(), {"source": "hf", "path": str(path)}


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
