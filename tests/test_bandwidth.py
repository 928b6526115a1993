"""gpt2/distributed/bandwidth.py: the start-up all-reduce measurement, its arithmetic, and the trainer's line."""

from __future__ import annotations

import json

import pytest
from conftest import TINY_MODEL_FLAGS, run_trainer

from gpt2.distributed.bandwidth import bus_bandwidth, format_network_cost, fsdp_traffic, network_cost, network_warning

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
    c = network_cost(
        backend="nccl",
        world_size=32,
        nodes=4,
        bucket_bytes=25 * 2**20,
        allreduce_s=0.01,
        grad_bytes=124_475_904 * 4,
        step_compute_s=0.5,
    )
    assert c.algbw_bytes_per_s == pytest.approx(2.62144e9)
    assert c.busbw_bytes_per_s == pytest.approx(2.62144e9 * 2 * 31 / 32)
    assert c.step_allreduce_s == pytest.approx(0.18994, rel=1e-4)
    assert c.share == pytest.approx(0.37988, rel=1e-4)
    line = format_network_cost(c)
    assert line.startswith(
        "network    all-reduce of 25.0 MiB over 32 ranks (nccl): 10.0 ms, algbw 2.62 GB/s, "
        "busbw 5.08 GB/s; a step's gradient all-reduce (498 MB) ~0.19 s = 38% of the planned "
        "0.5 s of compute per step"
    ), line
    warning = network_warning(c)
    assert "38%" in warning and "NCCL_IB" in warning and "NCCL_SOCKET_IFNAME" in warning


def test_a_fast_network_or_an_unknown_compute_time_gives_no_warning():
    # InfiniBand-class: 25 MiB in 1 ms (26 GB/s) -> 0.019 s, 3.8% of the same step.
    fast = network_cost(
        backend="nccl",
        world_size=32,
        nodes=4,
        bucket_bytes=25 * 2**20,
        allreduce_s=0.001,
        grad_bytes=124_475_904 * 4,
        step_compute_s=0.5,
    )
    assert fast.share == pytest.approx(0.037988, rel=1e-4) and network_warning(fast) is None
    assert network_warning(fast, threshold=0.03) is not None  # the threshold is what decides
    unknown = network_cost(
        backend="nccl", world_size=2, nodes=2, bucket_bytes=MB, allreduce_s=0.1, grad_bytes=4 * MB, step_compute_s=None
    )
    assert unknown.share is None and network_warning(unknown) is None
    assert "no planned compute to compare with" in format_network_cost(unknown)


def test_only_several_nodes_are_warned_about_the_network():
    """The same slow all-reduce (38% of a step): across nodes the warning is about the network (NCCL's
    sockets vs InfiniBand, gloo's TCP interface); on one node there is no network: GPUs get a warning
    about their own links, and CPU ranks (gloo, one host: a 2-rank CPU run) none at all."""

    def cost(backend, nodes):
        return network_cost(
            backend=backend,
            world_size=8,
            nodes=nodes,
            bucket_bytes=25 * 2**20,
            allreduce_s=0.01,
            grad_bytes=124_475_904 * 4,
            step_compute_s=0.5,
        )

    across = network_warning(cost("nccl", 2))
    assert "Across nodes" in across and "InfiniBand" in across and "on 2 node(s)" in across
    assert "GLOO_SOCKET_IFNAME" in network_warning(cost("gloo", 4))
    one_node_gpus = network_warning(cost("nccl", 1))
    assert "InfiniBand" not in one_node_gpus and "NCCL_IB" not in one_node_gpus and "nvidia-smi topo" in one_node_gpus
    assert network_warning(cost("gloo", 1)) is None
    assert cost("gloo", 1).to_dict()["nodes"] == 1


