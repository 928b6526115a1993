#!/usr/bin/env bash
# Before a GPU session, on this machine: .gpu/ (git-ignored, ~6 MiB) with nanoGPT at the pinned commit
# (from a local clone or mirror: NANOGPT_SOURCE, default /work/.mirror/karpathy+nanoGPT/repo), token
# shards of tinyshakespeare for the gpt2 shape, the corpus for the tests, and pytest's files.
# The device call then carries it: bench/README.md, "On a GPU".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 || command -v python )}
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" bench/gpu_session.py prepare \
    --nanogpt "${NANOGPT_SOURCE:-/work/.mirror/karpathy+nanoGPT/repo}" "$@"
