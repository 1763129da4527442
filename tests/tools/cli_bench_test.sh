#!/usr/bin/env bash
# Smoke test of every `stoke bench` subcommand on a tiny synthetic set with short runs: each must
# finish and print its figures. Not a timed assertion; ctest's TIMEOUT catches one that grows slow
# again (a fixed work count that does not scale with the data once kept `bench read` busy for
# minutes).
# Usage: cli_bench_test.sh path/to/stoke
set -u
stoke=$1
source "$(dirname "$0")/cli_lib.sh"

"$stoke" synth "$work/src" --classes 3 --per-class 8 >/dev/null
"$stoke" pack "$work/src" "$work/ds.lmdb" -q >/dev/null
quick=(--seconds 0.05 --repeats 2 --threads 2)
check bench_pack 0 "pack --validate pixels --index none, 2 threads .* img/s" -- \
  "$stoke" bench pack --data "$work/src" "${quick[@]}" --work-dir "$work/scratch"
# N = 1: each figure once, in the table and in the JSON (the 1-thread rows were there twice, and
# the JSON kept one of each pair).
check bench_pack_one_thread 0 "^4 rows, 4 results$" -- bash -c \
  "rows=\$('$stoke' bench pack --data '$work/src' --seconds 0.05 --repeats 1 --threads 1 --json '$work/bp1.json' \
     --work-dir '$work/scratch' 2>/dev/null | grep -c 'pack --validate'); \
   echo \"\$rows rows, \$(/usr/bin/python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))[\"results\"]))' \
     '$work/bp1.json') results\""
check bench_read 0 "random \+CRC, 2 threads +[0-9]+ +[0-9.]+" -- \
  "$stoke" bench read --data "$work/src" "${quick[@]}" --work-dir "$work/scratch" --json "$work/read.json"
check bench_read_json 0 '"mb_s"' -- cat "$work/read.json"
# A link loop among the images is skipped, as pack skips it (it was an uncaught exception).
mkdir -p "$work/looped/a"
cp "$work"/src/class_00/img_000[0-2].jpg "$work/looped/a/"
ln -s self.jpg "$work/looped/a/self.jpg"
check bench_pack_link_loop 0 "img/s" -- "$stoke" bench pack --data "$work/looped" "${quick[@]}" --work-dir "$work/scratch"
# --json never into what is measured.
check bench_data_is_a_dataset 1 "bench: .*ds.lmdb: a packed dataset; --data takes an image folder tree" -- \
  "$stoke" bench read --data "$work/ds.lmdb" "${quick[@]}"
check bench_block_size_without_block_shuffle 1 "--block-size and --window-blocks shape block shuffle; with --shuffle full" -- \
  "$stoke" bench pipeline "$work/ds.lmdb" --shuffle full --block-size 7 "${quick[@]}"
check bench_data_is_a_file 1 "bench: .*ds.lmdb/data.mdb: not a folder; --data takes an image folder tree" -- \
  "$stoke" bench pack --data "$work/ds.lmdb/data.mdb" "${quick[@]}"
check bench_json_not_into_the_images 1 "bench: --json .*: that is inside .*src" -- \
  "$stoke" bench read --data "$work/src" "${quick[@]}" --work-dir "$work/scratch" --json "$work/src/class_00/img_0000.jpg"
check bench_json_not_into_the_dataset 1 "bench: --json .*: that is inside .*ds.lmdb" -- \
  "$stoke" bench decode "$work/ds.lmdb" --seconds 0.05 --repeats 1 --json "$work/ds.lmdb/data.mdb"
# What a bench packs goes in a folder of its own inside --work-dir, removed at the end (the packed
# datasets and lists stayed there); what else is in --work-dir stays.
touch "$work/scratch/mine.txt"
# Nor --work-dir: its scratch folder was packed as one more input (25 images of 24).
check bench_work_dir_not_in_the_images 1 "bench: --work-dir .*: that is inside .*src" -- \
  "$stoke" bench pack --data "$work/src" "${quick[@]}" --work-dir "$work/src"
# bench train's outputs: not over its config or dataset, nor over each other.
printf 'data: {train: %s, image_size: 32, batch_size: 6}\nmodel: {preset: lenet, classes: 3}\n' "$work/ds.lmdb" >"$work/bt.yaml"
check bench_train_json_not_into_the_dataset 1 "--json .*: that is inside .*ds.lmdb" -- \
  "$stoke" bench train --config "$work/bt.yaml" --steps 2 --warmup 1 --repeats 1 --json "$work/ds.lmdb/data.mdb"
check bench_train_model_json_not_over_the_config 1 "bench train: --model-json .*: that is .*bt.yaml" -- \
  "$stoke" bench train --config "$work/bt.yaml" --steps 2 --warmup 1 --repeats 1 --model-json "$work/bt.yaml"
