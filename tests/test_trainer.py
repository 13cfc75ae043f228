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
import contextlib
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
import loss  # noqa: E402
import trainer  # noqa: E402
from conftest import FakeActor, Owner, forkserver, free_port, read_jsonl  # noqa: E402
from scripts import checkpoints, rundir  # noqa: E402

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


class _Beats:
    """A watchdog timer's side as elastic.Progress offers it: counts `made()`."""
    def __init__(self):
        self.count = 0

    def made(self):
        self.count += 1


def _held_by_rank0(rank, world, port, tmp):
    from scripts.ranks import all_max
    _init(rank, world, port)
    beats = _Beats()
    if rank == 0:
        time.sleep(2.0)  # as rank 0 waits for a broadcast to a stopped engine (trainer.send_weights)
    t0 = time.time()
    got = all_max([rank], CPU, progress=beats)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps({"got": got, "beats": beats.count,
                                                         "waited": time.time() - t0}))
    dist.destroy_process_group()


def test_a_rank_held_in_a_collective_by_another_re_arms_its_watchdog(tmp_path):
    """A chaos soak stopped an actor's engine while trainer rank 0 waited for the broadcast to it: rank 1,
    held meanwhile in a collective with rank 0, made no progress for run.hang_timeout_s, and its node's
    watchdog killed both trainer ranks, which had not failed. The all-reduce rank 1 waits in now re-arms its
    timer while it waits (rank 0 re-arms its own as it waits for the broadcast: WeightServer.wait_idle)."""
    spawn(_held_by_rank0, 2, str(tmp_path))
    held = json.loads((tmp_path / "rank1.json").read_text())
    assert held["got"] == [1] and held["waited"] > 1.5 and held["beats"] > 50, held


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


def test_trainer_correction_chooses_the_weights_and_logs_its_fractions(tmp_path):
    """trainer.correction reaches the loss: on one batch (a fifth of the tokens 3 nats off-policy, ratios
    ~e^3 > 5) eq. 5 clamps and masks nothing; token_mask drops those tokens (mask_frac > 0, clamp_frac 0,
    a different loss); the fractions are logged overall and by lag."""
    batch = make_batch(12, 3, seed=0)
    got = {}
    for name in ("tis", "token_mask"):
        cfg = make_cfg(tmp_path, **{"trainer.correction": name})
        got[name] = trainer.train_step(trainer.build_state(cfg, CPU, model=tiny_model()), batch, cfg)
    tis, mask = got["tis"], got["token_mask"]
    assert tis["clamp_frac"] > 0 and tis["mask_frac"] == 0
    assert mask["clamp_frac"] == 0 and 0.1 < mask["mask_frac"] < 0.5 and mask["loss"] != pytest.approx(tis["loss"])
    lag_keys = [k for k in mask if k.startswith("mask_lag_")]
    assert lag_keys and sum(mask[k] * mask[k.replace("mask_lag_", "tokens_lag_")] for k in lag_keys) == \
        pytest.approx(mask["mask_frac"] * mask["tokens"])


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

