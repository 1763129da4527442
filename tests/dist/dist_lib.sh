# Shared by the multi-rank CLI tests (after tests/tools/cli_lib.sh and setting $stoke): a small
# packed dataset, the run config, and a long run whose rank is killed.

# skip REASON: the test cannot run here (ctest counts exit 77 as skipped).
skip() {
  echo "SKIPPED: $*"
  exit 77
}

# make_dataset: $work/train.lmdb and $work/train_val.lmdb, 4 classes of synthetic pictures.
make_dataset() {
  "$stoke" synth "$work/images" --classes 4 --per-class 40 >/dev/null || exit 1
  "$stoke" pack "$work/images" "$work/train.lmdb" --val-fraction 0.2 -q >/dev/null || exit 1
}

# config NAME EPOCHS [EXTRA_DATA_YAML]: $work/NAME.yaml, a small CPU model (with a batch-norm layer
# when $dist_batchnorm is set) running in $work/NAME; $dist_keys is added to its dist: block.
config() {
  local bn=""
  [[ -n ${dist_batchnorm:-} ]] && bn=$'\n    - {type: batchnorm}'
  cat >"$work/$1.yaml" <<YAML
data: {train: $work/train.lmdb, val: $work/train_val.lmdb, batch_size: 16, threads: 1, image_size: 16, val_resize: 18${3:-}}
model:
  classes: 4
  layers:
    - {type: conv, out: 8, kernel: 3, pad: 1}$bn
    - {type: relu}
    - {type: maxpool, kernel: 2}
    - {type: flatten}
    - {type: linear, out: 4}
optimizer: {lr: 0.1}
epochs: $2
compute_threads: 1
backend: cpu
run_dir: $work/$1
log_every_steps: 2
dist: {timeout_s: 60${dist_keys:-}}
YAML
}

# figures NAME: every loss and accuracy figure rank 0 logged (no timings), one per line.
figures() { grep -oE '"(loss|top1|top5|world)":[^,}]*' "$work/$1/metrics.jsonl"; }

# same_figures TEST A B: runs A and B logged the same figures (both non-empty).
same_figures() {
  if [[ -s $work/$2/metrics.jsonl ]] && cmp -s <(figures "$2") <(figures "$3"); then
    echo "ok   $1 ($(figures "$2" | wc -l) logged figures identical)"
    passed=$((passed + 1))
  else
    echo "FAIL $1: the logged figures differ"
    diff <(figures "$2") <(figures "$3") | head -10 | sed 's/^/    /'
    failures=$((failures + 1))
  fi
}

# start_long NAME FIND LAUNCHER...: a 500-epoch run of config NAME under LAUNCHER in the background
# ($job, output in $work/NAME.out); once it trains, $victim is the pid `FIND NAME` prints.
start_long() {
  local name=$1 find=$2
  shift 2
  config "$name" 500
  timeout 300 "$@" "$stoke" train --config "$work/$name.yaml" -q >"$work/$name.out" 2>&1 &
  job=$!
  victim=""
  for _ in $(seq 1 600); do
    if grep -qs '"type":"train"' "$work/$name/metrics.jsonl"; then
      victim=$("$find" "$name")
      [[ -n $victim ]] && break
    fi
    sleep 0.1
  done
}

# A process of `stoke train --config $work/NAME.yaml` whose environment holds VAR=VALUE.
rank_with_env() {  # rank_with_env NAME VAR=VALUE
  for pid in $(pgrep -f "$work/$1.yaml"); do
    if [[ $(cat "/proc/$pid/comm" 2>/dev/null) == stoke ]] &&
      tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "$2"; then
      echo "$pid"
      return
    fi
  done
}

# kill_expect_end TEST NAME WHO: SIGKILL $victim of start_long NAME; the job must end, non-zero,
# within 30 s.
kill_expect_end() {
  local test=$1 name=$2 who=$3
  if [[ -z $victim ]]; then
    echo "FAIL $test: training did not start, or $who was not found"
    failures=$((failures + 1))
    kill "$job" 2>/dev/null
    return
  fi
  local start rc ms
  start=$(date +%s%N)
  kill -9 "$victim"
  wait "$job"
  rc=$?
  ms=$((($(date +%s%N) - start) / 1000000))
  if [[ $rc -ne 0 && $ms -lt 30000 ]]; then
    echo "ok   $test (the job ended with exit $rc, $ms ms after $who was killed)"
    passed=$((passed + 1))
  else
    echo "FAIL $test: exit $rc after $ms ms"
    sed 's/^/    /' "$work/$name.out" | tail -20
    if declare -F diagnose >/dev/null; then diagnose 2>&1 | sed 's/^/    /'; fi
    failures=$((failures + 1))
  fi
}

# expect_stopped TEST NAME RC: run NAME was asked to stop and did: exit 0, rank 0 said where, and
# its checkpoint is there ($work/NAME.out holds the output). RC is the job's exit status (any
# other text: why it was not even asked).
expect_stopped() {
  local test=$1 name=$2 rc=$3
  if [[ $rc == 0 ]] && grep -qE "stopped at step [0-9]+; continue with" "$work/$name.out" &&
    ls "$work/$name/checkpoints" 2>/dev/null | grep -q step-; then
    echo "ok   $test ($(grep -oE 'stopped at step [0-9]+' "$work/$name.out"))"
    passed=$((passed + 1))
  else
    echo "FAIL $test: exit $rc"
    sed 's/^/    /' "$work/$name.out" | tail -20
    failures=$((failures + 1))
  fi
}
