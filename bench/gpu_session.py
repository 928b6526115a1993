"""The GPU issue's part 1 as a few commands: prepare here, then one command per device call there.

    python bench/gpu_session.py prepare           # here (no GPU needed): .gpu/ with nanoGPT, shards, corpus
    python bench/gpu_session.py part1             # there: doctor, the GPU tests, the GPU-relevant test files
    python bench/gpu_session.py part2             # there: vs_nanogpt (gpt2, cuda), the checkpoint stall, resume
    python bench/gpu_session.py part2 --dry-run   # the commands and their time limits, nothing run

(`bash scripts/gpu_prepare.sh` and `bash scripts/gpu_session.sh PART` call these; bench/README.md,
"On a GPU", gives the device call.) A part is a list of steps, each a command with its own time limit,
run one after another; the limits of a part add up to at most --budget-s (default 560 s, under the device
tool's 10 minutes a command). A step that fails or runs out of time is recorded as such and the next
one runs: one failure never loses the others' results. A single step runs by its name
(`python bench/gpu_session.py resume`), `all` runs both parts.

Everything goes to $OUT (or --out): PART.md (every step's status and its report: tables, test summary
lines), PART.json (the same, machine-readable) and PART-logs.tar.gz (every step's full log and files).
Steps write into runs/gpu_session/PART/ first; the inductor cache is runs/gpu_session/inductor, which
a warm device machine keeps between calls, so a part run again compiles from cache.

Nothing here needs `datasets` or a network: nanoGPT, the token shards and the tests' corpus travel in
.gpu/ (git-ignored, carried by the device call). --cpu-smoke runs the same steps at tiny shapes on a
CPU (tests/test_gpu_session.py), to prove the commands and their parsing before GPU time is spent.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPU_DIR = REPO / ".gpu"
WORK = REPO / "runs" / "gpu_session"
DEFAULT_BUDGET_S = 560
SUITE = ["tests/test_model.py", "tests/test_precision.py", "tests/test_fused_loss.py", "tests/test_ckpt_writer.py",
         "tests/test_trainer.py"]
"""The default suite's files that run differently where CUDA is present (part 1)."""
TRAIN_MIN_TOKENS = 2 * 524_288 + 1
"""Train tokens .gpu/data holds at least: two optimizer steps of the gpt2 preset without a repeat inside one."""


@dataclass(frozen=True)
class Step:
    name: str
    cmd: list[str]
    limit_s: int
    report: str = ""
    """A file the step writes (relative to the part's work dir) whose text goes into PART.md."""
    needs: str = ""
    """Why the step cannot run here, if it cannot (it is then recorded as skipped)."""
    elastic: bool = False
    """May run past limit_s into the time the steps before it left unused (run_steps)."""


@dataclass
class Result:
    name: str
    status: str
    """ok, failed (exit status), timeout, skipped"""
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


def steps_for(part: str, work: Path, *, cpu_smoke: bool = False) -> list[Step]:
    """The steps of a part (or the one step of that name), with commands and limits."""
    py = python_cmd()
    data, tree = GPU_DIR / "data", GPU_DIR / "nanogpt"
    doctor = importlib.util.find_spec("gpt2.doctor") is not None
    needs_doctor = "" if doctor else "gpt2/doctor.py is not in this checkout (branch doctor, to be merged)"
    if cpu_smoke:
        bench = [*py, "bench/vs_nanogpt.py", "--device", "cpu", "--shapes", "tiny", "--micro-batches", "2",
                 "--steps", "1", "--warmup", "1", "--rounds", "1"]
        stall = [*py, "bench/checkpoint_stall.py", "--device", "cpu", "--preset", "debug", "--reps", "1",
                 "--tokens", "64"]
        resume = [*py, "bench/resume_check.py", "--device", "cpu", "--shape", "tiny", "--steps", "12",
                  "--ckpt-step", "4", "--no-repeat"]
        suite, gpu_tests = ["tests/test_flops.py", "-k", "table"], ["tests/test_flops.py", "-m", "gpu"]
    else:
        bench = [*py, "bench/vs_nanogpt.py", "--device", "cuda", "--micro-batches", "12,16", "--steps", "20",
                 "--warmup", "10", "--rounds", "1"]
        stall = [*py, "bench/checkpoint_stall.py", "--device", "cuda", "--preset", "gpt2", "--reps", "3",
                 "--tokens", "16384"]
        resume = [*py, "bench/resume_check.py", "--device", "cuda", "--shape", "gpt2", "--steps", "40",
                  "--ckpt-step", "20"]
        suite, gpu_tests = SUITE, [*gpu_test_files(), "-m", "gpu"]
    pytest = [*py, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "--continue-on-collection-errors",
              *(["--timeout", "300"] if pytest_timeout_available() else [])]
    all_steps = {
        "env": Step("env", [*py, "bench/gpu_session.py", "env"], 25, report="logs/env.log"),
        "doctor": Step("doctor", [*py, "-m", "gpt2.doctor", "--out", str(work / "doctor")], 180, needs=needs_doctor),
        "gpu-tests": Step("gpu-tests", [*pytest, *gpu_tests, "--junitxml", str(work / "gpu-tests.xml")], 90),
        "suite": Step("suite", [*pytest, *suite, "--junitxml", str(work / "suite.xml")], 250,
                      elastic=True),
        "bench": Step("bench", [*bench, "--nanogpt", str(tree) if tree.is_dir() else "none", "--data-dir", str(data),
                                "--md", str(work / "vs_nanogpt.md"), "--json", str(work / "vs_nanogpt.json")],
                      300, report="vs_nanogpt.md", elastic=True),
        "stall": Step("stall", [*stall, "--dir", str(work)], 60),
        "resume": Step("resume", [*resume, "--data-dir", str(data), "--work", str(work / "resume_runs"),
                                  "--md", str(work / "resume_check.md"), "--json", str(work / "resume_check.json")],
                       170, report="resume_check.md", elastic=True),
    }
    parts = {"part1": ["env", "doctor", "gpu-tests", "suite"], "part2": ["env", "bench", "stall", "resume"]}
    parts["all"] = parts["part1"] + parts["part2"][1:]
    if part in all_steps:
        return [all_steps[part]]
    return [all_steps[name] for name in parts[part]]


