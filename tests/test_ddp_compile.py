"""torch.compile under DDP (gpt2/train/trainer.py build, wrap_ddp): the gradient all-reduce overlaps the
compiled backward. Two real gloo ranks (torch.multiprocessing spawn) through the trainer's build() and
train_step(): the same losses as uncompiled DDP, one compiled backward graph per bucket, and a profile
in which the first all-reduce starts before the last backward graph ends."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from _helpers import built, spawn_ranks

STEPS = 10


def _config(data_dir: Path, out_dir: Path, *, compile: bool):
    from gpt2.train.cli import parse_config

    # 2 ranks x 2 sequences x 64 tokens x 2 micro-steps: no_sync is exercised too. A block's weights
    # are 0.75 MiB: with 1 MiB buckets the blocks and the (tied) embedding fall into several buckets.
    return parse_config(
        [
            "--n-layer",
            "3",
            "--n-head",
            "2",
            "--n-embd",
            "128",
            "--block-size",
            "64",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--compile",
            str(compile).lower(),
            "--data-dir",
            str(data_dir),
            "--out-dir",
            str(out_dir),
            "--micro-batch-size",
            "2",
            "--total-batch-size",
            "512",
            "--max-steps",
            str(STEPS + 1),
            "--lr",
            "3e-3",
            "--warmup-steps",
            "2",
            "--eval-tokens",
            "512",
            "--ddp-bucket-cap-mb",
            "1",
            "--num-threads",
            "1",
        ]
    )


def _rank(rank: int, data_dir: str, tmp: str) -> None:
    import torch.distributed as tdist
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    from gpt2.distributed.group import Dist
    from gpt2.train.run_log import RunLog
    from gpt2.train.trainer import evaluate, train_step

    tdist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    dist = Dist(rank=rank, local_rank=rank, world_size=2, local_world_size=2, device=torch.device("cpu"))
    torch.set_num_threads(1)
    result = {}
    for compiled in (False, True):
        cfg = _config(Path(data_dir), Path(tmp) / f"run_{compiled}", compile=compiled)
        parts = built(cfg, dist, RunLog(dist, cfg.train.ckpt.out_dir))
        # As the trainer does at step 0: the model is first compiled for evaluation, outside DDP's
        # forward (eval mode, no grad); training must still get the graphs split at the buckets.
        val_loss = evaluate(parts, dist)
        counters.clear()
        losses = [train_step(parts, cfg.train, dist, False)["loss"] for _ in range(STEPS)]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train_step(parts, cfg.train, dist, False)
        events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()]
        backward = [(s, e) for name, s, e in events if name == "CompiledFunctionBackward"]
        reduces = [s for name, s, _ in events if name == "c10d::allreduce_"]
        result[str(compiled)] = {
            "val_loss": val_loss,
            "losses": losses,
            "aot_graphs": counters["aot_autograd"]["total"],
            "backward_graphs_per_step": len(backward) // parts.accum_steps,
            "first_allreduce_start": min(reduces),
            "last_backward_end": max((e for _, e in backward), default=None),
            "state_keys": list(parts.model.state_dict()),
        }
    if rank == 0:
        (Path(tmp) / "result.json").write_text(json.dumps(result))
    tdist.destroy_process_group()


@pytest.fixture(scope="module")
def overlap(tmp_path_factory, shakespeare_shards):
    tmp = tmp_path_factory.mktemp("ddp_compile")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spawn_ranks(_rank, (str(shakespeare_shards), str(tmp)), nprocs=2)
    return json.loads((tmp / "result.json").read_text())


@pytest.mark.slow
def test_compiled_ddp_losses_equal_uncompiled_ddp(overlap):
    eager, compiled = overlap["False"]["losses"], overlap["True"]["losses"]
    assert len(eager) == STEPS and eager[0] != eager[-1]  # the model trained
    assert max(abs(a - b) for a, b in zip(eager, compiled, strict=True)) < 1e-5, (eager, compiled)
    assert abs(overlap["False"]["val_loss"] - overlap["True"]["val_loss"]) < 1e-5


@pytest.mark.slow
def test_compiled_backward_is_split_at_the_buckets(overlap):
    run = overlap["True"]
    assert run["aot_graphs"] > 1, run  # DDPOptimizer's subgraphs, each compiled forward+backward
    assert run["backward_graphs_per_step"] == run["aot_graphs"], run  # each runs its backward every micro-step
    assert overlap["False"]["aot_graphs"] == 0


@pytest.mark.slow
def test_first_all_reduce_starts_before_the_last_backward_graph_ends(overlap):
    run = overlap["True"]
    assert run["last_backward_end"] is not None
    assert run["first_allreduce_start"] < run["last_backward_end"], run


@pytest.mark.slow
def test_checkpoint_keys_of_a_compiled_ddp_model_have_no_wrapper_prefix(overlap):
    keys = overlap["True"]["state_keys"]
    assert keys == overlap["False"]["state_keys"]
    assert not [k for k in keys if k.startswith(("_orig_mod.", "module."))]


def test_build_bounds_the_compile_workers_before_compiling(tmp_path, shakespeare_shards):
    import torch._inductor.config as inductor_config

    from gpt2.distributed.group import Dist, usable_cpus
    from gpt2.train.run_log import RunLog

    dist = Dist(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
    with inductor_config.patch(compile_threads=99):  # restored after (torch's own config patcher)
        for compiled, expected in ((False, 99), (True, usable_cpus())):
            cfg = _config(shakespeare_shards, tmp_path / str(compiled), compile=compiled)
            built(cfg, dist, RunLog(dist, cfg.train.ckpt.out_dir))
            assert inductor_config.compile_threads == expected