check bench_train_json_not_over_the_model_json 1 "bench train: --json .*: that is .*m.json" -- \
  "$stoke" bench train --config "$work/bt.yaml" --steps 2 --warmup 1 --repeats 1 --json "$work/m.json" \
  --model-json "$work/m.json"
check bench_train_refusals_left_the_dataset 0 "records +24" -- "$stoke" inspect "$work/ds.lmdb"
check bench_repeats_bounded 105 "--repeats: must be at most 1000 runs per figure" -- \
  "$stoke" bench decode "$work/ds.lmdb" --seconds 0.05 --repeats 100000000
# The config's checks of its training set, as `stoke train` makes them (it failed at a record's label).
printf 'data: {train: %s, image_size: 32, batch_size: 6}\nmodel: {preset: lenet, classes: 2}\n' "$work/ds.lmdb" >"$work/bt2.yaml"
check bench_train_checks_the_classes 1 "bt2.yaml:2: model.classes is 2, but .*ds.lmdb has 3 classes" -- \
  "$stoke" bench train --config "$work/bt2.yaml" --steps 2 --warmup 1 --repeats 1
check bench_train_warmup_at_least_one 105 "--warmup: must be > 0, not 0" -- \
  "$stoke" bench train --config "$work/bt.yaml" --steps 2 --warmup 0 --repeats 1
# An empty output path was read as "not given": the figures were silently not written.
check bench_json_empty 105 "--json: expected a file name, got an empty string" -- \
  "$stoke" bench decode "$work/ds.lmdb" --seconds 0.05 --repeats 1 --json ""
check bench_work_dir_empty 105 "--work-dir: expected a folder name, got an empty string" -- \
  "$stoke" bench pack --data "$work/src" "${quick[@]}" --work-dir ""
check bench_train_model_json_empty 105 "--model-json: expected a file name, got an empty string" -- \
  "$stoke" bench train --config "$work/bt.yaml" --steps 2 --warmup 1 --repeats 1 --model-json ""
check bench_pipeline_io_threads_bounded 105 "--io-threads: must be at most 1024" -- \
  "$stoke" bench pipeline "$work/ds.lmdb" --shuffle full --io-threads 20000 --seconds 0.05 --repeats 1
check bench_work_dir_left_as_it_was 0 "^mine.txt$" -- ls -A "$work/scratch"
check bench_decode 0 "whole sample .* img/s" -- "$stoke" bench decode "$work/ds.lmdb" --seconds 0.05 --repeats 2
# A dataset of decoded pixels has nothing for a JPEG decode benchmark: said so, by its encoding.
"$stoke" pack "$work/src" "$work/raw.lmdb" -q --encoding raw >/dev/null
check bench_decode_raw_dataset 1 "raw.lmdb: its 24 records hold decoded pixels \(packed with --encoding raw\)" -- \
  "$stoke" bench decode "$work/raw.lmdb" --seconds 0.05 --repeats 1
check bench_pipeline 0 "loader, 2 threads .* img/s" -- \
  "$stoke" bench pipeline "$work/ds.lmdb" --batch 4 "${quick[@]}"
# Damaged records are left out with a warning naming them, as the loader skips them: one whose
# payload fails its CRC, and one whose header's payload size is wrong (that one ended the bench).
cp -r "$work/ds.lmdb" "$work/damaged.lmdb"
python3 - "$work/damaged.lmdb/data.mdb" <<'PY'
import sys
path = sys.argv[1]
raw = bytearray(open(path, "rb").read())
at = [i for i in range(len(raw) - 4) if raw[i:i + 4] == b"STKR"]
raw[at[2] + 24] ^= 1        # record 2's payload_size
raw[at[5] + 32 + 200] ^= 1  # a byte of record 5's payload
open(path, "wb").write(bytes(raw))
PY
check bench_decode_skips_damaged_records 0 "2 damaged records left out" -- \
  "$stoke" bench decode "$work/damaged.lmdb" --seconds 0.05 --repeats 1
check bench_decode_names_the_damaged_header 0 "record [0-9]+: header says [0-9]+ payload bytes.*left out of the figures" -- \
  "$stoke" bench decode "$work/damaged.lmdb" --seconds 0.05 --repeats 1
# The loader's run then holds them to its budget, as training does: 2 of 24 is more than 1%.
check bench_pipeline_holds_damaged_records_to_the_budget 1 "more than max_skip_fraction 0.01 of the 24 samples" -- \
  "$stoke" bench pipeline "$work/damaged.lmdb" --seconds 0.05 --repeats 1 --batch 4 --threads 2
