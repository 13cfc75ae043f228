"""trainer.py on CPU: hand-written FSDP over real gloo ranks vs. a plain single-process reference,
micro-batching, gathered-memory bound, weight broadcast, checkpoints, and main() against fake neighbours.

Run: .venv/bin/python -m pytest -q tests/test_trainer.py        (~1-2 min on 2 cores)

Multi-rank tests start ranks with torch.multiprocessing (forkserver: conftest.forkserver) on free ports, one torch thread each.
Tolerances: "exact" means torch.equal (same arithmetic in the same order, e.g. resume vs uninterrupted).
FSDP vs. the reference is 1e-5 absolute on parameters after 3 AdamW steps at lr 1e-3: the two sum the
gradient in different orders (per-rank partial sums, padded micro-batches vs. one sample at a time), ~1e-7
relative, and Adam divides by sqrt(v), so an element whose gradient nearly cancels can move by a visible
fraction of lr; measured max 1.1e-6. A real bug (a dropped micro-batch, a wrong normalizer, clipping or
decay on the wrong elements) moves parameters by ~lr = 1e-3, 100x the tolerance.
"""
import functools
import json
import math
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import common  # noqa: E402
import elastic  # noqa: E402
import loss  # noqa: E402
import trainer  # noqa: E402
from conftest import FakeActor, forkserver, free_port, read_jsonl, receive_weights  # noqa: E402

torch.set_num_threads(1)
LR, WD, TEMP, CLIP = 1e-3, 0.1, 0.7, 1.0
CPU = torch.device("cpu")


def tiny_model(layers=3):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=False))


def make_cfg(tmp, world=1, batch_size=12, **kw):
    over = {"run.dir": str(tmp), "trainer.nproc": world, "trainer.batch_size": batch_size, "actor.group_size": 2,
            "trainer.lr": LR, "trainer.weight_decay": WD, "trainer.grad_clip": CLIP, "actor.temperature": TEMP,
            "actor.max_tokens": 12, "trainer.micro_batch_tokens": 40, **kw}
    return common.load_config([f"{k}={v}" for k, v in over.items()])


def make_batch(n, version, seed):
    """n samples sorted longest first (so the ranks' contiguous shares need different micro-batch counts).
    Behaviour logprobs around the uniform policy's log(1/64) = -4.16, a fifth of them 3 nats lower so that
    the IS clamp (ratio > 5) engages; versions up to 3 behind."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        P, C = int(rng.integers(1, 7)), int(rng.integers(1, 12))
        out.append(dict(prompt_ids=rng.integers(0, 64, P).astype(np.int32),
                        completion_ids=rng.integers(0, 64, C).astype(np.int32),
                        logprobs=(rng.uniform(-5, -3.5, C) - 3 * (rng.random(C) < 0.2)).astype(np.float32),
                        versions=np.sort(rng.integers(max(0, version - 3), version + 1, C)).astype(np.int32),
                        advantage=float(rng.normal()), reward=float(rng.random() < 0.5), group_id=100 * seed + i // 2))
    return sorted(out, key=lambda s: -(len(s["prompt_ids"]) + len(s["completion_ids"])))


def reference_train(model, batches, batch_size, device=CPU):
    """The plain single-process version: one sample at a time, torch.optim.AdamW, torch's clipping.
    device: where the model lives (bench/gpu_check.py runs it on CUDA)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, foreach=False)
    losses, norms = [], []
    for batch in batches:
        opt.zero_grad()
        total = 0.0
        for s in batch:
            P, C = len(s["prompt_ids"]), len(s["completion_ids"])
            ids = torch.from_numpy(np.concatenate([s["prompt_ids"], s["completion_ids"]]).astype(np.int64))[None].to(device)
            logits = model(input_ids=ids).logits[:, P - 1:P - 1 + C]  # [1,C,V]
            logprobs = torch.log_softmax(logits.float() / TEMP, -1).gather(-1, ids[:, P:, None])[..., 0]  # [1,C]
            lo, _ = loss.policy_loss(logprobs, torch.from_numpy(s["logprobs"])[None].to(device),
                                     torch.tensor([s["advantage"]], device=device),
                                     torch.ones(1, C, dtype=torch.bool, device=device), batch_size, is_clamp=5.0)
            lo.backward()
            total += lo.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        losses.append(total)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses, norms


def full_params(state):
    """Collective: every rank must call it."""
    out = {}
    for unit in state.fsdp.full_units(torch.float32):
        out.update({n: t.clone() for n, t in unit.items()})
    return out


def spawn(fn, world, *args):
    """fn(rank, world, port, *args) on `world` ranks (conftest.forkserver)."""
    forkserver()
    mp.start_processes(fn, args=(world, free_port()) + args, nprocs=world, join=True, start_method="forkserver")


def _init(rank, world, port):
    torch.set_num_threads(1)
    # 60 s: a rank that skips a collective then fails the test instead of hanging it for gloo's 30 minutes
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))


def _share(batch, world, rank):
    n = len(batch) // world
    return batch[rank * n:(rank + 1) * n]


