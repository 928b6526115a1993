"""Shared by test_checkpoint.py and test_resume.py: launching the trainer as a process we can signal,
waiting for a training step, and reading what a run left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from conftest import REPO, TINY_MODEL_FLAGS

from gpt2.train.run_log import read_metrics

FP32_CPU = ["--device", "cpu", "--dtype", "float32", "--compile", "false", "--sample-interval", "0", "--plot", "false"]
"""Deterministic settings: exact resume is promised for CPU, fp32, no compile."""


def tiny_run_flags(data_dir: Path, *, max_steps: int, ckpt_interval: int, eval_tokens: int = 1024) -> list[str]:
    """A 2-layer model, 512 tokens per step (2 ranks x 4 x 64, or 1 rank x 2 accumulation steps). The loss path is
    pinned as the micro-batch is: uncompiled, auto measures this CPU (gpt2/plan/loss_probe.py) and caches nothing
    measured under load (issue 73), so two runs a test compares could otherwise take different paths."""
    return [
        *TINY_MODEL_FLAGS,
        *FP32_CPU,
        "--loss-impl",
        "chunked",
        "--data-dir",
        str(data_dir),
        "--micro-batch-size",
        "4",
        "--total-batch-size",
        "512",
        "--max-steps",
        str(max_steps),
        "--warmup-steps",
        "3",
        "--lr",
        "3e-3",
        "--eval-interval",
        "0",
        "--eval-tokens",
        str(eval_tokens),
        "--ckpt-interval",
        str(ckpt_interval),
        "--keep-checkpoints",
        "100",
        "--log-interval",
        "1",
    ]


@dataclass
class Launched:
    """A trainer launched in the background; stdout/stderr go to files (no pipe can fill up)."""

    proc: subprocess.Popen
    log_dir: Path
    started: float

    @property
    def stdout(self) -> str:
        return (self.log_dir / "stdout.txt").read_text()

    @property
    def stderr(self) -> str:
        return (self.log_dir / "stderr.txt").read_text()

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"trainer still running after {timeout} s\n{self.output()}") from None

    def output(self) -> str:
        return f"stdout:\n{self.stdout[-4000:]}\nstderr:\n{self.stderr[-4000:]}"

    def workers(self) -> dict[int, int]:
        """{rank: pid} of torchrun's current worker processes (its direct children)."""
        found = {}
        for pid in children(self.proc.pid):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            ranks = [e.split(b"=", 1)[1] for e in env if e.startswith(b"RANK=")]
            if ranks:
                found[int(ranks[0])] = pid
        return found

    def kill(self) -> None:
        """SIGKILL the launcher and its workers (each by pid), e.g. after a failed assertion."""
        pids = children(self.proc.pid) if self.proc.poll() is None else []
        for pid in [self.proc.pid, *pids]:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        self.proc.wait()


def import_train_ddp():
    """train_ddp.py as a module, to call main() in this process (one rank, no process group)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_ddp", REPO / "train_ddp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PATCHED_TRAIN = """
import sys
sys.path.insert(0, {repo!r})
{patch}
sys.argv[0] = {train!r}
import runpy
runpy.run_path({train!r}, run_name="__main__")
"""


def patched_train_script(directory: Path, patch: str) -> Path:
    """A script that runs `patch` (Python: monkeypatching gpt2 in each worker), then train_ddp.py.

    How a test makes one step of a real multi-process run slow or faulty without a test hook in
    the trainer: torchrun starts this script instead of train_ddp.py.
    """
    script = directory / "patched_train_ddp.py"
    script.write_text(PATCHED_TRAIN.format(repo=str(REPO), patch=patch, train=str(REPO / "train_ddp.py")))
    return script


NAN_AT_STEP = """
import gpt2.train.trainer as trainer
from gpt2.model.gpt import GPT

_train_step, _forward, _now = trainer.train_step, GPT.forward, {{"step": None}}


def train_step(parts, *args, **kwargs):  # remembers which optimizer step (from 0) is running
    _now["step"] = parts.step
    try:
        return _train_step(parts, *args, **kwargs)
    finally:
        _now["step"] = None


def forward(self, *args, **kwargs):  # that step's training losses are NaN on every rank
    logits, loss = _forward(self, *args, **kwargs)
    if _now["step"] == {step} and loss is not None:
        loss = loss * float("nan")
    return logits, loss


