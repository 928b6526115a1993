"""How long a checkpoint stops training: a synchronous save against a background one (--async-ckpt).

    python bench/checkpoint_stall.py                  # the gpt2 preset (124M + AdamW, ~1.5 GB), ~2 min
    python bench/checkpoint_stall.py --preset debug --reps 1   # seconds

The state is what the trainer saves (weights, AdamW's two moments after one step, config, loader and
RNG state), on the CPU. After a warm-up round (the writer's first save allocates the buffers it then
reuses: that copy is 2-3x slower), each round times, alternately (so both see the same machine load):
  sync    gpt2.ckpt.checkpoint.save_checkpoint: torch.save, sha256, fsync, rename, sidecar, `latest`; the
          training loop waits for all of it.
  async   gpt2.ckpt.writer.CheckpointWriter: submit() at the step boundary, then the next micro-step's
          forward and backward (--tokens) while the writer thread copies the state to host memory,
          then wait_copied() before the optimizer update, as train_step does. The stall is the time
          the loop spends in submit() and wait_copied(); the thread then writes exactly what the
          synchronous save writes (background write).
Files go to --dir (default: a temporary directory next to the system's, removed after), keep=1.

--device cuda: the state lives on the GPU, as the trainer's does, and the forward and backward run there
under --dtype autocast (default bf16), e.g. `--device cuda --tokens 16384` (one micro-step of 16 x 1024).
The copy is then queued on the training stream (pinned, non-blocking) and the next kernels run after
it, so the host sees no wait: the stall is measured on the device's clock instead, as the round's
submit + forward + backward + wait_copied, synchronized, minus the same forward and backward alone
(timed just before, synchronized); fwd+bwd is that alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpt2.ckpt import checkpoint as ckpt
from gpt2.ckpt.writer import CheckpointWriter
from gpt2.core import precision
from gpt2.core.config import RunConfig, TrainConfig, model_preset
from gpt2.model.gpt import GPT
from gpt2.train.session import make_optimizer


def trainer_like_state(preset: str, device: torch.device | None = None):
    """A model of `preset` on device, AdamW after one step, and the dict gpt2/train/trainer.py save() would hand to
    the writer."""
    device = torch.device("cpu") if device is None else device
    torch.manual_seed(0)
    mc = model_preset(preset)
    tc = TrainConfig.of(data_dir="d", out_dir="o", dtype="float32")
    model = GPT(mc).to(device)
    opt = make_optimizer(model, tc.optim, device, peak_lr=tc.schedule.lr, prec=precision.FLOAT32)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return (
        model,
        opt,
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scaler": {},
            "config": RunConfig(mc, tc).to_dict(),
            "tokenizer": "gpt2",
            "loader": {"position": 0},
            "rng": [
                {
                    "torch": torch.get_rng_state(),
                    **({"cuda": torch.cuda.get_rng_state(device)} if device.type == "cuda" else {}),
                }
            ],
            "world_size": 1,
            "tokens": 0,
            "torch_version": str(torch.__version__),
        },
    )


def tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from tensors(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt2", help="model preset (gpt2/core/config.py)")
    ap.add_argument("--reps", type=int, default=3, help="rounds of (sync, async), alternating which goes first")
    ap.add_argument(
        "--tokens",
        type=int,
        default=1024,
        help="tokens of the forward+backward that runs while the state is copied (one micro-step)",
    )
    ap.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the state and the step live")
    ap.add_argument(
        "--dtype",
        default=None,
        help="autocast dtype of the forward and backward (default: bfloat16 on cuda, float32 on cpu)",
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("checkpoint_stall.py: error: --device cuda: no CUDA device here", file=sys.stderr)
        return 2
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    model, opt, state = trainer_like_state(args.preset, device)
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # the tied weight once
        for part in ("model", "optimizer")
        for t in tensors(state[part])
    }
    state_bytes = sum(storages.values())
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows = run_rounds(model, opt, state, Path(tmp), args.reps, args.tokens, dtype)
        size = next(Path(tmp, "sync", "checkpoints").glob("*.pt")).stat().st_size
    where = (
        f"{torch.cuda.get_device_name(device)}, fwd+bwd in {dtype}"
        if device.type == "cuda"
        else f"{torch.get_num_threads()} threads"
    )
    print(
        f"checkpoint of the {args.preset} preset: {size / 1e9:.2f} GB on disk ({state_bytes / 1e9:.2f} GB of "
        f"tensors); torch {torch.__version__}, {where}"
    )
    print("| round | sync save s | async stall s | ratio | copy s | background write s | fwd+bwd s |")
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(
            f"| {i or 'warm-up (allocates the copy buffers)'} | {r['sync']:.2f} | {r['stall']:.3f} | "
            f"{ratio(r['sync'], r['stall'])} | {r['copy']:.2f} "
            f"| {r['write']:.2f} | {r['fwd_bwd']:.3f} |"
        )
    med = {k: statistics.median(r[k] for r in rows[1:]) for k in rows[0]}
    print(
        f"| median | {med['sync']:.2f} | {med['stall']:.3f} | {ratio(med['sync'], med['stall'])} | "
        f"{med['copy']:.2f} | {med['write']:.2f} | {med['fwd_bwd']:.3f} |"
    )
    print(f"sync save writes {size / 1e9 / med['sync']:.2f} GB/s here (torch.save + sha256 + fsync)")
    return 0


def ratio(sync_s: float, stall_s: float) -> str:
    """How many times shorter the stall is; on CUDA a stall within timing noise can come out <= 0."""
    return f"{sync_s / stall_s:.1f}x" if stall_s > 0 else "n/a (stall within timing noise)"


def run_rounds(model: GPT, opt, state: dict, root: Path, reps: int, tokens: int, dtype: str = "float32") -> list[dict]:
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    writer = CheckpointWriter(device)
    x = torch.randint(
        0, 50257, (max(1, tokens // model.config.block_size), min(tokens, model.config.block_size)), device=device
    )

    def fwd_bwd():
        with precision.Precision(dtype, dtype).autocast(device):  # the --dtype flag's name
            _, loss = model(x, x, return_logits=False)
        loss.backward()

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    rows = []
    for rep in range(reps + 1):  # round 0: the first background save allocates its buffers
        row = {}
        for kind in ("sync", "async") if rep % 2 else ("async", "sync"):
            sync()
            t0 = time.perf_counter()
            if kind == "sync":
                ckpt.save_checkpoint(root / "sync", rep, state, keep=1)
                row["sync"] = time.perf_counter() - t0
                continue
            if cuda:  # the same forward and backward alone, on the device's clock: what the stall adds to
                fwd_bwd()
                sync()
                row["fwd_bwd"] = time.perf_counter() - t0
                opt.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
            writer.submit(root / "async", rep, state, keep=1)
            stall = time.perf_counter() - t0
            t1 = time.perf_counter()  # the next step's forward and backward run while the state is copied
            fwd_bwd()
            if not cuda:
                row["fwd_bwd"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            writer.wait_copied()  # what train_step does before the optimizer update
            sync()
            row["stall"] = (time.perf_counter() - t0 - row["fwd_bwd"]) if cuda else stall + time.perf_counter() - t2
            opt.step()
            opt.zero_grad(set_to_none=True)
            done = writer.wait()  # before the next timing: one thing at a time
            row["copy"], row["write"] = done["copy_s"], done["write_s"]
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
