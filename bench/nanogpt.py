"""nanoGPT itself, as a reference the benchmarks run side by side with ours: fetched, pinned, never copied.

--nanogpt SOURCE (default $NANOGPT_DIR where set, else https://github.com/karpathy/nanoGPT; a local clone,
bare repository or mirror works too) is cloned once into runs/bench/nanogpt-<PINNED[:12]> and checked out
at PINNED, the commit the
benchmarks' flags and log parsing were written against: a source without it, or a cache checked out at
another commit, is refused with one line. nanoGPT then runs as its users run it, `python train.py
--key=value ...` in its own directory, on a data directory of its format (data/<name>/train.bin and
val.bin, headerless uint16) written from our shards, so both read the same tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpt2.data.shards import read_header

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = "https://github.com/karpathy/nanoGPT"
PINNED = "3adf61e154c3fe3fca428ad6bc3818b27a3b8291"
"""karpathy/nanoGPT master as of 2025 (README: 'mention nanochat and deprecation'); train.py unchanged since 2023."""
CACHE = REPO / "runs" / "bench"
ITER_LINE = re.compile(r"^iter (\d+): loss ([\d.]+|nan), time ([\d.]+)ms")


SOURCE_ENV = "NANOGPT_DIR"
"""A local clone or mirror of nanoGPT holding PINNED: where the benchmarks and scripts/gpu_prepare.sh take it
from when no --nanogpt is given (a machine without the network to GitHub)."""


class NanoGPTError(RuntimeError):
    """nanoGPT could not be fetched, pinned or run: the message says which and what to do."""


def default_source() -> str:
    """--nanogpt's default: $NANOGPT_DIR, else GitHub."""
    return os.environ.get(SOURCE_ENV) or DEFAULT_SOURCE


def reachable_source() -> tuple[str | None, str]:
    """(a source the pinned commit can be had from, or None; why none) for the tests that run nanoGPT:
    $NANOGPT_DIR, the benchmarks' cache already checked out, or GitHub when it answers within 30 s."""
    if os.environ.get(SOURCE_ENV):
        return os.environ[SOURCE_ENV], ""
    if (CACHE / f"nanogpt-{PINNED[:12]}" / ".git").exists():
        return DEFAULT_SOURCE, ""  # checkout() finds the cache and clones nothing
    try:
        done = subprocess.run(["git", "ls-remote", DEFAULT_SOURCE, "HEAD"], capture_output=True, timeout=30)
    except (subprocess.TimeoutExpired, OSError):
        done = None
    if done is not None and done.returncode == 0:
        return DEFAULT_SOURCE, ""
    return None, (
        f"no nanoGPT reference: ${SOURCE_ENV} is not set (a local clone or mirror of "
        f"github.com/karpathy/nanoGPT holding {PINNED[:12]}), no runs/bench/nanogpt-{PINNED[:12]} cache, "
        "and github.com did not answer"
    )


def add_nanogpt_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--nanogpt",
        default=default_source(),
        help=f"where to clone nanoGPT from: a URL or a local git directory (default ${SOURCE_ENV} where "
        f"set, else {DEFAULT_SOURCE}); 'none' leaves out every nanoGPT row",
    )
    ap.add_argument(
        "--nanogpt-commit",
        default=PINNED,
        help=f"the nanoGPT commit (only the pinned one, {PINNED[:12]}, is accepted: the flags "
        "and log lines this script relies on are those of that commit)",
    )


def add_side_by_side_flags(ap: argparse.ArgumentParser) -> None:
    """What every benchmark that runs nanoGPT beside ours takes: --md, where nanoGPT comes from, the corpus."""
    from corpus import add_corpus_flag  # bench/corpus.py

    ap.add_argument("--md", type=Path, help="also write the report here")
    add_nanogpt_flags(ap)
    add_corpus_flag(ap)


