"""Reads a run's TensorBoard event files with TensorBoard's own reader (EventAccumulator, which
checks every record's checksums) and compares every scalar with metrics.jsonl: same tags, steps,
wall times and values (metrics.jsonl holds doubles; events hold float32).
Usage: check_tensorboard.py RUN_DIR"""
import json
import os
import sys

import numpy as np
import tensorboard
from tensorboard.backend.event_processing import event_accumulator

TAGS = {"train": ["loss", "top1", "lr", "images_per_s", "data_wait"],
        "val": ["loss", "top1", "top5"],
        "epoch": ["loss", "top1"]}


def main(run_dir):
    want = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            for field in TAGS.get(r["type"], []):
                if field in r:
                    want.setdefault(f'{r["type"]}/{field}', []).append((r["step"], r["time"], r[field]))
    tb_dir = os.path.join(run_dir, "tensorboard")
    files = [f for f in os.listdir(tb_dir) if "tfevents" in f]
    assert len(files) == 1, f"expected one event file in {tb_dir}, found {files}"
    acc = event_accumulator.EventAccumulator(tb_dir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    tags = sorted(acc.Tags()["scalars"])
    assert tags == sorted(want), f"tags differ: tensorboard {tags} vs metrics.jsonl {sorted(want)}"
    compared = 0
    for tag in tags:
        got = [(e.step, e.wall_time, e.value) for e in acc.Scalars(tag)]
        exp = want[tag]
        assert len(got) == len(exp), f"{tag}: {len(got)} events vs {len(exp)} metrics lines"
        for (gs, gt, gv), (es, et, ev) in zip(got, exp):
            assert gs == es, f"{tag}: step {gs} vs {es}"
            assert gt == et, f"{tag} step {gs}: wall time {gt} vs {et}"
            assert np.float32(gv) == np.float32(ev), f"{tag} step {gs}: {gv} vs {ev}"
            compared += 1
    steps = [s for s, _, _ in want["train/loss"]]
    assert steps == sorted(set(steps)), f"train/loss steps repeat or go back: {steps}"
    print(f"tensorboard {tensorboard.__version__}: {len(tags)} tags, {compared} scalars equal to metrics.jsonl "
          f"({run_dir}); train/loss steps {steps[0]}..{steps[-1]}")


if __name__ == "__main__":
    main(sys.argv[1])
