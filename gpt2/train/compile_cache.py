"""torch.compile's caches in a directory that outlives the job: a requeued run does not compile from scratch.

Inductor keeps what it compiled (the FX graph cache, the AOT autograd cache, the C++/Triton kernels) under
TORCHINDUCTOR_CACHE_DIR, by default /tmp/torchinductor_$USER: lost when a requeue lands on another node.
Here the run points it (and TRITON_CACHE_DIR) at RUN/compile-cache/<key>/ (`--compile-cache auto`, so the
SLURM scripts and every requeue of one run directory share it with no extra flag), or at DIR/<key>/ for a
cluster-wide `--compile-cache DIR`, before the first compilation, on every rank.

<key> is a short hash of what must match for an artifact to be reusable (cache_key): torch's release and
build, Python's, Triton's, and the device kind (GPU name and capability, or the CPU's architecture and
vector instructions, which inductor's C++ kernels are built for). Another torch or GPU kind gets its own
directory, with key.json beside its files saying what it holds. Inductor's own entries are content-hashed
(graph, shapes, dtypes, config), so another model shape in the same directory is a miss, never a wrong
hit: the shape is not part of the key, and runs of different shapes share a directory's common kernels.

Corruption: inductor recovers from a bad cache entry but not from a bad kernel file it finds there (a
truncated .so or .py fails the first step). So rank 0 seals the directory at the run's end
(MANIFEST: every file's size, mtime and sha256) and checks it at the next start: a listed file that changed is
corrupt (one warning, those files removed; inductor rebuilds what is missing); a foreign or unreadable
key.json or manifest starts the directory afresh. Under RUN (one run at a time, run.lock) the files the
manifest does not list are a compile that never finished (a job killed mid-compile) and are removed too;
in a shared directory they may be another run's compile in progress, and are left alone.

Portable cache artifacts (torch.compiler.save_cache_artifacts, torch >= 2.7) are not used: they bundle the
same entries this directory already holds, for moving a cache to a machine without the shared filesystem a
requeue has; the directory needs no extra step in the loop.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2.core import compat
from gpt2.core.atomic import atomic_write_text
from gpt2.distributed.group import Dist, all_gather_object, barrier, rank0_decides

AUTO = "auto"
OFF = "off"
DIRNAME = "compile-cache"
"""The default cache's folder in the run directory (not a run record: a fresh start in RUN keeps it)."""
KEY_FILE = "key.json"
MANIFEST = "manifest.json"
OURS = (KEY_FILE, MANIFEST)
ISA_PREFIXES = ("avx", "amx", "sse", "ssse", "fma", "f16c", "bmi", "vnni", "asimd", "sve", "neon")
"""The CPU flags inductor's C++ kernels depend on (its vector ISA choice); the rest of /proc/cpuinfo's
flags (mitigations, virtualisation) do not change a kernel and would split the cache for nothing."""


@dataclass(frozen=True)
class CompileCache:
    path: Path
    """This rank's keyed directory (TORCHINDUCTOR_CACHE_DIR)."""
    exclusive: bool
    """Whether only this run uses it (under RUN): files no manifest lists are then an unfinished compile."""
    all_paths: tuple[Path, ...]
    """Every rank's keyed directory (one per device kind), which rank 0 checks and seals."""


def cache_root(setting: str, out_dir: str, env: dict | None = None) -> tuple[Path, bool] | None:
    """Where the caches go, and whether only this run uses that directory; None for `off`.

    auto: RUN/compile-cache, unless the environment already sets TORCHINDUCTOR_CACHE_DIR (a cluster's
    or a person's choice, kept, as a shared directory); a path: that directory, shared."""
    env = os.environ if env is None else env
    if setting == OFF:
        return None
    if setting == AUTO:
        chosen = chosen_by_environment(env)
        if not chosen:
            return Path(out_dir) / DIRNAME, True
        chosen = Path(chosen)
        if (chosen / KEY_FILE).is_file():  # a keyed directory set by an earlier run in this process
            return chosen.parent, False
        return chosen, False
    return Path(setting), False


