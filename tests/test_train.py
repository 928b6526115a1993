"""End-to-end trainer tests through real processes: `python train_ddp.py` and `torchrun` (gloo)."""

import json
import math
import re

import pytest
import torch
from _helpers import built, train_in_process
from conftest import TINY_MODEL_FLAGS, run_trainer

from gpt2.train.cli import parse_config
from gpt2.train.run_log import read_metrics

FP32 = ["--device", "cpu", "--dtype", "float32", "--compile", "false", "--sample-interval", "0", "--plot", "false"]


def train_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def val_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r}


def check(run):
    assert run.returncode == 0, f"exit {run.returncode}\nstdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-3000:]}"


def test_two_ranks_equal_one_rank_with_accumulation(tmp_path, shakespeare_shards):
    """2 ranks x micro-batch 4 == 1 rank x 2 accumulation steps x micro-batch 4, same global batch."""
    common = [
        *TINY_MODEL_FLAGS,
        *FP32,
        "--data-dir",
        str(shakespeare_shards),
        "--micro-batch-size",
        "4",
        "--total-batch-size",
        "512",
        "--max-steps",
        "10",
        "--warmup-steps",
        "3",
        "--lr",
        "3e-3",
        "--eval-interval",
        "0",
        "--eval-tokens",
        "2048",
        "--ckpt-interval",
        "0",
        "--log-interval",
        "1",
    ]
    two = run_trainer([*common, "--out-dir", str(tmp_path / "two")], nproc=2)
    check(two)
    one = run_trainer([*common, "--out-dir", str(tmp_path / "one")], nproc=1)
    check(one)
    a, b = train_losses(tmp_path / "two"), train_losses(tmp_path / "one")
    assert sorted(a) == sorted(b) == list(range(1, 11))
    for step in a:
        assert a[step] == pytest.approx(b[step], abs=1e-5), (step, a[step], b[step])
    assert a[10] < a[1]  # it did learn something, so equality is not trivial
    info = json.loads((tmp_path / "one" / "config.json").read_text())
    assert info["accum_steps"] == 2 and info["world_size"] == 1
    assert json.loads((tmp_path / "two" / "config.json").read_text())["accum_steps"] == 1
    ua, ub = val_losses(tmp_path / "two"), val_losses(tmp_path / "one")
    assert ua[10] == pytest.approx(ub[10], abs=1e-5)  # validation is averaged across ranks exactly


