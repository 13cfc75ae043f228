"""Trainer: hand-written FSDP over torchrun ranks; pulls samples, packs, steps, sends weights,
checkpoints.

Consumes  `sample` messages (common.SCHEMAS: rollout, reward, advantage, verifier, order) and
          `tick`s, ZMQ PULL from the verifier at ports.host:ports.samples; the ranks train whole
          groups in the order the verifier forwarded them, B = trainer.batch_size per step.
Produces  (1) the weights after every optimizer step (every actor.G_steps, conventional) to the
          weight roster of the live actors (weights_sync.WeightServer), version = optimizer steps
          taken; (2) <run.dir>/checkpoints/step-N (HF safetensors, config, tokenizer,
          optim-rank{r}.pt, trainer_state.json, COMPLETE); (3) metrics_trainer.jsonl and, per
          rank, samples_trainer[.rank{r}].jsonl (each step's sequences: group ids, sample
          indices, tickets, per-token versions run-length coded [v, n]; read by
          scripts/check_run.py); (4) to the ledger (elastic.py, rank 0): the tickets each step
          trained, with the version it made, and the groups lost on the way.
Run alone (the run's store and ledger, `python elastic.py`; a verifier pushes
samples, the actors' vLLM workers join the weight roster):
    torchrun --standalone --nproc_per_node=N trainer.py trainer.nproc=N [section.key=value ...]
`python trainer.py` without torchrun runs one rank with no process group (every collective is a
no-op).

Deliberate simplifications vs. the paper and its released code (DeepSpeed ZeRO-3):
 1. FSDP units are the decoder blocks + one root (embeddings, final norm, lm_head); overlap is one
    unit deep (trainer.prefetch) on one process group: all-gathers and reduce-scatters queue
    (torchtitan: separate streams).
 2. Gradients are reduce-scattered in fp32 by default (exact sums; trainer.reduce_dtype=bfloat16
    halves the bytes).
 3. Micro-batches are right-padded rows of length-sorted samples, not one packed row with a
    block-diagonal mask: padding wastes little after sorting; a packed row would pay O(T^2)
    attention.
 4. Every rank loads the whole HF model into CPU memory once before sharding (no meta-device init).
 5. Checkpoints assume a filesystem shared by all ranks; resuming on another number of ranks re-cuts
    the optimizer shards and restarts the RNG streams.
 6. The asynchronous weight send (sync.async_send) keeps one full copy of the weights on rank 0.
"""
import contextlib
import functools
import json
import math
import os
import sys
import time
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import common
import corrections
import elastic
import loss
import weights_sync
from scripts import checkpoints, rundir, telemetry
from scripts.ranks import all_gather_ints, all_max, all_reduce, init_distributed, is_main, rank, world

# torch 2.13 marks the two collectives FSDP needs as deprecated (their successors don't exist in
# older torch).
warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed\.")

# --- FSDP -----------------------------------------------------------------------------------------
# Forward: a unit's wrapped forward all-gathers its shards into a flat compute-dtype buffer
# (`_Gather`, `_take`), points the modules' parameter attributes at views of it, runs, drops the
# views; saved tensors living in the buffer become handles (`_pack`), so nothing keeps it alive.
# Backward: the first op needing the unit's weights unpacks a handle, which re-gathers the unit
# (`_unpack`); `_Gather.backward`, run once all the unit's weights have gradients, frees that copy
# and reduce-scatters the flat gradient (`_reduce`).
# Overlap (trainer.prefetch; as torchtitan/FSDP2): taking a unit issues the all-gather of the next
# one needed, run while this one computes; a reduce-scatter is waited on only when the next unit's
# gradient is ready. Gathered at once: the root, the unit computing, the one prefetched.
# Collective order: all ranks build the same graph (zero-weight micro-batches too) and autograd runs
# ready nodes in a fixed order, so all ranks issue the same collectives in the same order.
# The design and its measured checks: docs/DESIGN.md, "Hand-written FSDP".

class Unit:
    """One sharding unit: its parameters flattened into an fp32 vector of N elements padded to
    N_pad, a multiple of W; this rank owns elements [rank*S, (rank+1)*S), S = N_pad/W (`shard`, the
    master copy)."""

    def __init__(self, entries, device, index_in_model):
        self.index = index_in_model
        # slots: (module, attribute, index of the parameter in `names`); first: id(parameter) ->
        # (its index, the parameter, its name). A tied tensor (two slots) is stored once.
        self.slots, first = [], {}
        for name, module, attr in entries:
            p = getattr(module, attr)
            self.slots.append((module, attr, first.setdefault(id(p), (len(first), p, name))[0]))
        params, self.names = [p for _, p, _ in first.values()], [n for _, _, n in first.values()]
        self.shapes, self.numels = [p.shape for p in params], [p.numel() for p in params]
        self.numel = sum(self.numels)
        self.pad = -self.numel % world()
        padding = [torch.zeros(self.pad)]
        flat = torch.cat([p.detach().reshape(-1).float() for p in params] + padding)  # [N_pad]
        # AdamW decays matrices only (not norms, biases): a flat shard mixes both, hence a
        # per-element mask.
        decay = torch.cat([torch.full((p.numel(),), float(p.ndim >= 2)) for p in params] + padding)
        # [S] fp32 master
        self.shard = flat.chunk(world())[rank()].clone().to(device).requires_grad_(True)
        self.decay = decay.chunk(world())[rank()].bool().to(device)  # [S] bool
        self.exp_avg = torch.zeros_like(self.shard)  # [S] AdamW first moment
        self.exp_avg_sq = torch.zeros_like(self.shard)  # [S] AdamW second moment
        # (work, buffer [N_pad]): an all-gather issued ahead by the prefetch, until taken
        self.pending = None
        # the unit's weights re-gathered for backward, until _Gather.backward
        self.regathered = None
        # The module's own parameters are gone: the shard is the truth.
        for module, attr, _ in self.slots:
            module._parameters.pop(attr, None)
            setattr(module, attr, None)

    def views(self, full):
        """The unit's flat weights [N_pad] -> a view of each parameter, in `names` order."""
        return [t.view(s) for t, s in zip(full.split(self.numels + [self.pad]), self.shapes)]

