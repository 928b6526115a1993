"""gpt2/train/compile_cache.py: where torch.compile's caches go, their key, the check against the manifest
(a corrupt or foreign cache: one warning, never fatal), and a resumed start loading instead of compiling."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY_MODEL_FLAGS

from gpt2.distributed.group import single_process
from gpt2.train import compile_cache as cc

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme sse sse2 ssse3 sse4_1 avx avx2 fma f16c bmi2 avx512f avx512_bf16 amx_tile pti md_clear
bugs\t\t: spectre_v1
processor\t: 1
flags\t\t: fpu sse
"""


class Log:
    """What the trainer's RunLog gets, recorded."""

    def __init__(self):
        self.lines = {"info": [], "warn": [], "detail": []}

    def info(self, m):
        self.lines["info"].append(m)

    def warn(self, m):
        self.lines["warn"].append(m)

    def detail(self, m):
        self.lines["detail"].append(m)


def test_auto_is_under_the_run_directory_off_is_none_a_path_is_shared(tmp_path):
    assert cc.cache_root("auto", str(tmp_path / "run"), env={}) == (tmp_path / "run" / "compile-cache", True)
    assert cc.cache_root("off", str(tmp_path / "run"), env={}) is None
    assert cc.cache_root(str(tmp_path / "shared"), "run", env={}) == (tmp_path / "shared", False)
    # A directory the environment names is kept, shared; one this process set (a keyed one) is not nested.
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "env")}
    assert cc.cache_root("auto", "run", env=env) == (tmp_path / "env", False)
    keyed = tmp_path / "env" / "0123456789abcdef"
    keyed.mkdir(parents=True)
    (keyed / cc.KEY_FILE).write_text("{}")
    assert cc.cache_root("auto", "run", env={"TORCHINDUCTOR_CACHE_DIR": str(keyed)}) == (tmp_path / "env", False)