def test_torchrun_training_on_shakespeare_lowers_validation_loss(tmp_path, shakespeare_shards):
    run_dir = tmp_path / "run"
    hellaswag = tmp_path / "hellaswag.jsonl"  # the official schema; scored every 15 steps by both ranks
    hellaswag.write_text(
        "".join(
            json.dumps({"ctx": f"The king said {w}", "endings": [" and", " the", " of", " to"], "label": i % 4}) + "\n"
            for i, w in enumerate(["that", "so", "no"])
        )
    )
    run = run_trainer(
        [
            *TINY_MODEL_FLAGS,
            *FP32[:-2],
            "--data-dir",
            str(shakespeare_shards),
            "--out-dir",
            str(run_dir),
            "--micro-batch-size",
            "8",
            "--total-batch-size",
            "2048",
            "--max-steps",
            "30",
            "--warmup-steps",
            "5",
            "--lr",
            "3e-3",
            "--eval-interval",
            "15",
            "--eval-tokens",
            "4096",
            "--sample-interval",
            "30",
            "--log-interval",
            "5",
            "--ckpt-interval",
            "0",
            "--hellaswag-interval",
            "15",
            "--hellaswag-file",
            str(hellaswag),
        ],
        nproc=2,
    )
    check(run)
    val = val_losses(run_dir)
    assert sorted(val) == [0, 15, 30]
    assert val[0] == pytest.approx(math.log(50257), abs=0.3)
    assert val[30] < val[15] < val[0] - 2.0
    recs = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == [5, 10, 15, 20, 25, 30]
    for r in steps:
        assert {"step", "loss", "lr", "grad_norm", "tokens", "step_s", "tok_per_s", "mfu"} <= set(r)
        assert r["tokens"] == r["step"] * 2048
    hs = [r for r in recs if "hellaswag_acc_norm" in r]
    assert [r["step"] for r in hs] == [15, 30] and all(0 <= r["hellaswag_acc_norm"] <= 1 for r in hs)
    # The console's start-up is a few lines; the planner's whole summary and the network line are in
    # RUN/train.log, with every console line (rank 0's: once).
    startup = run.stdout.split("step      0 | val loss")[0].splitlines()
    assert len(startup) <= 8 and startup[0].startswith("starting ") and "params     " not in run.stdout, startup
    assert any(line.startswith("plan       ") and "run/train.log (--verbose prints it)" in line for line in startup)
    log = (run_dir / "train.log").read_text()
    assert "params     " in log and "fits       yes" in log and "\nnetwork    all-reduce of " in log
    assert log.count("step     30/30") == 1 and "sample at step 30" in log
    samples = [r["sample"] for r in recs if "sample" in r]
    assert len(samples) == 1 and len(samples[0]) > 0
    assert "sample at step 30" in run.stdout
    assert (run_dir / "loss_curve.png").stat().st_size > 1000
    from gpt2.metrics import main as plot_main  # on request: `python -m gpt2.metrics RUN`

    assert plot_main([str(run_dir), "--out", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 1000
    with pytest.raises(SystemExit):
        plot_main([str(tmp_path / "not_a_run")])
    assert (run_dir / "checkpoints" / "latest").is_file()  # always a final checkpoint
    # rank 0 alone logs: one line per logged step, not one per rank
    assert run.stdout.count("step     30/30") == 1


@pytest.mark.slow
def test_compiled_bf16_run_logs_sane_numbers(tmp_path, shakespeare_shards):
    run_dir = tmp_path / "run"
    run = run_trainer(
        [
            *TINY_MODEL_FLAGS,
            "--device",
            "cpu",
            "--dtype",
            "bfloat16",
            "--compile",
            "true",
            "--data-dir",
            str(shakespeare_shards),
            "--out-dir",
            str(run_dir),
            "--micro-batch-size",
            "4",
            "--total-batch-size",
            "512",
            "--max-steps",
            "6",
            "--warmup-steps",
            "2",
            "--lr",
            "3e-3",
            "--eval-interval",
            "0",
            "--eval-tokens",
            "1024",
            "--sample-interval",
            "0",
            "--log-interval",
            "1",
            "--ckpt-interval",
            "0",
            "--plot",
            "false",
            "--tensorboard",
            "true",
        ],
        nproc=1,
    )
    check(run)
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))  # the optional TensorBoard sink
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 6
    for r in steps:
        assert math.isfinite(r["loss"]) and 0 < r["loss"] < 11.5
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        assert r["tok_per_s"] > 0 and 0 < r["mfu"] < 1 and r["mem_mb"] > 0
        assert not r["skipped"]
    assert steps[-1]["loss"] < steps[0]["loss"]
    info = json.loads((run_dir / "config.json").read_text())
    assert (
        info["config"]["train"]["compute"]["compile"] is True
        and info["config"]["train"]["compute"]["dtype"] == "bfloat16"
    )
    assert info["versions"]["torch"] == torch.__version__
    # the checkpoint of a compiled model has no _orig_mod. prefix
    state = torch.load(run_dir / "checkpoints" / "step_00000006.pt", map_location="cpu", weights_only=True)
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in state["model"])


