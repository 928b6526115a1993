"""Sharded checkpoints (--parallel fsdp, torch.distributed.checkpoint): written by every rank, atomic,
verified, kept K at a time; a killed run resumes bitwise; a 2-rank checkpoint continues on 1 and 3
ranks and under DDP (and a DDP one under FSDP); sample, eval and export read one in one process.
Real processes (torchrun, gloo, CPU, fp32), as tests/test_resume.py does for DDP."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
from _helpers import (
    hold_after_step,
    launch,
    losses,
    patched_train_script,
    release_run,
    run,
    seeded_rng,
    tiny_run_flags,
    ulps_apart,
    uninterrupted_run,
    wait_for_step,
)

from gpt2.ckpt import checkpoint as ckpt
from gpt2.core.config import ModelConfig, RunConfig, TrainConfig
from gpt2.train.state import check_compatible

pytestmark = pytest.mark.torch_feature("fsdp")  # FSDP2 on CPU: torch >= 2.6 (gpt2/core/compat.py)

MAX_STEPS = 8
CKPT_INTERVAL = 3
TOTAL_BATCH = 1536
"""Tokens per step: 2 ranks x 3, 3 ranks x 2 or 1 rank x 6 micro-batches of 4 x 64."""


def flags(data_dir, out_dir, *extra, parallel="fsdp"):
    return [
        *tiny_run_flags(data_dir, max_steps=MAX_STEPS, ckpt_interval=CKPT_INTERVAL),
        "--out-dir",
        str(out_dir),
        "--total-batch-size",
        str(TOTAL_BATCH),
        "--parallel",
        parallel,
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shakespeare_shards):
    """The uninterrupted 2-rank FSDP run: sharded checkpoints at steps 3, 6 and 8."""
    out = tmp_path_factory.mktemp("fsdp_reference")
    return uninterrupted_run(flags(shakespeare_shards, out / "run"), out, MAX_STEPS)


MUON = ("--optimizer", "muon")


@pytest.fixture(scope="module")
def muon_reference(tmp_path_factory, shakespeare_shards):
    """The uninterrupted 2-rank FSDP run with Muon (each sharded matrix gathered for Newton-Schulz)."""
    out = tmp_path_factory.mktemp("fsdp_muon_reference")
    done = run(flags(shakespeare_shards, out / "run", *MUON), nproc=2, log_dir=out)
    assert done.proc.returncode == 0, done.output()
    got = losses(out / "run")
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    assert got[MAX_STEPS] < got[1] - 0.1
    assert ckpt.load_checkpoint(step_dir(out / "run", MAX_STEPS))["optimizer_kind"] == "muon"
    return out / "run"


def step_dir(run_dir, step):
    return run_dir / "checkpoints" / f"step_{step:08d}"


def full_state(path, out) -> dict:
    """A sharded checkpoint as whole tensors (DCP's own converter, into file out) plus its train.pt."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, out)
    return {**torch.load(out, weights_only=False), "train": ckpt.load_checkpoint(path, verify=False)}


def assert_same_sharded_state(a: dict, b: dict) -> None:
    """Bitwise equal weights, optimizer moments and steps, data position and every rank's RNG."""
    assert a["model"].keys() == b["model"].keys() and a["model"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"weight {k} differs"
    # AdamW's state, or Muon's pair of optimizers ({"adamw": ..., "muon": ...}, gpt2/ckpt/dcp.py)
    inner = ["adamw", "muon"] if "state" not in a["optimizer"] else [None]
    for which in inner:
        oa, ob = (a["optimizer"], b["optimizer"]) if which is None else (a["optimizer"][which], b["optimizer"][which])
        sa, sb = oa["state"], ob["state"]
        assert sa.keys() == sb.keys() and sa, which
        for name in sa:
            for k in sa[name]:
                assert torch.equal(torch.as_tensor(sa[name][k]), torch.as_tensor(sb[name][k])), (
                    f"{which} {name}.{k} differs"
                )
    assert a["train"]["step"] == b["train"]["step"]
    assert a["train"]["loader"] == b["train"]["loader"]
    for ra, rb in zip(a["train"]["rng"], b["train"]["rng"], strict=True):
        assert torch.equal(ra["torch"], rb["torch"])


def copy_checkpoint(src, run_dir):
    """A checkpoint (file or directory) and its sidecar into run_dir/checkpoints, as a user copies one."""
    dest = run_dir / "checkpoints"
    dest.mkdir(parents=True, exist_ok=True)
    (shutil.copytree if src.is_dir() else shutil.copy)(src, dest / src.name)
    shutil.copy(src.with_suffix(".json"), dest / src.with_suffix(".json").name)
    return dest / src.name


RESHARD_ULPS = 8
"""How far (float32 ulps of the loss) a run resumed on another layout may drift from the uninterrupted
one. A resharded or re-laid-out resume sums the gradients over another partition (3 ranks x 2
micro-steps instead of 2 x 3; DDP's buckets instead of FSDP's reduce-scatter), so every update after
it rounds differently: measured up to 2 ulps by step 8 on an AVX2-only CPU (10.18438720703125 vs
10.184385299682617) and 0.3 on one with avx512, whose wider vectors sum in another order. A real
resharding bug (a wrong, missing or doubled shard, a moment not carried over) moves the loss by 1e-4
or more, hundreds of ulps: 8 leaves room for other CPUs' vector widths and catches every such bug."""


def assert_losses_close(got: dict, want: dict, steps, ulps: float = RESHARD_ULPS):
    assert sorted(s for s in got if s in steps) == list(steps), got
    for s in steps:
        apart = ulps_apart(got[s], want[s])
        assert apart <= ulps, f"step {s}: {got[s]} vs {want[s]}: {apart:.1f} float32 ulps apart (at most {ulps})"


# ------------------------------------------------------------------ layout and atomicity (real checkpoints)


def test_each_rank_writes_its_shards_and_the_sidecar_hashes_every_file(reference):
    path = step_dir(reference, CKPT_INTERVAL)
    assert ckpt.is_sharded_checkpoint(path)
    meta = ckpt.read_sidecar(path)
    assert sorted(meta["files"]) == sorted(p.name for p in path.iterdir())
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", ckpt.TRAIN_FILE} == set(meta["files"])
    assert meta["bytes"] == sum(f["bytes"] for f in meta["files"].values()) == ckpt.checkpoint_size(path)
    for name, f in meta["files"].items():
        assert ckpt.file_sha256(path / name) == f["sha256"], name
    # neither rank holds the whole model: each shard file is about half of the model and its moments
    shards = [meta["files"][n]["bytes"] for n in ("__0_0.distcp", "__1_0.distcp")]
    assert max(shards) < 0.6 * sum(shards)
    train = ckpt.load_checkpoint(path)
    assert train["sharded"] and train["world_size"] == 2 and "model" not in train and "optimizer" not in train
    assert len(train["rng"]) == 2 and train["optimizer_kind"] == "adamw"
    assert (reference / "checkpoints" / "latest").read_text().strip() == f"step_{MAX_STEPS:08d}"
    assert not list((reference / "checkpoints").glob("*.tmp"))


def test_damaged_or_unfinished_sharded_checkpoints_are_never_chosen(tmp_path, reference):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    ckdir = run_dir / "checkpoints"
    warnings = []
    # a write killed before its rename, and one renamed but without its sidecar yet
    shutil.copytree(ckdir / f"step_{MAX_STEPS:08d}", ckdir / "step_00000009.tmp")
    shutil.copytree(ckdir / f"step_{MAX_STEPS:08d}", ckdir / "step_00000010")
    assert ckpt.latest_valid(run_dir, warnings.append) == step_dir(run_dir, MAX_STEPS)
    # a missing shard file: named, with the fix; auto falls back to the one before
    (step_dir(run_dir, MAX_STEPS) / "__1_0.distcp").unlink()
    missing = r"__1_0\.distcp: missing from the sharded checkpoint.*--resume auto"
    with pytest.raises(ckpt.CheckpointError, match=missing):
        ckpt.verify_checkpoint(step_dir(run_dir, MAX_STEPS))
    assert ckpt.latest_valid(run_dir, warnings.append) == step_dir(run_dir, 6)
    # a flipped byte: the sha256 of that file, named
    shard = step_dir(run_dir, 6) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"__0_0\.distcp: sha256 does not match the sidecar"):
        ckpt.verify_checkpoint(step_dir(run_dir, 6))
    assert ckpt.latest_valid(run_dir, warnings.append) == step_dir(run_dir, 3)
    assert any("step_00000010" in w and "sidecar" in w for w in warnings), warnings
    with pytest.raises(ckpt.CheckpointError, match="sha256 does not match"):  # named explicitly: refused
        ckpt.resolve_resume(str(step_dir(run_dir, 6)), run_dir)
    assert ckpt.resolve_resume(str(step_dir(run_dir, 3)), run_dir) == step_dir(run_dir, 3)


@pytest.mark.slow
def test_an_incompatible_sharded_checkpoint_is_refused_before_loading(reference):
    class Log:
        def info(self, msg):
            pass

    saved = ckpt.load_checkpoint(step_dir(reference, 3))
    model = ModelConfig(**saved["config"]["model"])
    wider = ModelConfig(**{**saved["config"]["model"], "n_embd": 128})
    with pytest.raises(ckpt.CheckpointError, match="model shape differs.*n_embd: checkpoint 64 vs now 128"):
        check_compatible(saved, RunConfig(wider, TrainConfig.of(data_dir="d", out_dir="o")), Log())
    other = "trained with --optimizer adamw, this run asks for --optimizer muon"
    with pytest.raises(ckpt.CheckpointError, match=other):
        check_compatible(saved, RunConfig(model, TrainConfig.of(data_dir="d", out_dir="o", optimizer="muon")), Log())
    check_compatible(saved, RunConfig(model, TrainConfig.of(data_dir="d", out_dir="o")), Log())


def test_retention_keeps_k_directories_and_a_rewrite_replaces_the_step(tmp_path):
    def write(step, payload=b"x"):
        tmp = ckpt.begin_sharded(tmp_path, step)
        for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", ckpt.TRAIN_FILE):
            (tmp / name).write_bytes(payload * step)
        files = ckpt.hash_files(tmp, ckpt.own_files(tmp, 0)) | ckpt.hash_files(tmp, ckpt.own_files(tmp, 1))
        return ckpt.publish_sharded(tmp_path, step, files, keep=2, run_id="r")

    assert ckpt.own_files(ckpt.begin_sharded(tmp_path, 99), 1) == []  # (and a stale temp, removed below)
    for step in (1, 2, 3):
        write(step)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_00000002", "step_00000002.json", "step_00000003", "step_00000003.json"]
    ckpt.save_checkpoint(tmp_path, 3, {"x": 1}, keep=2, run_id="r")  # the same step as a .pt: replaces it
    assert not step_dir(tmp_path, 3).exists() and ckpt.looks_complete(tmp_path / "checkpoints" / "step_00000003.pt")
    write(3, b"y")
    assert not (tmp_path / "checkpoints" / "step_00000003.pt").exists()
    ckpt.verify_checkpoint(step_dir(tmp_path, 3))


# ------------------------------------------------------------------ resume: same size, resharded, DDP


@pytest.mark.parametrize(
    "optimizer", ["adamw", pytest.param("muon", marks=[pytest.mark.torch_feature("muon"), pytest.mark.slow])]
)
@pytest.mark.slow
def test_kill_9_then_resume_auto_continues_bitwise(tmp_path, shakespeare_shards, optimizer, request):
    reference = request.getfixturevalue("reference" if optimizer == "adamw" else "muon_reference")
    extra = MUON if optimizer == "muon" else ()
    rng = seeded_rng(request)
    victim = rng.choice([0, 1])
    kill_after = rng.randint(CKPT_INTERVAL + 1, MAX_STEPS - 2)
    where = f"rank {victim} killed after step {kill_after}"
    run_dir, release = tmp_path / "run", tmp_path / "release"
    job = launch(
        flags(shakespeare_shards, run_dir, *extra),
        nproc=2,
        log_dir=tmp_path,
        max_restarts=1,
        script=patched_train_script(tmp_path, hold_after_step(kill_after, release)),
    )
    try:
        wait_for_step(job, run_dir, kill_after)
        pids = job.workers()
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[victim], signal.SIGKILL)
        release_run(job, release)
        assert job.wait() == 0, f"{where}\n{job.output()}"
    finally:
        job.kill()
    resumed = [line for line in job.stdout.splitlines() if line.startswith("resumed from ")]
    assert len(resumed) == 1 and f"step_{CKPT_INTERVAL:08d} at step {CKPT_INTERVAL}" in resumed[0], job.output()
    assert losses(run_dir) == losses(reference), where  # bitwise: the floats of every step
    assert_same_sharded_state(
        full_state(step_dir(run_dir, MAX_STEPS), tmp_path / "resumed.pt"),
        full_state(step_dir(reference, MAX_STEPS), tmp_path / "reference.pt"),
    )
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_three_ranks(tmp_path, shakespeare_shards, reference):
    """DCP reshards the 2-rank shards over 3 ranks; the loader keeps the global batch. Compared:
    every resumed step's loss (the first one, step 4, included) with the uninterrupted 2-rank run's
    same step, same 1536-token global batch."""
    copy_checkpoint(step_dir(reference, CKPT_INTERVAL), tmp_path / "run")
    three = run(flags(shakespeare_shards, tmp_path / "run"), nproc=3, log_dir=tmp_path)
    assert three.proc.returncode == 0, three.output()
    assert "resume: world size 2 -> 3; accumulation is now 2 micro-steps" in three.stdout
    assert_losses_close(losses(tmp_path / "run"), losses(reference), range(CKPT_INTERVAL + 1, MAX_STEPS + 1))
    assert ckpt.read_sidecar(step_dir(tmp_path / "run", MAX_STEPS))["files"].keys() >= {"__2_0.distcp"}


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one_process(tmp_path, shakespeare_shards, reference):
    """One process (no process group, the plain model): DCP reads the whole tensors; it then writes .pt."""
    copy_checkpoint(step_dir(reference, CKPT_INTERVAL), tmp_path / "run")
    one = run(flags(shakespeare_shards, tmp_path / "run"), nproc=1, log_dir=tmp_path)
    assert one.proc.returncode == 0, one.output()
    assert "resume: world size 2 -> 1; accumulation is now 6 micro-steps" in one.stdout
    assert_losses_close(losses(tmp_path / "run"), losses(reference), range(CKPT_INTERVAL + 1, MAX_STEPS + 1))


