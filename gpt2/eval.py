"""Evaluation of a trained model: HellaSwag accuracy and validation loss.

    python -m gpt2.eval hellaswag --checkpoint RUN [--data hellaswag_val.jsonl]
    python -m gpt2.eval loss --checkpoint RUN --data-dir DIR [--eval-tokens N]
    torchrun --standalone --nproc_per_node=8 -m gpt2.eval hellaswag --checkpoint RUN

HellaSwag is scored completion-style, as in the GPT-2/GPT-3 papers and build-nanogpt: each of the
4 endings is appended to the context (" " + ending, so the ending starts a new word) and the model's
log-likelihood of the ending tokens alone is summed. acc takes the ending with the largest sum,
acc_norm the largest mean per token (which does not favour short endings). On the 10,042
validation examples, OpenAI's GPT-2 124M gets acc_norm 0.2955 and GPT-2 XL (1.5B) 0.4893.

Under torchrun, rank r scores examples r, r+W, r+2W, ...; each example is computed exactly as on one
rank (same rows, same padding), so the counts summed over ranks do not depend on the world size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from gpt2.atomic import atomic_write
from gpt2.config import EOT_TOKEN
from gpt2.dist import Dist, all_reduce_sum, broadcast_object
from gpt2.model import GPT, unwrap
from gpt2 import precision
from gpt2.load import load_any
from gpt2.tokenizer import encode

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
N_ENDINGS = 4


@dataclass(frozen=True)
class Example:
    """One HellaSwag item: a context, 4 candidate endings, and the index of the right one."""
    ctx: str
    endings: tuple[str, ...]
    label: int


def parse_example(line: str, where: str) -> Example:
    """One jsonl line of the official schema (ctx, endings, label; other fields ignored)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with ctx, endings, label; got {type(obj).__name__}")
    missing = [k for k in ("ctx", "endings", "label") if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)} (HellaSwag lines hold ctx, endings, label)")
    ctx, endings, label = obj["ctx"], obj["endings"], obj["label"]
    if not isinstance(ctx, str):
        raise ValueError(f"{where}: ctx must be a string, got {type(ctx).__name__}")
    if not (isinstance(endings, list) and len(endings) == N_ENDINGS and all(isinstance(e, str) for e in endings)):
        raise ValueError(f"{where}: endings must be a list of {N_ENDINGS} strings")
    if isinstance(label, str) and label.isdigit():  # some re-distributions store the label as text
        label = int(label)
    if not (isinstance(label, int) and not isinstance(label, bool) and 0 <= label < N_ENDINGS):
        raise ValueError(f"{where}: label must be an integer in 0..{N_ENDINGS - 1}, got {label!r}")
    return Example(ctx, tuple(endings), label)


def load_examples(path: str | Path, limit: int | None = None) -> list[Example]:
    """Every example of a HellaSwag jsonl file; a bad line raises ValueError naming file:line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such HellaSwag file")
    examples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            examples.append(parse_example(line, f"{path}:{lineno}"))
            if limit is not None and len(examples) >= limit:
                break
    if not examples:
        raise ValueError(f"{path}: holds no examples")
    return examples


def default_data_path() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "gpt2-ddp" / "hellaswag_val.jsonl"


def download(url: str, dest: Path, timeout_s: float = 60.0) -> Path:
    """Fetch url into dest atomically (temp file + rename); ValueError with a fix if it fails."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_write(dest) as out, urllib.request.urlopen(url, timeout=timeout_s) as resp:
            while chunk := resp.read(1 << 20):
                out.write(chunk)
    except OSError as e:  # URLError, HTTPError, timeouts and disk errors are all OSErrors
        raise ValueError(f"could not download {url} to {dest} ({e}); fetch the file where the network "
                         f"allows and pass its path (--data FILE; train_ddp.py: --hellaswag-file FILE)") from None
    return dest


def prepare_hellaswag(path: str | Path | None, dist: Dist, *, url: str = HELLASWAG_URL,
                      limit: int | None = None) -> list[Example]:
    """The examples of path (default: the user cache), downloaded by rank 0 first if missing.

    Collective under torchrun: every rank must call it. Rank 0 alone reads (and if need be
    downloads) the file and sends the examples to the others, so the path need only exist on rank
    0's node: other nodes may not see rank 0's cache. A failure raises on every rank.
    """
    path = Path(path) if path else default_data_path()
    result = None
    if dist.is_main:
        try:
            if not path.is_file():
                print(f"{path} not found: downloading {url}", file=sys.stderr, flush=True)
                download(url, path)
            result = ("ok", load_examples(path, limit))
        except ValueError as e:
            result = ("error", str(e))
    kind, value = broadcast_object(result, dist)
    if kind == "error":
        raise ValueError(value)
    return value


