"""One-shot GPU check of the paths CPU CI cannot run: NCCL process groups, bf16 compute, the hand-written
FSDP on CUDA, and the weight sender on CUDA. Prints one line per check and writes a JSON report.

Run on a GPU machine:  python bench/gpu_check.py [--out report.json] [--big]
  --big   also time a Qwen2-0.5B-shaped model (random weights, built in-process: nothing is downloaded)

Checks (each independent; a failure is reported and the next check runs):
  fsdp_fp32   FSDP on CUDA over a 1-rank NCCL group, fp32 compute, vs the plain single-process AdamW
              reference of tests/test_trainer.py on the same GPU: max |param diff| after 3 steps (CPU bound 1e-5)
  fsdp_fp32_ac  the same with trainer.activation_checkpointing=true (re-gather in recomputation)
  fsdp_bf16   the same with bf16 compute (model.dtype auto on GPU): distance from the fp32 reference, reported
  nccl_2rank  two processes on the same GPU in one NCCL group: NCCL refuses this ("Duplicate GPU") in most
              builds; when it works, a WeightSender -> receive() round trip is checked bit for bit
  big, big_ac  (--big) tokens/s, TFLOP/s (6·N·tokens) and peak memory of train_step at bf16, and the time of
              send_weights (gather + pack; a 1-rank group broadcasts to nobody); big_ac: the same with activation
              checkpointing (memory vs speed)
vLLM on GPU is not checked here: the device machine has no vLLM and cannot download it.
"""
import argparse
import gc
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
import trainer  # noqa: E402
import weights_sync  # noqa: E402
from conftest import free_port  # noqa: E402
from test_trainer import full_params, make_batch, make_cfg, reference_train, tiny_model  # noqa: E402

REPORT = {}


def check(name):
    def wrap(fn):
        def run(*a, **kw):
            t0 = time.time()
            try:
                REPORT[name] = {"ok": True, **fn(*a, **kw)}
            except Exception as e:  # report and go on: every check is independent
                REPORT[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
            REPORT[name]["s"] = round(time.time() - t0, 1)
            print(f"[gpu_check] {name}: {json.dumps({k: v for k, v in REPORT[name].items() if k != 'trace'})}",
                  flush=True)
        return run
    return wrap


def _fsdp_vs_reference(tmp, dtype, ac=False):
    cfg = make_cfg(tmp, world=1, **{"model.dtype": dtype, "trainer.activation_checkpointing": ac})
    dev = torch.device("cuda")
    batches = [make_batch(12, v, seed=v) for v in range(3)]
    ref, ref_losses, _ = reference_train(tiny_model().to(dev), batches, 12, dev)
    state = trainer.build_state(cfg, dev, model=tiny_model())
    losses = [trainer.train_step(state, b, cfg)["loss"] for b in batches]
    got = full_params(state)
    diff = max((got[n].float() - ref[n].float()).abs().max().item() for n in ref)
    return {"max_param_diff": diff, "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "compute_dtype": str(state.fsdp.dtype)}


@check("fsdp_fp32")
def fsdp_fp32(tmp):
    r = _fsdp_vs_reference(tmp, "float32")
    assert r["max_param_diff"] < 1e-5, f"FSDP fp32 on CUDA is {r['max_param_diff']:.2e} from the reference (> 1e-5)"
    return r


@check("fsdp_fp32_ac")
def fsdp_fp32_ac(tmp):
    r = _fsdp_vs_reference(tmp, "float32", ac=True)
    assert r["max_param_diff"] < 1e-5, f"FSDP + activation checkpointing on CUDA is {r['max_param_diff']:.2e} off"
    return r


@check("fsdp_bf16")
def fsdp_bf16(tmp):
    return _fsdp_vs_reference(tmp, "auto")


def _two_rank(rank, port, result_q):
    try:
        torch.cuda.set_device(0)
        store = weights_sync.create_store("127.0.0.1", port, rank == 0, 60)
        pg = weights_sync.init_group(store, rank, 2, "nccl", timeout_s=60)
        torch.manual_seed(0)
        model = tiny_model().to("cuda", torch.bfloat16)
        named = list(model.state_dict().items())
        if rank == 0:
            sender = weights_sync.WeightSender(store, pg, bucket_mb=0.01)  # several buckets
            manifest = [(n, list(t.shape), t.dtype) for n, t in named]
            sender.send(7, iter(named), manifest)
            result_q.put(("sent", None))
        else:
            version, got = weights_sync.receive(pg)
            same = all(torch.equal(got[n], t) for n, t in named)
            result_q.put(("received", {"version": version, "tensors": len(got), "bit_equal": same}))
    except Exception as e:
        result_q.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))


