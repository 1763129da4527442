#!/usr/bin/env bash
# Exported models against ONNX Runtime (from PyPI, in a virtual environment this script makes once
# for every build tree: build/onnx-venv of the source tree; exit 77, which ctest reports as skipped, when PyPI cannot be reached):
#   1. every preset, the example layer list and a list of every layer type: ONNX Runtime's logits
#      equal the CPU backend's within 1e-4 of the largest logit, folded, unfolded and uint8 input;
#   2. a model `stoke demo` trained for 5 epochs (about 97% top-1: enough samples near a decision
#      boundary for a difference to show), exported by the CLI: top-1 on the validation set through ONNX
#      Runtime within 0.2 points of `stoke eval`'s.
# Usage: onnx_runtime_test.sh path/to/stoke path/to/export_reference
set -euo pipefail
stoke=$1 reference=$2
here=$(cd "$(dirname "$0")" && pwd)
venv=${STOKE_ONNX_VENV:-$here/../../build/onnx-venv}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

source "$here/../testing/pypi_venv.sh"
pypi_venv "$venv" onnxruntime "the ONNX checker tests (export_test) still ran"
"$python" -c 'import onnxruntime; print("onnxruntime", onnxruntime.__version__)'

echo "== 1. every model: ONNX Runtime vs the CPU backend"
mkdir -p "$work/models"
"$reference" models "$work/models"
"$python" "$here/check_onnxruntime.py" models "$work/models"

echo "== 2. a trained demo model through export: validation top-1"
"$stoke" demo --dir "$work/demo" --epochs 5 --threads 2 2>/dev/null | tail -1
"$stoke" eval --run "$work/demo/run" --data "$work/demo/train_val.lmdb" --threads 2 --json >"$work/eval.json"
"$stoke" export --run "$work/demo/run" -o "$work/demo.onnx"
"$stoke" export --run "$work/demo/run" -o "$work/demo_u8.onnx" --uint8-input
mkdir -p "$work/val"
"$reference" val "$work/demo/run" "$work/val"
"$python" "$here/check_onnxruntime.py" val "$work/val" "$work/eval.json" "$work/demo.onnx" "$work/demo_u8.onnx"
