"""What the gradient all-reduce will cost: measured once at start-up, weighed against the planned compute.

Multi-node runs are where the network surprises: NCCL falling back to TCP sockets where InfiniBand was
expected turns a 1% all-reduce into half of every step, and nothing else in the log says so. The
trainer times an all-reduce of one gradient bucket after the process group starts and prints one line.

Bandwidths follow nccl-tests' definitions (doc/PERFORMANCE.md there):
    algbw = bytes / time
    busbw = algbw * 2 (n - 1) / n     (all-reduce: what each link carries, comparable across n)
An all-reduce of S bytes then takes about S / algbw.

Under --parallel fsdp no gradient is all-reduced: each micro-step all-gathers every unit's weights
twice (forward, and again in backward: units reshard after their forward) and the step's last
micro-step reduce-scatters the gradients once. The same links carry them: a ring all-gather or
reduce-scatter of S bytes (the whole tensor's) moves S (n - 1) / n per rank, so its busbw is
algbw (n - 1) / n and it takes about S (n - 1) / n / busbw at the all-reduce's measured busbw.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as tdist

from gpt2.distributed.group import Dist, barrier, collective

WARN_SHARE = 0.2
"""Warn when one step's gradient all-reduce would take more than this share of its planned compute."""
GRAD_BYTES_PER_PARAM = 4
"""DDP all-reduces fp32 gradients (weights stay fp32 under autocast), once per optimizer step."""


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s of an all-reduce of nbytes that took seconds over world_size ranks."""
    if nbytes <= 0 or seconds <= 0 or world_size < 2:
        raise ValueError(
            f"bus_bandwidth needs nbytes > 0, seconds > 0 and world_size >= 2, got {nbytes}, {seconds}, {world_size}"
        )
    algbw = nbytes / seconds
    return algbw, algbw * 2 * (world_size - 1) / world_size


@dataclass(frozen=True, kw_only=True)
class NetworkCost:
    """One start-up measurement and what it predicts for a step (written to config.json)."""

    backend: str
    world_size: int
    bucket_bytes: int
    """Bytes of the timed all-reduce: one gradient bucket (--ddp-bucket-cap-mb, or all gradients if fewer)."""
    allreduce_s: float
    """Median time of the timed rounds."""
    algbw_bytes_per_s: float
    busbw_bytes_per_s: float
    grad_bytes: int
    """Gradient bytes all-reduced once per optimizer step (parameters x 4)."""
    step_allreduce_s: float
    """grad_bytes / algbw: the step's all-reduce at the measured rate, none of it hidden behind backward."""
    step_compute_s: float | None
    """The planner's compute time per step (FLOPs per rank over peak at its assumed MFU); None without a peak."""
    share: float | None
    """step_comm_s / step_compute_s."""
    parallel: str = "ddp"
    """ddp: the step's traffic is grad_bytes all-reduced; fsdp: all-gathers and a reduce-scatter (below)."""
    gather_bytes: int = 0
    """fsdp: bytes of one all-gather of every unit's weights (parameters x the compute dtype's size)."""
    gathers_per_step: int = 0
    """fsdp: all-gathers of the weights per optimizer step (2 per micro-step: forward and backward)."""
    reduce_scatter_bytes: int = 0
    """fsdp: bytes of the step's one gradient reduce-scatter (parameters x 4: reduced in fp32)."""
    step_bytes: int = 0
    """The collectives' bytes per step: grad_bytes (ddp), or gathers x gather_bytes + reduce_scatter_bytes."""
    nodes: int = 1
    """Hosts the ranks run on (world size / ranks per host): only with several is the network in the path."""
    step_comm_s: float = 0.0
    """The step's collectives at the measured rate: step_allreduce_s (ddp), or (fsdp) step_bytes x
    (n - 1) / n / busbw (ring all-gather and reduce-scatter)."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FsdpTraffic:
    """What one optimizer step of --parallel fsdp moves (gpt2/distributed/fsdp.py: blocks and the root are units)."""

    gather_bytes: int
    gathers_per_step: int
    reduce_scatter_bytes: int

    @property
    def step_bytes(self) -> int:
        return self.gathers_per_step * self.gather_bytes + self.reduce_scatter_bytes


def fsdp_traffic(n_params: int, param_bytes: int, accum_steps: int) -> FsdpTraffic:
    """Every micro-step gathers the weights in forward and again in backward (no-sync accumulation
    skips the reduce-scatter, not the gathers); the last one reduce-scatters fp32 gradients once."""
    if n_params <= 0 or param_bytes <= 0 or accum_steps <= 0:
        raise ValueError(
            f"fsdp_traffic needs positive n_params, param_bytes and accum_steps, "
            f"got {n_params}, {param_bytes}, {accum_steps}"
        )
    return FsdpTraffic(
        gather_bytes=n_params * param_bytes,
        gathers_per_step=2 * accum_steps,
        reduce_scatter_bytes=n_params * GRAD_BYTES_PER_PARAM,
    )


def network_cost(
    *,
    backend: str,
    world_size: int,
    nodes: int,
    bucket_bytes: int,
    allreduce_s: float,
    grad_bytes: int,
    step_compute_s: float | None,
    fsdp: FsdpTraffic | None = None,
) -> NetworkCost:
    """Pure arithmetic: the measured bucket time -> bandwidths -> the step's collectives (DDP's
    all-reduce, or fsdp's all-gathers and reduce-scatter) against its compute."""
    algbw, busbw = bus_bandwidth(bucket_bytes, allreduce_s, world_size)
    step_allreduce_s = grad_bytes / algbw
    extra = {}
    if fsdp is None:
        step_bytes, step_comm_s = grad_bytes, step_allreduce_s
    else:
        step_bytes = fsdp.step_bytes
        step_comm_s = step_bytes * (world_size - 1) / world_size / busbw
        extra = {
            "parallel": "fsdp",
            "gather_bytes": fsdp.gather_bytes,
            "gathers_per_step": fsdp.gathers_per_step,
            "reduce_scatter_bytes": fsdp.reduce_scatter_bytes,
        }
    share = step_comm_s / step_compute_s if step_compute_s else None
    return NetworkCost(
        backend=backend,
        world_size=world_size,
        nodes=nodes,
        bucket_bytes=bucket_bytes,
        allreduce_s=allreduce_s,
        algbw_bytes_per_s=algbw,
        busbw_bytes_per_s=busbw,
        grad_bytes=grad_bytes,
        step_allreduce_s=step_allreduce_s,
        step_compute_s=step_compute_s,
        share=share,
        step_bytes=step_bytes,
        step_comm_s=step_comm_s,
        **extra,
    )