def test_auto_stays_under_the_run_after_importing_torch_dynamo_sets_inductors_default(tmp_path):
    """torch >= 2.13 sets TORCHINDUCTOR_CACHE_DIR to its default when torch._dynamo is imported (torch.optim
    imports it; the memory plan's warm-up runs first): auto must still mean RUN/compile-cache (CI caught a
    first compiled start writing to /tmp/torchinductor_USER and the resumed one finding no RUN cache)."""
    code = (
        "import os, sys; os.environ.pop('TORCHINDUCTOR_CACHE_DIR', None); import torch.optim, torch._dynamo; "
        "from gpt2.train import compile_cache as cc; "
        "print(os.environ.get('TORCHINDUCTOR_CACHE_DIR') is not None, cc.cache_root('auto', sys.argv[1]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split(" ", 1)
    assert out[1].strip() == repr((tmp_path / "run" / "compile-cache", True))
    env = {"TORCHINDUCTOR_CACHE_DIR": cc.inductor_default_dir()}
    assert cc.cache_root("auto", str(tmp_path / "run"), env=env) == (tmp_path / "run" / "compile-cache", True)


def test_the_key_names_torch_python_and_the_cpu_vector_instructions_only():
    assert cc.cpu_isa(CPUINFO) == [
        "amx_tile",
        "avx",
        "avx2",
        "avx512_bf16",
        "avx512f",
        "bmi2",
        "f16c",
        "fma",
        "sse",
        "sse2",
        "sse4_1",
        "ssse3",
    ]  # not fpu, pti, md_clear; the first CPU's
    key = cc.cache_key(torch.device("cpu"))
    assert key["torch"] == torch.__version__ and key["python"].startswith(f"{sys.version_info.major}.")
    assert key["device"]["type"] == "cpu" and key["device"]["machine"]
    name = cc.key_name(key)
    assert re.fullmatch(r"[0-9a-f]{16}", name) and name == cc.key_name(json.loads(json.dumps(key)))
    for change in (
        {"torch": "2.99.0"},
        {"triton": "9.9"},
        {"python": "3.99.0"},
        {"device": {**key["device"], "isa": key["device"]["isa"] + ["avx10"]}},
        {"device": {"type": "cuda", "name": "NVIDIA H100", "capability": "9.0", "cuda": "12.4"}},
    ):
        assert cc.key_name({**key, **change}) != name, change


def _filled(path: Path, key: dict) -> dict[str, bytes]:
    """A keyed cache as inductor leaves it (a kernel, its source, an FX graph entry), checked and sealed."""
    assert cc.check(path, key, exclusive=True) == []
    files = {
        "ab/cabc.so": b"\x7fELF" + bytes(300),
        "ab/cabc.cpp": b"int f() { return 1; }",
        "fxgraph/fa/entry": b"pickled graph",
        "locks/cabc.lock": b"",
    }
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    assert cc.seal(path) == sum(len(d) for d in files.values())
    assert "locks/cabc.lock" not in json.loads((path / cc.MANIFEST).read_text())
    return files


def test_a_sealed_cache_is_kept_whole_and_sealing_again_reads_only_what_changed(tmp_path, monkeypatch):
    key, path = {"torch": "t"}, tmp_path / "k"
    files = _filled(path, key)
    assert cc.check(path, key, exclusive=True) == []
    assert all((path / rel).read_bytes() == data for rel, data in files.items())
    (path / "ab/cnew.so").write_bytes(b"new kernel")
    read = []
    monkeypatch.setattr(cc, "_digest", lambda p: read.append(p.name) or "h")
    cc.seal(path)
    assert read == ["cnew.so"] and json.loads((path / cc.MANIFEST).read_text())["ab/cnew.so"][2] == "h"


def test_a_corrupt_file_is_one_warning_and_only_it_is_removed(tmp_path):
    key, path = {"torch": "t"}, tmp_path / "k"
    _filled(path, key)
    (path / "ab/cabc.so").write_bytes(b"\x7fELF" + bytes(10))  # truncated
    entry = path / "fxgraph/fa/entry"
    mtime = entry.stat().st_mtime_ns
    entry.write_bytes(b"pickled grapH")  # same size, another byte, written later (a clock tick may not show it)
    os.utime(entry, ns=(mtime + 10**9, mtime + 10**9))
    warnings = cc.check(path, key, exclusive=False)
    assert len(warnings) == 1 and "2 file(s)" in warnings[0] and "corrupt" in warnings[0], warnings
    assert not (path / "ab/cabc.so").exists() and not (path / "fxgraph/fa/entry").exists()
    assert (path / "ab/cabc.cpp").exists()
    assert sorted(json.loads((path / cc.MANIFEST).read_text())) == ["ab/cabc.cpp"]  # a rebuilt file is not corrupt


@pytest.mark.parametrize("exclusive", [True, False])
def test_unlisted_files_are_an_unfinished_compile_only_under_the_run_directory(tmp_path, exclusive):
    """A job killed mid-compile leaves files no manifest lists: removed where only this run writes; in a
    shared directory they may be another run's compile in progress, and stay."""
    key, path = {"torch": "t"}, tmp_path / "k"
    _filled(path, key)
    (path / "cd/ccd.so").parent.mkdir()
    (path / "cd/ccd.so").write_bytes(b"\x7fEL")
    assert cc.check(path, key, exclusive=exclusive) == []
    assert (path / "cd/ccd.so").exists() is not exclusive
    assert (path / "ab/cabc.so").exists()


@pytest.mark.parametrize("damage", ["foreign key", "garbage key", "garbage manifest", "manifest list"])
def test_a_foreign_or_unreadable_cache_is_one_warning_and_cleared(tmp_path, damage):
    key, path = {"torch": "t"}, tmp_path / "k"
    _filled(path, key)
    if damage == "foreign key":
        (path / cc.KEY_FILE).write_text(json.dumps({"torch": "another"}))
    elif damage == "garbage key":
        (path / cc.KEY_FILE).write_bytes(b"\x00\xff{")
    elif damage == "garbage manifest":
        (path / cc.MANIFEST).write_text('{"ab/cabc.so": [30')
    else:
        (path / cc.MANIFEST).write_text("[1, 2]")
    warnings = cc.check(path, key, exclusive=False)
    assert len(warnings) == 1 and "cleared" in warnings[0], warnings
    assert sorted(p.name for p in path.iterdir()) == [cc.KEY_FILE]
    assert json.loads((path / cc.KEY_FILE).read_text()) == key
    assert [p.name for p in tmp_path.iterdir()] == ["k"]  # nothing left aside


def test_use_points_inductor_at_the_keyed_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # restored after the test, as use() changes it
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    log = Log()
    cache = cc.use("auto", str(tmp_path / "run"), single_process(), log)
    keyed = tmp_path / "run" / "compile-cache" / cc.key_name(cc.cache_key(torch.device("cpu")))
    assert cache.path == keyed and cache.exclusive and cache.all_paths == (keyed,)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(keyed.resolve())
    assert os.environ["TRITON_CACHE_DIR"] == str((keyed / "triton").resolve())
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == str(keyed.resolve()) and inductor_config.fx_graph_cache
    assert log.lines["warn"] == [] and json.loads((keyed / cc.KEY_FILE).read_text())["torch"] == torch.__version__
    # A second start in this process (tests, the doctor) finds its own keyed directory, not one inside it.
    assert cc.use("auto", str(tmp_path / "run"), single_process(), log).path == keyed


def test_an_unwritable_cache_directory_is_one_warning_and_no_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    (tmp_path / "file").write_text("not a directory")
    log = Log()
    assert cc.use(str(tmp_path / "file"), str(tmp_path / "run"), single_process(), log) is None
    assert len(log.lines["warn"]) == 1 and "compiling without it" in log.lines["warn"][0]
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def _two_rank_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as tdist

    from gpt2.distributed.group import Dist

    tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    dist = Dist(rank=rank, local_rank=rank, world_size=2, local_world_size=2, device=torch.device("cpu"))
    log = Log()
    cache = cc.use("auto", out_dir, dist, log)
    (cache.path / f"rank{rank}.so").write_bytes(b"kernel %d" % rank)  # each rank's compile writes into it
    cc.finish(cache, dist, log)
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps({"path": str(cache.path), "warn": log.lines["warn"], "env": os.environ["TORCHINDUCTOR_CACHE_DIR"]})
    )
    tdist.destroy_process_group()