def example_rows(ex: Example, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(4, T) token rows context+ending, right-padded, and a (4, T) mask of the ending tokens.

    A row longer than block_size loses tokens from the start of its context (the ending is what is
    scored); an ending that leaves no context token to predict its first token is an error.
    """
    ctx = encode(ex.ctx) or [EOT_TOKEN]  # an empty context still needs a token to predict the ending from
    rows, masks = [], []
    for ending in ex.endings:
        end = encode(" " + ending)  # GPT-2's BPE attaches the space to the following word
        if len(end) + 1 > block_size:
            raise ValueError(f"an ending of {len(end)} tokens does not fit block_size={block_size} with context")
        row = (ctx + end)[-block_size:]
        rows.append(row)
        masks.append([0] * (len(row) - len(end)) + [1] * len(end))
    width = max(len(r) for r in rows)
    tokens = torch.zeros(N_ENDINGS, width, dtype=torch.long)
    mask = torch.zeros(N_ENDINGS, width, dtype=torch.bool)
    for i, (row, m) in enumerate(zip(rows, masks)):
        tokens[i, :len(row)] = torch.tensor(row)
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.bool)
    return tokens, mask


@torch.no_grad()
def score_endings(model: GPT, tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum and mean log-likelihood of the masked (ending) tokens of each row: two (4,) tensors."""
    logits, _ = model(tokens)
    # The logit at position t predicts token t+1: score positions 1.. with the logits before them.
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    token_logp = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    m = mask[:, 1:].float()
    total = (token_logp * m).sum(dim=1)
    return total, total / m.sum(dim=1)


def hellaswag_eval(model: GPT, examples: list[Example], dist: Dist, device: torch.device, *,
                   dtype: str = "float32", progress: bool = True) -> dict:
    """acc and acc_norm over examples, this rank scoring examples rank, rank+W, ...; counts all-reduced.

    Collective under torchrun (every rank must call it). Pass the plain or DDP/compiled model: it is
    unwrapped, run in eval mode and put back in its previous mode. Returns acc, acc_norm, correct,
    correct_norm and n (the number of examples).
    """
    if not examples:
        raise ValueError("no HellaSwag examples to evaluate")
    model = unwrap(model)
    was_training = model.training
    model.eval()
    counts = torch.zeros(3, dtype=torch.float64, device=device)  # correct, correct_norm, n
    mine = examples[dist.rank::dist.world_size]
    bar = _progress(mine, enabled=progress and dist.is_main, world_size=dist.world_size)
    try:
        with precision.autocast(dtype, device):
            for ex in bar:
                tokens, mask = example_rows(ex, model.config.block_size)
                total, mean = score_endings(model, tokens.to(device), mask.to(device))
                counts += torch.tensor([int(total.argmax()) == ex.label, int(mean.argmax()) == ex.label, 1],
                                       dtype=torch.float64, device=device)
    finally:
        model.train(was_training)
    correct, correct_norm, n = (int(v) for v in all_reduce_sum(counts, dist).tolist())
    return {"acc": correct / n, "acc_norm": correct_norm / n, "correct": correct, "correct_norm": correct_norm,
            "n": n}


def _progress(items, *, enabled: bool, world_size: int):
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=f"hellaswag (rank 0 of {world_size})", unit="ex", file=sys.stderr, mininterval=1.0)


@torch.no_grad()
def validation_loss(model: torch.nn.Module, loader, dtype: str, dist: Dist) -> float:
    """Mean loss per token over an EvalLoader's fixed set, reduced over ranks (the trainer's evaluation).

    Runs the model (plain, compiled or DDP-wrapped: DDP's own wrapper is skipped) in eval mode and
    puts it back in the mode it was in. Padded rows of a short last batch have targets -1 and do not count.
    """
    model = getattr(model, "module", model)  # DDP: no gradient hooks, no buffer sync for an evaluation
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, device=dist.device, dtype=torch.float64)
    try:
        with precision.autocast(dtype, dist.device):
            for x, y in loader:
                _, loss = model(x, y, return_logits=False)
                n = (y != -1).sum()
                totals += torch.stack([loss.double() * n, n.double()])
    finally:
        model.train(was_training)
    all_reduce_sum(totals, dist)
    return (totals[0] / totals[1]).item()


