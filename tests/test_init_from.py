"""--init-from (gpt2/train/init_from.py): a new run from trained weights. Step 0's val loss is the source
model's; the optimizer, schedule and step start fresh; a resume of the new run continues it, not the
source; bad sources are refused in one line before any work; under ddp and fsdp on 2 ranks every rank
holds the source's weights."""

from __future__ import annotations

import hashlib
import importlib
import json
import shutil

import pytest
import torch
from _helpers import FP32_CPU, import_train_ddp, losses, records, run, spawn_ranks
from conftest import TINY_MODEL_FLAGS, run_trainer

from gpt2.core.config import ModelConfig

# Every run here: the same eval set (eval_tokens 1024 at micro-batch 4), so step 0's val loss of a run
# started from a model equals that model's own last val loss.
COMMON = [
    *FP32_CPU,
    "--loss-impl",  # pinned: auto measures this CPU and, under load, two runs a test compares could differ
    "chunked",
    "--micro-batch-size",
    "4",
    "--total-batch-size",
    "512",
    "--warmup-steps",
    "3",
    "--lr",
    "3e-3",
    "--eval-tokens",
    "1024",
    "--log-interval",
    "1",
    "--eval-interval",
    "0",
]


def val_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in records(run_dir) if "val_loss" in r}


@pytest.fixture(scope="module")
def source(tmp_path_factory, shakespeare_shards):
    """A tiny model trained 5 steps (its run directory, checkpoint, last val loss) and its export."""
    base = tmp_path_factory.mktemp("source")
    done = run_trainer(
        [
            *TINY_MODEL_FLAGS,
            *COMMON,
            "--data-dir",
            str(shakespeare_shards),
            "--max-steps",
            "5",
            "--ckpt-interval",
            "0",
            "--out-dir",
            str(base / "run"),
        ]
    )
    assert done.returncode == 0, done.stderr
    import subprocess
    import sys

    from conftest import REPO

    export = subprocess.run(
        [sys.executable, "-m", "gpt2.export", "--checkpoint", str(base / "run"), "--out", str(base / "hf")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert export.returncode == 0, export.stderr
    return {
        "run": base / "run",
        "ckpt": base / "run" / "checkpoints" / "step_00000005.pt",
        "hf": base / "hf",
        "val_loss": val_losses(base / "run")[5],
        "data": shakespeare_shards,
    }


def fine_tune(source, out, *extra, steps: int = 1, nproc: int = 1, log_dir=None):
    args = [
        *COMMON,
        "--data-dir",
        str(source["data"]),
        "--max-steps",
        str(steps),
        "--ckpt-interval",
        "1",
        "--out-dir",
        str(out),
        *extra,
    ]
    if nproc == 1:
        return run_trainer(args)
    return run(args, nproc=nproc, log_dir=log_dir)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    "kind", ["hf", pytest.param("ckpt", marks=pytest.mark.slow), pytest.param("run", marks=pytest.mark.slow)]
)
def test_step_0_is_the_source_model_and_the_rest_starts_fresh(tmp_path, source, kind):
    """From our export (HF directory), a checkpoint file and a run directory: step 0's val loss is the
    source's (fp32, eager) within 1e-5; the optimizer's state is one step old after step 1 (no moments
    or step count came with the weights); the lr is the schedule's first; config.json names the source
    and its sha256; the shape came from the weights (no shape flag given)."""
    out = tmp_path / "ft"
    done = fine_tune(source, out, "--init-from", str(source[kind]))
    assert done.returncode == 0, done.stderr
    assert abs(val_losses(out)[0] - source["val_loss"]) < 1e-5
    state = torch.load(out / "checkpoints" / "step_00000001.pt", map_location="cpu", weights_only=True)
    assert state["step"] == 1 and state["loader"]["position"] > 0
    steps = {int(s["step"]) for s in state["optimizer"]["state"].values()}
    assert steps == {1}, steps  # AdamW's own count: fresh moments, one update old
    src = torch.load(source["ckpt"], map_location="cpu", weights_only=True)
    assert src["run_id"] != state["run_id"]
    assert state["config"]["model"] == {**src["config"]["model"]}  # the shape came from the weights
    assert losses(out)[1] and records(out)[1]["lr"] == pytest.approx(3e-3 / 3)  # warmup's step 0 lr
    info = json.loads((out / "config.json").read_text())
    record = info["init_from"]
    if kind == "hf":
        assert record["kind"] == "hf" and record["sha256"] == sha256(source["hf"] / "model.safetensors")
        assert record["files"]["config.json"]["sha256"] == sha256(source["hf"] / "config.json")
    else:
        assert record["kind"] == "checkpoint" and record["step"] == 5
        assert record["path"] == str(source["ckpt"].resolve()) and record["sha256"] == sha256(source["ckpt"])
    assert info["config"]["train"]["ckpt"]["init_from"] == str(source[kind])
    assert "init from " in done.stdout and "start fresh" in done.stdout


@pytest.mark.slow
def test_a_resume_of_the_new_run_continues_it_not_the_source(tmp_path, source):
    """The same command line again (a requeue, --init-from still there) with a later --max-steps: the
    run resumes its own step 2 and trains steps 3-4 exactly as one uninterrupted 4-step run; the source
    is not read again, and config.json keeps the record of where the weights came from."""
    flags = ("--init-from", str(source["hf"]))
    whole = tmp_path / "whole"
    assert fine_tune(source, whole, *flags, steps=4).returncode == 0
    out = tmp_path / "ft"
    first = fine_tune(source, out, *flags, steps=2)
    assert first.returncode == 0, first.stderr
    record = json.loads((out / "config.json").read_text())["init_from"]
    again = fine_tune(source, out, *flags, steps=4)
    assert again.returncode == 0, again.stderr
    assert "not read: this run resumes its own checkpoint" in again.stdout
    assert losses(out) == losses(whole)  # bitwise: the resume continued the new run exactly
    assert [r["step"] for r in records(out) if "val_loss" in r] == [0, 2, 4]  # step 0 once: by the first start
    assert val_losses(out)[4] == val_losses(whole)[4]
    assert json.loads((out / "config.json").read_text())["init_from"] == record


@pytest.mark.slow
def test_without_init_from_nothing_changes(tmp_path, source):
    """Without --init-from a fixed-seed run is what it was: the same run twice gives bitwise the same
    losses, and config.json has no init_from entry. (build() still seeds and initialises in the same
    order; the start decision it now makes before them draws no torch random numbers: a run id is
    the time and secrets.token_hex.)"""
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        assert fine_tune(source, out, *TINY_MODEL_FLAGS, steps=2).returncode == 0
    assert losses(a) == losses(b)
    assert "init_from" not in json.loads((a / "config.json").read_text())


def refusal(argv, *, lines: int = 1) -> str:
    """parse_command's one-line refusal (exit 2) of argv (lines=2: TrainConfig's list of problems, one)."""
    import contextlib
    import io

    from gpt2.train.cli import parse_command

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        parse_command(argv)
    assert e.value.code == 2
    said = err.getvalue().strip().splitlines()
    assert len(said) == lines, said
    return said[-1]


def hf_dir_like(source, tmp_path, **changes):
    d = tmp_path / "other"
    shutil.copytree(source["hf"], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **changes}))
    return d