trainer.train_step, GPT.forward = train_step, forward
"""


def nan_at_step(step: int) -> str:
    """Patch text (for patched_train_script, or exec in-process) making optimizer step `step`
    (counted from 0) compute a NaN loss: how tests exercise the non-finite guard."""
    return NAN_AT_STEP.format(step=step)


def inject_nan(monkeypatch, step: int) -> None:
    """nan_at_step in this process, undone by pytest's monkeypatch at the end of the test."""
    import gpt2.train.trainer as trainer
    from gpt2.model.gpt import GPT

    monkeypatch.setattr(trainer, "train_step", trainer.train_step)  # remembered, restored after the test
    monkeypatch.setattr(GPT, "forward", GPT.forward)
    exec(nan_at_step(step), {})


HOLD_AFTER_STEP = """
import os, signal, time
from pathlib import Path
import gpt2.train.trainer as trainer

_step_before_hold = trainer.train_step


def step_after_hold(parts, *args, **kwargs):
    # Step {step} is done and logged: every rank waits here until the test releases the run, saying on
    # disk once its own stop signal has been received (the trainer's preempt.StopRequest recorded it).
    if parts.step == {step}:
        stop = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
        said = False
        while not Path({release!r}).exists():
            if not said and stop is not None and stop.signum is not None:
                Path({release!r} + ".signalled." + os.environ.get("RANK", "0")).touch()
                said = True
            time.sleep(0.01)
    return _step_before_hold(parts, *args, **kwargs)


trainer.train_step = step_after_hold
"""


def hold_after_step(step: int, release: Path) -> str:
    """Patch text (for patched_train_script): after optimizer step `step` every rank waits until the
    file `release` exists. A test signals (or kills) the run there, then calls release_run: the run
    cannot finish before the signal lands, however fast the machine."""
    return HOLD_AFTER_STEP.format(step=step, release=str(release))


def release_run(
    launched: Launched, release: Path, *, signalled_ranks: tuple[int, ...] = (), timeout: float = 120
) -> None:
    """Let a run held by hold_after_step go on, once each of signalled_ranks has received its signal."""
    deadline = time.monotonic() + timeout  # a safety net on a loaded machine, not a timing assumption
    while not all(release.with_name(f"{release.name}.signalled.{r}").exists() for r in signalled_ranks):
        if launched.proc.poll() is not None or time.monotonic() > deadline:
            launched.kill()
            raise AssertionError(f"ranks {signalled_ranks} did not all report their signal\n{launched.output()}")
        time.sleep(0.02)
    release.touch()


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def launch(
    args: list[str],
    *,
    nproc: int,
    log_dir: Path,
    max_restarts: int = 0,
    env: dict | None = None,
    script: Path = REPO / "train_ddp.py",
) -> Launched:
    """`python train_ddp.py` for nproc=1 (unless max_restarts), else torchrun --standalone (gloo)."""
    if nproc == 1 and not max_restarts:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.2",
            str(script),
            *args,
        ]
    log_dir.mkdir(parents=True, exist_ok=True)
    # One thread per process keeps runs on 2 shared cores fast, and runs with equal thread counts
    # compute bitwise the same. TORCH_ELASTIC_SHUTDOWN_TIMEOUT: how long torchrun waits after
    # SIGTERM before SIGKILL (a SIGSTOPped worker never exits by itself).
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "30", **(env or {})}
    with open(log_dir / "stdout.txt", "w") as out, open(log_dir / "stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, env=full_env)
    return Launched(proc, log_dir, time.monotonic())


def run(args: list[str], *, nproc: int, log_dir: Path, timeout: float = 300, **kw) -> Launched:
    launched = launch(args, nproc=nproc, log_dir=log_dir, **kw)
    launched.wait(timeout)
    return launched


def records(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / "metrics.jsonl", missing_ok=True)  # also while the run writes it


def losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} from metrics.jsonl; asserts each step appears once (the log reads as one run)."""
    steps = [r for r in records(run_dir) if "loss" in r]
    assert len({r["step"] for r in steps}) == len(steps), f"repeated steps in {run_dir}/metrics.jsonl"
    return {r["step"]: r["loss"] for r in steps}


def wait_for_step(launched: Launched, run_dir: Path, step: int, timeout: float = 180) -> None:
    """Block until metrics.jsonl records `step` (the optimizer step has completed on every rank)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.get("step", -1) >= step and "loss" in r for r in records(run_dir)):
            return
        if launched.proc.poll() is not None:
            raise AssertionError(f"trainer exited {launched.proc.returncode} before step {step}\n{launched.output()}")
        time.sleep(0.05)
    launched.kill()
    raise AssertionError(f"no step {step} within {timeout} s\n{launched.output()}")


