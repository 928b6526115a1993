import dataclasses
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from gpt2.core.config import MODEL_PRESETS, TRAIN_ONLY_PRESETS, TRAIN_PRESETS, TRAIN_SECTIONS, ModelConfig, TrainConfig
from gpt2.train.cli import HELP_WIDTH, PRESETS, build_parser, parse_config, shown_default

BASE = ["--data-dir", "d", "--out-dir", "o"]


def test_defaults_are_the_fast_settings():
    cfg = parse_config(BASE)
    assert cfg.train.compute.dtype == "auto" and cfg.train.compute.compile is True  # auto: what the device runs fast
    assert cfg.model.vocab_size == 50304 and cfg.model.attn_impl == "sdpa"
    assert cfg.train.batch.total_batch_size == 524_288


def test_micro_batch_size_auto_from_flag_and_file(tmp_path):
    assert parse_config(BASE + ["--micro-batch-size", "auto"]).train.batch.micro_batch_size == "auto"
    assert parse_config(BASE + ["--micro-batch-size", "12"]).train.batch.micro_batch_size == 12
    toml = tmp_path / "c.toml"
    toml.write_text('micro_batch_size = "auto"\n')
    assert parse_config(BASE + ["--config", str(toml)]).train.batch.micro_batch_size == "auto"
    toml.write_text('micro_batch_size = "many"\n')
    with pytest.raises(SystemExit):
        parse_config(BASE + ["--config", str(toml)])