# --- FSDP equivalence ----------------------------------------------------------------------------------

def _fsdp_worker(rank, world, port, tmp, batches):
    _init(rank, world, port)
    cfg = make_cfg(tmp, world)
    state = trainer.build_state(cfg, CPU, model=tiny_model())
    metrics, counts = [], []
    for batch in batches:
        counts.append(len(trainer.pack_micro_batches(_share(batch, world, rank), cfg.trainer.micro_batch_tokens)))
        metrics.append(trainer.train_step(state, _share(batch, world, rank), cfg))
    params = full_params(state)
    torch.save({"params": params, "metrics": metrics, "counts": counts, "peak": state.fsdp.peak_bytes,
                "shard_sizes": [u.shard.numel() for u in state.fsdp.units],
                "unit_numels": [u.numel for u in state.fsdp.units]}, Path(tmp) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_matches_single_process_adamw(tmp_path, world):
    batches = [make_batch(12, v, seed=v) for v in range(3)]
    spawn(_fsdp_worker, world, str(tmp_path), batches)
    ref, ref_losses, ref_norms = reference_train(tiny_model(), batches, 12)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    assert any(len(set(c)) > 1 for c in zip(*(r["counts"] for r in results))), "no step padded a rank's micro-batches"
    if world == 3:
        assert any(n % 3 for n in results[0]["unit_numels"]), "3 ranks should need padding of some unit"
    for r in results:
        assert r["params"].keys() == ref.keys()
        for name, p in ref.items():
            torch.testing.assert_close(r["params"][name], p, atol=1e-5, rtol=0, msg=name)
        for m, lo, norm in zip(r["metrics"], ref_losses, ref_norms):
            assert m["loss"] == pytest.approx(lo, rel=1e-5, abs=1e-5)
            assert m["grad_norm"] == pytest.approx(norm, rel=1e-5)
            assert m["grad_norm"] > CLIP  # clipping was active
    assert any(m["clamp_frac"] > 0 for m in results[0]["metrics"])  # the IS clamp engaged
    assert results[0]["metrics"][2]["lag_max"] == 2 and results[0]["metrics"][0]["lag_max"] == 0
    assert sum(results[0]["shard_sizes"]) * world == sum(n + (-n % world) for n in results[0]["unit_numels"])


def _prefetch_worker(rank, world, port, tmp, batches):
    _init(rank, world, port)
    out = {}
    for prefetch in ("false", "true"):
        for ac in ("false", "true"):
            cfg = make_cfg(tmp, world, **{"trainer.prefetch": prefetch, "trainer.activation_checkpointing": ac})
            state = trainer.build_state(cfg, CPU, model=tiny_model())
            metrics = [trainer.train_step(state, _share(b, world, rank), cfg) for b in batches]
            out[prefetch, ac] = (full_params(state), [(m["loss"], m["grad_norm"]) for m in metrics],
                                 state.fsdp.peak_bytes)
    if rank == 0:
        torch.save(out, Path(tmp) / "prefetch.pt")
    dist.destroy_process_group()


def test_prefetch_is_bit_identical(tmp_path):
    """2 gloo ranks, 3 steps, with and without activation checkpointing: prefetching all-gathers and async
    reduce-scatters change when collectives run, never what they compute, so parameters, losses and norms are
    equal bit for bit (torch.equal). The prefetch really ran: its peak of gathered memory is one block higher."""
    spawn(_prefetch_worker, 2, str(tmp_path), [make_batch(12, v, seed=v) for v in range(3)])
    out = torch.load(tmp_path / "prefetch.pt", weights_only=False)
    for ac in ("false", "true"):
        (p_off, m_off, peak_off), (p_on, m_on, peak_on) = out["false", ac], out["true", ac]
        assert m_on == m_off, ac
        assert p_on.keys() == p_off.keys() and all(torch.equal(p_on[k], p_off[k]) for k in p_off), ac
        assert peak_on > peak_off, ac


def _reduce_dtype_worker(rank, world, port, tmp):
    _init(rank, world, port)
    ids = [torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(r)) for r in range(world)]
    out = {}
    for dtype in ("float32", "bfloat16"):
        state = trainer.build_state(make_cfg(tmp, world, **{"trainer.reduce_dtype": dtype}), CPU, model=tiny_model())
        state.model(input_ids=ids[rank]).logits.pow(2).mean().backward()
        out[dtype] = torch.cat([u.shard.grad for u in state.fsdp.units])  # [ΣS] this rank's summed shards
    # Each rank's own gradient before any reduction (plain autograd, unsharded), cut like this rank's shards.
    for r in range(world):
        model = tiny_model()
        model(input_ids=ids[r]).logits.pow(2).mean().backward()
        grads = {n: p.grad.reshape(-1) for n, p in model.named_parameters()}
        out[f"rank{r}"] = torch.cat([torch.cat([grads[n] for n in u.names] + [torch.zeros(u.pad)])
                                     .chunk(world)[rank] for u in state.fsdp.units])  # [ΣS]
    torch.save(out, Path(tmp) / f"reduce{rank}.pt")
    dist.destroy_process_group()


