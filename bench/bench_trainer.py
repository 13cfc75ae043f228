"""Trainer throughput and memory, measured side by side in one run, optionally against another checkout.

Run: .venv/bin/python bench/bench_trainer.py [--repo /path/to/other/checkout] [--reps 2] [--steps 3]
         [--batch 32] [--micro-batch-tokens 4096] [--only scaling,one_core,memory] [--mem-tokens 2048]
     (~10 min on 2 CPU cores with --repo, half without)

Every measurement runs in fresh processes (one per rank, one torch thread each, gloo on CPU) that import
trainer.py from the checkout measured: this one, and with --repo the other one too, so before/after come
out of the same run on the same machine load. A setting the other checkout's config does not know
(trainer.prefetch before it existed) is left out there: its one behaviour is measured, labelled "(none)".
  scaling   2 ranks / 1 rank tokens/s on the embedded tiny model's shape and on a ~30M model, with
            trainer.prefetch on and off; the best of --reps runs of each configuration, interleaved so that
            a burst of load on the machine hits them all. Same batch everywhere (B sequences: 8 prompt +
            8..56 completion tokens, like the arithmetic task), split B/W per rank. Printed with it: the ideal
            ratio, 1 rank's padded tokens / the busiest rank's (rows x longest per micro-batch: each rank pads
            to its own longest, so it is 2.0 only when the split pads alike; at --micro-batch-tokens 1024, the
            old default of this bench, it is 1.65), the fraction of step time rank 0 is blocked in collectives
            (sync calls and waits on async ones; they include waiting for the slower rank), and the peak of
            gathered parameters relative to the whole model.
  one_core  trainer tokens/s of the default tiny model (scripts/make_tiny_model defaults) on one core with
            the checkout's default trainer config: a 128-sequence batch of arithmetic-like lengths.
  memory    peak memory of one training step, 152k vocabulary, hidden 64, at trainer.micro_batch_tokens =
            --mem-tokens (one full micro-batch of 8 rows, 1/8 prompt; the checkout's defaults otherwise): the
            process's peak RSS during the step (Linux VmHWM, reset through /proc/self/clear_refs just before
            it), and that peak above the RSS before the step. 2048 by default: more completion positions
            than one trainer.logits_chunk (1024), and the code before chunking needs ~6 GiB there (~12 at 4096).
Tokens/s count prompt + completion tokens of all ranks per second of step time, after one warm-up step.
Not a test: the numbers depend on the machine's load (shared cores: indicative only).
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
MODELS = {"tiny": dict(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=512),  # the embedded model
          "30M": dict(hidden=512, layers=9, heads=8, kv_heads=4, intermediate=1536),
          "152k": dict(vocab_size=151936, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=256)}


def _batch(n, prompt, completion, vocab, seed=0):
    import numpy as np
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        C = int(rng.integers(*completion)) if isinstance(completion, tuple) else completion
        out.append(dict(prompt_ids=rng.integers(0, vocab, prompt).astype(np.int32),
                        completion_ids=rng.integers(0, vocab, C).astype(np.int32),
                        logprobs=rng.uniform(-6, -5, C).astype(np.float32), versions=np.zeros(C, np.int32),
                        advantage=float(rng.normal()), reward=0.0, group_id=i // 8))
    return out


def _rss_kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))


def child(job):
    """One rank of one measurement, in the checkout job["repo"]; rank 0 prints a RESULT line."""
    sys.path.insert(0, job["repo"])
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    import common
    import trainer
    from scripts.make_tiny_model import tiny_config
    from transformers import Qwen2ForCausalLM
    fields = common.DEFAULTS["trainer"] if hasattr(common, "DEFAULTS") else common.TrainerCfg.__dataclass_fields__
    missing = [k for k in job["over"] if k.startswith("trainer.") and k[8:] not in fields]
    if missing:
        print("RESULT" + json.dumps({"na": f"{missing[0]} unknown"}), flush=True)
        return
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    blocked = [0.0]  # seconds rank 0 spends blocked in a collective (sync call, or wait on an async one)

    class Timed:
        def __init__(self, work):
            self.work = work

        def wait(self):
            t0 = time.perf_counter()
            try:
                return self.work.wait()
            finally:
                blocked[0] += time.perf_counter() - t0

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                return Timed(out) if out is not None else None
            finally:
                blocked[0] += time.perf_counter() - t0
        return wrapper
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"):
        setattr(dist, name, timed(getattr(dist, name)))  # trainer looks them up on torch.distributed at call time

    over = {"trainer.nproc": world, "trainer.batch_size": job["batch"], **job["over"]}
    cfg = common.load_config([f"{k}={v}" for k, v in over.items()])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_config(**MODELS[job["model"]], max_pos=4096))
    state = trainer.build_state(cfg, torch.device("cpu"), model=model)
    vocab = model.config.vocab_size
    batch = _batch(job["batch"], job["prompt"], tuple(job["completion"]) if isinstance(job["completion"], list)
                   else job["completion"], vocab)
    r = dist.get_rank() if world > 1 else 0
    shares = [batch[i * len(batch) // world:(i + 1) * len(batch) // world] for i in range(world)]
    share = shares[r]
    # rows x longest of every micro-batch, the busiest rank's: compute is paid on padded tokens
    padded = max(sum(len(mb) * max(len(s["prompt_ids"]) + len(s["completion_ids"]) for s in mb)
                     for mb in trainer.pack_micro_batches(sh, cfg.trainer.micro_batch_tokens)) for sh in shares)
    if job["kind"] == "memory":
        rss0 = _rss_kib("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM (peak RSS) to the current RSS
        trainer.train_step(state, share, cfg)
        peak = _rss_kib("VmHWM")
        print("RESULT" + json.dumps({"peak_mib": peak / 1024, "step_mib": (peak - rss0) / 1024}), flush=True)
        return
    trainer.train_step(state, share, cfg)  # warm-up
    state.fsdp.peak_bytes, blocked[0] = 0, 0.0
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(job["steps"]):
        trainer.train_step(state, share, cfg)
    elapsed = time.perf_counter() - t0
    if r == 0:
        params = sum(u.numel for u in state.fsdp.units)
        tokens = sum(len(s["prompt_ids"]) + len(s["completion_ids"]) for s in batch) * job["steps"]
        print("RESULT" + json.dumps(dict(params=params, tokens_per_s=tokens / elapsed, step_s=elapsed / job["steps"],
                                         blocked=blocked[0] / elapsed, padded=padded,
                                         peak_frac=state.fsdp.peak_bytes / (4 * params))), flush=True)
    if world > 1:
        dist.destroy_process_group()


def measure(repo, world, **job):
    """Start `world` rank processes of one measurement in checkout `repo` -> rank 0's result dict."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = {"repo": str(repo), "steps": 3, "batch": 32, "prompt": 8, "completion": [8, 57], "over": {}, **job}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(world), "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, __file__, "--child", json.dumps(job)], env={**env, "RANK": str(r)},
                              cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = [p.communicate()[0] for p in procs]
    line = [x for x in outs[0].splitlines() if x.startswith("RESULT")]
    if any(p.returncode for p in procs) or not line:
        return {"na": "failed: " + " | ".join(o.strip().splitlines()[-1] for o in outs if o.strip())}
    return json.loads(line[0][6:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", help="another checkout to measure side by side (e.g. a worktree of an old commit)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096, help="scaling runs (4096: the config default)")
    ap.add_argument("--reps", type=int, default=2, help="scaling runs per configuration, interleaved; best kept")
    ap.add_argument("--only", default="scaling,one_core,memory")
    ap.add_argument("--mem-tokens", type=int, default=2048)
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))
    repos = {"this": HERE} | ({"other": Path(args.repo).resolve()} if args.repo else {})
    for name, repo in repos.items():
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
        print(f"checkout {name}: {repo} at {commit.stdout.strip() or '?'}", flush=True)
    only, summary = args.only.split(","), []

    def fmt(r, key, spec):
        return "n/a" if "na" in r else f"{r[key]:{spec}}"

    if "scaling" in only:
        print(f"scaling: best of {args.reps} interleaved runs; micro_batch_tokens {args.micro_batch_tokens}, "
              f"batch {args.batch}; 'ideal' = 1-rank padded tokens / the busiest rank's (the ratio if only compute "
              f"counted)\n{'checkout':8} {'model':5} {'params':>7} {'ranks':>5} {'prefetch':>8} {'tokens/s':>9} "
              f"{'step s':>7} {'blocked in coll.':>16} {'peak gathered/model':>19}  all runs (tokens/s)")
        over = {"trainer.micro_batch_tokens": args.micro_batch_tokens, "actor.max_tokens": 64}
        configs = [(1, "-"), (2, "true"), (2, "false")]
        for model in ("tiny", "30M"):
            job = dict(kind="scaling", model=model, steps=args.steps, batch=args.batch)
            runs = {}
            for _ in range(args.reps):  # interleaved: a burst of load on the machine hits every configuration
                for name, repo in repos.items():
                    for world, prefetch in configs:
                        switch = {"trainer.prefetch": prefetch} if world > 1 else {}
                        r = measure(repo, world, **job, over=over | switch)
                        if "unknown" in r.get("na", ""):  # a checkout before the key: its one behaviour
                            if prefetch == "false":
                                continue
                            r, prefetch = measure(repo, world, **job, over=over), "(none)"
                        runs.setdefault((name, world, prefetch), []).append(r)
            best = {}
            for (name, world, prefetch), rs in runs.items():
                ok = [x for x in rs if "na" not in x]
                r = best[name, world, prefetch] = max(ok, key=lambda x: x["tokens_per_s"]) if ok else rs[0]
                params = "n/a" if "na" in r else f"{r['params'] / 1e6:.2f}M"
                print(f"{name:8} {model:5} {params:>7} {world:5d} {prefetch:>8} {fmt(r, 'tokens_per_s', '9.0f'):>9} "
                      f"{fmt(r, 'step_s', '7.3f'):>7} {fmt(r, 'blocked', '16.1%'):>16} "
                      f"{fmt(r, 'peak_frac', '19.2f'):>19}  "
                      + (" ".join(f"{x['tokens_per_s']:.0f}" for x in ok) or r["na"]), flush=True)
            for (name, world, prefetch), two in best.items():
                one = best[name, 1, "-"]
                if world == 2 and "na" not in one and "na" not in two:
                    summary.append(f"{name:6} {model:5} 2 ranks / 1 rank, prefetch {prefetch:6}: "
                                   f"x{two['tokens_per_s'] / one['tokens_per_s']:.2f} "
                                   f"(ideal x{one['padded'] / two['padded']:.2f})")
    if "one_core" in only:
        rows = {name: measure(repo, 1, kind="one_core", model="tiny", steps=args.steps, batch=128, prompt=10,
                              completion=[8, 44]) for name, repo in repos.items()}
        for name, r in rows.items():
            summary.append(f"{name:6} default tiny model, one core, default trainer config: "
                           f"{fmt(r, 'tokens_per_s', '.0f')} tokens/s")
        if len(rows) == 2 and all("na" not in r for r in rows.values()):
            ratio = rows["this"]["tokens_per_s"] / rows["other"]["tokens_per_s"]
            summary.append(f"       one core, this / other: x{ratio:.2f}")
    if "memory" in only:
        rows = {}
        for name, repo in repos.items():
            rows[name] = r = measure(repo, 1, kind="memory", model="152k", batch=8, prompt=16,
                                     completion=args.mem_tokens // 8 - 16,
                                     over={"trainer.micro_batch_tokens": args.mem_tokens, "actor.max_tokens": 512})
            summary.append(f"{name:6} one step, vocab 151936, hidden 64, micro_batch_tokens {args.mem_tokens}: "
                           f"peak RSS {fmt(r, 'peak_mib', '.0f')} MiB, {fmt(r, 'step_mib', '.0f')} MiB above the "
                           f"RSS before the step")
        if len(rows) == 2 and all("na" not in r for r in rows.values()):
            ratio = rows["other"]["step_mib"] / rows["this"]["step_mib"]
            summary.append(f"       step memory above the RSS before it, other / this: x{ratio:.2f}")
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