def uninterrupted_run(args: list[str], out: Path, max_steps: int) -> Path:
    """A 2-rank run (args write into out/run) that must finish and learn: the reference an interrupted
    run is compared with. Returns its run directory."""
    done = run(args, nproc=2, log_dir=out)
    assert done.proc.returncode == 0, done.output()
    got = losses(out / "run")
    assert sorted(got) == list(range(1, max_steps + 1))
    assert got[max_steps] < got[1] - 0.1  # it learns, so equal losses are not equal by accident
    return out / "run"


def load_ckpt(run_dir: Path, step: int) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step_{step:08d}.pt", map_location="cpu", weights_only=True)


def assert_same_state(a: dict, b: dict) -> None:
    """Bitwise equal weights, optimizer state, step, data position and RNG states."""
    assert a["step"] == b["step"]
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"weight {k} differs"
    # One optimizer's state_dict, or --optimizer muon's {"optimizers": {"adamw": ..., "muon": ...}}.
    oa, ob = (x["optimizer"].get("optimizers", {"": x["optimizer"]}) for x in (a, b))
    assert oa.keys() == ob.keys()
    for name in oa:
        sa, sb = oa[name]["state"], ob[name]["state"]
        assert sa.keys() == sb.keys() and sa, name
        for i in sa:
            for k in sa[i]:
                assert torch.equal(sa[i][k], sb[i][k]), f"optimizer {name} state {i}.{k} differs"
    assert a["loader"] == b["loader"]
    for ra, rb in zip(a["rng"], b["rng"], strict=True):
        assert torch.equal(ra["torch"], rb["torch"])


def spawn_ranks(fn, args: tuple, nprocs: int) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs), each rank leaving as the trainer's ranks do.

    A spawned rank that returns ends through Python's finalization, where a gloo worker thread still
    releasing a finished collective's tensors can take the GIL and abort the process ("terminate
    called without an active exception", SIGABRT: gpt2/distributed/group.py exit_after_group). Every result a
    worker writes is saved before it returns, so the rank flushes and leaves by os._exit: 0 when fn
    returned, 1 (its traceback printed to the test's captured stderr) when it raised.
    """
    import torch.multiprocessing as mp

    mp.spawn(_spawned_rank, args=(fn, *args), nprocs=nprocs, join=True)


def _spawned_rank(rank: int, fn, *args) -> None:
    import traceback

    code = 0
    try:
        fn(rank, *args)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


MUON_SHAPES = [(96, 32), (32, 32), (32, 128), (64, 64), (48, 16)]


def muon_spread_worker(rank: int, world: int, init_file: str, out: str, ns_dtype: torch.dtype) -> None:
    """Three Muon steps on MUON_SHAPES with the same seeded gradients on every rank (as after DDP's
    all-reduce), one thread; saves the parameters, the state, the matrices this rank orthogonalised
    and each step's calls of torch.distributed's collectives."""
    import torch.distributed as tdist

    import gpt2.train.muon
    from gpt2.distributed.group import Dist

    torch.set_num_threads(1)
    calls, collectives = [], []
    plain = gpt2.train.muon.newton_schulz
    gpt2.train.muon.newton_schulz = lambda g, *a: calls.append(tuple(g.shape)) or plain(g, *a)
    for name in (
        "all_gather_single",
        "all_gather_into_tensor",
        "all_gather",
        "broadcast",
        "all_reduce",
        "scatter",
        "send",
        "recv",
    ):
        real = getattr(tdist, name)
        setattr(tdist, name, lambda *a, name=name, real=real, **k: collectives.append(name) or real(*a, **k))
    if world > 1:
        tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(*s)) for s in MUON_SHAPES]
        dist = Dist(rank, rank, world, world, torch.device("cpu"))
        opt = gpt2.train.muon.Muon(params, lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype, dist=dist)
        per_step = []
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            before = len(collectives)
            opt.step()
            per_step.append(collectives[before:])
        torch.save(
            {
                "params": [p.detach() for p in params],
                "state": opt.state_dict(),
                "calls": calls,
                "collectives": per_step,
            },
            f"{out}/rank{rank}.pt",
        )
        if world > 1:  # no rank tears its connections down while a peer may still be sending on them
            tdist.barrier()
    finally:
        if world > 1:
            tdist.destroy_process_group()


def seeded_rng(request) -> random.Random:  # noqa: F821 (random is imported where it is used)
    """The random choices of one test (which rank to kill, after which step), replayable.

    Seeded by the test's own id, so every run of the suite (CI's included) makes the same choices and
    a failure reproduces; GPT2_TEST_SEED=N explores other choices. The seed is printed (pytest shows
    it with a failure) and tests put their choices in their assertion messages.
    """
    import random
    import zlib

    seed = int(os.environ.get("GPT2_TEST_SEED", zlib.crc32(request.node.nodeid.encode())))
    print(f"{request.node.nodeid}: random choices seeded with {seed} (GPT2_TEST_SEED={seed} replays them)")
    return random.Random(seed)


def ulps_apart(a: float, b: float) -> float:
    """|a - b| in float32 units in the last place of b: how far two float32 results are in rounding
    steps, whatever their magnitude (a loss of 10 has ulps of 9.5e-7, a loss of 3 of 2.4e-7)."""
    import numpy as np

    return abs(a - b) / float(np.spacing(np.float32(abs(b))))


def no_space_after(n_bytes: int):
    """A checkpoint._HashingWriter.write that fails as a full disk does once n_bytes are written: the
    OS's OSError, which torch.save reports as RuntimeError "[enforce fail at inline_container.cc:672]
    . unexpected pos ..." (monkeypatch it onto _HashingWriter.write)."""
    import errno

    from gpt2.ckpt import checkpoint as ckpt

    real = ckpt._HashingWriter.write

    def write(self, data):
        if self.size + len(data) > n_bytes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data)

    return write


