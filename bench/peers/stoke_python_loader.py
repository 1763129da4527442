#!/usr/bin/python3
"""stoke's loader through its Python package (stoke.torch.Loader: torch uint8 tensors viewing the
ring), the same job as `stoke bench pipeline`: RandomResizedCrop(224) + flip, full shuffle.
Prints one JSON line: images/s over the epochs after the first (warm-up), median of --repeats.
Run with PYTHONPATH=build/python."""
import json
import statistics
import time

from peer_args import loader_args
from stoke.torch import Loader


def main():
    a = loader_args("stoke_python_loader.py", "a dataset made by `stoke pack`")
    rates = []
    for _ in range(a.repeats):
        loader = Loader(a.data, batch_size=a.batch, size=224, threads=a.threads, seed=1)
        images, t0 = 0, None
        for epoch in range(a.epochs):
            if epoch == 1:
                t0 = time.perf_counter()
            for batch in loader:
                if epoch >= 1:
                    images += batch["images"].shape[0]
                del batch
        rates.append(images / (time.perf_counter() - t0))
        loader.close()
    print(json.dumps({"img_s": statistics.median(rates), "runs": rates}))


if __name__ == "__main__":
    main()
