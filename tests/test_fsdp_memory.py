"""bench/fsdp_memory.py: DDP against FSDP peak memory per rank on 2 CPU gloo ranks, with the planner beside it.

A tiny shape where the state still dominates (the debug preset: 7.2M parameters, 16 bytes each under
AdamW, against one 128-token sequence; measured 0.85 FSDP/DDP); the README's gpt2-medium table comes from
the same script at its defaults.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.torch_feature("fsdp")  # FSDP2 on CPU: torch >= 2.6 (gpt2/core/compat.py)


@pytest.mark.slow
def test_fsdp_memory_bench_measures_both_modes_and_fsdp_holds_less(tmp_path):
    # Twice the debug preset's width at half its block: the state (weights, gradients, AdamW's moments) outweighs
    # the LM head's logits, so sharding it shows (at the debug shape the eager loss's 12 B/logit about equals
    # what sharding saves, and the two modes measured within a few percent of each other).
    done = subprocess.run(
        [
            sys.executable,
            "bench/fsdp_memory.py",
            "--preset",
            "debug",
            "--n-embd",
            "256",
            "--block-size",
            "64",
            "--steps",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {}
    for line in done.stdout.splitlines():
        m = re.fullmatch(
            r"\| (ddp|fsdp) \| ([\d,]+) MiB \| ([\d,]+) MiB \| ([\d,]+) MiB \| ([\d.]+) \| ([\d.]+) \|", line
        )
        if m:
            rows[m.group(1)] = [float(g.replace(",", "")) for g in m.groups()[1:]]
    assert set(rows) == {"ddp", "fsdp"}, done.stdout
    for mode, (rank0, rank1, predicted, ratio, _loss) in rows.items():
        assert rank0 > 0 and rank1 > 0 and predicted > 0, (mode, done.stdout)
        assert abs(ratio - max(rank0, rank1) / predicted) < 0.01, (mode, done.stdout)
    assert rows["ddp"][4] == rows["fsdp"][4]  # the same step's loss: the same training maths
    ratio = re.search(r"FSDP/DDP peak per rank: ([\d.]+)", done.stdout)
    assert ratio, done.stdout
    measured = max(rows["fsdp"][:2]) / max(rows["ddp"][:2])
    assert abs(float(ratio.group(1)) - measured) < 0.01
    assert measured < 1  # the state dominates: sharding it must show
    assert rows["fsdp"][2] < rows["ddp"][2]  # and the planner predicts the same direction


def test_fsdp_memory_bench_refuses_a_bad_value_in_one_line():
    done = subprocess.run(
        [sys.executable, "bench/fsdp_memory.py", "--steps", "0"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error: ")
