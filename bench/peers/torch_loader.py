#!/usr/bin/python3
"""The job `stoke bench pipeline` measures, done the usual PyTorch way: torchvision ImageFolder,
RandomResizedCrop(224), RandomHorizontalFlip, PILToTensor (uint8, as stoke's batches are), DataLoader
with N workers; --normalize adds the float32 conversion and Normalize of the usual recipe (more work
than stoke's rows do). Prints one JSON line: images/s over the epochs after the first (warm-up),
median of --repeats."""
import json
import statistics
import time

import torch
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from peer_args import loader_args


def main():
    a = loader_args("torch_loader.py", "image folder tree (one folder per class)", threads_flag="--workers",
                    extra=lambda ap: ap.add_argument("--normalize", action="store_true",
                                                     help="float32 output, normalised (ToTensor + Normalize)"))
    torch.set_num_threads(1)  # workers do the work; the main process only collects batches
    to_tensor = [transforms.ToTensor(), transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])] \
        if a.normalize else [transforms.PILToTensor()]
    tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), *to_tensor])
    ds = datasets.ImageFolder(a.data, transform=tf)
    rates = []
    for _ in range(a.repeats):
        loader = DataLoader(ds, batch_size=a.batch, shuffle=True, num_workers=a.threads,
                            persistent_workers=a.threads > 0, drop_last=False)
        images = 0
        t0 = None
        for epoch in range(a.epochs):
            if epoch == 1:
                t0 = time.perf_counter()
            for x, _ in loader:
                if epoch >= 1:
                    images += x.shape[0]
        rates.append(images / (time.perf_counter() - t0))
        del loader
    print(json.dumps({"tool": "pytorch DataLoader", "torch": torch.__version__,
                      "workers": a.threads, "batch": a.batch, "images": len(ds),
                      "output": "float32 normalised" if a.normalize else "uint8",
                      "img_s": statistics.median(rates), "runs": rates}))


if __name__ == "__main__":
    main()