def inductor_default_dir() -> str:
    """Where inductor caches when nobody says (tempdir/torchinductor_USER, as torch computes it)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # torch < 2.6 keeps it beside the other runtime helpers
        from torch._inductor.runtime.runtime_utils import default_cache_dir
    return os.path.abspath(default_cache_dir())


def chosen_by_environment(env) -> str | None:
    """TORCHINDUCTOR_CACHE_DIR when a person or a cluster set it. Importing torch._dynamo (torch.optim does, as
    the memory plan's warm-up does before the cache is chosen) sets it to inductor's default in torch >= 2.13:
    that value is torch's doing, not a choice."""
    chosen = env.get("TORCHINDUCTOR_CACHE_DIR")
    if not chosen or os.path.abspath(chosen) == inductor_default_dir():
        return None
    return chosen


def cpu_isa(cpuinfo: str) -> list[str]:
    """The vector-instruction flags in /proc/cpuinfo's text (first processor), sorted."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return sorted({f for f in value.split() if f.startswith(ISA_PREFIXES)})
    return []


def device_kind(device: torch.device) -> dict:
    """What a compiled kernel is built for: the GPU's name and capability, or the CPU's ISA."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {
            "type": "cuda",
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
            "hip": getattr(torch.version, "hip", None),
        }
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: the architecture alone
        cpuinfo = ""
    return {"type": device.type, "machine": platform.machine(), "isa": cpu_isa(cpuinfo)}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cache_key(device: torch.device) -> dict:
    """Everything that must match for a cached artifact to be reused (module docstring)."""
    return {
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "python": platform.python_version(),
        "triton": _version("triton") or _version("pytorch-triton"),
        "device": device_kind(device),
    }


def key_name(key: dict) -> str:
    """The keyed directory's name: 16 hex digits of the key's sha256."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(path: Path) -> list[Path]:
    """The cache's files, but ours and inductor's lock files (empty, and held by a compile in progress)."""
    return sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and not p.is_symlink()
        and p.relative_to(path).as_posix() not in OURS
        and p.relative_to(path).parts[0] != "locks"
    )


def _read_json(path: Path):
    """The file's JSON, None when absent, or raise ValueError when unreadable."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: {e}") from None


def check(path: Path, key: dict, exclusive: bool) -> list[str]:
    """Rank 0, before any rank compiles: make `path` a directory holding only trustworthy files for `key`.
    Returns the warnings (at most one per directory); removes what cannot be trusted."""
    try:
        found_key = _read_json(path / KEY_FILE)
        manifest = _read_json(path / MANIFEST)
        if found_key is not None and found_key != key:
            raise ValueError(f"{path / KEY_FILE} describes another torch or device ({key_name(found_key)})")
        if manifest is not None and not isinstance(manifest, dict):
            raise ValueError(f"{path / MANIFEST} is not a manifest")
    except ValueError as e:
        _discard(path)
        _start(path, key)
        return [f"compile cache: {e}; it is cleared and the model compiles from scratch"]
    manifest = manifest or {}
    bad = []
    for p in _files(path) if path.is_dir() else []:
        rel = p.relative_to(path).as_posix()
        listed = manifest.get(rel)
        if listed is None:
            if exclusive:  # a compile a killed job never finished (nothing else writes under RUN)
                p.unlink(missing_ok=True)
            continue
        if not _intact(p, listed):
            bad.append(rel)
            p.unlink(missing_ok=True)  # content-addressed: inductor rebuilds a missing file
    _start(path, key)
    if bad:  # the manifest no longer vouches for them: whatever is rebuilt there is new, not corrupt
        kept = {rel: entry for rel, entry in manifest.items() if rel not in bad}
        atomic_write_text(path / MANIFEST, json.dumps(kept, sort_keys=True) + "\n")
        return [
            f"compile cache: {len(bad)} file(s) in {path} changed since it was sealed (corrupt, e.g. "
            f"{bad[0]}); removed, and what they held is compiled again"
        ]
    return []


