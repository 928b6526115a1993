"""Checkpoint files: atomic writes, sidecars, retention, damaged files, compatibility, RNG, stop markers."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import (
    hold_after_step,
    import_train_ddp,
    launch,
    no_space_after,
    patched_train_script,
    tiny_run_flags,
    wait_for_step,
)
from conftest import REPO

from gpt2.ckpt import checkpoint as ckpt
from gpt2.ckpt.load import load_model
from gpt2.core.config import ModelConfig, RunConfig, TrainConfig
from gpt2.distributed import preempt
from gpt2.distributed.preempt import StopRequest
from gpt2.train.state import check_compatible, rng_state, set_rng_state


def state(step: int, n: int = 1000) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(n, generator=g)}, "note": f"step {step}"}


def names(out_dir) -> list[str]:
    return sorted(p.name for p in (out_dir / "checkpoints").iterdir())


class Log:
    """Stands in for RunLog: records what would be printed."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, message: str) -> None:
        self.lines.append(message)

    warn = info


def test_save_writes_file_sidecar_and_latest_atomically(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 7, state(7), keep=3)
    assert path == tmp_path / "checkpoints" / "step_00000007.pt"
    assert names(tmp_path) == ["latest", "step_00000007.json", "step_00000007.pt"]  # no temp files left
    meta = json.loads(path.with_suffix(".json").read_text())
    data = path.read_bytes()
    assert meta == {"step": 7, "file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000007.pt\n"
    loaded = ckpt.load_checkpoint(path)
    assert loaded["step"] == 7 and loaded["format"] == ckpt.FORMAT_VERSION and loaded["note"] == "step 7"
    assert torch.equal(loaded["model"]["w"], state(7)["model"]["w"])
    assert ckpt.resolve_resume("auto", tmp_path) == path
    assert ckpt.resolve_resume("never", tmp_path) is None
    assert ckpt.resolve_resume("auto", tmp_path / "elsewhere") is None  # fresh start


def test_retention_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in range(1, 6):
        ckpt.save_checkpoint(tmp_path, step, state(step), keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000005.pt", "step_00000004.pt"]
    assert not list((tmp_path / "checkpoints").glob("step_0000000[123].json"))


def test_retention_never_counts_or_keeps_incomplete_files_and_never_deletes_the_only_valid_one(tmp_path):
    ckdir = tmp_path / "checkpoints"
    ckpt.save_checkpoint(tmp_path, 1, state(1), keep=2)
    # Two later writes that died between the rename and the sidecar: no sidecar, they do not count.
    for step in (2, 3):
        ckpt.save_checkpoint(tmp_path, step, state(step), keep=5)
        (ckdir / f"step_{step:08d}.json").unlink()
    ckpt.save_checkpoint(tmp_path, 4, state(4), keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000004.pt", "step_00000001.pt"]
    # keep=1: only the one just written survives, and it is the valid one
    ckpt.save_checkpoint(tmp_path, 5, state(5), keep=1)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000005.pt"]
    ckpt.verify_checkpoint(ckdir / "step_00000005.pt")


def test_retention_after_resuming_an_earlier_checkpoint_keeps_the_one_just_written(tmp_path):
    """Resumed from step 2 while step 9 exists (an abandoned continuation): saving step 3 with keep=1 must
    not delete step 3 (the newest by step is 9) and `latest` names step 3."""
    for step in (2, 9):
        ckpt.save_checkpoint(tmp_path, step, state(step), keep=5)
    ckpt.save_checkpoint(tmp_path, 3, state(3), keep=1)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000009.pt", "step_00000003.pt"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000003.pt\n"


def test_auto_takes_the_newest_valid_step_whatever_latest_names(tmp_path):
    """Issue 32: `latest` naming step 2 while valid steps 4 and 6 exist made auto resume from 2 (and then
    overwrite 4 and 6). auto goes by step; `latest` is a hint, and a bad one (not UTF-8, not a name,
    a missing file) is never followed."""
    for step in (2, 4, 6):
        ckpt.save_checkpoint(tmp_path, step, state(step), keep=10)
    pointer = tmp_path / "checkpoints" / "latest"
    pointer.write_text("step_00000002.pt\n")
    warnings = []
    assert ckpt.resolve_resume("auto", tmp_path, warn=warnings.append).name == "step_00000006.pt"
    assert warnings == [
        f"{pointer} names step_00000002.pt, but step_00000006.pt is a later step and verifies: "
        "resuming from step_00000006.pt (--resume auto takes the newest valid checkpoint; pass "
        "--resume PATH for another)"
    ]
    for bad in (
        b"\xff\xfe step_\x80\n",
        b"",
        b"step_00000002.pt\nstep_00000004.pt\n",
        b"../../etc/passwd\n",
    ):
        pointer.write_bytes(bad)
        warnings = []
        assert ckpt.resolve_resume("auto", tmp_path, warn=warnings.append).name == "step_00000006.pt", bad
        assert warnings == [], bad
    # A missing file it names is a checkpoint that vanished (issue 58): said, with the steps it loses.
    pointer.write_bytes(b"step_00000099.pt\n")
    warnings = []
    assert ckpt.resolve_resume("auto", tmp_path, warn=warnings.append).name == "step_00000006.pt"
    assert len(warnings) == 1 and "steps 7-99 are lost" in warnings[0], warnings
    # The newest is damaged: the next one by step, not the one `latest` names.
    newest = tmp_path / "checkpoints" / "step_00000006.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    pointer.write_text("step_00000002.pt\n")
    warnings = []
    assert ckpt.resolve_resume("auto", tmp_path, warn=warnings.append).name == "step_00000004.pt"
    assert "truncated" in warnings[0] and "names step_00000002.pt, but step_00000004.pt" in warnings[1]


def test_run_id_is_in_the_checkpoint_and_its_sidecar(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 7, state(7), keep=3, run_id="run-a")
    assert json.loads(path.with_suffix(".json").read_text())["run_id"] == "run-a"
    assert ckpt.load_checkpoint(path)["run_id"] == "run-a"


def test_retention_neither_deletes_nor_counts_another_runs_checkpoints(tmp_path):
    """An earlier run's checkpoints left in checkpoints/ (at lower and higher steps): retention of this
    run keeps `keep` of its own, never deletes the others, and warns about them."""
    for step in (1, 9):
        ckpt.save_checkpoint(tmp_path, step, state(step), keep=10, run_id="old", warn=pytest.fail)
    warnings = []
    for step in (2, 3, 4):
        ckpt.save_checkpoint(tmp_path, step, state(step), keep=2, run_id="new", warn=warnings.append)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step_00000009.pt",
        "step_00000004.pt",
        "step_00000003.pt",
        "step_00000001.pt",
    ]
    for step in (1, 9):  # intact
        ckpt.verify_checkpoint(tmp_path / "checkpoints" / f"step_{step:08d}.pt")
    assert len(warnings) == 6 and all("belongs to run old, not to this directory's run new" in w for w in warnings)
    # keep=1: only this run's newest survives of its own; the other run's still stay
    ckpt.save_checkpoint(tmp_path, 5, state(5), keep=1, run_id="new", warn=warnings.append)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step_00000009.pt",
        "step_00000005.pt",
        "step_00000001.pt",
    ]


def test_auto_takes_the_newest_of_the_directorys_run_not_the_pointer_to_another(tmp_path):
    ckpt.save_checkpoint(tmp_path, 2, state(2), keep=10, run_id="ours")
    ckpt.save_checkpoint(tmp_path, 9, state(9), keep=10, run_id="theirs", warn=lambda m: None)  # `latest` -> 9
    (tmp_path / "config.json").write_text(json.dumps({"run_id": "ours"}))
    warnings = []
    assert ckpt.resolve_resume("auto", tmp_path, warn=warnings.append).name == "step_00000002.pt"
    assert len(warnings) == 1 and "step_00000009.pt: it belongs to run theirs" in warnings[0]
    # Named explicitly, a file of any run is taken (the trainer decides what that means for the directory).
    assert ckpt.resolve_resume(str(tmp_path / "checkpoints" / "step_00000009.pt"), tmp_path).name == "step_00000009.pt"


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage_sidecar"])
def test_damaged_newest_checkpoint_is_skipped_by_auto_and_refused_by_name(tmp_path, damage):
    good = ckpt.save_checkpoint(tmp_path, 1, state(1), keep=3)
    bad = ckpt.save_checkpoint(tmp_path, 2, state(2), keep=3)
    data = bytearray(bad.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        bad.write_bytes(bytes(data))
    elif damage == "truncate":
        bad.write_bytes(bytes(data[: len(data) // 3]))
    else:
        bad.with_suffix(".json").write_text("{not json")
    warnings = []
    assert ckpt.resolve_resume("auto", tmp_path, warn=warnings.append) == good
    assert len(warnings) == 1 and "skipping checkpoint" in warnings[0] and bad.name in warnings[0]
    expected = {"flip": "sha256 does not match", "truncate": "truncated", "garbage_sidecar": "did not finish"}[damage]
    with pytest.raises(ckpt.CheckpointError, match=expected):
        ckpt.resolve_resume(str(bad), tmp_path)
    with pytest.raises(ckpt.CheckpointError, match=expected):
        ckpt.load_checkpoint(bad)
    ckpt.load_checkpoint(good)


def test_a_checkpoint_whose_sidecar_is_gone_is_used_with_a_warning_when_it_checks_out(tmp_path):
    """Issue 41: sidecars removed (a copy tool that skips .json files, a person tidying up) made auto skip
    every checkpoint and start over, and --resume PATH and gpt2.export refuse the intact files. A .pt
    whose zip checksums match and that loads as the step its name says is used, with a warning."""
    ckpt.save_checkpoint(tmp_path, 1, state(1), keep=3, run_id="r")
    path = ckpt.save_checkpoint(tmp_path, 2, state(2), keep=3, run_id="r")
    data, sidecar = path.read_bytes(), json.loads(path.with_suffix(".json").read_text())
    for p in (tmp_path / "checkpoints").glob("*.json"):
        p.unlink()
    warnings = []
    assert ckpt.resolve_resume("auto", tmp_path, warn=warnings.append) == path
    assert warnings == [
        f"checkpoint {path} has lost its sidecar step_00000002.json (size and sha256): using it, "
        "as every record's zip checksum matches and it loads as step 2; a run that resumes from it "
        "writes the sidecar again"
    ]
    assert ckpt.resolve_resume(str(path), tmp_path, warn=warnings.append) == path
    with pytest.warns(UserWarning, match="lost its sidecar"):
        assert torch.equal(load_state_w(path), state(2)["model"]["w"])
    assert ckpt.checkpoint_meta(path) == sidecar  # what the sidecar said, from the file alone
    # Every rank checks rank 0's choice: its size, and (the first rank of each node) its bytes.
    from gpt2.ckpt import resume

    point = resume._point(path)
    assert not point.sidecar and (point.sha256, point.bytes, point.run_id) == (sidecar["sha256"], len(data), "r")
    assert resume.check_visible(point, rehash=True) is None
    path.write_bytes(flip(data, 10))
    assert resume.check_visible(point, rehash=False) is None  # the same size: only a rehash sees it
    assert "sees a different step_00000002.pt" in resume.check_visible(point, rehash=True)
    path.write_bytes(data)
    # Damaged as well: refused by name, skipped by auto for the one before it.
    for damage, why in (
        (data[: len(data) // 2], "not a complete zip archive"),
        (flip(data, len(data) // 2), "fails its zip checksum"),
    ):
        path.write_bytes(damage)
        warnings = []
        assert ckpt.resolve_resume("auto", tmp_path, warn=warnings.append).name == "step_00000001.pt"
        assert why in warnings[0] and "lost its sidecar" in warnings[1]
        with pytest.raises(ckpt.CheckpointError, match=why):
            ckpt.resolve_resume(str(path), tmp_path)
    # Renamed to another step's name: not the checkpoint it claims to be.
    path.write_bytes(data)
    os.rename(path, path.with_name("step_00000007.pt"))
    with pytest.raises(ckpt.CheckpointError, match="holds step 2, not the step its name says"):
        ckpt.resolve_resume(str(path.with_name("step_00000007.pt")), tmp_path)


def load_state_w(path):
    return ckpt.load_checkpoint(path)["model"]["w"]


def flip(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0xFF
    return bytes(out)


def test_auto_refuses_to_start_over_checkpoints_it_cannot_verify(tmp_path):
    """Every checkpoint of the run damaged: auto warned about each, then started fresh (the run moved
    aside, training from step 0, exit 0). Now a one-line refusal that says how to go on."""
    for path in [ckpt.save_checkpoint(tmp_path, step, state(step), keep=3, run_id="r") for step in (1, 2)]:
        path.write_bytes(path.read_bytes()[:100])
    (tmp_path / "config.json").write_text(json.dumps({"run_id": "r"}))
    warnings = []
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.resolve_resume("auto", tmp_path, warn=warnings.append)
    assert len(warnings) == 2 and all("truncated" in w for w in warnings)
    assert str(err.value) == (
        f"--resume auto: none of this run's 2 checkpoint(s) in {tmp_path / 'checkpoints'} "
        "verifies (step_00000002.pt, step_00000001.pt; the warnings above say why), so the run "
        "would start over: restore them (with their .json sidecars), pass --resume PATH of "
        "another checkpoint, or --resume never to start fresh (this run's files move into a "
        "previous-* folder)"
    )
    # Another run's checkpoints do not hold a fresh start back (they are ignored, with a warning).
    (tmp_path / "config.json").write_text(json.dumps({"run_id": "other"}))
    assert ckpt.resolve_resume("auto", tmp_path, warn=warnings.append) is None


def test_auto_says_which_steps_a_vanished_checkpoint_loses_and_refuses_when_all_are_gone(tmp_path):
    """A checkpoint deleted with its sidecar and `latest` left (a scratch purge between a preemption and
    its requeue): auto resumed from the older one without a word, and with every .pt gone started from
    step 0. Now a warning naming the steps lost, and the truncated-files refusal when nothing is left."""
    paths = [ckpt.save_checkpoint(tmp_path, step, state(step), keep=5, run_id="r") for step in (1, 2, 3)]
    (tmp_path / "config.json").write_text(json.dumps({"run_id": "r"}))
    paths[2].unlink()
    warnings = []
    assert ckpt.resolve_resume("auto", tmp_path, warn=warnings.append) == paths[1]
    assert warnings == [
        f"step_00000003.pt of this run is gone from {tmp_path / 'checkpoints'} (named by its sidecar): resuming "
        "from step 2, so step 3 is lost and trained again; restore step_00000003.pt and rerun to keep them"
    ]
    paths[2].with_suffix(".json").unlink()  # `latest` alone still names it
    warnings.clear()
    assert ckpt.resolve_resume("auto", tmp_path, warn=warnings.append) == paths[1]
    assert len(warnings) == 1 and "(named by latest)" in warnings[0] and "step 3 is lost" in warnings[0]
    paths[0].unlink()
    paths[1].unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"this run's checkpoint\(s\) step_00000003.pt, step_00000002.pt"):
        ckpt.resolve_resume("auto", tmp_path, warn=warnings.append)
    # Another run's leftovers hold nothing back.
    (tmp_path / "config.json").write_text(json.dumps({"run_id": "other"}))
    (tmp_path / "checkpoints" / "latest").unlink()
    assert ckpt.resolve_resume("auto", tmp_path, warn=warnings.append) is None


def test_resuming_a_data_manifest_says_it_is_not_a_checkpoint(tmp_path, shakespeare_shards):
    """`--resume DATA/manifest.json` read the manifest as its own sidecar: "2181 bytes but None were
    written; truncated"."""
    manifest = shakespeare_shards / "manifest.json"
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.resolve_resume(str(manifest), tmp_path)
    assert str(err.value) == (
        f"{manifest}: data_prep's manifest of the token shards in {shakespeare_shards}, not a "
        "checkpoint: pass that directory as --data-dir; pass a step_*.pt file or step_*/ "
        "directory, or a run directory"
    )
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(ckpt.CheckpointError, match="notes.txt: not a checkpoint"):
        ckpt.resolve_resume(str(other), tmp_path)


def test_named_paths(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="no such checkpoint file"):
        ckpt.resolve_resume(str(tmp_path / "nope.pt"), tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="no valid checkpoint in that directory"):
        ckpt.resolve_resume(str(tmp_path), tmp_path)
    path = ckpt.save_checkpoint(tmp_path, 4, state(4), keep=3)
    assert ckpt.resolve_resume(str(tmp_path), tmp_path / "other") == path  # a run directory
    assert ckpt.resolve_resume(str(tmp_path / "checkpoints"), tmp_path / "other") == path
    torch.save({"model": {}}, tmp_path / "foreign.pt")
    with pytest.raises(ckpt.CheckpointError, match="not a checkpoint of this program"):
        ckpt.load_checkpoint(tmp_path / "foreign.pt", verify=False)


KILLED_WRITER = """
import os, signal, sys, torch
from gpt2.ckpt import checkpoint as ckpt
out = sys.argv[1]
ckpt.save_checkpoint(out, 1, {"model": {"w": torch.ones(300_000)}}, keep=3)
write = ckpt._HashingWriter.write
def dying_write(self, data):
    n = write(self, data)
    if self.size > 400_000:  # well inside the second checkpoint's 1.2 MB of tensor data
        self.f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return n
ckpt._HashingWriter.write = dying_write
ckpt.save_checkpoint(out, 2, {"model": {"w": torch.zeros(300_000)}}, keep=3)
"""


def test_process_killed_inside_torch_save_leaves_the_previous_checkpoint_selected(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KILLED_WRITER), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ckdir = tmp_path / "checkpoints"
    tmps = list(ckdir.glob("step_00000002.pt.*.tmp"))
    assert len(tmps) == 1 and tmps[0].stat().st_size > 400_000  # a real half-written file
    assert not (ckdir / "step_00000002.pt").exists()
    assert (ckdir / "latest").read_text().strip() == "step_00000001.pt"
    found = ckpt.resolve_resume("auto", tmp_path, warn=pytest.fail)
    assert found.name == "step_00000001.pt"
    assert torch.equal(ckpt.load_checkpoint(found)["model"]["w"], torch.ones(300_000))
    # The next save (the resumed run's) removes the debris.
    ckpt.save_checkpoint(tmp_path, 2, state(2), keep=3)
    assert not list(ckdir.glob("*.tmp"))


def run_config(**changes) -> RunConfig:
    model = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64}
    model.update({k: changes.pop(k) for k in list(changes) if k in ModelConfig.__dataclass_fields__})
    return RunConfig(ModelConfig(**model), TrainConfig.of(data_dir="d", out_dir="o", **changes))


def test_incompatible_model_shape_or_tokenizer_is_refused():
    saved = {"config": run_config().to_dict(), "tokenizer": "gpt2"}
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"model shape differs.*n_layer: checkpoint 2 vs now 3.*"
        r"n_embd: checkpoint 64 vs now 128",
    ):
        check_compatible(saved, run_config(n_layer=3, n_embd=128), Log())
    with pytest.raises(ckpt.CheckpointError, match="block_size"):
        check_compatible(saved, run_config(block_size=128), Log())
    with pytest.raises(ckpt.CheckpointError, match="tokenizer 'cl100k' is not gpt2"):
        check_compatible({**saved, "tokenizer": "cl100k"}, run_config(), Log())


def test_changed_learning_rate_and_max_steps_are_allowed_and_logged():
    saved = {"config": run_config().to_dict(), "tokenizer": "gpt2"}
    log = Log()
    check_compatible(saved, run_config(lr=1e-4, max_steps=50, resume="never", dropout=0.1), log)
    assert "resume: lr changed from 0.0006 to 0.0001" in log.lines
    assert "resume: max_steps changed from 19073 to 50" in log.lines
    assert not any("resume " in line or "dropout" in line for line in log.lines)  # not a shape field
    assert len(log.lines) == 2


def test_resume_through_main_refuses_another_shape_and_logs_a_new_lr(tmp_path, shakespeare_shards, capsys):
    """train_ddp.main in this process (one rank, no process group): exit codes and messages users see."""
    train_ddp = import_train_ddp()
    base = [
        *tiny_run_flags(shakespeare_shards, max_steps=2, ckpt_interval=1, eval_tokens=256),
        "--out-dir",
        str(tmp_path),
    ]
    assert train_ddp.main(base) == 0
    capsys.readouterr()
    assert train_ddp.main([*base, "--n-layer", "3"]) == 2
    err = capsys.readouterr().err
    assert (
        "train_ddp.py: error: the checkpoint's model shape differs from this run's: n_layer: checkpoint 2 vs "
        "now 3. Use the same shape flags, or start fresh with --resume never" in err
    )
    assert train_ddp.main([*base, "--seed", "7"]) == 2
    assert "the checkpoint's data order used seed 1337, this run has --seed 7" in capsys.readouterr().err
    assert train_ddp.main([*base, "--max-steps", "3", "--lr", "1e-3"]) == 0
    out = capsys.readouterr().out
    assert "resume: max_steps changed from 2 to 3" in out and "resume: lr changed from 0.003 to 0.001" in out
    assert "resumed from" in out and "at step 2" in out
    ckdir = tmp_path / "checkpoints"
    data = bytearray((ckdir / "step_00000003.pt").read_bytes())
    data[-100] ^= 1
    (ckdir / "step_00000003.pt").write_bytes(bytes(data))
    assert train_ddp.main([*base, "--max-steps", "3", "--resume", str(ckdir / "step_00000003.pt")]) == 2
    assert "sha256 does not match its sidecar; the file is corrupt" in capsys.readouterr().err


def test_rng_states_survive_a_weights_only_checkpoint(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1), np.random.randn()  # move off the seeds
    ckpt.save_checkpoint(tmp_path, 1, {"rng": [rng_state()]}, keep=1)
    want = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    set_rng_state(ckpt.load_checkpoint(ckpt.resolve_resume("auto", tmp_path))["rng"][0])
    got = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3))
    assert got[:3] == want[:3] and torch.equal(got[3], want[3])


def test_stop_request_records_repeated_signals_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert stop.signum is None and stop.name is None
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal, e.g. during the save: only the flag moves
        assert stop.name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_requeue_marker_and_exit_code_contract(tmp_path):
    path = preempt.write_requeue_marker(tmp_path, {"step": 5, "signal": "SIGUSR1", "checkpoint": "step_00000005.pt"})
    assert path == tmp_path / "requeue"
    assert json.loads(path.read_text())["step"] == 5
    preempt.clear_requeue_marker(tmp_path)
    preempt.clear_requeue_marker(tmp_path)  # idempotent
    assert not path.exists()
    assert preempt.stop_exit_code({}) == preempt.EXIT_REQUEUE == 3
    assert preempt.stop_exit_code({"TORCHELASTIC_RUN_ID": "x"}) == 0


LAUNCHER_DIES = """
import os, signal, subprocess, sys, time
from gpt2.distributed import preempt
# A worker whose launcher (the middle process) dies: first after the prctl, then before it.
if sys.argv[1] == "launcher":
    worker = subprocess.Popen([sys.executable, __file__, "worker", sys.argv[2]])
    while not os.path.exists(sys.argv[2] + ".armed"):
        time.sleep(0.01)
    os._exit(0)  # dies without waiting: the worker is orphaned
got, end = [], time.monotonic() + 150  # an orphan that is never signalled still ends
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
env = {"TORCHELASTIC_RUN_ID": "test"}
assert not preempt.stop_with_launcher(os.getppid(), {})  # not under torchrun: nothing armed
assert preempt.stop_with_launcher(os.getppid(), env)
open(sys.argv[2] + ".armed", "w").close()
while not got and time.monotonic() < end:  # the kernel's SIGTERM at the launcher's exit
    time.sleep(0.01)
preempt.stop_with_launcher(os.getpid(), env)  # "started by" a process that is not the parent now: gone
while len(got) < 2 and time.monotonic() < end:
    time.sleep(0.01)
if len(got) == 2:
    open(sys.argv[2] + ".stopped", "w").close()
"""


def test_a_worker_is_signalled_when_its_launcher_dies_even_before_it_asked(tmp_path):
    """preempt.stop_with_launcher (issue 32: workers orphaned by a killed torchrun): SIGTERM when the
    launcher exits after the worker armed it, and at once when it had already gone before."""
    script = tmp_path / "launcher_dies.py"
    script.write_text(LAUNCHER_DIES)
    mark = str(tmp_path / "worker")
    subprocess.run(
        [sys.executable, str(script), "launcher", mark],
        cwd=REPO,
        check=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    deadline = time.monotonic() + 120  # a safety net on a loaded machine: the worker takes milliseconds
    while not os.path.exists(mark + ".stopped"):
        assert time.monotonic() < deadline, "the orphaned worker got no SIGTERM"
        time.sleep(0.02)


def test_load_model_from_a_run_directory(tmp_path):
    from gpt2.model.gpt import GPT

    cfg = run_config()
    model = GPT(cfg.model)
    ckpt.save_checkpoint(tmp_path, 3, {"model": model.state_dict(), "config": cfg.to_dict()}, keep=1)
    loaded, saved = load_model(tmp_path)
    assert saved["step"] == 3 and not loaded.training
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def counting(monkeypatch, module, name: str) -> list:
    """Replace module.name with a wrapper that records each call's first argument."""
    calls, real = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_load_any_and_load_model_hash_the_checkpoint_once(tmp_path, monkeypatch):
    """A run directory, its checkpoints/ directory or a step_*.pt file: one sha256 pass over the file each."""
    from gpt2.ckpt.load import load_any
    from gpt2.model.gpt import GPT

    cfg = run_config()
    path = ckpt.save_checkpoint(
        tmp_path, 3, {"model": GPT(cfg.model).state_dict(), "config": cfg.to_dict(), "tokenizer": "gpt2"}, keep=1
    )
    for target in (tmp_path, tmp_path / "checkpoints", path):
        hashed = counting(monkeypatch, ckpt, "file_sha256")
        model, info = load_any(target)
        assert hashed == [path] and info["step"] == 3, (target, hashed)
        hashed = counting(monkeypatch, ckpt, "file_sha256")
        load_model(target)
        assert hashed == [path], (target, hashed)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))  # the one pass still catches a damaged file
    with pytest.raises(ckpt.CheckpointError, match="sha256 does not match"):
        load_any(path)


def test_one_sidecar_reader(tmp_path, monkeypatch):
    """Every reader of a sidecar (retention, verification, the resume decision) goes through read_sidecar."""
    from gpt2.ckpt import resume

    path = ckpt.save_checkpoint(tmp_path, 2, state(2), keep=1, run_id="run-a")
    readers = {
        "looks_complete": lambda: ckpt.looks_complete(path),
        "verify_checkpoint": lambda: ckpt.verify_checkpoint(path),
        "belongs": lambda: ckpt.belongs(path, "run-a"),
        "stray_warning": lambda: ckpt.stray_warning(path, "run-b"),
        "resume._point": lambda: resume._point(path),
        "resume.check_visible": lambda: resume.check_visible(resume._point(path), rehash=False),
    }
    for name, read in readers.items():
        calls = counting(monkeypatch, ckpt, "read_sidecar")
        read()
        assert calls and set(calls) == {path}, name
    assert ckpt.read_sidecar(path)["run_id"] == "run-a" and resume._point(path).run_id == "run-a"
    path.with_suffix(".json").write_text("[1, 2]")  # valid JSON, not a sidecar
    with pytest.raises(ValueError, match="no JSON object"):
        ckpt.read_sidecar(path)
    assert ckpt.sidecar(path) is None and not ckpt.looks_complete(path)
    assert "ValueError" in resume.check_visible(resume.ResumePoint(str(path), 2, "x", 1), rehash=False)
    with pytest.raises(ckpt.CheckpointError, match="missing or unreadable; the write did not finish"):
        ckpt.verify_checkpoint(path)
    sources = {p.name: p.read_text() for p in (REPO / "gpt2").glob("*.py") if p.name != "checkpoint.py"}
    assert [n for n, text in sources.items() if 'with_suffix(".json")' in text] == []


# ------------------------------------------------------------------ one line where a traceback was (issue 32, item 8)


def main_err(args, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = import_train_ddp().main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("async_ckpt", ["false", "true"])
def test_a_full_disk_at_a_checkpoint_is_one_line_naming_the_directory(
    tmp_path, shakespeare_shards, monkeypatch, capsys, async_ckpt
):
    """false: the final synchronous save (was: the RuntimeError's traceback, ENOSPC only in its context);
    true: step 2's background write, reported at a later step (was: "RuntimeError: ... unexpected pos")."""
    monkeypatch.setattr(ckpt._HashingWriter, "write", no_space_after(4096))
    args = [
        *tiny_run_flags(
            shakespeare_shards, max_steps=2 if async_ckpt == "false" else 4, ckpt_interval=2, eval_tokens=256
        ),
        "--out-dir",
        str(tmp_path),
        "--async-ckpt",
        async_ckpt,
    ]
    code, err = main_err(args, capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    background = " in the background" if async_ckpt == "true" else ""
    assert lines[0].startswith(
        f"train_ddp.py: error: writing the checkpoint of step 2{background} failed (No space "
        f"left on device in {tmp_path / 'checkpoints'} ("
    ), lines[0]
    assert "unexpected pos" not in err and "The newest complete checkpoint is the one before it" in err


def test_a_failed_background_write_is_reported_at_the_next_step_not_the_next_save(
    tmp_path, shakespeare_shards, monkeypatch, capsys
):
    """Issue 41: a background write that failed (disk full) was reported at the next save, 20 steps of
    compute later. The step after the failure stops the run with it. The test holds the trainer after
    step 4's save until the writer's thread has failed (a slow machine may not have by then), so step 5
    is that next step."""
    from gpt2.train import trainer

    monkeypatch.setattr(ckpt._HashingWriter, "write", no_space_after(4096))
    real_save = trainer.save

    def save_then_wait_for_the_failure(parts, *args, **kwargs):
        real_save(parts, *args, **kwargs)
        if parts.step == 4:
            while not parts.writer.failed:  # the event the trainer looks for, without a deadline
                time.sleep(0.01)

    monkeypatch.setattr(trainer, "save", save_then_wait_for_the_failure)
    args = [
        *tiny_run_flags(shakespeare_shards, max_steps=12, ckpt_interval=4, eval_tokens=256),
        "--out-dir",
        str(tmp_path),
        "--async-ckpt",
        "true",
    ]
    code, err = main_err(args, capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("train_ddp.py: error: writing the checkpoint of step 4 in the background failed (No space")
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in line
    ]
    assert steps == [1, 2, 3, 4, 5]  # stopped at step 5, not at step 8's save
    assert not (tmp_path / "requeue").exists() and not (tmp_path / "run.lock").exists()


def test_resuming_the_sidecar_says_so_and_names_the_checkpoint(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 3, state(3), keep=2)
    named = path.with_suffix(".json")
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.resolve_resume(str(named), tmp_path)
    assert str(err.value) == (
        f"{named}: this is a checkpoint's sidecar (its size, sha256 and run id), not the checkpoint; pass {path}"
    )  # was: "... bytes but ... were written; truncated"
    with pytest.raises(ckpt.CheckpointError, match="sidecar"):
        load_model(path.with_suffix(".json"))


def test_an_out_dir_that_cannot_be_made_is_one_line_before_start(tmp_path, shakespeare_shards, capsys):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "run"  # mkdir raised NotADirectoryError from the trainer, with a traceback
    code, err = main_err(
        [*tiny_run_flags(shakespeare_shards, max_steps=1, ckpt_interval=1), "--out-dir", str(out)], capsys
    )
    assert code == 2
    assert (
        err == f"train_ddp.py: error: --out-dir {out}: {tmp_path / 'file'} is a file, not a directory; pass a "
        "directory\n"
    )


@pytest.fixture
def tmpfs(tmp_path):
    """A real small file system, mounted here: mount(size, ro) -> its directory. Needs root and `mount`
    (skipped otherwise: a real-resource test; the simulated ENOSPC tests above run everywhere)."""
    mounted = []

    def mount(size: str, ro: bool = False) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        opts = f"size={size}" + (",ro" if ro else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=True)


def test_a_real_full_disk_and_a_read_only_out_dir_are_one_line(tmp_path, shakespeare_shards, tmpfs):
    # A disk too small for one checkpoint (~40 MB) is refused before the first step (78 item 5's start-up check).
    small = tmpfs("4m")
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "train_ddp.py"),
            *tiny_run_flags(shakespeare_shards, max_steps=2, ckpt_interval=2, eval_tokens=256),
            "--out-dir",
            str(small / "run"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.startswith(f"train_ddp.py: error: --out-dir {small / 'run'}: ") and run.stderr.count("\n") == 1
    assert "free on its disk, and a checkpoint of this model and optimizer is ~" in run.stderr
    # A disk with room at the start that fills up under the run (another job's files): the save's real ENOSPC
    # is one line naming the directory. The run holds after step 1 while the test fills the disk.
    full, release = tmpfs("64m"), tmp_path / "release"
    job = launch(
        [
            *tiny_run_flags(shakespeare_shards, max_steps=2, ckpt_interval=2, eval_tokens=256),
            "--out-dir",
            str(full / "run"),
            "--async-ckpt",
            "false",
        ],
        nproc=1,
        log_dir=tmp_path / "logs",
        script=patched_train_script(tmp_path, hold_after_step(1, release)),
    )
    try:
        wait_for_step(job, full / "run", 1)
        with open(full / "filler", "wb") as filler:  # leaves ~1 MB: metrics lines fit, a checkpoint does not
            filler.write(b"\0" * (shutil.disk_usage(full).free - (1 << 20)))
        release.touch()
        assert job.wait() == 1
    finally:
        job.kill()
    errors = [line for line in job.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, job.stderr[-3000:]
    assert errors[0].startswith(
        f"train_ddp.py: error: writing the checkpoint of step 2 failed (No space left on "
        f"device in {full / 'run' / 'checkpoints'} ("
    ), errors[0]
    read_only = tmpfs("1m", ro=True)
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "train_ddp.py"),
            *tiny_run_flags(shakespeare_shards, max_steps=1, ckpt_interval=1),
            "--out-dir",
            str(read_only / "run"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2
    assert run.stderr == (
        f"train_ddp.py: error: --out-dir {read_only / 'run'}: cannot write in {read_only} (a "
        "read-only file system); pass a writable --out-dir\n"
    )


def test_a_run_directory_made_read_only_mid_run_is_one_line(tmp_path, shakespeare_shards, tmpfs):
    """Issue 41: RUN turned read-only under a running trainer ended in two chained tracebacks (the
    metrics write's EROFS, then the lock's removal). Now one line naming the file, the fix, and that
    run.lock stays (nothing can remove it from a read-only directory) for the next start to take over."""
    fs = tmpfs("200m")
    run_dir, release = fs / "run", tmp_path / "release"
    args = [
        *tiny_run_flags(shakespeare_shards, max_steps=4, ckpt_interval=2, eval_tokens=256),
        "--out-dir",
        str(run_dir),
        "--async-ckpt",
        "false",
    ]
    job = launch(
        args, nproc=1, log_dir=tmp_path / "logs", script=patched_train_script(tmp_path, hold_after_step(3, release))
    )
    try:
        # Step 3 logged: step 2's checkpoint is complete and no file is open for writing (the remount
        # would fail), and step 3 owes nothing else before the hold.
        wait_for_step(job, run_dir, 3)
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        release.touch()
        assert job.wait() == 1
    finally:
        job.kill()
    assert job.stderr == (
        f"train_ddp.py: error: rank 0: {run_dir / 'metrics.jsonl'}: Read-only file system; make "
        f"--out-dir {run_dir} writable (or free space) and rerun with --resume auto: it continues "
        f"from the newest checkpoint; {run_dir / 'run.lock'} could not be removed: the next start "
        "takes it over\n"
    )
    # It cannot be removed from a read-only directory; its holder has exited, which the next start
    # sees (test_resume.py: a holder killed with SIGKILL is taken over).
    assert json.loads((run_dir / "run.lock").read_text())["pid"] == job.proc.pid
