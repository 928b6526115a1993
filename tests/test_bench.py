"""The benchmark scripts run and print their tables: a benchmark that crashes reports nothing.

Tiny settings: these check that the scripts work against the current code, not the numbers.
"""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def bench_process(*args: str, timeout: int) -> subprocess.CompletedProcess:
    """`python ARGS...` in the repository, its output captured: for a test that reads the exit status itself."""
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def run_bench(*args: str, timeout: int) -> str:
    done = bench_process(*args, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "USDT" not in done.stderr, done.stderr[-3000:]  # kineto's profiler_start/stop lines (gpt2.plan)
    return done.stdout


def test_prep_throughput_prints_its_table_with_identical_bytes():
    out = run_bench("bench/prep_throughput.py", "--mb", "1", "--rounds", "2", timeout=300)
    row = next(line for line in out.splitlines() if line.startswith("| 1 MB"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-1] == "yes"  # -w1 and -w2 wrote the same bytes
    assert re.fullmatch(r"[\d.]+x \([\d.]+, [\d.]+\)", cells[6]), cells[6]  # ratio and both rounds
    assert int(cells[1].replace(",", "")) > 100_000


def test_loss_bench_times_chunked_and_plain_eager_and_compiled():
    # aot_eager compiles without a C++ toolchain run: seconds, and the compiled rows still go through dynamo
    out = run_bench(
        "bench/lm_head_loss.py",
        "--device",
        "cpu",
        "--batch",
        "1",
        "--seq-len",
        "64",
        "--n-embd",
        "32",
        "--vocab-size",
        "512",
        "--rounds",
        "2",
        "--steps",
        "1",
        "--threads",
        "1",
        "--backend",
        "aot_eager",
        "--also-chunk-logits",
        "4096",
        timeout=300,
    )
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| row")]
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    assert [c[0] for c in cells] == [
        "chunked eager",
        "chunked compiled",
        "plain eager",
        "plain compiled",
        "chunked compiled, 4,096 logits/chunk",
    ]
    assert cells[3][2] == "1.00x"  # the reference
    assert [c[4] for c in cells] == ["1", "1", "-", "-", "8"]  # 64 rows: 2**23 logits on a CPU; 4096 // 512 = 8
    losses = [float(c[5]) for c in cells]
    assert max(losses) - min(losses) < 1e-4  # the same maths on every row


@pytest.mark.slow
def test_ladder_runs_the_trainers_step_and_the_models_attention_kernels(tmp_path):
    out = run_bench(
        "bench/ladder.py",
        "--device",
        "cpu",
        "--rungs",
        "base,tf32,bf16,compile",
        "--n-layer",
        "1",
        "--n-head",
        "2",
        "--n-embd",
        "64",
        "--block-size",
        "64",
        "--micro-batch-size",
        "2",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--threads",
        "1",
        "--out",
        str(tmp_path / "ladder.png"),
        timeout=300,
    )
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")]
    rungs = {r[0]: r for r in rows if r[0] in ("base", "tf32", "bf16", "compile")}
    assert rungs["tf32"][2] == "n/a (CUDA only)"
    losses = [float(rungs[name][9]) for name in ("base", "bf16", "compile")]  # the doctor's ladder's own rungs
    assert all(10.5 < x < 11.2 for x in losses) and max(losses) - min(losses) < 1e-2  # ~ln(50257), same batch
    kernels = [r for r in rows if r[0] in ("explicit mask", "SDPA attn_mask", "SDPA is_causal")]
    assert [(r[0], r[1]) for r in kernels] == [
        (k, d) for d in ("float32", "bfloat16") for k in ("explicit mask", "SDPA attn_mask", "SDPA is_causal")
    ]
    assert all(r[5] == "yes" for r in kernels)  # the model's three attn_impls agree
    assert (tmp_path / "ladder.png").stat().st_size > 0


@pytest.mark.soak  # ~5 minutes of compiling on 2 cores, by hand: over CI's budget
def test_train_throughput_runs_every_row_and_states_the_goals(tmp_path):
    md = tmp_path / "report.md"
    out = run_bench(
        "bench/train_throughput.py",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--ddp-rounds",
        "1",
        "--order-model",
        "small",
        "--md",
        str(md),
        timeout=1500,
    )
    main, orders = out.split("DDP and torch.compile orders")
    rows = [line for line in main.splitlines() if line.startswith("| ") and "configuration" not in line]
    names = [r.split("|")[1].strip() for r in rows]
    order_rows = [r.strip("|").split("|") for r in orders.splitlines() if r.startswith("| ") and "order" not in r]
    assert [r[0].strip() for r in order_rows] == [
        "compile, then DDP (the trainer)",
        "DDP, then compile",
        "each block compiled, then DDP",
        "eager DDP",
    ]
    order_losses = [float(r[4]) for r in order_rows]
    assert order_rows[0][3].strip() == "1.00x" and max(order_losses) - min(order_losses) < 1e-3  # the same maths
    # The bench's own low-precision dtype (bf16 where its measured peaks say bf16 is fast on this CPU, else
    # fp32 and no bf16 rows): read from its table, as a second measurement here could disagree on a loaded machine.
    low = names[3].split(" compiled")[0] if len(names) > 3 else None
    assert low in ("bf16", "fp32"), names
    assert names == [
        "fp32 eager",
        "fp32 compiled",
        "fp32 compiled, --loss-impl full",
        f"{low} compiled, plain loss + for-loop AdamW",
        f"{low} compiled, chunked loss + for-loop AdamW",
        *([f"{low} compiled"] if low != "fp32" else []),
        f"{low} compiled, --optimizer muon",
        f"train_ddp.py, {low} compiled",
        f"torchrun train_ddp.py, {low} compiled",
        f"torchrun train_ddp.py, {low} compiled, --optimizer muon",
    ]
    losses = {float(r.strip("|").split("|")[-1]) for r in rows}
    assert all(10.5 < x < 11.2 for x in losses)  # random tokens: ~ln(50257) at step 1
    assert re.search(rf"- {low} compiled: MFU [\d.]+% \(goal >= 60%\)", out)
    assert re.search(r"- DDP efficiency 2 x 1 / 1 x 2: [\d.]+% \(goal >= 90%\)", out)
    assert re.search(
        rf"- --optimizer muon: [+-][\d.]+% step time against AdamW's {low} compiled row \(goal < 10%\)", out
    )
    assert re.search(r"- --optimizer muon under torchrun \(2 x 1, .*\): [+-][\d.]+% step time against AdamW's", out)
    assert re.search(r"- fp32 compiled step time, chunked loss / full logits: [\d.]+x", out)
    assert md.read_text().strip() == out.strip()


@pytest.mark.slow  # ~21 s
def test_optimizers_bench_prints_the_table_and_the_steps_ratio_and_reuses_finished_runs(tmp_path):
    results = tmp_path / "runs.json"
    args = [
        "bench/optimizers.py",
        "--shapes",
        "small",
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--adamw-lrs",
        "1e-3,2e-3",
        "--muon-lrs",
        "0.02",
        "--eval-tokens",
        "2048",
        "--results",
        str(results),
        "--extend",
        "0",
    ]
    out = run_bench(*args, timeout=600)
    assert "| step | AdamW lr 0.001 | AdamW lr 0.002 | Muon 0.02 (AdamW part 0.002) |" in out
    rows = [line for line in out.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [r.split("|")[1].strip() for r in rows] == ["0", "2", "4"]
    assert re.search(r"- steps for Muon to reach AdamW's final val loss: (\d+ of 4 = \*\*[\d.]+x\*\*|not reached)", out)
    assert re.search(
        r"- best Muon: muon-lr 0.02, final val [\d.]+; [\d.]+ s/step \([+-][\d.]+%; runs at different", out
    )
    import json

    assert len(json.loads(results.read_text())) == 3
    again = run_bench(*args, timeout=120)  # every run is in the results file: nothing is trained again
    assert again == out.replace(out.splitlines()[0], again.splitlines()[0])


def test_optimizer_sweeps_go_past_an_edge_while_the_best_lr_is_there():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from optimizers import sweep
    finally:
        sys.path.remove(str(REPO / "bench"))

    def bowl(best):  # a run whose final val loss is lowest at lr == best
        def run(lr):
            tried.append(lr)
            return {"steps": 1, "val": {"1": abs(math.log2(lr / best))}}

        return run

    tried = []
    assert sweep([1e-3, 2e-3, 4e-3], bowl(2e-3), extend=2) == 2e-3 and tried == [1e-3, 2e-3, 4e-3]
    tried = []
    assert sweep([1e-3, 2e-3, 4e-3], bowl(8e-3), extend=2) == 8e-3 and tried == [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2]
    tried = []
    assert sweep([1e-3, 2e-3], bowl(1e-4), extend=2) == 2.5e-4 and tried == [1e-3, 2e-3, 5e-4, 2.5e-4]
    tried = []
    assert sweep([1e-3, 2e-3], bowl(1e-4), extend=0) == 1e-3 and tried == [1e-3, 2e-3]


def test_checkpoint_stall_bench_times_a_sync_and_a_background_save():
    out = run_bench("bench/checkpoint_stall.py", "--preset", "debug", "--reps", "1", "--tokens", "64", timeout=300)
    assert re.search(r"checkpoint of the debug preset: [\d.]+ GB on disk", out)
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| round")]
    assert [r.split("|")[1].strip() for r in rows] == ["warm-up (allocates the copy buffers)", "1", "median"]
    for row in rows:
        sync, stall, ratio, copy, write, fwd_bwd = (c.strip() for c in row.strip("|").split("|")[1:])
        assert all(float(x) >= 0 for x in (sync, stall, copy, write, fwd_bwd)) and ratio.endswith("x")
        assert float(sync) > 0 and float(write) > 0


@pytest.mark.parametrize("script", ["bench/optimizers.py", "bench/data_order.py", "bench/prep_throughput.py"])
def test_a_bench_without_its_corpus_says_so_in_one_line_and_exits_2(tmp_path, script):
    missing = tmp_path / "no" / "tinyshakespeare.txt"
    done = subprocess.run(
        [sys.executable, script, "--corpus", str(missing)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    name = Path(script).name
    assert done.stderr.splitlines() == [
        f"{name}: error: corpus {missing} not found: pass --corpus PATH (any "
        "UTF-8 .txt file; docs/data.md says where to get tinyshakespeare)"
    ]
    assert done.stdout == ""
    help_text = subprocess.run(
        [sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    ).stdout
    assert "--corpus" in help_text and "tinyshakespeare.txt" in help_text  # the default is the shared file


def test_a_corpus_data_prep_refuses_is_one_line_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\n\n\xff\xfe not UTF-8\n")
    done = subprocess.run(
        [sys.executable, "bench/data_order.py", "--corpus", str(bad)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith(f"data_order.py: error: data_prep failed on {bad}: ") and "not valid UTF-8" in line


def test_ladder_chart_defaults_under_runs_not_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # wherever it is started from
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import ladder

    out = ladder.build_parser().parse_args([]).out
    assert out == REPO / "runs" / "bench" / "ladder.png" and out.is_absolute()
    assert "/runs/" in (REPO / ".gitignore").read_text().splitlines()  # never committed by accident
    assert ladder.build_parser().parse_args(["--out", "x/l.png"]).out == Path("x/l.png")


def nanogpt_module():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import nanogpt
    finally:
        sys.path.remove(str(REPO / "bench"))
    return nanogpt


NANOGPT_SOURCE, NO_NANOGPT = nanogpt_module().reachable_source()
"""Where the nanoGPT rows take the pinned commit from: $NANOGPT_DIR, the benchmarks' cache, or GitHub."""

needs_nanogpt = pytest.mark.skipif(
    NANOGPT_SOURCE is None, reason=f"{NO_NANOGPT} (the rows of ours are tested without it)"
)


def table_rows(out: str, first_cell: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in out.splitlines()
        if line.startswith("| ") and not line.startswith(f"| {first_cell} ")
    ]


@pytest.mark.slow
def test_vs_nanogpt_times_ours_at_defaults_and_fp32_without_nanogpt():
    out = run_bench(
        "bench/vs_nanogpt.py",
        "--nanogpt",
        "none",
        "--shapes",
        "tiny",
        "--modes",
        "eager",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--rounds",
        "1",
        timeout=600,
    )
    rows = table_rows(out, "row")
    assert [r[0] for r in rows] == ["ours eager", "ours fp32 eager"]
    assert rows[1][1] == "fp32" and rows[0][1] in ("fp32", "bf16")  # whatever --dtype auto picked here
    assert all(float(r[2]) > 0 and r[4] == "-" and r[6].endswith("%") for r in rows)
    assert re.search(r"- ours eager: its start-up said: precision  \w+: .* / loss       ", out)  # auto's own lines
    assert "- ours at defaults here is `compiled`" in out  # no preset: the trainer compiles by default
    assert "nanoGPT not run (--nanogpt none)" in out


@needs_nanogpt
def test_vs_nanogpt_runs_nanogpt_itself_beside_ours_on_the_same_shape():
    out = run_bench(
        "bench/vs_nanogpt.py",
        "--nanogpt",
        NANOGPT_SOURCE,
        "--shapes",
        "tiny",
        "--modes",
        "eager",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--rounds",
        "1",
        timeout=900,
    )
    rows = table_rows(out, "row")
    assert [r[0] for r in rows] == ["nanoGPT eager", "ours eager", "ours fp32 eager"]
    assert rows[0][1] == "fp32" and rows[0][4] == "1.00x"
    assert all(re.fullmatch(r"[\d.]+x", r[4]) for r in rows)
    # the tiny shape compiles by default: an eager-only run has no "at defaults" row, so it claims no goal
    assert "- ours at defaults here is `compiled`" in out and "against nanoGPT's best" not in out


def test_nanogpt_is_pinned_and_an_unreachable_source_is_one_clear_error(tmp_path):
    nanogpt = nanogpt_module()
    with pytest.raises(nanogpt.NanoGPTError, match=f"is not the pinned {nanogpt.PINNED}"):
        nanogpt.checkout(str(tmp_path / "anywhere"), "0" * 40, cache=tmp_path)
    with pytest.raises(nanogpt.NanoGPTError, match="cannot clone nanoGPT from .*--nanogpt none"):
        nanogpt.checkout(str(tmp_path / "nowhere"), cache=tmp_path)
    done = subprocess.run(
        [sys.executable, "bench/vs_nanogpt.py", "--nanogpt-commit", "1" * 40],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.startswith("vs_nanogpt.py: error: --nanogpt-commit 1111")


def test_time_to_loss_reports_steps_and_time_to_the_target_without_nanogpt():
    out = run_bench(
        "bench/time_to_loss.py",
        "--nanogpt",
        "none",
        "--target",
        "10.9",
        "--steps",
        "2",
        "--eval-every",
        "1",
        "--val-tokens",
        "256",
        "--seeds",
        "2",
        "--rows",
        "adamw,muon,preset",
        timeout=600,
    )
    rows = table_rows(out, "run")
    assert [r[0] for r in rows] == [
        "ours AdamW (nanoGPT's recipe)",
        "ours Muon at its defaults",
        *[f"--preset speed (+ warmup 20 -> 5 steps), seed {s}" for s in (1337, 1338)],
    ]
    for r in rows:  # ln(50257) = 10.82 at step 0 < 10.9: every run is at the target after its first step
        assert r[1] == "1" and float(r[3]) > 0 and r[4] == "-" and float(r[5]) < 10.9
    assert "target: val 10.9000 (--target)" in out


@needs_nanogpt
def test_time_to_loss_takes_nanogpts_val_loss_as_the_target_by_the_same_estimator():
    out = run_bench(
        "bench/time_to_loss.py",
        "--nanogpt",
        NANOGPT_SOURCE,
        "--steps",
        "2",
        "--eval-every",
        "1",
        "--val-tokens",
        "256",
        "--rows",
        "muon",
        timeout=900,
    )
    target = float(re.search(r"target: val ([\d.]+) \(nanoGPT's at step 2\)", out)[1])
    assert 9.5 < target < 11.0  # two steps from ~ln(50257)
    rows = table_rows(out, "run")
    assert [r[0] for r in rows] == ["nanoGPT train.py (2 runs, before and after ours)", "ours Muon at its defaults"]
    assert rows[0][1] == "2" and rows[0][4] == "1.00x" and float(rows[0][5]) == pytest.approx(target, abs=1e-4)
    assert re.fullmatch(r"[\d.]+x|-", rows[1][4])


def test_the_speed_preset_is_the_last_row_of_the_time_to_loss_ablation():
    """The preset is what the ablation measured: Muon on the recipe plus every change, nothing else."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import time_to_loss as ttl
    finally:
        sys.path.remove(str(REPO / "bench"))
    from gpt2.train.cli import parse_config

    common = ["--data-dir", "d", "--out-dir", "o"]
    last = parse_config(ttl.ablation_rows()[-1][1] + common)
    preset = parse_config(["--preset", ttl.PRESET] + common)
    learning = (
        "optimizer",
        "lr",
        "min_lr",
        "warmup_steps",
        "max_steps",
        "decay_steps",
        "micro_batch_size",
        "total_batch_size",
        "muon_lr",
        "muon_momentum",
        "beta1",
        "beta2",
        "weight_decay",
        "grad_clip",
        "dtype",
        "compile",
        "seed",
        "data_order",
    )
    assert {k: preset.train.flat()[k] for k in learning} == {k: last.train.flat()[k] for k in learning}
    assert preset.model == last.model  # GPT-2's architecture at nanoGPT's small Shakespeare shape


def test_matmul_shapes_times_every_matmul_of_a_step_and_weights_them_by_flops(tmp_path):
    """bench/matmul_shapes.py: 15 rows (the block's four linears and the LM head, each forward, dX and
    dW) and a FLOP-weighted rate in each dtype that lies between the slowest and fastest row's."""
    md = tmp_path / "mm.md"
    done = subprocess.run(
        [
            sys.executable,
            "bench/matmul_shapes.py",
            "--n-embd",
            "32",
            "--n-layer",
            "2",
            "--tokens",
            "64",
            "--vocab-size",
            "50304",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--dtypes",
            "float32",
            "--md",
            str(md),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = [r.strip("|").split("|") for r in md.read_text().splitlines() if r.startswith("| ") and "m x k" not in r]
    assert len(rows) == 16 and rows[12][0].strip() == "lm head fwd" and rows[12][1].strip() == "64 x 32 x 50304"
    assert [r[2].strip() for r in rows[:15]] == ["2"] * 12 + ["1"] * 3
    rate = [float(r[3].split("(")[0].strip("* ").replace(",", "")) for r in rows]
    assert min(rate[:15]) <= rate[15] <= max(rate[:15]) and rate[15] > 0
    bad = subprocess.run(
        [sys.executable, "bench/matmul_shapes.py", "--dtypes", "float8"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("matmul_shapes.py: error: --dtypes: ")


def test_activation_checkpointing_bench_prints_both_rows():
    out = run_bench(
        "bench/activation_checkpointing.py",
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--n-embd",
        "32",
        "--block-size",
        "64",
        "--batch",
        "2",
        "--steps",
        "1",
        timeout=300,
    )
    assert "| none |" in out and "| full |" in out and "x the peak" in out


def tiny_shards(directory: Path, tokens: int = 60_000) -> Path:
    import numpy as np

    from gpt2.data.shards import write_shard

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    write_shard(directory / "train_000000.bin", rng.integers(0, 50257, tokens).astype(np.uint16))
    write_shard(directory / "val_000000.bin", rng.integers(0, 50257, 4096).astype(np.uint16))
    return directory


def test_gpu_profile_runs_our_rows_on_a_cpu_and_says_it_saw_no_kernels(tmp_path):
    """bench/gpu_profile.py's rows run end to end (eager, a CPU: the smoke test; its kernel tables need
    CUDA, tested below from device events)."""
    md = tmp_path / "profile.md"
    out = run_bench(
        "bench/gpu_profile.py",
        *("--shape", "tiny", "--device", "cpu", "--nanogpt", "none", "--no-compile"),
        *("--data-dir", str(tiny_shards(tmp_path / "data")), "--warmup", "1", "--steps", "2"),
        *("--profile-steps", "1", "--md", str(md)),
        timeout=600,
    )
    rows = table_rows(out.split("\n\n**")[0], "row")
    # the label names the loss path the planner picked; uncompiled on a CPU that is a timed probe's choice
    assert [r[0] for r in rows] in (["ours model (loss full)", "ours"], ["ours model (loss chunked)", "ours"])
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
    assert out.count("no device kernels (a CPU run)") == 2 and out.strip().endswith(md.read_text().strip())


def test_gpu_profile_tables_device_kernels_by_kind_with_the_idle_share():
    """From the profiler's device events (as on CUDA): kernel time by kind, the top kernels, and the share
    of the profiled span with no kernel running (overlapping kernels counted once)."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gpu_profile
    finally:
        sys.path.remove(str(REPO / "bench"))

    def kernel(name, t0, t1, device=DeviceType.CUDA, annotation=False):
        return NS(device_type=device, name=name, time_range=NS(start=t0, end=t1), is_user_annotation=annotation)

    events = [
        kernel("nvjet_sm90_tst_192x192_gemm", 0, 600),
        kernel("triton_poi_fused_gelu_0", 500, 700),  # overlaps the matmul: counted once in the busy time
        kernel("cudnn_sdpa_flash_fprop", 900, 1000),
        kernel("multi_tensor_apply_kernel<FusedAdamW>", 1100, 1200),
        kernel("aten::mm", 0, 5000, device=DeviceType.CPU),  # the host's op: not a kernel
        kernel("Optimizer.step#AdamW.step", 1050, 1250, annotation=True),  # spans the kernels: not one
    ]
    row = gpu_profile.Profile("x", step_s=[0.01], mean_s=0.01)
    gpu_profile.kernel_profile(NS(events=lambda: events), row)
    assert row.busy_us == 700 + 100 + 100 and row.span_us == 1200
    assert gpu_profile.kind_of("void at::native::vectorized_elementwise_kernel<FillFunctor>") == "copy / fill"
    args = NS(shape="tiny", warmup=1, steps=1, profile_steps=1, top=2, nanogpt=None)
    text = "\n".join(gpu_profile.report([row], args, 64, 1.0))
    (head,) = table_rows(text.split("\n\n**")[0], "row")
    assert head[5:8] == ["1.00", "4", "25.0%"]  # kernel ms/step, kernels/step, idle share of the span
    kinds = dict((r[0], r[1]) for r in table_rows(text.split("| kind |")[1].split("top 2")[0], "kind"))
    assert kinds == {
        "matmul": "0.600",
        "triton (fused by inductor)": "0.200",
        "attention": "0.100",
        "optimizer, clip (multi-tensor)": "0.100",
    }
    assert (
        "top 2 kernels" in text and "nvjet_sm90_tst_192x192_gemm" in text and "cudnn_sdpa" not in text.split("top 2")[1]
    )


def test_step_overhead_times_the_loops_host_work_against_nanogpts_ways(tmp_path):
    out = run_bench(
        "bench/step_overhead.py", "--data-dir", str(tiny_shards(tmp_path / "data")), "--reps", "5", timeout=600
    )
    rows = table_rows(out, "row")
    assert [r[0].split(":")[0].split(",")[0] for r in rows] == ["loader", "clip", "whole step"]
    for r in rows:
        ours, theirs = (float(c.replace(",", "")) for c in r[1:3])
        assert ours > 0 and theirs > 0 and r[3].endswith("x")
        assert float(r[3][:-1]) == pytest.approx(ours / theirs, rel=0.03, abs=0.01)  # the cells are rounded
    ops = re.search(r"bookkeeping ops per step .*: ours (\d+) \((\d+) with --spike-guard false\), nanoGPT's (\d+)", out)
    assert ops and int(ops[3]) > 0 and int(ops[1]) > int(ops[2]) > 0, out


def test_plan_resident_reads_each_ranks_total_from_the_plan_line():
    """bench/plan_resident.py parses what gpt2/plan/report.py plan_line prints: one rank, and two ranks where
    rank 0's loss probe makes its total apart (the bench compares each rank's peak with its own total)."""
    from types import SimpleNamespace

    from gpt2.plan.hardware import GIB
    from gpt2.plan.report import plan_line

    sys.path.insert(0, str(REPO / "bench"))
    try:
        import plan_resident
    finally:
        sys.path.remove(str(REPO / "bench"))

    def plan(world_size: int, probe: int | None) -> dict:
        # 32 x 256 tokens x 128 wide in fp32: a 4 MiB activation is mapped, so the heap's slack is the flat 64 MiB
        shape = dict(cfg=SimpleNamespace(n_layer=4, n_embd=128), micro_batch_size=32, seq_len=256)
        p = SimpleNamespace(
            memory=SimpleNamespace(total=GIB // 4),
            usable_bytes=20 * GIB,
            step_time_s=None,
            world_size=world_size,
            **shape,
        )
        return plan_resident.plan_of("starting\n" + plan_line(p, "x", shown=False, held=GIB // 2, probe=probe))

    one = plan(1, None)
    assert one["each"] == one["rank0"] == 0.81 * GIB and one["held"] == 0.5 * GIB and one["probe"] is None
    two = plan(2, GIB)
    assert two["each"] == 0.81 * GIB and two["rank0"] == 1.5 * GIB and two["probe"] == GIB
    assert plan_resident.verdict(1.1 * GIB, GIB) == "ok" and plan_resident.verdict(0.9 * GIB, GIB) == "LOW"
    assert plan_resident.verdict(1.3 * GIB, GIB) == "HIGH"


def test_the_speedrun_preset_is_the_last_row_of_the_modern_ablation():
    """--preset speedrun is --preset speed plus every change of the modern ablation, nothing else (issue 56)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import time_to_loss as ttl
    finally:
        sys.path.remove(str(REPO / "bench"))
    from gpt2.core.config import ARCHS
    from gpt2.train.cli import parse_config

    common = ["--data-dir", "d", "--out-dir", "o"]
    flags = ["--preset", ttl.PRESET] + [f for _, extra in ttl.MODERN for f in extra]
    last, preset = parse_config(flags + common), parse_config(["--preset", ttl.MODERN_PRESET] + common)
    assert preset.train == last.train and preset.model == last.model
    assert preset.model == parse_config(["--preset", "speed", "--arch", "modern"] + common).model.replace(
        logit_softcap=None, doc_attention=True
    )
    assert all(getattr(preset.model, k) == v for k, v in ARCHS["modern"].items() if k != "logit_softcap")
    rows = ttl.modern_rows()
    assert len(rows) == len(ttl.MODERN) - 1 + len(ttl.MODERN_TRIED)  # the preset's own row is --rows speedrun
    assert all(flags[:2] == ["--preset", ttl.MODERN_PRESET] for _, flags in rows[len(ttl.MODERN) - 1 :])


@pytest.mark.slow
def test_time_to_loss_runs_the_speedrun_preset_and_judges_its_goal():
    out = run_bench(
        "bench/time_to_loss.py",
        *("--nanogpt", "none", "--target", "10.9", "--steps", "2", "--eval-every", "1", "--val-tokens", "256"),
        *("--seeds", "1", "--rows", "speedrun"),
        timeout=600,
    )
    rows = table_rows(out, "run")
    assert [r[0] for r in rows] == ["--preset speedrun, seed 1337"]
    assert rows[0][1] == "1" and float(rows[0][5]) < 10.9
    assert rows[0][8] == "1,024"  # tokens to the target: 1 step of 16 x 64


@pytest.mark.slow
def test_time_to_loss_runs_the_presets_at_the_large_shape():
    """--shape large: 6L/384, block 256, 8 x 256 tokens a step, for nanoGPT's recipe and the preset rows alike."""
    out = run_bench(
        "bench/time_to_loss.py",
        *("--shape", "large", "--nanogpt", "none", "--target", "10.9", "--steps", "1", "--eval-every", "1"),
        *("--val-tokens", "512", "--seeds", "1", "--rows", "speedrun"),
        timeout=600,
    )
    assert "256-token windows" in out and "shape large: 6L/384, block 256, 8 x 256 tokens a step, 600 steps" in out
    rows = table_rows(out, "run")
    assert [r[0] for r in rows] == ["--preset speedrun, seed 1337"]
    assert rows[0][1] == "1" and rows[0][8] == "2,048"  # tokens to the target: 1 step of 8 x 256
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import time_to_loss as ttl
    finally:
        sys.path.remove(str(REPO / "bench"))
    from gpt2.train.cli import parse_config

    common = ["--data-dir", "d", "--out-dir", "o"]
    large = parse_config([*ttl.SHAPES["large"].recipe, *common])
    m, t = large.model, large.train
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size) == (6, 6, 384, 256)
    assert (t.batch.micro_batch_size, t.batch.total_batch_size, t.schedule.max_steps, t.schedule.warmup_steps) == (
        8,
        2048,
        600,
        60,
    )
    preset = parse_config(["--preset", "speedrun", *ttl.SHAPES["large"].preset_flags, *common])
    # the preset's own 200-step horizon, not nanoGPT's 600 (its decay then ends before the target, 2026-12-06)
    assert (preset.model.n_embd, preset.model.block_size, preset.train.schedule.max_steps) == (384, 256, 200)
    assert preset.model.rope and preset.train.optim.muon_lr == 0.01


def test_time_to_loss_says_nanogpts_numbers_as_soon_as_its_run_ends():
    """A long bench (--shape large: ~40 minutes of nanoGPT on 2 cores) stopped before its table keeps them."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import time_to_loss as ttl
    finally:
        sys.path.remove(str(REPO / "bench"))
    line = ttl.progress_line({"val": {20: 5.0, 10: 6.0}, "times": [1.0, 3.0, 2.0]}, target=5.0)
    assert line == "  nanoGPT run 1: val {10: 6.0, 20: 5.0}; target 5.0000; 3 steps, median 2.000 s/step, 6.0 s counted"


def test_time_to_loss_optim_rows_move_one_setting_of_the_speedrun_preset_from_its_own_value():
    """--rows optim: --preset speedrun with one optimizer setting moved (the learning rate with its floor), each
    label naming the preset's value it moves from, and no row counted toward the preset's goal."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import time_to_loss as ttl
    finally:
        sys.path.remove(str(REPO / "bench"))
    from gpt2.train.cli import parse_config

    common = ["--data-dir", "d", "--out-dir", "o"]
    names = {"lr": "AdamW part lr", "muon_lr": "Muon lr", "muon_momentum": "Muon momentum", "beta2": "AdamW beta2"}
    names["weight_decay"] = "AdamW weight decay"
    for shape in ttl.SHAPES.values():
        preset = parse_config(["--preset", "speedrun", *shape.preset_flags, *common])
        rows = ttl.optim_rows(shape)
        assert len(rows) == len(ttl.OPTIM_MOVES) >= 1
        assert ttl.planned_rows({"optim"}, shape, seeds=3) == rows
        for label, flags in rows:
            cfg = parse_config(flags + common)
            assert not label.startswith("--preset") and cfg.model == preset.model
            before = {**vars(preset.train.optim), **vars(preset.train.schedule)}
            after = {**vars(cfg.train.optim), **vars(cfg.train.schedule)}
            moved = {f: (before[f], now) for f, now in after.items() if now != before[f]}
            main = [f for f in moved if f != "min_lr"]
            assert len(main) == 1 and label.startswith(names[main[0]]), (label, moved)
            was, now = moved[main[0]]
            said = re.search(r" (\S+) -> (\S+)$", label.split(" (--preset")[0])
            assert (float(said[1]), float(said[2])) == pytest.approx((was, now)) and now != was
            if main[0] == "lr":  # the floor stays a tenth of the peak, as in the preset
                assert moved["min_lr"][1] == pytest.approx(now / 10)
            rest = dataclasses.replace(cfg.train, optim=preset.train.optim, schedule=preset.train.schedule)
            assert rest == preset.train


def test_time_to_loss_technique_rows_add_one_technique_to_the_speedrun_preset_at_each_seed():
    """--rows techniques (issue 76): --preset speedrun with exactly one technique's option changed (cautious weight
    decay: with the decay it gates), at each seed, none counted toward the preset's goal."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import time_to_loss as ttl
    finally:
        sys.path.remove(str(REPO / "bench"))
    from gpt2.train.cli import parse_config

    common = ["--data-dir", "d", "--out-dir", "o"]
    for shape in ttl.SHAPES.values():
        preset = parse_config(["--preset", "speedrun", *shape.preset_flags, *common])
        rows = ttl.technique_rows(shape, seeds=2)
        assert ttl.planned_rows({"techniques"}, shape, seeds=2) == rows and len(rows) == 2 * len(ttl.TECHNIQUES)
        changed = []
        for label, flags in rows:
            cfg = parse_config(flags + common)
            assert not label.startswith("--preset") and label.endswith(("seed 1337)", "seed 1338)"))
            moved = {
                f: v
                for f, v in {**vars(cfg.train.optim), **vars(cfg.train.batch), **vars(cfg.model)}.items()
                if v != {**vars(preset.train.optim), **vars(preset.train.batch), **vars(preset.model)}[f]
            }
            if "cautious" in label:  # the gate, beside the decay it gates (the row before it)
                assert moved == {"muon_weight_decay": 0.1, "cautious_wd": True}, (label, moved)
                continue
            half = preset.train.batch.micro_batch_size // 2
            if "batch warmup:" in label:  # with the halved micro-batch it needs, its control the row before it
                assert moved == {"micro_batch_size": half, "batch_warmup_steps": 16, "batch_warmup_stages": 1}
                continue
            assert len(moved) == 1, (label, moved)
            changed.append(next(iter(moved.items())))
        assert ("muon_ortho", "polar_express") in changed and ("muon_momentum_warmup", 31) in changed
        assert {("value_embeds", 1), ("unet_skips", True), ("muon_weight_decay", 0.1)} <= set(changed)
        assert ("micro_batch_size", preset.train.batch.micro_batch_size // 2) in changed


def test_gpt2_recipe_bench_scales_each_presets_schedule_to_the_run():
    """bench/gpt2_recipe.py: warmup, decay and the momentum warmup the same share of 200 steps as of the preset's."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gpt2_recipe
    finally:
        sys.path.remove(str(REPO / "bench"))
    assert gpt2_recipe.scaled_schedule("gpt2", 200) == ["--max-steps", "200", "--warmup-steps", "7"]
    assert gpt2_recipe.scaled_schedule("gpt2-speedrun", 200) == [
        *("--max-steps", "200", "--decay-steps", "57", "--muon-momentum-warmup", "22"),
    ]
    assert gpt2_recipe.scaled_schedule("gpt2-speedrun", 2)[2:] == ["--decay-steps", "1", "--muon-momentum-warmup", "1"]


@pytest.mark.slow
def test_gpt2_recipe_bench_prints_both_presets_val_by_step_and_exits_by_its_verdict():
    """A 2-step smoke: the table, and an exit status that says the verdict (0: gpt2-speedrun reached gpt2's final
    val loss, 1: not within the run; in 2 steps either may happen, CI's run of 4481749 read 1)."""
    done = bench_process(
        "bench/gpt2_recipe.py", "--steps", "2", "--eval-every", "1", "--val-tokens", "256", timeout=600
    )
    out = done.stdout
    assert done.returncode in (0, 1), done.stdout[-2000:] + done.stderr[-2000:]
    rows = table_rows(out, "step")
    assert [r[0] for r in rows] == ["0", "1", "2"] and all(math.isfinite(float(r[3])) for r in rows)
    assert "gpt2's final val loss" in out and "median s/step: gpt2 " in out
    assert ("gpt2-speedrun reaches it at step" in out) == (done.returncode == 0), out


def test_time_to_loss_horizon_rows_end_the_speedrun_presets_decay_sooner():
    """--rows horizon: --preset speedrun at the large shape with each other --max-steps, and nothing else
    changed; the small shape has none and says so."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import time_to_loss as ttl
    finally:
        sys.path.remove(str(REPO / "bench"))
    from gpt2.train.cli import parse_config

    common = ["--data-dir", "d", "--out-dir", "o"]
    large = ttl.SHAPES["large"]
    preset = parse_config(["--preset", "speedrun", *large.preset_flags, *common])
    rows = ttl.horizon_rows(large)
    own = preset.train.schedule.max_steps
    assert len(rows) == len(large.horizons) >= 1 and own not in large.horizons
    for (label, flags), h in zip(rows, large.horizons):
        cfg = parse_config(flags + common)
        assert not label.startswith("--preset") and f"horizon {own} -> {h} steps" in label  # not the preset's goal
        assert cfg.train.schedule.max_steps == h and cfg.model == preset.model
        assert dataclasses.replace(cfg.train.schedule, max_steps=own) == preset.train.schedule
        assert dataclasses.replace(cfg.train, schedule=preset.train.schedule) == preset.train
    out = bench_process("bench/time_to_loss.py", "--nanogpt", "none", "--target", "5", "--rows", "horizon", timeout=300)
    assert out.returncode == 2 and "--rows horizon needs --shape large" in out.stderr
    only = ["--nanogpt", "none", "--target", "5", "--rows", "techniques", "--only", "no such row"]
    out = bench_process("bench/time_to_loss.py", *only, timeout=300)  # refused before any work
    assert out.returncode == 2 and "--only 'no such row' keeps none of the rows of --rows techniques" in out.stderr


def test_auto_under_load_judges_issue_73s_goals_and_runs_a_trial(tmp_path, monkeypatch, fake_clock):
    """bench/auto_under_load.py's summary (the loaded trials' decisions against the quiet ones', the cache
    entries they wrote) and one trial in this process, on conftest's fake clock (a quiet machine, no real
    timing: the bench's own trials measure in fresh processes)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import auto_under_load as bench
    finally:
        sys.path.remove(str(REPO / "bench"))
    from gpt2.plan import batch_probe, loss_probe, matmul_peak, precision_choice

    usual = {"dtype": "bfloat16", "loss": "full", "micro_batch": 8, "cached": []}
    line, ok = bench.summary([usual] * 10, [usual] * 9 + [{**usual, "loss": "chunked"}])
    assert ok and line.endswith("loaded trials with the same: 9 of 10 (goal >= 90%); loaded trials that wrote a "
                                "cache entry: 0 (goal 0): PASS")  # fmt: skip
    assert not bench.summary([usual] * 10, [usual] * 8 + [{**usual, "micro_batch": 1}] * 2)[1]
    assert not bench.summary([usual] * 10, [usual] * 9 + [{**usual, "cached": ["peak"]}])[1]
    names = ["matmul-peak-float32-ab.json", "dtype-choice-cd.json", "eager-loss-ef.json", "micro-batch-01.json"]
    assert bench.cache_kinds(names) == ["dtype", "loss", "micro-batch", "peak"] and bench.cache_kinds([]) == []

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for module, cache in [(matmul_peak, "_PEAKS"), (precision_choice, "_CHOICES"), (loss_probe, "_TIMES"),
                          (batch_probe, "_RATES")]:  # fmt: skip
        monkeypatch.setattr(module, cache, {})
    fake_clock.run = False  # seconds a FLOP for the matmul probes, seconds a call for the rest
    fake_clock.times.update(bfloat16=1 / 400e9, float32=1 / 150e9, full=0.2, chunked=0.3)
    result = bench.trial("debug")
    assert result["micro_batch"] == 8 and result["dtype"] in ("bfloat16", "float32")  # float32: no bf16 instructions
    assert set(result["reasons"]) == {"precision", "micro_batch", "loss", "peak"} and len(result["load"]) == 2
    assert bench.table([("quiet", 1, {**result, "cached": ["peak"]})], reasons=False)[2].startswith(
        f"| 1 | quiet | {result['dtype']} | {result['loss']} | 8 |"
    )


@pytest.mark.slow
def test_mixture_bench_prints_the_cost_and_shares_tables():
    """bench/mixed_corpora.py at a tiny count of steps: the cost rows at 1, 2 and 8 sources, the shares within 0.5%."""
    out = run_bench(
        "bench/mixed_corpora.py",
        "--tables",
        "cost,shares",
        "--shapes",
        "debug",
        "--loader-steps",
        "3",
        "--train-steps",
        "1",
        "--rounds",
        "1",
        timeout=600,
    )
    cost = [line for line in out.splitlines() if line.startswith("| debug |")]
    assert [row.split("|")[2].strip() for row in cost] == ["1", "2", "8"], out
    shares = [line for line in out.splitlines() if line.startswith(("| 0.", "| 1 /", "| 8 sources"))]
    assert len(shares) == 4 and all(float(row.split("|")[3].strip(" %")) < 0.5 for row in shares), out