def test_bf16_reduce_scatter_is_within_two_roundings(tmp_path):
    """trainer.reduce_dtype=bfloat16 on 2 gloo ranks: each rank's fp32 gradient a, b is rounded to bf16 and the
    sum of the rounded values rounded again, each rounding of relative error <= 2^-8 (bf16 keeps 8 significant
    bits), so |g - (a+b)| <= 2^-8 (|a|+|b|) + 2^-8 (1+2^-8)(|a|+|b|) = 2^-7 (1+2^-9)(|a|+|b|) per element
    (measured max: 0.9 of it). The fp32 reduction equals a+b (1e-7: the same sum of the same values). The bf16
    result must differ from the fp32 one (it really was reduced in bf16)."""
    spawn(_reduce_dtype_worker, 2, str(tmp_path))
    for r in range(2):
        out = torch.load(tmp_path / f"reduce{r}.pt", weights_only=False)
        exact, scale = out["rank0"] + out["rank1"], out["rank0"].abs() + out["rank1"].abs()  # [ΣS]
        torch.testing.assert_close(out["float32"], exact, atol=1e-7, rtol=1e-6)
        assert ((out["bfloat16"] - exact).abs() <= 2 ** -7 * (1 + 2 ** -9) * scale).all()
        assert not torch.equal(out["bfloat16"], out["float32"])


def _count_call(calls, i, *hook_args):
    calls[i] += 1


def test_micro_batch_and_activation_checkpointing_invariance(tmp_path):
    """Many small micro-batches == one big one == with activation checkpointing; world 1, in-process.
    Tolerance 1e-6: only the summation order of the micro-batch gradients differs (measured ~1e-8).
    Checkpointing is really on: each block's MLP is entered twice per micro-batch (forward, then
    backward's recomputation), and once without it. Counted by forward pre-hooks: the recomputation
    stops (raises) once it has remade the last saved tensor, inside the MLP, before a post-hook."""
    batches = [make_batch(12, v, seed=v) for v in range(2)]
    runs, mlp_calls = {}, {}
    for name, kw in {"small": {"trainer.micro_batch_tokens": 16}, "large": {"trainer.micro_batch_tokens": 4096},
                     "ac": {"trainer.micro_batch_tokens": 16, "trainer.activation_checkpointing": "true"}}.items():
        cfg = make_cfg(tmp_path, **kw)
        state = trainer.build_state(cfg, CPU, model=tiny_model())
        calls = mlp_calls[name] = [0] * len(state.model.model.layers)
        for i, layer in enumerate(state.model.model.layers):
            layer.mlp.register_forward_pre_hook(functools.partial(_count_call, calls, i))
        runs[name] = ([trainer.train_step(state, b, cfg)["micro_batches"] for b in batches], full_params(state))
    assert runs["small"][0][0] > 4 and runs["large"][0][0] == 1
    assert runs["ac"][0] == runs["small"][0]  # the same micro-batches
    micro_batches = sum(runs["small"][0])
    assert set(mlp_calls["small"]) == {micro_batches}, mlp_calls  # each block once a micro-batch
    assert set(mlp_calls["ac"]) == {2 * micro_batches}, mlp_calls  # and again in backward
    for name in ("large", "ac"):
        for k, p in runs["small"][1].items():
            torch.testing.assert_close(runs[name][1][k], p, atol=1e-6, rtol=0, msg=f"{name}: {k}")


def test_zero_advantage_samples_are_skipped_result_unchanged(tmp_path):
    """Half the samples have advantage 0 (whole groups, as when every attempt is right or every one wrong):
    train_step does not run them (trained_sequences), yet loss, gradient norm and parameters equal the
    reference that runs every sample (normaliser: all B sequences). Tolerance as for FSDP vs reference;
    a wrong normaliser (trained sequences instead of B) would move them by ~2x."""
    batches = [make_batch(12, v, seed=v) for v in range(3)]
    for b in batches:
        for s in b:
            if s["group_id"] % 2:
                s["advantage"] = 0.0
    cfg = make_cfg(tmp_path)
    state = trainer.build_state(cfg, CPU, model=tiny_model())
    metrics = [trainer.train_step(state, b, cfg) for b in batches]
    ref, ref_losses, ref_norms = reference_train(tiny_model(), batches, 12)
    zeros = [sum(s["advantage"] == 0.0 for s in b) for b in batches]
    assert all(z >= 2 for z in zeros) and [m["trained_sequences"] for m in metrics] == [12 - z for z in zeros]
    params = full_params(state)
    for name, p in ref.items():
        torch.testing.assert_close(params[name], p, atol=1e-5, rtol=0, msg=name)
    for m, lo, norm in zip(metrics, ref_losses, ref_norms):
        assert m["loss"] == pytest.approx(lo, rel=1e-5, abs=1e-6) and m["grad_norm"] == pytest.approx(norm, rel=1e-5)