def test_bad_sources_and_conflicting_flags_are_refused_in_one_line(tmp_path, source):
    base = ["--data-dir", "d", "--out-dir", str(tmp_path / "run")]
    line = refusal([*base, "--init-from", str(source["hf"]), "--n-layer", "3", "--n-embd", "64"])
    assert "--n-layer gives n_layer=3, the weights have n_layer=2" in line and "n_embd" not in line
    assert "--preset debug gives n_layer=4" in refusal([*base, "--preset", "debug", "--init-from", str(source["ckpt"])])
    assert "no such file or directory" in refusal([*base, "--init-from", str(tmp_path / "missing")])
    llama = hf_dir_like(source, tmp_path, model_type="llama")
    assert "describes a 'llama' model, not GPT-2" in refusal([*base, "--init-from", str(llama)])
    shutil.rmtree(llama)
    vocab = hf_dir_like(source, tmp_path, vocab_size=32000)
    assert "vocab_size=32000" in refusal([*base, "--init-from", str(vocab)])
    (tmp_path / "empty").mkdir()
    assert "holds no config.json" in refusal([*base, "--init-from", str(tmp_path / "empty")])
    assert "pass one of them" in refusal(
        [*base, "--init-from", str(source["hf"]), "--resume", str(source["ckpt"])], lines=2
    )
    assert "add --init-from" in refusal([*base, "--preset", "finetune"])
    # The shape comes from the weights; fields that are not shape (dropout) may be set.
    from gpt2.train.cli import parse_config

    cfg = parse_config([*base, "--preset", "finetune", "--init-from", str(source["hf"]), "--dropout", "0.1"])
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.vocab_size, cfg.model.dropout) == (2, 64, 50304, 0.1)
    assert cfg.train.schedule.lr == 3e-5 and cfg.train.schedule.decay_steps == 20