def _start(path: Path, key: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if _read_json(path / KEY_FILE) != key:
        atomic_write_text(path / KEY_FILE, json.dumps(key, indent=1, sort_keys=True) + "\n")


def _discard(path: Path) -> None:
    """Remove a keyed directory: renamed first, so no rank ever reads a half-deleted one."""
    if not path.exists():
        return
    aside = path.with_name(f".discarded-{path.name}-{os.getpid()}")
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _intact(p: Path, listed) -> bool:
    """Whether file p is what the manifest's [size, mtime_ns, sha256] recorded. An unchanged size and
    mtime is trusted without reading the file, so a start costs a stat per file, not a read of the
    whole cache (a shared one can hold many models); a torn or rewritten file changes one of them."""
    if not (isinstance(listed, list) and len(listed) == 3):
        return False
    st = p.stat()
    return st.st_size == listed[0] and (st.st_mtime_ns == listed[1] or _digest(p) == listed[2])


def seal(path: Path) -> int:
    """Rank 0, after every rank's compiles: record each file's size, mtime and sha256 (MANIFEST); a file
    the last seal recorded unchanged is not read again. Returns the files' total bytes."""
    try:
        old = _read_json(path / MANIFEST)
    except ValueError:
        old = None
    old = old if isinstance(old, dict) else {}
    listed = {}
    for p in _files(path):
        rel, st = p.relative_to(path).as_posix(), p.stat()
        was = old.get(rel)
        same = isinstance(was, list) and len(was) == 3 and was[:2] == [st.st_size, st.st_mtime_ns]
        listed[rel] = [st.st_size, st.st_mtime_ns, was[2] if same else _digest(p)]
    atomic_write_text(path / MANIFEST, json.dumps(listed, sort_keys=True) + "\n")
    return sum(entry[0] for entry in listed.values())


def use(setting: str, out_dir: str, dist: Dist, log) -> CompileCache | None:
    """Every rank, before the first compilation: choose, check and set the cache directory (a collective)."""
    root = cache_root(setting, out_dir)
    if root is None:
        return None
    base, exclusive = root
    key = cache_key(dist.device)
    keys = {key_name(k): k for k in all_gather_object(key, dist)}  # a node of another GPU kind: its own

    def checked() -> tuple[list[str], bool]:
        warnings = []
        try:
            for name, k in sorted(keys.items()):
                warnings += check(base / name, k, exclusive)
        except OSError as e:  # unwritable or full: the run goes on, compiling as if it had no cache
            return [
                f"compile cache: {base}: {e.strerror or e}; compiling without it (pass a writable "
                f"--compile-cache DIR, or --compile-cache off)"
            ], False
        return warnings, True

    # Also the barrier: no rank compiles before rank 0 has checked.
    warnings, usable = rank0_decides(checked, dist)
    for w in warnings:
        log.warn(w)
    if not usable:
        return None
    path = base / key_name(key)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path.resolve())
    os.environ["TRITON_CACHE_DIR"] = str((path / "triton").resolve())
    compat.enable_compile_caches()
    log.detail(f"compile cache: {path} ({'this run' if exclusive else 'shared'}; key {json.dumps(key)})")
    return CompileCache(path, exclusive, tuple(sorted(base / name for name in keys)))


def hits() -> dict[str, int]:
    """This process's cache lookups so far: graphs loaded and compiled (inductor's counters)."""
    from torch._dynamo.utils import counters

    return {
        "loaded": counters["inductor"]["fxgraph_cache_hit"],
        "compiled": counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_bypass"],
    }


def finish(cache: CompileCache | None, dist: Dist, log, *, report: bool = True) -> None:
    """Every rank at the same point (after the first step, after the loop): rank 0 seals the directories and,
    with report, says what the cache did."""
    if cache is None:
        return
    barrier(dist)  # every rank's compiles are written
    if not dist.is_main:
        return
    try:
        size = sum(seal(p) for p in cache.all_paths if p.is_dir())
    except OSError as e:
        log.warn(
            f"compile cache: {cache.path} could not be sealed ({e.strerror or e}); the next start "
            "trusts none of it and compiles from scratch"
        )
        return
    if not report:
        return
    n = hits()
    log.info(
        f"compile cache: {n['loaded']} graph(s) loaded from it, {n['compiled']} compiled | "
        f"{size / 2**20:.1f} MiB in {cache.path}"
    )
