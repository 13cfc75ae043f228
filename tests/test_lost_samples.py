"""Samples lost between the verifier and the trainer ranks go back to their actors' budgets (issue 30, item 5).

The verifier's side (verifier.State and complete, which number each actor process's samples) runs in this
process with a real ZMQ PUSH socket; two trainer ranks run trainer.take_batch and trainer.settle in
processes of their own over a real gloo group; the store is a real TCPStore. Rank 1 drops its connection for
real: it closes its PULL socket while ZMQ holds samples queued for it, then connects a new one. What never
arrived must be given back exactly, each to its own actor incarnation (store keys dropped/<inc>/<cut>), nothing that
arrived may be, and a restarted trainer must not give back what was sent before it started.

Run: .venv/bin/python -m pytest -q tests/test_lost_samples.py      (~20-40 s on 2 busy cores)
"""
import collections
import itertools
import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import zmq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import common  # noqa: E402
import elastic  # noqa: E402
import trainer  # noqa: E402
import verifier  # noqa: E402
import weights_sync  # noqa: E402
from conftest import forkserver, free_port  # noqa: E402

SHARE = 4  # samples a rank pulls per step
PROCS = 3  # actor incarnations the groups come from: 1, 2, 3
CUT = 1  # every sample's cut, and the trainer's (trainer.take_batch)
VOCAB = 64


def make_cfg(tmp, store_port, samples_port):
    over = {"run.dir": tmp, "sync.port": store_port, "ports.samples": samples_port, "run.peer_timeout_s": 60,
            "actor.group_size": 2, "trainer.nproc": 2, "trainer.batch_size": 2 * SHARE}
    return common.load_config([f"{k}={v}" for k, v in over.items()])


def _pull_socket(addr):
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