@pytest.mark.slow
def test_fsdp_checkpoint_continues_under_ddp_and_back(tmp_path, shakespeare_shards, reference):
    """FSDP step 3 -> DDP (FQN-keyed moments into param-id keyed AdamW) to step 8, writing .pt files;
    its step-6 .pt -> FSDP again (whole tensors sliced into shards). Both follow the FSDP reference."""
    copy_checkpoint(step_dir(reference, CKPT_INTERVAL), tmp_path / "ddp")
    ddp = run(flags(shakespeare_shards, tmp_path / "ddp", parallel="ddp"), nproc=2, log_dir=tmp_path / "log_ddp")
    assert ddp.proc.returncode == 0, ddp.output()
    assert "resume: parallel changed from 'fsdp' to 'ddp'" in ddp.stdout
    assert_losses_close(losses(tmp_path / "ddp"), losses(reference), range(CKPT_INTERVAL + 1, MAX_STEPS + 1))
    pt = tmp_path / "ddp" / "checkpoints" / "step_00000006.pt"
    ckpt.verify_checkpoint(pt)
    copy_checkpoint(pt, tmp_path / "fsdp")
    back = run(flags(shakespeare_shards, tmp_path / "fsdp"), nproc=2, log_dir=tmp_path / "log_fsdp")
    assert back.proc.returncode == 0, back.output()
    assert f"resumed from {tmp_path}/fsdp/checkpoints/step_00000006.pt at step 6" in back.stdout
    assert_losses_close(losses(tmp_path / "fsdp"), losses(reference), range(7, MAX_STEPS + 1))
    assert ckpt.is_sharded_checkpoint(step_dir(tmp_path / "fsdp", MAX_STEPS))


