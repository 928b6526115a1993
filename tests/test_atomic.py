"""gpt2/core/atomic.py: every file the project writes ends with the mode a plain open() would give it
(0666 less the umask), whatever writes it: atomic_write's private temp file, or safetensors."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from gpt2.ckpt import checkpoint as ckpt
from gpt2.core import atomic

# umask -> the mode open(path, "w") gives a new file
UMASKS = {0o022: 0o644, 0o077: 0o600, 0o002: 0o664}


@pytest.fixture(params=sorted(UMASKS), ids=lambda m: f"umask{m:03o}")
def umask(request):
    """Run the test under this umask (process-wide), restored afterwards."""
    before = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(before)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def plain_open_mode(tmp_path) -> int:
    """What open() really gives under the current umask: the reference, not a formula."""
    probe = tmp_path / "plain-open-probe"
    with open(probe, "w"):
        pass
    try:
        return mode(probe)
    finally:
        probe.unlink()


def test_current_umask_reads_without_changing_it(umask, monkeypatch):
    assert atomic.current_umask() == umask
    assert atomic.current_umask() == umask  # reading did not change it
    assert atomic.plain_file_mode() == UMASKS[umask]

    def no_proc(*args, **kwargs):  # not Linux (or /proc not mounted): the os.umask pair
        raise FileNotFoundError("/proc/self/status")

    monkeypatch.setattr(atomic, "open", no_proc, raising=False)
    assert atomic.current_umask() == umask
    monkeypatch.undo()
    assert atomic.current_umask() == umask  # the fallback restored it


def test_atomic_write_gives_the_plain_open_mode(tmp_path, umask):
    atomic.atomic_write_text(tmp_path / "f.txt", "x")
    assert mode(tmp_path / "f.txt") == UMASKS[umask] == plain_open_mode(tmp_path)
    atomic.atomic_write_text(tmp_path / "f.txt", "y")  # replacing keeps it too
    assert mode(tmp_path / "f.txt") == UMASKS[umask]


def test_checkpoint_sidecar_and_latest_get_the_plain_open_mode(tmp_path, umask):
    path = ckpt.save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(10)}}, keep=1)
    for p in (path, path.with_suffix(".json"), path.parent / "latest"):
        assert mode(p) == UMASKS[umask], p.name


def test_data_prep_shards_and_manifest_get_the_plain_open_mode(tmp_path, umask, shakespeare_path):
    from data_prep.pipeline import prepare
    from data_prep.prep_config import PrepConfig

    src = tmp_path / "corpus.txt"
    src.write_text(shakespeare_path.read_text()[:20_000])
    out = tmp_path / "shards"
    prepare(
        PrepConfig(
            sources=(str(src),), out=out, shard_tokens=2000, val_tokens=500, progress=False, txt_sample_by="paragraph"
        ),
        log=lambda m: None,
    )
    files = sorted(out.iterdir())
    assert len([p for p in files if p.suffix == ".bin"]) >= 2 and (out / "manifest.json") in files
    assert {p.name: mode(p) for p in files} == {p.name: UMASKS[umask] for p in files}


def test_hugging_face_export_gets_the_plain_open_mode(tmp_path, umask):
    """safetensors writes model.safetensors 0600 whatever the umask: a teammate could not load it."""
    pytest.importorskip("safetensors")
    from gpt2.core.config import ModelConfig
    from gpt2.export import export
    from gpt2.model.gpt import GPT

    out = export(GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)), tmp_path / "hf")
    files = sorted(p.name for p in out.iterdir())
    assert {"model.safetensors", "config.json", "vocab.json", "merges.txt", "tokenizer_config.json"} <= set(files)
    assert {name: mode(out / name) for name in files} == {name: UMASKS[umask] for name in files}