def test_fsdp_step_is_two_gathers_per_micro_step_and_one_reduce_scatter_at_ring_busbw():
    # 124,475,904 parameters in bf16 (2 B gathered), 2 micro-steps: 4 all-gathers of 249.0 MB and one
    # fp32 reduce-scatter of 497.9 MB = 1493.7 MB. The same 25 MiB all-reduce in 10 ms over 32 ranks
    # (busbw 5.08 GB/s); a ring moves 31/32 of it: 1493.7 MB x 31/32 / 5.08 GB/s = 0.285 s, 57% of 0.5 s.
    t = fsdp_traffic(124_475_904, 2, 2)
    assert (t.gather_bytes, t.gathers_per_step, t.reduce_scatter_bytes) == (248_951_808, 4, 497_903_616)
    assert t.step_bytes == 4 * 248_951_808 + 497_903_616
    c = network_cost(
        backend="nccl",
        world_size=32,
        nodes=4,
        bucket_bytes=25 * 2**20,
        allreduce_s=0.01,
        grad_bytes=124_475_904 * 4,
        step_compute_s=0.5,
        fsdp=t,
    )
    busbw = 2.62144e9 * 2 * 31 / 32
    assert c.parallel == "fsdp" and c.step_bytes == t.step_bytes
    assert c.step_comm_s == pytest.approx(t.step_bytes * 31 / 32 / busbw) == pytest.approx(0.28491, rel=1e-4)
    assert c.share == pytest.approx(c.step_comm_s / 0.5)
    line = format_network_cost(c)
    assert "\n" not in line and "all-reduce" not in line.split(";")[1], line
    assert line.endswith(
        "a step's fsdp traffic (4 all-gathers of 249 MB weights + 1 reduce-scatter of 498 MB fp32 "
        "gradients = 1,494 MB, ring: x 31/32 at busbw) ~0.285 s = 57% of the planned 0.5 s of "
        "compute per step"
    ), line
    assert network_warning(c).startswith("fsdp's all-gathers and reduce-scatter would take 57%")
    # DDP's line and numbers are what they were; its step_comm_s is its all-reduce
    ddp = network_cost(
        backend="nccl",
        world_size=32,
        nodes=4,
        bucket_bytes=25 * 2**20,
        allreduce_s=0.01,
        grad_bytes=124_475_904 * 4,
        step_compute_s=0.5,
    )
    assert ddp.parallel == "ddp" and ddp.step_comm_s == ddp.step_allreduce_s and ddp.step_bytes == ddp.grad_bytes
    # fp32 on 2 ranks: busbw = algbw and a ring moves half of each tensor
    two = network_cost(
        backend="gloo",
        world_size=2,
        nodes=1,
        bucket_bytes=MB,
        allreduce_s=0.01,
        grad_bytes=4 * MB,
        step_compute_s=None,
        fsdp=fsdp_traffic(MB, 4, 1),
    )
    assert two.step_bytes == 3 * 4 * MB and two.step_comm_s == pytest.approx(12 * MB / 2 / 1e8)
    with pytest.raises(ValueError, match="fsdp_traffic needs positive"):
        fsdp_traffic(MB, 4, 0)


def _flags(data_dir, out_dir):
    return [
        *TINY_MODEL_FLAGS,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--compile",
        "false",
        "--sample-interval",
        "0",
        "--plot",
        "false",
        "--data-dir",
        str(data_dir),
        "--out-dir",
        str(out_dir),
        "--micro-batch-size",
        "2",
        "--total-batch-size",
        "256",
        "--max-steps",
        "1",
        "--eval-tokens",
        "0",
        "--ckpt-interval",
        "0",
    ]


@pytest.mark.slow
def test_two_ranks_log_the_network_line_and_record_it_one_process_does_not(tmp_path, shakespeare_shards):
    two = run_trainer(_flags(shakespeare_shards, tmp_path / "two"), nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    log = (tmp_path / "two" / "train.log").read_text()  # a start-up detail: RUN/train.log, or --verbose
    lines = [line for line in log.splitlines() if line.startswith("network    all-reduce of ")]
    assert len(lines) == 1, log  # one line, from rank 0
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
    assert "network " not in (tmp_path / "one" / "train.log").read_text()
    assert "network" not in json.loads((tmp_path / "one" / "config.json").read_text())


def test_fsdp_ranks_log_what_an_fsdp_step_moves(tmp_path, shakespeare_shards):
    """Under --parallel fsdp the line and config.json count the all-gathers and the reduce-scatter
    (fp32 on a CPU: 4 B gathered per parameter), not DDP's all-reduce."""
    two = run_trainer([*_flags(shakespeare_shards, tmp_path / "two"), "--parallel", "fsdp", "--verbose"], nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    lines = [line for line in two.stdout.splitlines() if line.startswith("network    ")]
    assert len(lines) == 1 and "a step's fsdp traffic (2 all-gathers of " in lines[0], two.stdout
    net = json.loads((tmp_path / "two" / "config.json").read_text())["network"]
    params = json.loads((tmp_path / "two" / "config.json").read_text())["params"]
    assert net["parallel"] == "fsdp" and net["gathers_per_step"] == 2  # 256 tokens = 2 ranks x 2 x 64: 1 micro-step
    assert net["gather_bytes"] == net["reduce_scatter_bytes"] == net["grad_bytes"]
    assert net["gather_bytes"] == 4 * params
    assert net["step_bytes"] == 3 * net["gather_bytes"]
    assert net["step_comm_s"] == pytest.approx(net["step_bytes"] / 2 / net["busbw_bytes_per_s"])
    assert net["share"] == pytest.approx(net["step_comm_s"] / net["step_compute_s"])
