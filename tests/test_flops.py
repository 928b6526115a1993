import pytest
import torch

from gpt2.core import precision
from gpt2.core.config import ModelConfig, model_preset, param_count
from gpt2.plan import matmul_peak, precision_choice
from gpt2.plan.flops import (
    checked_mfu,
    device_peak_flops,
    flops_per_token,
    format_flops,
    gpu_table_peak,
    mfu,
    peak_problem,
)
from gpt2.plan.matmul_peak import peak_rate


def test_flops_per_token_matches_hand_count():
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=4, block_size=8, vocab_size=50257)
    wte = 50257 * 4
    layer = (4 + 4) * 2 + (4 * 12 + 12) + (4 * 4 + 4) + (4 * 16 + 16) + (16 * 4 + 4)
    ln_f = 4 + 4
    n_no_pos = wte + layer + ln_f
    assert param_count(cfg, include_position=False) == n_no_pos
    assert param_count(cfg) == n_no_pos + 8 * 4
    attention = 12 * 1 * 4 * 8  # 12 * L * h * T
    assert flops_per_token(cfg) == 6 * n_no_pos + attention
    assert flops_per_token(cfg, seq_len=2) == 6 * n_no_pos + 12 * 1 * 4 * 2


def test_flops_per_token_gpt2_known_value():
    # nanoGPT's estimate for 124M at T=1024: 6 * 123.65M (no wpe, vocab 50257) + 12*12*768*1024.
    cfg = model_preset("gpt2", vocab_size=50257)
    n = 124_439_808 - 1024 * 768
    assert flops_per_token(cfg) == 6 * n + 12 * 12 * 768 * 1024
    assert flops_per_token(cfg) == pytest.approx(0.8552e9, rel=1e-3)


def test_flops_per_token_rejects_seq_len_beyond_block():
    with pytest.raises(ValueError, match="block_size"):
        flops_per_token(ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=8), seq_len=9)


def test_mfu_arithmetic():
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=4, block_size=8, vocab_size=50257)
    f = flops_per_token(cfg)
    assert mfu(1000.0, cfg, peak=1000.0 * f) == pytest.approx(1.0)
    assert mfu(250.0, cfg, peak=1000.0 * f) == pytest.approx(0.25)
    assert mfu(250.0, cfg, peak=1000.0 * f, seq_len=4) < 0.25  # fewer attention FLOPs
    with pytest.raises(ValueError, match="positive"):
        mfu(1.0, cfg, peak=0.0)


