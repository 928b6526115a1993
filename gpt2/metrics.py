"""`python -m gpt2.metrics RUN`: draw a run's loss curve (RUN/loss_curve.png) from RUN/metrics.jsonl."""

from __future__ import annotations

import sys
from pathlib import Path

from gpt2.core.args import OneLineParser
from gpt2.train.run_log import plot_loss_curve


def main(argv: list[str] | None = None) -> int:
    """`python -m gpt2.metrics RUN`: (re)draw RUN/loss_curve.png from RUN/metrics.jsonl, e.g. mid-run."""
    parser = OneLineParser(prog="python -m gpt2.metrics", description=main.__doc__)
    parser.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="PNG path (default RUN/loss_curve.png)")
    args = parser.parse_args(argv)
    metrics = Path(args.run_dir) / "metrics.jsonl"
    if not metrics.is_file():
        parser.exit(2, f"error: {metrics} not found: is {args.run_dir} a run directory?\n")
    png = plot_loss_curve(metrics, args.out or Path(args.run_dir) / "loss_curve.png")
    if png is None:
        parser.exit(2, "error: matplotlib is not installed: pip install matplotlib\n")
    print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
