"""gpt2/bandwidth.py: the start-up all-reduce measurement, its arithmetic, and the trainer's line."""

from __future__ import annotations

import json

import pytest

from conftest import TINY_MODEL_FLAGS, run_trainer
from gpt2.bandwidth import bus_bandwidth, format_network_cost, network_cost, network_warning

MB = 10**6


def test_bus_bandwidth_is_nccl_tests_definition():
    assert bus_bandwidth(100 * MB, 0.1, 2) == (1e9, 1e9)  # 2 ranks: busbw = algbw
    algbw, busbw = bus_bandwidth(100 * MB, 0.1, 8)
    assert algbw == 1e9 and busbw == pytest.approx(1.75e9)  # x 2 * 7 / 8
    for bad in ((0, 0.1, 2), (100, 0, 2), (100, 0.1, 1)):
        with pytest.raises(ValueError, match="bus_bandwidth needs"):
            bus_bandwidth(*bad)


def test_a_124m_step_over_a_slow_network_is_warned_about():
    # 124,475,904 parameters: 497.9 MB of fp32 gradients. A 25 MiB bucket in 10 ms is 2.62 GB/s
    # (~21 Gb/s, TCP sockets), so the step's all-reduce takes 0.19 s: 38% of 0.5 s of compute.
    c = network_cost(backend="nccl", world_size=32, bucket_bytes=25 * 2**20, allreduce_s=0.01,
                     grad_bytes=124_475_904 * 4, step_compute_s=0.5)
    assert c.algbw_bytes_per_s == pytest.approx(2.62144e9)
    assert c.busbw_bytes_per_s == pytest.approx(2.62144e9 * 2 * 31 / 32)
    assert c.step_allreduce_s == pytest.approx(0.18994, rel=1e-4)
    assert c.share == pytest.approx(0.37988, rel=1e-4)
    line = format_network_cost(c)
    assert line.startswith("network    all-reduce of 25.0 MiB over 32 ranks (nccl): 10.0 ms, algbw 2.62 GB/s, "
                           "busbw 5.08 GB/s; a step's gradient all-reduce (498 MB) ~0.19 s = 38% of the planned "
                           "0.5 s of compute per step"), line
    warning = network_warning(c)
    assert "38%" in warning and "NCCL_IB" in warning and "NCCL_SOCKET_IFNAME" in warning


def test_a_fast_network_or_an_unknown_compute_time_gives_no_warning():
    # InfiniBand-class: 25 MiB in 1 ms (26 GB/s) -> 0.019 s, 3.8% of the same step.
    fast = network_cost(backend="nccl", world_size=32, bucket_bytes=25 * 2**20, allreduce_s=0.001,
                        grad_bytes=124_475_904 * 4, step_compute_s=0.5)
    assert fast.share == pytest.approx(0.037988, rel=1e-4) and network_warning(fast) is None
    assert network_warning(fast, threshold=0.03) is not None  # the threshold is what decides
    unknown = network_cost(backend="nccl", world_size=2, bucket_bytes=MB, allreduce_s=0.1, grad_bytes=4 * MB,
                           step_compute_s=None)
    assert unknown.share is None and network_warning(unknown) is None
    assert "no planned compute to compare with" in format_network_cost(unknown)


def _flags(data_dir, out_dir):
    return [*TINY_MODEL_FLAGS, "--device", "cpu", "--dtype", "float32", "--compile", "false", "--sample-interval",
            "0", "--plot", "false", "--data-dir", str(data_dir), "--out-dir", str(out_dir), "--micro-batch-size", "2",
            "--total-batch-size", "256", "--max-steps", "1", "--eval-tokens", "0", "--ckpt-interval", "0"]


def test_two_ranks_log_the_network_line_and_record_it_one_process_does_not(tmp_path, shakespeare_shards):
    two = run_trainer(_flags(shakespeare_shards, tmp_path / "two"), nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    lines = [line for line in two.stdout.splitlines() if line.startswith("network    all-reduce of ")]
    assert len(lines) == 1, two.stdout  # one line, from rank 0
    assert "over 2 ranks (gloo)" in lines[0] and "of the planned" in lines[0], lines[0]
    net = json.loads((tmp_path / "two" / "config.json").read_text())["network"]
    assert net["world_size"] == 2 and net["backend"] == "gloo"
    assert net["algbw_bytes_per_s"] > 0 and net["busbw_bytes_per_s"] == pytest.approx(net["algbw_bytes_per_s"])
    assert net["grad_bytes"] > net["bucket_bytes"] > 0 or net["grad_bytes"] == net["bucket_bytes"]
    assert net["share"] == pytest.approx(net["step_allreduce_s"] / net["step_compute_s"])
    # DDP's broadcast_buffers is deprecated in torch 2.13 (a FutureWarning from every rank): not used
    assert "FutureWarning" not in two.stderr, two.stderr[-3000:]

    one = run_trainer(_flags(shakespeare_shards, tmp_path / "one"), nproc=1)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "network " not in one.stdout
    assert "network" not in json.loads((tmp_path / "one" / "config.json").read_text())