def test_blackwell_peaks_and_no_mfu_claimed_for_a_mig_slice(monkeypatch, capsys, tmp_path):
    """B200 and GB200 from the GB200 NVL72 / HGX B200 data sheet (dense = half its sparse tensor rows); a MIG
    slice, named as its GPU plus the profile, gets no peak, and the trainer says why."""
    from gpt2.plan.flops import mig_profile

    assert gpu_table_peak("NVIDIA B200", torch.bfloat16) == 2250e12
    assert gpu_table_peak("NVIDIA B200", torch.float32, tf32=True) == 1100e12
    assert gpu_table_peak("NVIDIA GB200", torch.bfloat16) == 2500e12
    assert gpu_table_peak("NVIDIA GB200", torch.float32) == 80e12
    assert mig_profile("NVIDIA A100-SXM4-40GB MIG 1g.5gb") == "1g.5gb" and mig_profile("NVIDIA A100-SXM4-40GB") is None
    assert gpu_table_peak("NVIDIA A100-SXM4-40GB MIG 1g.5gb", torch.bfloat16) is None
    assert gpu_table_peak("NVIDIA H100 80GB HBM3 MIG 7g.80gb", torch.bfloat16) is None

    from types import SimpleNamespace

    from gpt2.core.precision import Precision
    from gpt2.distributed.group import Dist
    from gpt2.train import startup
    from gpt2.train.run_log import RunLog

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3 MIG 3g.40gb")
    from gpt2.plan import resolve

    monkeypatch.setattr(resolve, "device_name", lambda device: "NVIDIA H100 80GB HBM3 MIG 3g.40gb")
    dist = Dist(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cuda", 0))
    peak, why = resolve.mfu_peak(dist.device, Precision("bfloat16", "bfloat16", tf32=True))  # the record's
    assert peak is None
    startup.log_mfu_peak(SimpleNamespace(peak=peak, peak_why=why), dist, RunLog(dist, tmp_path))
    assert "mfu n/a: NVIDIA H100 80GB HBM3 MIG 3g.40gb is a MIG slice (3g.40gb)" in capsys.readouterr().out


def test_gpu_table_peaks():
    assert gpu_table_peak("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312e12
    assert gpu_table_peak("NVIDIA A100-PCIE-40GB", torch.float32) == 19.5e12
    assert gpu_table_peak("NVIDIA A100-PCIE-40GB", torch.float32, tf32=True) == 156e12
    assert gpu_table_peak("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert gpu_table_peak("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert gpu_table_peak("NVIDIA H200", torch.bfloat16) == 989e12
    assert gpu_table_peak("Tesla V100-SXM2-32GB", torch.float32, tf32=True) == 15.7e12  # no TF32
    assert gpu_table_peak("Tesla V100-SXM2-32GB", torch.bfloat16) is None
    assert gpu_table_peak("Some Future GPU", torch.bfloat16) is None


@pytest.mark.parametrize(
    "name, bf16",
    [
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40", 181e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA A10G", 70e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA A40", 149.7e12),
        ("NVIDIA RTX A6000", 154.8e12),
        ("NVIDIA RTX 6000 Ada Generation", 364.2e12),
        ("NVIDIA GeForce RTX 3090", 71e12),
        ("NVIDIA GeForce RTX 3090 Ti", 80e12),
        ("NVIDIA GeForce RTX 4090", 165e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200 NVL", 835e12),
    ],
)
def test_gpu_table_matches_whole_tokens(name, bf16):
    """A short model name never matches inside a longer one: L4 is not L40, A10 is not A100."""
    assert gpu_table_peak(name, torch.bfloat16) == bf16


@pytest.mark.parametrize(
    "name, fp16, fp32",
    [
        ("Tesla T4", 65e12, 8.1e12),
        ("Tesla V100-SXM2-32GB", 125e12, 15.7e12),
        ("Tesla V100-PCIE-16GB", 112e12, 14e12),
        ("Tesla V100S-PCIE-32GB", 130e12, 16.4e12),
    ],
)
def test_gpu_table_pre_ampere_has_fp16_but_no_bf16(name, fp16, fp32):
    assert gpu_table_peak(name, torch.float16) == fp16
    assert gpu_table_peak(name, torch.float32, tf32=True) == fp32  # no TF32 tensor cores
    assert gpu_table_peak(name, torch.bfloat16) is None


@pytest.mark.parametrize("name", ["Quadro RTX 6000", "NVIDIA GeForce RTX 2080 Ti", "NVIDIA A2", "NVIDIA L"])
def test_gpu_table_leaves_unlisted_gpus_out(name):
    assert gpu_table_peak(name, torch.bfloat16) is None
    assert gpu_table_peak(name, torch.float16) is None


def _fake_cuda(monkeypatch, name: str) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_device_peak_flops_cuda_uses_the_table(monkeypatch):
    _fake_cuda(monkeypatch, "NVIDIA L40")
    assert device_peak_flops("cuda", torch.bfloat16, tf32=False) == 181e12
    assert device_peak_flops("cuda:0", torch.float32, tf32=True) == 90.5e12


def test_device_peak_flops_takes_tf32_as_passed_not_from_torch(monkeypatch):
    """tf32 is the run's setting, passed in: torch's global matmul precision does not change the peak."""
    _fake_cuda(monkeypatch, "NVIDIA A100-SXM4-80GB")
    before = torch.get_float32_matmul_precision()
    try:
        for global_precision in ("highest", "high"):
            torch.set_float32_matmul_precision(global_precision)
            assert device_peak_flops("cuda", torch.float32, tf32=False) == 19.5e12
            assert device_peak_flops("cuda", torch.float32, tf32=True) == 156e12
            assert device_peak_flops("cuda", torch.bfloat16, tf32=True) == 312e12  # tf32 is about fp32 only
    finally:
        torch.set_float32_matmul_precision(before)
    with pytest.raises(TypeError):
        device_peak_flops("cuda", torch.float32)  # no default: every caller says


def test_device_peak_flops_unlisted_cuda_gpu_is_none_not_measured(monkeypatch):
    """A measured rate is below the data-sheet peak, so MFU against it would be inflated."""
    import gpt2.plan.flops

    def no_measuring(*args, **kwargs):
        raise AssertionError("a CUDA peak must not be measured")

    monkeypatch.setattr(gpt2.plan.flops, "measured_peaks", no_measuring)
    _fake_cuda(monkeypatch, "Some Future GPU")
    assert device_peak_flops("cuda", torch.bfloat16, tf32=False) is None
    _fake_cuda(monkeypatch, "Tesla T4")
    assert device_peak_flops("cuda", torch.bfloat16, tf32=False) is None  # listed, but no bf16 tensor cores
    assert device_peak_flops("cuda", torch.float16, tf32=False) == 65e12


def test_device_peak_flops_measures_on_cpu_and_never_below_fp32(tmp_path, monkeypatch):
    """MFU is against the kernels that can run: where bf16 is emulated, compiled code may run fp32
    kernels faster than the bf16 "peak", so an autocast peak is at least the fp32 rate. In a cache of its own: its
    fp16 peak is measured alternating with fp32's, which would otherwise rewrite the session's fp32 peak (measured
    under the suite's load) for every later trainer start."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(matmul_peak, "_PEAKS", {})
    fp32 = peak_rate("cpu", torch.float32)
    assert device_peak_flops("cpu", torch.float32, tf32=False) == fp32
    for dtype in (torch.bfloat16, torch.float16):
        # measured with fp32 again, alternately (gpt2.plan.matmul_peak.peak_rates): compare with both as they now are
        assert device_peak_flops("cpu", dtype, tf32=False) == max(
            peak_rate("cpu", torch.float32), peak_rate("cpu", dtype)
        )


@pytest.mark.gpu
def test_device_peak_flops_cuda_is_the_table_entry():
    peak = device_peak_flops("cuda", torch.bfloat16, tf32=False)
    assert peak == gpu_table_peak(torch.cuda.get_device_name(), torch.bfloat16)
    assert peak is None or peak > 1e12


@pytest.fixture
def peak_cache(tmp_path, monkeypatch, fake_clock):
    """An empty user cache and a fresh process's view of it on a quiet machine (conftest's fake_clock); every
    probe counted, at a chosen rate."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(matmul_peak.REFRESH_PEAK_ENV, raising=False)
    monkeypatch.setattr(matmul_peak, "_PEAKS", {})
    monkeypatch.setattr(precision_choice, "_CHOICES", {})
    probes = {"n": 0, "rates": iter([]), "clock": fake_clock}

    def fake_probe(device, dtype, **kwargs):
        assert kwargs["fresh"] and kwargs["min_time_s"] >= 0.05 and kwargs["cpu_time"]  # a probe long enough
        probes["n"] += 1
        return rate_of(next(probes["rates"]))

    monkeypatch.setattr(matmul_peak, "matmul_rate", fake_probe)
    return probes


def rate_of(flop_s: float) -> matmul_peak.MatmulRate:
    """A probe's result at flop_s, by the wall clock and (per thread) by CPU time alike."""
    return matmul_peak.MatmulRate(flop_s, flop_s / torch.get_num_threads(), 1024)


def test_the_cpu_peak_is_the_best_of_several_probes_measured_once_and_cached_on_disk(peak_cache, monkeypatch):
    peak_cache["rates"] = iter([40e9, 150e9, 149e9, 151e9, 148e9])  # another tenant slowed one of them
    assert peak_rate("cpu", torch.float32) == 151e9
    assert peak_cache["n"] == matmul_peak.PEAK_PROBES
    [entry] = (matmul_peak.peak_cache_dir()).glob("matmul-peak-float32-*.json")
    assert matmul_peak.peak_cache_dir().parent.name == "cache"  # under $XDG_CACHE_HOME/gpt2-ddp
    assert not list(matmul_peak.peak_cache_dir().glob("*.tmp"))  # written through a temp file, renamed
    monkeypatch.setattr(matmul_peak, "_PEAKS", {})  # a new process on the same machine
    assert peak_rate("cpu", torch.float32) == 151e9 and device_peak_flops("cpu", torch.float32, tf32=False) == 151e9
    assert peak_cache["n"] == matmul_peak.PEAK_PROBES  # read back, not measured again
    torch.set_num_threads(torch.get_num_threads() + 1)  # another thread count is another peak
    peak_cache["rates"] = iter([300e9] * matmul_peak.PEAK_PROBES)
    assert peak_rate("cpu", torch.float32) == 300e9 and peak_cache["n"] == 2 * matmul_peak.PEAK_PROBES


def test_a_comparison_measures_both_dtypes_alternately_under_the_same_load(peak_cache, monkeypatch):
    seen = []
    rates = {
        torch.bfloat16: iter([100e9, 90e9, 110e9, 95e9, 99e9]),
        torch.float32: iter([200e9, 150e9, 210e9, 190e9, 180e9]),
    }

    def probe(device, dtype, **kwargs):
        seen.append(dtype)
        return rate_of(next(rates[dtype]))

    monkeypatch.setattr(matmul_peak, "matmul_rate", probe)
    monkeypatch.setattr(precision_choice, "cpu_bf16_instructions", lambda: True)
    assert precision_choice.resolve_precision("auto", "cpu").dtype == "float32"
    bf16, fp32 = torch.bfloat16, torch.float32
    assert seen == [bf16, fp32, fp32, bf16, bf16, fp32, fp32, bf16, bf16, fp32]  # paired, A B B A: issue 73
    assert (
        device_peak_flops("cpu", torch.bfloat16, tf32=False) == 210e9 and len(seen) == 2 * matmul_peak.PEAK_PROBES
    )  # shared


def test_the_refresh_variable_measures_the_cached_peak_again(peak_cache, monkeypatch):
    peak_cache["rates"] = iter([100e9] * matmul_peak.PEAK_PROBES + [160e9] * matmul_peak.PEAK_PROBES)
    assert peak_rate("cpu", torch.float32) == 100e9
    monkeypatch.setattr(matmul_peak, "_PEAKS", {})
    monkeypatch.setenv(matmul_peak.REFRESH_PEAK_ENV, "1")
    assert peak_rate("cpu", torch.float32) == 160e9 and peak_cache["n"] == 2 * matmul_peak.PEAK_PROBES
    assert peak_rate("cpu", torch.float32) == 160e9 and peak_cache["n"] == 2 * matmul_peak.PEAK_PROBES  # once
    monkeypatch.setattr(matmul_peak, "_PEAKS", {})
    monkeypatch.delenv(matmul_peak.REFRESH_PEAK_ENV)
    assert peak_rate("cpu", torch.float32) == 160e9 and peak_cache["n"] == 2 * matmul_peak.PEAK_PROBES  # replaced


ISSUE_FP32 = [17.7e9, 15.9e9, 15.7e9, 184.4e9, 4.9e9]
"""Issue 73's fp32 probes (its cache entry's probes_flop_s), measured at load average 7.73 on 2 cores."""


def peak_lines(prec: precision.Precision) -> tuple[float | None, list[str]]:
    """MFU's peak for prec on this CPU as a start decides it (gpt2/plan/resolve.py) and the line it logs."""
    from types import SimpleNamespace

    from gpt2.distributed.group import Dist
    from gpt2.plan import resolve
    from gpt2.train import dryrun, startup

    cpu = torch.device("cpu")
    dist = Dist(rank=0, local_rank=0, world_size=1, local_world_size=1, device=cpu)
    peak, why = resolve.mfu_peak(cpu, prec)
    how = resolve.cpu_peak(cpu, prec.torch_dtype).how
    decided = SimpleNamespace(peak=peak, peak_why=why, peak_how=how, hardware=SimpleNamespace(device_type="cpu"))
    lines = []
    startup.log_mfu_peak(decided, dist, dryrun.Log(lines.append))
    return peak, lines


def test_a_peak_measured_under_load_is_neither_cached_nor_used_for_mfu(peak_cache):
    """Issue 73: MFU against a peak taken while other jobs ran would swing with them. The probes' wall rates
    are the issue's; the plan still gets the measurement (its step time is for a loaded machine too)."""
    from gpt2.plan import resolve

    peak_cache["clock"].load = 7.73
    peak_cache["rates"] = iter(ISSUE_FP32)
    fp32 = precision.Precision("float32", "float32")
    peak, lines = peak_lines(fp32)
    assert peak is None and not list(matmul_peak.peak_cache_dir().glob("*.json"))
    assert lines == [
        "mfu n/a: the CPU matmul peak 0.184 TFLOP/s is doubtful (the best of 5 float32 matmul probes (n=1024), "
        "measured now at load 7.7 on 2 CPU(s); not cached: load average 7.7 above the 2 CPU(s)), and MFU against "
        "it would move with the load; a quieter start measures and caches it (GPT2_DDP_REFRESH_PEAK=1 forces a "
        "measurement)"
    ]
    assert resolve.plan_peak(torch.device("cpu"), fp32, None) == 184.4e9 and peak_cache["n"] == 5  # measured once


def test_scattered_probes_on_a_quiet_machine_are_not_cached_either(peak_cache):
    peak_cache["rates"] = iter(ISSUE_FP32)
    [m] = matmul_peak.measured_peaks("cpu", (torch.float32,))
    assert (
        m.flop_s == 184.4e9
        and m.doubt == "its best probe is 11.60x their median"
        and not list(matmul_peak.peak_cache_dir().glob("*.json"))
    )


def test_the_peak_line_says_how_the_peak_was_measured_and_where_it_is_cached(peak_cache, monkeypatch):
    peak_cache["rates"] = iter([150e9] * matmul_peak.PEAK_PROBES)
    peak, lines = peak_lines(precision.Precision("float32", "float32"))
    [path] = matmul_peak.peak_cache_dir().glob("matmul-peak-float32-*.json")
    threads = torch.get_num_threads()
    assert peak == 150e9 and lines == [
        f"peak       0.150 TFLOP/s per rank ({threads} thread(s)): the best of 5 float32 matmul probes (n=1024), "
        f"measured now at load 0.3 on 2 CPU(s); cached in {path} (GPT2_DDP_REFRESH_PEAK=1 measures again)"
    ]
    monkeypatch.setattr(matmul_peak, "_PEAKS", {})  # the next run reads it, with when it was measured
    entry = __import__("json").loads(path.read_text())
    assert entry["trusted"] and entry["load"] == {"load_average": 0.3, "cores": 2, "wait_share": 0.0}
    _, lines = peak_lines(precision.Precision("float32", "float32"))
    assert f"(n=1024), measured {entry['measured']} at load 0.3 on 2 CPU(s); cached in {path}" in lines[0]


def test_a_cache_entry_written_before_issue_73_is_measured_again(peak_cache):
    """The issue's own entry (best of five, no record of its load but the load average): doubtful, so measured
    again, and the new quiet measurement replaces it."""
    import json

    key = matmul_peak.peak_key("cpu", torch.float32)
    path = matmul_peak.peak_cache_path(key)
    path.parent.mkdir(parents=True)
    old = {"key": key, "flop_s": 184.4e9, "probes_flop_s": ISSUE_FP32, "load_average_1min": 7.73}
    path.write_text(json.dumps({**old, "measured": "2026-12-01T10:00:00+0000"}))
    peak_cache["rates"] = iter([33.5e9] * matmul_peak.PEAK_PROBES)
    assert peak_rate("cpu", torch.float32) == 33.5e9 and peak_cache["n"] == matmul_peak.PEAK_PROBES
    assert json.loads(path.read_text())["flop_s"] == 33.5e9


def test_a_cached_peak_is_measured_again_every_recheck_runs_and_a_busy_recheck_keeps_it(peak_cache, monkeypatch):
    from gpt2.plan import paired

    peak_cache["rates"] = iter([150e9] * matmul_peak.PEAK_PROBES)
    assert peak_rate("cpu", torch.float32) == 150e9  # measured and cached (run 1)
    for _ in range(paired.RECHECK_RUNS - 1):  # runs 2 .. RECHECK_RUNS read it
        monkeypatch.setattr(matmul_peak, "_PEAKS", {})
        assert peak_rate("cpu", torch.float32) == 150e9
    assert peak_cache["n"] == matmul_peak.PEAK_PROBES
    peak_cache["clock"].load = 5.0  # due, but a busy start does not re-check: it would only be doubtful
    for _ in range(3):
        monkeypatch.setattr(matmul_peak, "_PEAKS", {})
        assert peak_rate("cpu", torch.float32) == 150e9
    assert peak_cache["n"] == matmul_peak.PEAK_PROBES
    monkeypatch.setattr(matmul_peak, "_PEAKS", {})
    peak_cache["clock"].load = 0.2  # the first quiet start re-checks; its probes scatter: the quiet peak stays
    peak_cache["rates"] = iter([40e9, 150e9] * matmul_peak.PEAK_PROBES)
    [m] = matmul_peak.measured_peaks("cpu", (torch.float32,))
    assert peak_cache["n"] == 2 * matmul_peak.PEAK_PROBES and m.flop_s == 150e9 and m.doubt is None
    assert "its re-check now was doubtful: its best probe is 3.75x their median" in m.how
    for _ in range(paired.RECHECK_RUNS - 1):  # counted from 0 again: not re-measured at every start
        monkeypatch.setattr(matmul_peak, "_PEAKS", {})
        assert peak_rate("cpu", torch.float32) == 150e9
    assert peak_cache["n"] == 2 * matmul_peak.PEAK_PROBES
    monkeypatch.setattr(matmul_peak, "_PEAKS", {})
    peak_cache["rates"] = iter([170e9] * matmul_peak.PEAK_PROBES)  # a quiet re-check that holds replaces it
    assert peak_rate("cpu", torch.float32) == 170e9 and peak_cache["n"] == 3 * matmul_peak.PEAK_PROBES


def test_a_damaged_cache_file_is_measured_again(peak_cache, monkeypatch):
    peak_cache["rates"] = iter([100e9] * (2 * matmul_peak.PEAK_PROBES))
    peak_rate("cpu", torch.float32)
    [entry] = matmul_peak.peak_cache_dir().glob("*.json")
    entry.write_text('{"key": ')
    monkeypatch.setattr(matmul_peak, "_PEAKS", {})
    assert peak_rate("cpu", torch.float32) == 100e9 and peak_cache["n"] == 2 * matmul_peak.PEAK_PROBES


def test_a_peak_below_the_sanity_floor_gives_no_mfu_and_is_not_cached(peak_cache, monkeypatch):
    threads = torch.get_num_threads()
    peak_cache["rates"] = iter([0.04e9] * matmul_peak.PEAK_PROBES)  # the "peak 0.0 TFLOP/s" of the issue
    peak = device_peak_flops("cpu", torch.float32, tf32=False)
    assert peak == 0.04e9
    assert not list(matmul_peak.peak_cache_dir().glob("*.json"))  # the next run measures again
    why = peak_problem(peak, "cpu", threads)
    assert why and "0.0000400 TFLOP/s" in why and "disturbed" in why and matmul_peak.REFRESH_PEAK_ENV in why
    assert peak_problem(matmul_peak.CPU_PEAK_FLOOR_PER_THREAD * threads, "cpu", threads) is None
    assert peak_problem(1e9, "cuda", 1) is None  # data-sheet peaks are not probes


def test_an_mfu_above_100_percent_is_not_shown():
    cfg = model_preset("gpt2")
    peak = 2e12
    ok_tok_s = 0.5 * peak / flops_per_token(cfg)
    assert checked_mfu(ok_tok_s, cfg, peak) == (pytest.approx(0.5), None)
    value, why = checked_mfu(1.3 * peak / flops_per_token(cfg), cfg, peak)
    assert value is None and "MFU 130%" in why and "2.00 TFLOP/s" in why and "measures it again" in why


def test_a_peak_proved_wrong_is_dropped_from_the_cache(peak_cache, monkeypatch):
    from gpt2.train.trainer import forget_cpu_peak

    peak_cache["rates"] = iter([50e9] * matmul_peak.PEAK_PROBES + [150e9] * matmul_peak.PEAK_PROBES)
    assert peak_rate("cpu", torch.float32) == 50e9
    forget_cpu_peak(torch.device("cpu"), precision.Precision("bfloat16", "bfloat16"))  # after an MFU > 100%
    assert not list(matmul_peak.peak_cache_dir().glob("*.json"))
    assert peak_rate("cpu", torch.float32) == 150e9 and peak_cache["n"] == 2 * matmul_peak.PEAK_PROBES


def test_peaks_are_printed_with_enough_digits_to_tell_them_apart():
    assert format_flops(0.1509e12) == "0.151 TFLOP/s"
    assert format_flops(0.04e12) == "0.0400 TFLOP/s"  # printed "0.0" before
    assert format_flops(312e12) == "312.0 TFLOP/s"  # the data-sheet numbers README shows are unchanged
    assert format_flops(83.5e12) == "83.5 TFLOP/s" and format_flops(1e12) == "1.00 TFLOP/s"


@pytest.mark.slow
def test_the_trainer_shows_no_mfu_from_a_cached_peak_below_the_floor(tmp_path, shakespeare_shards):
    """End to end: a cache entry that is clearly wrong (as a disturbed probe would have been, had it
    been cached) makes the run log "mfu n/a:" and record no MFU, instead of MFU 80-93%."""
    import json
    import os

    from conftest import TINY_MODEL_FLAGS, run_trainer

    from gpt2.train.run_log import read_metrics

    cache = tmp_path / "cache"
    real = torch.get_num_threads()
    try:
        for threads in range(1, max(16, os.cpu_count() or 1) + 1):  # whatever the run uses
            torch.set_num_threads(threads)
            for dtype in (torch.float32, torch.bfloat16):  # bf16 too: --dtype's reason compares the two
                key = matmul_peak.peak_key("cpu", dtype)
                path = cache / "gpt2-ddp" / matmul_peak.peak_cache_path(key).name
                path.parent.mkdir(parents=True, exist_ok=True)
                load = {"load_average": 0.1, "cores": 2, "wait_share": 0.0}
                entry = {"key": key, "flop_s": 0.04e9, "how": "a probe", "trusted": True, "load": load}
                path.write_text(json.dumps({**entry, "measured": "2026-12-01T10:00:00+0000"}))
    finally:
        torch.set_num_threads(real)
    run = run_trainer(
        [
            *TINY_MODEL_FLAGS,
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--compile",
            "false",
            "--data-dir",
            str(shakespeare_shards),
            "--out-dir",
            str(tmp_path / "run"),
            "--micro-batch-size",
            "4",
            "--total-batch-size",
            "256",
            "--max-steps",
            "2",
            "--eval-interval",
            "0",
            "--eval-tokens",
            "0",
            "--sample-interval",
            "0",
            "--log-interval",
            "1",
            "--ckpt-interval",
            "0",
            "--plot",
            "false",
        ],
        env={"XDG_CACHE_HOME": str(cache), matmul_peak.REFRESH_PEAK_ENV: "0"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "mfu n/a: the measured CPU matmul peak 0.0000400 TFLOP/s is below" in run.stdout
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 2 and all(r["mfu"] is None for r in steps)
    assert "mfu   n/a" in run.stdout


def test_the_share_of_causal_attention_a_document_mask_keeps_and_what_mfu_counts_of_it():
    """Issue 75: MFU at --doc-attention counts the full T x T attention; the start-up says how much the mask skips at
    the data's document lengths. The share against a hand count, and the skipped share of the counted FLOPs."""
    import numpy as np

    from gpt2.plan.flops import flops_per_token, within_document_share

    E = 50256
    # window 1: [E 1 2 E] -> documents of 3 and 1 tokens: 6 + 1 of 10 causal pairs; window 2: one document, 10 of 10
    share = within_document_share(np.array([E, 1, 2, E, 3, 4, 5, 6, 7]), 4, E)
    assert (share.kept, share.windows, share.documents) == (0.85, 2, 2)
    assert within_document_share(np.arange(64), 8, E).kept == 1.0  # no EOT: plain causal attention
    assert within_document_share(np.full(16, E), 8, E).kept == 8 / 36  # every token its own document
    with pytest.raises(ValueError, match="no window of 8"):
        within_document_share(np.arange(5), 8, E)
    cfg = model_preset("gpt2")
    attention = 12 * 12 * 768 * 1024 / flops_per_token(cfg)  # 13.2% of the FLOPs MFU counts
    assert share.skipped_of_counted(cfg) == pytest.approx(attention * 0.15 / 2)
    assert within_document_share(np.arange(64), 8, E).skipped_of_counted(cfg) == 0.0
