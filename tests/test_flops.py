import pytest
import torch

from gpt2.config import ModelConfig, model_preset
from gpt2.flops import device_peak_flops, flops_per_token, gpu_table_peak, mfu, param_count
from gpt2.model import GPT
from gpt2.precision import matmul_rate


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


def test_param_count_matches_module_for_gqa_and_no_bias():
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=16, bias=False)
    assert param_count(cfg) == GPT(cfg).num_params()


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


@pytest.mark.parametrize("name, bf16", [
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
])
def test_gpu_table_matches_whole_tokens(name, bf16):
    """A short model name never matches inside a longer one: L4 is not L40, A10 is not A100."""
    assert gpu_table_peak(name, torch.bfloat16) == bf16


@pytest.mark.parametrize("name, fp16, fp32", [
    ("Tesla T4", 65e12, 8.1e12),
    ("Tesla V100-SXM2-32GB", 125e12, 15.7e12),
    ("Tesla V100-PCIE-16GB", 112e12, 14e12),
    ("Tesla V100S-PCIE-32GB", 130e12, 16.4e12),
])
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
    assert device_peak_flops("cuda", torch.bfloat16) == 181e12
    assert device_peak_flops("cuda:0", torch.float32, tf32=True) == 90.5e12


def test_device_peak_flops_unlisted_cuda_gpu_is_none_not_measured(monkeypatch):
    """A measured rate is below the data-sheet peak, so MFU against it would be inflated."""
    import gpt2.flops

    def no_measuring(*args, **kwargs):
        raise AssertionError("a CUDA peak must not be measured")

    monkeypatch.setattr(gpt2.flops, "matmul_rate", no_measuring)
    _fake_cuda(monkeypatch, "Some Future GPU")
    assert device_peak_flops("cuda", torch.bfloat16) is None
    _fake_cuda(monkeypatch, "Tesla T4")
    assert device_peak_flops("cuda", torch.bfloat16) is None  # listed, but no bf16 tensor cores
    assert device_peak_flops("cuda", torch.float16) == 65e12


def test_device_peak_flops_measures_on_cpu_and_never_below_fp32():
    """MFU is against the kernels that can run: where bf16 is emulated, compiled code may run fp32
    kernels faster than the bf16 "peak", so an autocast peak is at least the fp32 rate."""
    fp32 = matmul_rate("cpu", torch.float32)
    assert device_peak_flops("cpu", torch.float32) == fp32
    for dtype in (torch.bfloat16, torch.float16):
        assert device_peak_flops("cpu", dtype) == max(fp32, matmul_rate("cpu", dtype))


@pytest.mark.gpu
def test_device_peak_flops_cuda_is_the_table_entry():
    peak = device_peak_flops("cuda", torch.bfloat16)
    assert peak == gpu_table_peak(torch.cuda.get_device_name(), torch.bfloat16)
    assert peak is None or peak > 1e12
