"""Weight-broadcast bandwidth: `WeightSender.send` (header + packing + broadcast) vs a raw broadcast of
the same bytes between the same two processes; then the load into a vLLM engine, timed separately.

Run: .venv/bin/python bench/bench_weights.py [--models tiny,100m] [--reps 5] [--no-vllm]
     (~3 min on 2 cores with both models; target: send / raw >= 0.9)

Rank 0 (this process) sends; rank 1 is a plain receiver process that walks the received tensors without
copying them (the receiver's work in vLLM, the load, is measured in the vLLM phase). Every timing starts
after a barrier (a broadcast rooted at rank 1) so that both ends are ready; repetitions interleave the
three methods and the median is reported.
- send:        WeightSender.send (JSON header, bucket layout, double-buffered packing, bucket broadcasts)
- raw buckets: one broadcast per bucket of pre-filled buffers of the same sizes (the same collectives)
- raw flat:    one broadcast of all bytes at once (no bucketing at all)
"""
import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import weights_sync as ws  # noqa: E402

MODELS = {"tiny": {}, "100m": dict(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2560, max_pos=512)}
METHODS = ("send", "raw buckets", "raw flat")


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_state_dict(model_dir):
    from safetensors.torch import load_file
    return load_file(os.path.join(model_dir, "model.safetensors"))


def barrier(pg, rank):
    pg.broadcast(torch.zeros(1), 1).wait()  # rank 0 returns once rank 1 has posted: both are ready


def plan(sd, bucket_mb):
    manifest = [(n, tuple(t.shape), t.dtype) for n, t in sd.items()]
    _, sizes = ws.bucket_layout(manifest, int(bucket_mb * 2**20))
    return manifest, sizes


def receiver(port, model_dir, bucket_mb, reps):
    torch.set_num_threads(1)
    sd = load_state_dict(model_dir)
    _, sizes = plan(sd, bucket_mb)
    store = ws.create_store("127.0.0.1", port, False, 120)
    pg = ws.init_group(store, 1, 2, "gloo", 120)
    bufs = [torch.empty(s, dtype=torch.uint8) for s in sizes]
    flat = torch.empty(sum(sizes), dtype=torch.uint8)
    cache = {}  # like the vLLM worker on CPU: receive buffers kept across updates
    for _ in range(reps):
        for method in METHODS:
            barrier(pg, 1)
            if method == "send":
                header = ws.receive_header(pg)
                for _name, _t in ws.iter_tensors(pg, header, buffers=cache):
                    pass
            elif method == "raw buckets":
                for b in bufs:
                    pg.broadcast(b, 0).wait()
            else:
                pg.broadcast(flat, 0).wait()


def bench_wire(model_dir, bucket_mb, reps):
    sd = load_state_dict(model_dir)
    manifest, sizes = plan(sd, bucket_mb)
    port = free_port()
    proc = mp.get_context("spawn").Process(target=receiver, args=(port, model_dir, bucket_mb, reps))
    proc.start()
    store = ws.create_store("127.0.0.1", port, True, 120)
    pg = ws.init_group(store, 0, 2, "gloo", 120)
    sender = ws.WeightSender(store, pg, bucket_mb)
    bufs = [torch.ones(s, dtype=torch.uint8) for s in sizes]
    flat = torch.ones(sum(sizes), dtype=torch.uint8)
    times = {m: [] for m in METHODS}
    for v in range(reps):
        for method in METHODS:
            barrier(pg, 0)
            t0 = time.perf_counter()
            if method == "send":
                sender.send(v, iter(sd.items()), manifest)
            elif method == "raw buckets":
                works = [pg.broadcast(b, 0) for b in bufs]
                for w in works:
                    w.wait()
            else:
                pg.broadcast(flat, 0).wait()
            times[method].append(time.perf_counter() - t0)
    proc.join()
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    return nbytes, len(sizes), {m: sorted(ts)[len(ts) // 2] for m, ts in times.items()}


async def engine_sender(engine, bucket_mb):
    """A weight group of two: trainer rank 0 in this process, the engine's one worker as rank 1."""
    store = ws.create_store("127.0.0.1", 0, True, 120)
    box = {}
    th = threading.Thread(target=lambda: box.update(pg=ws.init_group(store, 0, 2, "gloo", 120, "weights/1")))
    th.start()  # init_group blocks until the worker joins, which the RPCs below make happen
    await engine.collective_rpc("init_weights_sync", args=("127.0.0.1", store.port, 120, "engine-bench"))
    await engine.collective_rpc("join_roster", args=(1, 1, 2, 120))
    th.join()
    return ws.WeightSender(store, box["pg"], bucket_mb)


def bench_vllm(model_dir, bucket_mb, reps):
    """The same send into a vLLM engine's worker: wire time vs load (in place) time."""
    import asyncio
    os.environ["PYTHONPATH"] = str(REPO)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "1"
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    sd = load_state_dict(model_dir)
    manifest, _ = plan(sd, bucket_mb)

    async def run():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=model_dir, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 << 20,
            worker_extension_cls="weights_sync.WeightUpdateExtension"))
        sender = await engine_sender(engine, bucket_mb)
        rows = []
        for v in range(reps):
            t_send = {}

            def send():
                t0 = time.perf_counter()
                sender.send(v, iter(sd.items()), manifest)
                t_send["s"] = time.perf_counter() - t0
            th = threading.Thread(target=send)
            th.start()
            t0 = time.perf_counter()
            stats = (await engine.collective_rpc("receive_weights"))[0]
            rpc_s = time.perf_counter() - t0
            th.join()
            rows.append((t_send["s"], rpc_s, stats["wire_s"], stats["load_s"]))
        engine.shutdown()
        return rows

    rows = asyncio.run(run())
    return [sorted(col)[len(col) // 2] for col in zip(*rows)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,100m")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=32.0)
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from scripts.make_tiny_model import random_model_dir
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            t0 = time.time()
            model_dir = random_model_dir(os.path.join(tmp, name), seed=0, **MODELS[name])
            nbytes, buckets, med = bench_wire(model_dir, args.bucket_mb, args.reps)
            gbps = {m: nbytes / s / 1e9 for m, s in med.items()}
            print(f"\n== {name}: {nbytes / 1e6:.1f} MB in {buckets} buckets of <= {args.bucket_mb:g} MiB "
                  f"(built in {time.time() - t0:.0f} s), median of {args.reps}")
            for m in METHODS:
                print(f"  {m:<12} {med[m] * 1e3:8.1f} ms  {gbps[m]:6.2f} GB/s")
            print(f"  send / raw buckets = {gbps['send'] / gbps['raw buckets']:.2f}   "
                  f"send / raw flat = {gbps['send'] / gbps['raw flat']:.2f}   (target >= 0.9)")
            if not args.no_vllm:
                send_s, rpc_s, wire_s, load_s = bench_vllm(model_dir, args.bucket_mb, args.reps)
                print(f"  into vLLM: trainer's send {send_s * 1e3:.1f} ms, receive_weights rpc {rpc_s * 1e3:.1f} ms "
                      f"= wire {wire_s * 1e3:.1f} ms + load (in place) {load_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
