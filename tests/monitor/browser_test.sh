#!/usr/bin/env bash
# The monitor in a real browser: `stoke train --monitor` serves the page of its own run while it
# trains; headless Chromium loads it and must show a step written after it loaded (no reload),
# with every chart drawn and no console error. Then `stoke monitor` over that run and a finished
# one: both overlaid, against step and against wall-clock time. The screenshot is kept (SCREENSHOT, default
# build/monitor-screenshot.png of the source tree). Exit 77 (skipped) without chromium,
# chromedriver or python3-selenium (scripts/install-deps installs them).
# Usage: browser_test.sh path/to/stoke [SCREENSHOT] [MIN_EVALS]
set -euo pipefail
stoke=$1
here=$(cd "$(dirname "$0")" && pwd)
shot=${2:-$here/../../build/monitor-screenshot.png}
min_evals=${3:-0}
for need in /usr/bin/chromium /usr/bin/chromedriver; do
  [[ -x $need ]] || { echo "SKIP: $need is missing (apt-get install chromium chromium-driver)"; exit 77; }
done
/usr/bin/python3 -c 'import selenium' 2>/dev/null || { echo "SKIP: python3-selenium is missing"; exit 77; }
work=$(mktemp -d)
pid=
cleanup() {
  [[ -n $pid ]] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

"$stoke" demo --dir "$work/demo" --per-class 100 --epochs 1 --threads 1 >/dev/null
# Long enough to be still training whatever the machine: the test stops it.
sed "s|run_dir: .*|run_dir: $work/run|; s|^epochs: .*|epochs: 400|; s|log_every_steps: .*|log_every_steps: 3|;
     s|threads: 0|threads: 1|; s|compute_threads: 0|compute_threads: 1|" "$work/demo/demo.yaml" >"$work/run.yaml"
printf 'eval: {every_epochs: 4}\ncheckpoint: {every_epochs: 100}\n' >>"$work/run.yaml"
"$stoke" train --config "$work/run.yaml" --monitor 127.0.0.1:0 -q 2>"$work/train.err" &
pid=$!
url=
for _ in $(seq 300); do
  url=$(grep -o 'monitor: http://[^ ]*' "$work/train.err" | cut -d' ' -f2 || true)
  [[ -n $url ]] && grep -q '"type":"train"' "$work/run/metrics.jsonl" 2>/dev/null && break
  kill -0 "$pid" 2>/dev/null || { cat "$work/train.err"; echo "training ended early"; exit 1; }
  sleep 0.1
done
[[ -n $url ]] || { cat "$work/train.err"; echo "no monitor address on stderr"; exit 1; }
echo "training, monitor at $url"
mkdir -p "$(dirname "$shot")"
/usr/bin/python3 "$here/check_browser.py" "$url" "$work/run/metrics.jsonl" "$shot" --settle-val "$min_evals"

echo "== stoke monitor over two runs: the demo's finished run and this one, still training"
"$stoke" monitor "$work/demo/run" "$work/run" --port 0 --poll-ms 500 >"$work/monitor.out" &
mpid=$!
trap 'kill "$mpid" 2>/dev/null || true; cleanup' EXIT
for _ in $(seq 100); do grep -q "http://" "$work/monitor.out" && break; sleep 0.1; done
murl=$(grep -o 'http://[^ ]*' "$work/monitor.out")
/usr/bin/python3 "$here/check_browser.py" --overlay "$murl" "run" "run (2)"
kill -INT "$mpid"
wait "$mpid"
cat "$work/monitor.out"
kill -INT "$pid"
wait "$pid"
pid=
echo "training stopped with a checkpoint: $(ls "$work/run/checkpoints" | tail -1)"