def test_non_finite_gradient_skips_the_update(tmp_path):
    """An advantage of 3e38 is a finite number, but its gradient overflows to inf: the update is skipped
    (weights and AdamW moments unchanged, counted), the step still counts; the next step trains normally
    and AdamW's bias correction counts applied updates only."""
    cfg = make_cfg(tmp_path)
    state = trainer.build_state(cfg, CPU, model=tiny_model())
    trainer.train_step(state, make_batch(12, 0, seed=0), cfg)
    before = [(u.shard.detach().clone(), u.exp_avg.clone(), u.exp_avg_sq.clone()) for u in state.fsdp.units]
    bad = make_batch(12, 1, seed=1)
    bad[0]["advantage"] = 3e38
    m = trainer.train_step(state, bad, cfg)
    assert not math.isfinite(m["grad_norm"]) and (m["step_skipped"], m["skipped_steps"], state.step) == (1, 1, 2)
    for u, (shard, m1, m2) in zip(state.fsdp.units, before):
        assert torch.equal(u.shard, shard) and torch.equal(u.exp_avg, m1) and torch.equal(u.exp_avg_sq, m2)
        assert u.shard.grad is None
    m = trainer.train_step(state, make_batch(12, 2, seed=2), cfg)
    assert math.isfinite(m["grad_norm"]) and m["step_skipped"] == 0 and m["skipped_steps"] == 1
    assert not torch.equal(state.fsdp.units[1].shard, before[1][0])


def _memory_worker(rank, world, port, tmp):
    _init(rank, world, port)
    peaks = {}
    for prefetch in ("false", "true"):
        cfg = make_cfg(tmp, world, **{"trainer.micro_batch_tokens": 16, "trainer.prefetch": prefetch})
        state = trainer.build_state(cfg, CPU, model=tiny_model(layers=6))
        trainer.train_step(state, _share(make_batch(12, 0, seed=0), world, rank), cfg)
        assert state.fsdp.live_bytes == 0  # nothing gathered survives the step
        peaks[prefetch] = state.fsdp.peak_bytes
    if rank == 0:
        torch.save({"peaks": peaks, "units": [(u.numel + u.pad) * 4 for u in state.fsdp.units]}, Path(tmp) / "mem.pt")
    dist.destroy_process_group()


def test_gathered_parameter_memory_stays_two_units(tmp_path):
    """Peak bytes of gathered (full, fp32 on CPU) parameters during a step on 2 ranks, counted until the buffers
    are really freed (weakref.finalize on each gathered buffer). Without prefetch: the root unit (gathered for
    the whole forward, re-gathered at the head's backward until the embedding's) plus one block. With prefetch:
    plus the block gathered ahead while one computes, so root + two blocks (the bound prefetch needs, and it is
    reached), never the whole model (6 blocks here: 38% of it)."""
    spawn(_memory_worker, 2, str(tmp_path))
    out = torch.load(tmp_path / "mem.pt", weights_only=False)
    root, *blocks = out["units"]
    blocks = sorted(blocks)
    assert out["peaks"]["false"] <= root + blocks[-1]
    assert root + blocks[-1] < out["peaks"]["true"] <= root + blocks[-1] + blocks[-2]


def test_run_root_equals_model_forward(tmp_path):
    """FSDP.run_root(fn) around the model's parts (what a completion-only head does) == model(...): the same
    logits and the same shard gradients, bit for bit (same ops, same order)."""
    ids = torch.randint(0, 64, (2, 9))
    out = []
    for parts in (False, True):
        state = trainer.build_state(make_cfg(tmp_path), CPU, model=tiny_model())
        m = state.model
        if parts:
            logits = state.fsdp.run_root(
                lambda x: torch.nn.functional.linear(m.model(input_ids=x).last_hidden_state, m.lm_head.weight), ids)
        else:
            logits = m(input_ids=ids).logits  # [B,T,V]
        logits.pow(2).mean().backward()
        out.append((logits.detach(), [u.shard.grad for u in state.fsdp.units]))
        assert state.fsdp.live_bytes == 0
    assert torch.equal(out[0][0], out[1][0])
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))


def test_gpu_check_runs_in_smoke_mode(tmp_path):
    """bench/gpu_check.py --smoke --big: every check of the one-shot GPU script, on CPU with tiny sizes and
    gloo (2 CPU ranks stand for the machine's GPUs), so that the next device session only has to run it."""
    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, str(REPO / "bench/gpu_check.py"), "--smoke", "--big", "--out", str(out)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"fsdp_fp32", "fsdp_fp32_ac", "fsdp_bf16", "nccl_2rank", "big", "big_ac", "big_chunk0", "ranks",
            "big_ranks", "sender_stream", "step_clock", "weight_group_timeout"} <= set(report)
    assert report["ranks"]["prefetch_bit_equal"] and report["nccl_2rank"]["bit_equal"]
    # gloo raises on a missing rank (the GPU run checks that NCCL does too, instead of aborting)
    assert report["weight_group_timeout"]["verdict"].startswith("raised")
    assert r.stdout.count("[gpu_check] PASS") == 10
    assert r.stdout.count("[gpu_check] SKIP") == 2  # sender_stream, step_clock: CUDA only
    assert report["env"]["model_runner"] == "V1"  # vLLM is here; its CPU platform has no V2