# Flags that would do nothing are refused: decode runs on one core, a given dataset is not packed
# from --data or in --work-dir. A run cannot be endless, and a --json that cannot be written is
# named before anything is measured (it was found after the runs, naming a temporary file).
check bench_decode_threads 109 "not expected: 2 --threads" -- "$stoke" bench decode "$work/ds.lmdb" --threads 2
check bench_db_and_data 108 "DB excludes --data" -- "$stoke" bench pipeline "$work/ds.lmdb" --data "$work/src"
check bench_db_and_work_dir 108 "DB excludes --work-dir" -- "$stoke" bench decode "$work/ds.lmdb" --work-dir "$work/w"
check bench_seconds_finite 105 "--seconds: must be at most 3600 seconds per run, not inf" -- \
  "$stoke" bench decode "$work/ds.lmdb" --seconds inf
check bench_json_folder_missing 1 "--json $work/nowhere/out.json: no folder $work/nowhere" -- \
  "$stoke" bench decode "$work/ds.lmdb" --seconds 30 --repeats 5 --json "$work/nowhere/out.json"
check bench_pipeline_epochs 0 "3 epochs per run" -- \
  "$stoke" bench pipeline "$work/ds.lmdb" --batch 4 --epochs 3 --repeats 1 --threads 2
# Without --seconds a storage run times its whole epochs: 2 x 24 records pass the read-ahead (its
# open-ended deadline overflowed the clock and the run stopped after the first batch of 4).
records_read() {  # the records the read-ahead handed out, summed over where they came from
  "$stoke" bench pipeline "$work/ds.lmdb" --shuffle full --repeats 1 --threads 2 --batch 4 --epochs 2 2>&1 |
    sed -nE 's/.*read-ahead[^:]*: ([0-9]+) records from its buffers, ([0-9]+) from the page cache, ([0-9]+) through the map.*/records \1 \2 \3/p' |
    awk '{ print "records read:", $2 + $3 + $4 }'
}
check bench_pipeline_storage_whole_epochs 0 "^records read: 48$" -- records_read
check bench_storage_flags_need_shuffle 1 "need --shuffle" -- "$stoke" bench pipeline "$work/ds.lmdb" --memory-mb 10
check bench_memory_mb_bounded 105 "--memory-mb: must be at most 1073741824 MB, not 17592186044416" -- \
  "$stoke" bench pipeline "$work/ds.lmdb" --shuffle full --memory-mb 17592186044416
check bench_memory_mb_units_said 105 "--memory-mb: expected a number >= 0, not '2G'" -- \
  "$stoke" bench pipeline "$work/ds.lmdb" --shuffle full --memory-mb 2G
check bench_threads_not_negative 105 "--threads" -- "$stoke" bench read --data "$work/src" --threads -3
check bench_batch_zero 105 "--batch: must be > 0, not 0" -- "$stoke" bench pipeline "$work/ds.lmdb" --batch 0
# The scratch folder of a bench that was killed (its process gone) is removed by the next bench; a
# bench of a given dataset makes none of its own. A live process's folder stays (this shell's), as
# does one whose lock is held (a bench in another PID namespace, whose PID may be dead here).
mkdir -p "$work/tmp"
sleep 0 &
dead=$!
wait "$dead"
locked=$((dead + 1000000))
mkdir -p "$work/tmp/stoke-bench-$dead/bench_pipeline.lmdb" "$work/tmp/stoke-bench-x" "$work/tmp/stoke-bench-$$" \
  "$work/tmp/stoke-bench-$locked"
touch "$work/tmp/stoke-bench-$locked/.lock"
exec {held}<"$work/tmp/stoke-bench-$locked/.lock"
flock -x "$held"
scratch_left() {
  TMPDIR=$work/tmp "$stoke" bench pipeline "$work/ds.lmdb" --batch 4 --seconds 0.05 --repeats 1 --threads 2 \
    >/dev/null 2>&1 || printf "bench failed "
  local label
  for label in dead:$dead x:x self:$$ locked:$locked; do
    [[ -d $work/tmp/stoke-bench-${label#*:} ]] && printf "%s kept " "${label%%:*}" || printf "%s gone " "${label%%:*}"
  done
}
check bench_removes_orphan_scratch 0 "^dead gone x kept self kept locked kept $" -- scratch_left
exec {held}<&-
cat >"$work/train.yaml" <<YAML
data: {train: $work/ds.lmdb, batch_size: 4, threads: 2, image_size: 16}
model:
  classes: 3
  layers: [{type: conv, out: 4, kernel: 3}, {type: global_avgpool}, {type: linear, out: 3}]
backend: cpu
compute_threads: 2
YAML
check bench_train 0 "compute only .* img/s" -- "$stoke" bench train --config "$work/train.yaml" --seconds 0.05 --repeats 2
check bench_train_timeline_needs_a_gpu 1 "--timeline times copies and steps on a GPU; this run's backend is cpu" -- \
  "$stoke" bench train --config "$work/train.yaml" --seconds 0.05 --repeats 1 --timeline 4
check bench_seconds_positive 105 "seconds" -- "$stoke" bench read --data "$work/src" --seconds 0
finish
