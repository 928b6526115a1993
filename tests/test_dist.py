"""gpt2/dist.py: the per-rank share of the node's CPUs for inductor's compile workers."""

from __future__ import annotations

import torch
import torch._inductor.config as inductor_config

from gpt2.dist import Dist, compile_threads, set_compile_threads, usable_cpus


def test_compile_threads_share_the_node_among_its_local_ranks():
    assert compile_threads(32, 8) == 4      # not 8 x 32 = 256 workers on a 32-core node
    assert compile_threads(32, 1) == 32
    assert compile_threads(30, 8) == 3      # rounded down: never more workers than cores
    assert compile_threads(2, 8) == 1       # at least one
    assert compile_threads(1, 0) == 1


def test_set_compile_threads_takes_effect_in_inductor():
    from torch._inductor.async_compile import get_compile_threads

    with inductor_config.patch(compile_threads=99):  # restored after (torch's own config patcher)
        for local_ranks in (1, 2, 64):
            dist = Dist(rank=0, local_rank=0, world_size=local_ranks, local_world_size=local_ranks,
                        device=torch.device("cpu"))
            expected = max(1, usable_cpus() // local_ranks)
            assert set_compile_threads(dist) == expected
            # what inductor's worker pool is sized from, when the first compilation creates it
            assert inductor_config.compile_threads == get_compile_threads() == expected
