"""Export a checkpoint as a Hugging Face GPT-2: `python -m gpt2.export --checkpoint RUN --out DIR`.

DIR gets config.json + model.safetensors (GPT2LMHeadModel, vocab cut back to the tokenizer's
50,257 rows), so `GPT2LMHeadModel.from_pretrained(DIR)` gives the same logits, and the GPT-2 BPE
files (vocab.json, merges.txt) when the offline copies are available, so
`AutoTokenizer.from_pretrained(DIR)` works without the hub too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

from gpt2.hf import save_hf_dir
from gpt2.model import GPT
from gpt2.sample import load_any
from gpt2.tokenizer import GPT2_FILES, bundled_bpe_dir

# Our BPE file names -> the names GPT2Tokenizer reads (same bytes: merges.txt keeps the version line).
HF_TOKENIZER_FILES = {"encoder.json": "vocab.json", "vocab.bpe": "merges.txt"}
# Files of a training run: a run directory must not be mistaken for an export target (its
# config.json is the run's record, and export would overwrite it).
RUN_MARKERS = ("checkpoints", "metrics.jsonl")


def export(model: GPT, out_dir: str | Path) -> Path:
    """Write model as a Hugging Face GPT-2 directory (weights, config, tokenizer files if available)."""
    out = Path(out_dir)
    clash = [m for m in RUN_MARKERS if (out / m).exists()]
    if clash:
        raise ValueError(f"--out {out} is a training run directory (it holds {', '.join(clash)}); "
                         "export into a new directory, e.g. --out RUN/hf")
    save_hf_dir(model, out)
    write_tokenizer_files(out)
    return out


def write_tokenizer_files(out: Path) -> bool:
    """Copy the hash-verified GPT-2 BPE files as vocab.json / merges.txt; False if unavailable."""
    source = bundled_bpe_dir()
    if source is None:
        return False
    for ours, theirs in HF_TOKENIZER_FILES.items():
        data = (source / ours).read_bytes()
        if hashlib.sha256(data).hexdigest() != GPT2_FILES[ours][1]:
            return False
    for ours, theirs in HF_TOKENIZER_FILES.items():
        shutil.copyfile(source / ours, out / theirs)
    # GPT-2 has no padding or BOS of its own: <|endoftext|> serves as both, as on the hub.
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
               "model_max_length": json.loads((out / "config.json").read_text())["n_positions"],
               "tokenizer_class": "GPT2Tokenizer"}
    (out / "tokenizer_config.json").write_text(json.dumps(special, indent=2) + "\n")
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gpt2.export", allow_abbrev=False,
                                     description="Write a checkpoint as a Hugging Face GPT2LMHeadModel directory.")
    parser.add_argument("--checkpoint", required=True, help="step_*.pt file or run directory (newest valid checkpoint)")
    parser.add_argument("--out", required=True, help="directory to write (created; existing export files replaced)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        model, info = load_any(args.checkpoint, "cpu")
        out = export(model, args.out)
    except ValueError as e:
        print(f"gpt2.export: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    step = f" (step {info['step']})" if "step" in info else ""
    print(f"exported {info['path']}{step} to {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
