#!/usr/bin/env bash
# End-to-end checks of the stoke CLI: exit codes and messages as a user sees them.
# Usage: cli_test.sh path/to/stoke
set -u
stoke=$1
source "$(dirname "$0")/cli_lib.sh"

# The version names the revision built, read at every build (read when CMake configured, it named
# an older one after later commits).
if head=$(git -C "$(dirname "$0")" rev-parse --short=12 HEAD 2>/dev/null); then
  check version_names_head 0 "^stoke [0-9.]+ \($head\)$" -- "$stoke" --version
fi
check synth 0 "wrote 3 classes" -- "$stoke" synth "$work/src" --classes 3 --per-class 10
printf 'not a jpeg' >"$work/src/class_01/broken.jpg"
# Into a folder holding files the images would be mixed with them (an earlier synth's classes
# stayed, and were packed): refused. A negative seed wrapped to 2^64 - 1.
check synth_into_a_used_folder 1 "src: exists and is not an empty folder" -- \
  "$stoke" synth "$work/src" --classes 2 --per-class 2
check synth_negative_seed 105 "--seed: must be >= 0, not -1" -- "$stoke" synth "$work/neg" --seed -1
check synth_shapes_limit 1 "at most 20 distinct classes" -- "$stoke" synth "$work/shapes" --style shapes --classes 21 \
  --per-class 1
# A synth stopped mid-tree leaves no OUT (a pack of it would take the part for the whole set): the
# tree is built in OUT.partial, renamed into place when complete; the next synth starts over.
synth_stopped() {  # synth_stopped SIGNAL OUT: signals a large synth once its first image is written
  "$stoke" synth "$2" --classes 50 --per-class 400 &
  local pid=$! i
  for ((i = 0; i < 200; ++i)); do
    [[ -e $2.partial/class_00/img_0000.jpg ]] && break
    sleep 0.05
  done
  kill -"$1" "$pid"
  wait "$pid"
  local rc=$?
  [[ ! -e $2 ]] || { echo "$2 exists after the signal"; return 99; }
  return $rc
}
check synth_interrupted 130 "interrupted; .*stopped not written" -- synth_stopped INT "$work/stopped"
check synth_interrupted_left_nothing 0 "" -- test ! -e "$work/stopped.partial"
check synth_killed 137 "" -- synth_stopped KILL "$work/killed"
check synth_after_a_kill 0 "wrote 2 classes x 3 images" -- "$stoke" synth "$work/killed" --classes 2 --per-class 3
check synth_after_a_kill_counts 0 "^6$" -- bash -c "find '$work/killed' -name '*.jpg' | wc -l; test ! -e '$work/killed.partial'"
mkdir -p "$work/user.partial/notes"
check synth_keeps_a_users_partial_folder 1 "user.partial: holds .*notes, which synth does not write" -- \
  "$stoke" synth "$work/user" --classes 1 --per-class 1
check pack 0 "train: 30 records" -- "$stoke" pack "$work/src" "$work/ds.lmdb" --threads 2 -q \
  --report "$work/report.json"
check pack_validate_pixels 0 "train: 30 records" -- "$stoke" pack "$work/src" "$work/px.lmdb" -q \
  --validate pixels
check pack_bad_validate 105 "validate" -- "$stoke" pack "$work/src" "$work/v.lmdb" --validate all
check pack_reports_bad 0 "skipped class_01/broken.jpg" -- "$stoke" pack "$work/src" "$work/ds2.lmdb" -q
check report_file 0 "broken.jpg" -- cat "$work/report.json"
check pack_exists 1 "already exists .*--overwrite" -- "$stoke" pack "$work/src" "$work/ds.lmdb" -q
mkdir -p "$work/allbad/c" && printf 'not a jpeg' >"$work/allbad/c/a.jpg"
check pack_nothing_packed 0 "none of the 1 inputs could be packed .*allbad.lmdb holds no record" -- \
  "$stoke" pack "$work/allbad" "$work/allbad.lmdb" -q
