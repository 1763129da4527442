#!/usr/bin/env python3
"""The job `stoke bench pipeline` measures, done with NVIDIA DALI's CPU pipeline: the file reader,
a CPU JPEG decoder fused with RandomResizedCrop (fn.decoders.image_random_crop, which decodes only
the crop's region where it can), resize to 224x224 and a random horizontal flip, uint8 HWC out,
no GPU (device_id=None). Prints one JSON line: images/s over the epochs after the first
(warm-up), median of --repeats. Run it with a Python that has nvidia-dali (bench/peers/
compare-pipeline --dali makes a virtual environment with it)."""
import json
import statistics
import time

from nvidia import dali
from nvidia.dali import fn, pipeline_def, types

from peer_args import loader_args


def main():
    a = loader_args("dali_loader.py", "image folder tree (one folder per class)")

    @pipeline_def(batch_size=a.batch, num_threads=a.threads, device_id=None, prefetch_queue_depth=2)
    def crops():
        jpegs, labels = fn.readers.file(file_root=a.data, random_shuffle=True, name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                               random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
        images = fn.resize(images, resize_x=224, resize_y=224)
        images = fn.flip(images, horizontal=fn.random.coin_flip())
        return images, labels

    rates = []
    images_per_epoch = 0
    for r in range(a.repeats):
        pipe = crops(seed=r + 1)
        pipe.build()
        images_per_epoch = pipe.epoch_size("reader")
        batches = (images_per_epoch + a.batch - 1) // a.batch
        images = 0
        t0 = None
        for epoch in range(a.epochs):
            if epoch == 1:
                t0 = time.perf_counter()
            for _ in range(batches):
                out, _ = pipe.run()
                if epoch >= 1:
                    images += len(out)
        rates.append(images / (time.perf_counter() - t0))
        del pipe
    print(json.dumps({"tool": "NVIDIA DALI CPU pipeline", "dali": dali.__version__, "threads": a.threads,
                      "batch": a.batch, "images": images_per_epoch, "img_s": statistics.median(rates),
                      "runs": rates}))


if __name__ == "__main__":
    main()