def gpu_test_files() -> list[str]:
    """The test files that hold tests marked gpu (collecting only them: a collection error elsewhere
    cannot stop the GPU tests)."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text())


def use_pylib() -> bool:
    """Whether the steps take pytest from .gpu/pylib: only where this Python has none."""
    return importlib.util.find_spec("pytest") is None and (GPU_DIR / "pylib").is_dir()


def pytest_timeout_available() -> bool:
    if use_pylib():
        return (GPU_DIR / "pylib" / "pytest_timeout.py").is_file()
    return importlib.util.find_spec("pytest_timeout") is not None


def child_env() -> dict[str, str]:
    """The steps' environment: this checkout first on PYTHONPATH, .gpu/pylib (pytest) where this Python
    lacks pytest, and the inductor cache under runs/ (kept between calls on a warm machine)."""
    env = dict(os.environ)
    paths = [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    if use_pylib():
        paths.append(str(GPU_DIR / "pylib"))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(WORK / "inductor"))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_step(step: Step, work: Path, limit_s: int) -> Result:
    """One step, its output to work/logs/NAME.log; stopped at limit_s (SIGINT first, so pytest and the
    benches still write what they have; then SIGKILL to its whole process group)."""
    log = work / "logs" / f"{step.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    shown = " ".join(step.cmd)
    if step.needs:
        log.write_text(f"skipped: {step.needs}\n")
        return Result(step.name, "skipped", None, 0.0, limit_s, shown, tail=step.needs)
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write(f"$ {shown}\n")
        f.flush()
        proc = subprocess.Popen(step.cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=child_env(),
                                start_new_session=True)
        try:
            rc, status = proc.wait(timeout=limit_s), ""
        except subprocess.TimeoutExpired:
            status = "timeout"
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
            if proc.poll() is None or _group_alive(proc.pid):
                _kill_group(proc.pid)
            rc = proc.wait()
    seconds = time.monotonic() - t0
    status = status or ("ok" if rc == 0 else "failed")
    text = log.read_text(errors="replace")
    report = (work / step.report).read_text(errors="replace") if step.report and (work / step.report).is_file() else ""
    keep = 6 if report else 25  # a step with a report: the log's tail only says how it ended
    return Result(step.name, status, rc, round(seconds, 1), limit_s, shown, tail="\n".join(text.splitlines()[-keep:]),
                  report=report)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_steps(steps: list[Step], work: Path, budget_s: float, on_result=None) -> list[Result]:
    """Every step in order; never stops early. A step runs within its limit and what is left of the budget
    after the limits of the steps after it; an elastic one also gets what the steps before it left unused."""
    t0, results = time.monotonic(), []
    for i, step in enumerate(steps):
        left = budget_s - (time.monotonic() - t0)
        limit = int(left - 5 - sum(s.limit_s for s in steps[i + 1:] if not s.needs))
        limit = limit if step.elastic else min(limit, step.limit_s)
        if limit < min(20, step.limit_s) and not step.needs:
            res = Result(step.name, "skipped", None, 0.0, step.limit_s, " ".join(step.cmd),
                         tail=f"no time left in the part's {budget_s:.0f} s budget")
        else:
            res = run_step(step, work, max(limit, 1))
        results.append(res)
        if on_result:
            on_result(results)
    return results


def summary_md(part: str, results: list[Result], started: str) -> str:
    lines = [f"# gpu_session {part}", "", f"started {started} UTC; {len(results)} steps", "",
             "| step | status | exit | s | limit s |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r.name} | {r.status} | {'' if r.rc is None else r.rc} | {r.seconds:.0f} | {r.limit_s} |"
              for r in results]
    for r in results:
        lines += ["", f"## {r.name}: {r.status}", "", f"`{r.cmd}`", ""]
        if r.report:
            lines += [r.report.rstrip(), ""]
        lines += ["log tail:", "```", r.tail, "```"]
    return "\n".join(lines) + "\n"


def write_outputs(part: str, results: list[Result], work: Path, out: Path, started: str) -> None:
    """PART.md, PART.json and PART-logs.tar.gz (the work dir: logs, reports, doctor's files) in out."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{part}.md").write_text(summary_md(part, results, started))
    (out / f"{part}.json").write_text(json.dumps({"part": part, "started": started,
                                                  "steps": [asdict(r) for r in results]}, indent=1) + "\n")
    with tarfile.open(out / f"{part}-logs.tar.gz", "w:gz") as tar:
        for path in sorted(work.rglob("*")):  # not checkpoints or shards: the device call returns < 16 MiB a file
            if path.is_file() and path.suffix not in (".pt", ".bin") and path.stat().st_size < 4 * 2**20:
                tar.add(path, arcname=str(path.relative_to(work.parent)))


def env_report() -> str:
    """What the machine is: Python, torch, CUDA, the GPU, nvidia-smi, the .gpu/ manifest."""
    import platform

    lines = [f"python {platform.python_version()} ({sys.executable}); {platform.platform()}; {os.cpu_count()} cores"]
    try:
        import torch

        lines.append(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available: "
                     f"{torch.cuda.is_available()}")
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            lines.append(f"device 0: {torch.cuda.get_device_name(0)}, {p.total_memory / 2**30:.1f} GiB, "
                         f"capability {p.major}.{p.minor}, {torch.cuda.device_count()} device(s); bf16 native: "
                         f"{torch.cuda.is_bf16_supported(including_emulation=False)}")
    except Exception as e:  # an environment report reports what it can
        lines.append(f"torch: {type(e).__name__}: {e}")
    for mod in ("numpy", "tiktoken", "pytest", "datasets", "triton"):
        spec = importlib.util.find_spec(mod)
        lines.append(f"{mod}: {'present' if spec else 'absent'}")
    smi = shutil.which("nvidia-smi")
    if smi:
        done = subprocess.run([smi], capture_output=True, text=True, timeout=30)
        lines += ["", done.stdout.strip()]
    manifest = GPU_DIR / "MANIFEST.json"
    lines.append("")
    lines.append(f".gpu/MANIFEST.json: {manifest.read_text().strip() if manifest.is_file() else 'absent'}")
    return "\n".join(lines)


# ---- prepare (here, before the device call) ----


def prepare(nanogpt_source: str, corpus: Path, pylib: bool) -> None:
    """.gpu/: nanoGPT at the pinned commit (a shallow checkout, used in place), token shards of the corpus
    (the train split tiled to TRAIN_MIN_TOKENS), the corpus itself (tests/test_ckpt_writer.py reads it),
    and, if asked, pytest's pure-Python files from this Python (a GPU machine may have no pytest)."""
    sys.path.insert(0, str(REPO / "bench"))
    import nanogpt
    import numpy as np
    from corpus import prepare_by_paragraph, require_corpus

    from gpt2.data.shards import write_shard

    require_corpus(corpus, "gpu_session.py prepare")
    GPU_DIR.mkdir(exist_ok=True)
    tree = GPU_DIR / "nanogpt"
    if nanogpt.detached_head(tree) != nanogpt.PINNED:
        shutil.rmtree(tree, ignore_errors=True)
        url = nanogpt_source if "://" in nanogpt_source else f"file://{Path(nanogpt_source).resolve()}"
        for cmd in (["git", "init", "-q", str(tree)],
                    ["git", "-C", str(tree), "fetch", "-q", "--depth", "1", url, nanogpt.PINNED],
                    ["git", "-C", str(tree), "checkout", "-q", "--detach", "FETCH_HEAD"]):
            subprocess.run(cmd, check=True, timeout=600)
    assert nanogpt.detached_head(tree) == nanogpt.PINNED
    (tree / nanogpt.COMMIT_FILE).write_text(nanogpt.PINNED + "\n")  # in case a copy leaves .git/ behind
    data = GPU_DIR / "data"
    shutil.rmtree(data, ignore_errors=True)
    raw = GPU_DIR / "data-raw"
    shutil.rmtree(raw, ignore_errors=True)
    prepare_by_paragraph(corpus, raw, "gpu_session.py prepare")
    train = nanogpt.shard_tokens(raw, "train")
    val = nanogpt.shard_tokens(raw, "val")
    data.mkdir()
    tiled = np.tile(train, -(-TRAIN_MIN_TOKENS // len(train)))
    write_shard(data / "bench_train_000000.bin", tiled)
    write_shard(data / "bench_val_000000.bin", val)
    shutil.rmtree(raw)
    (GPU_DIR / "corpus").mkdir(exist_ok=True)
    shutil.copyfile(corpus, GPU_DIR / "corpus" / "tinyshakespeare.txt")
    if pylib:
        copy_pytest(GPU_DIR / "pylib")
    manifest = {"nanogpt": nanogpt.PINNED, "corpus": str(corpus), "train_tokens": int(len(tiled)),
                "train_tokens_distinct": int(len(train)), "val_tokens": int(len(val)),
                "note": f"the train split tiled {len(tiled) / len(train):.1f}x: the gpt2 preset's 524,288-token "
                        "steps need more than the corpus holds; throughput does not depend on the text"}
    (GPU_DIR / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(p.stat().st_size for p in GPU_DIR.rglob("*") if p.is_file())
    print(f"prepared {GPU_DIR}: {size / 2**20:.1f} MiB ({json.dumps(manifest)})")


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
    src = GPU_DIR / "corpus" / "tinyshakespeare.txt"
    if not src.is_file():
        return f"{target}: missing, and no .gpu/corpus copy (run prepare): tests that read it will fail"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
    except OSError as e:
        return f"{target}: could not be written ({e}): tests that read it will fail"
    return f"{target}: copied from .gpu/corpus"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", help="prepare | part1 | part2 | all | env | a step: doctor, gpu-tests, suite, bench, "
                    "stall, resume")
    ap.add_argument("--out", type=Path, default=None, help="where the results go (default $OUT, else runs/gpu_session/out)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"the part's time, all steps together (default {DEFAULT_BUDGET_S}; all: twice that)")
    ap.add_argument("--dry-run", action="store_true", help="print the steps' commands and limits, run nothing")
    ap.add_argument("--cpu-smoke", action="store_true", help="the same steps at tiny shapes on the CPU")
    ap.add_argument("--nanogpt", default="/work/.mirror/karpathy+nanoGPT/repo",
                    help="prepare: a local clone or mirror of nanoGPT holding the pinned commit (or a URL)")
    ap.add_argument("--corpus", type=Path, default=REPO.parent / "shared" / "data" / "tinyshakespeare.txt",
                    help="prepare: the text the shards are made of")
    ap.add_argument("--no-pylib", action="store_true", help="prepare: do not copy pytest into .gpu/pylib")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.what == "prepare":
        prepare(args.nanogpt, args.corpus, not args.no_pylib)
        return 0
    if args.what == "env":
        print(env_report())
        return 0
    names = {"part1", "part2", "all", "doctor", "gpu-tests", "suite", "bench", "stall", "resume"}
    if args.what not in names:
        print(f"gpu_session.py: error: unknown {args.what!r}: prepare, env, or one of {sorted(names)}", file=sys.stderr)
        return 2
    part = args.what + ("-cpu-smoke" if args.cpu_smoke else "")
    work = WORK / part
    steps = steps_for(args.what, work, cpu_smoke=args.cpu_smoke)
    budget = args.budget_s or DEFAULT_BUDGET_S * (2 if args.what == "all" else 1)
    if args.dry_run:
        for s in steps:
            print(f"{s.name}\t{s.limit_s} s\t{' '.join(s.cmd)}" + (f"\t(skipped: {s.needs})" if s.needs else ""))
        print(f"total limit {sum(s.limit_s for s in steps)} s of a {budget:.0f} s budget")
        return 0
    out = args.out or Path(os.environ.get("OUT") or WORK / "out")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    if args.what in ("part1", "all", "suite"):
        (work / "corpus.txt").write_text(place_corpus() + "\n")

    def save(results: list[Result]) -> None:
        write_outputs(part, results, work, out, started)
        print(f"[gpu_session {part}] {results[-1].name}: {results[-1].status} in {results[-1].seconds:.0f} s",
              flush=True)

    results = run_steps(steps, work, budget, on_result=save)
    if not results:
        return 0
    bad = [r.name for r in results if r.status not in ("ok", "skipped")]
    print(f"[gpu_session {part}] done: {len(results) - len(bad)} of {len(results)} steps ok or skipped"
          + (f"; not ok: {', '.join(bad)}" if bad else "") + f"; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