check pack_missing_src 1 "no-such-dir" -- "$stoke" pack "$work/no-such-dir" "$work/x.lmdb" -q
# Images beside the class folders belong to no class: said, not dropped in silence; and a
# dataset's root given for one split (its "classes" train and val) is pointed out.
mkdir -p "$work/loose/cat" "$work/roots/train/cat" "$work/roots/val/cat"
cp "$work/src/class_00/img_0000.jpg" "$work/loose/cat/" && cp "$work/src/class_00/img_0001.jpg" "$work/loose/"
cp "$work/src/class_00/img_0000.jpg" "$work/roots/train/cat/" && cp "$work/src/class_00/img_0001.jpg" "$work/roots/val/cat/"
check pack_names_loose_images 0 "loose: 1 file\(s\) directly in it \(e.g. img_0001.jpg\) are in no class folder" -- \
  "$stoke" pack "$work/loose" "$work/loose.lmdb" -q
check pack_names_a_roots_splits 0 "roots: its class folders are all named as splits \(train, val\)" -- \
  "$stoke" pack "$work/roots" "$work/roots.lmdb" -q
# An output that is a link is written through, dangling or not (a dangling one was taken for a
# file in the way once the pack was done, and could then be neither resumed nor overwritten).
mkdir -p "$work/store" && ln -s store/linked.lmdb "$work/linked.lmdb"
check pack_through_a_dangling_link 0 "train: 30 records, 3 classes, .* -> .*store/linked.lmdb" -- \
  "$stoke" pack "$work/src" "$work/linked.lmdb" -q
check pack_through_a_link_overwrites 0 "train: 30 records" -- \
  "$stoke" pack "$work/src" "$work/linked.lmdb" -q --overwrite
check pack_through_a_link_left_the_link 0 "records +30" -- bash -c \
  "test -L '$work/linked.lmdb' && test ! -e '$work/linked.lmdb.partial' && '$stoke' inspect '$work/linked.lmdb'"
ln -s loop_b "$work/loop_a" && ln -s loop_a "$work/loop_b"
check pack_into_a_loop_of_links 1 "loop_a: a loop of symbolic links" -- "$stoke" pack "$work/src" "$work/loop_a" -q
# A name too long for the working copies' names, refused before the work (it failed after it).
long=$(printf 'n%.0s' $(seq 250))
check pack_name_too_long 1 "a name of 250 bytes; .* 11 more \('.publishing'\), past the 255-byte limit" -- \
  "$stoke" pack "$work/src" "$work/$long" -q
check pack_name_too_long_wrote_nothing 0 "" -- bash -c "! ls '$work' | grep -q '^nnnnn'"
check pack_empty_report 105 "--report: expected a file name, got an empty string" -- \
  "$stoke" pack "$work/src" "$work/r.lmdb" --report ""
check pack_empty_val_output 105 "--val-output: expected a folder name, got an empty string" -- \
  "$stoke" pack "$work/src" "$work/r.lmdb" --val-fraction 0.2 --val-output ""
check pack_bad_flag 105 "quality" -- "$stoke" pack "$work/src" "$work/y.lmdb" --quality 0
check pack_on_error_fail 1 "broken.jpg.*--on-error fail" -- \
  "$stoke" pack "$work/src" "$work/z.lmdb" -q --on-error fail
