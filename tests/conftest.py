import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SHAKESPEARE = REPO / "tests" / "data" / "tinyshakespeare.txt"
"""Karpathy's tinyshakespeare (char-rnn's input.txt, public domain, 1.1 MB), shipped with the tests so that a
fresh clone runs them alone; CI's ../shared/data holds the same bytes (test_data_prep.py checks that)."""


XDIST_MAX_WORKERS = 8
"""`-n auto`'s ceiling: each worker holds torch (~0.5 GB) and starts runs of 2-4 processes of its own."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`pytest -n auto` (README's test command): one worker a CPU this process may use (its affinity mask, as
    the trainer counts them, not the node's), at most XDIST_MAX_WORKERS."""
    from gpt2.distributed.group import usable_cpus

    return min(usable_cpus(), XDIST_MAX_WORKERS)


def xdist_workers() -> int:
    """How many pytest-xdist workers share this machine (1 without xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def pytest_configure(config):
    # The trainer's compiled runs keep torch.compile's caches in RUN/compile-cache (gpt2/train/compile_cache.py),
    # and every test's RUN is new: compiled tests would each compile from scratch (minutes on 2 cores).
    # Naming inductor's usual directory keeps them sharing one keyed cache, as they did before that cache;
    # tests of the default location remove this variable.
    import getpass
    import tempfile

    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    )
    if "PYTEST_XDIST_WORKER" not in os.environ:  # the controller (or a run without -n), before any test or worker
        session_probe_cache(config)
    if getattr(config.option, "dist", "no") == "load":
        # `-n N` alone deals tests out one by one, so a module-scoped fixture (a reference run, a prepared corpus,
        # a local SLURM) would be made again by every worker that runs one of its tests, and torn down by one while
        # another still used it (CI, 2026-12-06: slurmctld stopped under a running job). loadfile keeps each test
        # file on one worker. (loadgroup, per fixture, would be finer, but with pytest >= 9.2 xdist 3.8 can no
        # longer name a test's group in its id, so it groups nothing.)
        config.option.dist = "loadfile"
    if xdist_workers() > 1:
        # Workers share the cores: each takes its share for its own torch (OpenMP threads that outnumber the cores
        # spin against each other, several times slower), and the runs it starts inherit the same share.
        from gpt2.distributed.group import usable_cpus

        share = max(1, usable_cpus() // xdist_workers())
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)


def session_probe_cache(config) -> None:
    """The suite's own XDG_CACHE_HOME, with this CPU's matmul peaks (MFU's, --dtype auto's) measured once in it
    before any test, at each thread count the tests' trainers run with: every process the tests start reads them.

    Issue 73's rules cache no measurement taken under load, and `-n auto` keeps the cores busy: every trainer start
    would measure its probes again (seconds of matmuls each, hundreds of starts), MFU would read n/a and --dtype
    auto could decide differently from run to run. So here, once, the measurement is made as a start makes it and
    cached whatever the load (its doubt waived), which is what a first run did before that issue. Tests of the
    probes and the cache use their own XDG_CACHE_HOME and fake clocks; removed when the session ends."""
    import shutil
    import tempfile

    from gpt2.distributed.group import usable_cpus
    from gpt2.plan import matmul_peak, paired, precision_choice

    cache = tempfile.mkdtemp(prefix="gpt2-ddp-tests-cache-")
    os.environ["XDG_CACHE_HOME"] = cache
    config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))
    threads, mp = torch.get_num_threads(), pytest.MonkeyPatch()
    mp.setattr(paired.Load, "busy", lambda self: None)
    mp.setattr(paired.Comparison, "doubt", lambda self: None)
    mp.setattr(matmul_peak, "CPU_PEAK_FLOOR_PER_THREAD", 0.0)
    try:
        for n in sorted({max(1, usable_cpus() // ranks) for ranks in (1, 2, 3, 4)}):
            torch.set_num_threads(n)  # the trainer's: its CPUs over its local ranks (distributed.group)
            flags = precision_choice.cpu_bf16_instructions()
            if flags is False:  # fp32 picked without measuring: the peaks alone (an autocast run's MFU reads bf16's)
                matmul_peak.measured_peaks("cpu", (torch.bfloat16, torch.float32))
            else:  # the pairs that decide bf16 against fp32, both peaks cached with the verdict
                precision_choice.cpu_dtype_choice("cpu", flags)
    finally:
        mp.undo()
        torch.set_num_threads(threads)
        matmul_peak._PEAKS.clear()  # this process reads them from the cache as any other does
        precision_choice._CHOICES.clear()
    shutil.copytree(matmul_peak.peak_cache_dir(), Path(cache) / PRISTINE)
    os.environ[SESSION_CACHE_ENV] = cache


SESSION_CACHE_ENV = "GPT2_TEST_SESSION_CACHE"
PRISTINE = "pristine"
"""session_probe_cache's measurements as made, beside the cache every process reads (XDG_CACHE_HOME/gpt2-ddp)."""