# --- weight broadcast -------------------------------------------------------------------------------------

def _broadcast_worker(rank, world, port, tmp, sync_port, batch):
    import weights_sync as ws
    torch.set_num_threads(1)
    if rank == 2:  # the actor's side: joins the weight group, takes two versions
        actor = FakeActor(sync_port)
        actor.done.wait(120)
        torch.save({"got": actor.updates, "error": repr(actor.error)}, Path(tmp) / "receiver.pt")
        return
    _init(rank, 2, port)
    cfg = make_cfg(tmp, 2, **{"sync.port": sync_port, "sync.async_send": False})
    state = trainer.build_state(cfg, CPU, model=tiny_model())
    store, server = ws.create_store("127.0.0.1", sync_port, False, 60), None
    if trainer.is_main():  # the broadcast runs in the WeightServer's thread
        server = ws.WeightServer(cfg, version=0, device=CPU, group=elastic.Membership(cfg, epoch=1))
        while not server.members:  # the actor in the group: it gets both versions
            time.sleep(0.05)
    trainer.send_weights(state, server, store, cfg, wait=True)
    trainer.train_step(state, _share(batch, 2, rank), cfg)
    trainer.send_weights(state, server, store, cfg, wait=True)
    params = full_params(state)
    if trainer.is_main():
        server.close("done")
        torch.save(params, Path(tmp) / "trainer.pt")
    dist.destroy_process_group()


def test_broadcast_receiver_gets_trainer_weights(tmp_path):
    import weights_sync as ws
    store = ws.create_store("127.0.0.1", 0, True, 60)  # the run's store (weights_sync.serve_store)
    spawn(_broadcast_worker, 3, str(tmp_path), store.port, make_batch(12, 0, seed=0))
    rec = torch.load(tmp_path / "receiver.pt", weights_only=False)
    params = torch.load(tmp_path / "trainer.pt", weights_only=False)
    init = dict(tiny_model().named_parameters())
    (v0, w0), (v1, w1) = rec["got"]
    assert (v0, v1) == (0, 1), rec["error"]
    assert list(w1) == list(params)  # same names, manifest order
    for name, p in params.items():
        assert w1[name].dtype == torch.float32 and torch.equal(w1[name], p), name  # bitwise: the checksum is the bytes
        assert torch.equal(w0[name], init[name].detach()), name
        assert not torch.equal(w0[name], w1[name]), name  # the step changed every tensor


# --- checkpoints -------------------------------------------------------------------------------------------------