# Ctrl-C during a pack: exit 130 (143 for SIGTERM; not 1, as for a failure) and a resumable
# dataset. The list file is a FIFO, so the signal lands while pack waits for its list: after the
# handler is in place (pack opens the list only then), before any record is written.
pack_from_fifo() {  # pack_from_fifo SIGNAL(0: none, else INT or TERM) pack-args...
  local signal=$1
  shift
  rm -f "$work/list.fifo" && mkfifo "$work/list.fifo"
  "$stoke" pack "$work/src" "$work/int.lmdb" --list "$work/list.fifo" -q "$@" &
  local pid=$!
  # The writer opens the FIFO (which waits for pack to open it), signals, then writes the list. It
  # runs apart, so that a pack that fails before opening its list cannot leave this test waiting.
  (
    exec 9>"$work/list.fifo"
    if [[ $signal != 0 ]]; then kill -"$signal" "$pid" && sleep 0.2; fi
    printf 'class_00/img_0000.jpg 0\nclass_00/img_0001.jpg 0\nclass_02/img_0003.jpg 2\n' >&9
  ) &
  local writer=$!
  wait "$pid"
  local rc=$?
  kill "$writer" 2>/dev/null
  wait "$writer" 2>/dev/null
  return $rc
}
check pack_interrupted 130 "interrupted; 0 records of train kept .*--resume" -- pack_from_fifo INT
check pack_terminated 143 "interrupted; 0 records of train kept .*--resume" -- pack_from_fifo TERM --resume
check pack_interrupted_resumed 0 "train: 3 records" -- pack_from_fifo 0 --resume
# Stopped while replacing an output: --resume continues (it still replaces it); --resume and
# --overwrite together are refused, so the advice names the swap.
check pack_overwrite_interrupted 130 "rerun the same command with --resume in place of --overwrite \(it still replaces .*int.lmdb\)" -- \
  pack_from_fifo INT --overwrite
check pack_overwrite_interrupted_kept_the_old 0 "records +3$" -- "$stoke" inspect "$work/int.lmdb"
check pack_overwrite_interrupted_resumed 0 "train: 3 records" -- pack_from_fifo 0 --resume
# --resume takes only an interrupted pack's folder at OUT.partial; a user's file there is kept.
echo "notes" >"$work/kept.lmdb.partial"
check pack_resume_keeps_other_files 1 "kept.lmdb.partial is not an interrupted pack" -- \
  "$stoke" pack "$work/src" "$work/kept.lmdb" -q --resume
check pack_resume_kept_the_file 0 "notes" -- cat "$work/kept.lmdb.partial"
# A second pack into an output another one is writing is refused, and touches nothing: flock(1)
# holds the output's lock as a running pack would.
check pack_locked 1 "another process .*locked.lmdb.lock" -- \
  flock "$work/locked.lmdb.lock" "$stoke" pack "$work/src" "$work/locked.lmdb" -q --overwrite
check pack_locked_left_nothing 1 "" -- test -e "$work/locked.lmdb.partial" -o -e "$work/locked.lmdb"
check pack_unlocked 0 "train: 30 records" -- "$stoke" pack "$work/src" "$work/locked.lmdb" -q
check pack_lock_removed 1 "" -- test -e "$work/locked.lmdb.lock"
# --resume on a finished output only reads it: it works in a folder this user cannot write (as
# root, the check runs as nobody in a folder root owns).
ro=$(mktemp -d /tmp/stoke-cli-ro.XXXXXX)
cp -r "$work/src" "$work/locked.lmdb" "$ro/"
chmod -R a+rX "$ro" && chmod a-w "$ro"
as_reader=()
if [[ $(id -u) -eq 0 ]]; then as_reader=(setpriv --reuid=65534 --regid=65534 --clear-groups); fi
check pack_resume_finished_read_only 0 "already complete" -- \
  "${as_reader[@]}" "$stoke" pack "$ro/src" "$ro/locked.lmdb" -q --resume
chmod u+w "$ro" && rm -rf "$ro"
check inspect 0 "records +30" -- "$stoke" inspect "$work/ds.lmdb"
check inspect_json 0 '"records": 30' -- "$stoke" inspect "$work/ds.lmdb" --json
check inspect_verify 0 "30 records checked, 0 bad" -- "$stoke" inspect "$work/ds.lmdb" --verify
check extract 0 "record 4 ->" -- "$stoke" inspect "$work/ds.lmdb" --extract 4 --output "$work/r4.jpg"
check extract_with_verify 108 "--verify excludes --extract" -- \
  "$stoke" inspect "$work/ds.lmdb" --extract 4 --output "$work/r4v.jpg" --verify
