#!/usr/bin/env bash
# End-to-end checks of `stoke train`, `stoke demo` and `stoke bench train` as a user runs them.
# Usage: cli_train_test.sh path/to/stoke
set -u
stoke=$1
source "$(dirname "$0")/cli_lib.sh"

check demo 0 "demo: validation top-1" -- "$stoke" demo --dir "$work/demo" --per-class 40 --epochs 2 --threads 2
check demo_outputs 0 "curves.svg" -- ls "$work/demo/run"
# The demo replaces only its own folder's outputs: a folder of other files is refused, untouched.
mkdir -p "$work/precious/sub" && echo keep >"$work/precious/sub/thesis.txt"
check demo_refuses_other_folder 1 "precious: the folder exists, is not empty and is not a demo's" -- \
  "$stoke" demo --dir "$work/precious" --per-class 20 --epochs 1 --threads 2
check demo_left_it_alone 0 "keep" -- cat "$work/precious/sub/thesis.txt"
# Even when the folder holds only names the demo writes itself (images, train.lmdb, run, ...).
mkdir -p "$work/proj/images/holiday" && echo photo >"$work/proj/images/holiday/p1.jpg"
check demo_refuses_its_own_names 1 "proj: the folder exists, is not empty and is not a demo's" -- \
  "$stoke" demo --dir "$work/proj" --per-class 20 --epochs 1 --threads 2
check demo_left_the_photos 0 "photo" -- cat "$work/proj/images/holiday/p1.jpg"
# A folder name that YAML would misread unquoted ('#' starts a comment, ': ' a map), twice: the second
# run replaces the first's outputs and keeps a file of the user's.
odd="$work/demo #2: [x]"
check demo_odd_folder 0 "demo: validation top-1" -- "$stoke" demo --dir "$odd" --per-class 20 --epochs 1 --threads 2
echo mine >"$odd/notes.txt"
check demo_again 0 "demo: validation top-1" -- "$stoke" demo --dir "$odd" --per-class 20 --epochs 1 --threads 2
check demo_again_kept_notes 0 "mine" -- cat "$odd/notes.txt"
# Ctrl-C while a demo replaces an earlier one: exit 130, the earlier demo's outputs as they were
# (they were removed first, and every later demo then stopped at the partial pack left behind).
# signalled SIGNAL STEP OUT -- DEMO-ARGS...: a demo started with DEMO-ARGS, sent SIGNAL once it
# prints "== STEP." (its handler is set by then), however slow the build; its output in OUT;
# returns its exit code. demo_signalled SIGNAL OUT: a long demo in $odd, signalled while it
# generates its images.
signalled() {
  local signal=$1 step=$2 out=$3
  shift 4
  # Removed first: the redirection below truncates it only once the child runs, and the wait could
  # meanwhile find the last run's "== 1." and signal the new demo before its handler is set (a
  # background job ignores SIGINT until then: that demo ran to the end, seen under ASan in CI).
  rm -f "$out"
  "$stoke" demo "$@" >"$out" 2>&1 &
  local pid=$! waited=0
  until grep -q "^== $step\." "$out" 2>/dev/null || ((waited >= 600)); do
    sleep 0.1
    waited=$((waited + 1))
  done
  sleep 0.3
  kill "-$signal" "$pid"
  wait "$pid" 2>/dev/null
}
demo_signalled() {
  signalled "$1" 1 "$2" -- --dir "$odd" --per-class 5000 --epochs 1 --threads 2
}
demo_interrupted() {
  demo_signalled INT "$work/demo_int.out"
  local rc=$?
  cat "$work/demo_int.out"
  return "$rc"
}
check demo_interrupted 130 "interrupted while generating the images; the earlier demo's outputs in .* are as they were" -- \
  demo_interrupted
# Interrupted while training, a first demo removes what it wrote, and says so, naming no
# checkpoint or plot of the run it removed (it printed the run's summary with their paths).
demo_training_interrupted() {
  signalled INT 3 "$work/demo_train.out" -- --dir "$work/fresh" --per-class 20 --epochs 5000 --threads 2
  local rc=$?
  cat "$work/demo_train.out"
  return "$rc"
}
check demo_interrupted_training 130 "interrupted while training, at step [0-9]+ of [0-9]+; what it wrote in .*fresh is removed" -- \
  demo_training_interrupted
check demo_interrupted_training_names_no_removed_file 0 "" -- bash -c \
  "! grep -q 'checkpoint: \|curves: ' '$work/demo_train.out' && test ! -e '$work/fresh/run'"