class _Gather(torch.autograd.Function):
    """shard [S] fp32 -> the unit's flat weights [N_pad] in the compute dtype. Backward:
    reduce-scatter."""

    @staticmethod
    def forward(ctx, shard, fsdp, unit):
        ctx.fsdp, ctx.unit = fsdp, unit
        return fsdp._take(unit)  # [N_pad]

    @staticmethod
    def backward(ctx, grad_full):  # [N_pad]
        # Ordering: this node needs every weight's gradient, so every backward op using the weights
        # has run.
        ctx.unit.regathered = None
        ctx.fsdp._reduce(ctx.unit, grad_full)
        # _reduce puts the summed gradient into shard.grad once it has arrived
        return None, None, None

class FSDP:
    """Shards an HF causal LM (decoder blocks in model.model.layers) in place; see the section
    comment."""

    def __init__(self, model, device, dtype, activation_checkpointing=False, prefetch=True,
                 reduce_dtype=torch.float32):
        self.device, self.dtype, self.reduce_dtype = device, dtype, reduce_dtype
        self.prefetch = prefetch and world() > 1  # one rank gathers by copying: nothing to overlap
        self.live = {}  # storage address of a gathered forward buffer -> its unit (for _pack)
        # gathered parameter memory, counted until truly freed
        self.live_bytes = self.peak_bytes = 0
        self.reducing = None  # (work, shard gradient [S], unit) of the reduce-scatter in flight
        layers = model.model.layers
        unit_of = {id(m): i + 1 for i, layer in enumerate(layers) for m in layer.modules()}
        # unit 0 = root (embeddings, final norm, lm_head), unit i = decoder block i
        entries = [[] for _ in range(len(layers) + 1)]
        for mname, module in model.named_modules():
            attrs = [attr for attr, p in module._parameters.items() if p is not None]
            entries[unit_of.get(id(module), 0)] += [(f"{mname}.{a}", module, a) for a in attrs]
        self.units = [Unit(e, device, i) for i, e in enumerate(entries)]
        model.to(device)  # what is left: buffers (rotary table), unsharded
        model.forward = functools.partial(self.run_root, model.forward)
        for layer, unit in zip(layers, self.units[1:]):
            self._wrap(layer, unit, ac=activation_checkpointing)

    def run_root(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) with the root unit gathered for the whole call (embeddings first,
        head last) and the saved-tensor hooks installed: model(...) runs through it, as can a
        caller's own model.model(...) and model.lm_head.weight. Not nested (one call per
        forward)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self._run(self.units[0], fn, *args, **kwargs)

    def _run(self, unit, fn, *args, **kwargs):
        """fn(*args, **kwargs) with `unit` gathered: from before its first op until it returns, the
        modules' parameter attributes are views of the gathered buffer, which `live` maps to the
        unit (for _pack)."""
        full = _Gather.apply(unit.shard, self, unit)  # [N_pad]
        views = unit.views(full)
        for module, attr, i in unit.slots:
            setattr(module, attr, views[i])
        self.live[full.untyped_storage().data_ptr()] = unit
        # From here on the modules' attributes alone hold the buffer (dropping them frees it).
        del full, views
        try:
            return fn(*args, **kwargs)
        # Also when checkpoint's recomputation stops early by raising inside `fn`: drop the views
        # and the `live` entry (after the unit's forward only handles refer to the buffer, so
        # dropping the views frees it).
        finally:
            for module, attr, _ in unit.slots:
                setattr(module, attr, None)
            self.live = {k: u for k, u in self.live.items() if u is not unit}

    def _wrap(self, module, unit, ac):
        run = functools.partial(self._run, unit, module.forward)
        # Activation checkpointing: the gather happens inside `run`, so backward's recomputation
        # re-gathers the unit itself (checkpoint's own saved-tensor hooks replace ours in there).
        run_ac = functools.partial(checkpoint, run, use_reentrant=False) if ac else run
        module.forward = lambda *a, **kw: (run_ac if torch.is_grad_enabled() else run)(*a, **kw)

    def all_gather(self, shard, dtype=None, async_op=False):
        """shard [S] -> the full flat unit [N_pad] (a new buffer, counted in live_bytes until
        freed). async_op: -> (work to wait on before reading the buffer, or None; buffer)."""
        # [N_pad]
        full = torch.empty(shard.numel() * world(), dtype=dtype or self.dtype, device=shard.device)
        work = None
        # sync: every rank, same unit (c10d keeps the cast input alive until the work is done)
        if world() > 1:
            # The collective gets an alias of `full`: its worker thread drops a finished
            # collective's tensors whenever it next runs (on gloo on a loaded CPU, milliseconds
            # later), which live_bytes leaves out.
            work = dist.all_gather_into_tensor(full.detach(), shard.detach().to(full.dtype),
                                               async_op=async_op)
        else:
            full.copy_(shard.detach())
        self.live_bytes += full.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(full, self._released, full.nbytes)  # fires when the last view is gone
        return (work, full) if async_op else full

    def _released(self, nbytes):
        self.live_bytes -= nbytes

    def _next(self, unit):
        """The unit whose weights are needed after `unit`'s: forward takes units in order (root,
        blocks 1..L); backward starts at the head (root), then L..1 (block 1's successor, the
        embedding, is root)."""
        i, n = unit.index, len(self.units)
        # not inside backward (checkpoint's recomputation is)
        if torch._C._current_graph_task_id() < 0:
            return self.units[i + 1] if i + 1 < n else None
        return self.units[i - 1 if i else n - 1] if i != 1 and n > 1 else None

    def _take(self, unit):
        """-> the unit's gathered weights [N_pad]: the prefetched buffer, else gathered now."""
        work, full = unit.pending or self.all_gather(unit.shard, async_op=True)
        unit.pending = None
        nxt = self._next(unit) if self.prefetch else None
        if nxt is not None and nxt.pending is None:
            # Sync (issued here, waited on when taken): all ranks take the same units in the same
            # order, so this all-gather keeps their order.
            nxt.pending = self.all_gather(nxt.shard, async_op=True)
        if work is not None:
            # sync: `unit`'s weights are here (on GPU the compute stream waits, the host goes on)
            work.wait()
        return full

    def _reduce(self, unit, grad_full):
        """grad_full [N_pad]: this rank's gradient of the unit -> summed over ranks into this rank's
        shard.grad."""
        # Ordering: the previous unit's reduce-scatter (run during this backward) ends before the
        # next is issued: one in flight, at most one extra unit of gradient memory.
        self.finish_reduce()
        if world() == 1:
            self.reducing = (None, grad_full.float(), unit)  # the whole gradient is the shard's
        else:
            grad = grad_full.to(self.reduce_dtype)  # [N_pad] (simplification 2)
            # [S] this rank's part of the sum
            shard_grad = torch.empty(grad.numel() // world(), dtype=grad.dtype, device=grad.device)
            # Sync: every rank's gradient of this unit is summed (c10d keeps `grad` alive until the
            # work is done).
            work = dist.reduce_scatter_tensor(shard_grad, grad, op=dist.ReduceOp.SUM, async_op=True)
            self.reducing = (work, shard_grad, unit)
        # The root's reduce-scatter is a backward's last (the embedding is forward's first op):
        # nothing is left to overlap it with, so it completes now and every .grad is whole when
        # backward() returns.
        if not self.prefetch or unit.index == 0:
            self.finish_reduce()

    def finish_reduce(self):
        """Wait for the reduce-scatter in flight; add its result to the unit's shard.grad
        (accumulated over micro-batches, as autograd would: the first one is stored, the next ones
        added in place)."""
        if self.reducing is not None:
            # take the one in flight out of its slot
            (work, shard_grad, unit), self.reducing = self.reducing, None
            if work is not None:
                work.wait()  # sync: the summed gradient of `unit` is here
            g = shard_grad.float()  # [S]
            unit.shard.grad = g if unit.shard.grad is None else unit.shard.grad.add_(g)

    def _pack(self, t):
        unit = self.live.get(t.untyped_storage().data_ptr()) if t.dtype == self.dtype else None
        return t if unit is None else (unit, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, packed):
        if not isinstance(packed, tuple):
            return packed
        unit, size, stride, offset = packed
        if unit.regathered is None:  # the first backward op of this unit: gather it again
            unit.regathered = self._take(unit)
        return unit.regathered.as_strided(size, stride, offset)

    @torch.no_grad()
    def clip_and_step(self, step, lr, betas, eps, weight_decay, max_norm) -> float:
        """Clip by the global gradient norm, then AdamW (torch's formula) on this rank's shards.
        -> norm."""
        # sync: every reduce-scatter has landed before the norm (the root's backward waited)
        self.finish_reduce()
        # this rank's sum of squared gradients
        sq = torch.stack([u.shard.grad.pow(2).sum() for u in self.units]).sum()
        norm = all_reduce(sq).sqrt().item()  # sync: the norm over all shards of all units
        # as torch's clip_grad_norm_
        coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
        b1, b2 = betas
        for u in self.units:
            # A NaN/inf norm would pass min(1, c/(norm+eps)) and poison the weights and moments:
            # the update is skipped (train_step counts it).
            if math.isfinite(norm):
                u.shard.grad.mul_(coef)  # clip
                p, g, m, v = u.shard, u.shard.grad, u.exp_avg, u.exp_avg_sq  # [S] each
                if weight_decay:
                    p.mul_(1 - lr * weight_decay * u.decay)  # decoupled decay, matrices only
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v.sqrt() / math.sqrt(1 - b2 ** step)).add_(eps)
                p.addcdiv_(m, denom, value=-lr / (1 - b1 ** step))
            u.shard.grad = None
        return norm

    def full_units(self, dtype):
        """Yields {hf_name: full tensor} one unit at a time. Every rank must consume it: one
        all-gather each."""
        for u in self.units:
            # no graph: all_gather reads shard.detach()
            yield dict(zip(u.names, u.views(self.all_gather(u.shard, dtype))))

    def state_dict(self):
        units = [{"shard": u.shard.detach().cpu(), "exp_avg": u.exp_avg.cpu(),
                  "exp_avg_sq": u.exp_avg_sq.cpu()} for u in self.units]
        return {"world": world(), "units": units}

    @torch.no_grad()
    def load_state_dict(self, sds):
        """sds: the optimizer files of a checkpoint in rank order: this rank's alone when it was
        written by as many ranks as now, else all of them, re-cut into this world's shards."""
        for i, u in enumerate(self.units):
            for k in ("shard", "exp_avg", "exp_avg_sq"):
                # [S] this rank's, or [N_pad] of the old world
                x = torch.cat([sd["units"][i][k] for sd in sds])
                # re-cut: [N] without the old padding, padded for this world
                if sds[0]["world"] != world():
                    x = torch.cat([x[:u.numel], torch.zeros(u.pad)]).chunk(world())[rank()]
                getattr(u, k).copy_(x)

