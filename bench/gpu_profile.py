"""Where the GPU time of one big train_step goes (bench/gpu_check.py's 630M-parameter model, bf16,
1 GPU): torch.profiler's kernels grouped into matrix products, attention, the optimizer and the rest
(elementwise, norms, copies), with each group's share of the step's GPU time. It explains gpu_check's
MFU figure. The trainer's AdamW is written with plain tensor ops (trainer.py), so its kernels count
under "the rest", not "optimizer" (which catches torch's fused/foreach optimizers only).

Run on a GPU machine:  python bench/gpu_profile.py [--out profile.txt]      (~1 min on one H200)
"""
import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import SIZES, _batch, _big, big_cfg, init_world  # noqa: E402

import trainer  # noqa: E402  (gpu_check put the repo on the path)

GROUPS = [("matrix products", ("gemm", "cutlass", "cublas", "sm90_xmma", "nvjet", "matmul")),
          ("attention", ("flash", "fmha", "attention", "sdpa")),
          ("optimizer", ("adam", "foreach", "multi_tensor")),
          ("cross-entropy and softmax", ("softmax", "log_softmax", "nll", "cross_entropy"))]
REST = "the rest (elementwise, norms, copies)"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_profile.txt")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "no CUDA device: this script is for a GPU machine"
    init_world()
    tmp = Path(tempfile.mkdtemp())
    report, state = _big(tmp)  # warm-up and 3 timed steps
    sz = SIZES["gpu"]
    batch = _batch(sz["rows"], sz["prompt"], sz["completion"], sz["model"]["vocab_size"], 9, 9)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.train_step(state, batch, big_cfg(tmp))
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages()
               if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in kernels)
    groups = {name: 0.0 for name, _ in GROUPS} | {REST: 0.0}
    for e in kernels:
        key = next((name for name, pats in GROUPS if any(p in e.key.lower() for p in pats)), None)
        groups[key or REST] += e.self_device_time_total
    lines = [f"train_step (timed in _big): {report['train_step_s']} s, {report['tokens_per_s']} tokens/s, "
             f"MFU {report['mfu']:.0%}; profiled step: GPU busy {total / 1e6:.3f} s", ""]
    lines += [f"{name:40s} {t / 1e6:7.3f} s  {t / total:6.1%}" for name, t in groups.items()]
    lines += ["", "top kernels by GPU time:"]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]:
        lines.append(f"{e.self_device_time_total / 1e3:9.1f} ms  {e.count:5d}x  {e.key[:110]}")
    text = "\n".join(lines)
    print(text, flush=True)
    Path(args.out).write_text(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