check demo_interrupted_kept_the_run 0 "curves.svg" -- ls "$odd/run"
check demo_interrupted_kept_the_config 0 "epochs: 1" -- cat "$odd/demo.yaml"
check demo_interrupted_left_nothing 0 "" -- test ! -e "$odd/.stoke-demo-previous" -a ! -e "$odd/.stoke-demo-state"
check demo_after_an_interrupted_one 0 "demo: validation top-1" -- \
  "$stoke" demo --dir "$odd" --per-class 20 --epochs 1 --threads 2
# A demo killed (-9) at any step of replacing an earlier one: the next demo in the folder puts the
# earlier outputs back first. Each step's leftovers are made by hand (and once by a real kill -9);
# the next demo is then stopped with Ctrl-C, so what it restored is what is left to look at.
echo original >"$odd/run/original.txt"
own=(images train.lmdb train_val.lmdb run demo.yaml)
killed_demo() {  # a real kill -9 while it generates images
  demo_signalled KILL "$work/demo_kill.out"
  cat "$odd/.stoke-demo-state"
}
left_as_killed_in() {  # the folder as a demo killed in step $1 leaves it
  local p="$odd/.stoke-demo-previous"
  mkdir -p "$p"
  case $1 in
    aside) mv "$odd/run" "$odd/demo.yaml" "$p/" ;;  # killed between two of its moves
    cleaning)
      for e in "${own[@]}"; do mv "$odd/$e" "$p/"; done
      mkdir -p "$odd/images/new" "$odd/train.lmdb.partial" ;;  # the new demo's, half removed
    restoring)
      for e in "${own[@]}"; do mv "$odd/$e" "$p/"; done
      mv "$p/run" "$odd/" ;;  # killed between two moves back
    discarding) mkdir -p "$p/run/old" ;;  # the new demo finished; its predecessor's remains
  esac
  echo "$1" >"$odd/.stoke-demo-state"
}
check demo_killed 0 "^running$" -- killed_demo
for step in killed aside cleaning restoring discarding; do
  [[ $step == killed ]] || left_as_killed_in "$step"
  check "demo_after_kill_in_${step}_recovers" 130 "earlier demo's outputs in .* are as they were" -- demo_interrupted
  check "demo_after_kill_in_${step}_kept_the_run" 0 "original" -- cat "$odd/run/original.txt"
  check "demo_after_kill_in_${step}_kept_the_rest" 0 "" -- \
    test -d "$odd/images" -a -d "$odd/train.lmdb" -a -d "$odd/train_val.lmdb" -a -f "$odd/demo.yaml" \
    -a ! -e "$odd/train.lmdb.partial" -a ! -e "$odd/images/new" -a ! -e "$odd/.stoke-demo-previous" \
    -a ! -e "$odd/.stoke-demo-state"
done
check demo_not_utf8 1 "the name is not UTF-8" -- "$stoke" demo --dir "$work/bad"$'\xff'"dir" --per-class 20 --epochs 1
cfg=$work/demo/demo.yaml
check print_config 0 "momentum: 0.9" -- "$stoke" train --config "$cfg" --print-config
check print_config_takes_no_run_flags 108 "--print-config excludes --resume" -- \
  "$stoke" train --config "$cfg" --print-config --resume nonexist.ckpt
"$stoke" train --config "$cfg" --print-config >"$work/resolved.yaml"
check print_config_reads_back 0 "batch_size: 64" -- "$stoke" train --config "$work/resolved.yaml" --print-config
# A dataset that cannot be opened is named with the config file and the key that holds it.
sed "s|^  val: .*|  val: $work/no-such-val.lmdb|" "$cfg" >"$work/missing_val.yaml"
check train_missing_val_names_the_key 1 "missing_val.yaml:[0-9]+: data.val: dataset: .*no-such-val.lmdb: no such file" -- \
  "$stoke" train --config "$work/missing_val.yaml" -q
sed "s|run_dir: .*|run_dir: $work/run2|; s|^epochs: .*|epochs: 2|" "$cfg" >"$work/run2.yaml"
check train_stops_early 0 "stopped at step 4; continue with: .*--resume" -- \
  "$stoke" train --config "$work/run2.yaml" --max-steps 4 -q
check train_refuses_fresh_over_old 1 "already holds checkpoints.*--resume" -- \
  "$stoke" train --config "$work/run2.yaml" -q
