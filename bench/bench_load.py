"""What loading new weights into a vLLM engine costs, by path, and what the in-place path costs decoding
(docs/DESIGN.md, "Weights in place").

    .venv/bin/python bench/bench_load.py [--model tiny|30m|DIR] [--h 64] [--cores 0]

One offline engine in this process (vLLM's LLM with the model runner in-process, one core, the actor's
settings), the model's own checkpoint as the update. Prints medians of 20 loads:
  1. vLLM's general `reload_weights` (layerwise: rebuild each layer, rerun its post-load step; on CPU the
     oneDNN GEMM handles are packed again);
  2. after scripts/engine_setup.py, unpack_cpu_weights: `model.load_weights`, in place (the actor's path);
  3. (CPU) what re-creating the oneDNN handles after each in-place load would add;
and the decode tokens/s of h sequences x 64 tokens with vLLM's packed kernels and with the unpacked
ones (F.linear), and whether both sample the same completions (seeded).
About 1 minute (tiny) to 3 minutes (30m) on one core. Not a test: the numbers depend on the machine.
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODELS = {"30m": dict(hidden=512, layers=10, heads=8, kv_heads=4, intermediate=1536, max_pos=512)}


def median_ms(fn, n=20):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--h", type=int, default=64)
    ap.add_argument("--cores", default="0")
    args = ap.parse_args()
    # the actor's CPU engine settings (engine_setup.start_engines)
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCHDYNAMO_DISABLE="1",
                      VLLM_CPU_OMP_THREADS_BIND=args.cores)
    import torch
    torch.set_num_threads(1)
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from scripts import engine_setup
    from scripts.make_tiny_model import random_model_dir
    tmp = tempfile.mkdtemp()
    path = {"tiny": str(REPO / "assets/tiny-model")}.get(args.model, args.model)
    if args.model in MODELS:
        path = random_model_dir(os.path.join(tmp, "model"), seed=0, **MODELS[args.model])
    llm = LLM(model=path, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=2**29, seed=0,
              enable_prefix_caching=False, max_num_seqs=args.h, max_num_batched_tokens=max(2048, args.h))
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    model = worker.model_runner.get_model()
    sd = {}
    for f in engine_setup.checkpoint_files(path):
        sd.update(load_file(f))
    prompt = {"prompt_token_ids": llm.get_tokenizer()("12+34=\n")["input_ids"]}
    params = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=1)

    def decode():
        llm.generate([prompt] * 8, params, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate([prompt] * args.h, params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return tokens / (time.perf_counter() - t0), [o.outputs[0].token_ids for o in outs]

    packed_tps, packed_ids = decode()
    reload_ms = median_ms(lambda: worker.reload_weights(weights_iterator=iter(sd.items())))
    engine_setup.unpack_cpu_weights(model, path)
    in_place_ms = median_ms(lambda: model.load_weights(iter(sd.items())))
    plain_tps, plain_ids = decode()
    print(f"\n== {args.model}: {sum(t.numel() for t in sd.values()) / 1e6:.1f}M parameters, h={args.h}")
    print(f"  load: reload_weights {reload_ms:.1f} ms; in place (model.load_weights) {in_place_ms:.1f} ms")
    linears = [m for m in model.modules() if hasattr(m, "cpu_linear")]
    if linears:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        repack_ms = median_ms(lambda: [dispatch_cpu_unquantized_gemm(m, remove_weight=False)
                                       for m in linears])
        print(f"  re-creating the {len(linears)} oneDNN handles after each load would add "
              f"{repack_ms:.1f} ms")
    same = sum(a == b for a, b in zip(packed_ids, plain_ids))
    print(f"  decode: packed kernels {packed_tps:.0f} tokens/s, in-place weights (F.linear on CPU) "
          f"{plain_tps:.0f} tokens/s ({plain_tps / packed_tps:.2f}x); same completions {same}/{args.h}")


if __name__ == "__main__":
    main()
