"""The GPU session's code on a CPU: vs_nanogpt's micro-batch layout (its commands, log parsing and report),
bench/resume_check.py (a real kill -9 and resume at a tiny shape), checkpoint_stall's --device, and
bench/gpu_session.py's plan and its runner (a failing or overrunning step never loses the others).

Nothing here needs a GPU: what runs on one is built by the same functions tested here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from gpt2.plan.flops import flops_per_token
from gpt2.train.cli import parse_config

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import gpu_session  # noqa: E402
import nanogpt  # noqa: E402
import resume_check  # noqa: E402
import vs_nanogpt as vs  # noqa: E402

sys.path.remove(str(REPO / "bench"))


def test_nanogpt_rows_are_its_own_train_py_at_the_gpt2_shape_bf16_compiled_one_micro_step():
    flags = vs.nano_batch_flags(vs.SHAPES["gpt2"], 16, device="cuda", dataset="bench-1", steps=30)
    assert {k: flags[k] for k in ("device", "dtype", "compile", "batch_size", "block_size",
                                  "gradient_accumulation_steps", "n_layer", "n_head", "n_embd", "dataset",
                                  "max_iters", "dropout", "bias")} == dict(
        device="cuda", dtype="bfloat16", compile=True, batch_size=16, block_size=1024, gradient_accumulation_steps=1,
        n_layer=12, n_head=12, n_embd=768, dataset="bench-1", max_iters=29, dropout=0.0, bias=True)
    assert vs.nano_batch_flags(vs.SHAPES["tiny"], 2, device="cpu", dataset="d", steps=2)["dtype"] == "float32"


def test_our_rows_are_the_gpt2_preset_at_a_fixed_micro_batch_or_at_its_defaults(tmp_path):
    shape = vs.SHAPES["gpt2"]
    fixed = parse_config(vs.ours_batch_flags(shape, 12, device="cuda", data=tmp_path, out=tmp_path, steps=30))
    assert (fixed.model.n_layer, fixed.model.n_embd, fixed.model.block_size, fixed.model.vocab_size) == (12, 768, 1024, 50304)
    t = fixed.train
    assert (t.micro_batch_size, t.total_batch_size, t.compile, t.device, t.dtype, t.max_steps) == (
        12, 12 * 1024, True, "cuda", "auto", 30)  # one micro-step per step, as nanoGPT's rows; dtype auto: bf16 there
    assert (t.eval_interval, t.sample_interval, t.ckpt_interval, t.log_interval) == (0, 0, 0, 1)
    default = parse_config(vs.ours_batch_flags(shape, None, device="cuda", data=tmp_path, out=tmp_path, steps=30)).train
    assert (default.micro_batch_size, default.total_batch_size, default.compile) == ("auto", 524_288, True)


def test_nanogpt_log_parsing_takes_iteration_times_losses_and_the_wrappers_peak_memory():
    out = ("tokens per iteration will be: 12,288\ncompiling the model... (takes a ~minute)\n"
           "step 0: train loss 10.9, val loss 10.9\niter 0: loss 10.9531, time 41234.12ms, mfu -100.00%\n"
           "iter 1: loss 10.2, time 25.50ms, mfu -100.00%\npeak_memory_mib 20345.6 cuda_max_memory_allocated\n")
    run = nanogpt.parse_log(out, Path("o"))
    assert run.step_s == pytest.approx([41.23412, 0.0255]) and run.losses == [10.9531, 10.2]
    assert (run.peak_mib, run.peak_source) == (20345.6, "cuda_max_memory_allocated")
    assert nanogpt.parse_log("iter 0: loss 1.0, time 5.00ms\n", Path("o")).peak_mib is None
    with pytest.raises(nanogpt.NanoGPTError, match="printed no 'iter N"):
        nanogpt.parse_log("Traceback ...\n", Path("o"))
    assert "cuda_max_memory_allocated" in nanogpt.MEASURE_MEMORY and "runpy.run_path('train.py'" in nanogpt.MEASURE_MEMORY


def row(who, mb, step_s, tokens, **kw):
    r = vs.Row("gpt2", "by-batch", who, micro_batch=mb, tokens=tokens, dtype="bfloat16", **kw)
    r.times = [step_s]
    return r


def test_the_micro_batch_report_judges_both_goals_against_the_data_sheet_peak():
    per_token = flops_per_token(parse_config(["--preset", "gpt2", "--data-dir", "d", "--out-dir", "o"]).model)
    default_s = 524_288 * per_token / (0.46 * 989e12)  # 46% MFU on an H100
    rows = [row("nanoGPT", 12, 0.100, 12_288, peak_mib=20_000.0), row("ours", 12, 0.090, 12_288, peak_mib=18_000.0),
            row("nanoGPT", 16, 0.120, 16_384), row("ours", 16, 0.125, 16_384),
            row("ours", None, default_s, 524_288, note="micro-batch auto: 32 sequences", resolved_batch="32 x 16")]
    failed = vs.Row("gpt2", "by-batch", "nanoGPT", micro_batch=24, error="CUDA out of memory")
    h100 = vs.Device("cuda", "NVIDIA H100 80GB HBM3")
    text = "\n".join(vs.by_batch_report(rows + [failed], vs.SHAPES["gpt2"], h100, {"bfloat16": 989e12}))
    assert "| ours B=12 |  | bf16 | 0.0900 | 136,533 | 1.11x | " in text
    assert "| nanoGPT B=12 |  | bf16 | 0.1000 | 122,880 | 1.00x | " in text and "| 20,000 |" in text
    assert "- ours B=12 against nanoGPT B=12: **1.11x** tokens/s (goal >= 1.00x): met" in text
    assert "- ours B=16 against nanoGPT B=16: **0.96x** tokens/s (goal >= 1.00x): NOT met" in text
    assert "- MFU of ours at defaults: **46.0%** (goal >= 45% on an H100): met" in text
    assert "| ours defaults | 32 x 16 | bf16 |" in text and "its start-up said: micro-batch auto: 32" in text
    assert "| nanoGPT B=24 | - |" in text and "CUDA out of memory" in text
    a100 = "\n".join(vs.by_batch_report(rows, vs.SHAPES["gpt2"], vs.Device("cuda", "NVIDIA A100-SXM4-80GB"),
                                         {"bfloat16": 312e12}))
    assert "not judged: this is NVIDIA A100-SXM4-80GB" in a100
    unknown = "\n".join(vs.by_batch_report(rows, vs.SHAPES["gpt2"], vs.Device("cuda", "NVIDIA Future"),
                                           {"bfloat16": None}))
    assert "MFU of ours at defaults: n/a" in unknown and "bf16 not in gpt2/plan/flops.py's table" in unknown
    assert vs.row_peak(h100, "bfloat16") == 989e12  # gpt2/plan/flops.py's table, by the device's name
    data = json.loads(vs.rows_json(rows, h100, {"bfloat16": 989e12}, {"steps": 20}))
    assert data["rows"][1]["tokens_per_s"] == pytest.approx(12_288 / 0.09) and data["device"] == h100.name


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda", "--micro-batches", "12", "--shapes", "gpt2,tiny"], "compares one shape at a time"),
    (["--shapes", "gpt2"], "shape gpt2 is compared by micro-batch only"),
    (["--shapes", "tiny", "--micro-batches", "0"], "must be positive integers"),
    (["--shapes", "tiny", "--micro-batches", "2", "--profile"], "--profile profiles the eager/compiled layout"),
    (["--shapes", "tiny", "--micro-batches", "2", "--data-dir", "/nonexistent"], "holds no *train*.bin shards"),
])
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


def check(a, c, b=None, **kw):
    ch = resume_check.Check(2, 4, a=dict(enumerate(a, 1)), c=dict(enumerate(c, 1)),
                            b=dict(enumerate(b, 1)) if b else {}, killed_at=3, resumed_step=2, **kw)
    return resume_check.verdict(ch, 1e-6)


def test_the_resume_verdict_takes_the_noise_floor_of_two_uninterrupted_runs():
    passed, lines = check([5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.0, 2.0])
    assert passed and "bit for bit" in lines[1] and "noise floor: not measured" in lines[2]
    passed, lines = check([5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.001, 2.0], b=[5.0, 4.0, 3.0006, 2.0])
    assert passed and "= 0.0012" in lines[3]  # 1e-3 <= 2 x 6e-4
    passed, lines = check([5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.001, 2.0], b=[5.0, 4.0, 3.0004, 2.0])
    assert not passed and "= 0.0008" in lines[3]  # 1e-3 > 2 x 4e-4
    passed, lines = check([5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.1, 2.0], b=[5.0, 4.0, 3.0004, 2.0])
    assert not passed and "**0.1**" in lines[1] and lines[-1].endswith("**FAIL**")
    passed, lines = check([5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.0, 2.0], problems=["did not resume"])
    assert not passed and "- problem: did not resume" in lines
    passed, lines = check([5.0, 4.0, 3.0, 2.0], [5.0, 4.0])  # C never got past the checkpoint
    assert not passed and "no losses of steps 3..4" in lines[1]


def test_resume_check_kills_a_real_run_after_its_checkpoint_and_compares_the_resumed_losses(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    from gpt2.data.shards import write_shard

    rng = np.random.default_rng(0)
    write_shard(data / "t_train_000000.bin", rng.integers(0, 50257, 20_000).astype(np.uint16))
    write_shard(data / "t_val_000000.bin", rng.integers(0, 50257, 2_000).astype(np.uint16))
    out = tmp_path / "rc.json"
    done = subprocess.run([sys.executable, "bench/resume_check.py", "--device", "cpu", "--shape", "tiny",
                           "--steps", "6", "--ckpt-step", "2", "--no-repeat", "--data-dir", str(data),
                           "--work", str(tmp_path / "work"), "--json", str(out), "--", "--dtype", "float32"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["passed"] and result["resumed_step"] == 2 and result["killed_at"] >= 2
    assert sorted(map(int, result["C"])) == [1, 2, 3, 4, 5, 6] and result["A"] == result["C"]  # fp32 CPU: exact
    assert "exact resume after kill -9: **PASS**" in done.stdout
    assert (tmp_path / "work" / "C-killed.log").is_file() and (tmp_path / "work" / "C-resumed.log").is_file()


def test_checkpoint_stall_says_in_one_line_when_cuda_is_asked_for_and_absent():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    done = subprocess.run([sys.executable, "bench/checkpoint_stall.py", "--device", "cuda"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr == "checkpoint_stall.py: error: --device cuda: no CUDA device here\n"


def test_each_gpu_part_fits_one_device_call_and_runs_what_the_issue_asks(tmp_path):
    for part in ("part1", "part2"):
        steps = gpu_session.steps_for(part, tmp_path)
        assert sum(s.limit_s for s in steps) <= gpu_session.DEFAULT_BUDGET_S < 600
    part1 = {s.name: " ".join(s.cmd) for s in gpu_session.steps_for("part1", tmp_path)}
    assert list(part1) == ["env", "doctor", "gpu-tests", "suite"]
    assert part1["doctor"].endswith(f"-m gpt2.doctor --out {tmp_path / 'doctor'}")
    assert " -m gpu " in part1["gpu-tests"] and "tests/test_ckpt_writer.py" in part1["gpu-tests"]
    assert all(f in part1["suite"] for f in gpu_session.SUITE)
    part2 = {s.name: " ".join(s.cmd) for s in gpu_session.steps_for("part2", tmp_path)}
    assert list(part2) == ["env", "bench", "stall", "resume"]
    assert ("bench/vs_nanogpt.py --device cuda --micro-batches 12,16 --steps 20 --warmup 10 --rounds 1"
            in part2["bench"]) and f"--data-dir {gpu_session.GPU_DIR / 'data'}" in part2["bench"]
    assert "bench/checkpoint_stall.py --device cuda --preset gpt2" in part2["stall"]
    assert "bench/resume_check.py --device cuda --shape gpt2" in part2["resume"]
    dry = subprocess.run([sys.executable, "bench/gpu_session.py", "part2", "--dry-run"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    total = re.fullmatch(r"total limit (\d+) s of a 560 s budget", dry.stdout.splitlines()[-1])
    assert dry.returncode == 0 and total and int(total[1]) <= 560


def test_the_session_runner_records_a_failure_and_a_timeout_and_runs_every_step(tmp_path):
    py = sys.executable
    work = tmp_path / "part"
    work.mkdir()
    steps = [gpu_session.Step("good", [py, "-c", f"open({str(work / 'r.md')!r}, 'w').write('| table |'); print('fine')"],
                              60, report="r.md"),
             gpu_session.Step("bad", [py, "-c", "import sys; print('broken'); sys.exit(3)"], 60),
             gpu_session.Step("slow", [py, "-c", "import time; print('started', flush=True); time.sleep(60)"], 2),
             gpu_session.Step("absent", [py, "-m", "nowhere"], 60, needs="not in this checkout"),
             gpu_session.Step("after", [py, "-c", "print('still ran')"], 60)]
    results = gpu_session.run_steps(steps, work, budget_s=300)
    assert [(r.name, r.status, r.rc) for r in results] == [
        ("good", "ok", 0), ("bad", "failed", 3), ("slow", "timeout", results[2].rc), ("absent", "skipped", None),
        ("after", "ok", 0)]
    assert results[2].seconds < 30 and "started" in results[2].tail and "still ran" in results[4].tail
    out = tmp_path / "out"
    gpu_session.write_outputs("part9", results, work, out, "now")
    assert sorted(p.name for p in out.iterdir()) == ["part9-logs.tar.gz", "part9.json", "part9.md"]
    md = (out / "part9.md").read_text()
    assert "| bad | failed | 3 |" in md and "| slow | timeout |" in md and "not in this checkout" in md
    assert "| table |" in md  # the step's report, in PART.md
    with tarfile.open(out / "part9-logs.tar.gz") as tar:
        assert {"part/logs/good.log", "part/logs/bad.log", "part/logs/after.log"} <= set(tar.getnames())
    skipped = gpu_session.run_steps(steps[:1], work, budget_s=10)  # under 20 s left: nothing starts
    assert skipped[0].status == "skipped" and "no time left" in skipped[0].tail
    # an elastic step gets what the steps before it left unused, the others keep their limits
    quick = gpu_session.Step("quick", [py, "-c", "pass"], 100)
    sleepy = gpu_session.Step("sleepy", [py, "-c", "import time; time.sleep(25)"], 22, elastic=True)
    timed = gpu_session.run_steps([quick, sleepy], work, budget_s=130)
    assert [r.status for r in timed] == ["ok", "ok"] and timed[1].limit_s > 100


@pytest.mark.slow
def test_part2_runs_end_to_end_on_a_cpu_at_tiny_shapes(tmp_path):
    """gpu_session.py part2 --cpu-smoke: vs_nanogpt's micro-batch layout (nanoGPT too, where a source is
    reachable), the stall and the resume check, through the same runner; ~5 min on 2 busy cores."""
    mirror = Path("/work/.mirror/karpathy+nanoGPT/repo")
    prep = [sys.executable, "bench/gpu_session.py", "prepare", "--no-pylib"] + (
        ["--nanogpt", str(mirror)] if mirror.is_dir() else [])
    prepared = subprocess.run(prep, cwd=REPO, capture_output=True, text=True, timeout=600)
    if prepared.returncode:
        pytest.skip(f"no nanoGPT source to prepare .gpu/ from: {prepared.stderr[-300:]}")
    done = subprocess.run([sys.executable, "bench/gpu_session.py", "part2", "--cpu-smoke", "--budget-s", "1500",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = {s["name"]: s for s in json.loads((tmp_path / "part2-cpu-smoke.json").read_text())["steps"]}
    assert {n: s["status"] for n, s in steps.items()} == dict(env="ok", bench="ok", stall="ok", resume="ok")
    assert "| nanoGPT B=2 | 2 x 1 | fp32 |" in steps["bench"]["report"]
    assert "exact resume after kill -9: **PASS**" in steps["resume"]["report"]