@pytest.mark.slow
def test_readme_quickstart_script_runs_twice(tmp_path):
    """README's first command, shortened by flags passed through to train_ddp.py, run twice in a row:
    the second run reuses the data and says the run is finished. PYTHON: the interpreter this test
    runs under (not whatever `python` is on PATH)."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    run_dir = tmp_path / "run"
    env = {**os.environ, "DATA_DIR": str(tmp_path / "pydoc"), "NPROC": "2", "PYTHON": sys.executable}
    cmd = [
        "bash",
        "scripts/quickstart.sh",
        str(run_dir),
        "--max-steps",
        "3",
        "--eval-interval",
        "3",
        "--sample-interval",
        "3",
        "--sample-tokens",
        "8",
        "--plot",
        "false",
    ]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    check(run)
    assert run.stdout.splitlines()[0].startswith("documents ")  # data_prep's summary: the data was made
    assert "sample at step 3" in run.stdout
    # the start-up network line (two ranks; in RUN/train.log), recorded in config.json too; and no deprecation noise
    assert re.search(
        r"network +all-reduce of [\d.]+ MiB over 2 ranks \(gloo\).*busbw [\d.]+ GB/s",
        (run_dir / "train.log").read_text(),
    )
    assert "NCCL" not in run.stderr and "InfiniBand" not in run.stderr  # one host: no network to warn about
    assert json.loads((run_dir / "config.json").read_text())["network"]["world_size"] == 2
    assert "FutureWarning" not in run.stderr and "Traceback" not in run.stderr
    val = val_losses(run_dir)
    assert sorted(val) == [0, 3] and val[3] < val[0]
    manifest = json.loads((tmp_path / "pydoc" / "shards" / "manifest.json").read_text())
    assert manifest["totals"]["tokens"] > 100_000
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    check(again)
    assert "nothing to do:" in again.stdout  # the same shards, not rebuilt
    assert "nothing to train:" in again.stdout and "already finished step 3" in again.stdout
    # said at once: data_prep's line, the trainer's `starting` line, then this; no plan, no checks' lines
    assert again.stdout.splitlines()[2].startswith("nothing to train:"), again.stdout
    assert len(again.stdout.splitlines()) == 3 and "warning:" not in again.stderr, again.stdout + again.stderr
    assert val_losses(run_dir) == val  # the finished run is left as it was


def test_a_model_that_cannot_fit_is_refused_before_allocating(tmp_path, shakespeare_shards):
    run = run_trainer(
        [
            "--preset",
            "gpt2-xl",
            "--device",
            "cpu",
            "--compile",
            "false",
            "--data-dir",
            str(shakespeare_shards),
            "--out-dir",
            str(tmp_path / "run"),
            "--micro-batch-size",
            "512",
        ]
    )
    assert run.returncode == 2, run.stderr
    if "gpt2-xl does not fit on cpu" in run.stderr:  # a host with less than ~26 GiB: not even one sequence
        assert "micro_batch_size=1 needs" in run.stderr and "use a smaller model" in run.stderr
    else:
        assert "micro_batch_size=512 needs" in run.stderr and "or less" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    assert run.stdout.strip().splitlines() == [run.stdout.strip()] and run.stdout.startswith(
        "starting "
    )  # then the error
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_model_that_fits_nowhere_stops_every_rank_with_one_error(tmp_path, shakespeare_shards):
    """--micro-batch-size auto: rank 0 finds that not even one sequence fits and every rank stops with
    its error (exit 2), none left waiting for rank 0's answer."""
    run = run_trainer(
        [
            "--n-layer",
            "48",
            "--n-head",
            "64",
            "--n-embd",
            "8192",
            "--device",
            "cpu",
            "--compile",
            "false",
            "--data-dir",
            str(shakespeare_shards),
            "--out-dir",
            str(tmp_path / "run"),
            "--micro-batch-size",
            "auto",
            "--total-batch-size",
            "2048",
            "--block-size",
            "1024",
        ],
        nproc=2,
    )
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("train_ddp.py: error:")]
    assert len(errors) == 1, run.stderr[-3000:]
    assert "does not fit on cpu (1/2 of host RAM)" in errors[0] and "world size 2" in errors[0]
    assert "collective operation failed" not in run.stderr


def test_read_metrics_skips_a_torn_line_and_a_missing_file_with_missing_ok(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 10.0}\n{"step": 2, "loss": 9.5}\n{"step": 3, "lo')  # being written
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    assert read_metrics(tmp_path / "none.jsonl", missing_ok=True) == []
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path / "none.jsonl")