def val_loss(model: GPT, data_dir: str | Path, dist: Dist, *, eval_tokens: int, batch_size: int,
             dtype: str = "float32") -> dict:
    """Mean loss per token over the first eval_tokens of the val shards (the trainer's evaluation)."""
    from gpt2.data import EvalLoader, find_shards

    model = unwrap(model)
    loader = EvalLoader(find_shards(data_dir, "val"), micro_batch_size=batch_size, seq_len=model.config.block_size,
                        eval_tokens=eval_tokens, rank=dist.rank, world_size=dist.world_size, device=dist.device)
    if loader.n_seqs == 0:
        raise ValueError(f"--eval-tokens {eval_tokens} is less than one sequence of block_size="
                         f"{model.config.block_size} tokens (or the val shards are that short)")
    loss = validation_loss(model, loader, dtype, dist)
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": loader.tokens,
            "clamped": loader.clamped}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gpt2.eval", allow_abbrev=False,
                                     description="Evaluate a checkpoint or Hugging Face GPT-2 directory.")
    sub = parser.add_subparsers(dest="task", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--checkpoint", required=True,
                        help="step_*.pt file, run directory (newest valid checkpoint), or Hugging Face directory")
    common.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    common.add_argument("--dtype", choices=precision.DTYPES, default="auto",
                        help="autocast dtype (auto: what this device runs fast, see gpt2/precision.py)")
    common.add_argument("--json", action="store_true", help="print the result as one JSON line")
    common.add_argument("--num-threads", type=int, default=0,
                        help="CPU threads per rank (0: the node's cores divided among its ranks)")
    hs = sub.add_parser("hellaswag", parents=[common], help="HellaSwag acc / acc_norm (completion style)")
    hs.add_argument("--data", default=None,
                    help=f"HellaSwag jsonl; downloaded here if missing (default {default_data_path()})")
    hs.add_argument("--url", default=HELLASWAG_URL, help="where to download the file from when missing")
    hs.add_argument("--limit", type=int, default=None, help="only the first N examples")
    loss = sub.add_parser("loss", parents=[common], help="validation loss and perplexity on *val*.bin shards")
    loss.add_argument("--data-dir", required=True, help="directory holding *val*.bin shards")
    loss.add_argument("--eval-tokens", type=int, default=10_485_760, help="tokens to evaluate (from the start)")
    loss.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass per rank")
    return parser


def main(argv: list[str] | None = None) -> int:
    from gpt2.dist import resolve_device, set_cpu_threads, setup, teardown, world_from_env

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
            device = resolve_device(args.device, info.local_rank)
            model, source = load_any(args.checkpoint, device)
            dist = setup(info, device, timeout_s=600.0)
            set_cpu_threads(dist, args.num_threads)
            # rank 0 chooses for every rank (auto measures the CPU: ranks must not disagree)
            dtype = broadcast_object(precision.resolve(args.dtype, device).dtype if dist.is_main else None, dist)
            if args.task == "hellaswag":
                examples = prepare_hellaswag(args.data, dist, url=args.url, limit=args.limit)
            else:
                result = val_loss(model, args.data_dir, dist, eval_tokens=args.eval_tokens,
                                  batch_size=args.batch_size, dtype=dtype)
        except ValueError as e:
            if info is None or info.rank == 0:
                print(f"gpt2.eval: error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
        if args.task == "hellaswag":
            result = hellaswag_eval(model, examples, dist, device, dtype=dtype)
        if dist.is_main:
            print(json.dumps(result) if args.json else _describe(args.task, result, source))
        return 0
    finally:
        teardown(dist)


def _describe(task: str, r: dict, source: dict) -> str:
    where = f"{source['source']} {source['path']}"
    if task == "hellaswag":
        return (f"hellaswag {where}: acc {r['acc']:.4f} ({r['correct']}/{r['n']}) | "
                f"acc_norm {r['acc_norm']:.4f} ({r['correct_norm']}/{r['n']})")
    clamped = " (all the val shards hold)" if r["clamped"] else ""
    return f"val loss {where}: {r['loss']:.4f} | perplexity {r['perplexity']:.2f} | {r['tokens']:,} tokens{clamped}"


if __name__ == "__main__":
    sys.exit(main())
