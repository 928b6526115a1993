"""The training config in sections (issue 55 part 4): each section validates itself, parts take their own,
the flags and presets are unchanged, and what git d1ce9c0 wrote flat (a run's config.json, --config files;
tests/data/config_v1) still loads. Old checkpoints: tests/test_state.py resumes two kept ones."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from gpt2.core.config import (
    SECTION_OF,
    TRAIN_PRESETS,
    TRAIN_SECTIONS,
    OptimConfig,
    RunConfig,
    ScheduleConfig,
    SpikeConfig,
    TrainConfig,
    train_values,
)
from gpt2.core.precision import FLOAT32
from gpt2.train.cli import parse_config

KEPT = Path(__file__).resolve().parent / "data" / "config_v1"
"""Written by git d1ce9c0, the last version with the flat TrainConfig: a tiny run's config.json, two --config
files (flat keys; [model] and [train] tables) and, beside each, the RunConfig.to_dict() it parsed to there."""
REQUIRED = ["--data-dir", "D", "--out-dir", "O"]
ADDED_SINCE = {
    "data_weights": "",
    "data_weight_schedule": "",
    "embed_lr": None,
    "head_lr": None,
    "muon_ortho": "newton_schulz",
    "muon_momentum_warmup": 0,
    "muon_momentum_start": 0.85,
    "cautious_wd": False,
    "batch_warmup_steps": 0,
    "batch_warmup_stages": 3,
}
"""Fields added after d1ce9c0 (issue 74's mixtures), with the defaults that keep what an older file meant: one
source, no weights."""


def test_every_training_field_is_in_exactly_one_section_and_the_flags_are_unchanged():
    fields = [f.name for cls in TRAIN_SECTIONS.values() for f in dataclasses.fields(cls)]
    assert len(fields) == len(set(fields)) == len(SECTION_OF) == 64 + len(ADDED_SINCE)
    old_flat = json.loads((KEPT / "flat.expected.json").read_text())["train"]
    # the 64 names d1ce9c0 had, every flag and preset key still meaning it, the mixture's two since, and the
    # embeddings' and head's learning rates, Muon's orthogonalisation and momentum warmup
    assert set(fields) == set(old_flat) | set(ADDED_SINCE)
    assert [SECTION_OF[name] for name in ADDED_SINCE] == ["data", "data", *["optim"] * 6, "batch", "batch"]
    for preset in TRAIN_PRESETS.values():
        assert set(preset) <= set(SECTION_OF)


def test_a_config_json_written_before_the_sections_loads_and_a_resume_keeps_its_auto_choices(tmp_path):
    from gpt2.ckpt.resume import KEPT_ON_RESUME, decided_before

    info = json.loads((KEPT / "config.json").read_text())
    old_train = info["config"]["train"]
    cfg = RunConfig.from_dict(info["config"])
    assert cfg.train.flat() == old_train | ADDED_SINCE  # every value where it was, read from its section
    assert (cfg.train.batch.micro_batch_size, cfg.train.compute.loss_impl, cfg.train.ckpt.out_dir) == (
        2,
        "chunked",
        "RUN",
    )
    assert RunConfig.from_dict(cfg.to_dict()) == cfg  # today's sectioned form reads back the same
    assert set(cfg.to_dict()["train"]) == set(TRAIN_SECTIONS)
    (tmp_path / "config.json").write_text(json.dumps(info))
    kept = decided_before(tmp_path / "config.json", info["run_id"], info["world_size"])
    assert kept == {k: old_train[k] for k in KEPT_ON_RESUME}  # a resume of that run decides as it did


@pytest.mark.parametrize("name", ["flat", "sectioned"])
def test_config_files_written_for_the_flat_config_parse_as_they_did(name):
    expected = json.loads((KEPT / f"{name}.expected.json").read_text())
    cfg = parse_config(["--config", str(KEPT / f"{name}.toml"), *REQUIRED])
    assert cfg == RunConfig.from_dict(expected)
    assert cfg.train.flat() == expected["train"] | ADDED_SINCE


def test_a_config_file_may_use_the_sections_as_tables(tmp_path, capsys):
    """[optim] and [schedule], as --help names its headings, or [train.optim]; a key in another section's
    table is refused with its table named (a typo there must not be silently read as another field)."""
    new = tmp_path / "new.toml"
    new.write_text(
        '[schedule]\nlr = 3e-3\nmax_steps = 7\n\n[train.optim]\noptimizer = "muon"\n\n[spike]\nspike_window = 9\n'
    )
    tc = parse_config(["--config", str(new), *REQUIRED]).train
    assert (tc.schedule.lr, tc.schedule.max_steps, tc.optim.optimizer, tc.spike.spike_window) == (3e-3, 7, "muon", 9)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text("[optim]\nmax_steps = 7\n")
    with pytest.raises(SystemExit):
        parse_config(["--config", str(wrong), *REQUIRED])
    assert "unknown keys ['optim.max_steps']" in capsys.readouterr().err


def test_the_docs_read_each_field_from_its_own_section():
    """The docs cited `cfg.train.optim.lr`, but lr lives in the schedule section: every `cfg.train.SECTION.FIELD`
    in docs/ and the README names a field of that section."""
    import re

    repo = KEPT.parents[2]
    cited = [
        (page.name, section, name)
        for page in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
        for section, name in re.findall(r"cfg\.train\.(\w+)\.(\w+)", page.read_text())
    ]
    assert cited, "the docs cite no field: the check checks nothing"
    wrong = [c for c in cited if c[1] not in TRAIN_SECTIONS or SECTION_OF.get(c[2]) != c[1]]
    assert wrong == [], wrong


def test_a_runs_config_json_repeats_that_run_with_a_new_out_dir_and_the_docs_say_so(tmp_path, capsys):
    """Issue 77: `--config RUN/config.json` was refused as not valid TOML, where a new user tried it to repeat a run.
    The record (this version's sections, or d1ce9c0's flat layout) now reads as a config file, all but its
    out_dir: the new run's is required, and a flag beside it wins."""
    cfg = parse_config(["--preset", "speedrun", "--lr", "2e-3", "--micro-batch-size", "4", *REQUIRED])
    record = tmp_path / "run" / "config.json"
    record.parent.mkdir()
    record.write_text(json.dumps({"run_id": "r", "config": cfg.to_dict(), "world_size": 1}))
    again = parse_config(["--config", str(record), "--out-dir", "NEW"])
    assert again == RunConfig(cfg.model, cfg.train.replace(out_dir="NEW"))
    assert again.model.doc_attention and again.train.schedule.lr == 2e-3  # the preset's and the flag's values
    assert parse_config(["--config", str(record), "--out-dir", "NEW", "--lr", "1e-3"]).train.schedule.lr == 1e-3
    old = json.loads((KEPT / "config.json").read_text())["config"]  # flat, as d1ce9c0 wrote it
    kept = parse_config(["--config", str(KEPT / "config.json"), "--out-dir", "NEW"])
    assert kept == RunConfig(RunConfig.from_dict(old).model, RunConfig.from_dict(old).train.replace(out_dir="NEW"))
    with pytest.raises(SystemExit):
        parse_config(["--config", str(record)])
    err = capsys.readouterr().err
    assert f"--out-dir is required with --config {record}" in err and f"--out-dir {record.parent} --resume auto" in err
    (tmp_path / "other.json").write_text('{"metrics": []}')
    with pytest.raises(SystemExit):
        parse_config(["--config", str(tmp_path / "other.json"), "--out-dir", "NEW"])
    assert "not a run's config.json" in capsys.readouterr().err
    page = " ".join((KEPT.parents[2] / "docs" / "training.md").read_text().split())
    assert "`--config RUN/config.json --out-dir NEW` reads the record every run writes" in page


def test_each_section_validates_itself_and_the_config_reports_every_problem_at_once():
    with pytest.raises(ValueError, match=r"beta1=1.5, beta2=0.95 must be in \[0, 1\)"):
        OptimConfig(beta1=1.5)
    with pytest.raises(ValueError, match="min_lr=0.1 must be between 0 and lr=0.01"):
        ScheduleConfig(lr=0.01, min_lr=0.1)
    with pytest.raises(ValueError) as err:
        TrainConfig.of(beta1=1.5, max_steps=0, spike_window=2, parallel="pp")
    lines = str(err.value).splitlines()
    assert lines[0] == "invalid training config:" and len(lines) == 5  # four sections' problems, one line each
    with pytest.raises(ValueError, match="fp8_head=True with parallel=fsdp"):  # two sections: TrainConfig's check
        TrainConfig.of(fp8_head=True, parallel="fsdp")
    with pytest.raises(TypeError, match="unknown training fields"):
        TrainConfig.of(learning_rate=1e-3)


def test_replace_and_flat_speak_the_flags_vocabulary():
    tc = TrainConfig.of(lr=1e-3, parallel="fsdp")
    changed = tc.replace(micro_batch_size=4, lr=2e-3)
    assert (changed.batch.micro_batch_size, changed.schedule.lr, changed.distributed.parallel) == (4, 2e-3, "fsdp")
    assert tc.schedule.lr == 1e-3  # frozen: a new config
    assert list(tc.flat()) == [f.name for cls in TRAIN_SECTIONS.values() for f in dataclasses.fields(cls)]
    assert train_values(tc.to_dict()) == tc.flat() == train_values(tc.flat())


def test_replace_replaces_only_the_sections_it_changes_and_still_checks_across_them():
    """Issue 77: a change of one field replaces its section, not the whole config through the flat fields; the
    result is the config the flat rebuild gave, every problem is still reported at once, and across sections."""
    tc = TrainConfig.of(lr=1e-3, parallel="fsdp")
    changed = tc.replace(micro_batch_size=4, lr=2e-3)
    assert changed == TrainConfig.of(**{**tc.flat(), "micro_batch_size": 4, "lr": 2e-3})
    untouched = [s for s in TRAIN_SECTIONS if s not in ("batch", "schedule")]
    assert all(getattr(changed, s) is getattr(tc, s) for s in untouched)
    with pytest.raises(ValueError) as err:
        tc.replace(beta1=1.5, max_steps=0)
    assert str(err.value).splitlines()[0] == "invalid training config:" and len(str(err.value).splitlines()) == 3
    with pytest.raises(ValueError, match="fp8_head=True with parallel=fsdp"):  # TrainConfig's own check
        tc.replace(fp8_head=True)
    with pytest.raises(TypeError, match=r"unknown training fields \['learning_rate'\]"):
        tc.replace(learning_rate=1e-3)


def test_parts_take_their_section():
    """The spike guard and the optimizer are made from their sections alone (issue 55's examples)."""
    import inspect

    import torch

    from gpt2.model.gpt import GPT
    from gpt2.train.optim import make_optimizer
    from gpt2.train.spike_guard import SpikeGuard

    guard = SpikeGuard(SpikeConfig(spike_window=16, spike_loss_z=5.0), torch.device("cpu"))
    assert (guard.window, guard.loss_z) == (16, 5.0)
    assert inspect.signature(make_optimizer).parameters["optim"].annotation in ("OptimConfig", OptimConfig)
    from gpt2.core.config import ModelConfig

    model = GPT(ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=8))
    opt = make_optimizer(model, OptimConfig(beta1=0.8), torch.device("cpu"), peak_lr=1e-3, prec=FLOAT32)
    assert opt.param_groups[0]["betas"] == (0.8, 0.95) and opt.param_groups[0]["lr"] == 1e-3