def checkout(source: str, commit: str = PINNED, cache: Path = CACHE) -> Path:
    """nanoGPT's working tree at the pinned commit, cloned from source into cache once; a source that is
    itself a working tree checked out at the pinned commit (scripts/gpu_prepare.sh's .gpu/nanogpt) is
    used in place, without git (a GPU machine may have none)."""
    if commit != PINNED:
        raise NanoGPTError(
            f"--nanogpt-commit {commit} is not the pinned {PINNED}: this benchmark parses that "
            "commit's train.py flags and log lines; check another commit's and change PINNED in "
            "bench/nanogpt.py to use it"
        )
    if (Path(source) / "train.py").is_file() and detached_head(Path(source)) == PINNED:
        return Path(source).resolve()
    tree = cache / f"nanogpt-{PINNED[:12]}"
    if not (tree / ".git").exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".nanogpt-{PINNED[:12]}.partial"
        subprocess.run(["rm", "-rf", str(tmp)], check=True)
        done = subprocess.run(
            ["git", "clone", "--quiet", "--no-checkout", source, str(tmp)], capture_output=True, text=True, timeout=600
        )
        if done.returncode:
            raise NanoGPTError(
                f"cannot clone nanoGPT from {source}: {_last(done.stderr)}; pass --nanogpt "
                f"PATH_OR_URL or set {SOURCE_ENV} (a clone or mirror of github.com/karpathy/nanoGPT), "
                "or --nanogpt none"
            )
        found = subprocess.run(["git", "-C", str(tmp), "checkout", "--quiet", PINNED], capture_output=True, text=True)
        if found.returncode:
            raise NanoGPTError(f"{source} does not hold the pinned nanoGPT commit {PINNED}: {_last(found.stderr)}")
        tmp.rename(tree)
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if head != PINNED:
        raise NanoGPTError(
            f"{tree} is checked out at {head or 'nothing'}, not the pinned {PINNED}: remove that "
            "directory and run again"
        )
    return tree


COMMIT_FILE = ".nanogpt-commit"
"""Written by `bench/gpu_session.py prepare` into its checkout: the commit, for a copy without .git/."""


def detached_head(tree: Path) -> str | None:
    """The commit a working tree's .git/HEAD names when it is detached (40 hex digits), read without git;
    where .git/ is absent, the commit its COMMIT_FILE records."""
    for path in (tree / ".git" / "HEAD", tree / COMMIT_FILE):
        try:
            head = path.read_text().strip()
        except OSError:
            continue
        return head if re.fullmatch(r"[0-9a-f]{40}", head) else None
    return None


