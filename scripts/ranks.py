"""The trainer's ranks: torchrun's environment made a process group (NCCL on GPU, gloo on CPU), and the
few collectives trainer.py and its checkpoints use. Every function works without a process group
(`python trainer.py`: one rank, each collective a no-op). A function marked "sync" is a collective:
every rank calls it, in the same order.

    init_distributed(timeout_s)   the process group and this rank's device
    rank(), world(), is_main()    this rank, the number of ranks, whether this is rank 0
    all_reduce(t, op)             in place, over all ranks
    all_max(values, device, ...)  element-wise maxima over all ranks (sync; a wait may re-arm the watchdog)
    all_gather_ints(values, dev)  every rank's list of non-negative ints, in rank order (sync)
    barrier(progress)             (sync; the wait may re-arm the watchdog)
"""
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def init_distributed(timeout_s: float = 1800.0) -> torch.device:
    """torchrun env -> the trainer's process group (NCCL on GPU, gloo on CPU) and this rank's
    device."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def all_reduce(t, op=dist.ReduceOp.SUM):
    if world() > 1:
        dist.all_reduce(t, op=op)
    return t


def all_max(values: list, device, dtype=None, progress=None) -> list:
    """The element-wise maxima of `values` over all ranks (sync: one all-reduce). With `progress`
    (this rank's watchdog timer, elastic.Progress) the wait re-arms it: a rank held here waits on
    another rank, which its own timer watches, and is not hung itself."""
    t = torch.tensor(values, dtype=dtype, device=device)
    if world() > 1:
        _wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True), progress)
    return t.tolist()


def _wait(work, progress):
    while progress is not None and not work.is_completed():
        progress.made()
        time.sleep(0.005)
    work.wait()


def all_gather_ints(values: list, device) -> list:
    """Every rank's list of non-negative ints, in rank order (sync: two all-reduces)."""
    n = all_max([len(values)], device)[0]
    # row r: rank r's values, -1 elsewhere, so that the maximum over ranks fills every row
    rows = torch.full((world(), n), -1, dtype=torch.int64, device=device)
    rows[rank(), :len(values)] = torch.tensor(values, dtype=torch.int64)
    return [[i for i in row.tolist() if i >= 0] for row in all_reduce(rows, dist.ReduceOp.MAX)]


def barrier(progress=None):
    """(sync) With `progress`, as all_max: the wait for the other ranks re-arms this rank's timer
    (rank 0 writes a checkpoint's model while the others wait here)."""
    if world() > 1:
        _wait(dist.barrier(async_op=True), progress)
