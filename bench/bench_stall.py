"""How long an in-flight weight update stalls generation, vs one decode step and vs the broadcast itself;
and tokens/s with an update after every decode step vs without updates.

Run: .venv/bin/python bench/bench_stall.py [--model tiny|30m] [--requests 32] [--tokens 200] [--every 1]
                                           [--recompute-kv]      (~1 min for tiny, ~3 min for 30m, 2 cores)

One vLLM engine built exactly as actor.py builds it (actor.start_engines), a sender thread in this process
acting as trainer rank 0 (weights_sync.WeightSender over gloo), and actor.update_weights as the actor
calls it. Phase 1 generates N x T tokens without updates; phase 2 the same, with an update after every
`--every` decode steps (a streamed request marks the steps).
- pause:     actor.update_weights wall time (pause_generation .. resume_generation): generation is stopped
- decode:    median time between two tokens of the streamed request in phase 1 (one engine step)
- broadcast: the worker's time waiting on the wire (header + buckets); load: its reload_weights time
"""
import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import actor  # noqa: E402
from bench_weights import engine_sender  # noqa: E402
import common  # noqa: E402

MODELS = {"tiny": {}, "30m": dict(hidden=512, layers=10, heads=8, kv_heads=4, intermediate=1536, max_pos=512)}
PROMPTS = ["12+34=\n", "7+8=\n", "305+96=\n", "1+1=\n"]


async def generate_all(engine, params, n, tag, on_step=None, every=1):
    """n requests to completion; the first is streamed and `on_step` awaited after each of its tokens.
    -> (completion tokens, wall seconds, times between the streamed request's tokens)"""
    t0 = time.perf_counter()
    rest = [asyncio.create_task(actor.generate(engine, PROMPTS[i % 4], params, f"{tag}-{i}")) for i in range(1, n)]
    gaps, last, seen, due = [], None, 0, every
    async for out in engine.generate(PROMPTS[0], params, request_id=f"{tag}-0"):
        now = time.perf_counter()
        new = len(out.outputs[0].token_ids) - seen
        seen += new
        if last is not None and new:
            gaps.append((now - last) / new)
        last = now
        if on_step is not None and not out.finished and seen >= due:
            due = seen + every
            await on_step()
            last = time.perf_counter()  # the next gap is a decode step, not the update
    outs = await asyncio.gather(*rest)
    return seen + sum(len(r["completion_ids"]) for r in outs), time.perf_counter() - t0, gaps


async def run(args, model_dir, tmp):
    cfg = common.load_config([f"model.path={model_dir}", f"run.dir={tmp}", "actor.kv_cache_gb=1",
                              f"actor.max_inflight={args.requests}", f"actor.max_tokens={args.tokens}",
                              f"actor.cpu_cores={args.cpu_cores}"])
    engine = actor.start_engines(cfg)[0]
    from safetensors.torch import load_file
    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    manifest = [(n, tuple(t.shape), t.dtype) for n, t in sd.items()]
    sender = await engine_sender(engine, cfg.sync.bucket_mb)
    send_s, versions = [], iter(range(1 << 30))

    async def update():
        v = next(versions)
        t = threading.Thread(target=lambda: send_s.append(_timed(sender.send, v, iter(sd.items()), manifest)))
        t.start()
        _, pause = await actor.update_weights([engine], v, args.recompute_kv, 120)
        t.join()
        stats.append((pause, *(await engine.collective_rpc("weight_sync_stats"))[0].values()))

    stats = []
    await update()  # version 0, so that every token carries a version
    from vllm import SamplingParams  # as actor.sampling_params, but every request runs the full length
    params = SamplingParams(n=1, temperature=1.0, max_tokens=args.tokens, logprobs=0, ignore_eos=True)
    await generate_all(engine, params, 4, "warmup")
    stats.clear()
    tokens0, wall0, gaps = await generate_all(engine, params, args.requests, "plain")
    tokens1, wall1, _ = await generate_all(engine, params, args.requests, "updates", update, args.every)
    engine.shutdown()
    return tokens0 / wall0, tokens1 / wall1, float(np.median(gaps)), stats, send_s, wall1


def _timed(f, *a):
    t = time.perf_counter()
    f(*a)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--cpu-cores", default="1")
    ap.add_argument("--every", type=int, default=1, help="decode steps between updates")
    ap.add_argument("--recompute-kv", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import vllm.v1.engine.async_llm  # noqa: F401  (before any engine exists; see actor.main)
    from scripts.make_tiny_model import random_model_dir
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_model_dir(os.path.join(tmp, "model"), seed=0, **MODELS[args.model])
        tps0, tps1, step, stats, send_s, wall1 = asyncio.run(run(args, model_dir, tmp))
    pause, _version, _seconds, nbytes, wire, load = (np.array(c, dtype=float) for c in zip(*stats))
    n = len(pause)
    pct = lambda x, q: float(np.percentile(x, q)) * 1e3  # noqa: E731
    print(f"\n== {args.model}: {nbytes[0] / 1e6:.1f} MB of weights, {args.requests} requests x {args.tokens} tokens, "
          f"recompute_kv={args.recompute_kv}")
    print(f"  decode step (no updates)  {step * 1e3:7.1f} ms")
    print(f"  pause per update          {pct(pause, 50):7.1f} ms median, {pct(pause, 90):.1f} p90  ({n} updates)")
    print(f"    of which broadcast      {pct(wire, 50):7.1f} ms   load (reload_weights) {pct(load, 50):.1f} ms   "
          f"rest (pause/resume, rpc) {pct(pause - wire - load, 50):.1f} ms")
    print(f"  trainer's send            {np.median(send_s) * 1e3:7.1f} ms median")
    print(f"  pause / decode step = {np.median(pause) / step:.1f}    pause / broadcast = "
          f"{np.median(pause) / np.median(wire):.1f}")
    print(f"  tokens/s: {tps0:.0f} without updates, {tps1:.0f} with an update every {args.every} step(s) "
          f"({tps1 / tps0:.2f}x); {n / wall1:.1f} updates/s")


if __name__ == "__main__":
    main()
