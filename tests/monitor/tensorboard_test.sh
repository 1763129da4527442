#!/usr/bin/env bash
# A run's TensorBoard event files read back by TensorBoard itself (from PyPI, in a virtual
# environment this script makes once: build/tb-venv of the source tree; exit 77, which ctest
# reports as skipped, when PyPI cannot be reached). The run is trained, stopped, and resumed from
# an earlier checkpoint, so the files must also have dropped the steps the resume replaced.
# Usage: tensorboard_test.sh path/to/stoke
set -euo pipefail
stoke=$1
here=$(cd "$(dirname "$0")" && pwd)
venv=${STOKE_TB_VENV:-$here/../../build/tb-venv}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

source "$here/../testing/pypi_venv.sh"
pypi_venv "$venv" tensorboard "the event-file tests of monitor_test and train_test still ran"

echo "== a run: 2 epochs, stopped at step 9, resumed from its oldest checkpoint (the end of epoch 1)"
"$stoke" demo --dir "$work/demo" --per-class 40 --epochs 1 --threads 2 >/dev/null
cfg=$work/run.yaml
sed "s|run_dir: .*|run_dir: $work/run|; s|^epochs: .*|epochs: 2|; s|log_every_steps: .*|log_every_steps: 2|" \
  "$work/demo/demo.yaml" >"$cfg"
grep -q "log_every_steps" "$cfg" || echo "log_every_steps: 2" >>"$cfg"
"$stoke" train --config "$cfg" --max-steps 9 -q >/dev/null
first=$(ls "$work/run/checkpoints" | head -1)
"$stoke" train --config "$cfg" --resume "$work/run/checkpoints/$first" -q >/dev/null
echo "resumed from $first"
"$python" "$here/check_tensorboard.py" "$work/run"
