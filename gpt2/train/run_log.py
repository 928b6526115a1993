"""Rank-0 logging: one stdout line per logged step, RUN/metrics.jsonl, RUN/train.log, optional TensorBoard / W&B.

Every method is safe to call on every rank; only rank 0 writes.

Three kinds of line: info (the console and RUN/train.log), warn (stderr, marked, and the log) and detail
(the log; the console only with --verbose). The start-up's plan is detail: a newcomer's console gets the
few lines that say what runs, the log keeps every line for whoever asks why.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

from gpt2.ckpt.rundir import TRAIN_LOG
from gpt2.core.atomic import atomic_write_text
from gpt2.distributed.group import Dist


def _fmt_mfu(mfu: float | None) -> str:
    """MFU as a percentage; n/a where the device's peak is unknown (see gpt2.plan.flops.device_peak_flops)."""
    return "  n/a " if mfu is None else f"{mfu * 100:5.1f}%"


def _fmt(value, spec: str) -> str:
    return "nan" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


class RunLog:
    def __init__(
        self,
        dist: Dist,
        out_dir: str | Path,
        *,
        tensorboard: bool = False,
        wandb_project: str = "",
        run_config: dict | None = None,
        verbose: bool = True,
        log_file: bool = False,
        console: bool = True,
    ) -> None:
        """verbose: detail lines on the console too (the trainer passes --verbose; other callers see all).
        console: False keeps info and detail lines off the console (a benchmark's Session: the start-up's lines
        go to RUN/train.log alone); warnings still reach stderr.
        log_file: keep every line for RUN/train.log, which open_sinks(log_file=True) opens (until then they
        wait in memory: RUN may still hold an earlier run's records)."""
        self.active = dist.is_main
        self.path = Path(out_dir) / "metrics.jsonl"
        self.verbose, self.console = verbose, console
        self._tb = self._wandb = self._text = None
        self._pending: list[str] | None = [] if log_file else None
        self._held: list[tuple[str, str]] | None = None
        if not self.active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.open_sinks(tensorboard=tensorboard, wandb_project=wandb_project, run_config=run_config)

    def open_sinks(
        self,
        *,
        tensorboard: bool = False,
        wandb_project: str = "",
        run_config: dict | None = None,
        log_file: bool = False,
    ) -> None:
        """Start TensorBoard (RUN/tb), W&B (RUN/wandb) and (log_file) RUN/train.log, appended to: a resumed
        run's log goes on. They write into RUN at once, so the trainer opens them only after an earlier
        run's records there have been moved aside."""
        if not self.active:
            return
        out_dir = self.path.parent
        if log_file and self._text is None and self._pending is not None:
            self._text = out_dir / TRAIN_LOG
            self._append_text(self._pending)
            self._pending = None
        if tensorboard and self._tb is None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self._tb = SummaryWriter(str(out_dir / "tb"))
        if wandb_project and self._wandb is None:
            import wandb

            self._wandb = wandb.init(project=wandb_project, config=run_config, dir=str(out_dir), resume="allow")

    def truncate_after(self, step: int) -> None:
        """On resume: keep only records up to `step`, so the log reads like one uninterrupted run. A last
        line cut mid-record (a full disk, a copy cut short) is dropped with a warning naming the rows
        lost: the resume does not run the steps up to `step` again."""
        if not self.active or not self.path.is_file():
            return
        text = self.path.read_text()
        records = parse_records(text, self.path)
        kept = [rec for rec in records if rec.get("step", 0) <= step]
        problem = lost_rows(text, records, step, self.path)
        if problem:
            self.warn(problem)
        atomic_write_text(self.path, "".join(json.dumps(rec) + "\n" for rec in kept))

    def info(self, message: str) -> None:
        self._line("info", message)

    def warn(self, message: str) -> None:
        self._line("warn", f"warning: {message}")

    def detail(self, message: str) -> None:
        """A line for RUN/train.log, on the console only with --verbose (the start-up's plan)."""
        self._line("detail", message)

    def hold(self) -> None:
        """Keep the lines from here until release(): the start-up's checks print nothing before they pass,
        so a refusal is the first thing a console shows after the `starting` line."""
        if self.active:
            self._held = []

    def release(self, *, console: bool = True) -> None:
        """The held lines, in order. console=False (a refusal followed): only --verbose shows them."""
        held, self._held = self._held or [], None
        for kind, message in held:
            if console or self.verbose:
                self._emit(kind, message)

    def _line(self, kind: str, message: str) -> None:
        if not self.active:
            return
        if self._held is not None:
            self._held.append((kind, message))
        else:
            self._emit(kind, message)

    def _emit(self, kind: str, message: str) -> None:
        if kind == "warn":
            print(message, file=sys.stderr, flush=True)
        elif self.console and (kind == "info" or self.verbose):
            print(message, flush=True)
        if self._text is not None:
            self._append_text([message])
        elif self._pending is not None:
            self._pending.append(message)

    def _append_text(self, lines: list[str]) -> None:
        """Opened for each write, as metrics.jsonl is: no file of RUN stays open for writing between steps
        (a file system remounted read-only, or unmounted for a copy, then needs no open file closed first)."""
        with open(self._text, "a", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)

    def record(self, rec: dict) -> None:
        """Append one JSON record (train step, eval, sample or event) to metrics.jsonl."""
        if not self.active:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        scalars = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, rec["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=rec["step"])

    def log_step(self, rec: dict, max_steps: int) -> None:
        self.record(rec)
        skipped = "  SKIPPED (non-finite)" if rec.get("skipped") else ""
        if rec.get("overflow"):  # fp16: the loss scaler's own skip, part of its normal working
            skipped = f"  overflow: update skipped by the loss scaler (scale now {rec['loss_scale']:g})"
        self.info(
            f"step {rec['step']:>6}/{max_steps} | loss {_fmt(rec['loss'], '.4f')} | lr {rec['lr']:.3e} | "
            f"norm {_fmt(rec['grad_norm'], '.3f')} | {rec['step_s'] * 1000:7.1f} ms | "
            f"{rec['tok_per_s']:>9,.0f} tok/s | mfu {_fmt_mfu(rec.get('mfu'))} | mem {rec['mem_mb']:,.0f} MB{skipped}"
        )

    def log_eval(
        self, step: int, tokens: int, val_loss: float, val_tokens: int, per_source: dict[str, float] | None = None
    ) -> None:
        """val_tokens: how many tokens the loss is the mean over (the first --eval-tokens of the val split,
        as whole sequences; of each source's, for a mixture), said on the line: `python -m gpt2.eval loss`
        over another count (its default is 10M: all of a small val split) gives another number for the same
        checkpoint. per_source: a mixture's val_loss/NAME, val_loss being their weighted mean."""
        per_source = per_source or {}
        by_source = {f"val_loss/{name}": loss for name, loss in per_source.items()}
        self.record({"step": step, "tokens": tokens, "val_loss": val_loss, **by_source, "val_tokens": val_tokens})
        each = " (" + ", ".join(f"{name} {loss:.4f}" for name, loss in per_source.items()) + ")" if per_source else ""
        self.info(
            f"step {step:>6} | val loss {val_loss:.4f}{each} | ppl {math.exp(min(val_loss, 50)):.2f} | "
            f"{val_tokens:,} val tokens"
        )

    def close(self) -> None:
        self._text = None
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def parse_records(text: str, where: str | Path) -> list[dict]:
    """The records of metrics.jsonl text. Only the last line may be incomplete (a live run is writing
    it, or a crash tore it): it is dropped. Any other line that is not a JSON object is damage, and a
    ValueError names it: dropping it silently would hide lost records."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict):
            out.append(rec)
        elif i < len(lines):
            raise ValueError(
                f"{where}:{i}: not a JSON record ({line[:60]!r}); the metrics log is damaged. "
                "Repair or remove that line (or move the file away) and rerun"
            )
    return out


def lost_rows(text: str, records: list[dict], step: int, where: str | Path) -> str | None:
    """A warning when metrics.jsonl text ends in a line cut mid-record (parse_records drops it) whose
    row a resume from `step` will not write again; None otherwise (e.g. the row of a step past `step`,
    which the resumed run logs anew)."""
    lines = text.splitlines()
    last = len(lines)
    while last and not lines[last - 1].strip():
        last -= 1
    if not last:
        return None
    try:
        if isinstance(json.loads(lines[last - 1]), dict):
            return None
    except ValueError:
        pass
    cut = lines[last - 1]
    found = re.match(r'\s*\{\s*"step"\s*:\s*(\d+)', cut)
    before = max((r["step"] for r in records if isinstance(r.get("step"), int)), default=0)
    cut_step = int(found.group(1)) if found else None
    if (cut_step if cut_step is not None else before) > step:  # rows are in step order: a later step's
        return None  # row, which the resumed run writes again
    if cut_step is None:
        lost = f"a row logged after step {before} is"
    elif cut_step < step:
        lost = f"the row of step {cut_step}, and any logged after it up to step {step}, are"
    else:
        lost = f"a row of step {cut_step} is"
    return (
        f"{where}:{last} was cut mid-record ({cut[:60]!r}) and is dropped: {lost} lost (the run resumes "
        f"at step {step} and does not run those steps again)"
    )


def read_metrics(path: str | Path, *, missing_ok: bool = False) -> list[dict]:
    """The records of a metrics.jsonl (see parse_records); a missing file is [] with missing_ok."""
    path = Path(path)
    if missing_ok and not path.is_file():
        return []
    return parse_records(path.read_text(), path)


def plot_loss_curve(metrics_path: str | Path, out_png: str | Path) -> Path | None:
    """Train and val loss over tokens as a PNG; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    recs = read_metrics(metrics_path)
    train = [
        (r["tokens"], r["loss"]) for r in recs if "loss" in r and r.get("loss") is not None and math.isfinite(r["loss"])
    ]
    val = [(r["tokens"], r["val_loss"]) for r in recs if "val_loss" in r]
    sources = sorted({k for r in recs for k in r if k.startswith("val_loss/")})  # a mixture's, one curve each
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="val loss (weighted mean)" if sources else "val loss")
    for key in sources:
        ax.plot(*zip(*[(r["tokens"], r[key]) for r in recs if key in r]), ".--", label=f"val loss {key[9:]}")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    out_png = Path(out_png)
    tmp = out_png.with_name(out_png.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, out_png)
    return out_png
