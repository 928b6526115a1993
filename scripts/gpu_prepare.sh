#!/usr/bin/env bash
# Before a GPU session, on this machine: .gpu/ (git-ignored, ~8 MiB) with nanoGPT at the pinned commit
# (from --nanogpt PATH_OR_URL, else $NANOGPT_DIR, a local clone or mirror, else GitHub; --nanogpt none
# prepares without it), token shards of tinyshakespeare for the gpt2 shape, the GPT-2 tokenizer's files,
# the corpus for the tests, and pytest's files. The device call then carries it: bench/README.md, "On a GPU".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 || command -v python )}
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" bench/gpu_session.py prepare "$@"
