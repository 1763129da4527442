#!/usr/bin/python3
"""The training step `stoke bench train` measures, in PyTorch: the same model (built from the JSON
that `stoke bench train --model-json` writes, or torchvision's own ResNet-18/34/50 when the preset
is one of them and torchvision is installed), batch, threads, loss and optimizer (SGD with
momentum / Nesterov / weight decay), on one fixed batch of normalised input. On the device the JSON
names: "cpu" in float32, or "cuda" with autocast to the JSON's precision (bfloat16, or float16
with a GradScaler). Prints one JSON line: images/s, median of --repeats runs of --steps steps
after --warmup steps."""
import argparse
import json
import statistics
import time

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.spec = spec["layers"]
        self.mods = nn.ModuleDict()
        for l in self.spec:
            t, name = l["type"], l["name"]
            if t == "conv":
                m = nn.Conv2d(l["in_c"], l["out"], l["kernel"], l["stride"], l["pad"], bias=l["bias"])
            elif t == "batchnorm":
                bn = nn.BatchNorm1d if l["in_vector"] else nn.BatchNorm2d
                m = bn(l["in_c"], eps=spec["bn_epsilon"], momentum=spec["bn_momentum"])
            elif t == "relu":
                m = nn.ReLU()
            elif t == "maxpool":
                m = nn.MaxPool2d(l["kernel"], l["stride"], l["pad"])
            elif t == "avgpool":
                m = nn.AvgPool2d(l["kernel"], l["stride"], l["pad"], count_include_pad=True)
            elif t == "global_avgpool":
                m = nn.AdaptiveAvgPool2d(1)
            elif t == "linear":
                features = l["in_c"] * (1 if l["in_vector"] else l["in_h"] * l["in_w"])
                m = nn.Sequential(nn.Flatten(), nn.Linear(features, l["out"], bias=l["bias"]))
            elif t == "flatten":
                m = nn.Flatten()
            elif t == "dropout":
                m = nn.Dropout(l["p"])
            elif t == "add":
                m = None
            else:
                raise SystemExit(f"torch_train.py: unknown layer type {t}")
            if m is not None:
                self.mods[name] = m

    def forward(self, x):
        out = {"input": x}
        y = x
        for l in self.spec:
            ins = [out[i] for i in l["inputs"]]
            y = ins[0] + ins[1] if l["type"] == "add" else self.mods[l["name"]](ins[0])
            out[l["name"]] = y
        return y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="JSON from stoke bench train --model-json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--channels-last", action="store_true", help="NHWC memory format")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (the warm-up compiles it)")
    a = ap.parse_args()
    spec = json.load(open(a.model))
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    device = spec.get("device", "cpu")
    precision = spec.get("precision", "float32")
    model_source = "stoke layer list"
    net = None
    if spec.get("preset") in ("resnet18", "resnet34", "resnet50"):
        try:
            import torchvision
            net = getattr(torchvision.models, spec["preset"])(num_classes=spec["classes"])
            model_source = "torchvision " + spec["preset"]
        except ImportError:
            net = None
    if net is None:
        net = Net(spec)
    n, size, classes = spec["batch"], spec["image_size"], spec["classes"]
    x = torch.randn(n, 3, size, size)
    y = torch.randint(0, classes, (n,))
    if device == "cuda":
        torch.backends.cudnn.benchmark = True
        net, x, y = net.cuda(), x.cuda(), y.cuda()
    amp_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(precision)
    use_amp = device == "cuda" and amp_dtype is not None
    scaler = None
    if use_amp and amp_dtype == torch.float16:  # torch.amp.GradScaler from torch 2.3, torch.cuda.amp's before
        scaler = torch.amp.GradScaler("cuda") if hasattr(torch.amp, "GradScaler") else torch.cuda.amp.GradScaler()
    if a.channels_last:
        net = net.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=spec["label_smoothing"])
    params = list(net.parameters())
    if a.compile:
        if not hasattr(torch, "compile"):
            raise SystemExit(f"torch_train.py: --compile needs torch 2.0 or later, this is {torch.__version__}")
        net = torch.compile(net)
    opt = torch.optim.SGD(params, lr=0.01, momentum=spec["momentum"], nesterov=spec["nesterov"],
                          weight_decay=spec["weight_decay"])
    net.train()

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=amp_dtype, enabled=use_amp):
            loss = loss_fn(net(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    rates = []
    for _ in range(a.repeats):
        for _ in range(a.warmup):
            step()
        sync()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        sync()
        rates.append(a.steps * n / (time.perf_counter() - t0))
    print(json.dumps({"img_s": statistics.median(rates), "runs": rates, "threads": a.threads, "batch": n,
                      "channels_last": a.channels_last, "compiled": a.compile, "torch": torch.__version__,
                      "device": device, "precision": precision if use_amp else "float32", "model": model_source,
                      "params": sum(p.numel() for p in params)}))


if __name__ == "__main__":
    main()