def test_precedence_defaults_preset_file_flags(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("lr = 2e-3\nmax_steps = 77\n[model]\nn_layer = 3\n")
    cfg = parse_config(BASE + ["--preset", "debug"])
    assert cfg.model.n_layer == 4 and cfg.train.schedule.lr == TRAIN_PRESETS["debug"]["lr"]  # preset over defaults
    assert cfg.train.optim.weight_decay == TrainConfig().optim.weight_decay  # default where the preset is silent
    cfg = parse_config(BASE + ["--preset", "debug", "--config", str(toml)])
    assert (
        cfg.model.n_layer == 3 and cfg.train.schedule.lr == 2e-3 and cfg.train.schedule.max_steps == 77
    )  # file over preset
    assert cfg.model.n_embd == 128  # still the preset's
    cfg = parse_config(BASE + ["--preset", "debug", "--config", str(toml), "--lr", "5e-4", "--n-layer", "2"])
    assert (
        cfg.train.schedule.lr == 5e-4 and cfg.model.n_layer == 2 and cfg.train.schedule.max_steps == 77
    )  # flags over file


def test_every_field_is_a_kebab_case_flag():
    import dataclasses

    from gpt2.core.config import ModelConfig
    from gpt2.train.cli import build_parser

    flags = {a for action in build_parser()._actions for a in action.option_strings}
    for cls in (ModelConfig, *TRAIN_SECTIONS.values()):
        for f in dataclasses.fields(cls):
            assert "--" + f.name.replace("_", "-") in flags


def test_a_bare_boolean_flag_means_true():
    assert parse_config(BASE + ["--verbose"]).train.log.verbose is True
    assert parse_config(BASE + ["--verbose", "false", "--compile"]).train.log.verbose is False
    assert parse_config(BASE + ["--compile", "--max-steps", "3"]).train.compute.compile is True
    assert parse_config(BASE).train.log.verbose is False


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--no-such-flag", "1"], "unrecognized argument --no-such-flag"),
        (["--n-head", "5"], "not divisible by n_head"),
        (["--compile", "maybe"], "expected true or false"),
        (["--dtype", "float8"], "dtype='float8'"),
        (["--micro-batch-size", "0"], "micro_batch_size=0"),
        (["--micro-batch-size", "big"], "expected an integer or auto"),
        (["--min-lr", "1.0"], "min_lr=1.0"),
    ],
)
def test_bad_flags_exit_2_with_a_message(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(BASE + argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--grad-clip", "nan"],
        ["--lr", "inf"],
        ["--lr", "nan"],
        ["--dropout", "inf"],
        ["--muon-lr", "inf"],
        ["--dist-step-timeout-s", "inf"],
    ],
)
def test_non_finite_float_flags_exit_2_with_one_line_naming_the_flag(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(BASE + argv)
    assert e.value.code == 2
    assert (
        capsys.readouterr().err == f"train_ddp.py: error: {argv[0]} {float(argv[1])}: not a finite number; nan "
        "and inf are refused, give a number\n"
    )


def test_non_finite_values_in_a_config_file_and_rehearsal_flags_are_refused(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text("lr = inf\n")  # TOML has inf and nan: the config's own check catches what argparse never saw
    with pytest.raises(SystemExit):
        parse_config(BASE + ["--config", str(toml)])
    assert "--lr inf: not a finite number" in capsys.readouterr().err
    from gpt2.train.cli import parse_command

    with pytest.raises(SystemExit):
        parse_command(BASE + ["--dry-run", "--gpu-memory-gb", "inf"])
    assert "--gpu-memory-gb inf must be a finite number > 0" in capsys.readouterr().err


def test_a_mistyped_flag_is_one_line_with_the_flag_meant(tmp_path):
    """Not 26 lines of usage before the error: the one line, and the flag the user probably meant."""
    run = subprocess.run(
        [sys.executable, "train_ddp.py", "--max_steps", "10"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2
    assert run.stderr == "train_ddp.py: error: unrecognized argument --max_steps; did you mean --max-steps?\n"


def test_a_mistyped_flag_is_reported_before_torch_is_imported():
    """torch was imported before the flags were parsed: a typo took ~25 s to report on a loaded machine."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "train_ddp.py", "--max-stepz", "10"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "did you mean --max-steps?" in run.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")]
    assert "gpt2.train.cli" in imported and "torch" not in imported


@pytest.mark.parametrize(
    "argv, err",
    [
        (["--max-step=3"], "unrecognized argument --max-step; did you mean --max-steps?"),
        (
            ["--warmup_steps", "3", "--zzz"],
            "unrecognized argument --warmup_steps; did you mean --warmup-steps?; unrecognized argument --zzz",
        ),
        (["--zzz"], "unrecognized argument --zzz; --help lists the flags"),
        (["--max-steps", "x"], "argument --max-steps: invalid int value: 'x'"),  # argparse's own errors: one line too
    ],
)
def test_parser_errors_are_one_line_without_the_usage(argv, err, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(BASE + argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == f"train_ddp.py: error: {err}\n"


def test_the_tools_parsers_say_the_same_in_one_line(capsys):
    from gpt2 import eval, export, sample
    from gpt2.doctor.__main__ import main as doctor_main
    from gpt2.plan.__main__ import main as plan_main

    for name, main, argv, err in (
        ("gpt2.sample", sample.main, ["--checkpoint", "x", "--max_new_tokens", "3"], "did you mean --max-new-tokens?"),
        ("gpt2.export", export.main, ["--checkpoint", "x", "--out", "y", "--ouy", "z"], "did you mean --out?"),
        (
            "gpt2.eval",
            eval.main,
            ["loss", "--checkpoint", "x", "--data-dir", "d", "--eval_tokens", "3"],
            "did you mean --eval-tokens?",
        ),
        ("gpt2.plan", plan_main, ["--world_size", "8"], "did you mean --world-size?"),
        ("gpt2.doctor", doctor_main, ["--skipp", "x"], "did you mean --skip?"),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        lines = capsys.readouterr().err.splitlines()
        assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith(f"{name}: error: unrecognized argument")
        assert lines[0].endswith(err), lines


def test_required_dirs(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--preset", "debug"])
    assert "--data-dir and --out-dir are required" in capsys.readouterr().err


def test_toml_errors(tmp_path, capsys):
    bad_key = tmp_path / "a.toml"
    bad_key.write_text("n_layers = 3\n")
    with pytest.raises(SystemExit):
        parse_config(BASE + ["--config", str(bad_key)])
    assert "unknown keys ['n_layers']" in capsys.readouterr().err
    bad_type = tmp_path / "b.toml"
    bad_type.write_text('n_layer = "three"\n')
    with pytest.raises(SystemExit):
        parse_config(BASE + ["--config", str(bad_type)])
    assert "should be of type int" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(BASE + ["--config", str(tmp_path / "missing.toml")])
    assert "no such file" in capsys.readouterr().err


def test_bad_config_fails_before_any_process_group(tmp_path):
    """A batch that does not divide and a missing data dir are reported by the real entry point, fast."""
    run = subprocess.run(
        [
            sys.executable,
            "train_ddp.py",
            "--preset",
            "debug",
            "--data-dir",
            str(tmp_path / "nope"),
            "--out-dir",
            str(tmp_path / "run"),
            "--device",
            "cpu",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "no such directory" in run.stderr and "data_prep" in run.stderr
    assert not (tmp_path / "run").exists()  # nothing was started


def test_missing_optional_sink_is_refused_before_start(tmp_path, shakespeare_shards, monkeypatch):
    import importlib.util

    from gpt2.train.startup import check_data

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = parse_config(
        ["--preset", "debug", "--data-dir", str(shakespeare_shards), "--out-dir", str(tmp_path), "--wandb-project", "p"]
    )
    with pytest.raises(ValueError, match="--wandb-project needs the wandb package"):
        check_data(cfg.train, cfg.model.block_size, 1)


def _refuse_batch(launcher: list[str], shards, run_dir) -> subprocess.CompletedProcess:
    # 5120 tokens, micro-batch 8 x block 128: 1024 per step in one process (divides), 2048 with two ranks
    return subprocess.run(
        [
            *launcher,
            "train_ddp.py",
            "--preset",
            "debug",
            "--data-dir",
            str(shards),
            "--out-dir",
            str(run_dir),
            "--device",
            "cpu",
            "--total-batch-size",
            "5120",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_batch_that_does_not_divide_is_refused_with_the_sizes_that_would(tmp_path, shakespeare_shards):
    """README: refused "with the sizes that would", exit code 2, under plain python."""
    run = subprocess.run(
        [
            sys.executable,
            "train_ddp.py",
            "--preset",
            "debug",
            "--data-dir",
            str(shakespeare_shards),
            "--out-dir",
            str(tmp_path / "run"),
            "--device",
            "cpu",
            "--total-batch-size",
            "3000",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train_ddp.py: error: total_batch_size=3000 is not a multiple")
    assert "sizes that would divide: --total-batch-size 2048 or 3072 (multiples of 1024)" in lines[0]


def test_batch_refused_under_torchrun_shows_the_workers_line_with_the_sizes(tmp_path, shakespeare_shards):
    """torchrun turns the worker's exit 2 into its own exit 1 and a ChildFailedError summary (README
    says so); what matters is that the worker's one line, with the sizes, is in the output, once."""
    run = _refuse_batch(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
        shakespeare_shards,
        tmp_path / "run",
    )
    assert run.returncode == 1, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("train_ddp.py: error:")]
    assert errors == [
        "train_ddp.py: error: total_batch_size=5120 is not a multiple of micro_batch_size*block_size"
        "*world_size = 8*128*2 = 2048; sizes that would divide: --total-batch-size 4096 or 6144 "
        "(multiples of 2048), or --micro-batch-size 1, 2, 4, 5"
    ]  # rank 0 only
    assert "exitcode  : 2" in run.stderr and "ChildFailedError" in run.stderr
    assert not (tmp_path / "run").exists()
    # the same flags divide in one process: the refusal is about the world size, not the numbers
    from gpt2.core.schedule import grad_accum_steps

    assert grad_accum_steps(5120, 8, 128, 1) == 5


def test_sample_prompt_longer_than_the_block_is_refused_before_start(tmp_path, shakespeare_shards):
    """One prompt rule (gpt2.model.tokenizer.encode_prompt): too long is an error, here before training starts."""
    from gpt2.train.startup import check_data

    flags = [
        "--preset",
        "debug",
        "--data-dir",
        str(shakespeare_shards),
        "--out-dir",
        str(tmp_path),
        "--block-size",
        "16",
        "--sample-interval",
        "5",
    ]

    def checked(argv):
        cfg = parse_config(argv)
        return check_data(cfg.train, cfg.model.block_size, 1)

    checked([*flags, "--sample-prompt", "To be or not to be"])  # fits: accepted
    with pytest.raises(ValueError, match=r"--sample-prompt: the prompt is \d+ tokens but the model's block_size is 16"):
        checked([*flags, "--sample-prompt", "word " * 40])
    checked([*flags, "--sample-interval", "0", "--sample-prompt", "word " * 40])  # never sampled


def test_collective_failures_are_told_apart_by_type_not_by_message(tmp_path, shakespeare_shards, monkeypatch, capsys):
    """A RuntimeError raised inside gpt2.distributed.group.collective becomes a CollectiveError (exit 1 with the
    dead-peer advice); any other RuntimeError propagates whatever its text says."""
    from _helpers import import_train_ddp

    import gpt2.train.startup
    import gpt2.train.trainer
    from gpt2.distributed.group import CollectiveError, collective

    with pytest.raises(CollectiveError, match=r"barrier failed \(RuntimeError: Connection closed by peer\)"):
        with collective("barrier"):
            raise RuntimeError("Connection closed by peer\nmore detail")
    with pytest.raises(torch.OutOfMemoryError):
        with collective("all_reduce"):
            raise torch.OutOfMemoryError("out of memory")

    train_ddp = import_train_ddp()
    flags = ["--preset", "debug", "--data-dir", str(shakespeare_shards), "--out-dir", str(tmp_path), "--device", "cpu"]

    def fails_in_a_collective(*args, **kwargs):
        with collective("the gradient all-reduce"):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:39625")

    monkeypatch.setattr(gpt2.train.startup, "start", lambda *args, **kwargs: "the run")  # the failure is train's
    monkeypatch.setattr(gpt2.train.trainer, "train", fails_in_a_collective)
    assert train_ddp.main(flags) == 1
    err = capsys.readouterr().err
    assert "a collective operation failed (the gradient all-reduce failed (RuntimeError: [gloo/" in err
    assert "another rank died, or did not answer within --dist-step-timeout-s" in err

    def a_bug_mentioning_nccl(*args, **kwargs):
        raise RuntimeError("NCCL gloo timed out: only words, raised outside any collective")

    monkeypatch.setattr(gpt2.train.trainer, "train", a_bug_mentioning_nccl)
    with pytest.raises(RuntimeError, match="only words"):
        train_ddp.main(flags)


HEADINGS = [
    "preset and config file",
    "model",
    "data",
    "batch",
    "schedule",
    "optim",
    "spike",
    "compute",
    "ckpt",
    "eval",
    "log",
    "distributed",
    "dry run",
]
"""The model's heading, then one per TrainConfig section, named as the section is (cfg.train.optim: optim)."""


def help_page(monkeypatch, columns: int = HELP_WIDTH) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))  # argparse lays help out for the terminal's width
    monkeypatch.setenv("PYTHON_COLORS", "0")  # Python 3.14's argparse colours help where FORCE_COLOR asks
    return build_parser().format_help()