def _what_a_step_moves(c: NetworkCost) -> str:
    if c.parallel != "fsdp":
        return f"a step's gradient all-reduce ({c.grad_bytes / 1e6:,.0f} MB)"
    return (
        f"a step's fsdp traffic ({c.gathers_per_step} all-gathers of {c.gather_bytes / 1e6:,.0f} MB weights "
        f"+ 1 reduce-scatter of {c.reduce_scatter_bytes / 1e6:,.0f} MB fp32 gradients = "
        f"{c.step_bytes / 1e6:,.0f} MB, ring: x {c.world_size - 1}/{c.world_size} at busbw)"
    )


def format_network_cost(c: NetworkCost) -> str:
    """The one start-up line."""
    against = (
        "no planned compute to compare with (no peak FLOP/s for this device)"
        if c.share is None
        else f"{c.share:.0%} of the planned {c.step_compute_s:.3g} s of compute per step"
    )
    return (
        f"network    all-reduce of {c.bucket_bytes / 2**20:.1f} MiB over {c.world_size} ranks ({c.backend}): "
        f"{c.allreduce_s * 1e3:.1f} ms, algbw {c.algbw_bytes_per_s / 1e9:.2f} GB/s, busbw "
        f"{c.busbw_bytes_per_s / 1e9:.2f} GB/s; {_what_a_step_moves(c)} ~{c.step_comm_s:.3g} s = {against}"
    )


