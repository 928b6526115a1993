"""Evaluate a checkpoint from the command line: HellaSwag accuracy and validation loss.

    python -m gpt2.eval hellaswag --checkpoint RUN [--data hellaswag_val.jsonl]
    python -m gpt2.eval loss --checkpoint RUN --data-dir DIR [--eval-tokens N]
    python -m gpt2.eval loss --checkpoint RUN --data-dir A,B [--data-weights 0.75,0.25]   # a line per source
    torchrun --standalone --nproc_per_node=8 -m gpt2.eval hellaswag --checkpoint RUN

The scoring itself is gpt2/train/scoring.py's (the trainer runs the same functions), the HellaSwag file
gpt2/data/hellaswag.py's; this module adds what a command line needs: loading any checkpoint or Hugging
Face directory (gpt2/ckpt/load.py), the val shards of a directory, flags and one-line errors.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from gpt2.ckpt.load import load_any
from gpt2.core import precision
from gpt2.core.args import OneLineParser
from gpt2.core.config import data_dirs, normalised, parse_weights, source_name
from gpt2.core.precision import FLOAT32, Precision
from gpt2.data.hellaswag import HELLASWAG_URL, default_data_path, prepare_hellaswag
from gpt2.distributed.group import Dist, rank0_decides
from gpt2.model.gpt import GPT, unwrap
from gpt2.plan import precision_choice
from gpt2.train.scoring import hellaswag_eval, loader_loss


def val_shards_loss(
    model: GPT,
    data_dir: str | Path,
    dist: Dist,
    *,
    eval_tokens: int,
    batch_size: int,
    prec: Precision = FLOAT32,
    progress: bool = False,
) -> dict:
    """Loss, perplexity and token count over the first eval_tokens of data_dir's val shards.

    The trainer's own number: the same EvalLoader and gpt2.train.scoring.loader_loss as its evaluations."""
    from gpt2.data.check import verify_shards
    from gpt2.data.loader import EvalLoader, find_shards

    model = unwrap(model)
    shards = find_shards(data_dir, "val")
    # Their manifest, sha256 and token ids (an id the model cannot embed crashed the first forward), read
    # by rank 0 for every rank: val shards are small (the trainer reads them whole too).
    rank0_decides(lambda: verify_shards(data_dir, {"val": shards}, "full"), dist, errors=(ValueError,))
    loader = EvalLoader(
        shards,
        micro_batch_size=batch_size,
        seq_len=model.config.block_size,
        eval_tokens=eval_tokens,
        rank=dist.rank,
        world_size=dist.world_size,
        device=dist.device,
    )
    if loader.n_seqs == 0:
        raise ValueError(
            f"--eval-tokens {eval_tokens} is less than one sequence of block_size="
            f"{model.config.block_size} tokens (or the val shards are that short)"
        )
    loss = loader_loss(model, loader, prec, dist, progress=progress)
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": loader.tokens, "clamped": loader.clamped}


def loss_sources(args: argparse.Namespace) -> tuple[list[str], list[str], list[float] | None]:
    """--data-dir's directories, their names and --data-weights, checked before anything loads."""
    dirs = data_dirs(args.data_dir)
    weights = None
    if len(dirs) > 1 and args.data_weights:
        weights = parse_weights(args.data_weights, "--data-weights")
        if len(weights) != len(dirs):
            raise ValueError(f"--data-weights gives {len(weights)} weight(s) for {len(dirs)} --data-dir directories")
    elif args.data_weights:
        raise ValueError("--data-weights weighs several --data-dir directories (A,B): one needs none")
    names = [source_name(d) for d in dirs]
    if len(set(names)) < len(names):
        raise ValueError(f"--data-dir {args.data_dir}: two directories of one name; each source is named by its own")
    return dirs, names, weights


