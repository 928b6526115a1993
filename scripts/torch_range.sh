#!/usr/bin/env bash
# The declared torch range, tested: for each torch release given (default: the oldest supported and the
# newest tested, below), a venv of its own (.venv-torch-VERSION, kept for the next run), torch installed as
# a user would (`pip install torch==VERSION`, the regular wheels, which also run on a CPU), then this project
# with its test extras, then the compatibility subset: the fast unit tests that touch torch's APIs and the
# end-to-end commands of tests/test_torch_range.py (torchrun DDP, compile, Muon, FSDP, kill -9 and resume,
# sample, eval, export). .ci/run runs it after the main suite.
# Usage: bash scripts/torch_range.sh [VERSION ...]
# TORCH_RANGE_KEEP=0 removes each venv once its tests have run and keeps no wheel in pip's cache (each venv
# is ~5 GB of CUDA wheels): .ci/run sets it, as CI's machine is new every time and its disk is not large.
set -euo pipefail
cd "$(dirname "$0")/.."
# The floor must match gpt2/core/compat.py's TORCH_FLOOR (tests/test_compat.py checks it).
FLOOR=2.5.1
NEWEST=2.15.0
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=("$FLOOR" "$NEWEST")
SUBSET=(tests/test_compat.py tests/test_torch_range.py tests/test_gpt.py tests/test_precision.py
        tests/test_loss.py tests/test_checkpoint.py tests/test_state.py tests/test_writer.py
        tests/test_group.py tests/test_muon.py tests/test_fsdp.py)

# A site-wide pip configuration may cap torch (seen: /etc/xdg/pip's constraint torch<=2.14.1), which makes
# the newest tested release impossible to install and would make `pip install -e .` swap it back for the
# capped one. These venvs exist to test exactly the release named, so their pip reads no configuration
# file (PIP_* environment variables still apply). The default setup (scripts/setup.sh) is left as it is.
nocfg=(env PIP_CONFIG_FILE=/dev/null)
KEEP=${TORCH_RANGE_KEEP:-1}
[ "$KEEP" = 1 ] || nocfg+=(PIP_NO_CACHE_DIR=1 UV_NO_CACHE=1)
# uv (the dev extra installs it into .venv) unpacks the ~2.6 GB of CUDA wheels about 4x faster than pip
# (69 s against 261 s for torch 2.5.1 on the 2-core CI machine, docs/testing.md); it reads no pip configuration,
# so no cap applies. Without it, pip, as before.
UV=${UV:-$(command -v uv || { [ -x .venv/bin/uv ] && echo .venv/bin/uv; } || true)}
install() {  # install PYTHON PIP-ARGS...: into that venv, with uv where there is one, else its own pip
  local py=$1
  shift
  if [ -n "$UV" ]; then
    "${nocfg[@]}" "$UV" pip install -q --python "$py" "$@"
  else
    "${nocfg[@]}" "$py" -m pip install -q "$@"
  fi
}

for v in "${VERSIONS[@]}"; do
  env=".venv-torch-$v"
  py="$env/bin/python"
  [ -x "$py" ] || python3 -m venv "$env"
  have=$("$py" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
  if [ "$have" != "$v" ]; then
    echo "torch_range: installing torch==$v into $env${UV:+ (uv)}"
    [ -n "$UV" ] || "${nocfg[@]}" "$py" -m pip install -q --upgrade pip > "$env/setup.log" 2>&1
    install "$py" "torch==$v" >> "$env/setup.log" 2>&1 || { cat "$env/setup.log"; exit 1; }
  fi
  # The project over the torch already there (torch>=floor is satisfied, so the installer keeps it): what a
  # cluster user's `pip install -e .` does.
  install "$py" -e ".[dev]" >> "$env/setup.log" 2>&1 || { cat "$env/setup.log"; exit 1; }
  got=$("$py" -c "import torch; print(torch.__version__)")
  # Never test a torch other than the one named (a cap or a resolver swap would do that silently).
  [ "${got%%+*}" = "$v" ] || { echo "torch_range: asked for torch $v, $env has $got"; exit 1; }
  echo "torch_range: torch $got: ${#SUBSET[@]} test files"
  set +e
  # The subset's default tests (its long ones are in .ci/run's long pass, on the main venv's torch), and
  # test_torch_range: the end-to-end runs, on this torch only.
  "$py" -m pytest -q -n auto -p no:cacheprovider -m "not slurm and not soak and not slow" "${SUBSET[@]}"
  rc=$?
  set -e
  if [ "$KEEP" != 1 ]; then rm -rf "$env"; fi
  if [ "$rc" -ne 0 ]; then echo "torch_range: torch $got: FAILED (pytest exit $rc)"; exit "$rc"; fi
done
