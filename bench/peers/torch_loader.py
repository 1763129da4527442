#!/usr/bin/python3
"""The job `stoke bench pipeline` measures, done the usual PyTorch way: torchvision ImageFolder,
RandomResizedCrop(224), RandomHorizontalFlip, ToTensor, Normalize, DataLoader with N workers.
Prints one JSON line: images/s over the epochs after the first (warm-up), median of --repeats."""
import argparse
import json
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("data", help="image folder tree (one folder per class)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=3, help="per run; the first is not timed")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if a.epochs < 2:
        sys.exit("torch_loader.py: --epochs must be >= 2 (the first is a warm-up)")
    torch.set_num_threads(1)  # workers do the work; the main process only collects batches
    tf = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
    ])
    ds = datasets.ImageFolder(a.data, transform=tf)
    rates = []
    for _ in range(a.repeats):
        loader = DataLoader(ds, batch_size=a.batch, shuffle=True, num_workers=a.workers,
                            persistent_workers=a.workers > 0, drop_last=False)
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
                      "workers": a.workers, "batch": a.batch, "images": len(ds),
                      "img_s": statistics.median(rates), "runs": rates}))


if __name__ == "__main__":
    main()