# ---- the documentation: README.md, the guide, and docs/*.md, the reference --------------------------


def guide_pages() -> list[Path]:
    """README.md, then every docs/*.md page (sorted): the documentation whose commands tests read."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def guide_text() -> str:
    """README.md and every docs/ page, one after the other."""
    return "\n".join(page.read_text() for page in guide_pages())


def guide_section(page: str, heading: str) -> str:
    """The `## heading` section of one page (README.md or docs/NAME.md), up to the next `## `."""
    text = (REPO / page).read_text()
    return text.split(f"\n## {heading}", 1)[1].split("\n## ", 1)[0]


def guide_commands() -> list[list[str]]:
    """Every command of the documentation's ```bash blocks, continuation lines joined and comments dropped."""
    import re
    import shlex

    commands = []
    for block in re.findall(r"```bash\n(.*?)```", guide_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def model_body(model, idx):
    """A GPT's embeddings, blocks and final LayerNorm on idx: everything the planner's activation_bytes
    counts but the LM head (test_plan and test_activation_checkpointing measure its peak)."""
    import torch

    t = model.transformer
    x = t.drop(t.wte(idx) + t.wpe(torch.arange(idx.size(1))))
    for block in t.h:
        x = block(x)
    return t.ln_f(x)


def train_in_process(cfg, dist) -> int:
    """What train_ddp.py does once its process group is up, in this process: the run's guards, start, train."""
    from gpt2.train.startup import run_guards, start
    from gpt2.train.trainer import train

    with run_guards(cfg.train.ckpt.out_dir, dist) as stop_request:
        run = start(cfg, dist, stop_request=stop_request)
        return 0 if run is None else train(run)


def built(cfg, dist, log=None):
    """The trainer's parts for cfg as a real start builds them (gpt2/train/build.py build), from the start-up's
    record (its `auto` flags decided: resolve_auto) and check_data's shards, in a new directory."""
    from gpt2.train.build import build
    from gpt2.train.run_log import RunLog
    from gpt2.train.startup import check_data, resolve_auto

    log = log or RunLog(dist, cfg.train.ckpt.out_dir)
    return build(resolve_auto(cfg, dist, log), dist, log, check_data(cfg.train, cfg.model.block_size, dist.world_size))


def optimizer_of(model, tc, device, dist=None):
    """The optimizer build() makes for a TrainConfig: its optim section, the schedule's peak lr and its dtype
    (auto: float32, what a CPU without native bf16 resolves it to)."""
    from gpt2.core.precision import FLOAT32, Precision
    from gpt2.train.optim import make_optimizer

    dtype = tc.compute.dtype
    prec = FLOAT32 if dtype == "auto" else Precision(dtype, dtype)
    return make_optimizer(model, tc.optim, device, peak_lr=tc.schedule.lr, prec=prec, dist=dist)