def measured_values(path: Path) -> dict | None:
    """A cache entry's measured values (not its counters), or None where it is missing or unreadable."""
    import json

    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return {k: v for k, v in entry.items() if k not in ("runs", "measured", "load")}


@pytest.fixture(autouse=True)
def _session_peaks_kept(request):
    """Before each test, the session's measured peaks and --dtype auto choices as session_probe_cache made them.
    A trainer drops a cached peak that an MFU over 100% proves wrong, and re-checks it every RECHECK_RUNS-th start
    on a machine it judges quiet: under `-n auto` either can leave the peak of a thread count and dtype missing
    for the rest of the session (seen once, on a Xeon with AMX: two later runs read "mfu n/a"). Each restore is
    written to RESTORED, and the session's summary names the test before which it happened."""
    root = os.environ.get(SESSION_CACHE_ENV)
    if root:
        import shutil

        live_dir = Path(root) / "gpt2-ddp"
        for kept in sorted((Path(root) / PRISTINE).glob("*.json")):
            live = live_dir / kept.name
            now = measured_values(live)
            if now != measured_values(kept):
                shutil.copyfile(kept, live)
                with open(Path(root) / RESTORED, "a") as f:
                    f.write(f"{request.node.nodeid}: {kept.name} {'changed' if now else 'missing'}\n")
    yield


RESTORED = "restored.log"


def pytest_terminal_summary(terminalreporter):
    root = os.environ.get(SESSION_CACHE_ENV)
    log = Path(root) / RESTORED if root else None
    if log is not None and log.is_file():
        lines = log.read_text().splitlines()
        terminalreporter.write_line(f"conftest: the session's cached peaks were restored {len(lines)} time(s):")
        for line in lines[:20]:
            terminalreporter.write_line(f"  before {line}")


def pytest_collection_modifyitems(config, items):
    # GPU tests skip where there is no CUDA device, and a feature's tests where this torch lacks the
    # feature (the compatibility runs on the oldest supported torch: test_torch_range.py asserts the
    # one-line refusal there instead); nothing else is ever skipped.
    from gpt2.core.compat import FIRST_RELEASE, feature_available, torch_version

    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        for mark in item.iter_markers("torch_feature"):
            feature = mark.args[0]
            if not feature_available(feature):
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"{feature} needs torch >= {FIRST_RELEASE[feature]}; this is torch {torch_version()}"
                    )
                )


