#!/usr/bin/env bash
# `stoke eval`, `stoke export` and `stoke predict` as a user runs them on a run `stoke demo` trained:
# eval agrees with the trainer's own evaluation, export writes a model (or says the build has no
# ONNX), predict names bad images and still runs the others, and damaged or mismatched inputs are
# refused by name. Usage: cli_export_test.sh path/to/stoke
set -u
stoke=$1
source "$(dirname "$0")/../tools/cli_lib.sh"
src=$(cd "$(dirname "$0")/../.." && pwd)

"$stoke" demo --dir "$work/demo" --per-class 40 --epochs 3 --threads 2 >"$work/demo.txt" 2>&1 ||
  { cat "$work/demo.txt"; exit 1; }
run=$work/demo/run
val=$work/demo/train_val.lmdb
# The trainer's last evaluation, as the demo printed it: "validation: loss L, top-1 T%, ..."
want_top1=$(sed -n 's/^validation: loss [0-9.]*, top-1 \([0-9.]*\)%.*/\1/p' "$work/demo.txt")
check eval_matches_training 0 "top-1 ${want_top1//./\\.}%" -- "$stoke" eval --run "$run" --data "$val" --threads 2
check eval_json 0 '"top5": ' -- "$stoke" eval --run "$run" --data "$val" --threads 2 --json
check eval_per_class 0 "most often mistaken for" -- "$stoke" eval --run "$run" --data "$val" --classes 0
check eval_needs_model 1 "give the model with --run RUN_DIR or --checkpoint FILE" -- "$stoke" eval --data "$val"
check eval_missing_data 1 "nowhere.lmdb" -- "$stoke" eval --run "$run" --data "$work/nowhere.lmdb"
check eval_empty_run 1 "holds no checkpoints" -- "$stoke" eval --run "$work" --data "$val"
# Bad records are left out up to a budget: the config's, or eval's own --max-skip-fraction.
cp -r "$val" "$work/damaged.lmdb"
/usr/bin/python3 - "$work/damaged.lmdb/data.mdb" <<'PY'
import sys
raw = bytearray(open(sys.argv[1], "rb").read())
at = raw.find(b"\xff\xd8\xff", len(raw) // 3)
raw[at + 2:at + 300] = bytes(298)  # one record's bytes no longer match its CRC
open(sys.argv[1], "wb").write(bytes(raw))
PY
check eval_over_the_configs_budget 1 "more than max_skip_fraction 0.01 .*--max-skip-fraction sets eval's own" -- \
  "$stoke" eval --run "$run" --data "$work/damaged.lmdb" --threads 2
check eval_within_its_own_budget 0 "skipped 1 bad record" -- \
  "$stoke" eval --run "$run" --data "$work/damaged.lmdb" --threads 2 --max-skip-fraction 0.1
# A run trained with on_error: fail fails at a bad record, unless eval is given its own budget.
sed 's/^\(  *on_error:\) skip/\1 fail/' "$run/config.yaml" >"$work/fail.yaml"
check eval_config_says_fail 0 "on_error: fail" -- cat "$work/fail.yaml"
check eval_fails_as_the_run_would 1 "on_error fail" -- \
  "$stoke" eval --run "$run" --config "$work/fail.yaml" --data "$work/damaged.lmdb" --threads 2
check eval_own_budget_skips_whatever_the_run_s_policy 0 "skipped 1 bad record" -- \
  "$stoke" eval --run "$run" --config "$work/fail.yaml" --data "$work/damaged.lmdb" --threads 2 --max-skip-fraction 0.1
# Another preprocessing through --config is allowed, and said.
sed 's/^\(  *val_resize:\) .*/\1 48/' "$run/config.yaml" >"$work/resize.yaml"
check eval_other_preprocessing_said 0 "prepares images unlike .*data.val_resize 48 \(trained with: [0-9]+\)" -- \
  "$stoke" eval --run "$run" --config "$work/resize.yaml" --data "$val" --threads 2
check eval_budget_checked 105 "--max-skip-fraction: Value 2 not in range" -- \
  "$stoke" eval --run "$run" --data "$val" --max-skip-fraction 2

if "$stoke" export --help >/dev/null 2>&1 && "$stoke" export --run "$run" -o "$work/m.onnx" >"$work/export.txt" 2>&1; then
  check export_report 0 "output 'logits' N x 10" -- cat "$work/export.txt"
  check export_folds 0 "batch norm: [1-9][0-9]* folded" -- cat "$work/export.txt"
  check export_uint8 0 "input 'image' uint8" -- "$stoke" export --run "$run" -o "$work/m8.onnx" --uint8-input
  check export_file 0 "" -- test -s "$work/m8.onnx"
  # What an export killed mid-write left (its process gone) goes when the file is written again.
  (exit 0) & dead=$!; wait $dead
  : >"$work/m8.onnx.tmp.$dead"
  : >"$work/m8.onnx.tmp.$$"
  check export_again 0 "input 'image' uint8" -- "$stoke" export --run "$run" -o "$work/m8.onnx" --uint8-input
  check export_removed_a_dead_export_s_temporary 1 "" -- test -e "$work/m8.onnx.tmp.$dead"
  check export_kept_a_live_writer_s_temporary 0 "" -- test -e "$work/m8.onnx.tmp.$$"
  # Never over what it is exported from (the model's checkpoint was once replaced by the ONNX file).
  ckpt=$(ls "$run"/checkpoints/step-*.ckpt | tail -1)
  cp "$ckpt" "$work/ckpt.before"
  check export_not_over_its_checkpoint 1 "export: --output .*: that is .*, which this command reads" -- \
    "$stoke" export --run "$run" -o "$ckpt"
  check export_left_the_checkpoint 0 "" -- cmp "$ckpt" "$work/ckpt.before"
  check export_not_over_the_config 1 "export: --output .*config.yaml: that is" -- \
    "$stoke" export --run "$run" -o "$run/config.yaml"
  # Nor into a dataset's folder it does not read (it replaced another dataset's data.mdb).
  cp "$work/demo/train.lmdb/data.mdb" "$work/data.before"
  check export_not_into_a_dataset 1 "export: --output .*train.lmdb/data.mdb: that is inside the dataset" -- \
    "$stoke" export --run "$run" -o "$work/demo/train.lmdb/data.mdb"
  check export_not_beside_a_dataset_s_records 1 "that is inside the dataset .*train.lmdb" -- \
    "$stoke" export --run "$run" -o "$work/demo/train.lmdb/model.onnx"
  check export_left_the_dataset 0 "" -- cmp "$work/demo/train.lmdb/data.mdb" "$work/data.before"
else
  check export_unavailable 1 "no ONNX export" -- cat "$work/export.txt"
fi

# Predict: two good images, a text file, a truncated JPEG; the good ones still get their classes.
img0=$(ls "$work/demo/images/class_00" | head -1)
img3=$(ls "$work/demo/images/class_03" | head -1)
cp "$work/demo/images/class_00/$img0" "$work/good0.jpg"
cp "$work/demo/images/class_03/$img3" "$work/good3.jpg"
echo "not an image" >"$work/notes.txt"
head -c 700 "$work/good0.jpg" >"$work/cut.jpg"
check predict_good 0 "good0.jpg: class_[0-9]+ [01]\.[0-9]{4}, " -- "$stoke" predict --run "$run" "$work/good0.jpg" "$work/good3.jpg" -k 3
check predict_bad_named 3 "notes.txt: error: .*not a JPEG" -- \
  "$stoke" predict --run "$run" "$work/good0.jpg" "$work/notes.txt" "$work/cut.jpg" "$work/good3.jpg"
check predict_truncated_named 3 "cut.jpg: error: " -- \
  "$stoke" predict --run "$run" "$work/good0.jpg" "$work/notes.txt" "$work/cut.jpg" "$work/good3.jpg"
check predict_others_still_run 3 "good3.jpg: class_" -- \
  "$stoke" predict --run "$run" "$work/good0.jpg" "$work/notes.txt" "$work/cut.jpg" "$work/good3.jpg"
# Every image bad: each is named, and nothing of predict's own scratch dataset shows.
check predict_all_bad_names_only_the_inputs 0 "^ok$" -- bash -c "out=\$('$stoke' predict --run '$run' '$work/notes.txt' '$work/cut.jpg' 2>&1)
  rc=\$?; if [[ \$rc == 3 && \$out == *notes.txt* && \$out == *cut.jpg* && \$out != *inputs.lmdb* && \$out != *stoke-predict* ]]; then echo ok; else echo \"exit \$rc: \$out\"; fi"
check predict_folder_json 0 '"probability": ' -- "$stoke" predict --run "$run" "$work/demo/images/class_02" --json -k 2
check predict_missing 3 "nothing.jpg: error: no such file or folder" -- "$stoke" predict --run "$run" "$work/nothing.jpg"
# A missing input is one bad line among the others (it ended predict with no result for any).
check predict_missing_among_others 3 "good3.jpg: class_03 " -- "$stoke" predict --run "$run" "$work/nothing.jpg" "$work/good3.jpg" -k 1
# Names with spaces at either end, and a hidden file in a folder (left out, as pack does).
cp "$work/good3.jpg" "$work/ spaced.jpg "
mkdir -p "$work/folder" && cp "$work/good3.jpg" "$work/folder/" && echo junk >"$work/folder/.DS_Store"
check predict_spaced_name 0 "/ spaced.jpg : class_03 " -- "$stoke" predict --run "$run" "$work/ spaced.jpg " -k 1
check predict_hidden_left_out 0 "good3.jpg: class_03 " -- "$stoke" predict --run "$run" "$work/folder" -k 1
check predict_no_tmpdir 1 "set TMPDIR to a writable folder" -- env TMPDIR="$work/nowhere" "$stoke" predict --run "$run" "$work/good3.jpg"
# "dl/../img.jpg" where dl is a symlink is the file the kernel finds (real/img.jpg, a class_03
# image), not the one a textual normalisation names (q/img.jpg, a class_00 image).
mkdir -p "$work/q" "$work/real/sub" && cp "$work/good3.jpg" "$work/real/img.jpg" && cp "$work/good0.jpg" "$work/q/img.jpg"
ln -s "$work/real/sub" "$work/q/dl"
check predict_through_symlinked_folder 0 "dl/\.\./img.jpg: class_03 " -- "$stoke" predict --run "$run" "$work/q/dl/../img.jpg" -k 1
check predict_error_names_the_input 3 "^/dev/null: error: .*/dev/null" -- "$stoke" predict --run "$run" /dev/null
# The demo's images are predicted as their class (the model reached high accuracy).
check predict_right_class 0 "good3.jpg: class_03 " -- "$stoke" predict --run "$run" "$work/good3.jpg"

# A truncated checkpoint and a config of another model are refused, naming the files.
ck=$(ls "$run"/checkpoints/*.ckpt | tail -1)
head -c 5000 "$ck" >"$work/cut.ckpt"
check eval_truncated_checkpoint 1 "cut.ckpt.*(truncated|damaged)" -- "$stoke" eval --checkpoint "$work/cut.ckpt" --data "$val"
check predict_truncated_checkpoint 1 "cut.ckpt" -- "$stoke" predict --checkpoint "$work/cut.ckpt" "$work/good0.jpg"
check export_truncated_checkpoint 1 "cut.ckpt" -- "$stoke" export --checkpoint "$work/cut.ckpt" -o "$work/x.onnx"
# A run whose newest checkpoint is cut: the refusal names the one before it.
cp -r "$run" "$work/cut_run"
newest=$(ls "$work/cut_run"/checkpoints/*.ckpt | tail -1) before=$(ls "$work/cut_run"/checkpoints/*.ckpt | tail -2 | head -1)
check cut_run_has_two_checkpoints 0 "" -- test "$newest" != "$before"
head -c 5000 "$ck" >"$newest"
check eval_cut_newest_names_the_one_before 1 "the run's newest checkpoint; the one before it is ${before//./\\.}" -- \
  "$stoke" eval --run "$work/cut_run" --data "$val"
check eval_config_mismatch 1 "config .*residual_layers.yaml does not match checkpoint .*$(basename "$ck")" -- \
  "$stoke" eval --checkpoint "$ck" --config "$src/configs/residual_layers.yaml" --data "$val"
check export_config_mismatch 1 "residual_layers.yaml does not match" -- \
  "$stoke" export --checkpoint "$ck" --config "$src/configs/residual_layers.yaml" -o "$work/x.onnx"
check export_no_partial_file 1 "" -- test -e "$work/x.onnx"

# A thread count past the bound is refused before anything starts (100000 reached OpenMP and
# ended eval with SIGSEGV), and so is a negative class count (it wrapped to "all").
check eval_too_many_threads 105 "must be at most 4096" -- "$stoke" eval --run "$run" --data "$val" --threads 100000
check eval_negative_classes 105 "must be >= 0, not -1" -- "$stoke" eval --run "$run" --data "$val" --classes -1
# A FIFO (or a device) at the output is refused and left as it is, not replaced by a file.
mkfifo "$work/fifo.onnx"
check export_onto_a_fifo 1 "fifo.onnx: exists and is not a regular file \(a FIFO\)" -- \
  "$stoke" export --run "$run" -o "$work/fifo.onnx"
check export_fifo_kept 0 "" -- test -p "$work/fifo.onnx"
check extract_empty_output 105 "expected a file name, got an empty string" -- \
  "$stoke" inspect "$val" --extract 0 --output ''
finish
