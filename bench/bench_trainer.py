"""Trainer throughput: 1 rank vs 2 ranks of the hand-written FSDP, on the tiny model and a ~30M model.

Run: .venv/bin/python bench/bench_trainer.py [--steps 3] [--batch 32]        (~2 min on 2 CPU cores)

Each rank is one process with one torch thread (gloo on CPU), so 2 ranks use 2 cores and the ideal ratio
is 2.0. Every configuration trains on the same batch (B sequences: ~8 prompt + 8..56 completion tokens,
like the arithmetic task), split B/W per rank. Reported per configuration: tokens/s (prompt + completion,
all ranks, per second of step time), the fraction of step time rank 0 spends inside collectives
(all-gathers, reduce-scatters, all-reduces; on CPU they include waiting for the slower rank), and the peak
of gathered parameter memory relative to the whole model. Not a test: numbers depend on the machine's load.
"""
import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODELS = {"tiny": dict(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=512),  # the embedded model
          "30M": dict(hidden=512, layers=9, heads=8, kv_heads=4, intermediate=1536)}


def _batch(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        P, C = 8, int(rng.integers(8, 57))
        out.append(dict(prompt_ids=rng.integers(0, 256, P).astype(np.int32),
                        completion_ids=rng.integers(0, 256, C).astype(np.int32),
                        logprobs=rng.uniform(-6, -5, C).astype(np.float32), versions=np.zeros(C, np.int32),
                        advantage=float(rng.normal()), reward=0.0, group_id=i // 8))
    return out


def _worker(rank, world, port, model_name, steps, batch_size, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import common
    import trainer
    from scripts.make_tiny_model import tiny_config
    from transformers import Qwen2ForCausalLM

    in_collectives = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                in_collectives[0] += time.perf_counter() - t0
        return wrapper
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"):
        setattr(dist, name, timed(getattr(dist, name)))  # trainer looks them up on torch.distributed at call time

    cfg = common.load_config([f"trainer.nproc={world}", f"trainer.batch_size={batch_size}",
                              "trainer.micro_batch_tokens=1024", "actor.max_tokens=64"])
    torch.manual_seed(0)
    state = trainer.build_state(cfg, torch.device("cpu"), model=Qwen2ForCausalLM(tiny_config(**MODELS[model_name])))
    batch = _batch(batch_size)
    share = batch[rank * batch_size // world:(rank + 1) * batch_size // world]
    trainer.train_step(state, share, cfg)  # warm-up
    state.fsdp.peak_bytes, in_collectives[0] = 0, 0.0
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(state, share, cfg)
    elapsed = time.perf_counter() - t0
    if rank == 0:
        params = sum(u.numel for u in state.fsdp.units)
        tokens = sum(len(s["prompt_ids"]) + len(s["completion_ids"]) for s in batch) * steps
        queue.put(dict(params=params, tokens_per_s=tokens / elapsed, step_s=elapsed / steps,
                       coll_frac=in_collectives[0] / elapsed, peak_frac=state.fsdp.peak_bytes / (4 * params)))
    dist.destroy_process_group()


def run(model_name, world, steps, batch_size):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world, port, model_name, steps, batch_size, queue), nprocs=world, join=True)
    return queue.get()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{'model':6} {'params':>8} {'ranks':>5} {'tokens/s':>9} {'step s':>7} {'in collectives':>15} "
          f"{'peak gathered / model':>22}")
    ratios = {}
    for model_name in MODELS:
        res = {}
        for world in (1, 2):
            r = res[world] = run(model_name, world, args.steps, args.batch)
            print(f"{model_name:6} {r['params'] / 1e6:7.2f}M {world:5d} {r['tokens_per_s']:9.0f} {r['step_s']:7.3f} "
                  f"{r['coll_frac']:15.1%} {r['peak_frac']:22.2f}", flush=True)
        ratios[model_name] = res[2]["tokens_per_s"] / res[1]["tokens_per_s"]
    print("tokens/s, 2 ranks / 1 rank (ideal 2.0): " + ", ".join(f"{m} x{r:.2f}" for m, r in ratios.items()))


if __name__ == "__main__":
    main()
