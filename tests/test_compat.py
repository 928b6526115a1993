"""gpt2/core/compat.py: the one place where torch releases differ, decided by capability.

These run on whichever torch the environment has (CI: 2.13 in the main suite, the floor and the
newest in their own environments), so each test asserts what must hold on every supported release.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REPO

from gpt2.core import compat
from gpt2.core.precision import Precision

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def test_declared_floor_is_pyprojects_and_is_installed_or_newer():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_dep = next(d for d in deps if d.startswith("torch"))
    assert torch_dep.split(";")[0].split("#")[0].strip() == f"torch>={compat.TORCH_FLOOR}"
    installed = tuple(int(x) for x in compat.torch_version().split(".")[:2])
    assert installed >= tuple(int(x) for x in compat.TORCH_FLOOR.split("."))


def test_ddp_keyword_exists_on_this_torch_and_turns_buffer_sync_off():
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    kwargs = compat.ddp_no_buffer_sync()
    ((name, value),) = kwargs.items()
    assert name in inspect.signature(DDP.__init__).parameters
    assert value is False


def test_missing_features_lists_exactly_the_unavailable_asked_ones():
    assert compat.missing_features(optimizer="adamw", parallel="ddp") == []
    lines = compat.missing_features(optimizer="muon", parallel="fsdp")
    expected = [f for f in ("muon", "fsdp") if not compat.feature_available(f)]
    assert len(lines) == len(expected)
    for line, feature in zip(lines, expected):
        assert f"torch >= {compat.FIRST_RELEASE[feature]}" in line
        assert f"this is torch {compat.torch_version()}" in line
        assert "\n" not in line


def test_missing_feature_message_when_the_capability_is_absent(monkeypatch):
    monkeypatch.setattr(compat, "has_muon", lambda: False)
    monkeypatch.setattr(compat, "fsdp_api", lambda: None)
    lines = compat.missing_features(optimizer="muon", parallel="fsdp")
    assert lines[0].startswith("--optimizer muon needs torch >= 2.9 (torch.optim.Muon); this is torch ")
    assert lines[0].endswith("install a newer torch, or use --optimizer adamw")
    assert lines[1].startswith("--parallel fsdp needs torch >= 2.6")
    assert lines[1].endswith("or use --parallel ddp")


def test_trainer_refuses_a_missing_feature_before_any_process_group(monkeypatch, tmp_path):
    from gpt2.core.config import RunConfig, TrainConfig, model_preset
    from gpt2.train.startup import check_data

    monkeypatch.setattr(compat, "has_muon", lambda: False)
    cfg = RunConfig(
        model=model_preset("debug"),
        train=TrainConfig.of(
            data_dir=str(tmp_path),
            out_dir=str(tmp_path / "run"),
            optimizer="muon",
            micro_batch_size=4,
            total_batch_size=4 * 64 * 2,
        ),
    )
    with pytest.raises(ValueError, match=r"--optimizer muon needs torch >= 2\.9"):
        check_data(cfg.train, cfg.model.block_size, world_size=1)


def test_fsdp_api_matches_the_feature_and_is_sharded_never_raises():
    from gpt2.distributed.fsdp import is_sharded, mixed_precision

    api = compat.fsdp_api()
    assert (api is not None) == compat.feature_available("fsdp")
    assert is_sharded(torch.nn.Linear(2, 2)) is False  # on every torch, FSDP or not (checkpoints call it)
    assert mixed_precision(Precision("bfloat16", "bfloat16"), torch.device("cpu")) is None


SET_TIMEOUT = """
import datetime, os, sys, warnings
import torch, torch.distributed as tdist
from gpt2.core import compat
tdist.init_process_group("gloo", store=tdist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
with warnings.catch_warnings():
    warnings.simplefilter("error")
    compat.set_default_timeout(datetime.timedelta(seconds=123))
t = torch.ones(2)
tdist.all_reduce(t)
out = torch.empty(2)
with warnings.catch_warnings():
    warnings.simplefilter("error")
    compat.all_gather_into(out, torch.tensor([3.0, 4.0]))
print(t.tolist(), out.tolist(), flush=True)
os._exit(0)
"""
"""set_default_timeout and all_gather_into in a one-rank gloo group, with every warning an error, in a process of its
own that leaves by os._exit: on torch 2.5.1 the process group's destructor can deadlock (it joins a gloo thread that
waits for the GIL the destructor holds: seen once in the torch range, 2026-12-07, pytest's worker hung for good), as
the trainer's own exit avoids (gpt2/distributed/group.py)."""


def test_timeout_and_all_gather_work_and_warn_nothing(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SET_TIMEOUT, str(tmp_path / "store")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[1.0, 1.0] [3.0, 4.0]"


def test_importing_and_building_ddp_warns_nothing(tmp_path):
    """No deprecation warning from the project's own use of torch on this release (a subprocess: a
    fresh import, where module-level warnings would show)."""
    script = f"""
import warnings, datetime
warnings.simplefilter("error")
import torch, torch.distributed as tdist
import gpt2.train.trainer
from gpt2.core import compat
from gpt2.core.precision import Precision
from torch.nn.parallel import DistributedDataParallel as DDP
tdist.init_process_group("gloo", store=tdist.FileStore({str(tmp_path / "store")!r}, 1), rank=0, world_size=1)
DDP(torch.nn.Linear(4, 4), **compat.ddp_no_buffer_sync())
compat.set_default_timeout(datetime.timedelta(seconds=60))
tdist.destroy_process_group()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_ci_tests_the_declared_floor():
    script = (REPO / "scripts" / "torch_range.sh").read_text()
    floor = next(line.split("=", 1)[1] for line in script.splitlines() if line.startswith("FLOOR="))
    assert floor.startswith(compat.TORCH_FLOOR + "."), (floor, compat.TORCH_FLOOR)
    assert "scripts/torch_range.sh" in (REPO / ".ci" / "run").read_text()


def test_torch_range_installs_past_a_site_wide_pip_cap():
    """A machine whose pip configuration caps torch (a constraint file) must still get the release named:
    every pip call in the torch-range venvs reads no configuration file, and the script checks the torch it got."""
    script = (REPO / "scripts" / "torch_range.sh").read_text()
    lines = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    installs = [line for line in lines if "pip install" in line]  # pip's own, and uv's pip interface
    assert any('"$UV" pip install' in line for line in installs), installs
    assert any("-m pip install" in line for line in installs), installs  # the fallback where uv is missing
    assert all('"${nocfg[@]}"' in line for line in installs), installs
    # torch and the project each go through install(), whichever installer it takes
    assert sum(line.lstrip().startswith("install ") for line in lines) >= 2
    assert "nocfg=(env PIP_CONFIG_FILE=/dev/null)" in script
    assert "asked for torch $v" in script
