#!/usr/bin/env python3
"""Train a torchvision ResNet-18 from a stoke dataset, fed by stoke.torch.Loader.

    build/bin/stoke demo                                   # makes build/demo/train.lmdb and _val
    PYTHONPATH=build/python python3 examples/train_torchvision.py build/demo/train.lmdb \
        --val build/demo/train_val.lmdb --size 64 --batch-size 64 --epochs 2

On a GPU it trains in mixed precision (autocast to bfloat16 where the GPU has it, else float16
with a gradient scaler), channels-last; on the CPU in float32. The loader hands out batches where
the model runs: on a GPU it copies them there and normalises them with its own kernel, in the
autocast type, on the current stream.
"""
import argparse
import time

import torch
import torch.nn.functional as F

try:
    import torchvision
except ImportError:
    raise SystemExit("train_torchvision.py needs torchvision for its ResNet-18: pip install torchvision "
                     "(or apt-get install python3-torchvision)") from None

from stoke.torch import Loader

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("train", help="a dataset made by `stoke pack`")
    p.add_argument("--val", help="a validation dataset")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=224, help="training crop side")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate at batch 256 (scaled linearly)")
    p.add_argument("--threads", type=int, default=0, help="loader threads (0: this process's share of the cores)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: all epochs)")
    args = p.parse_args()
    for flag, value, least in (("--epochs", args.epochs, 1), ("--max-steps", args.max_steps, 0)):
        if value < least:
            p.error(f"{flag} must be at least {least}, not {value}")

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    # Mixed precision on a GPU only (bfloat16 where it has it); the CPU trains in float32.
    amp_dtype = torch.float16 if on_gpu and not torch.cuda.is_bf16_supported() else torch.bfloat16
    input_dtype = amp_dtype if on_gpu else torch.float32
    loader = Loader(args.train, batch_size=args.batch_size, size=args.size, threads=args.threads, seed=1,
                    device=device, normalize=(MEAN, STD), dtype=input_dtype)
    classes = len(loader.dataset.classes)
    # The validation set opened now, not after training: a wrong path, or a set of other classes
    # (whose top-1 would mean nothing), is found before the first step.
    val = None
    if args.val:
        val = Loader(args.val, batch_size=args.batch_size, size=args.size, train=False, threads=args.threads,
                     device=device, normalize=(MEAN, STD), dtype=input_dtype)
        if list(val.dataset.classes) != list(loader.dataset.classes):
            raise SystemExit(f"--val {args.val}: its classes ({len(val.dataset.classes)}) are not those of "
                             f"{args.train} ({classes}); give a validation split of the same dataset")
    model = torchvision.models.resnet18(num_classes=classes).to(device, memory_format=torch.channels_last)
    lr = args.lr * args.batch_size / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-5)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(loader), pct_start=0.25)
    # Loss scaling for float16 only; torch.amp.GradScaler from torch 2.3, torch.cuda.amp's before.
    use_scaler = on_gpu and amp_dtype == torch.float16
    scaler = (torch.amp.GradScaler("cuda", enabled=use_scaler) if hasattr(torch.amp, "GradScaler")
              else torch.cuda.amp.GradScaler(enabled=use_scaler))

    def prepare(batch):
        # Normalised [B, 3, H, W] channels-last images and int64 labels, already on `device`.
        return batch["images"], batch["labels"]

    step = 0
    for epoch in range(args.epochs):
        model.train()
        start, seen, loss_sum = time.perf_counter(), 0, 0.0
        for batch in loader:
            x, y = prepare(batch)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=on_gpu):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            seen += y.numel()
            loss_sum += loss.item() * y.numel()
            step += 1
            if args.max_steps and step >= args.max_steps:
                break
        secs = time.perf_counter() - start
        print(f"epoch {epoch}: loss {loss_sum / max(seen, 1):.4f}, {seen / secs:.1f} images/s", flush=True)
        if args.max_steps and step >= args.max_steps:
            break

    if val is not None:
        model.eval()
        correct = total = 0
        with torch.no_grad(), torch.autocast(device.type, dtype=amp_dtype, enabled=on_gpu):
            for batch in val:
                x, y = prepare(batch)
                correct += (model(x).argmax(1) == y).sum().item()
                total += y.numel()
        print(f"validation: top-1 {100 * correct / total:.2f}% on {total} images")
    loader.close()
    if val is not None:
        val.close()


if __name__ == "__main__":
    main()