def test_checkpoint_reloads_in_hf_with_identical_logits(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    cfg = make_cfg(tmp_path, batch_size=8, **{"trainer.init_from": tiny_model_dir, "trainer.keep_checkpoints": 2})
    state = trainer.build_state(cfg, CPU)  # from trainer.init_from via from_pretrained
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for step in range(3):
        trainer.train_step(state, make_batch(8, step, seed=step), cfg)
        path = trainer.save_checkpoint(state, cfg, tokenizer)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2", "step-3"]  # keep 2
    assert {"COMPLETE", "optim-rank0.pt", "trainer_state.json", "config.json", "model.safetensors.index.json",
            "tokenizer.json"} <= {p.name for p in path.iterdir()}
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        ours = state.model(input_ids=ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(path).eval()(input_ids=ids).logits
    assert torch.equal(ours, theirs)  # fp32 master weights, same kernels
    assert AutoTokenizer.from_pretrained(path).decode(tokenizer.encode("12+34=\n")) == "12+34=\n"
    assert json.loads((path / "trainer_state.json").read_text())["max_group_id"] == 203


def _resume_worker(rank, world, port, tmp, batches):
    _init(rank, world, port)
    cfg = make_cfg(tmp, world)
    state = trainer.build_state(cfg, CPU, model=tiny_model())
    for i, batch in enumerate(batches):
        trainer.train_step(state, _share(batch, world, rank), cfg)
        if i == 1:
            ckpt = trainer.save_checkpoint(state, cfg)
    uninterrupted = full_params(state)
    resumed = trainer.build_state(cfg, CPU, ckpt=trainer.latest_checkpoint(Path(tmp) / "checkpoints"))
    assert resumed.step == 2 and resumed.max_group_id == 105 and ckpt.name == "step-2"
    trainer.train_step(resumed, _share(batches[2], world, rank), cfg)
    if rank == 0:
        torch.save({"a": uninterrupted, "b": full_params(resumed)}, Path(tmp) / "resume.pt")
    else:
        full_params(resumed)
    dist.destroy_process_group()


def test_resume_equals_uninterrupted(tmp_path):
    """2 ranks: steps 1-2, checkpoint, step 3  ==  reload step-2 (model, optimizer shards, counters), step 3:
    exact. Resumed by 1 rank instead (optimizer shards re-cut): 1e-5, as FSDP vs. the reference."""
    batches = [make_batch(12, v, seed=v) for v in range(3)]
    spawn(_resume_worker, 2, str(tmp_path), batches)
    out = torch.load(tmp_path / "resume.pt", weights_only=False)
    cfg = make_cfg(tmp_path, 1)
    one = trainer.build_state(cfg, CPU, ckpt=tmp_path / "checkpoints" / "step-2")
    trainer.train_step(one, batches[2], cfg)
    one = full_params(one)
    for name, p in out["a"].items():
        assert torch.equal(out["b"][name], p), name
        torch.testing.assert_close(one[name], p, atol=1e-5, rtol=0, msg=name)


def test_incomplete_checkpoints_are_ignored(tmp_path):
    root = tmp_path / "checkpoints"
    for name, complete in [("step-2", True), ("step-9", False), (".tmp-step-12", True), ("step-x", True)]:
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / "COMPLETE").write_text("ok\n")
    assert trainer.latest_checkpoint(root).name == "step-2"
    assert trainer.latest_checkpoint(tmp_path / "nothing") is None


# --- main() against a fake verifier and a fake actor ---------------------------------------------------------------

def _sample_frames(i, version, vocab=64, bad=False, advantage=None, inc=1, cut=1, seq0=0):
    rng = np.random.default_rng(i)
    P, C = int(rng.integers(1, 6)), int(rng.integers(1, 10))
    header = {"group_id": i // 2, "sample_idx": i % 2, "group_size": 2, "task": "arithmetic", "answer": "3",
              "finish_reason": "stop", "t_start": 0.0, "t_end": 1.0, "inc": inc, "cut": cut, "eval": False,
              "reward": float(i % 2), "status": "correct",
              "advantage": float(i % 2) - 0.5 if advantage is None else advantage, "seq": i - seq0,
              "verifier": 1, "order": i}
    arrays = {"prompt_ids": rng.integers(0, vocab, P).astype(np.int32),
              "completion_ids": rng.integers(0, vocab, C).astype(np.int32),
              "logprobs": np.full(C, -4.0, dtype=np.float32), "versions": np.full(C, version, dtype=np.int32)}
    if bad:
        arrays["versions"] = arrays["versions"][:-1] if C > 1 else np.zeros(3, np.int32)
    return common.encode(header, arrays)


def _launch(tmp, model_dir, ranks, sync_port, samples_port, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 \
        else [sys.executable]
    over = [f"run.dir={tmp}", f"model.path={model_dir}", f"trainer.nproc={ranks}", "trainer.batch_size=4",
            "actor.group_size=2", "trainer.checkpoint_every=2", f"sync.port={sync_port}",
            f"ports.samples={samples_port}", "run.peer_timeout_s=20", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(cmd + [str(REPO / "trainer.py")] + over, cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_main_loop_with_fake_verifier_and_actor(tmp_path):
    """torchrun, 2 ranks, 3 steps: version 0..3 reach the actor, a malformed sample is counted, metrics and
    samples_trainer.jsonl are written, the final checkpoint exists; then a resume to step 4 continues the
    version, lists the groups to do again and starts the group counter after the last trained group (1 rank:
    optimizer shards re-cut). Samples of another incarnation or cut are discarded and counted."""
    import zmq
    import weights_sync as ws
    model_dir = tmp_path / "model"
    tiny_model().save_pretrained(model_dir)
    samples_port = free_port()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.bind(f"tcp://127.0.0.1:{samples_port}")
    sent = {"n": 0}

    def verifier(stop, actor):
        while actor.cut is None and not stop.is_set():  # samples come from a member of the group
            time.sleep(0.05)
        seq0 = sent["n"]  # a verifier numbers each incarnation's samples of a cut from 0
        while not stop.is_set():
            try:  # non-blocking: a trainer that exits between poll and send would block a plain send forever
                n = sent["n"]  # one of another incarnation, one of an older cut: discarded
                frames = _sample_frames(n, 0, bad=n == 3, inc=actor.inc + (n == 5), cut=actor.cut - (n == 6),
                                        seq0=seq0)
                push.send_multipart(frames, flags=zmq.NOBLOCK)
                sent["n"] += 1
            except zmq.Again:
                time.sleep(0.05)

    def run(ranks, *extra):
        store, stop = ws.create_store("127.0.0.1", 0, True, 60), threading.Event()  # the run's store
        proc = _launch(tmp_path, model_dir, ranks, store.port, samples_port, *extra)
        actor = FakeActor(store.port)
        th = threading.Thread(target=verifier, args=(stop, actor), daemon=True)
        th.start()
        out, _ = proc.communicate(timeout=150)
        stop.set()
        th.join(timeout=30)
        actor.done.wait(30)
        assert proc.returncode == 0, out
        return actor, store, out

    actor, store, out = run(2, "trainer.max_steps=3", "sync.async_send=false")  # every version, in order
    assert actor.versions == [0, 1, 2, 3] and actor.error is None, out
    # the first cut fences the group ids at 0: nothing to do again
    assert (store.get(f"redo/{actor.cut}"), store.get("groups/next").split()[:2]) == (b"", [b"1", b"0"])
    recs = [r for r in read_jsonl(tmp_path / "metrics_trainer.jsonl") if "trainer/loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3]
    keys = {"trainer/ess", "trainer/kl", "trainer/clamp_frac", "trainer/lag_mean", "trainer/tokens_per_s",
            "trainer/wait_s", "trainer/broadcast_s", "trainer/kl_lag_2", "trainer/tokens_lag_2",
            "trainer/lag_by_position"}
    assert keys <= set(recs[-1]) and recs[-1]["trainer/malformed"] == 1 and recs[1]["trainer/lag_max"] == 1
    # samples 5 and 6, on whichever ranks; then 2, 4 and 7, whose groups are never whole (3, 5, 6)
    assert recs[-1]["trainer/discarded"] == 5
    lost = sorted((d["group_id"], d["reason"]) for d in read_jsonl(tmp_path / "groups_dropped.jsonl"))
    assert lost == [(g, "lost on the way") for g in (1, 2, 3)], lost
    rows = read_jsonl(tmp_path / "samples_trainer.jsonl")
    rows1 = read_jsonl(tmp_path / "samples_trainer.rank1.jsonl")
    assert [r["trainer_version"] for r in rows] == [0, 1, 2] == [r["trainer_version"] for r in rows1]
    # whole groups, each in one step, on whichever rank holds each sample
    assert [len(r["group_ids"]) + len(r1["group_ids"]) for r, r1 in zip(rows, rows1)] == [4, 4, 4]
    assert all(sorted(r["group_ids"] + r1["group_ids"])[::2] == sorted(r["group_ids"] + r1["group_ids"])[1::2]
               for r, r1 in zip(rows, rows1))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2", "step-3"]
    state = json.loads((tmp_path / "checkpoints/step-3/trainer_state.json").read_text())
    untrained = [g for g in range(state["trained_below"], state["max_group_id"] + 1)
                 if g not in state["trained_above"]]

    actor, store, out = run(1, "trainer.max_steps=4", "run.resume=true", "sync.async_send=false")
    assert actor.versions == [3, 4], out
    # a new store (a whole run resumed): the fence starts after the last trained id, the ids below it that
    # were never trained come first
    assert [int(g) for g in store.get(f"redo/{actor.cut}").decode().split(",") if g] == untrained
    assert int(store.get("groups/next").split()[1]) == state["max_group_id"] + 1
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics_trainer.jsonl") if "trainer/loss" in r][-1] == 4

    push.close()


def _model_and_verifier(tmp_path):
    """A tiny model directory, the run's store (hosted here), a free port and the verifier's bound PUSH
    socket (with its stop event)."""
    import zmq
    import weights_sync as ws
    model_dir = tmp_path / "model"
    tiny_model().save_pretrained(model_dir)
    samples_port, store = free_port(), ws.create_store("127.0.0.1", 0, True, 60)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.bind(f"tcp://127.0.0.1:{samples_port}")
    return model_dir, samples_port, store, push, threading.Event()


def _push_samples(push, stop, advantage_of, actor):
    """Push samples 0, 1, ... of `actor`'s incarnation and cut (sample i with advantage advantage_of(i); None:
    the default), from when it is in a group until `stop`."""
    import zmq
    while actor.cut is None and not stop.is_set():
        time.sleep(0.05)
    i = 0
    while not stop.is_set():
        try:
            frames = _sample_frames(i, 0, advantage=advantage_of(i), inc=actor.inc, cut=actor.cut)
            push.send_multipart(frames, flags=zmq.NOBLOCK)
            i += 1
        except zmq.Again:
            time.sleep(0.05)


@pytest.mark.parametrize("max_lag,versions", [(4, [0, 1, 3]), (0, [0, 1, 2, 3])])
def test_skipped_step_is_not_broadcast_and_non_finite_samples_are_dropped(tmp_path, max_lag, versions):
    """main(): the second batch's advantages (3e38) overflow the gradient, so step 2 is skipped and its
    (unchanged) weights are not broadcast: the actor receives versions 0, 1, 3. With actor.max_lag=0 the
    actor could not start step 3's samples on version 1 (trainer.weights_owed): version 2 is sent before
    them. A sample with a NaN advantage is dropped as malformed and counted (the wire format refuses
    non-finite numbers)."""
    model_dir, samples_port, store, push, stop = _model_and_verifier(tmp_path)
    proc = _launch(tmp_path, model_dir, 1, store.port, samples_port, "trainer.max_steps=3",
                   "sync.async_send=false", f"actor.max_lag={max_lag}")
    actor = FakeActor(store.port)
    advantage = lambda i: 3e38 if 4 <= i < 8 else float("nan") if i == 9 else None  # noqa: E731
    th = threading.Thread(target=_push_samples, args=(push, stop, advantage, actor), daemon=True)
    th.start()
    out, _ = proc.communicate(timeout=150)
    stop.set()
    push.close()
    assert proc.returncode == 0, out
    recs = [r for r in read_jsonl(tmp_path / "metrics_trainer.jsonl") if "trainer/loss" in r]
    assert [r["trainer/step_skipped"] for r in recs] == [0, 1, 0] and recs[-1]["trainer/skipped_steps"] == 1
    assert recs[-1]["trainer/malformed"] == 1
    actor.done.wait(30)
    assert actor.versions == versions, out


def test_ids_to_do_again_at_a_cut():
    """Groups finish out of order: at a checkpoint, and at any cut, ids below the fence may never have been
    trained (in flight, or given up at the cut). The books list them (redo/<cut>: the actors generate them
    first), leaving out the ones the verifier dropped for good; a checkpoint keeps only the ids above the
    first untrained one."""
    import weights_sync as ws
    from types import SimpleNamespace
    store = ws.create_store("127.0.0.1", 0, True, 30)
    state = SimpleNamespace(trained_below=0, trained_ids={0, 1, 3, 5, 6}, max_group_id=6)
    trainer.prune_trained(state)
    assert state.trained_below == 2 and state.trained_ids == {3, 5, 6}
    elastic.drop(store, 1, 1, 7, 4)  # the verifier dropped group 7
    books = elastic.Ledger(store, None, state)
    books.start_cut(2, elastic.fence(store, 2, floor=9))
    assert store.get("redo/2") == b"2,4,8," and store.get("groups/next").split()[:2] == [b"2", b"9"]
    state.trained_ids |= {2, 4}
    trainer.prune_trained(state)
    assert state.trained_below == 7 and state.trained_ids == set()


def _dying_actor(sync_port):
    """Joins the weight group, takes version 0, then dies without a word (os._exit: no clean shutdown)."""
    actor = FakeActor(sync_port)
    while not actor.updates and not actor.done.is_set():
        time.sleep(0.01)
    os._exit(0)


def test_a_lost_actor_leaves_the_group_and_the_trainer_waits_for_another(tmp_path):
    """Its only actor dies after version 0: the trainer counts it lost (its heartbeat stops, or the next
    broadcast fails), forms a group without it, and waits up to run.peer_timeout_s for an actor to join,
    saying so; then it stops, non-zero, naming what it waited for."""
    model_dir, samples_port, store, push, stop = _model_and_verifier(tmp_path)
    proc = _launch(tmp_path, model_dir, 1, store.port, samples_port, "trainer.max_steps=200",
                   "run.peer_timeout_s=10", "run.heartbeat_timeout_s=2")
    dying = mp.get_context("spawn").Process(target=_dying_actor, args=(store.port,))
    dying.start()
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        stop.set()
        proc.kill()
        push.close()
    dying.join(timeout=10)
    assert proc.returncode != 0, out[-3000:]
    assert "actor incarnation 1 lost" in out or "forming a new one" in out, out[-3000:]
    assert "no actor in the weight group: waiting up to 10 s (run.peer_timeout_s)" in out, out[-3000:]
    assert "no actor has been alive" in out, out[-3000:]
    assert '"trainer/done"' not in (tmp_path / "metrics_trainer.jsonl").read_text()


def test_membership_follows_heartbeats_judged_by_this_hosts_clock(tmp_path):
    """An actor's heartbeat carries its host's clock, which may be skewed: a WeightServer judges silence
    from when the beat last changed, here. An hour-behind clock that keeps beating stays in the group; one
    that stops beating (its clock an hour ahead) leaves it after run.heartbeat_timeout_s."""
    import weights_sync as ws
    store = ws.create_store("127.0.0.1", 0, True, 30)
    cfg = make_cfg(tmp_path, **{"sync.port": store.port, "run.heartbeat_timeout_s": 2.0})
    behind, ahead = FakeActor(store.port, clock_skew_s=-3600), FakeActor(store.port, clock_skew_s=3600)
    server = ws.WeightServer(cfg, version=0, device=CPU, group=elastic.Membership(cfg, epoch=1))
    deadline = time.time() + 30
    while set(server.members) != {behind.inc, ahead.inc} and time.time() < deadline:
        time.sleep(0.1)
    assert set(server.members) == {behind.inc, ahead.inc}
    ahead.done.set()  # its beats stop
    while set(server.members) != {behind.inc} and time.time() < deadline:
        time.sleep(0.1)
    assert set(server.members) == {behind.inc}
    time.sleep(3)  # longer than the timeout: the one that beats, whatever its clock, stays
    assert set(server.members) == {behind.inc}
    server.close("done")


def test_waiting_for_samples_times_out_naming_the_verifier(tmp_path):
    import zmq
    import weights_sync as ws
    addr = f"tcp://127.0.0.1:{free_port()}"  # nobody binds it
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    from types import SimpleNamespace
    state = trainer.TrainState(model=None, fsdp=SimpleNamespace(device=CPU))
    with pytest.raises(SystemExit) as e:
        trainer.take_batch(sock, [], 1, 1, state, make_cfg(tmp_path, **{"run.peer_timeout_s": 1}), addr, 64,
                           lambda: ({1}, 1), lambda: None)
    sock.close()
    msg = str(e.value.code)
    assert addr in msg and "run.peer_timeout_s" in msg and "is verifier.py running" in msg
