"""U(h): generation throughput of this project's vLLM engine at batch h, for scripts/throughput_model.py.

    .venv/bin/python bench/bench_engine_util.py [--model assets/tiny-model] [--cores 0] \
        [--out bench/out/engine_util.json]
    .venv/bin/python scripts/throughput_model.py --util bench/out/engine_util.json [runs/repro/*]

About 1-2 minutes on one CPU core with the embedded tiny model (engine start ~20-40 s). Measures:
  1. tokens/s at batch h for h in --batches: h requests of exactly --tokens completion tokens each
     (ignore_eos), started together on one engine pinned to --cores; best of --repeats (other load on the
     machine only ever slows a repeat down). U(h) = tokens/s / the best over h (the paper's U is a fraction
     of peak FLOPs; on a CPU we do not know the peak, so the flash is the best measured per-token time).
  2. the completion lengths the model samples on the training task (temperature 1, actor.max_tokens):
     the long tail the model needs;
  3. how many completion tokens/s the trainer's work (forward, backward, AdamW; fp32, one thread per core)
     gets through on batches of those sequences: tau = peak / this.
Writes one JSON (h, tokens_per_s, U, lengths, train_completion_tokens_per_s, ...) and prints a table.
The engine settings are the actor's (eager, fp32, a small KV cache: docs/DESIGN.md,
"Known traps (measured)"), with prefix caching off: these prompts are distinct, and each h is timed
afresh, never on blocks a repeat left cached.
Not a test: the numbers depend on the machine and on what else runs on it.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import common  # noqa: E402


def measure_generation(llm, prompts, batches, tokens, repeats):
    from vllm import SamplingParams
    params = SamplingParams(temperature=1.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True, seed=0)
    llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up: first-call allocations
    out = []
    for h in batches:
        best = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            res = llm.generate(prompts[:h], params, use_tqdm=False)
            wall = time.perf_counter() - t0
            n = sum(len(r.outputs[0].token_ids) for r in res)
            best = max(best, n / wall)
        out.append(best)
        print(f"  h={h:>4}: {best:8.0f} tokens/s", flush=True)
    return out


def sample_lengths(llm, prompts, max_tokens):
    from vllm import SamplingParams
    res = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=1), use_tqdm=False)
    return [[list(r.prompt_token_ids), list(r.outputs[0].token_ids)] for r in res]


def measure_training(model_dir, seqs, batch, steps, lr=1e-4):
    """Completion tokens/s of forward + backward + AdamW on right-padded rows (as trainer.py's micro-batches)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rows = seqs[:batch]
    T = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)  # [B,T]
    mask = torch.zeros(len(rows), T - 1, dtype=torch.bool)  # [B,T-1] completion tokens
    for i, (p, c) in enumerate(rows):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        mask[i, len(p) - 1:len(p) - 1 + len(c)] = True
    n_tokens, times = int(mask.sum()), []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]  # [B,T-1,V]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B,T-1]
        loss = -(logp * mask).sum() / len(rows)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return n_tokens / min(times[1:])  # the first step pays one-off allocations


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="assets/tiny-model")
    ap.add_argument("--cores", default="0", help="CPU cores for the engine and the training measurement (taskset list)")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256", help="batch sizes h")
    ap.add_argument("--tokens", type=int, default=32, help="completion tokens per request when measuring U(h)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64, help="actor.max_tokens for the sampled lengths")
    ap.add_argument("--n-lengths", type=int, default=256, help="completions sampled for the length distribution")
    ap.add_argument("--train-batch", type=int, default=64)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--out", default="bench/out/engine_util.json")
    args = ap.parse_args()

    import torch
    cores = sorted(common.cpu_set(args.cores))
    on_gpu = torch.cuda.is_available()
    if not on_gpu:  # one OMP thread per listed core for the engine; the same cores for this process
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.cores
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    model_dir = str(REPO / args.model) if (REPO / args.model).exists() else args.model
    batches = [int(h) for h in args.batches.split(",")]

    import tasks
    test = tasks.arithmetic_test(max(max(batches), args.n_lengths))
    prompts = [tasks.format_prompt(p) for p in test]
    from vllm import LLM
    t0 = time.time()
    extra = {"gpu_memory_utilization": 0.5} if on_gpu else {"kv_cache_memory_bytes": 1 << 30}
    llm = LLM(model=model_dir, dtype="auto" if on_gpu else "float32", enforce_eager=not on_gpu, seed=0,
              enable_prefix_caching=False, generation_config="vllm", max_num_seqs=max(batches), **extra)
    print(f"engine started in {time.time() - t0:.0f} s; U(h) with {args.tokens} tokens per request, cores {args.cores}")
    tps = measure_generation(llm, prompts, batches, args.tokens, args.repeats)
    seqs = sample_lengths(llm, prompts[:args.n_lengths], args.max_tokens)
    lengths = [len(c) for _, c in seqs]
    del llm
    train_tps = measure_training(model_dir, seqs, args.train_batch, args.train_steps)

    peak = max(tps)
    import vllm
    result = {"model": args.model, "device": "cuda" if on_gpu else "cpu", "cores": 1 if on_gpu else len(cores),
              "tokens_per_request": args.tokens, "h": batches, "tokens_per_s": tps,
              "U": [t / peak for t in tps], "peak_tokens_per_s": peak, "lengths": lengths,
              "train_completion_tokens_per_s": train_tps / (1 if on_gpu else len(cores)),
              "train_batch": args.train_batch, "time": time.time(),
              "versions": {"vllm": vllm.__version__, "torch": torch.__version__}}
    out = REPO / args.out if not os.path.isabs(args.out) else Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\n{'h':>5} {'tokens/s':>10} {'U(h)':>6}")
    for h, t in zip(batches, tps):
        print(f"{h:>5} {t:>10.0f} {t / peak:>6.2f}")
    print(f"completion lengths: mean {sum(lengths) / len(lengths):.1f}, max {max(lengths)} "
          f"(max_tokens {args.max_tokens})")
    print(f"training: {train_tps:.0f} completion tokens/s -> tau = {peak / train_tps:.2f} flashes per token")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
