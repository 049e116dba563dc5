#!/usr/bin/env bash
# Create the Python environment diag's torch-xla-<platform> backend runs its worker in.
#
# torch_xla needs its own torch (torch-xla 2.9.0 wants torch 2.9.x; beside another torch,
# `import torch_xla` fails with an undefined-symbol ImportError), so it lives in a venv of
# its own and diag starts the torch-xla worker under that venv's python:
#     scripts/torch-xla-env.sh /path/to/venv
#     diag run --backend torch-xla-cpu --python torch-xla=/path/to/venv/bin/python ...
# diag puts its own checkout on the worker's PYTHONPATH, so only diag's worker-side
# dependencies are installed here. On plain PyPI, Linux torch==2.9.0 is the CUDA build:
# about 3.8 GB to download and 7 GB on disk.
set -euo pipefail
dest="${1:?usage: scripts/torch-xla-env.sh DEST (a new or existing venv directory)}"
py="${DIAG_TORCH_XLA_BASE_PYTHON:-python3.11}"
"$py" -m venv "$dest"
"$dest/bin/python" -m pip install -q --upgrade pip
"$dest/bin/python" -m pip install -q torch==2.9.0 torch-xla==2.9.0 numpy ml_dtypes mpmath
"$dest/bin/python" -c 'import torch, torch_xla; print("torch", torch.__version__, "torch_xla", torch_xla.__version__)'