def sources_loss(model: GPT, args: argparse.Namespace, dist: Dist, prec: Precision) -> dict:
    """val_shards_loss of --data-dir's one directory; of each of several ({"sources": {NAME: result}}, NAME
    its directory's name, and with --data-weights "loss": their weighted mean, as the trainer's val_loss)."""
    dirs, names, weights = loss_sources(args)
    results = {
        name: val_shards_loss(
            model, d, dist, eval_tokens=args.eval_tokens, batch_size=args.batch_size, prec=prec, progress=True
        )
        for name, d in zip(names, dirs)
    }
    if len(dirs) == 1:
        return results[names[0]]
    out = {"sources": results}
    if weights is not None:
        out["loss"] = sum(w * results[n]["loss"] for n, w in zip(names, normalised(weights)))
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m gpt2.eval",
        allow_abbrev=False,
        description="Evaluate a checkpoint or Hugging Face GPT-2 directory.",
    )
    sub = parser.add_subparsers(dest="task", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--checkpoint",
        required=True,
        help="step_*.pt file, run directory (newest valid checkpoint), or Hugging Face directory",
    )
    common.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    common.add_argument(
        "--dtype",
        choices=precision.DTYPES,
        default="auto",
        help="autocast dtype (auto: what this device runs fast, see gpt2/plan/precision_choice.py)",
    )
    common.add_argument("--json", action="store_true", help="print the result as one JSON line")
    common.add_argument(
        "--num-threads", type=int, default=0, help="CPU threads per rank (0: the node's cores divided among its ranks)"
    )
    hs = sub.add_parser("hellaswag", parents=[common], help="HellaSwag acc / acc_norm (completion style)")
    hs.add_argument(
        "--data", default=None, help=f"HellaSwag jsonl; downloaded here if missing (default {default_data_path()})"
    )
    hs.add_argument("--url", default=HELLASWAG_URL, help="where to download the file from when missing")
    hs.add_argument("--limit", type=int, default=None, help="only the first N examples")
    loss = sub.add_parser("loss", parents=[common], help="validation loss and perplexity on *val*.bin shards")
    loss.add_argument(
        "--data-dir", required=True, help="directory holding *val*.bin shards; A,B,...: each source of a mixture"
    )
    loss.add_argument(
        "--data-weights", default="", help="with several --data-dir: also their weighted mean (the trainer's val_loss)"
    )
    loss.add_argument("--eval-tokens", type=int, default=10_485_760, help="tokens to evaluate (from the start)")
    loss.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass per rank")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(argv)[0]


def run(argv: list[str] | None = None) -> tuple[int, bool]:
    """main's work: its exit code, and whether this process started a process group (exit_rank)."""
    from gpt2.distributed.group import resolve_device, set_cpu_threads, setup, teardown, world_from_env

    args = build_parser().parse_args(argv)
    dist = None
    info = None
    try:
        try:  # user errors: exit 2 with one line (printed by rank 0)
            info = world_from_env()
            if args.num_threads < 0:
                raise ValueError(f"--num-threads {args.num_threads} must be >= 0")
            if args.task == "hellaswag" and args.limit is not None and args.limit < 1:
                raise ValueError(f"--limit {args.limit} must be >= 1")
            if args.task == "loss" and (args.eval_tokens < 1 or args.batch_size < 1):
                raise ValueError("--eval-tokens and --batch-size must be >= 1")
            if args.task == "loss":
                loss_sources(args)  # the directories and weights, before the model loads
            device = resolve_device(args.device, info.local_rank)
            model, source = load_any(args.checkpoint, device)
            dist = setup(info, device, timeout_s=600.0)
            set_cpu_threads(dist, args.num_threads)
            # rank 0 chooses for every rank (auto measures the CPU: ranks must not disagree)
            choose = lambda: precision_choice.resolve_precision(args.dtype, device)  # noqa: E731
            prec = rank0_decides(choose, dist, errors=(ValueError,))
            if args.task == "hellaswag":
                examples = prepare_hellaswag(args.data, dist, url=args.url, limit=args.limit)
            else:
                result = sources_loss(model, args, dist, prec)
        except ValueError as e:
            if info is None or info.rank == 0:
                print(f"gpt2.eval: error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2, dist is not None
        if args.task == "hellaswag":
            result = hellaswag_eval(model, examples, dist, device, prec=prec)
        if dist.is_main:
            print(json.dumps(result) if args.json else _describe(args.task, result, source))
        return 0, dist is not None
    finally:
        teardown(dist)


def _describe(task: str, r: dict, source: dict) -> str:
    where = f"{source['source']} {source['path']}"
    if task == "hellaswag":
        return (
            f"hellaswag {where}: acc {r['acc']:.4f} ({r['correct']}/{r['n']}) | "
            f"acc_norm {r['acc_norm']:.4f} ({r['correct_norm']}/{r['n']})"
        )
    if "sources" in r:  # several --data-dir: a line each, then the weighted mean when weights were given
        lines = [_loss_line(f"{where} on {name}", one) for name, one in r["sources"].items()]
        if "loss" in r:
            lines.append(f"val loss {where}, weighted mean (--data-weights): {r['loss']:.4f}")
        return "\n".join(lines)
    return _loss_line(where, r)


def _loss_line(where: str, r: dict) -> str:
    clamped = " (all the val shards hold)" if r["clamped"] else ""
    return f"val loss {where}: {r['loss']:.4f} | perplexity {r['perplexity']:.2f} | {r['tokens']:,} val tokens{clamped}"


if __name__ == "__main__":
    from gpt2.distributed.group import exit_rank

    exit_rank(*run())  # under torchrun: past gloo's exit-time abort (gpt2/distributed/group.py exit_after_group)