check train_resumes 0 "steps 4 -> 10 of 10" -- "$stoke" train --config "$work/run2.yaml" --resume -q
# A resume under a config that makes other batches, or trains fewer steps than were taken, is
# refused (it went on, skipping records and mixing batch sizes, or rewrote the last checkpoint).
sed 's/batch_size: 64/batch_size: 60/' "$work/run2.yaml" >"$work/run2_bs.yaml"
check resume_other_batches 1 "other batches than this config makes \(data.batch_size 64 -> 60\)" -- \
  "$stoke" train --config "$work/run2_bs.yaml" --resume -q
sed 's/^epochs: .*/epochs: 1/' "$work/run2.yaml" >"$work/run2_short.yaml"
check resume_past_the_end 1 "is at step 10, past the 5 steps this config trains" -- \
  "$stoke" train --config "$work/run2_short.yaml" --resume -q
check metrics_file 0 '"type":"val"' -- cat "$work/run2/metrics.jsonl"
# One run at a time in a run_dir: a second start there, or a --resume while it runs, is refused
# at once (the two replaced each other's metrics and pruned each other's checkpoints).
sed "s|run_dir: .*|run_dir: $work/busy|; s|^epochs: .*|epochs: 200|" "$cfg" >"$work/busy.yaml"
"$stoke" train --config "$work/busy.yaml" -q >"$work/busy.out" 2>&1 &
busy=$!
for _ in $(seq 1 600); do
  grep -qs '"type":"train"' "$work/busy/metrics.jsonl" && break
  sleep 0.1
done
check train_refuses_a_busy_run_dir 1 "train: run_dir .*busy: another process \(pid $busy\) holds .*train.lock" -- \
  "$stoke" train --config "$work/busy.yaml" -q
check train_refuses_a_resume_of_a_running_run 1 "another process \(pid $busy\) holds" -- \
  "$stoke" train --config "$work/busy.yaml" --resume -q
kill -INT "$busy"
wait "$busy"
check train_busy_run_resumes_once_stopped 0 "checkpoint: " -- \
  "$stoke" train --config "$work/busy.yaml" --resume --max-steps 400 -q
# A config its author keeps in run_dir as config.yaml is the run's copy: not rewritten (its
# comments were lost to the resolved config), whether named through run_dir or another path.
mkdir -p "$work/own"
{ echo "# my notes"; sed "s|run_dir: .*|run_dir: $work/own|; s|^epochs: .*|epochs: 1|" "$cfg"; } >"$work/own/config.yaml"
cp "$work/own/config.yaml" "$work/own.expected"
check train_keeps_its_own_config 0 "" -- "$stoke" train --config "$work/own/config.yaml" --max-steps 2 -q
check train_kept_its_own_config 0 "" -- cmp "$work/own/config.yaml" "$work/own.expected"
ln -s "$work/own" "$work/own_link"
check train_keeps_its_own_config_through_a_link 0 "" -- \
  "$stoke" train --config "$work/own_link/./config.yaml" --resume -q
check train_kept_its_own_config_through_a_link 0 "" -- cmp "$work/own/config.yaml" "$work/own.expected"
sed 's/momentum: 0.9/momentum: 1.5/' "$cfg" >"$work/bad.yaml"
check train_bad_value 1 "bad.yaml:[0-9]+: optimizer.momentum: 1.5 is out of range; expected a number in \[0, 1\)" -- \
  "$stoke" train --config "$work/bad.yaml"
printf 'data: {train: x}\nmodel: {preset: lenet, classes: 3}\nepochs: 1\nepoch: 2\n' >"$work/typo.yaml"
check train_unknown_key 1 "typo.yaml:4: epoch: unknown key; expected one of: .*epochs" -- \
  "$stoke" train --config "$work/typo.yaml"
# Models whose first layer has no parameters train (the input needs no gradient).
for first in relu "maxpool, kernel: 2" "avgpool, kernel: 2" batchnorm; do
  name=${first%%,*}
  printf 'data: {train: %s, batch_size: 8, threads: 2, image_size: 16}\nmodel:\n  classes: 10\n  layers:\n    - {type: %s}\n    - {type: conv, out: 4, kernel: 3}\n    - {type: global_avgpool}\n    - {type: linear, out: 10}\nepochs: 1\nbackend: cpu\nrun_dir: %s\n' \
    "$work/demo/train.lmdb" "$first" "$work/first_$name" >"$work/first_$name.yaml"
  check "train_${name}_first" 0 "checkpoint: " -- "$stoke" train --config "$work/first_$name.yaml" --max-steps 3 -q