check extract_into_no_folder 1 "nodir/r4.jpg: create: No such file or directory" -- \
  "$stoke" inspect "$work/ds.lmdb" --extract 4 --output "$work/nodir/r4.jpg"
check extract_range 1 "record 99 out of range" -- \
  "$stoke" inspect "$work/ds.lmdb" --extract 99 --output "$work/r99.jpg"
# Never into the dataset read (its data.mdb was once replaced by the record).
check extract_not_into_the_dataset 1 "inspect: --output .*data.mdb: that is inside .*ds.lmdb" -- \
  "$stoke" inspect "$work/ds.lmdb" --extract 0 --output "$work/ds.lmdb/data.mdb"
check extract_left_the_dataset 0 "records +30" -- "$stoke" inspect "$work/ds.lmdb"
# pack's --report never over its list file, an image or the datasets it writes.
check pack_report_not_into_the_source 1 "pack: --report .*: that is inside .*src" -- \
  "$stoke" pack "$work/src" "$work/rep.lmdb" -q --report "$work/src/class_00/img_0000.jpg"
check pack_report_not_into_the_output 1 "pack: --report .*: that is inside .*rep.lmdb" -- \
  "$stoke" pack "$work/src" "$work/rep.lmdb" -q --report "$work/rep.lmdb/data.mdb"
# A list's images may be anywhere: none of them is written over (one was, with the report's JSON).
cp -r "$work/src/class_00" "$work/listed"
printf 'img_0000.jpg 0\nimg_0001.jpg 0\n' >"$work/listed.txt"
cp "$work/listed/img_0001.jpg" "$work/listed.expected"
check pack_report_not_over_a_listed_image 1 "pack: --report .*img_0001.jpg: that is the input image" -- \
  "$stoke" pack "$work/listed" "$work/rep.lmdb" -q --list "$work/listed.txt" --report "$work/listed/img_0001.jpg"
check pack_report_left_the_listed_image 0 "" -- cmp "$work/listed/img_0001.jpg" "$work/listed.expected"
check pack_val_output_needs_fraction 107 "--val-output requires --val-fraction" -- \
  "$stoke" pack "$work/src" "$work/rep.lmdb" -q --val-output "$work/rep_val.lmdb"
# Past int64 the index was once read as 9223372036854775807 and reported as that record.
check extract_past_int64 105 "99999999999999999999 is too large" -- \
  "$stoke" inspect "$work/ds.lmdb" --extract 99999999999999999999 --output "$work/rbig.jpg"
check extract_past_int64_in_hex 105 "0x7fffffffffffffffff is too large" -- \
  "$stoke" inspect "$work/ds.lmdb" --extract 0x7fffffffffffffffff --output "$work/rbig.jpg"
# A seed is 64 bits unsigned: all of them are taken, and none past them.
check synth_largest_seed 0 "wrote 1 classes x 1 images" -- \
  "$stoke" synth "$work/seed64" --classes 1 --per-class 1 --seed 18446744073709551615
check synth_seed_past_64_bits 105 "18446744073709551616 is too large" -- \
  "$stoke" synth "$work/seed65" --classes 1 --per-class 1 --seed 18446744073709551616
check inspect_missing 1 "no-such.lmdb: no such file" -- "$stoke" inspect "$work/no-such.lmdb"
mkdir -p "$work/garbage.lmdb" && head -c 100000 /dev/urandom >"$work/garbage.lmdb/data.mdb"
check inspect_garbage 1 "garbage.lmdb" -- "$stoke" inspect "$work/garbage.lmdb"
cp -r "$work/ds.lmdb" "$work/trunc.lmdb"
truncate -s 50000 "$work/trunc.lmdb/data.mdb"
check inspect_truncated 1 "truncated" -- "$stoke" inspect "$work/trunc.lmdb"

finish
