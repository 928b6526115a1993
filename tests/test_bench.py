"""The benchmark scripts run and print their tables: a benchmark that crashes reports nothing.

Tiny settings: these check that the scripts work against the current code, not the numbers.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_bench(*args: str, timeout: int) -> str:
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_prep_throughput_prints_its_table_with_identical_bytes():
    out = run_bench("bench/prep_throughput.py", "--mb", "1", "--rounds", "2", timeout=300)
    row = next(line for line in out.splitlines() if line.startswith("| 1 MB"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-1] == "yes"  # -w1 and -w2 wrote the same bytes
    assert re.fullmatch(r"[\d.]+x \([\d.]+, [\d.]+\)", cells[6]), cells[6]  # ratio and both rounds
    assert int(cells[1].replace(",", "")) > 100_000


@pytest.mark.slow
def test_train_throughput_runs_every_row_and_states_the_goals(tmp_path):
    md = tmp_path / "report.md"
    out = run_bench("bench/train_throughput.py", "--steps", "1", "--warmup", "1", "--ddp-rounds", "1",
                    "--md", str(md), timeout=1500)
    rows = [line for line in out.splitlines() if line.startswith("| ") and "configuration" not in line]
    names = [r.split("|")[1].strip() for r in rows]
    assert names == ["fp32 eager", "fp32 compiled", "bf16 compiled, plain loss + for-loop AdamW",
                     "bf16 compiled, chunked loss + for-loop AdamW", "bf16 compiled", "train_ddp.py, bf16 compiled",
                     "torchrun train_ddp.py, bf16 compiled"]
    losses = {float(r.strip("|").split("|")[-1]) for r in rows}
    assert all(10.5 < x < 11.2 for x in losses)  # random tokens: ~ln(50257) at step 1
    assert re.search(r"- bf16 compiled: MFU [\d.]+% \(goal >= 60%\)", out)
    assert re.search(r"- DDP efficiency 2 x 1 / 1 x 2: [\d.]+% \(goal >= 90%\)", out)
    assert md.read_text().strip() == out.strip()