def _broadcast_worker(rank, world, port, tmp, overrides, batch):
    import weights_sync as ws
    torch.set_num_threads(1)
    cfg = make_cfg(tmp, 2, **{"sync.async_send": False}, **dict(o.split("=", 1) for o in overrides))
    if rank == 2:  # the actor's side: joins the weight roster, takes two versions
        actor = FakeActor(cfg)
        actor.done.wait(120)
        torch.save({"got": actor.updates, "error": repr(actor.error)}, Path(tmp) / "receiver.pt")
        return
    _init(rank, 2, port)
    state = trainer.build_state(cfg, CPU, model=tiny_model())
    store, server = ws.create_store("127.0.0.1", cfg.sync.port, False, 60), None
    if trainer.is_main():  # the broadcast runs in the WeightServer's thread
        server = ws.WeightServer(cfg, 0, CPU, epoch=1, ledger=lambda: common.LedgerClient(cfg, store))
        while not server.members:  # the actor in the roster: it gets both versions
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
    owner = Owner(tmp_path)  # the run's store and ledger (elastic.py)
    try:
        spawn(_broadcast_worker, 3, str(tmp_path), owner.overrides, make_batch(12, 0, seed=0))
    finally:
        owner.close()
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
    state.done_ids = {0, 1, 2, 5}  # trained or dropped (rank 0's books, from the ledger's reports)
    for step in range(3):
        trainer.train_step(state, make_batch(8, step, seed=step), cfg)
        path = checkpoints.save(state, cfg, tokenizer)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2", "step-3"]  # keep 2
    assert {"COMPLETE", "optim-rank0.pt", "trainer_state.json", "config.json", "model.safetensors.index.json",
            "tokenizer.json"} <= {p.name for p in path.iterdir()}
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        ours = state.model(input_ids=ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(path).eval()(input_ids=ids).logits
    assert torch.equal(ours, theirs)  # fp32 master weights, same kernels
    assert AutoTokenizer.from_pretrained(path).decode(tokenizer.encode("12+34=\n")) == "12+34=\n"
    meta = json.loads((path / "trainer_state.json").read_text())
    assert (meta["done_below"], meta["done_above"]) == (3, [5])  # the ids done: 0, 1, 2 and 5


def _resume_worker(rank, world, port, tmp, batches):
    _init(rank, world, port)
    cfg = make_cfg(tmp, world)
    state = trainer.build_state(cfg, CPU, model=tiny_model())
    for i, batch in enumerate(batches):
        trainer.train_step(state, _share(batch, world, rank), cfg)
        if i == 1:
            ckpt = checkpoints.save(state, cfg)
    uninterrupted = full_params(state)
    resumed = trainer.build_state(cfg, CPU, ckpt=rundir.latest_checkpoint(Path(tmp) / "checkpoints"))
    assert resumed.step == 2 and ckpt.name == "step-2"
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
    assert rundir.latest_checkpoint(root).name == "step-2"
    assert rundir.latest_checkpoint(tmp_path / "nothing") is None


# --- main() against a fake verifier and a fake actor, with the real ledger ------------------------------------

class FakeVerifier:
    """A verifier as the trainer sees it, in a thread of this process (no scoring): once `actor` has weights,
    it asks the ledger for tickets in the actor's name (one at a time, by its lag budget), forwards each
    (its order from the ledger) and pushes its group_size samples over a real ZMQ PUSH socket. `change(n,
    header, arrays)` may alter the n-th group's samples (a malformed one, another epoch's)."""

    def __init__(self, owner, actor, push, stop, change=lambda n, h, a: None, advantage=lambda n, k: None):
        self.owner, self.actor, self.push, self.stop = owner, actor, push, stop
        self.change, self.advantage, self.groups = change, advantage, []  # [(ticket, group id)]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        import zmq
        import weights_sync as ws
        ledger = common.LedgerClient(self.owner.cfg, ws.create_store("127.0.0.1", self.owner.cfg.sync.port, False, 60))
        verifier = ledger.request("verifier_hello")["verifier"]
        while not self.stop.is_set():
            if not self.actor.updates:  # no weights yet: an actor generates nothing (version -1 marks an
                time.sleep(0.05)        # environment's tokens, which a sample may not start with)
                continue
            version = self.actor.versions[-1]
            reply = ledger.request("tickets", inc=self.actor.inc, epoch=self.actor.epoch or -1,
                                   version=version, want=1, pushed=[], drop=[])
            if not reply.get("tickets"):
                time.sleep(0.05)
                continue
            (ticket, group_id), = reply["tickets"]
            (_, order), = ledger.request("forward", verifier=verifier, forward=[ticket], drop=[])["accepted"]
            n = len(self.groups)
            self.groups.append((ticket, group_id))
            for k in range(2):
                header, arrays = _sample(n, k, version, ticket, group_id, verifier, order, self.actor.epoch,
                                         self.advantage(n, k))
                self.change(n, header, arrays)
                while not self.stop.is_set():
                    try:  # non-blocking: a trainer that exits between poll and send would block a send
                        self.push.send_multipart(common.encode(header, arrays), flags=zmq.NOBLOCK)
                        break
                    except zmq.Again:
                        time.sleep(0.05)


def _sample(n, k, version, ticket, group_id, verifier, order, epoch, advantage=None, vocab=64):
    rng = np.random.default_rng(2 * n + k)
    P, C = int(rng.integers(1, 6)), int(rng.integers(1, 10))
    header = {"group_id": group_id, "sample_idx": k, "group_size": 2, "task": "arithmetic", "answer": "3",
              "finish_reason": "stop", "t_start": 0.0, "t_end": 1.0, "ticket": ticket, "epoch": epoch,
              "eval": False, "turns": 1, "env_reward": 0.0, "reward": float(k), "status": "correct",
              "advantage": float(k) - 0.5 if advantage is None else advantage, "verifier": verifier,
              "order": order}
    arrays = {"prompt_ids": rng.integers(0, vocab, P).astype(np.int32),
              "completion_ids": rng.integers(0, vocab, C).astype(np.int32),
              "logprobs": np.full(C, -4.0, dtype=np.float32), "versions": np.full(C, version, dtype=np.int32)}
    return header, arrays


def _launch(tmp, model_dir, ranks, owner, samples_port, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 \
        else [sys.executable]
    over = [*owner.overrides, f"model.path={model_dir}", f"trainer.nproc={ranks}", "trainer.batch_size=4",
            "actor.group_size=2", "trainer.checkpoint_every=2", f"ports.samples={samples_port}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(cmd + [str(REPO / "trainer.py")] + over, cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _model_and_socket(tmp_path):
    """A tiny model directory, a free port and the verifier's bound PUSH socket (with a stop event)."""
    import zmq
    model_dir = tmp_path / "model"
    tiny_model().save_pretrained(model_dir)
    samples_port = free_port()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.bind(f"tcp://127.0.0.1:{samples_port}")
    return model_dir, samples_port, push, threading.Event()


def _break(n, header, arrays):
    """Group 1's second sample malformed (its versions one short); group 2's first sampled by weights of
    another trainer epoch: neither group is ever whole."""
    if n == 1 and header["sample_idx"] == 1:
        arrays["versions"] = arrays["versions"][:-1] if len(arrays["versions"]) > 1 else np.zeros(3, np.int32)
    if n == 2 and header["sample_idx"] == 0:
        header["epoch"] -= 1


def test_main_loop_with_fake_verifier_and_actor(tmp_path):
    """torchrun, 2 ranks, 3 steps, the real ledger: versions 0..3 reach the actor, a malformed sample and one of
    another epoch are counted, their groups found lost on the way once later groups passed every rank and given
    back to the ledger (no cut); metrics, samples records and checkpoints are written, and check_run holds.
    Then a resume on a new ledger (a whole run resumed) to step 4: the version goes on, and the ledger's
    numbering; the ids the checkpoint does not hold done are granted again first."""
    from scripts import check_run
    model_dir, samples_port, push, stop = _model_and_socket(tmp_path)

    def run(ranks, *extra):
        owner, stop = Owner(tmp_path), threading.Event()
        proc = _launch(tmp_path, model_dir, ranks, owner, samples_port, *extra)
        actor = FakeActor(owner.cfg)
        fake = FakeVerifier(owner, actor, push, stop, change=_break)
        try:
            out, _ = proc.communicate(timeout=150)
        finally:
            stop.set()
            actor.done.wait(30)
            owner.close()
        assert proc.returncode == 0, out
        return actor, owner, fake, out

    actor, owner, fake, out = run(2, "trainer.max_steps=3", "sync.async_send=false")  # every version, in order
    assert actor.versions == [0, 1, 2, 3] and actor.error is None, out
    recs = [r for r in read_jsonl(tmp_path / "metrics_trainer.jsonl") if "trainer/loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3]
    keys = {"trainer/ess", "trainer/kl", "trainer/clamp_frac", "trainer/lag_mean", "trainer/tokens_per_s",
            "trainer/wait_s", "trainer/broadcast_s", "trainer/lag_by_position"}
    assert keys <= set(recs[-1]) and recs[-1]["trainer/malformed"] == 1
    lost = [e for e in owner.journal() if e["event"] == "given_back"]
    assert [(e["tickets"], e["why"]) for e in lost] == [([fake.groups[1][0], fake.groups[2][0]],
                                                         "lost on the way")], lost
    rows = read_jsonl(tmp_path / "samples_trainer.jsonl")
    rows1 = read_jsonl(tmp_path / "samples_trainer.rank1.jsonl")
    assert [r["trainer_version"] for r in rows] == [0, 1, 2] == [r["trainer_version"] for r in rows1]
    # whole groups, each in one step, on whichever rank holds each sample, in forwarding order
    assert [sorted(r["tickets"] + r1["tickets"]) for r, r1 in zip(rows, rows1)][0] == \
        sorted([fake.groups[0][0]] * 2 + [fake.groups[3][0]] * 2)
    assert all(ok for _, ok, _ in check_run.check(tmp_path)), check_run.check(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2", "step-3"]
    state = json.loads((tmp_path / "checkpoints/step-3/trainer_state.json").read_text())
    issued = max(e["ticket"] for e in owner.journal() if e["event"] == "issued")

    actor, owner, fake, out = run(1, "trainer.max_steps=4", "run.resume=true", "sync.async_send=false")
    assert actor.versions == [3, 4], out
    hello = [e for e in owner.journal() if e["event"] == "hello" and e["role"] == "trainer"][-1]
    top = max(state["done_above"], default=state["done_below"] - 1) + 1
    assert (hello["epoch"], hello["step"], hello["next"]) == (2, 3, top)
    assert hello["redo"] == [g for g in range(state["done_below"], top) if g not in state["done_above"]]
    assert fake.groups[0][0] == issued + 1  # the ticket numbers go on
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics_trainer.jsonl") if "trainer/loss" in r][-1] == 4
    push.close()


def _main_one_rank(tmp_path, *extra, advantage=lambda n, k: None):
    """main() on one rank (every broadcast waited for: sync.async_send=false) against a FakeActor and a
    FakeVerifier -> (the actor, the trainer's output), the trainer having exited 0."""
    model_dir, samples_port, push, stop = _model_and_socket(tmp_path)
    owner = Owner(tmp_path)
    proc = _launch(tmp_path, model_dir, 1, owner, samples_port, "sync.async_send=false", *extra)
    actor = FakeActor(owner.cfg)
    FakeVerifier(owner, actor, push, stop, advantage=advantage)
    try:
        out, _ = proc.communicate(timeout=150)
    finally:
        stop.set()
        push.close()
        owner.close()
    assert proc.returncode == 0, out
    return actor, out


@pytest.mark.parametrize("max_lag,versions", [(4, [0, 1, 3]), (0, [0, 1, 2, 3])])
def test_skipped_step_is_not_broadcast_and_non_finite_samples_are_dropped(tmp_path, max_lag, versions):
    """main(): the second batch's advantages (3e38) overflow the gradient, so step 2 is skipped and its
    (unchanged) weights are not broadcast: the actor receives versions 0, 1, 3. With actor.max_lag=0 the
    actor could not start step 3's samples on version 1 (trainer.weights_owed): version 2 is sent before
    them. A sample with a NaN advantage is dropped as malformed and counted (the wire format refuses
    non-finite numbers)."""
    advantage = lambda n, k: 3e38 if 2 <= n < 4 else float("nan") if (n, k) == (4, 1) else None  # noqa: E731
    actor, out = _main_one_rank(tmp_path, "trainer.max_steps=3", f"actor.max_lag={max_lag}", advantage=advantage)
    recs = [r for r in read_jsonl(tmp_path / "metrics_trainer.jsonl") if "trainer/loss" in r]
    assert [r["trainer/step_skipped"] for r in recs] == [0, 1, 0] and recs[-1]["trainer/skipped_steps"] == 1
    assert recs[-1]["trainer/malformed"] == 1
    actor.done.wait(30)
    assert actor.versions == versions, out


def test_forced_staleness_broadcasts_every_kth_version(tmp_path):
    """sync.send_every=2 (forced staleness, for the staleness sweep): of 5 steps the actor receives versions
    0, 2 and 4, each held for two steps; without it, every version (the test above)."""
    actor, out = _main_one_rank(tmp_path, "trainer.max_steps=5", "sync.send_every=2", "actor.max_lag=1")
    actor.done.wait(30)
    assert actor.versions == [0, 2, 4], out


def test_done_ids_are_pruned_into_a_floor():
    """A checkpoint keeps every id below done_below done (trained or dropped), and the ones above it."""
    from types import SimpleNamespace
    state = SimpleNamespace(done_below=0, done_ids={0, 1, 3, 5, 6})
    checkpoints.prune_done(state)
    assert state.done_below == 2 and state.done_ids == {3, 5, 6}
    state.done_ids |= {2, 4}
    checkpoints.prune_done(state)
    assert state.done_below == 7 and state.done_ids == set()


def _dying_actor(overrides):
    """Joins the weight roster, takes version 0, then dies without a word (os._exit: no clean shutdown)."""
    actor = FakeActor(common.load_config(overrides))
    while not actor.updates and not actor.done.is_set():
        time.sleep(0.01)
    os._exit(0)


def test_a_lost_actor_leaves_the_roster_and_the_trainer_waits_for_another(tmp_path):
    """Its only actor dies after version 0: the ledger counts it lost (silent), the trainer forms a roster
    without it and waits up to run.peer_timeout_s for samples; then it stops, non-zero, naming what it waited
    for."""
    model_dir, samples_port, push, stop = _model_and_socket(tmp_path)
    # (the shortest peer timeout the timing check allows: it must exceed hang_timeout_s + restart_s)
    owner = Owner(tmp_path, "run.heartbeat_timeout_s=2", "run.peer_timeout_s=12", "run.hang_timeout_s=5",
                  "run.restart_s=5")
    proc = _launch(tmp_path, model_dir, 1, owner, samples_port, "trainer.max_steps=200")
    dying = mp.get_context("spawn").Process(target=_dying_actor, args=(owner.overrides,))
    dying.start()
    try:
        out, _ = proc.communicate(timeout=400)
    finally:
        stop.set()
        proc.kill()
        push.close()
        owner.close()
    dying.join(timeout=10)
    assert proc.returncode != 0, out[-3000:]
    assert "actor incarnation 1 lost: silent for 2 s" in (tmp_path / "owner.log").read_text()
    assert "no sample from the verifier" in out and "run.peer_timeout_s" in out, out[-3000:]
    assert '"trainer/done"' not in (tmp_path / "metrics_trainer.jsonl").read_text()


def test_the_roster_follows_the_actors_the_ledger_counts_alive(tmp_path):
    """Two actors in the roster; one falls silent (its requests stop): after run.heartbeat_timeout_s the
    ledger counts it lost and the next roster is formed without it; the other stays."""
    import weights_sync as ws
    owner = Owner(tmp_path, "run.heartbeat_timeout_s=2")
    try:
        stays, goes = FakeActor(owner.cfg), FakeActor(owner.cfg)
        server = ws.WeightServer(owner.cfg, 0, CPU, epoch=1, ledger=lambda: common.LedgerClient(owner.cfg, owner.store))
        deadline = time.time() + 30
        while set(server.members) != {stays.inc, goes.inc} and time.time() < deadline:
            time.sleep(0.1)
        assert set(server.members) == {stays.inc, goes.inc}
        goes.done.set()  # its requests stop
        while set(server.members) != {stays.inc} and time.time() < deadline:
            time.sleep(0.1)
        assert set(server.members) == {stays.inc}
        time.sleep(3)  # longer than the timeout: the one that speaks stays
        assert set(server.members) == {stays.inc}
        server.close("done")
    finally:
        owner.close()


def test_a_connection_that_brings_nothing_is_made_again(tmp_path):
    """The verifier the rank is connected to stops listening but keeps the connection open, and a new one
    binds the same address: zmq never reconnects a connection it does not see closed. After
    run.heartbeat_timeout_s with not even a tick, the rank connects again and trains the new one's group.
    Before, it waited on the silent connection until run.peer_timeout_s (a chaos run stood still 332 s after
    the verifier and the actor were killed at once, hearing nothing from the restarted verifier)."""
    import zmq
    from types import SimpleNamespace
    from test_lost_samples import G, VOCAB, _samples
    ctx, addr = zmq.Context.instance(), f"tcp://127.0.0.1:{free_port()}"
    old = ctx.socket(zmq.PUSH)
    old.bind(addr)
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    assert old.poll(10_000, zmq.POLLOUT)  # connected
    old.unbind(addr)  # no listener now; the connection stays, silent
    new = ctx.socket(zmq.PUSH)
    for _ in range(100):  # (the unbind ends in zmq's I/O thread)
        with contextlib.suppress(zmq.ZMQError):
            new.bind(addr)
            break
        time.sleep(0.05)

    def verifier():  # its one group, once a rank is connected to it
        if new.poll(30_000, zmq.POLLOUT):
            for frames in _samples(ticket=7, group_id=3, order=0, verifier=1, epoch=0):
                new.send_multipart(frames)
    th = threading.Thread(target=verifier)
    th.start()
    state = trainer.TrainState(model=None, fsdp=SimpleNamespace(device=CPU))
    cfg = make_cfg(tmp_path, **{"run.heartbeat_timeout_s": 1, "run.peer_timeout_s": 20, "run.hang_timeout_s": 5,
                                "run.restart_s": 1, "actor.group_size": G})
    try:
        batch, _, groups = trainer.take_batch(sock, [], G, G, state, cfg, addr, VOCAB)
    finally:
        th.join()
        for s in (sock, old, new):
            s.close(linger=0)
    assert groups == [(7, 3)] and sorted(s["sample_idx"] for s in batch) == list(range(G))


def test_waiting_for_samples_times_out_naming_the_verifier(tmp_path):
    import zmq
    addr = f"tcp://127.0.0.1:{free_port()}"  # nobody binds it
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    from types import SimpleNamespace
    state = trainer.TrainState(model=None, fsdp=SimpleNamespace(device=CPU))
    cfg = make_cfg(tmp_path, **{"run.peer_timeout_s": 6, "run.hang_timeout_s": 5, "run.restart_s": 0.1})
    with pytest.raises(SystemExit) as e:
        trainer.take_batch(sock, [], 1, 1, state, cfg, addr, 64)
    sock.close()
    msg = str(e.value.code)
    assert addr in msg and "run.peer_timeout_s" in msg and "is verifier.py running" in msg