def _rank(rank, world, port, tmp, store_port, samples_port, run, steps, drop_rank):
    """One trainer rank: `steps` steps of take_batch + settle (as trainer.main: settle after each step);
    rank `drop_rank` closes its socket with samples queued after its first pull and connects a new one. Then
    one more pull that is never settled (a trainer stopped between a pull and its settle). Reports to the store
    (test/received/<run>/<rank>) the (inc, seq) pairs it received, settled and not."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    cfg = make_cfg(tmp, store_port, samples_port)
    store = weights_sync.create_store("127.0.0.1", store_port, False, 60)
    state = trainer.TrainState(model=None, fsdp=SimpleNamespace(device=torch.device("cpu")))
    addr = common.zmq_addr("127.0.0.1", samples_port)
    sock = _pull_socket(addr)
    store.add(f"test/connected/{run}", 1)
    report = {"settled": [], "unsettled": [], "queued_at_drop": False}
    books = elastic.Ledger(store, world, state) if rank == 0 else None
    if books is not None:
        books.cut = CUT
    pending = []
    for step in range(steps + 1):
        samples, _ = trainer.take_batch(sock, pending, SHARE, SHARE, state, cfg, addr, VOCAB,
                                        lambda: (set(range(1, PROCS + 1)), CUT), lambda: None)
        report["settled" if step < steps else "unsettled"] += [[s["inc"], s["seq"]] for s in samples]
        if rank == drop_rank and step == 0:
            report["queued_at_drop"] = sock.poll(30_000) != 0  # more samples wait here: they go with the socket
            sock.close(linger=0)
            sock = _pull_socket(addr)
        if step < steps:
            trainer.settle(state, samples, books)
    store.set(f"test/received/{run}/{rank}", json.dumps(report))
    sock.close()
    dist.destroy_process_group()


def _group(state, group_id, inc):
    """A complete, scored group of 2 from actor incarnation `inc` -> verifier.complete numbers and encodes
    its samples."""
    key, scored = (False, group_id), {}
    for i in range(2):
        header = {"group_id": group_id, "sample_idx": i, "group_size": 2, "task": "arithmetic", "answer": "3",
                  "finish_reason": "stop", "t_start": 0.0, "t_end": 1.0, "inc": inc, "cut": CUT,
                  "eval": False,
                  "reward": float(i), "status": "correct"}
        arrays = {"prompt_ids": np.array([1, 2], np.int32), "completion_ids": np.array([3, 4, 5], np.int32),
                  "logprobs": np.full(3, -4.0, np.float32), "versions": np.zeros(3, np.int32)}
        scored[i] = (header, arrays)
    state.open[key] = {"size": 2, "t0": 0.0, "stream": (inc, CUT), "seen": {0, 1}, "scored": scored}
    verifier.complete(state, key)


def _run_trainer(vs, push, store, tmp, samples_port, run, steps, drop_rank, groups):
    """Start two trainer ranks and play the verifier until they exit: a group every 20 ms once both ranks are
    connected (round-robin deals to both; 12 at once first), the outbox pushed. -> {rank: its report}."""
    forkserver()
    ranks = mp.start_processes(_rank, args=(2, free_port(), str(tmp), store.port, samples_port, run, steps,
                                            drop_rank), nprocs=2, join=False, start_method="forkserver")
    store.wait([f"test/connected/{run}"], timedelta(seconds=120))
    while store.add(f"test/connected/{run}", 0) < 2:
        time.sleep(0.05)
    time.sleep(0.2)  # ZMQ attaches a connected peer's pipe a moment later
    next_group = 0.0
    for _ in range(12):  # a head start: samples queue up for each rank
        gid = next(groups)
        _group(vs, group_id=gid, inc=gid % PROCS + 1)
    while not ranks.join(timeout=0.005):
        if time.monotonic() >= next_group:
            gid = next(groups)
            _group(vs, group_id=gid, inc=gid % PROCS + 1)
            next_group = time.monotonic() + 0.02
        while vs.outbox and push.poll(0, zmq.POLLOUT):
            push.send_multipart(vs.outbox.popleft(), zmq.NOBLOCK)
    return {r: json.loads(store.get(f"test/received/{run}/{r}")) for r in range(2)}


def _settled_view(got):
    """Per actor incarnation, what the trainer's books (elastic.Ledger.settle) saw: the seqs received in settled steps, and the
    watermark (the lowest of the two ranks' highest settled seq of that process)."""
    received, top = collections.defaultdict(set), collections.defaultdict(lambda: [-1, -1])
    for r in range(2):
        for proc, seq in got[r]["settled"]:
            received[proc].add(seq)
            top[proc][r] = max(top[proc][r], seq)
    return received, {proc: min(t) for proc, t in top.items()}


def test_samples_lost_with_a_dropped_connection_are_given_back(tmp_path):
    store = weights_sync.create_store("127.0.0.1", 0, True, 60)  # trainer rank 0's, in the test: it outlives runs
    samples_port = free_port()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.bind(common.zmq_addr("127.0.0.1", samples_port))
    vs = verifier.State(make_cfg(tmp_path, store.port, samples_port), store)
    groups = itertools.count()
    dropped = lambda: [int(store.add(f"dropped/{p}/{CUT}", 0)) for p in range(1, PROCS + 1)]  # noqa: E731
    try:
        # --- run 1: rank 1's connection drops with samples queued for it ---
        got = _run_trainer(vs, push, store, tmp_path, samples_port, 1, steps=6, drop_rank=1, groups=groups)
        assert got[1]["queued_at_drop"], "nothing was queued for rank 1 when it closed its socket"
        arrived = {tuple(x) for r in range(2) for key in ("settled", "unsettled") for x in got[r][key]}
        received, watermark = _settled_view(got)
        # never arrived, and judged: below the process's watermark, from its first seq received
        lost = {proc: set(range(min(seqs), watermark[proc])) - seqs for proc, seqs in received.items()}
        assert sum(map(len, lost.values())), f"no sample was lost: {sorted(arrived)}"
        assert not [(p, s) for p, seqs in lost.items() for s in seqs if (p, s) in arrived]  # FIFO: truly lost
        # exactly the lost ones went back, each to its own actor process; nothing that arrived did
        assert dropped() == [len(lost.get(p, ())) for p in range(1, PROCS + 1)], (lost, dropped())

        # --- run 2: a restarted trainer (new ranks, new group) judges only from its first sample of each
        # process: what was sent before it (including what run 1 pulled last and never settled, and what was
        # still queued for run 1's ranks when they exited) is not given back ---
        after_run1 = dropped()
        assert any(got[r]["unsettled"] for r in range(2))
        got = _run_trainer(vs, push, store, tmp_path, samples_port, 2, steps=3, drop_rank=-1, groups=groups)
        received2, watermark2 = _settled_view(got)
        assert all(watermark2[p] > watermark[p] for p in received)  # run 2 settled past run 1's samples ...
        assert dropped() == after_run1  # ... and gave none back
    finally:
        push.close()


def test_settle_judges_each_process_from_its_first_seq_received(tmp_path):
    """elastic.Ledger.settle on one rank, by hand: each actor process's samples are
    judged from the first seq received of that process (an earlier trainer's are not this one's to judge),
    each later time from the last watermark; a gap is given back once, to its own process."""
    store = weights_sync.create_store("127.0.0.1", 0, True, 60)
    books = elastic.Ledger(store, 1, None)
    books.cut = CUT
    dropped = lambda: [int(store.add(f"dropped/{p}/{CUT}", 0)) for p in range(PROCS)]  # noqa: E731

    def settle(*pairs):
        books.settle([(0, p, s) for p, s in pairs])
    settle((0, 10), (0, 12), (0, 13), (1, 5))  # 0-9 of process 0, 0-4 of process 1: sent before this trainer
    assert dropped() == [1, 0, 0]  # process 0's 11
    settle((0, 16), (1, 8), (0, 17))
    assert dropped() == [3, 2, 0]  # 14, 15 of process 0; 6, 7 of process 1
    settle((0, 18), (2, 40))
    assert dropped() == [3, 2, 0]  # nothing twice; process 2's first sample: nothing before it judged


def test_a_restarted_verifiers_numbering_is_not_judged_against_the_old_ones(tmp_path):
    """The verifier restarts: the new one numbers its samples from 0 again, and the trainer may settle some
    of them before the cut the restart causes. Judged against the old verifier's numbers, every seq between
    them counted lost: samples given back that were trained or still on their way, and the actors admitted
    past max_lag until the cut. The new verifier registers before it sends any sample: once its
    incarnation is in the store, the books judge nothing until the cut starts them afresh."""
    store = weights_sync.create_store("127.0.0.1", 0, True, 60)
    books = elastic.Ledger(store, 1, SimpleNamespace(trained_below=0, trained_ids=set()))
    old = elastic.register_verifier(store)
    books.start_cut(CUT, 0, verifier=old)
    dropped = lambda: int(store.add(f"dropped/0/{CUT}", 0))  # noqa: E731
    books.settle([(0, 0, s) for s in range(10)])
    assert dropped() == 0
    elastic.register_verifier(store)  # the new verifier, then its samples 0..3
    books.settle([(0, 0, s) for s in range(4)])
    assert dropped() == 0
