#!/usr/bin/env bash
# Create (or bring up to date) the Python environment diag's torch-xla-<platform> backend
# runs its worker in:
#     scripts/torch-xla-env.sh DEST
#     diag run --backend torch-xla-cpu --python torch-xla=DEST/bin/python ...
#     (or: export DIAG_PYTHON_TORCH_XLA=DEST/bin/python)
#
# Why a venv of its own: torch-xla 2.9.0 needs torch 2.9.x (not declared in its metadata;
# beside another torch, `import torch_xla` fails with an undefined-symbol ImportError), while
# diag's own environment may hold any torch. diag puts its checkout on the worker's
# PYTHONPATH, so only what diag's worker imports is installed here (no diag, no jax).
# On plain PyPI the Linux torch==2.9.0 wheel is the CUDA build: about 3.8 GB to download and
# 7.1 GB on disk, about 2 minutes here. Running it again on an existing DEST only checks it
# (seconds), so CI can keep DEST between runs. torch-xla 2.9.0 has wheels for CPython
# 3.10-3.13 (manylinux_2_28 x86_64); DIAG_TORCH_XLA_BASE_PYTHON picks the interpreter.
set -euo pipefail
dest="${1:?usage: scripts/torch-xla-env.sh DEST (a new or existing venv directory)}"
py="${DIAG_TORCH_XLA_BASE_PYTHON:-}"
if [ -z "$py" ]; then
  for candidate in python3.11 python3.12 python3.10 python3.13 python3; do
    if command -v "$candidate" >/dev/null &&
       "$candidate" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 13))'; then
      py="$candidate"
      break
    fi
  done
fi
[ -n "$py" ] || { echo "torch-xla-env.sh: no Python 3.10-3.13 found; set DIAG_TORCH_XLA_BASE_PYTHON" >&2; exit 2; }
[ -x "$dest/bin/python" ] || "$py" -m venv "$dest"
"$dest/bin/python" -m pip install -q --disable-pip-version-check \
  torch==2.9.0 torch-xla==2.9.0 numpy ml_dtypes mpmath
"$dest/bin/python" -c 'import torch, torch_xla; print("torch", torch.__version__, "torch_xla", torch_xla.__version__)'