done
sed "s/batch_size: 8/batch_size: 300/; s/image_size: 16/image_size: 4096/" "$work/first_relu.yaml" >"$work/huge.yaml"
check train_oversized_batch 1 "resource exhausted: cpu backend: batch 300 at 4096x4096 needs at least .* GiB.*data.batch_size" -- \
  "$stoke" train --config "$work/huge.yaml" -q
check train_missing_config 1 "no-such.yaml" -- "$stoke" train --config "$work/no-such.yaml"
# A --val-fraction too small for the classes packs an empty validation set: named as such.
"$stoke" pack "$work/demo/images" "$work/split.lmdb" --val-fraction 0.001 >/dev/null 2>&1
sed "s|^  val: .*|  val: \"$work/split_val.lmdb\"|; s|run_dir: .*|run_dir: $work/run_empty_val|" "$cfg" >"$work/empty_val.yaml"
check train_empty_val 1 "data.val .*split_val.lmdb has no records .*leave data.val out" -- \
  "$stoke" train --config "$work/empty_val.yaml" -q
# A run_dir inside a dataset's folder is refused before anything is written there.
sed "s|run_dir: .*|run_dir: $work/demo/train.lmdb/run|" "$cfg" >"$work/run_in_ds.yaml"
check train_run_dir_in_a_dataset 1 "run_dir .*train.lmdb/run is inside data.train" -- \
  "$stoke" train --config "$work/run_in_ds.yaml" -q
check train_run_dir_in_a_dataset_left_nothing 1 "" -- test -e "$work/demo/train.lmdb/run"
sed 's/backend: auto/backend: cuda/' "$cfg" >"$work/cuda.yaml"
if nvidia-smi >/dev/null 2>&1; then
  echo "skip train_no_cuda_backend: a GPU is present (the CUDA backend is covered by cuda_test)"
else
  check train_no_cuda_backend 1 "backend 'cuda' was requested" -- "$stoke" train --config "$work/cuda.yaml" -q
fi
if ! "$stoke" monitor /no/such/run --port 0 2>&1 | grep -q "not in this build"; then  # built with the monitor
  check monitor_missing_run 1 "/no/such/run: no such folder; give a run directory" -- "$stoke" monitor /no/such/run --port 0
  check monitor_given_a_config 1 "run2.yaml: not a folder; give a run directory \(a config's run_dir" -- \
    "$stoke" monitor "$work/run2.yaml" --port 0
  check monitor_bad_port 105 "--port: Value 70000 not in range 0 to 65535" -- "$stoke" monitor "$work/run2" --port 70000
  check train_monitor_bad_address 1 "--monitor 'abc': expected \[HOST:\]PORT" -- \
    "$stoke" train --config "$work/run2.yaml" --monitor abc -q
  # A run that fails to start leaves no empty run_dir behind, with --monitor as without.
  sed "s|run_dir: .*|run_dir: $work/mon_new/sub|; s|train: .*train.lmdb|train: $work/nowhere.lmdb|" "$work/run2.yaml" \
    >"$work/mon_new.yaml"
  check train_monitor_failed_start 1 "nowhere.lmdb" -- "$stoke" train --config "$work/mon_new.yaml" --monitor 0 -q
  check train_monitor_failed_start_left_nothing 0 "" -- test ! -e "$work/mon_new"
  check tensorboard_events 0 "events.out.tfevents" -- ls "$work/run2/tensorboard"
fi
check bench_train_peer_fails 1 "PyTorch peer: FAILED, no ratio .*exit 1\): /bin/false" -- \
  "$stoke" bench train --config "$cfg" --steps 2 --warmup 1 --repeats 1 --peer --python /bin/false
check bench_train_peer_missing 1 "the PyTorch peer did not start \(No such file or directory\)" -- \
  "$stoke" bench train --config "$cfg" --steps 2 --warmup 1 --repeats 1 --peer --python "$work/no such/py'thon"
# A peer that times some other model (here none at all) gives no ratio, whatever rate it reports.
echo 'print("{\"img_s\": 5}")' >"$work/other_peer.py"
check bench_train_peer_other_model 1 "PyTorch peer: FAILED, no ratio .*reported 0 parameters at 5 img/s; stoke's model has" -- \
  "$stoke" bench train --config "$cfg" --steps 2 --warmup 1 --repeats 1 --peer --python python3 \
  --peer-script "$work/other_peer.py"
check bench_train_threads_bound 105 "--threads: must be at most 4096 \(0 = the config's\), not 100000" -- \
  "$stoke" bench train --config "$cfg" --threads 100000
check bench_train 0 "compute only .* img/s" -- \
  "$stoke" bench train --config "$cfg" --steps 2 --warmup 1 --repeats 1
finish