def test_help_puts_every_flag_under_a_heading_on_one_line_with_its_default(monkeypatch):
    """`train_ddp.py --help`: the flags under headings a person scans (every config field under exactly one),
    each on one line at 100 columns, its help one line that ends with its default (or says it is required)."""
    parser = build_parser()
    groups = {g.title: g._group_actions for g in parser._action_groups if g._group_actions}
    assert list(groups) == ["options", *HEADINGS] and [a.dest for a in groups["options"]] == ["help"]
    grouped = [a.dest for title in HEADINGS for a in groups[title]]
    fields = [
        f"{section}.{f.name}"
        for section, cls in (("model", ModelConfig), *TRAIN_SECTIONS.items())
        for f in dataclasses.fields(cls)
    ]
    assert HEADINGS[1:-1] == ["model", *TRAIN_SECTIONS]
    for title in HEADINGS[1:-1]:  # each heading holds its section's fields, in the section's order
        assert [a.dest for a in groups[title]] == [f for f in fields if f.startswith(title + ".")]
    assert len(grouped) == len(set(grouped)) and set(fields) <= set(grouped)
    page = help_page(monkeypatch).splitlines()
    assert max(map(len, page)) <= HELP_WIDTH - 2
    for action in parser._actions[1:]:
        assert "\n" not in action.help and re.search(r" \((default: [^()]+|required)\)$", action.help), action.help
        flag = action.option_strings[0]
        [line] = [x for x in page if re.match(rf"  {flag}( \S+)?  ", x)]  # the flag, its metavar, the help column
        assert line.endswith(action.help), (line, action.help)  # flag and help on one line, not wrapped
    shown = {a.dest: a.help for a in parser._actions[1:]}
    for section, cls in (("model", ModelConfig), *TRAIN_SECTIONS.items()):
        for f in dataclasses.fields(cls):
            expected = "(required)" if f.name in ("data_dir", "out_dir") else f"(default: {shown_default(f.default)})"
            assert shown[f"{section}.{f.name}"].endswith(expected)
    assert shown["compute.compile"].endswith("(default: true)") and shown["schedule.lr"].endswith("(default: 0.0006)")
    assert shown["ckpt.init_from"].endswith("(default: none)") and shown["model.n_kv_head"].endswith("(default: none)")


