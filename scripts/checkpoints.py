"""The trainer's checkpoints: `save` writes <run.dir>/checkpoints/step-N atomically (all ranks: each
its optimizer shard, rank 0 the HF model gathered one unit at a time, config, tokenizer and
trainer_state.json; COMPLETE last, then a rename), `restore` reads one back into a TrainState. What a
trainer may resume from is scripts/rundir.py's `latest_checkpoint`.

    prune_done(state)               done_below moved past the ids done (what trainer_state.json keeps)
    save(state, cfg, tokenizer)     all ranks; -> the checkpoint's directory
    restore(state, ckpt)            all ranks, right after the model is sharded
"""
import json
import os
import shutil
import time
from pathlib import Path

import torch

from scripts import rundir
from scripts.ranks import barrier, is_main, rank, world


def _fsync(path):  # files and directories alike
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def prune_done(state):
    """Move done_below past the ids done, keeping done_ids to the ids above it."""
    while state.done_below in state.done_ids:
        state.done_ids.discard(state.done_below)
        state.done_below += 1


def save(state, cfg, tokenizer=None) -> Path:
    """Atomic: everything goes into .tmp-step-N; COMPLETE is written last, then the directory is
    renamed."""
    from safetensors.torch import save_file
    prune_done(state)  # rank 0's: a resumed trainer's ledger grants the others again first
    root = cfg.run_dir / "checkpoints"
    final, tmp = root / f"step-{state.step}", root / f".tmp-step-{state.step}"
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(state.progress)  # sync: the directory exists before any rank writes into it
    optim = tmp / f"optim-rank{rank()}.pt"
    rng = {"rng_cuda": torch.cuda.get_rng_state()} if state.fsdp.device.type == "cuda" else {}
    torch.save({**state.fsdp.state_dict(), "rng_cpu": torch.get_rng_state(), **rng,
                "step": state.step}, optim)
    _fsync(optim)
    # The model: HF sharded safetensors, one file per unit, gathered one unit at a time (all ranks
    # join).
    weight_map, total = {}, 0
    for i, tensors in enumerate(state.fsdp.full_units(torch.float32)):
        state.progress.made()
        if is_main():
            fname = f"model-{i + 1:05d}-of-{len(state.fsdp.units):05d}.safetensors"
            save_file({n: t.detach().cpu().clone() for n, t in tensors.items()}, tmp / fname,
                      metadata={"format": "pt"})
            weight_map.update({n: fname for n in tensors})
            total += sum(t.nbytes for t in tensors.values())
    if is_main():
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        state.model.config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "trainer_state.json").write_text(json.dumps(
            {"step": state.step, "version": state.step, "done_below": state.done_below,
             "done_above": sorted(state.done_ids),
             "samples": state.samples, "skipped": state.skipped, "world_size": world(),
             "epoch": state.epoch,
             "time": time.time()}))
    barrier(state.progress)  # sync: every rank's optimizer shard is on disk before COMPLETE
    if is_main():
        for f in tmp.iterdir():
            _fsync(f)
        (tmp / "COMPLETE").write_text("ok\n")
        _fsync(tmp / "COMPLETE")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        _fsync(root)
        for d in rundir.complete_checkpoints(root)[:-cfg.trainer.keep_checkpoints]:
            shutil.rmtree(d, ignore_errors=True)
    barrier(state.progress)  # sync: nobody reads checkpoints or exits before the rename
    return final


def restore(state, ckpt):
    """On resume: this rank's optimizer shard (all ranks' re-cut when their number changed), its
    random stream (the same ranks only) and the counters, from checkpoint directory `ckpt`."""
    meta = json.loads((Path(ckpt) / "trainer_state.json").read_text())
    ranks = [rank()] if meta["world_size"] == world() else range(meta["world_size"])
    sds = [torch.load(Path(ckpt) / f"optim-rank{r}.pt", weights_only=True) for r in ranks]
    state.fsdp.load_state_dict(sds)
    if meta["world_size"] == world():  # same ranks: each continues its own random stream
        torch.set_rng_state(sds[0]["rng_cpu"])
        if state.fsdp.device.type == "cuda":
            torch.cuda.set_rng_state(sds[0]["rng_cuda"])
    for key in ("step", "samples", "skipped", "epoch", "done_below"):  # saved under their names
        setattr(state, key, meta[key])
    state.done_ids = set(meta["done_above"])