# --- state and batches ----------------------------------------------------------------------------

@dataclass
class TrainState:
    model: torch.nn.Module
    fsdp: FSDP
    step: int = 0  # optimizer steps taken = version of the current weights
    # rank 0, kept by checkpoints: every group id below done_below was trained or dropped, and
    # the ids above it that were (a restarted trainer's ledger grants the others again first)
    done_below: int = 0
    done_ids: set = field(default_factory=set)
    # steps whose gradient norm was not finite: no update applied (AdamW counts applied ones)
    skipped: int = 0
    epoch: int = 0  # this trainer's start (the ledger's): its timeline of steps
    samples: int = 0  # sequences trained on, all ranks
    malformed: int = 0  # malformed messages this rank dropped
    # samples of another trainer epoch, or of a group lost on the way (take_batch)
    discarded: int = 0
    last_sample: float = 0.0  # when this rank last received a sample (pull_samples)
    heard: float = 0.0  # when this rank last received anything, a tick included
    redialed: float = 0.0  # when it last connected again after hearing nothing (take_batch)
    # verifier incarnation -> the first order of its forwards not yet passed on this rank: past
    # its samples' orders and its ticks' (pull_samples)
    passed: dict = field(default_factory=dict)
    # verifier incarnation -> the first order not yet trained or found lost (whole_groups)
    start: dict = field(default_factory=dict)
    # rank 0: every verifier's forwards, as the ledger last said (where an old one's orders end)
    ends: list = field(default_factory=list)
    sent: int = -1  # the newest version broadcast to the actors (send_weights)
    # this rank's timeline (main sets it; run.trace): a disabled one records nothing
    events: telemetry.Events = field(default_factory=lambda: telemetry.Events(".", "none", on=False))
    # this rank's watchdog timer (main sets it): made at every micro-batch, wait and unit saved
    progress: elastic.Progress = field(default_factory=elastic.Progress)

