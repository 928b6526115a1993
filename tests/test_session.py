"""gpt2/train/session.py, bench/'s door into the trainer: a Session steps exactly as the trainer's run
does (the same losses, bit for bit, as train_ddp.py with the same flags), reads its numbers, closes."""

from __future__ import annotations

from _helpers import import_train_ddp, losses, tiny_run_flags

from gpt2.distributed.group import single_process
from gpt2.train.session import Session, parse_config


def test_a_session_steps_to_the_trainers_own_losses(tmp_path, shakespeare_shards):
    flags = tiny_run_flags(shakespeare_shards, max_steps=2, ckpt_interval=0, eval_tokens=256)
    assert import_train_ddp().main([*flags, "--out-dir", str(tmp_path / "run")]) == 0
    session = Session(parse_config([*flags, "--out-dir", str(tmp_path / "session")]), single_process("cpu"))
    got = {}
    for _ in range(2):
        stats = session.step()
        got[stats.step] = stats["loss"]
    assert got == losses(tmp_path / "run")
    assert session.steps == 2 and len(session.step_s) == 2 and session.accum_steps == 2
    assert session.tokens_per_s() > 0 and session.memory_mb() > 0
    assert session.evaluate() > 0
    session.close()
    assert session.parts is None
