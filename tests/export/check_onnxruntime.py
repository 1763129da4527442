"""Runs stoke's exported ONNX models in ONNX Runtime and compares them with stoke's own results.

    check_onnxruntime.py models DIR        (files written by `export_reference models DIR`)
    check_onnxruntime.py val DIR EVAL_JSON MODEL.onnx MODEL_U8.onnx
"""
import json
import sys

import numpy as np
import onnxruntime as ort

TOLERANCE = 1e-4  # of the largest |logit| of the batch
TOP1_POINTS = 0.2


def session(path):
    options = ort.SessionOptions()
    # One thread, the caller's: ONNX Runtime's pool spin-waits between operators. Beside a busy
    # core (ctest -j2 on 2 cores) the whole test took 65 s with two threads, 42 s with one (31 s
    # either way alone).
    options.intra_op_num_threads = 1
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def check_models(directory):
    failures = 0
    for case in json.load(open(f"{directory}/index.json")):
        name, n, size, classes = case["name"], case["batch"], case["size"], case["classes"]
        base = f"{directory}/{name}"
        want = np.fromfile(f"{base}.logits", dtype=np.float32).reshape(n, classes)
        f32 = np.fromfile(f"{base}.f32", dtype=np.float32).reshape(n, 3, size, size)
        u8 = np.fromfile(f"{base}.u8", dtype=np.uint8).reshape(n, size, size, 3)
        scale = float(np.abs(want).max())
        for variant, inputs in (("folded", {"input": f32}), ("unfolded", {"input": f32}), ("uint8", {"image": u8})):
            path = {"folded": f"{base}.onnx", "unfolded": f"{base}_nofold.onnx", "uint8": f"{base}_u8.onnx"}[variant]
            s = session(path)
            meta = s.get_modelmeta().custom_metadata_map
            assert len(json.loads(meta["stoke.classes"])) == classes, meta
            got = s.run(["logits"], inputs)[0]
            assert got.shape == want.shape, (got.shape, want.shape)
            err = float(np.abs(got - want).max()) / scale
            ok = err <= TOLERANCE
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name:16s} {variant:8s} max |ort - stoke| / max |logit| = {err:.2e}"
                  f" (max |logit| {scale:.3g}, tolerance {TOLERANCE:g})")
        # Dynamic batch: one sample alone gives its row of the batch.
        got1 = session(f"{base}.onnx").run(["logits"], {"input": f32[1:2]})[0]
        err1 = float(np.abs(got1[0] - want[1]).max()) / scale
        failures += err1 > TOLERANCE
        print(f"{'ok  ' if err1 <= TOLERANCE else 'FAIL'} {name:16s} batch of 1 {err1:.2e}")
    return failures


def check_val(directory, eval_json, model, model_u8):
    meta = json.load(open(f"{directory}/val.json"))
    n, size = meta["samples"], meta["size"]
    images = np.fromfile(f"{directory}/val.u8", dtype=np.uint8).reshape(n, size, size, 3)
    labels = np.fromfile(f"{directory}/val.labels", dtype=np.int32)
    stoke_top1 = json.load(open(eval_json))["top1"] * 100
    failures = 0
    if abs(meta["top1"] * 100 - stoke_top1) > 1e-9:
        print(f"FAIL the reference's top-1 {meta['top1'] * 100:.2f}% differs from stoke eval's {stoke_top1:.2f}%")
        failures += 1
    s8 = session(model_u8)
    m = s8.get_modelmeta().custom_metadata_map
    mean = np.array(json.loads(m["stoke.mean"]), dtype=np.float32).reshape(1, 3, 1, 1)
    std = np.array(json.loads(m["stoke.std"]), dtype=np.float32).reshape(1, 3, 1, 1)
    # The float model gets what its metadata says: (x / 255 - mean) / std, N x 3 x H x W.
    normalised = ((images.transpose(0, 3, 1, 2).astype(np.float32) / 255.0) - mean) / std
    for name, s, inputs in (("uint8 input", s8, lambda lo, hi: {"image": images[lo:hi]}),
                            ("float input", session(model), lambda lo, hi: {"input": normalised[lo:hi]})):
        correct = 0
        for lo in range(0, n, 100):
            logits = s.run(["logits"], inputs(lo, min(n, lo + 100)))[0]
            correct += int((logits.argmax(axis=1) == labels[lo:lo + 100]).sum())
        top1 = 100.0 * correct / n
        ok = abs(top1 - stoke_top1) <= TOP1_POINTS
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: ONNX Runtime top-1 {top1:.2f}% vs stoke eval {stoke_top1:.2f}% "
              f"on {n} samples (within {TOP1_POINTS} points)")
    return failures


def main():
    if sys.argv[1] == "models":
        failures = check_models(sys.argv[2])
    else:
        failures = check_val(*sys.argv[2:6])
    print(f"{failures} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
