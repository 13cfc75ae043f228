"""What the elastic weight group costs (docs/DESIGN.md, "The fault layer"), with 1, 2 and 4 actors: plain gloo
processes on this machine stand for the actors' workers (no vLLM), the embedded model's 4.2 MB of weights (or
--mb) are the update.

    .venv/bin/python bench/bench_regroup.py [--actors 1 2 4] [--mb 4.2] [--reps 20]

Per number of actors n, medians of --reps:
  regroup   forming a new weight group of rank 0 and n members (weights_sync.init_group: the store
            meeting and the bounded first broadcast), what a loss or a return costs once;
  update    one update broadcast to the n members of one group (weights_sync.WeightSender), what this
            layout costs per update, every update;
  per-actor the same update sent over n groups of two (rank 0 and one member each), one after the
            other: the layout that a member's loss could not break, for comparison.
Not a test: the numbers depend on the machine and on what else runs on it (2 cores here: 4 receivers
share them with the sender).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
import weights_sync as ws  # noqa: E402
from conftest import free_port, receive_weights  # noqa: E402


def tensors(mb):
    n = int(mb * 2**20 / 4)
    return [("w", torch.randn(n - 1024)), ("b", torch.randn(1024))]


def member(k, n, port, reps, mb):
    """Member k of n: meets in every group rank 0 forms, receives every update."""
    torch.set_num_threads(1)
    store = ws.create_store("127.0.0.1", port, False, 120)
    for rep in range(reps):
        pg = ws.init_group(store, 1 + k, 1 + n, "gloo", 120, f"all/{rep}")  # regroup
        for _ in range(2):
            receive_weights(pg)  # update
        pg.shutdown()
    pgs = [ws.init_group(store, 1, 2, "gloo", 120, f"pair/{k}")]  # per-actor layout
    for _ in range(reps):
        receive_weights(pgs[0])


def run(n, reps, mb):
    store = ws.create_store("127.0.0.1", 0, True, 120)
    procs = [mp.get_context("spawn").Process(target=member, args=(k, n, store.port, reps, mb)) for k in range(n)]
    for p in procs:
        p.start()
    named = tensors(mb)
    manifest = [(name, tuple(t.shape), t.dtype) for name, t in named]
    regroup, update, per_actor = [], [], []
    for rep in range(reps):
        t0 = time.perf_counter()
        pg = ws.init_group(store, 0, 1 + n, "gloo", 120, f"all/{rep}")
        regroup.append(time.perf_counter() - t0)
        sender = ws.WeightSender(store, pg, 32)
        for _ in range(2):  # the first after a new group warms its connections
            t0 = time.perf_counter()
            sender.send(rep, iter(named), manifest)
        update.append(time.perf_counter() - t0)
        pg.shutdown()
    pairs = [ws.WeightSender(store, ws.init_group(store, 0, 2, "gloo", 120, f"pair/{k}"), 32) for k in range(n)]
    for rep in range(reps):
        t0 = time.perf_counter()
        for sender in pairs:
            sender.send(rep, iter(named), manifest)
        per_actor.append(time.perf_counter() - t0)
    for p in procs:
        p.join()
    return [statistics.median(x) * 1e3 for x in (regroup, update, per_actor)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--mb", type=float, default=4.2)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{args.mb} MB of weights, medians of {args.reps}, gloo on this machine's loopback")
    for n in args.actors:
        regroup, update, per_actor = run(n, args.reps, args.mb)
        print(f"  {n} actor(s): regroup {regroup:.1f} ms (once per loss or return); update {update:.1f} ms "
              f"in one group; {per_actor:.1f} ms over {n} group(s) of two", flush=True)


if __name__ == "__main__":
    main()
