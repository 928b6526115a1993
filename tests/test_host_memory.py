"""gpt2/core/host_memory.py: what the host has free, the process's resident peak, and glibc's malloc setting."""

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from gpt2.core import host_memory

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="read from /proc")
glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")

# A 16 MiB tensor freed raises glibc's dynamic mmap threshold to 16 MiB; an 8 MiB one after it then comes
# from the heap and, freed, stays resident (under the 32 MiB trim threshold). What stays is measured as
# anonymous memory (RssAnon, where malloc's heap and mappings live), not VmRSS: the first op also maps
# libtorch's code pages, file-backed, 1.4 MiB here and 7 MiB on a CI machine whose kernel maps them in
# larger folios, and that is not memory malloc kept.
KEPT_AFTER_FREE = """
import json, sys, torch

def anonymous():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

if sys.argv[1] == "trainer":
    from gpt2.core.config import ComputeConfig
    from gpt2.distributed.group import Dist
    from gpt2.train.startup import configure_backends
    configure_backends(ComputeConfig(), Dist(rank=0, local_rank=0, world_size=1,
                       local_world_size=1, device=torch.device("cpu")))
start = anonymous()
a = torch.ones(4 * 2**20); del a
before = anonymous()
b = torch.ones(2 * 2**20); del b
print(json.dumps({"a": before - start, "b": anonymous() - before}))
"""


def kept_after_free(mode: str, env: dict | None = None, block: str = "b") -> int:
    """What stays resident after the 16 MiB block ("a") or the 8 MiB one after it ("b") is freed."""
    out = subprocess.run(
        [sys.executable, "-c", KEPT_AFTER_FREE, mode],
        capture_output=True,
        text=True,
        timeout=120,
        env=None if env is None else {**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])[block]


@linux
@glibc
def test_a_cpu_run_gives_freed_tensors_back_where_glibcs_defaults_keep_them():
    assert kept_after_free("default") >= 6 * 2**20  # the 8 MiB block stays in the heap
    assert kept_after_free("trainer") < 2 * 2**20  # the trainer's start-up (configure_backends) returns it
    # A user's own malloc setting wins: under a 32 MiB mmap threshold and a 64 MiB trim threshold the 16 MiB
    # block comes from the heap and stays there freed, trainer or not (the trainer's 4 MiB would unmap it).
    user = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(64 * 2**20)}
    assert kept_after_free("trainer", user, block="a") >= 12 * 2**20
    assert kept_after_free("trainer", block="a") < 2 * 2**20


def test_a_users_malloc_settings_are_recognised():
    assert not host_memory.user_malloc_settings({"PATH": "/bin"})
    assert host_memory.user_malloc_settings({"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert host_memory.user_malloc_settings({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert not host_memory.user_malloc_settings({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"})


@linux
def test_free_memory_and_the_resident_peak_are_read_and_the_peak_resets():
    free, rss = host_memory.available_bytes(), host_memory.resident_bytes()
    assert 0 < free and 0 < rss <= host_memory.resident_peak_bytes()
    big = torch.ones(32 * 2**20)  # 128 MiB, written
    del big
    assert host_memory.resident_peak_bytes() >= rss + 100 * 2**20
    assert host_memory.reset_resident_peak()
    assert host_memory.resident_peak_bytes() < rss + 100 * 2**20 or host_memory.resident_bytes() >= rss + 100 * 2**20