def test_the_hub_unreachable_is_one_line_naming_the_directory_form(tmp_path, monkeypatch):
    # huggingface_hub (datasets' dependency) reads HF_HUB_OFFLINE once, at its import: imported before the variable
    # is set, as an earlier test in this worker may have, its retries took ~25 s to fail (CI, 2026-12-06)
    importlib.import_module("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as unreachable as no network, without its retries
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # an empty cache
    line = refusal(["--data-dir", "d", "--out-dir", str(tmp_path / "run"), "--init-from", "gpt2-xl"])
    assert "--init-from gpt2-xl: the Hugging Face hub is unreachable (HF_HUB_OFFLINE is set)" in line
    assert "snapshot_download('openai-community/gpt2-xl'" in line and "pass --init-from gpt2-xl-hf" in line


def test_a_corrupt_weights_file_stops_the_run_with_one_line_exit_2(tmp_path, source):
    bad = tmp_path / "bad"
    shutil.copytree(source["hf"], bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    done = fine_tune(source, tmp_path / "ft", "--init-from", str(bad))
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "model.safetensors: unreadable" in errors[0] and "--init-from" in errors[0], errors
    assert not (tmp_path / "ft" / "checkpoints").exists() or not any((tmp_path / "ft" / "checkpoints").iterdir())


def test_dry_run_reports_the_source_without_reading_the_weights(tmp_path, source, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(source["hf"], hf)
    (hf / "model.safetensors").write_bytes(b"not read by a rehearsal")
    code = import_train_ddp().main(
        [
            "--data-dir",
            str(source["data"]),
            "--out-dir",
            str(tmp_path / "run"),
            *COMMON,
            "--max-steps",
            "2",
            "--init-from",
            str(hf),
            "--dry-run",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"init from  Hugging Face directory {hf}: n_layer=2 n_head=2 n_embd=64 block_size=64" in out
    assert "the model n_layer=2 n_head=2 n_embd=64 block_size=64" in out
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("parallel", ["ddp", pytest.param("fsdp", marks=pytest.mark.torch_feature("fsdp"))])
def test_two_ranks_start_from_the_source(tmp_path, source, parallel):
    """torchrun, 2 gloo ranks: step 0's val loss (every rank's share of the eval set, all-reduced) is the
    source's; and a resume of that run on 2 ranks continues it."""
    out = tmp_path / "ft"
    done = fine_tune(
        source, out, "--init-from", str(source["hf"]), "--parallel", parallel, nproc=2, log_dir=tmp_path / "log"
    )
    assert done.proc.returncode == 0, done.output()
    assert abs(val_losses(out)[0] - source["val_loss"]) < 1e-5
    assert json.loads((out / "config.json").read_text())["init_from"]["kind"] == "hf"


def _ranks_agree_worker(rank: int, world: int, init_file: str, out: str, hf_dir: str, parallel: str) -> None:
    """build()'s sequence on each rank: a fresh GPT (each rank a different seed, so agreement cannot be
    by accident), start_from_weights (rank 0 reads), then fsdp's sharding or ddp's wrap; every rank's
    full weights saved."""
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gpt2.distributed.fsdp import shard
    from gpt2.distributed.group import Dist
    from gpt2.model.gpt import GPT
    from gpt2.train.init_from import describe_source, start_from_weights

    class Log:
        def info(self, message):
            pass

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        dist = Dist(rank, rank, world, world, torch.device("cpu"))
        torch.manual_seed(100 + rank)
        model = GPT(ModelConfig(**describe_source(hf_dir).shape))
        start_from_weights(model, hf_dir, None, out, None, dist, Log(), broadcast=parallel == "fsdp")
        if parallel == "fsdp":
            shard(model, dist)
            weights = {n: p.full_tensor() for n, p in model.named_parameters()}
        else:
            wrapped = DDP(model)
            weights = {n.removeprefix("module."): p.detach().clone() for n, p in wrapped.named_parameters()}
        torch.save(weights, f"{out}/rank{rank}.pt")
        tdist.barrier()
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize("parallel", ["ddp", pytest.param("fsdp", marks=pytest.mark.torch_feature("fsdp"))])
def test_every_rank_holds_the_source_weights(tmp_path, source, parallel):
    from gpt2.model.hf import load_hf_dir

    spawn_ranks(_ranks_agree_worker, (2, str(tmp_path / "init"), str(tmp_path), str(source["hf"]), parallel), 2)
    truth = load_hf_dir(source["hf"]).state_dict()
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got.keys() <= truth.keys() and len(got) > 10
        assert all(torch.equal(got[n], truth[n]) for n in got), rank
