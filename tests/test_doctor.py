"""`python -m gpt2.doctor` on this CPU, as a user runs it: every section runs, its checks pass and say so
in the JSON and the table; a failing check makes the exit status 1 with the table still printed; a section
that raises is reported FAILED with one line while the others run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpt2.doctor import __main__ as cli
from gpt2.doctor import sections
from gpt2.doctor.check_correctness import LEARNS_MARGIN, correctness
from gpt2.doctor.check_environment import environment, parse_driver_version
from gpt2.doctor.context import SCALES, Context
from gpt2.doctor.results import Section, exit_status, format_table
from gpt2.doctor.sections import run_section

REPO = Path(__file__).resolve().parent.parent
SECTION_NAMES = ["environment", "attention", "correctness", "resume", "training", "ranks", "ladder"]


@pytest.fixture(scope="module")
def cpu_doctor(tmp_path_factory):
    """One CPU run as a user's first: every section but the opt-in ladder, 2 gloo ranks (about 3 minutes on 2
    loaded cores), shared by the tests below. The ladder (6 more models, 3 compiled: 50 s alone, 100-150 s under
    the long pass's load) is its own: its table in test_the_ladder_section_tables_every_rung, its rungs' real runs
    in tests/test_bench.py's ladder smoke, the whole --full run in soak."""
    out = tmp_path_factory.mktemp("doctor")
    done = doctor_on_cpu(out, "--ranks", "2")
    return done, json.loads((out / "doctor.json").read_text()), out


def doctor_on_cpu(out, *args: str) -> subprocess.CompletedProcess:
    """`python -m gpt2.doctor --device cpu ARGS --out OUT`, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "gpt2.doctor", "--device", "cpu", *args, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
    )


@pytest.mark.slow  # the shared full CPU run: ~3 minutes
def test_cpu_run_passes_and_prints_one_table(cpu_doctor):
    done, report, out = cpu_doctor
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert report["exit_status"] == 0 and report["device"] == "cpu" and report["complete"] is True
    assert list(report["sections"]) == SECTION_NAMES
    expected = {n: "ok" for n in SECTION_NAMES} | {"ladder": "skipped"}  # opt-in: --full or --only ladder
    assert {n: s["status"] for n, s in report["sections"].items()} == expected
    table = done.stdout.strip()
    assert table.startswith("gpt2 doctor: cpu") and "exit 0: all checks passed" in table.splitlines()[0]
    assert "| section | check | result | status |" in table
    for name in SECTION_NAMES:  # every section's first row names it
        assert any(line.startswith(f"| {name} (") for line in table.splitlines()), name
    assert (out / "doctor.txt").read_text().strip() == table
    assert "USDT" not in done.stderr  # kineto's profiler lines are silenced
    assert (out / "work" / "check-fast.log").is_file()  # --out keeps the runs


@pytest.mark.slow  # the shared full CPU run: ~3 minutes
def test_correctness_and_resume_checks_ran_and_passed(cpu_doctor):
    _, report, _ = cpu_doctor
    sec = report["sections"]
    cmp = sec["correctness"]["data"]["comparison"]
    assert cmp["steps"] == list(range(1, 9)) and cmp["missing"] == []
    assert cmp["max_abs_diff"] <= cmp["tolerance"] and cmp["tolerance"] in (1e-4, 2e-2)
    val = sec["correctness"]["data"]["reference_val"]
    assert sorted(val) == ["0", "8"] and val["0"] - val["8"] > LEARNS_MARGIN  # the val loss fell
    ref, fast = sec["resume"]["data"]["reference"], sec["resume"]["data"]["fast"]
    assert ref["losses"]["bitwise"] and ref["states"]["identical"] == ref["states"]["tensors"] > 50
    assert ref["losses"]["steps"] == [5, 6, 7, 8]
    assert fast["losses"]["steps"] == [5, 6, 7, 8] and fast["losses"]["max_abs_diff"] <= fast["losses"]["tolerance"]
    rows = {r["check"]: r["status"] for r in sec["resume"]["rows"]}
    assert list(rows.values()) == ["ok", "ok"]


@pytest.mark.slow  # the shared full CPU run: ~3 minutes
def test_measured_numbers_are_positive_and_consistent(cpu_doctor):
    _, report, _ = cpu_doctor
    sec = report["sections"]
    training = sec["training"]["data"]
    assert training["tokens_per_s"] > 0 and 0 < training["mfu"] <= 1 and training["peak_flops"] > 0
    mb = training["micro_batch_size"]  # auto: the throughput model's divisor of the 8 sequences (machine-dependent)
    assert 8 % mb == 0 and training["accum_steps"] == 8 // mb
    ranks = sec["ranks"]["data"]
    assert ranks["world_size"] == 2 and ranks["network"]["backend"] == "gloo"
    assert ranks["network"]["busbw_bytes_per_s"] > 0 and ranks["speedup"] > 0
    cmp = ranks["comparison"]
    assert cmp["steps"] == list(range(1, 13)) and cmp["max_abs_diff"] <= cmp["tolerance"]  # 2 ranks = 1 rank


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_ladder_section_tables_every_rung_and_what_it_could_not_run(tmp_path, monkeypatch, dtype):
    """check_ladder's rows and data for the CPU's rungs, run_ladder's results stood in (its real runs: the bench
    ladder smoke): what ran with tokens/s, step-up and MFU, TF32 n/a on a CPU, and where --dtype auto picks fp32,
    the rungs from bf16 on in fp32 (without_bf16)."""
    from gpt2.core import precision
    from gpt2.doctor import check_ladder
    from gpt2.doctor.acceleration import LADDER, RungResult

    seen = {}

    def run_ladder(rungs, shape, batch, device, *, steps, warmup, peaks, skip, progress):
        seen["rungs"], seen["skip"] = [r.name for r in rungs], dict(skip)
        return [
            RungResult(r, note=skip[r.name])
            if r.name in skip
            else RungResult(r, ms_per_step=100.0 - i, tokens_per_s=2560.0 + 100 * i, mfu_own=0.1, own_peak_name="fp32",
                            first_loss=10.9)
            for i, r in enumerate(rungs)
        ]  # fmt: skip

    monkeypatch.setattr(check_ladder, "run_ladder", run_ladder)
    monkeypatch.setattr(check_ladder, "initial_peaks", lambda device: {"fp32": 1e11})
    ctx = Context(torch.device("cpu"), SCALES["cpu"], tmp_path, 2, 60, lambda _: None)
    monkeypatch.setattr(Context, "auto_precision", lambda self: precision.Precision(dtype, dtype))
    section = run_section("ladder", check_ladder.ladder, ctx)
    assert section.status == "ok" and seen["rungs"] == [r.name for r in LADDER]
    rows = {r.check.split(":")[0]: r for r in section.rows}
    assert rows["tf32"].status == "n/a" and "n/a on cpu" in rows["tf32"].result and "A100 49,000" in rows["tf32"].result
    assert rows["base"].status == "ok" and "2,560 tokens/s, MFU 10.0% (fp32), 100 ms/step" in rows["base"].result
    if dtype == "bfloat16":
        assert rows["bf16"].status == "ok" and "2,760 tokens/s (1.08x)" in rows["bf16"].result
        assert rows["compile"].check == "compile: + torch.compile"
    else:  # no bf16 rung to time: it says why, and the compiled rungs run in fp32
        assert rows["bf16"].status == "n/a" and "n/a: --dtype auto picks float32 here" in rows["bf16"].result
        assert rows["compile"].check == "compile: + torch.compile (fp32)" and "(1.12x)" in rows["compile"].result
    rungs = {r["rung"]["name"]: r for r in section.data["rungs"]}
    assert list(rungs) == ["base", "tf32", "bf16", "compile", "flash", "vocab"]
    assert [r["a100_tokens_per_s"] for r in rungs.values()] == [16_000, 49_000, 54_500, 126_000, 170_000, 175_000]


@pytest.mark.slow  # the shared full CPU run: ~3 minutes
def test_attention_section_names_the_kernel_the_profiler_saw(cpu_doctor):
    _, report, _ = cpu_doctor
    data = report["sections"]["attention"]["data"]
    assert data["dispatched"] and data["dispatched"][0] in ("flash (cpu)", "math")
    runs = {t["name"]: t for t in data["trials"]}
    assert runs["math"]["runs"] and runs["math"]["agrees"]
    assert not runs["memory-efficient"]["runs"] and runs["memory-efficient"]["reason"]  # CUDA only


def test_a_failed_check_exits_1_with_the_table_printed(tmp_path):
    """Training processes killed by --timeout-s: correctness and resume cannot pass; the table still prints."""
    skip = "environment,attention,training,ranks,ladder"
    done = doctor_on_cpu(tmp_path, "--skip", skip, "--timeout-s", "1")
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "exit 1: a CHECK FAILED" in lines[0]
    row = next(line for line in lines if "| reference run |" in line)
    assert row.endswith("| FAILED |") and "killed after 1 s (--timeout-s)" in row
    assert any(line.startswith("| resume (") and "needs the correctness section's run" in line for line in lines)
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert report["exit_status"] == 1
    assert {n: s["status"] for n, s in report["sections"].items()} == {
        "environment": "skipped",
        "attention": "skipped",
        "correctness": "FAILED",
        "resume": "FAILED",
        "training": "skipped",
        "ranks": "skipped",
        "ladder": "skipped",
    }


@pytest.mark.slow
def test_the_precision_check_fails_for_a_different_computation(tmp_path):
    """The reference's own settings with another seed (another init and data order) as the "fast" path:
    1e-2..0.2 nats away per step, far outside the fp32 tolerance."""
    from gpt2.doctor.train_runs import REFERENCE_FLAGS

    ctx = Context(
        torch.device("cpu"),
        SCALES["cpu"],
        tmp_path,
        2,
        600,
        lambda _: None,
        fast_flags=(*REFERENCE_FLAGS, "--seed", "1"),
    )
    section = run_section("correctness", correctness, ctx)
    rows = {r.check: r for r in section.rows}
    assert rows["training learns"].status == "ok"
    assert rows["fast = reference"].status == "FAILED" and "> tolerance 1e-04" in rows["fast = reference"].result
    assert section.status == "FAILED" and exit_status([section]) == 1
    assert "| fast = reference |" in format_table([section], "header")


def test_a_section_that_raises_is_failed_with_one_line_and_the_rest_run(tmp_path):
    ctx = Context(torch.device("cpu"), SCALES["cpu"], tmp_path, 2, 60, lambda _: None)

    def broken(_):
        raise RuntimeError("no working C++ compiler found\n  (a long explanation)")

    failed = run_section("ladder", broken, ctx)
    assert failed.status == "FAILED" and failed.error
    assert failed.reason == "RuntimeError: no working C++ compiler found"
    assert "Traceback" in failed.data["traceback"]
    fine = run_section("environment", environment, ctx)
    assert fine.status == "ok"
    assert exit_status([fine, failed]) == 3  # a section could not run; no check failed
    failed.name = "correctness"
    assert exit_status([fine, failed]) == 1  # a correctness section that cannot run has not passed
    table = format_table([fine, failed], "header")
    # the section's own time (whole seconds) depends on the machine's load: any count passes
    assert re.search(
        r"\| correctness \(\d+ s\) \| section \| RuntimeError: no working C\+\+ compiler found \| FAILED \|", table
    ), table


def test_every_section_runs_once_and_prints_in_the_documented_order():
    assert sorted(sections.RUN_ORDER) == sorted(SECTION_NAMES)
    assert [name for name, _ in sections.SECTIONS] == SECTION_NAMES
    # the in-process GPU work after every training process (RUN_ORDER's docstring says why)
    assert sections.RUN_ORDER[-2:] == ("attention", "ladder")


def test_exit_status_counts_failed_checks_not_warnings():
    ok = Section("training")
    ok.note("peak memory", "n/a on cpu", "n/a")
    warn = Section("attention")
    warn.note("fused kernel", "math path", "WARN")
    assert exit_status([ok, warn]) == 0
    bad = Section("ranks")
    assert not bad.check("2 ranks = 1 rank", False, "differs")
    assert bad.status == "FAILED" and bad.reason == "2 ranks = 1 rank: differs" and exit_status([ok, bad]) == 1


def test_bad_arguments_exit_2(capsys):
    assert cli.main(["--skip", "laddr"]) == 2
    assert "--skip laddr: no such section" in capsys.readouterr().err
    assert cli.main(["--only", "training,rank"]) == 2
    assert "--only rank: no such section" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert cli.main(["--device", "cuda"]) == 2


@pytest.mark.parametrize(
    "text, version",
    [
        (
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 18:56:32 UTC 2023\n"
            "GCC version:  gcc version 12.2.0",
            "535.129.03",
        ),
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build  (dvs-builder@U16)\n",
            "550.54.15",
        ),
        ("550.54.15\n550.54.15\n", "550.54.15"),  # nvidia-smi --query-gpu=driver_version, one line per GPU
        ("", None),
    ],
)
def test_driver_version_is_read_from_the_kernel_module_or_nvidia_smi(text, version):
    assert parse_driver_version(text) == version


def sections_left_out(*argv: str) -> dict[str, str]:
    return cli.resolve_args(cli.build_parser().parse_args(["--device", "cpu", *argv]))[1]


def test_the_default_run_leaves_out_the_ladder_and_only_and_skip_choose_sections():
    """Sized for a lease: the ladder (6 compiled GPT-2 124M models) is opt-in; --only runs what it
    names (resume with the correctness runs it continues), --skip leaves out what it names."""
    assert sections_left_out() == {"ladder": "opt-in: --full or --only ladder"}
    assert sections_left_out("--full") == {}
    assert sections_left_out("--only", "ladder") == {n: "not in --only" for n in SECTION_NAMES if n != "ladder"}
    assert set(SECTION_NAMES) - set(sections_left_out("--only", "resume")) == {"correctness", "resume"}
    assert sections_left_out("--skip", "ranks,attention") == {
        "ladder": "opt-in: --full or --only ladder",
        "ranks": "--skip",
        "attention": "--skip",
    }


def test_the_json_is_rewritten_after_every_section(tmp_path, monkeypatch):
    """A run stopped by a time limit leaves the sections it finished: the second section reads the file
    the first one left, marked incomplete; the end marks it complete."""
    seen = {}

    def first(ctx):
        s = Section("environment")
        s.info("devices", "cpu: a test")
        return s

    def second(ctx):
        seen["json"] = json.loads((tmp_path / "doctor.json").read_text())
        seen["txt"] = (tmp_path / "doctor.txt").read_text()
        return Section("training")

    monkeypatch.setattr(sections, "SECTIONS", (("environment", first), ("training", second)))
    monkeypatch.setattr(sections, "RUN_ORDER", ("environment", "training"))
    assert cli.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    assert seen["json"]["complete"] is False and list(seen["json"]["sections"]) == ["environment"]
    assert "INCOMPLETE: still running" in seen["txt"].splitlines()[0] and "| environment (" in seen["txt"]
    final = json.loads((tmp_path / "doctor.json").read_text())
    assert final["complete"] is True and list(final["sections"]) == ["environment", "training"]


@pytest.mark.soak  # the opt-in ladder's 6 real rungs (3 compiled): ~50 s alone, 100-150 s under load; by hand
def test_the_full_cpu_run_times_every_rung_of_the_ladder(tmp_path):
    done = doctor_on_cpu(tmp_path, "--only", "ladder")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rungs = {
        r["rung"]["name"]: r
        for r in json.loads((tmp_path / "doctor.json").read_text())["sections"]["ladder"]["data"]["rungs"]
    }
    assert list(rungs) == ["base", "tf32", "bf16", "compile", "flash", "vocab"]
    assert rungs["tf32"]["tokens_per_s"] is None and rungs["tf32"]["note"].startswith("n/a on cpu")
    ran = [r for r in rungs.values() if r["tokens_per_s"] is not None]
    assert len(ran) >= 4 and all(r["tokens_per_s"] > 0 and 10.5 < r["first_loss"] < 11.2 for r in ran)
