"""How long an in-flight weight update stops generation, against what it must cost (wire + load), for the
actor's update path (actor.update_weights: the pause awaited, then receive+load, label, resume back to back) and
the sequential path it replaced (AsyncLLM.pause_generation, then each call awaited in turn), and the
actor's path followed by its weight check (actor.verify_weights), side by side in one run on one engine.

Run: .venv/bin/python bench/bench_stall.py [--model tiny|30m] [--requests 32] [--tokens 200] [--every 4]
                                           [--recompute-kv]      (~1-2 min for tiny, ~4 min for 30m, 2 cores)

One vLLM engine built exactly as actor.py builds it (engine_setup.start_engines), a sender thread in this process
acting as trainer rank 0 (weights_sync.WeightSender over gloo, its broadcast posted before the update as
the trainer's would be). Phase 1 generates N x T tokens without updates; phases 2 and 3 the same with an
update after every `--every` tokens of one streamed request, which also measures the stall as generation
sees it. Per update:
- stall:  the streamed request's gap across the update minus the median decode step (time generation
          stood still), and the update call's wall time as the actor sees it;
- wire:   the worker's time waiting on the broadcast (header + buckets); load: its reload_weights time;
- rest:   stall - wire - load: pause/resume hand-offs, RPC round trips, vLLM's 20 ms sleep (sequential).
Not a test: the numbers depend on the machine and on what else runs on it (these ratios are the figures).
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
from scripts import engine_setup  # noqa: E402

MODELS = {"tiny": {}, "30m": dict(hidden=512, layers=10, heads=8, kv_heads=4, intermediate=1536, max_pos=512)}
PROMPTS = ["12+34=\n", "7+8=\n", "305+96=\n", "1+1=\n"]


async def sequential_update(engines, version, recompute_kv, timeout_s):
    """The update path before the actor sent receive, label and resume together: vLLM's
    pause_generation (a round trip, then a 20 ms sleep), then receive, label and resume, each awaited
    in turn."""
    t0 = time.perf_counter()
    await asyncio.gather(*(e.pause_generation(mode="keep", clear_cache=recompute_kv) for e in engines))
    got = await asyncio.gather(*(e.collective_rpc("receive_weights", timeout=timeout_s) for e in engines))
    await asyncio.gather(*(e.update_weight_version(str(version)) for e in engines))
    await asyncio.gather(*(e.resume_generation() for e in engines))
    return [s for per_engine in got for s in per_engine], time.perf_counter() - t0


def verified(probe):
    """The actor's update path followed by its check that the engine computes what the trainer sent
    (actor.verify_weights, sync.verify_every=1): the probe request rides along with the decode steps."""
    async def update(engines, version, recompute_kv, timeout_s):
        stats, wall = await actor.update_weights(engines, version, recompute_kv, timeout_s)
        t0 = time.perf_counter()
        await actor.verify_weights(engines, version, probe, 1e-3)
        return stats, wall + time.perf_counter() - t0
    return update


def trainer_probe(model_dir, cfg, reps=20):
    """trainer.probe_logprobs on these weights (one rank, in this process) -> (probe, seconds per call)."""
    import trainer
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = trainer.build_state(cfg, torch.device("cpu"), model=model)
    probe = trainer.probe_logprobs(state, cfg)
    t0 = time.perf_counter()
    for _ in range(reps):
        trainer.probe_logprobs(state, cfg)
    return probe, (time.perf_counter() - t0) / reps


async def generate_all(engine, params, n, tag, on_step=None, every=1):
    """n requests to completion; the first is streamed and `on_step` awaited after each `every` of its
    tokens. -> (completion tokens, wall seconds, gaps between tokens, gaps across each update)"""
    t0 = time.perf_counter()
    rest = [asyncio.create_task(actor.generate(engine, PROMPTS[i % 4], params, f"{tag}-{i}")) for i in range(1, n)]
    gaps, across, last, seen, due, updated = [], [], None, 0, every, False
    async for out in engine.generate(PROMPTS[0], params, request_id=f"{tag}-0"):
        now = time.perf_counter()
        new = len(out.outputs[0].token_ids) - seen
        seen += new
        if last is not None and new:
            (across if updated else gaps).append(now - last if updated else (now - last) / new)
        last, updated = now, False
        if on_step is not None and not out.finished and seen >= due:
            due = seen + every
            await on_step()  # the next gap spans the update
            updated = True
    outs = await asyncio.gather(*rest)
    return seen + sum(len(r["completion_ids"]) for r in outs), time.perf_counter() - t0, gaps, across


async def run(args, model_dir, tmp):
    cfg = common.load_config([f"model.path={model_dir}", f"run.dir={tmp}", "actor.kv_cache_gb=1",
                              f"actor.max_inflight={args.requests}", f"actor.max_tokens={args.tokens}",
                              f"actor.cpu_cores={args.cpu_cores}", "actor.eval_every=0"])
    engine = engine_setup.start_engines(cfg)[0]
    from safetensors.torch import load_file
    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    manifest = [(n, tuple(t.shape), t.dtype) for n, t in sd.items()]
    sender = await engine_sender(engine, cfg.sync.bucket_mb)
    versions, rows = iter(range(1 << 30)), {}

    def updater(path, name):
        async def update():
            v = next(versions)
            t = threading.Thread(target=sender.send, args=(v, iter(sd.items()), manifest))
            t.start()  # the broadcast is posted first, as the trainer's is when it announces
            stats, wall = await path([engine], v, args.recompute_kv, 120)
            t.join()
            rows.setdefault(name, []).append((wall, stats[0]["wire_s"], stats[0]["load_s"]))
        return update

    await updater(actor.update_weights, "warm-up")()  # version 0, so that every token carries a version
    from vllm import SamplingParams  # as actor.sampling_params, but every request runs the full length
    params = SamplingParams(n=1, temperature=1.0, max_tokens=args.tokens, logprobs=0, ignore_eos=True)
    await generate_all(engine, params, 4, "warmup")
    tokens0, wall0, gaps, _ = await generate_all(engine, params, args.requests, "plain")
    step = float(np.median(gaps))
    probe, probe_s = trainer_probe(model_dir, cfg)
    out = {"decode step": step, "tokens/s without updates": tokens0 / wall0, "trainer probe s": probe_s}
    for name, path in (("pipelined (actor.update_weights)", actor.update_weights),
                       ("pipelined + verified", verified(probe)),
                       ("sequential (pause_generation)", sequential_update)):
        tokens, wall, _, across = await generate_all(engine, params, args.requests, name[:4], updater(path, name),
                                                     args.every)
        out[name] = (np.array(rows[name]), np.array(across) - step, tokens / wall)
    engine.shutdown()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--cpu-cores", default="1")
    ap.add_argument("--every", type=int, default=4, help="streamed tokens between updates")
    ap.add_argument("--recompute-kv", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import vllm.v1.engine.async_llm  # noqa: F401  (before any engine exists; see actor.main)
    from scripts.make_tiny_model import random_model_dir
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_model_dir(os.path.join(tmp, "model"), seed=0, **MODELS[args.model])
        out = asyncio.run(run(args, model_dir, tmp))
    ms = lambda x: float(np.median(x)) * 1e3  # noqa: E731
    print(f"\n== {args.model}: {args.requests} requests x {args.tokens} tokens, an update every {args.every} "
          f"tokens, recompute_kv={args.recompute_kv}")
    print(f"  decode step (no updates)  {out['decode step'] * 1e3:7.1f} ms;  {out['tokens/s without updates']:.0f} tokens/s")
    print(f"  trainer side of the check (trainer.probe_logprobs, one rank): {out['trainer probe s'] * 1e3:.1f} ms")
    for name in ("pipelined (actor.update_weights)", "pipelined + verified", "sequential (pause_generation)"):
        rows, stall, tps = out[name]
        wall, wire, load = rows[:, 0], rows[:, 1], rows[:, 2]
        print(f"  {name}: {len(rows)} updates, medians: stall {ms(stall):.1f} ms (update call {ms(wall):.1f}), "
              f"wire {ms(wire):.1f}, load {ms(load):.1f}, rest {ms(stall) - ms(wire) - ms(load):.1f}")
        print(f"    stall / (wire + load) = {np.median(stall) / np.median(wire + load):.2f};  "
              f"tokens/s {tps:.0f} ({tps / out['tokens/s without updates']:.2f}x of no updates)")
    a, b = (np.median(out[n][1]) for n in ("pipelined (actor.update_weights)", "sequential (pause_generation)"))
    print(f"  stall, pipelined / sequential = {a / b:.2f}")


if __name__ == "__main__":
    main()