CPU_REPORT_ENV = "GPT2_TEST_CPU_REPORT"
"""A file path: each test's CPU seconds (this process and the processes it started and waited for: torchrun, its
ranks, data_prep) and wall seconds are appended to it as JSON lines. CPU time barely moves with the machine's
load, where wall time does: docs/testing.md's table of where the suite's time goes is read from it."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get(CPU_REPORT_ENV)
    if not path:
        yield
        return
    import json
    import resource
    import time

    def cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    c0, t0 = cpu(), time.perf_counter()
    yield
    row = {"test": item.nodeid, "cpu_s": round(cpu() - c0, 2), "wall_s": round(time.perf_counter() - t0, 2)}
    with open(path, "a") as f:  # one line a write: workers of `-n` append to the same file
        f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="session")
def shakespeare_path() -> Path:
    assert SHAKESPEARE.is_file(), f"{SHAKESPEARE} is missing: it ships with the repository (git checkout it)"
    return SHAKESPEARE


@pytest.fixture(autouse=True)
def _torch_threads():
    # Keep each test's torch on the cores it was given; restore afterwards.
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _seeded_global_rngs(request):
    """Python's, numpy's and torch's global generators seeded by the test's id before each test: a test
    that draws from them (torch.randint without a generator) makes the same draws in every run and
    in any order of tests, so a failure replays."""
    import random
    import zlib

    import numpy as np

    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


TINY_MODEL_FLAGS = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "64"]
"""A model small enough that a torchrun test step takes milliseconds; vocab stays GPT-2's 50304."""


@pytest.fixture(scope="session")
def shakespeare_shards(tmp_path_factory, shakespeare_path) -> Path:
    """The shared Shakespeare prepared by data_prep exactly as a user would (val + 2 train shards)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("shakespeare_shards")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "data_prep",
            "--source",
            str(shakespeare_path),
            "--out",
            str(out),
            "--txt-sample-by",
            "paragraph",
            "--val-tokens",
            "20000",
            "--val-select",
            "first",
            "--shard-tokens",
            "160000",
            "--workers",
            "1",
            "--no-progress",
        ],
        check=True,
        cwd=REPO,
        capture_output=True,
    )
    return out


def run_trainer(args: list[str], *, nproc: int = 1, timeout: float = 600, env: dict | None = None):
    """Run train_ddp.py as users do: `python train_ddp.py` for one process, torchrun for several."""
    import subprocess
    import sys

    if nproc == 1:
        cmd = [sys.executable, str(REPO / "train_ddp.py"), *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(REPO / "train_ddp.py"),
            *args,
        ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)


class FakeClock:
    """gpt2.plan.paired.Clock on a scripted machine (issue 73's tests): each call of `name` takes times[name]
    seconds, a number or a list taken in turn, each a number (both clocks) or a (wall, cpu) pair; a name not
    scripted takes what its function returns when that is a paired.Timing (a matmul probe's own), else 1 s.
    The functions run unless run=False (their memory is real). The load average, the CPUs and the share of
    the time spent waiting for a CPU are as given; calls lists the names in the order they were timed."""

    def __init__(self, times=None, *, load=0.3, cores=2, wait_share=0.0, run=True):
        self.times = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in (times or {}).items()}
        self.load, self.n_cores, self.wait_share, self.run = load, cores, wait_share, run
        self.calls, self.now, self.waited = [], 0.0, 0.0

    def time(self, name, fn):
        from gpt2.plan.paired import Timing

        out = fn() if self.run else None
        scripted = self.times.get(name)
        if isinstance(scripted, list):
            t = scripted.pop(0) if len(scripted) > 1 else scripted[0]
        else:
            t = scripted
        if t is None:
            timing = out if isinstance(out, Timing) else Timing(1.0, 1.0)
        else:
            timing = Timing(*t) if isinstance(t, tuple) else Timing(t, t)
        self.calls.append(name)
        self.now += timing.wall_s
        self.waited += self.wait_share * timing.wall_s * self.threads()
        return timing

    def threads(self):
        return 1

    def waited_s(self):
        return self.waited

    def load_average(self):
        return self.load

    def cores(self):
        return self.n_cores

    def monotonic(self):
        return self.now


@pytest.fixture
def fake_clock(monkeypatch):
    """Every probe measures with a FakeClock: a quiet machine (load 0.3 on 2 CPUs, no waits), every call 1 s
    until the test scripts it (fake_clock.times[name] = ...)."""
    from gpt2.plan import paired

    clock = FakeClock()
    monkeypatch.setattr(paired, "CLOCK", clock)
    return clock
