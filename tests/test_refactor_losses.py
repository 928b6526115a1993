"""The start-up refactor (issue 55: gpt2/train/startup.py, trainer.py, dryrun.py, plan/resolve.py) must
reproduce main's losses bit for bit at c4247b7.

Each case is a short fixed-seed `--preset debug` run of train_ddp.py on CPU in float32, uncompiled, with
every start-up choice that could measure this machine pinned (--micro-batch-size, --loss-impl,
--activation-checkpointing, --num-threads: 0 would share this host's cores), so a run is bitwise the same
run to run. Its per-step training losses (RUN/metrics.jsonl) must equal, with ==, those that c4247b7's
train_ddp.py computed: tests/data/refactor_losses.json, written by this file run at c4247b7 with
REFACTOR_LOSSES_WRITE=1 (json keeps each float's repr, so it round-trips exactly). The references are one
machine's (its torch and the CPU's vector instructions, recorded beside them: an AVX2 AMD EPYC, torch 2.13):
there the losses must be equal; on another (CI's avx512 machines, the torch range) float32's kernels may round
differently in the last bits, so there they must agree to REL (a changed seed, init, schedule or batch
order moves them by far more), and the cases that are one computation (1 process = 2 DDP ranks = 2 FSDP
ranks; the resumed steps = the uninterrupted run's) must still be equal to each other.

Regenerate (only for a deliberate change of the numbers):
    git worktree add /tmp/ref c4247b7 && cp tests/test_refactor_losses.py /tmp/ref/tests/
    (cd /tmp/ref && REFACTOR_LOSSES_WRITE=1 /path/to/.venv/bin/python -m pytest -q tests/test_refactor_losses.py)
    cp /tmp/ref/tests/data/refactor_losses.json tests/data/ && git worktree remove --force /tmp/ref
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from _helpers import losses
from conftest import REPO, run_trainer

REFERENCE = Path(__file__).resolve().parent / "data" / "refactor_losses.json"
WRITE = os.environ.get("REFACTOR_LOSSES_WRITE") == "1"
STEPS = 4
RESUME_AT = 2
REL = 1e-5
"""Off the reference's machine: how far a loss may round away from the reference (a 4-step run's)."""


def machine() -> dict:
    """What float32's last bits depend on here: torch's release and the CPU's widest vector instructions."""
    flags = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return {"torch": torch.__version__, "isa": isa}


PINNED = [
    "--preset",
    "debug",
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--compile",
    "false",
    "--micro-batch-size",
    "2",
    "--total-batch-size",
    "512",  # 2 x 128 tokens per micro-step: 2 micro-steps on 1 rank, 1 on each of 2
    "--loss-impl",
    "chunked",
    "--activation-checkpointing",
    "none",
    "--num-threads",
    "1",
    "--log-interval",
    "1",
    "--eval-tokens",
    "512",
    "--sample-interval",
    "0",
    "--plot",
    "false",
]
"""The debug preset with nothing left to measure: the batch, the loss path, checkpointing and threads."""

CASES = {
    "debug_1proc": (1, []),
    "debug_ddp_2proc": (2, []),
    "debug_fsdp_2proc": (2, ["--parallel", "fsdp"]),
    "debug_muon_1proc": (1, ["--optimizer", "muon"]),
    "debug_resume_1proc": (1, []),
}
"""case -> (processes, extra flags); the resume case stops at step RESUME_AT, then continues with --resume."""

MARKS = {  # the FSDP and resume cases in CI's long pass: the default suite keeps the DDP one
    "debug_fsdp_2proc": (pytest.mark.torch_feature("fsdp"), pytest.mark.slow),
    "debug_resume_1proc": pytest.mark.slow,
    "debug_muon_1proc": pytest.mark.torch_feature("muon"),
}


def train(data_dir: Path, out_dir: Path, nproc: int, *extra: str, max_steps: int = STEPS) -> str:
    """One run of train_ddp.py into out_dir; returns its stdout."""
    args = [*PINNED, "--data-dir", str(data_dir), "--out-dir", str(out_dir), "--max-steps", str(max_steps), *extra]
    done = run_trainer(args, nproc=nproc)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    return done.stdout


def case_losses(name: str, data_dir: Path, out_dir: Path) -> list[float]:
    """The training losses of case `name`: steps 1..STEPS, or for the resume case those after the resume."""
    nproc, extra = CASES[name]
    if name != "debug_resume_1proc":
        train(data_dir, out_dir, nproc, *extra)
        got = losses(out_dir)
        assert sorted(got) == list(range(1, STEPS + 1)), got
        return [got[s] for s in range(1, STEPS + 1)]
    train(data_dir, out_dir, nproc, *extra, max_steps=RESUME_AT)  # its final checkpoint: step RESUME_AT
    stdout = train(data_dir, out_dir, nproc, *extra, "--resume", "auto")
    assert f"checkpoints/step_{RESUME_AT:08d}.pt at step {RESUME_AT}" in stdout, stdout
    got = losses(out_dir)  # both runs' records, each step once
    assert sorted(got) == list(range(1, STEPS + 1)), got
    return [got[s] for s in range(RESUME_AT + 1, STEPS + 1)]


@pytest.mark.parametrize("name", [pytest.param(n, marks=MARKS.get(n, ()), id=n) for n in CASES])
def test_losses_are_c4247b7s_bit_for_bit(name, tmp_path, shakespeare_shards):
    got = case_losses(name, shakespeare_shards, tmp_path / "run")
    assert all(isinstance(x, float) for x in got), got
    if WRITE:  # at c4247b7 only: record this case's losses (the other cases' are kept)
        table = json.loads(REFERENCE.read_text()) if REFERENCE.is_file() else {}
        table[name] = got
        table["machine"] = machine()
        REFERENCE.parent.mkdir(parents=True, exist_ok=True)
        REFERENCE.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
        return
    table = json.loads(REFERENCE.read_text())
    want = table[name]
    if table["machine"] == machine():
        assert got == want, f"{name}: {REPO.name}'s losses {got} are not c4247b7's {want}"
    else:
        assert got == pytest.approx(want, rel=REL), f"{name}: {got} vs c4247b7's {want} (on {table['machine']})"