def build_state(cfg, device, ckpt=None, model=None) -> TrainState:
    """Load the HF model (init_from, model.path, or a checkpoint directory) unless given; shard it;
    on resume also restore this rank's optimizer shard and the counters."""
    if model is None:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(
            ckpt or cfg.trainer.init_from or cfg.model_path, dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    tc, dtype = cfg.trainer, getattr(torch, cfg.compute_dtype(device.type == "cuda"))
    state = TrainState(model, FSDP(model, device, dtype, tc.activation_checkpointing, tc.prefetch,
                                   getattr(torch, tc.reduce_dtype)))
    if ckpt is not None:
        checkpoints.restore(state, ckpt)
    return state

def pack_micro_batches(samples, micro_batch_tokens):
    """Length-sorted greedy packing into micro-batches with rows x longest <= micro_batch_tokens (a
    longer sample gets a micro-batch of its own). Sorting keeps the padding of each row small
    (simplification 3)."""
    batches = []
    for s in sorted(samples, key=lambda s: -(len(s["prompt_ids"]) + len(s["completion_ids"]))):
        if batches and (len(batches[-1]) + 1) * longest <= micro_batch_tokens:
            batches[-1].append(s)
        else:
            batches.append([s])
            # the first sample of a micro-batch is its longest
            longest = len(s["prompt_ids"]) + len(s["completion_ids"])
    return batches

def collate(samples, version, device):
    """Right-padded rows. Logits at position t predict token t+1, so completion token j of a
    sample with a P-token prompt sits at shifted column P-1+j. No samples -> a zero-weight
    micro-batch (mask all false). Right padding needs no attention mask: with causal attention no
    real token sees a pad."""
    rows = max(len(samples), 1)
    T = max([len(s["prompt_ids"]) + len(s["completion_ids"]) for s in samples], default=2)
    input_ids = torch.zeros(rows, T, dtype=torch.long)  # [B,T]
    old_logprobs = torch.zeros(rows, T - 1)  # [B,T-1] μ of token t+1
    # [B,T-1] the model's completion tokens only (an environment's, version -1, carry no loss)
    mask = torch.zeros(rows, T - 1, dtype=torch.bool)
    lags = torch.zeros(rows, T - 1, dtype=torch.long)  # [B,T-1] version - versions[t]
    advantages = torch.tensor([float(s["advantage"]) for s in samples] or [0.0])  # [B]
    for i, s in enumerate(samples):
        P, C = len(s["prompt_ids"]), len(s["completion_ids"])
        ids = np.concatenate([s["prompt_ids"], s["completion_ids"]]).astype(np.int64)  # [T_i]
        input_ids[i, :P + C] = torch.from_numpy(ids)
        cols = slice(P - 1, P - 1 + C)
        old_logprobs[i, cols] = torch.from_numpy(s["logprobs"].astype(np.float32))
        mask[i, cols] = torch.from_numpy(s["versions"] >= 0)
        lags[i, cols] = version - torch.from_numpy(s["versions"].astype(np.int64))
    batch = dict(input_ids=input_ids, targets=input_ids[:, 1:], old_logprobs=old_logprobs,
                 mask=mask, lags=lags, advantages=advantages)
    return {k: v.to(device) for k, v in batch.items()}

def completion_forward(model, x, temperature: float, top_p: float, logits_chunk: int):
    """Under the root unit (FSDP.run_root): decoder -> final hidden states -> lm_head at completion
    positions only -> (2) log π and (3) entropy, scattered back to [B,T-1] (zeros elsewhere; masked
    out by the loss)."""
    # [B,T-1,D]
    hidden = model.model(input_ids=x["input_ids"], use_cache=False).last_hidden_state[:, :-1]
    m = x["mask"]  # [B,T-1]
    # [N] each
    logprobs, entropy = loss.completion_logprobs(hidden[m], model.lm_head.weight, x["targets"][m],
                                                 temperature, top_p, logits_chunk)
    zeros = torch.zeros(m.shape, dtype=torch.float32, device=m.device)  # [B,T-1]
    return zeros.masked_scatter(m, logprobs), zeros.masked_scatter(m, entropy)

# --- train step -----------------------------------------------------------------------------------

def train_step(state: TrainState, samples, cfg) -> dict:
    """One optimizer step on this rank's B/W samples (a sample message's fields and arrays); all
    ranks call it together; metrics are summed over ranks. A zero-advantage sample adds exactly 0 to
    (5) and its gradient, so it is not run (most groups early on); the normaliser still counts every
    sequence: loss and gradient are the whole batch's. Token diagnostics (ESS, KL, clamp fraction,
    entropy, by lag) thus describe the sequences carrying gradient; lags, reward and counts describe
    all. A non-finite gradient norm skips the update (weights and moments unchanged, `skipped`
    counted); the step still counts as a version, which is not broadcast."""
    t0 = time.time()
    tc, actor, device = cfg.trainer, cfg.actor, state.fsdp.device
    version = state.step  # the policy being trained; this step produces version + 1
    with_gradient = [s for s in samples if float(s["advantage"]) != 0.0]
    batches = pack_micro_batches(with_gradient, tc.micro_batch_tokens)
    # Sync: every micro-batch is a fixed sequence of collectives, so all ranks run as many as the
    # busiest one (at least one: every shard gets a gradient), the others adding zero-weight ones
    # (mask all false: zero gradient).
    n_mb = max(1, all_max([len(batches)], device)[0])
    sums = {}
    for mb in batches + [[]] * (n_mb - len(batches)):
        state.progress.made()
        x = collate(mb, version, device)
        logprobs, entropy = state.fsdp.run_root(completion_forward, state.model, x,  # [B,T-1] each
                                                actor.temperature, actor.top_p, tc.logits_chunk)
        # loss normalizer (tc.batch_size): sequences in this optimizer step, all micro-batches,
        # all ranks
        mb_loss, stats = loss.policy_loss(logprobs, x["old_logprobs"], x["advantages"], x["mask"],
                                          tc.batch_size, tc.is_clamp, entropy, x["lags"],
                                          corrections.choose(tc))
        # reduce-scatters each unit's gradient into its shard, accumulating over micro-batches
        mb_loss.backward()
        stats["loss"] = mb_loss.detach().to(torch.float64)
        sums = {k: sums[k] + v if k in sums else v for k, v in stats.items()}
    t_optimizer = time.time()
    state.events.span("step/forward_backward", t0, end=t_optimizer)
    grad_norm = state.fsdp.clip_and_step(state.step + 1 - state.skipped, tc.lr, tc.betas, tc.eps,
                                         tc.weight_decay, tc.grad_clip)
    state.events.span("step/optimizer", t_optimizer)
    skipped = not math.isfinite(grad_norm)
    state.skipped += skipped
    state.step += 1
    train_s = time.time() - t0

    # Paper Fig. 3a: token lags (version - versions[t]) by completion position, 0..max_tokens-1 in
    # P buckets.
    P = 8
    model = [np.flatnonzero(s["versions"] >= 0) for s in samples]  # per sample: model tokens
    lag_rows = [version - s["versions"][m].astype(np.int64) for s, m in zip(samples, model)]
    pos_rows = [np.minimum(m * P // actor.max_tokens, P - 1) for m in model]
    # [N_tok] each
    lags, pos = (np.concatenate(rows + [np.zeros(0, np.int64)]) for rows in (lag_rows, pos_rows))
    # this rank's sums over all its samples (trained or not), computed on the host
    host = dict(sequences=len(samples), trained_sequences=len(with_gradient),
                reward_sum=sum(float(s["reward"]) for s in samples), malformed=state.malformed,
                discarded=state.discarded,
                all_tokens=sum(len(s["prompt_ids"]) + len(s["completion_ids"]) for s in samples),
                env_tokens=sum(len(s["completion_ids"]) - len(m) for s, m in zip(samples, model)),
                turns=sum(int(s.get("turns", 1)) for s in samples),  # (benches' samples: 1 turn)
                lag_sum=lags.sum(), lag_tokens=len(lags), pos_tokens=np.bincount(pos, minlength=P),
                pos_lag_sum=np.bincount(pos, weights=lags, minlength=P))
    # Sync: one all-reduce for every summed statistic (keys sorted: the same order on every rank),
    # one for the maxima (a minimum is the maximum of its negation).
    local = sorted({**sums, **host}.items())
    flat = [torch.as_tensor(v, dtype=torch.float64, device=device).reshape(-1) for _, v in local]
    parts = all_reduce(torch.cat(flat)).split([t.numel() for t in flat])
    totals = {k: p.tolist() if np.ndim(v) else p.item() for (k, v), p in zip(local, parts)}
    lag_max, neg_lag_min = all_max([lags.max(initial=-10**9), -lags.min(initial=10**9)], device,
                                   torch.float64)
    state.samples += int(totals["sequences"])
    return step_metrics(totals, grad_norm, -neg_lag_min, lag_max, train_s, n_mb, state, skipped)

def step_metrics(s, grad_norm, lag_min, lag_max, train_s, n_mb, state, skipped) -> dict:
    """train_step's metrics. s: the step's statistics summed over micro-batches and ranks
    (loss.policy_loss's and the samples'); lag_min, lag_max: the extremes over all ranks' tokens
    (reported as 0 when there are no tokens)."""
    tok = max(s["tokens"], 1.0)
    metrics = {"loss": s["loss"], "grad_norm": grad_norm,
               "ess": loss.ess(s["ratio_sum"], s["ratio_sq_sum"], s["tokens"]),  # paper eq. 6
               "clamp_frac": s["clamped_tokens"] / tok, "mask_frac": s["masked_tokens"] / tok,
               "kl": s["kl_sum"] / tok,
               "entropy": s["entropy_sum"] / tok, "lag_min": lag_min if s["lag_tokens"] else 0.0,
               "lag_mean": s["lag_sum"] / max(s["lag_tokens"], 1.0),
               "lag_max": lag_max if s["lag_tokens"] else 0.0,
               "reward_mean": s["reward_sum"] / max(s["sequences"], 1), "tokens": s["tokens"],
               "tokens_per_s": s["all_tokens"] / train_s, "train_s": train_s, "micro_batches": n_mb,
               "malformed": s["malformed"], "discarded": s["discarded"],
               "env_tokens": s["env_tokens"], "turns_mean": s["turns"] / max(s["sequences"], 1),
               "trained_sequences": s["trained_sequences"],
               "skipped_steps": state.skipped, "step_skipped": int(skipped)}
    # Paper Fig. 7: off-policyness by lag (an absent bucket had no tokens).
    for i, label in enumerate(loss.LAG_BUCKET_LABELS):
        if n := s["bucket_tokens"][i]:
            ess = loss.ess(s["bucket_ratio_sum"][i], s["bucket_ratio_sq_sum"][i], n)
            metrics |= {f"tokens_lag_{label}": n, f"kl_lag_{label}": s["bucket_kl_sum"][i] / n,
                        f"ess_lag_{label}": ess, f"clamp_lag_{label}": s["bucket_clamped"][i] / n,
                        f"mask_lag_{label}": s["bucket_masked"][i] / n}
    # Paper Fig. 3a: mean lag by completion position (bucket p covers positions
    # [p, p+1) * max_tokens / P).
    return {**metrics, "lag_by_position": [round(total / n, 3) if n else None
                                           for total, n in zip(s["pos_lag_sum"], s["pos_tokens"])]}

# --- weights and checkpoints ----------------------------------------------------------------------

def send_weights(state, server, store, cfg, wait=False) -> float:
    """The current weights to the actors (-> seconds on the loop's path): all ranks gather each
    unit, rank 0 copies it for its WeightServer's thread to broadcast while the next step trains.
    A broadcast on the wire skips this version (only the newest travel) unless `wait`: the
    conventional actor idles for it, the first version must arrive, and sync.async_send=false waits
    for every broadcast. Sets state.sent, the newest version sent (the same on every rank)."""
    t0 = time.time()
    wait = wait or not cfg.sync.async_send
    busy = float(server is not None and not wait and server.lock.locked())
    if server is not None and wait:
        # the broadcast on the wire first (a stopped engine holds it until its roster is given
        # up): the other ranks wait for rank 0 in the all-reduce below, re-arming their watchdogs
        server.wait_idle()
    # sync: every rank follows rank 0's choice
    if all_max([busy], state.fsdp.device, progress=state.progress)[0]:
        return time.time() - t0
    if cfg.sync.verify_every and state.step % cfg.sync.verify_every == 0:
        probe = probe_logprobs(state, cfg)  # all ranks; the actor checks its engines against it
        if is_main():
            store.set(f"probe/{state.step}", json.dumps(probe))  # before the announcement
    named = ((n, t) for unit in state.fsdp.full_units(state.fsdp.dtype) for n, t in unit.items())
    if server is not None:
        server.send(state.step, named, wait=True)  # waits only for a broadcast started since
        if not cfg.sync.async_send:
            server.drain()
    else:
        for _ in named:  # the other ranks' part of each unit's all-gather
            pass
    state.sent = state.step
    # the span: gather, and the copy the server's thread broadcasts
    state.events.span("send", t0, version=state.step)
    return time.time() - t0

PROBE_LEN = 16  # tokens of the weight-check probe (probe_logprobs)

def probe_logprobs(state, cfg) -> dict:
    """log π (temperature 1, no top-p) of each token of a fixed probe sequence (PROBE_LEN seeded
    ids) after its first, under the current weights. The actor asks its engines for the same (a
    prompt's logprobs) after loading this version: a tensor received but never in effect shows there
    (actor.verify_weights). All ranks call it (the forward gathers units)."""
    ids = np.random.default_rng(0).integers(0, state.model.config.vocab_size, PROBE_LEN)
    probe = {"prompt_ids": ids[:1], "completion_ids": ids[1:], "advantage": 0.0,
             "logprobs": np.zeros(PROBE_LEN - 1, np.float32), "versions": np.zeros_like(ids[1:])}
    x = collate([probe], state.step, state.fsdp.device)
    with torch.no_grad():
        # [1,T-1]
        logprobs, _ = state.fsdp.run_root(completion_forward, state.model, x, 1.0, 1.0, 0)
    return {"ids": ids.tolist(), "logprobs": logprobs[x["mask"]].tolist()}

def weights_owed(step: int, sent: int, max_lag: int) -> bool:
    """Must the actors get newer weights before the samples of optimizer step `step` can exist?

    The actor starts samples for at most max_lag versions past the newest weights it holds
    (actor.admit): with version `sent`, the samples of steps up to sent + max_lag. A step not
    broadcast (a non-finite gradient skipped it, or the sender was still busy) does not move that
    bound, so after max_lag + 1 of them the trainer would wait for samples the actor may not start
    (with max_lag=0: after one)."""
    return step > sent + max_lag

# --- samples --------------------------------------------------------------------------------------

def pull_samples(sock, pending, state, vocab_size, group_size, n, seconds: float) -> float:
    """Wait up to `seconds` for a sample, then pull into `pending` until this rank holds n or
    `seconds` have passed, and every sample already here. -> seconds waited. A sample of another
    trainer epoch is discarded; a malformed one (bad schema, non-finite numbers, ids outside the
    vocabulary) is dropped and counted: its group is never whole (`whole_groups`). Every sample
    and tick moves its verifier's `passed` order."""
    waited, end, first = 0.0, time.time() + seconds, True
    while True:
        t0 = time.time()
        wait = first or len(pending) < n
        if not sock.poll(max(0, int(1000 * (end - t0))) if wait else 0):
            return waited + time.time() - t0
        waited, first = waited + time.time() - t0, False
        frames = sock.recv_multipart()
        state.heard = time.time()
        try:
            if len(frames) == 1:  # a tick: where the verifier's forwards stand
                header, _ = common.decode(frames, "tick")
                state.passed[header["verifier"]] = max(state.passed.get(header["verifier"], 0),
                                                       header["order"])
                continue
            header, arrays = common.decode(frames, "sample")
            ids = np.concatenate([arrays["prompt_ids"], arrays["completion_ids"]])
            if len(arrays["prompt_ids"]) == 0 or not np.all((0 <= ids) & (ids < vocab_size)):
                raise common.WireError("empty prompt or token id outside the vocabulary")
            if header["group_size"] != group_size:
                raise common.WireError(f"group_size {header['group_size']}, not {group_size}")
        except common.WireError as e:
            state.malformed += 1
            print(f"[trainer] rank {rank()}: dropped a malformed sample ({e})", flush=True)
            continue
        v = header["verifier"]
        state.passed[v] = max(state.passed.get(v, 0), header["order"] + 1)
        state.last_sample = time.time()
        if header["epoch"] != state.epoch:  # sampled by weights this trainer never had
            state.discarded += 1
            continue
        pending.append({**header, **arrays})

def group_table(pending: list, state) -> list:
    """This rank's part of `whole_groups`' input, one list of ints gathered from every rank: the
    number of groups it holds samples of, and per group [verifier, order, ticket, group id,
    samples here]; the number of verifiers it heard from, and per one [verifier, its `passed`
    order]; then, rank 0, every verifier's forwards as the ledger last said ([verifier, count])."""
    groups = {}
    for s in pending:
        key = (int(s["verifier"]), int(s["order"]), int(s["ticket"]), int(s["group_id"]))
        groups[key] = groups.get(key, 0) + 1
    flat = [len(groups), *(x for key, n in groups.items() for x in (*key, n))]
    flat += [len(state.passed), *(x for item in state.passed.items() for x in item)]
    return flat + [x for item in state.ends for x in item]

def whole_groups(tables: list, size: int, start: dict) -> list:
    """Every rank alike, from every rank's `group_table`: the forwarded groups from each verifier's
    `start` on, in the order they were forwarded, as far as each is known whole or lost ->
    [(verifier, order, ticket and group id if whole, else None)].

    The lag bound (actor.admit) takes groups in forwarding order, so none is trained before an
    earlier one is trained or known lost. A verifier's pipe to a rank is first in, first out (also
    across its restart: the rank's connecting PULL socket keeps its pipe), so once every rank has
    passed an order (a later group's sample or a tick came), what has not arrived of the group
    never will; traffic from a newer verifier passes every order of the older ones, whose forwards
    end where the ledger says."""
    held, passed, ends = {}, [], {}
    for r, flat in enumerate(tables):
        n = flat[0]
        for k in range(n):
            v, o, ticket, group_id, count = flat[1 + 5 * k:6 + 5 * k]
            held.setdefault((v, o), [(ticket, group_id), 0])[1] += count
        m, rest = flat[1 + 5 * n], flat[2 + 5 * n:]
        passed.append(dict(zip(rest[:2 * m:2], rest[1:2 * m:2])))
        if r == 0:
            ends = dict(zip(rest[2 * m::2], rest[2 * m + 1::2]))
    known = []
    for v in sorted(set(start) | {v for v, _ in held} | set(passed[0])):
        # the first order not yet passed on every rank (a rank that heard a newer verifier: none)
        w = min(math.inf if max(p, default=v) > v else p.get(v, 0) for p in passed)
        end = math.inf if w < math.inf else ends.get(v)
        o = start.get(v, 0)
        while end is not None and o < end:
            ticket, count = held.get((v, o), (None, 0))
            if count < size and o >= w:
                return known  # not known yet: in flight
            known.append((v, o, ticket if count == size else None))
            o += 1
        if end is None or end == math.inf:
            return known
    return known

def take_batch(sock, pending, want, size, state, cfg, addr, vocab_size, ledger=None):
    """This rank's part of the next optimizer step's `size` samples, all ranks together: whole
    groups only, in the order the verifiers forwarded them (`whole_groups`), once `want` samples
    of them are here. Each rank pulls for up to 0.2 s at a time; between pulls the ranks gather
    what they hold, drop the groups lost on the way, and rank 0 tells the ledger (the report
    also brings where each verifier's forwards end, and the ids dropped since). -> (samples,
    seconds waited, the step's groups [(ticket, group id)])."""
    device, waited, since, gs = state.fsdp.device, 0.0, time.time(), cfg.actor.group_size
    seconds = 0.0  # what is here may do
    while True:
        waited += pull_samples(sock, pending, state, vocab_size, gs, want // world(), seconds)
        seconds = 0.2
        state.progress.made()  # waiting for samples is waiting on the verifier, not hung
        now, quiet_since, hb = time.time(), max(state.heard, since), cfg.run.heartbeat_timeout_s
        if now - quiet_since > hb and now - state.redialed > hb:
            # A live verifier ticks every 0.5 s: a connection that brings nothing may be to no one
            # (zmq reconnects only a connection it sees closed). A message lost by this is a
            # group lost on the way (`whole_groups`).
            if state.redialed < quiet_since:  # said once a silence
                print(f"[trainer] rank {rank()}: nothing from {addr} for {hb:g} s "
                      "(run.heartbeat_timeout_s), not even a tick; connecting again until it "
                      "hears", flush=True)
            sock.disconnect(addr)
            sock.connect(addr)
            state.redialed = now
        # sync: every rank's groups to every rank
        mine = group_table(pending, state)
        tables = all_gather_ints(mine, device) if world() > 1 else [mine]
        known = whole_groups(tables, gs, state.start)
        whole = [i for i, (_, _, group) in enumerate(known) if group is not None]
        ready = len(whole) * gs >= want
        # the step's groups and the lost ones before them, else only the lost ones before any
        taken = known[:whole[size // gs - 1] + 1] if ready else known[:(whole or [len(known)])[0]]
        for v, o, _ in taken:
            state.start[v] = o + 1
        lost = [[v, o] for v, o, group in taken if group is None]
        gone = {(v, o) for v, o in lost}
        kept = [s for s in pending if (s["verifier"], s["order"]) not in gone]
        state.discarded += len(pending) - len(kept)
        pending[:] = kept
        if is_main() and ledger is not None:
            report(ledger, state, [], lost)
        if ready:
            chosen = {group[0] for _, _, group in taken if group is not None}
            batch = [s for s in pending if s["ticket"] in chosen]
            pending[:] = [s for s in pending if s["ticket"] not in chosen]
            return batch, waited, [group for _, _, group in taken if group is not None]
        last = max(state.last_sample, since)
        if time.time() - last > cfg.run.peer_timeout_s:
            sys.exit(f"[trainer] rank {rank()}: no sample from the verifier at {addr} for "
                     f"{cfg.run.peer_timeout_s:.0f} s (run.peer_timeout_s), {len(pending)} here, "
                     f"{len(whole) * gs} of {want} in whole groups on all ranks; is verifier.py "
                     "running, and is an actor in the weight roster (trainer rank 0's log)?")

def report(ledger, state, trained: list, lost: list):
    """Rank 0 to the ledger: the groups [(ticket, group id)] trained by the step that made
    state.step, the groups lost on the way; back: the group ids dropped since and every
    verifier's forwards. Trained and dropped ids are done for good (the checkpoint's done set)."""
    reply = ledger.request("report", epoch=state.epoch, version=state.step,
                           trained=[ticket for ticket, _ in trained], lost=lost)
    state.done_ids |= set(reply["dropped"]) | {group_id for _, group_id in trained}
    state.ends = reply["forwards"]

# --- main -----------------------------------------------------------------------------------------

def main():
    cfg = common.parse_argv()
    # --- distributed init ---
    device = init_distributed(timeout_s=max(cfg.run.peer_timeout_s, cfg.sync.timeout_s) + 60)
    # One thread per core: oversubscription is the CPU demo's enemy
    # (docs/DESIGN.md, "One thread per core on CPU").
    if device.type == "cpu":
        threads = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, threads))
    torch.manual_seed(cfg.run.seed + rank())
    if is_main():
        telemetry.setup_logging(cfg, "trainer")

    # The run's store (node 0's elastic.py, which run.sh starts before any role): announcements and
    # the weight rosters' rendezvous outlive a trainer that restarts; the ledger beside it.
    store = weights_sync.create_store(cfg.sync.host, cfg.sync.port, False, cfg.run.peer_timeout_s)

    # --- model: HF weights or the latest checkpoint, sharded over the ranks ---
    ckpt = rundir.latest_checkpoint(cfg.run_dir / "checkpoints") if cfg.run.resume else None
    state = build_state(cfg, device, ckpt)
    state.events = telemetry.Events(cfg.run_dir, f"trainer{rank()}", cfg.run.trace)
    state.progress = elastic.Progress(cfg, f"trainer rank {rank()} (pid {os.getpid()})")
    tokenizer, src = None, ckpt or cfg.trainer.init_from or cfg.model_path
    if is_main():
        params = sum(u.numel for u in state.fsdp.units)
        print(f"[trainer] {world()} rank(s) on {device}, {params / 1e6:.2f}M params, "
              f"{'resumed' if ckpt else 'fresh'} from {src}", flush=True)
        # a model directory without a tokenizer: checkpoints get none
        with contextlib.suppress(OSError, ValueError, TypeError):
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(src)

    # --- this trainer's epoch (the ledger grants the ids its checkpoint lacks again first) ---
    server, ledger, first = None, None, []
    if is_main():
        ledger = common.LedgerClient(cfg, store)
        checkpoints.prune_done(state)
        budget = {"batch_size": cfg.trainer.batch_size, "group_size": cfg.actor.group_size,
                  "max_lag": cfg.actor.max_lag, "schedule": cfg.actor.schedule,
                  "G_steps": cfg.actor.G_steps}
        reply = ledger.request("trainer_hello", epoch=state.epoch, step=state.step, budget=budget,
                               done_below=state.done_below, done_above=sorted(state.done_ids))
        first = [reply["epoch"], *(x for item in reply["forwards"] for x in item)]
    # sync: rank 0's epoch and where each verifier's forwards stand to every rank
    first = all_gather_ints(first, device)[0] if world() > 1 else first
    state.epoch, state.start = first[0], dict(zip(first[1::2], first[2::2]))

    # --- weight roster (trainer rank 0 + every live actor's workers): this version first ---
    if is_main():
        server = weights_sync.WeightServer(cfg, state.step, device, state.epoch,
                                           lambda: common.LedgerClient(cfg, store), state.progress)
    send_weights(state, server, store, cfg, wait=True)

    # --- samples: each rank pulls its own share from the verifier ---
    addr = common.zmq_addr(cfg.ports.host, cfg.ports.samples)
    sock = common.pull_socket()
    sock.connect(addr)
    conventional = cfg.actor.schedule == "conventional"
    common.freeze_heap()
    t_start = t_prev = time.time()

    # --- training loop: pull, step, send weights, log, checkpoint ---
    pending = []  # this rank's samples pulled and not yet trained
    while state.step < cfg.trainer.max_steps:
        if not conventional and weights_owed(state.step, state.sent, cfg.actor.max_lag):
            send_weights(state, server, store, cfg, wait=True)
        # Conventional RL (the paper's Algorithm 1) generates all B*G_steps samples of an RL step
        # with one policy before its first optimizer step; PipelineRL (G_steps=1) steps as soon
        # as B are here.
        steps = cfg.actor.G_steps - state.step % cfg.actor.G_steps
        t_wait = time.time()
        samples, wait_s, groups = take_batch(sock, pending, cfg.trainer.batch_size * steps,
                                             cfg.trainer.batch_size, state, cfg, addr,
                                             state.model.config.vocab_size, ledger)
        state.events.span("wait", t_wait)
        metrics = train_step(state, samples, cfg)  # trains version state.step, makes state.step + 1
        if is_main():  # the ledger's count and version move together; done before any checkpoint
            report(ledger, state, groups, [])
        # The weights go out in pipeline mode after every applied step (every sync.send_every-th:
        # forced staleness); conventional: once per RL step (G_steps steps), even when its last
        # step was skipped (the actor waits for this broadcast to start the next RL step).
        due = state.step % (cfg.actor.G_steps * cfg.sync.send_every) == 0 and (
            conventional or not metrics["step_skipped"])
        broadcast_s = send_weights(state, server, store, cfg, wait=conventional) if due else 0.0
        now = time.time()
        # busy: the time this step did not wait for samples / its wall (scripts/launch.py:
        # bottleneck)
        metrics.update(wait_s=wait_s, broadcast_s=broadcast_s,
                       samples_per_s=cfg.trainer.batch_size / (now - t_prev),
                       samples_total=state.samples, busy=1.0 - wait_s / (now - t_prev))
        t_prev = now
        if is_main():
            telemetry.log("trainer", metrics, state.step)  # every step: the figures read each one
        rundir.append_samples(cfg.run_dir, rank(), state.step, state.epoch, samples)
        if cfg.trainer.checkpoint_every and state.step % cfg.trainer.checkpoint_every == 0:
            checkpoints.save(state, cfg, tokenizer)

    # --- end: final checkpoint (unless the last step just wrote it) and summary ---
    if not (cfg.run_dir / "checkpoints" / f"step-{state.step}" / "COMPLETE").is_file():
        checkpoints.save(state, cfg, tokenizer)
    if server is not None:
        server.close("done")  # after the newest weights; the actors exit 0 on it
    state.progress.release()  # (what follows is bounded: the actors' acknowledgements, 30 s)
    if server is not None:
        # their last metrics are written once they have seen it (run.sh then stops the run)
        deadline = time.time() + 30
        while store.add("done_ack", 0) < len(server.members) and time.time() < deadline:
            time.sleep(0.1)
    if is_main():
        telemetry.log("trainer", {"done": 1, "steps": state.step, "samples_total": state.samples,
                               "wall_s": time.time() - t_start, "malformed": state.malformed},
                   state.step)
    sock.close()
    if dist.is_initialized():
        dist.destroy_process_group()

if __name__ == "__main__":
    try:
        main()
    except dist.DistNetworkError as e:  # the run's store went away: nothing to go on with
        os._exit(elastic.store_lost("trainer", e))
    # e.g. no samples: a broadcast still pending in the WeightServer's thread would make
    # interpreter teardown abort ("terminate called"): leave at once
    except SystemExit as e:
        if e.code not in (None, 0):
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr, flush=True)
            os._exit(e.code if isinstance(e.code, int) else 1)
        raise