@check("nccl_2rank")
def nccl_2rank():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_two_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = []
    deadline = time.time() + 90
    while len(out) < 2 and time.time() < deadline:
        try:
            out.append(q.get(timeout=5))
        except Exception:
            pass
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    errors = [v for k, v in out if k == "error"]
    if errors or len(out) < 2:
        return {"supported": False, "errors": errors or ["timed out after 90 s"]}
    rec = next(v for k, v in out if k == "received")
    assert rec["bit_equal"] and rec["version"] == 7, rec
    return {"supported": True, **rec}


ROWS, PROMPT, COMPLETION, VOCAB = 64, 128, 512, 151936  # one batch of the --big checks: 64 x 640 tokens


def _big(tmp, ac):
    """-> (report, state) after a warm-up and 3 timed train_steps of a Qwen2-0.5B-shaped model at bf16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=896, num_hidden_layers=24,
                                         num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                                         tie_word_embeddings=False))
    n_params = sum(p.numel() for p in model.parameters())
    cfg = make_cfg(tmp, world=1, batch_size=ROWS, **{"actor.max_tokens": COMPLETION,
                                                     "trainer.micro_batch_tokens": 16384, "model.dtype": "auto",
                                                     "trainer.activation_checkpointing": ac})
    state = trainer.build_state(cfg, torch.device("cuda"), model=model)
    rng = np.random.default_rng(0)

    def batch(version):
        return [dict(prompt_ids=rng.integers(0, VOCAB, PROMPT).astype(np.int32),
                     completion_ids=rng.integers(0, VOCAB, COMPLETION).astype(np.int32),
                     logprobs=rng.uniform(-12, -11, COMPLETION).astype(np.float32),
                     versions=np.full(COMPLETION, version, np.int32), advantage=float(rng.normal()), reward=1.0,
                     group_id=i) for i in range(ROWS)]

    torch.cuda.reset_peak_memory_stats()
    trainer.train_step(state, batch(0), cfg)  # warm-up
    torch.cuda.synchronize()
    t0, steps = time.time(), 3
    for v in range(1, steps + 1):
        m = trainer.train_step(state, batch(v), cfg)
    torch.cuda.synchronize()
    dt, tokens = (time.time() - t0) / steps, ROWS * (PROMPT + COMPLETION)
    return {"params_M": round(n_params / 1e6, 1), "activation_checkpointing": ac, "train_step_s": round(dt, 3),
            "tokens_per_s": round(tokens / dt), "micro_batches": m["micro_batches"],
            "tflops": round(6 * n_params * tokens / dt / 1e12, 1),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
            "loss_finite": bool(np.isfinite(m["loss"]))}, state


@check("big")
def big(tmp):
    out, state = _big(tmp, ac=False)
    store = weights_sync.create_store("127.0.0.1", free_port(), True, 60)
    pg = weights_sync.init_group(store, 0, 1, "nccl", timeout_s=60)
    sender = weights_sync.WeightSender(store, pg, bucket_mb=32)
    trainer.send_weights(state, sender, 1)  # warm-up (staging buffers)
    torch.cuda.synchronize()
    times = []
    for v in range(2, 5):
        times.append(trainer.send_weights(state, sender, v))
        torch.cuda.synchronize()
    gb = out["params_M"] * 1e6 * 2 / 1e9
    return {**out, "send_weights_s": round(min(times), 3), "send_gb": round(gb, 2),
            "send_gb_per_s": round(gb / min(times), 1)}


@check("big_ac")
def big_ac(tmp):
    gc.collect()  # the previous check's model: FSDP's wrapped forwards make reference cycles
    torch.cuda.empty_cache()
    return _big(tmp, ac=True)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--big", action="store_true")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "no CUDA device: this script is for a GPU machine"
    REPORT["env"] = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
                     "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    print(f"[gpu_check] env: {REPORT['env']}", flush=True)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "gpu_check"
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group("nccl", timeout=timedelta(seconds=120), device_id=torch.device("cuda", 0))
    fsdp_fp32(tmp)
    fsdp_fp32_ac(tmp)
    fsdp_bf16(tmp)
    nccl_2rank()
    if args.big:
        big(tmp)
        big_ac(tmp)
    dist.destroy_process_group()
    Path(args.out).write_text(json.dumps(REPORT, indent=1))
    failed = [k for k, v in REPORT.items() if k != "env" and not v["ok"]]
    print(f"[gpu_check] done; failed: {failed or 'none'}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