def test_two_ranks_share_one_keyed_directory_that_rank_0_checked_and_seals(tmp_path, monkeypatch):
    from _helpers import spawn_ranks

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # the spawned ranks inherit the environment
    run = tmp_path / "run"
    keyed = run / cc.DIRNAME / cc.key_name(cc.cache_key(torch.device("cpu")))
    _filled(keyed, cc.cache_key(torch.device("cpu")))
    (keyed / "ab/cabc.so").write_bytes(b"torn")
    spawn_ranks(_two_rank_worker, (str(tmp_path / "init"), str(run)), nprocs=2)
    got = [json.loads((run / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[0]["path"] == got[1]["path"] == str(keyed) and got[0]["env"] == str(keyed.resolve())
    assert got[0]["warn"] == got[1]["warn"] and len(got[0]["warn"]) == 1 and "cabc.so" in got[0]["warn"][0]
    sealed = json.loads((keyed / cc.MANIFEST).read_text())
    assert {"rank0.so", "rank1.so", "ab/cabc.cpp"} <= set(sealed) and "ab/cabc.so" not in sealed


def _train(args: list[str], max_steps: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "train_ddp.py", *args, "--max-steps", str(max_steps)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )


def _said(run: subprocess.CompletedProcess) -> tuple[int, int]:
    found = re.findall(r"compile cache: (\d+) graph\(s\) loaded from it, (\d+) compiled", run.stdout)
    assert run.returncode == 0 and len(found) == 1, run.stdout[-3000:] + run.stderr[-3000:]
    return int(found[0][0]), int(found[0][1])


@pytest.mark.slow
def test_a_resumed_start_loads_what_the_first_compiled_and_survives_a_corrupt_cache(tmp_path, shakespeare_shards):
    """The requeue path with the same flags (no --compile-cache): the first start compiles into
    RUN/compile-cache, the resumed one loads every graph from it and compiles none; then with kernel files
    truncated, a resumed start warns once, removes them and trains on (inductor would fail the step on a
    torn kernel), rebuilding them."""
    run = tmp_path / "run"
    args = [
        *TINY_MODEL_FLAGS,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--compile",
        "true",
        "--sample-interval",
        "0",
        "--plot",
        "false",
        "--data-dir",
        str(shakespeare_shards),
        "--out-dir",
        str(run),
        "--micro-batch-size",
        "4",
        "--total-batch-size",
        "256",
        "--eval-interval",
        "0",
        "--eval-tokens",
        "256",
        "--log-interval",
        "1",
    ]
    loaded, compiled = _said(_train(args, 1))
    assert loaded == 0 and compiled > 0
    (keyed,) = (run / "compile-cache").iterdir()
    files = sorted(p for p in keyed.rglob("*") if p.is_file())
    assert _said(_train(args, 2)) == (compiled, 0)
    assert sorted(p for p in keyed.rglob("*") if p.is_file()) == files  # nothing new was written
    torn = {p: len(p.read_bytes()) // 2 for p in [*keyed.rglob("*.so"), *keyed.rglob("*.py")]}
    for p, size in torn.items():
        p.write_bytes(p.read_bytes()[:size])
    third = _train(args, 3)
    warnings = [ln for ln in third.stderr.splitlines() if "compile cache:" in ln]
    assert len(warnings) == 1 and "corrupt" in warnings[0] and f"{len(torn)} file(s)" in warnings[0], third.stderr
    assert _said(third) == (compiled, 0)  # the graphs load; inductor rebuilt the removed kernels from them
    assert sorted(p for p in keyed.rglob("*") if p.is_file()) == files
    assert all(p.stat().st_size > size for p, size in torn.items())