def test_help_shows_what_each_preset_sets_as_the_flags_it_stands_for(monkeypatch):
    """The page ends with each preset's values as flags: every preset, every value, and (for the presets that
    need no --init-from) exactly the config --preset NAME gives."""
    page = help_page(monkeypatch)
    entries: dict[str, list[str]] = {}
    for line in page[page.index("presets (--preset NAME") :].splitlines()[1:]:
        if re.match(r"  \S", line):
            name, *rest = line.split()
            entries[name] = rest
        elif line.startswith(" " * 16):
            entries[name] += line.split()
    assert sorted(entries) == PRESETS
    for name, tokens in entries.items():
        values = {**MODEL_PRESETS.get(name, {}), **TRAIN_PRESETS.get(name, {})}
        assert dict(zip(tokens[::2], tokens[1::2])) == {
            f"--{k.replace('_', '-')}": shown_default(v) for k, v in values.items()
        }, name
        if name not in TRAIN_ONLY_PRESETS:
            assert parse_config([*BASE, *tokens]) == parse_config([*BASE, "--preset", name]), name


def test_before_the_group_rank_0_says_the_refusal_and_the_others_wait_for_the_launcher(monkeypatch, capsys):
    """Rank 1 exiting at once let torchrun stop rank 0 before it wrote its line (the test above, once, on a
    loaded machine: no line at all). The others wait to be ended by the launcher; past the grace, a rank
    whose problem is its own says it with its rank."""
    import time

    from _helpers import import_train_ddp

    from gpt2.distributed.group import WorldInfo

    train_ddp = import_train_ddp()
    waits = []
    monkeypatch.setattr(time, "sleep", waits.append)
    assert train_ddp.refuse_before_group(ValueError("no shards in D"), WorldInfo(0, 0, 2, 2)) == 2
    assert waits == [] and capsys.readouterr().err == "train_ddp.py: error: no shards in D\n"
    assert train_ddp.refuse_before_group(ValueError("no shards in D"), WorldInfo(1, 1, 2, 2)) == 2
    assert waits == [train_ddp.PEER_REFUSAL_GRACE_S]
    assert capsys.readouterr().err == "train_ddp.py: error: rank 1: no shards in D\n"
