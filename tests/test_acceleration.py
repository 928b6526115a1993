"""The acceleration ladder's library part (gpt2/doctor/acceleration.py); tests/test_bench.py runs bench/ladder.py."""

from __future__ import annotations

import torch

from gpt2.core.config import ModelConfig
from gpt2.doctor.acceleration import LADDER, TF32_OFF_CUDA, run_ladder, without_bf16


def test_a_device_without_fast_bf16_runs_the_rungs_after_it_in_fp32():
    rungs, skip = without_bf16(LADDER, "n/a: auto picks float32 here")
    assert [r.name for r in rungs] == [r.name for r in LADDER]
    assert skip == {"bf16": "n/a: auto picks float32 here"}
    after = [r for r in rungs if r.name in ("compile", "flash", "vocab")]
    assert all(not r.bf16 and r.switch.endswith("(fp32)") for r in after)
    assert [(r.compile, r.attn_impl, r.vocab_size) for r in after] == [
        (r.compile, r.attn_impl, r.vocab_size) for r in LADDER if r.name in ("compile", "flash", "vocab")
    ]


def test_skipped_rungs_carry_their_note_and_the_others_run():
    shape = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)
    peaks = {"bf16": 1e11, "fp32": 1e11}
    results = run_ladder(
        [LADDER[0], LADDER[1], LADDER[2]],
        shape,
        2,
        torch.device("cpu"),
        steps=1,
        warmup=1,
        peaks=peaks,
        skip={"bf16": "n/a: slower here"},
    )
    assert [r.note for r in results] == ["", TF32_OFF_CUDA, "n/a: slower here"]
    assert results[0].tokens_per_s > 0 and results[1].tokens_per_s is None and results[2].tokens_per_s is None