def network_warning(c: NetworkCost, threshold: float = WARN_SHARE) -> str | None:
    """A warning when the step's collectives would exceed threshold of the step's compute, else None.

    What it blames depends on where the bytes go. Across nodes it is the network (NCCL on TCP sockets
    where InfiniBand was expected is the usual cause). On one node there is no network: GPUs talk over
    NVLink or PCIe, so the advice is about those links; CPU ranks (gloo) on one host all-reduce through
    the host's own memory, whose share of a CPU step nothing can tune away, so there is no warning (the
    start-up's network line, in RUN/train.log, still gives the number)."""
    if c.share is None or c.share <= threshold:
        return None
    what = "the gradient all-reduce" if c.parallel != "fsdp" else "fsdp's all-gathers and reduce-scatter"
    head = (
        f"{what} would take {c.share:.0%} of each step's compute (busbw {c.busbw_bytes_per_s / 1e9:.2f} GB/s "
        f"over {c.world_size} ranks on {c.nodes} node(s))."
    )
    if c.nodes > 1 and c.backend == "nccl":
        return (
            f"{head} Across nodes this is usually NCCL over TCP sockets where InfiniBand was expected: run with "
            "NCCL_DEBUG=INFO and look for 'NET/IB' (not 'NET/Socket'), check NCCL_IB_DISABLE / NCCL_IB_HCA, and "
            "NCCL_SOCKET_IFNAME for the interface sockets use"
        )
    if c.nodes > 1:
        return (
            f"{head} Across nodes {c.backend} goes over TCP, so the link between the nodes is the limit: "
            "check that GLOO_SOCKET_IFNAME names the fastest interface"
        )
    if c.backend == "nccl":
        return (
            f"{head} All ranks are on one node, so this is the GPUs' own links, not the network: `nvidia-smi "
            "topo -m` shows whether they talk over NVLink or only PCIe, and NCCL_P2P_DISABLE should be unset"
        )
    return None


def time_all_reduce(nbytes: int, dist: Dist, *, warmup: int = 2, rounds: int = 5) -> float:
    """Median seconds of an all-reduce of nbytes of fp32 on this rank's device, after warm-up rounds.

    The first calls pay for connection set-up (and NCCL's lazy communicator init); rounds after it
    measure the steady rate. On CUDA each round waits for the device, since NCCL returns at once.
    """
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=dist.device)
    times = []
    with collective("the start-up all-reduce bandwidth test"):
        barrier(dist)
        for i in range(warmup + rounds):
            t0 = time.perf_counter()
            tdist.all_reduce(buf)
            if dist.device.type == "cuda":
                torch.cuda.synchronize(dist.device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_network(
    dist: Dist, *, bucket_cap_mb: float, n_params: int, step_compute_s: float | None, fsdp: FsdpTraffic | None = None
) -> NetworkCost | None:
    """Time one bucket's all-reduce and predict the step's (fsdp: its all-gathers and reduce-scatter
    at the same busbw); None on one process (nothing to reduce).

    Every rank times (the all-reduce needs them all) and takes rank 0's median, so all ranks agree.
    """
    if not dist.is_distributed:
        return None
    grad_bytes = n_params * GRAD_BYTES_PER_PARAM
    bucket_bytes = min(int(bucket_cap_mb * 2**20), grad_bytes)
    seconds = time_all_reduce(bucket_bytes, dist)
    agreed = torch.tensor([seconds], dtype=torch.float64, device=dist.device)
    with collective("broadcast of the bandwidth test's time"):
        tdist.broadcast(agreed, src=0)
    return network_cost(
        backend=tdist.get_backend(),
        world_size=dist.world_size,
        nodes=max(1, dist.world_size // max(1, dist.local_world_size)),
        bucket_bytes=bucket_bytes,
        allreduce_s=agreed.item(),
        grad_bytes=grad_bytes,
        step_compute_s=step_compute_s,
        fsdp=fsdp,
    )
