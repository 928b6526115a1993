"""A real short run of the trainer, judged by its own metrics: `train_ddp.py FLAGS` (after --), then every
step's step_s, tok_per_s and mfu from the run's metrics.jsonl, the evaluation steps and the final step
marked, and a verdict (bench/gpu_session.py's `realrun` step: --preset gpt2, 8 steps, evaluation at 4 and 8).

    python bench/realrun.py --md realrun.md -- --preset gpt2 --device cuda --data-dir .gpu/data \\
        --out-dir runs/realrun --max-steps 8 --eval-interval 4 --eval-tokens 65536 --ckpt-interval 0

Verdict (verdict()): every evaluation step's and the final step's step_s within [0.5x, 2x] of the median of
the ordinary steps (neither the first, which compiles, nor an evaluation or the final step), and an MFU on
every step after the first. Exit 1 on FAIL (--report-only: 0 whenever the run finished and the report was
written: the CPU smoke test, whose millisecond steps prove the parsing, not the times).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOW, HIGH = 0.5, 2.0
"""An evaluation or final step's step_s must lie within [LOW, HIGH] x the ordinary steps' median."""


def read_jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line
            continue
    return out


def step_rows(records: list[dict]) -> list[dict]:
    """One row per training step: step, step_s, tok_per_s, mfu, mem_mb, and kind: first, eval, final,
    eval+final or ordinary (evaluation steps: those with a val_loss record)."""
    evals = {r["step"] for r in records if "val_loss" in r}
    steps = sorted((r for r in records if "step_s" in r), key=lambda r: r["step"])
    last = steps[-1]["step"] if steps else None
    rows = []
    for i, r in enumerate(steps):
        kinds = [k for k, on in (("eval", r["step"] in evals), ("final", r["step"] == last)) if on]
        kind = "+".join(kinds) or ("first" if i == 0 else "ordinary")
        rows.append({k: r.get(k) for k in ("step", "step_s", "tok_per_s", "mfu", "mem_mb")} | {"kind": kind})
    return rows


def verdict(rows: list[dict]) -> tuple[bool, list[str]]:
    """(passed, Markdown lines): the module docstring's two checks."""
    ordinary = [r["step_s"] for r in rows if r["kind"] == "ordinary"]
    if not ordinary:
        return False, ["- no ordinary step (not the first, an evaluation or the final): nothing to compare: **FAIL**"]
    med = statistics.median(ordinary)
    lines, ok = [f"- median step_s of the {len(ordinary)} ordinary steps: {med:.4f} s"], True
    for r in rows:
        if r["kind"] in ("first", "ordinary"):
            continue
        ratio = r["step_s"] / med
        good = LOW <= ratio <= HIGH
        ok &= good
        lines.append(
            f"- step {r['step']} ({r['kind']}): {r['step_s']:.4f} s = {ratio:.2f}x the median "
            f"(within [{LOW}x, {HIGH}x]: {'yes' if good else '**no**'})"
        )
    if not any(r["kind"] not in ("first", "ordinary") for r in rows):
        ok = False
        lines.append("- no evaluation or final step was recorded")
    no_mfu = [r["step"] for r in rows[1:] if r["mfu"] is None]
    ok &= not no_mfu
    lines.append(
        "- MFU on every step after the first: " + ("yes" if not no_mfu else f"**no** (null at steps {no_mfu})")
    )
    lines.append(f"- realrun: **{'PASS' if ok else 'FAIL'}**")
    return ok, lines


def report(rows: list[dict], command: str) -> tuple[bool, str]:
    lines = [
        f"command: `{command}`",
        "",
        "| step | kind | step_s | tok/s | MFU | mem MiB |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "null"
        mem = f"{r['mem_mb']:,.0f}" if r.get("mem_mb") is not None else "-"
        kind = f"**{r['kind']}**" if r["kind"] not in ("first", "ordinary") else r["kind"]
        lines.append(f"| {r['step']} | {kind} | {r['step_s']:.4f} | {r['tok_per_s']:,.0f} | {mfu} | {mem} |")
    ok, said = verdict(rows)
    return ok, "\n".join(lines + [""] + said) + "\n"


def out_dir(flags: list[str]) -> Path:
    for i, f in enumerate(flags):
        if f == "--out-dir":
            return Path(flags[i + 1])
        if f.startswith("--out-dir="):
            return Path(f.split("=", 1)[1])
    raise SystemExit("realrun.py: error: give the run's --out-dir after --")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--md", type=Path, help="write the report here too")
    ap.add_argument("--json", type=Path, help="write the rows and the verdict here")
    ap.add_argument("--report-only", action="store_true", help="exit 0 whatever the verdict (a smoke test)")
    args = ap.parse_args(argv[:cut])
    flags = argv[cut + 1 :]
    run_dir = out_dir(flags)
    cmd = [sys.executable, "train_ddp.py", *flags]
    command = "python train_ddp.py " + " ".join(flags)
    print("$ " + command, flush=True)
    done = subprocess.run(cmd, cwd=REPO)
    metrics = run_dir / "metrics.jsonl"
    if done.returncode or not metrics.is_file():
        print(
            f"realrun.py: error: train_ddp.py exited {done.returncode}"
            + ("" if metrics.is_file() else f"; {metrics} is absent"),
            file=sys.stderr,
        )
        return 1
    rows = step_rows(read_jsonl(metrics))
    ok, text = report(rows, command)
    print(text)
    if args.md:
        args.md.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "passed": ok, "command": command}, indent=1) + "\n")
    return 0 if ok or args.report_only else 1


if __name__ == "__main__":
    sys.exit(main())