def test_read_metrics_refuses_a_damaged_line_that_is_not_the_last(tmp_path):
    """Only the last line can be torn (by a live writer or a crash); anywhere else it is damage."""
    from gpt2.distributed.group import Dist
    from gpt2.train.run_log import RunLog

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 10.0}\n{"step": 2, "lo\n{"step": 3, "loss": 9.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record .* the metrics log is damaged"):
        read_metrics(path)
    log = RunLog(Dist(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu")), tmp_path)
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        log.truncate_after(3)  # a resume says so rather than dropping step 2's record unseen
    log.close()


def test_a_resume_warns_when_a_cut_line_loses_rows_it_will_not_log_again(tmp_path, capsys):
    """Issue 41: a metrics.jsonl cut mid-line (a full disk, a copy cut short) lost rows silently on
    resume. The rows the resume will not log again are named; a cut row of a later step (logged again
    as the resumed run reaches it) is dropped without a word."""
    from gpt2.distributed.group import Dist
    from gpt2.train.run_log import RunLog

    path = tmp_path / "metrics.jsonl"
    rows = '{"step": 1, "loss": 10.0}\n{"step": 2, "loss": 9.5}\n'
    log = RunLog(Dist(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu")), tmp_path)
    for cut, resume_at, warning in (
        (
            '{"step": 3, "lo',
            4,
            f'{path}:3 was cut mid-record (\'{{"step": 3, "lo\') and is dropped: the row of '
            "step 3, and any logged after it up to step 4, are lost (the run resumes at step 4 "
            "and does not run those steps again)",
        ),
        ('{"step": 2, "val_lo', 2, "a row of step 2 is lost"),
        ('{"st', 3, "a row logged after step 2 is lost"),
        ('{"step": 3, "lo', 2, None),
    ):
        path.write_text(rows + cut)
        capsys.readouterr()
        log.truncate_after(resume_at)
        err = capsys.readouterr().err
        assert (warning in err and err.count("\n") == 1) if warning else err == "", (cut, err)
        assert path.read_text() == "".join(line + "\n" for line in rows.splitlines()[:resume_at])
    log.close()


def test_micro_batch_size_auto_resolves_on_rank_0_within_what_fits(tmp_path, capsys):
    """Rank 0 sizes the micro-batch with the planner (gpt2/plan/batch_choice.py: the throughput model among the
    micro-batches that fit with the plan's margin and divide); a memory cap passed to it bounds the choice."""
    from gpt2.core.config import ModelConfig, RunConfig, TrainConfig
    from gpt2.distributed.group import Dist
    from gpt2.plan.hardware import Hardware
    from gpt2.plan.memory import AUTO_HEADROOM, max_micro_batch_size
    from gpt2.train.run_log import RunLog
    from gpt2.train.startup import resolve_auto

    dist = Dist(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
    cfg = RunConfig(
        ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=256),
        TrainConfig.of(
            data_dir="d", out_dir=str(tmp_path), dtype="float32", micro_batch_size="auto", total_batch_size=256 * 48
        ),
    )
    log = RunLog(dist, tmp_path)
    roomy = resolve_auto(cfg, dist, log).cfg
    b = roomy.train.batch.micro_batch_size
    assert 48 % b == 0 and roomy.train.compute.dtype == "float32"
    assert f"micro-batch auto: {b} sequences, the fastest by the throughput model" in capsys.readouterr().out
    cap = Hardware(
        name="capped cpu", memory_bytes=200 * 2**20, peak_flops=1e11, device_type="cpu", reserve_bytes=0
    )  # with the plan's margin, 10 sequences fit in 200 MiB
    fits = max_micro_batch_size(cfg, cap, headroom=AUTO_HEADROOM)
    capped = resolve_auto(cfg, dist, log, hardware=cap).cfg
    assert capped.train.batch.micro_batch_size <= fits < 48 and 48 % capped.train.batch.micro_batch_size == 0


def test_loss_impl_auto_is_decided_by_rank_0_for_the_device_and_logged(tmp_path, capsys):
    """resolve_auto makes --loss-impl concrete for the resolved micro-batch: full logits on a roomy device,
    chunked on a small one (gpt2/plan/ choose_loss_impl), one start-up line with the reason."""
    from gpt2.core.config import ModelConfig, RunConfig, TrainConfig
    from gpt2.distributed.group import Dist
    from gpt2.plan.hardware import GIB, Hardware
    from gpt2.train.run_log import RunLog
    from gpt2.train.startup import resolve_auto

    dist = Dist(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
    cfg = RunConfig(
        ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=64),
        TrainConfig.of(data_dir="d", out_dir=str(tmp_path), dtype="float32", micro_batch_size=8, total_batch_size=512),
    )  # 512 tokens, compiled: full-logits peak 0.10 GiB
    log = RunLog(dist, tmp_path)
    roomy = Hardware(name="roomy", memory_bytes=8 * GIB, peak_flops=None, device_type="cpu", reserve_bytes=GIB)
    small = Hardware(name="small", memory_bytes=3 * GIB // 2, peak_flops=None, device_type="cpu", reserve_bytes=GIB)
    full, why_full = (r := resolve_auto(cfg, dist, log, hardware=roomy)).cfg, r.loss
    chunked, why_chunked = (r := resolve_auto(cfg, dist, log, hardware=small)).cfg, r.loss
    forced = resolve_auto(RunConfig(cfg.model, cfg.train.replace(loss_impl="full")), dist, log, hardware=small).cfg
    log.close()
    assert (full.train.compute.loss_impl, chunked.train.compute.loss_impl, forced.train.compute.loss_impl) == (
        "full",
        "chunked",
        "full",
    )
    out = capsys.readouterr().out
    assert f"loss       full logits: F.cross_entropy over the (B, T, V) logits ({why_full.reason})" in out
    assert "auto: full-logits peak 0.10 GiB at micro-batch 8 > 1/8 of 0.50 GiB usable" in why_chunked.reason
    assert f"({why_chunked.reason})" in out and "loss       chunked: " in out


@pytest.mark.slow
def test_loss_impl_full_and_chunked_train_alike_and_the_choice_is_logged_and_recorded(tmp_path, shakespeare_shards):
    """Real runs with --loss-impl full and chunked: the same per-step losses to 1e-5 (fp32), the choice in the
    start-up lines and config.json, and the dry run of the same command prints the same decision."""
    common = [
        *TINY_MODEL_FLAGS,
        *FP32,
        "--data-dir",
        str(shakespeare_shards),
        "--micro-batch-size",
        "4",
        "--total-batch-size",
        "512",
        "--max-steps",
        "4",
        "--warmup-steps",
        "2",
        "--lr",
        "3e-3",
        "--eval-interval",
        "0",
        "--eval-tokens",
        "512",
        "--ckpt-interval",
        "0",
        "--log-interval",
        "1",
    ]
    runs = {}
    for impl in ("full", "chunked"):  # the line is detail: on the console with --verbose, always in RUN/train.log
        run = run_trainer(
            [
                *common,
                "--out-dir",
                str(tmp_path / impl),
                "--loss-impl",
                impl,
                *(["--verbose"] if impl == "full" else []),
            ]
        )
        check(run)
        text = run.stdout if impl == "full" else (tmp_path / impl / "train.log").read_text()
        assert ("LM head + loss peak" in run.stdout) == (impl == "full")
        runs[impl] = text
        info = json.loads((tmp_path / impl / "config.json").read_text())
        assert info["config"]["train"]["compute"]["loss_impl"] == impl and info["loss"]["impl"] == impl
        line = [ln for ln in text.splitlines() if ln.startswith("loss       ")]
        assert len(line) == 1 and f"--loss-impl {impl}" in line[0] and info["loss"]["reason"] in line[0]
        label = "(full logits: all B*T*V at once" if impl == "full" else "(chunked: never all B*T*V logits"
        assert "LM head + loss peak" in text and label in text
    full, chunked = train_losses(tmp_path / "full"), train_losses(tmp_path / "chunked")
    assert sorted(full) == sorted(chunked) == [1, 2, 3, 4]
    for step in full:
        assert full[step] == pytest.approx(chunked[step], abs=1e-5), (step, full[step], chunked[step])
    assert full[4] < full[1]  # it learned: the agreement is over real updates
    dry = run_trainer(
        [*common, "--out-dir", str(tmp_path / "full"), "--loss-impl", "full", "--resume", "never", "--dry-run"]
    )
    check(dry)
    assert [ln for ln in dry.stdout.splitlines() if ln.startswith("loss       ")] == [
        ln for ln in runs["full"].splitlines() if ln.startswith("loss       ")
    ]


@pytest.mark.slow
def test_micro_batch_size_auto_end_to_end(tmp_path, shakespeare_shards):
    run_dir = tmp_path / "run"
    run = run_trainer(
        [
            *TINY_MODEL_FLAGS,
            *FP32,
            "--data-dir",
            str(shakespeare_shards),
            "--out-dir",
            str(run_dir),
            "--micro-batch-size",
            "auto",
            "--total-batch-size",
            "512",
            "--max-steps",
            "2",
            "--eval-interval",
            "0",
            "--eval-tokens",
            "512",
            "--ckpt-interval",
            "0",
        ]
    )
    check(run)
    # the default --warmup-steps 715 over --max-steps 2: said once, as a warning, not silently accepted
    assert [ln for ln in run.stderr.splitlines() if "warmup" in ln] == [
        ln
        for ln in run.stderr.splitlines()
        if ln.startswith("warning: --warmup-steps 715 is more than twice --max-steps 2")
    ]
    assert "warning: --warmup-steps 715" in run.stderr
    info = json.loads((run_dir / "config.json").read_text())
    b = info["config"]["train"]["batch"]["micro_batch_size"]  # 512 tokens = 8 x 64: a divisor of 8
    # uncompiled on a CPU the candidates are timed (gpt2/plan/batch_probe.py), elsewhere the throughput model picks
    assert re.search(
        rf"micro-batch auto: {b} sequences, (measured on this CPU|the fastest by the throughput model)", run.stdout
    )
    assert 8 % b == 0 and info["accum_steps"] == 8 // b


def test_warmup_that_does_not_end_before_max_steps_is_said_in_one_line():
    """--warmup-steps 1000 --max-steps 3: the lr only reaches 3/1000 of --lr and never decays. A smoke test
    of a recipe does that on purpose, so it is a warning (gpt2/train/startup.py log_warmup says why)."""
    from gpt2.core.config import TrainConfig
    from gpt2.train.startup import log_warmup

    said = []

    class Log:
        warn = said.append

    log_warmup(TrainConfig.of(data_dir="d", out_dir="o", warmup_steps=1000, max_steps=3, lr=6e-4).schedule, Log)
    assert len(said) == 1 and "\n" not in said[0], said
    assert said[0].startswith(
        "--warmup-steps 1,000 is more than twice --max-steps 3: the learning rate only rises, "
        "to 1.8e-06 (0.3% of --lr 0.0006) at the last step, and never decays"
    ), said[0]
    # up to twice as many warmup steps as steps the run still reaches half of --lr: a compressed schedule
    for fine in (
        dict(warmup_steps=0, max_steps=3),
        dict(warmup_steps=3, max_steps=2),
        dict(warmup_steps=6, max_steps=3),
    ):
        log_warmup(TrainConfig.of(data_dir="d", out_dir="o", **fine).schedule, Log)
    assert len(said) == 1
    log_warmup(TrainConfig.of(data_dir="d", out_dir="o", warmup_steps=7, max_steps=3).schedule, Log)
    assert len(said) == 2 and "(42.9% of --lr" in said[1]


def test_the_compile_line_comes_before_anything_is_compiled(tmp_path, shakespeare_shards, monkeypatch, capsys):
    """torch.compile compiles a graph when it first runs, and under DDP the first one runs inside build
    (its bucket-settling step): the line that explains a silent minute is on the console before build."""
    import gpt2.train.startup as startup
    from gpt2.distributed.group import single_process
    from gpt2.train.cli import parse_config

    class Building(Exception):
        pass

    def build(*args, **kwargs):
        raise Building(capsys.readouterr().out)

    monkeypatch.setattr(startup, "build", build)
    cfg = parse_config(
        [
            *TINY_MODEL_FLAGS,
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--compile",
            "true",
            "--data-dir",
            str(shakespeare_shards),
            "--out-dir",
            str(tmp_path / "run"),
            "--micro-batch-size",
            "2",
            "--total-batch-size",
            "128",
            "--max-steps",
            "1",
        ]
    )
    with pytest.raises(Building) as caught:
        train_in_process(cfg, single_process())
    assert "compiling: torch.compile builds each graph the first time it runs" in str(caught.value), caught.value


class Building(Exception):
    """Raised in place of build: the start-up has decided everything and built nothing."""


def start_up_to_build(argv: list[str], monkeypatch, capsys) -> tuple[str, str]:
    """A real start-up of argv (one process) stopped where it would build the model: its stdout and stderr."""
    import gpt2.train.startup as startup
    from gpt2.distributed.group import single_process

    def build(*args, **kwargs):
        raise Building

    monkeypatch.setattr(startup, "build", build)
    with pytest.raises(Building):
        train_in_process(parse_config(argv), single_process())
    captured = capsys.readouterr()
    return captured.out, captured.err


def tiny_start(shakespeare_shards, out_dir, *flags: str) -> list[str]:
    return [
        *TINY_MODEL_FLAGS,
        *FP32,
        "--data-dir",
        str(shakespeare_shards),
        "--out-dir",
        str(out_dir),
        "--micro-batch-size",
        "2",
        "--total-batch-size",
        "128",
        "--max-steps",
        "1",
        "--eval-tokens",
        "0",
        *flags,
    ]


def test_autotune_without_compile_and_an_fp8_head_on_a_cpu_are_each_a_warning(
    tmp_path, shakespeare_shards, monkeypatch, capsys
):
    """--autotune without --compile tunes nothing, --fp8-head on a CPU runs emulated FP8 (much slower): a start
    says each in one warning line before anything is built; without them, neither line."""
    from gpt2.model.fp8 import fp8_problem

    autotune = (
        "warning: --autotune does nothing without --compile: it times the compiled regions' matmul kernels, and "
        "nothing is compiled; pass --compile true, or drop --autotune"
    )
    fp8 = "warning: --fp8-head on a CPU runs the LM head's FP8 matmuls emulated (a CPU has no FP8 units;"
    _, err = start_up_to_build(
        tiny_start(shakespeare_shards, tmp_path / "a", "--autotune", "true"), monkeypatch, capsys
    )
    assert autotune in err.splitlines() and fp8 not in err, err
    _, err = start_up_to_build(tiny_start(shakespeare_shards, tmp_path / "b"), monkeypatch, capsys)
    assert "--autotune" not in err and fp8 not in err, err
    if fp8_problem("cpu") is None:  # this torch has FP8 matmuls on a CPU (else --fp8-head is refused there)
        _, err = start_up_to_build(
            tiny_start(shakespeare_shards, tmp_path / "c", "--fp8-head", "true"), monkeypatch, capsys
        )
        lines = [line for line in err.splitlines() if line.startswith(fp8)]
        assert len(lines) == 1 and lines[0].endswith(
            "drop --fp8-head (it speeds up GPUs with FP8 tensor cores: H100, H200, L4, L40)"
        ), err


def test_a_disk_without_room_for_a_checkpoint_is_refused_at_start_up_and_one_short_of_the_kept_ones_warned(
    tmp_path, shakespeare_shards, monkeypatch, capsys
):
    """A full disk was said only when the first save failed, steps in. Now the start-up compares the free space
    (shutil.disk_usage, faked here) with the plan's checkpoint size: less than one is refused in one line,
    less than the most the run adds at once (--keep-checkpoints 3 and 3 saves: 3) is one warning."""
    import shutil
    from collections import namedtuple

    from gpt2.ckpt.disk import disk_verdict, saves_of
    from gpt2.core.config import ModelConfig
    from gpt2.plan.budget import checkpoint_bytes

    size = checkpoint_bytes(ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=64))
    usage = namedtuple("usage", "total used free")
    free = [0]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - free[0], free[0]))
    run = tmp_path / "run"
    argv = tiny_start(shakespeare_shards, run, "--max-steps", "3", "--ckpt-interval", "1", "--keep-checkpoints", "3")
    free[0] = 1_000_000
    with pytest.raises(ValueError) as refused:
        start_up_to_build(argv, monkeypatch, capsys)
    assert str(refused.value) == (
        f"--out-dir {run}: 1.0 MB free on its disk, and a checkpoint of this model and optimizer is "
        f"~{size / 1e6:,.1f} MB: the first save would fail; free disk space, or pass an --out-dir on a disk with "
        "room (--ckpt-interval 0 still writes the final one)"
    )
    free[0] = int(2.5 * size)
    _, err = start_up_to_build(argv, monkeypatch, capsys)
    warnings = [line for line in err.splitlines() if line.startswith(f"warning: --out-dir {run}")]
    assert warnings == [
        f"warning: --out-dir {run}: {free[0] / 1e6:,.1f} MB free on its disk holds 2 checkpoint(s) and a checkpoint "
        f"of this model and optimizer is ~{size / 1e6:,.1f} MB; with --keep-checkpoints 3 this run adds up to 3 at "
        f"once ({3 * size / 1e6:,.1f} MB; a new one is written before the oldest is deleted), so a later save will "
        "fail: free disk space, or pass --keep-checkpoints 1, --ckpt-interval 0 (the final checkpoint only) or an "
        "--out-dir on a disk with room"
    ], err
    free[0] = 3 * size
    _, err = start_up_to_build(argv, monkeypatch, capsys)
    assert "free on its disk" not in err, err
    # How many a run adds at once: up to --keep-checkpoints + 1 (the new one before the oldest goes), fewer
    # when it saves fewer times; a resume whose own checkpoints are there adds only what retention does not replace.
    tc = parse_config(argv).train
    assert [saves_of(tc, step) for step in (0, 2, 3)] == [3, 1, 0]
    assert saves_of(parse_config([*argv, "--ckpt-interval", "0"]).train, 0) == 1
    assert saves_of(parse_config([*argv, "--max-steps", "10", "--ckpt-interval", "4"]).train, 0) == 3  # 4, 8, 10
    verdict = dict(free=2 * size, size=size, keep=3)
    assert disk_verdict("o", **verdict, saves=10, held=3) == (None, None)  # one more, then down to 3
    assert disk_verdict("o", **verdict, saves=1, held=0) == (None, None)
    assert disk_verdict("o", **verdict, saves=10, held=1)[1] is not None  # 3 more at once: 2 fit
    assert disk_verdict("o", **verdict, saves=0, held=0) == (None, None)  # a finished run writes nothing


def test_auto_dtype_is_logged_and_recorded_with_its_reason(tmp_path, shakespeare_shards):
    run_dir = tmp_path / "run"
    run = run_trainer(
        [
            *TINY_MODEL_FLAGS,
            "--device",
            "cpu",
            "--compile",
            "false",
            "--sample-interval",
            "0",
            "--plot",
            "false",
            "--data-dir",
            str(shakespeare_shards),
            "--out-dir",
            str(run_dir),
            "--micro-batch-size",
            "8",
            "--total-batch-size",
            "512",
            "--max-steps",
            "1",
            "--eval-interval",
            "0",
            "--eval-tokens",
            "512",
            "--ckpt-interval",
            "0",
        ]
    )
    check(run)
    info = json.loads((run_dir / "config.json").read_text())
    p = info["precision"]
    assert p["requested"] == "auto" and p["dtype"] in ("bfloat16", "float32")
    assert "GFLOP/s" in p["reason"] or "no bf16 instructions" in p["reason"]  # measured, or not worth measuring
    assert info["config"]["train"]["compute"]["dtype"] == p["dtype"]  # the run's config holds what actually ran
    assert f"precision  {p['dtype']}: {p['reason']}" in run.stdout
    # the first line comes before any measuring or building, so a slow start is never silent
    assert run.stdout.splitlines()[0].startswith("starting ")


def test_a_training_step_reads_nothing_from_the_device_and_its_numbers_come_in_one_read(
    tmp_path, shakespeare_shards, monkeypatch
):
    """With fused AdamW (the default) the skip is decided on the device: a step queues forward,
    backward, clip, update and the next micro-batch without one host read, so a GPU's queue never
    drains; loss, gradient norm and stop flag then come to the host together, in one read, when asked.
    Counted as the trainer's own reads of tensor values (item, tolist, float(), bool(), ...) and
    synchronize calls; the loader's host-side index maths is not a device read."""
    import sys
    from pathlib import Path

    import gpt2
    from gpt2.distributed.group import Dist
    from gpt2.train.cli import parse_config
    from gpt2.train.run_log import RunLog
    from gpt2.train.trainer import train_step

    cfg = parse_config(
        [
            *TINY_MODEL_FLAGS,
            *FP32,
            "--data-dir",
            str(shakespeare_shards),
            "--out-dir",
            str(tmp_path),
            "--micro-batch-size",
            "2",
            "--total-batch-size",
            "256",
            "--max-steps",
            "5",
        ]
    )
    dist = Dist(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
    parts = built(cfg, dist, RunLog(dist, tmp_path))
    assert parts.accum_steps == 2
    train_step(parts, cfg.train, dist, False)  # warm-up

    package = str(Path(gpt2.__file__).parent)
    host_side = {str(Path(package) / name) for name in ("data.py", "permutation.py")}
    reads = []

    def counting(name, original):
        def wrapper(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(package) and caller not in host_side:
                reads.append(f"{name} from {Path(caller).name}:{sys._getframe(1).f_lineno}")
            return original(*args, **kwargs)

        return wrapper

    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", counting("synchronize", torch.cuda.synchronize))
    outs = [train_step(parts, cfg.train, dist, False) for _ in range(3)]
    assert reads == []
    assert math.isfinite(outs[0]["loss"]) and math.isfinite(outs[0]["grad_norm"]) and outs[0]["stop"] is False
    assert outs[0]["skipped"] is False and outs[2]["loss"] != outs[0]["loss"]
    assert len(reads) == 2 and all(r.startswith("tolist from trainer.py") for r in reads), reads


@pytest.mark.slow
def test_a_compiler_failure_at_the_first_step_is_reported_as_one_and_not_as_a_dead_rank(tmp_path, shakespeare_shards):
    """2 ranks under torchrun, DDP + compile, no C++ compiler for inductor (CXX names none, a fresh kernel
    cache so nothing compiled earlier is reused): the first compile runs inside the bucket-settling
    step's collective context, and each rank says what failed and the fix, in one line, not that a
    collective failed because another rank died."""
    args = [
        *TINY_MODEL_FLAGS,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--compile",
        "true",
        "--sample-interval",
        "0",
        "--plot",
        "false",
        "--data-dir",
        str(shakespeare_shards),
        "--out-dir",
        str(tmp_path / "run"),
        "--micro-batch-size",
        "2",
        "--total-batch-size",
        "256",
        "--max-steps",
        "2",
        "--eval-tokens",
        "256",
    ]
    run = run_trainer(args, nproc=2, env={"CXX": "/nonexistent", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")})
    assert run.returncode != 0
    errors = [ln for ln in run.stderr.splitlines() if "train_ddp.py: error:" in ln]
    assert errors and all(
        "torch.compile could not build the model's kernels (InvalidCxxCompiler: No working C++ compiler found" in ln
        and "--compile false" in ln
        for ln in errors
    ), run.stderr[-3000:]
    assert "a collective operation failed" not in run.stderr, run.stderr[-3000:]
    assert "gpt2" not in "".join(ln for ln in run.stderr.splitlines() if ln.startswith("  File ")), run.stderr[
        -3000:
    ]  # no traceback from the trainer (torchrun prints its own for a failed worker)
