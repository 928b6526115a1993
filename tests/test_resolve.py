"""gpt2/plan/resolve.py: the start-up's decisions in one function, which a real start and the dry run share.

The dry run (train_ddp.py --dry-run, gpt2/train/dryrun.py) must decide what a real start on this machine
decides: the precision, activation checkpointing, micro-batch, loss path and the memory plan. Each case
below resolves a config as a real start does (its Target from the Dist, the threads configure_backends
sets, then startup's resolve_auto, or on rank 0 of a two-rank world its resolve) and rehearses the same
config in-process; the decision and plan lines of the first must be in the second, word for word. The
memory free now (MemAvailable) is pinned, so both see the same machine; one case pins it small.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TINY_MODEL_FLAGS

from gpt2.core import host_memory
from gpt2.core.precision import Precision
from gpt2.distributed.group import Dist
from gpt2.plan.hardware import GIB, Hardware
from gpt2.plan.resolve import Target, resolve_choices
from gpt2.train import dryrun, startup
from gpt2.train.cli import Rehearsal, parse_config

COMMON = [
    *TINY_MODEL_FLAGS,
    "--max-steps",
    "4",
    "--warmup-steps",
    "2",
    "--eval-tokens",
    "512",
    "--total-batch-size",
    "2048",
    "--device",
    "cpu",
]
CASES = {  # name: (flags, world size, free memory now in GiB)
    "auto": ([], 1, 16),
    "explicit": (
        [
            "--dtype",
            "float32",
            "--micro-batch-size",
            "8",
            "--loss-impl",
            "chunked",
            "--activation-checkpointing",
            "none",
            "--compile",
            "false",
        ],
        1,
        16,
    ),
    "uncompiled auto": (["--compile", "false"], 1, 16),
    "two ranks": ([], 2, 16),
    "fsdp two ranks": (["--parallel", "fsdp", "--dtype", "float32"], 2, 16),
    "small memory": (["--micro-batch-size", "4", "--dtype", "float32"], 1, 1.3),
}


def start_lines(cfg, world: int) -> list[str]:
    """What a real start on this machine logs of its decisions and plan (startup.decide_run's resolve_auto,
    log_mfu_peak and the plan), for rank 0 of `world` ranks on this host."""
    dist = Dist(rank=0, local_rank=0, world_size=world, local_world_size=world, device=torch.device("cpu"))
    startup.configure_backends(cfg.train.compute, dist)  # the threads a rank trains (and measures peaks) with
    lines = []
    log = dryrun.Log(lines.append)  # info, warnings and the plan's detail, as the dry run shows them
    if world == 1:
        resolved = startup.resolve_auto(cfg, dist, log)
    else:  # rank 0's decision, which resolve_auto broadcasts (no process group here)
        resolved = resolve_choices(cfg, startup.start_target(dist))
        startup.log_auto(resolved, log)
    startup.log_mfu_peak(resolved, dist, log)
    startup.check_plan(resolved, log)
    return lines


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_the_dry_run_decides_what_a_real_start_on_this_machine_decides(case, tmp_path, monkeypatch):
    flags, world, free_gib = CASES[case]
    monkeypatch.setattr(host_memory, "available_bytes", lambda: int(free_gib * GIB))
    argv = [*COMMON, *flags, "--data-dir", str(tmp_path / "absent"), "--out-dir", str(tmp_path / "run")]
    cfg = parse_config(argv)
    real = start_lines(cfg, world)
    torch.set_num_threads(7)  # the dry run's own process need not run with a rank's threads
    rehearsed = []
    assert dryrun.rehearse(cfg, Rehearsal(world_size=world), out=rehearsed.append) == 0
    assert any(line.startswith("precision  ") for line in real) and any("total" in line for line in real)
    first = rehearsed.index(real[0]) if real[0] in rehearsed else None
    assert first is not None and rehearsed[first : first + len(real)] == real, (real, rehearsed)
    assert torch.get_num_threads() == 7  # the rehearsal gave this process its threads back


def test_a_small_memory_cap_changes_the_decision_and_both_paths_take_it(tmp_path, monkeypatch):
    """The cap case above is one where the cap decides: --loss-impl auto takes the full logits with room and
    the chunked loss under the cap (else that case would not test the memory input)."""
    flags, _, _ = CASES["small memory"]
    cfg = parse_config([*COMMON, *flags, "--data-dir", "d", "--out-dir", str(tmp_path)])
    impls = {}
    for free in (1.3, 16):
        monkeypatch.setattr(host_memory, "available_bytes", lambda free=free: int(free * GIB))
        impls[free] = resolve_choices(cfg, Target(device=torch.device("cpu"))).cfg.train.compute.loss_impl
    assert impls == {1.3: "chunked", 16: "full"}


def test_resolve_makes_every_auto_concrete_once_and_records_its_reasons(tmp_path):
    cfg = parse_config([*COMMON, "--data-dir", "d", "--out-dir", str(tmp_path), "--dtype", "float32"])
    cap = Hardware(name="capped", memory_bytes=8 * GIB, peak_flops=1e11, device_type="cpu", reserve_bytes=GIB)
    r = resolve_choices(cfg, Target(device=torch.device("cpu"), hardware=cap))
    tc = r.cfg.train
    assert isinstance(tc.batch.micro_batch_size, int) and tc.compute.loss_impl in ("full", "chunked")
    assert tc.compute.activation_checkpointing in ("none", "full") and tc.compute.dtype == "float32"
    assert r.precision == Precision("float32", "float32", r.precision.reason) and r.hardware is cap
    assert (r.plan.micro_batch_size, r.plan.dtype, r.plan.memory.chunked_loss) == (
        tc.batch.micro_batch_size,
        "fp32",
        tc.compute.loss_impl == "chunked",
    )
    assert r.micro_batch.size == tc.batch.micro_batch_size and r.plan.micro_batch_choice == r.micro_batch
    assert r.loss.reason and r.ac.reason and r.precision.reason
    again = resolve_choices(r.cfg, Target(device=torch.device("cpu"), hardware=cap))  # concrete stays as it is
    assert again.cfg == r.cfg and again.plan.micro_batch_choice is None


def test_the_planner_functions_take_the_resolved_config_and_its_hardware():
    """Issue 42: plan, memory and the choosers take (RunConfig, Hardware, world_size), not a dozen loose values:
    the resolved config planned again gives the resolved plan, and each chooser, asked again of it, stands."""
    from gpt2.plan.ac_choice import choose_activation_checkpointing
    from gpt2.plan.loss_choice import choose_loss_impl
    from gpt2.plan.memory import memory
    from gpt2.plan.planner import plan

    cfg = parse_config(
        [
            *TINY_MODEL_FLAGS,
            "--data-dir",
            "d",
            "--out-dir",
            "o",
            "--total-batch-size",
            "8192",
            "--parallel",
            "fsdp",
            "--optimizer",
            "muon",
        ]
    )
    r = resolve_choices(cfg, Target(gpu="A100-40GB", world_size=2))
    again = plan(r.cfg, r.hardware, world_size=2, tokens=r.plan.tokens)
    assert dataclasses.replace(again, micro_batch_choice=r.plan.micro_batch_choice) == r.plan
    assert memory(r.cfg, r.hardware, world_size=2) == r.plan.memory and r.plan.memory.shards == 2
    assert r.plan.memory.optimizer_name == "muon" and r.plan.dtype == "bf16"
    assert choose_loss_impl(r.cfg, r.hardware, world_size=2).impl == r.loss.impl
    assert choose_activation_checkpointing(r.cfg, r.hardware, world_size=2).mode == r.ac.mode


def test_a_hypothetical_gpu_resolves_its_own_precision_and_tf32():
    cfg = parse_config([*TINY_MODEL_FLAGS, "--data-dir", "d", "--out-dir", "o", "--total-batch-size", "4096"])
    r = resolve_choices(cfg, Target(gpu="H100-80GB", world_size=2))
    assert r.precision.dtype == "bfloat16" and r.hardware.name == "H100-80GB" and r.warning is None
    fp32 = parse_config(
        [*TINY_MODEL_FLAGS, "--data-dir", "d", "--out-dir", "o", "--dtype", "float32", "--tf32", "true"]
    )
    assert resolve_choices(fp32, Target(gpu="A100-80GB")).precision.key == "tf32"
    assert resolve_choices(fp32, Target(device=torch.device("cpu"))).precision.key == "fp32"  # a CPU has no TF32