def tree_or_exit(source: str, commit: str, prog: str) -> Path | None:
    """A bench's --nanogpt: the checked-out tree, or None for 'none' (no nanoGPT rows); when it cannot
    be had, one line `PROG: error: ...` and exit 2."""
    try:
        return None if source == "none" else checkout(source, commit)
    except NanoGPTError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _last(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no message"


def shard_tokens(data_dir: Path, split: str) -> np.ndarray:
    """Every token of our shards of one split, in file order."""
    paths = sorted(p for p in data_dir.glob("*.bin") if p.name.startswith(f"{split}_") or f"_{split}_" in p.name)
    if not paths:
        raise NanoGPTError(f"no {split} shards in {data_dir}")
    return np.concatenate([np.fromfile(p, dtype=np.uint16, offset=256 * 4, count=read_header(p)) for p in paths])


def write_dataset(tree: Path, name: str, data_dir: Path) -> str:
    """nanoGPT's data/<name>/{train,val}.bin (headerless uint16) holding our shards' tokens; returns name."""
    out = tree / "data" / name
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        shard_tokens(data_dir, split).astype(np.uint16).tofile(out / f"{split}.bin")
    return name


@dataclass(frozen=True)
class NanoRun:
    step_s: list[float]
    """Each iteration's time as train.py prints it (iter 0 first)."""
    losses: list[float]
    out_dir: Path
    peak_mib: float | None = None
    """Peak memory as the MEASURE_MEMORY wrapper prints it at exit; None without the wrapper."""
    peak_source: str = ""
    """What peak_mib is: cuda_max_memory_allocated or max_rss."""


def run(
    tree: Path, flags: dict[str, object], out_dir: Path, *, wrapper: str | None = None, timeout: int = 7200
) -> NanoRun:
    """`python train.py --device=cpu --key=value ...` in nanoGPT's tree (flags may name another device);
    its per-iteration times and losses.

    wrapper: Python code run first in the same process (e.g. keeping every checkpoint train.py writes),
    which then runs train.py as __main__; None runs train.py directly."""
    args = [f"--{k}={v}" for k, v in {"device": "cpu", "out_dir": str(out_dir), **flags}.items()]
    cmd = [sys.executable, "train.py", *args] if wrapper is None else [sys.executable, "-c", wrapper, *args]
    done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise NanoGPTError(f"nanoGPT's train.py failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return parse_log(done.stdout, out_dir)


def parse_log(stdout: str, out_dir: Path) -> NanoRun:
    """train.py's `iter N: loss L, time Tms, ...` lines, and MEASURE_MEMORY's `peak_memory_mib M SOURCE`."""
    step_s, losses, peak, source = [], [], None, ""
    for line in stdout.splitlines():
        if m := ITER_LINE.match(line):
            losses.append(float(m[2]))
            step_s.append(float(m[3]) / 1000)
        elif m := PEAK_LINE.match(line):
            peak, source = float(m[1]), m[2]
    if not step_s:
        raise NanoGPTError(f"nanoGPT's train.py printed no 'iter N: loss ..., time ...ms' line:\n{stdout[-2000:]}")
    return NanoRun(step_s, losses, out_dir, peak, source)


PEAK_LINE = re.compile(r"^peak_memory_mib ([\d.]+) (\w+)$")
MEASURE_MEMORY = """\
import atexit, resource, runpy, sys, torch
def _peak():  # train.py prints no memory figure: the process's own peak, as our metrics' mem_mb counts it
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        print('peak_memory_mib %.1f cuda_max_memory_allocated' % (torch.cuda.max_memory_allocated() / 2**20))
    else:
        print('peak_memory_mib %.1f max_rss' % (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
atexit.register(_peak)
sys.argv = ['train.py'] + sys.argv[1:]
runpy.run_path('train.py', run_name='__main__')
"""
"""Runs train.py unchanged and prints its peak memory at exit (CUDA: the caching allocator's
max_memory_allocated, what our metrics' mem_mb records; CPU: the process's max RSS)."""


KEEP_CHECKPOINTS = """\
import os, runpy, sys, torch
_save = torch.save
def _keep(obj, f, *a, **k):  # every checkpoint train.py writes, as ckpt_<iter>.pt (it overwrites ckpt.pt)
    if isinstance(f, str) and f.endswith('ckpt.pt') and isinstance(obj, dict) and 'iter_num' in obj:
        f = f[:-len('ckpt.pt')] + 'ckpt_%d.pt' % obj['iter_num']
        obj = {'model': obj['model'], 'model_args': obj['model_args'], 'iter_num': obj['iter_num']}
    return _save(obj, f, *a, **k)
torch.save = _keep
sys.argv = ['train.py'] + sys.argv[1:]
runpy.run_path('train.py', run_name='__main__')
"""
"""Runs train.py unchanged, keeping each checkpoint it writes (weights only) under its own name."""


def load_model(tree: Path, ckpt: Path):
    """nanoGPT's own GPT (model.py of the pinned tree) with a checkpoint's weights, in eval mode."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("nanogpt_model", tree / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    with contextlib.redirect_stdout(io.StringIO()):  # its "number of parameters" line, once per checkpoint
        model = module.GPT(module.GPTConfig(**state["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in state["model"].items()})
    return model.eval()