@pytest.mark.slow
@pytest.mark.torch_feature("muon")
def test_muon_fsdp_checkpoint_continues_under_ddp(tmp_path, shakespeare_shards, muon_reference):
    """Muon's pair of optimizers, FQN-keyed in DCP, into DDP's Muon (param-id keyed, each matrix's
    momentum whole on every rank): steps 4..8 follow the uninterrupted FSDP Muon run."""
    copy_checkpoint(step_dir(muon_reference, CKPT_INTERVAL), tmp_path / "ddp")
    ddp = run(flags(shakespeare_shards, tmp_path / "ddp", *MUON, parallel="ddp"), nproc=2, log_dir=tmp_path)
    assert ddp.proc.returncode == 0, ddp.output()
    assert "resume: parallel changed from 'fsdp' to 'ddp'" in ddp.stdout
    assert_losses_close(losses(tmp_path / "ddp"), losses(muon_reference), range(CKPT_INTERVAL + 1, MAX_STEPS + 1))


# ------------------------------------------------------------------ the tools read it in one process


def test_sample_eval_and_export_load_a_two_rank_fsdp_checkpoint(tmp_path, reference, shakespeare_shards, capsys):
    import gpt2.eval
    import gpt2.export
    import gpt2.sample
    from gpt2.ckpt.load import load_any
    from gpt2.model.hf import load_hf_dir

    full = full_state(step_dir(reference, MAX_STEPS), tmp_path / "full.pt")
    for path in (reference, reference / "checkpoints", step_dir(reference, MAX_STEPS)):
        model, info = load_any(path)
        assert info == {"source": "checkpoint", "path": str(step_dir(reference, MAX_STEPS)), "step": MAX_STEPS}
        for k, v in model.state_dict().items():
            assert torch.equal(v, full["model"].get(k, full["model"]["transformer.wte.weight"])), k
    assert model.lm_head.weight is model.transformer.wte.weight

    assert (
        gpt2.eval.main(
            [
                "loss",
                "--checkpoint",
                str(reference),
                "--data-dir",
                str(shakespeare_shards),
                "--eval-tokens",
                "1024",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--json",
            ]
        )
        == 0
    )
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    val = [
        r["val_loss"]
        for r in map(json.loads, (reference / "metrics.jsonl").read_text().splitlines())
        if r.get("step") == MAX_STEPS and "val_loss" in r
    ]
    assert val and got["loss"] == pytest.approx(val[0], abs=1e-5)  # the run's own final evaluation

    assert (
        gpt2.sample.main(
            [
                "--checkpoint",
                str(step_dir(reference, MAX_STEPS)),
                "--max-new-tokens",
                "8",
                "--device",
                "cpu",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    printed = capsys.readouterr()
    assert f"loaded checkpoint step {MAX_STEPS} from {step_dir(reference, MAX_STEPS)}:" in printed.err
    assert printed.out.split("-" * 40)[0].strip()  # the sampled text

    assert gpt2.export.main(["--checkpoint", str(reference), "--out", str(tmp_path / "hf")]) == 0
    hf = load_hf_dir(tmp_path / "hf")
    for k, v in hf.state_dict().items():  # Hugging Face's vocabulary: 50257 of the padded 50304 rows
        rows = 50257 if k in ("transformer.wte.weight", "lm_head.weight") else None
        assert torch.equal(v[:rows], model.state_dict()[k][:rows]), k
