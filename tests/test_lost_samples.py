"""Samples lost between the verifier and the trainer ranks: no group is trained in part, and what is lost goes
back to its actor's budget.

The verifier's side (verifier.State and complete, which number each actor incarnation's samples) runs in this
process with a real ZMQ PUSH socket; two trainer ranks run trainer.take_batch and trainer.settle in processes of
their own over a real gloo group; the store is a real TCPStore. Rank 1 drops its connection for real: it closes
its PULL socket while ZMQ holds samples queued for it, then connects a new one. Every group trained must be
trained whole, in one step; a group a sample of which never arrives must be dropped whole and given back, and a
group none of whose samples arrives given back, each to its own actor incarnation (store keys dropped/<inc>/<cut>),
exactly when every rank has received a later sample of that incarnation (elastic.whole_groups).

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

SHARE = 4  # samples a rank trains a step, on average
G = 2  # group size
PROCS = 3  # actor incarnations the groups come from: 1, 2, 3
CUT = 1  # every sample's cut, and the trainer's (trainer.take_batch)
VOCAB = 64


def make_cfg(tmp, store_port, samples_port):
    over = {"run.dir": tmp, "sync.port": store_port, "ports.samples": samples_port, "run.peer_timeout_s": 60,
            "actor.group_size": G, "trainer.nproc": 2, "trainer.batch_size": 2 * SHARE}
    return common.load_config([f"{k}={v}" for k, v in over.items()])


class Recorded:
    """A real PULL socket that also notes (inc, group_id, sample_idx, seq, order) of every sample it hands out."""

    def __init__(self, addr, arrived):
        self.sock, self.arrived = zmq.Context.instance().socket(zmq.PULL), arrived
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)

    def poll(self, *args):
        return self.sock.poll(*args)

    def recv_multipart(self):
        frames = self.sock.recv_multipart()
        h = common.decode(frames, "sample")[0]
        self.arrived.append([h["inc"], h["group_id"], h["sample_idx"], h["seq"], h["order"]])
        return frames


def _rank(rank, world, port, tmp, store_port, samples_port, run, steps, drop_rank):
    """One trainer rank: `steps` steps of take_batch + settle (as trainer.main); rank `drop_rank` closes its
    socket with samples queued after its first step and connects a new one. Reports to the store
    (test/received/<run>/<rank>) what arrived and each step's batch."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    cfg = make_cfg(tmp, store_port, samples_port)
    store = weights_sync.create_store("127.0.0.1", store_port, False, 60)
    state = trainer.TrainState(model=None, fsdp=SimpleNamespace(device=torch.device("cpu")))
    addr = common.zmq_addr("127.0.0.1", samples_port)
    report = {"arrived": [], "batches": [], "queued_at_drop": False}
    sock = Recorded(addr, report["arrived"])
    store.add(f"test/connected/{run}", 1)
    books = elastic.Ledger(store, Path(tmp), state) if rank == 0 else None
    if books is not None:
        books.cut = CUT
    pending = []
    for step in range(steps):
        samples, _ = trainer.take_batch(sock, pending, 2 * SHARE, 2 * SHARE, state, cfg, addr, VOCAB,
                                        lambda: (set(range(1, PROCS + 1)), CUT), lambda: None, books)
        report["batches"].append([[s["inc"], s["group_id"], s["sample_idx"]] for s in samples])
        if rank == drop_rank and step == 0:
            report["queued_at_drop"] = sock.poll(30_000) != 0  # more samples wait here: they go with the socket
            sock.sock.close(linger=0)
            sock = Recorded(addr, report["arrived"])
        trainer.settle(state, samples, books)
    store.set(f"test/received/{run}/{rank}", json.dumps(report))
    sock.sock.close()
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
    state.open[key] = {"size": G, "t0": 0.0, "stream": (inc, CUT), "seen": {0, 1}, "scored": scored}
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


def test_a_group_with_a_sample_lost_is_never_trained_and_goes_back_whole(tmp_path):
    """Rank 1's connection drops with samples queued for it. Before, the rest of such a group was trained in
    part (and a group split over two steps could be cut by a checkpoint); now no group is trained in part, the
    ones judged lost are exactly those past every rank's watermark, and each goes back whole, once."""
    store = weights_sync.create_store("127.0.0.1", 0, True, 60)  # trainer rank 0's, in the test: it outlives runs
    samples_port = free_port()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.bind(common.zmq_addr("127.0.0.1", samples_port))
    vs = verifier.State(make_cfg(tmp_path, store.port, samples_port), store)
    try:
        got = _run_trainer(vs, push, store, tmp_path, samples_port, 1, steps=8, drop_rank=1,
                           groups=itertools.count())
    finally:
        push.close()
    assert got[1]["queued_at_drop"], "nothing was queued for rank 1 when it closed its socket"
    # every group trained is trained whole, in one step
    steps_of, trained = collections.defaultdict(set), collections.defaultdict(list)
    for r in range(2):
        for step, batch in enumerate(got[r]["batches"]):
            for inc, gid, idx in batch:
                steps_of[inc, gid].add(step)
                trained[inc, gid].append(idx)
    assert all(sorted(idx) == list(range(G)) for idx in trained.values()), trained
    assert all(len(s) == 1 for s in steps_of.values()), steps_of
    assert all(sum(map(len, got[r]["batches"])) for r in range(2))  # both ranks trained
    # what arrived, and the watermark the ranks judged by at last: the lowest of the ranks' highest order
    # received (one verifier here)
    arrived, top, firsts, blocks = collections.defaultdict(set), [-1, -1], {}, collections.defaultdict(set)
    for r in range(2):
        for inc, gid, idx, seq, order in got[r]["arrived"]:
            arrived[inc, gid].add(idx)
            top[r] = max(top[r], order)
            firsts[inc, gid] = order - seq % G
            blocks[inc].add(seq // G)
    judged = {key for key, idx in arrived.items() if len(idx) < G and firsts[key] + G - 1 <= min(top)}
    records = [json.loads(line) for line in (tmp_path / "groups_dropped.jsonl").read_text().splitlines()] \
        if (tmp_path / "groups_dropped.jsonl").exists() else []
    dropped = {(d["inc"], d["group_id"]) for d in records}
    assert judged, f"no sample was lost: {got[1]['arrived']}"
    assert dropped == judged and all(d["reason"] == "lost on the way" for d in records)
    assert not dropped & set(trained)
    # given back: G for each group dropped, and G for each block nothing of which arrived (a group lost whole:
    # round-robin over two ranks makes that rare; the by-hand test below has one)
    for inc in range(1, PROCS + 1):
        mine, back = sum(key[0] == inc for key in dropped), int(store.add(f"dropped/{inc}/{CUT}", 0))
        never = [b for b in range(max(blocks[inc], default=-1)) if b not in blocks[inc]]
        assert back - G * mine in range(0, G * len(never) + 1, G), (inc, mine, back, never)


def _held(inc, gid, idx, seq, order, verifier=1):
    return {"inc": inc, "group_id": gid, "sample_idx": idx, "seq": seq, "verifier": verifier, "order": order}


def test_whole_groups_and_the_books_by_hand(tmp_path):
    """elastic.whole_groups and Ledger.held on two ranks' tables, by hand: whole groups go in the verifier's
    order; a group is judged lost only once every rank has received a sample sent after its last, then dropped
    whole (recorded) and given back once; a block of seqs nothing of which arrived, below a group every rank
    has passed, is given back and owes a cut (its id is not known here)."""
    store = weights_sync.create_store("127.0.0.1", 0, True, 60)
    books = elastic.Ledger(store, tmp_path, None)
    books.cut = CUT
    # the verifier sent (order: inc, group, idx, seq): 0-1: 2/20 (seqs 0, 1); 2-3: 1/9 (seqs 0, 1; lost
    # whole); 4-5: 1/10 (2, 3); 6-7: 1/11 (4, 5); 8-9: 1/12 (6, 7); rank 1 has passed order 8, rank 0 order 9
    rank0 = [_held(2, 20, 0, 0, 0), _held(2, 20, 1, 1, 1), _held(1, 10, 0, 2, 4), _held(1, 11, 0, 4, 6),
             _held(1, 12, 1, 7, 9)]
    rank1 = [_held(1, 10, 1, 3, 5), _held(1, 12, 0, 6, 8)]
    tables = [elastic.group_table(rank0, {1: 9}, G), elastic.group_table(rank1, {1: 8}, G)]
    whole, lost, held, watermark = elastic.whole_groups(tables, G)
    assert whole == [(2, 20), (1, 10), (1, 12)]  # the order the verifier sent them
    assert lost == [(1, 11)] and watermark == {1: 8}  # 11's other sample (order 7) never arrives
    books.held(held, watermark, lost, G)
    assert int(store.add(f"dropped/1/{CUT}", 0)) == 2 + 2  # group 11, and block 0 (group 9)
    assert [json.loads(x)["group_id"] for x in (tmp_path / "groups_dropped.jsonl").read_text().splitlines()] == [11]
    assert books.recut  # group 9's id: a cut generates it again
    books.held(held, watermark, [], G)  # the next look: nothing given back twice
    assert int(store.add(f"dropped/1/{CUT}", 0)) == 4 and int(store.add(f"dropped/2/{CUT}", 0)) == 0
    # a rank with nothing of a verifier yet: nothing is judged
    tables[1] = elastic.group_table(rank1, {}, G)
    assert elastic.whole_groups(tables, G)[1:4:2] == ([], {1: -1})


def test_a_restarted_verifiers_numbering_is_not_judged_against_the_old_ones(tmp_path):
    """The verifier restarts: the new one numbers its samples from 0 again (seq and order), and the trainer
    may hold some of them before the cut the restart causes. Judged against the old verifier's numbers, its
    groups would be lost (dropped for good while they arrive) and seqs in between given back: the actors
    admitted past max_lag until the cut. Each verifier's samples are judged by its own numbers, and its
    groups follow the old one's."""
    store = weights_sync.create_store("127.0.0.1", 0, True, 60)
    books = elastic.Ledger(store, tmp_path, None)
    books.cut = CUT
    # the old verifier's group 50 (orders 90, 91), one sample on each rank; the new one's group 60 has its
    # first sample (order 0) on rank 0, its second is on its way: rank 1 has nothing of the new verifier yet
    rank0, rank1 = [_held(1, 50, 0, 0, 90), _held(1, 60, 0, 0, 0, verifier=2)], [_held(1, 50, 1, 1, 91)]
    tables = [elastic.group_table(rank0, {1: 90, 2: 0}, G), elastic.group_table(rank1, {1: 91}, G)]
    whole, lost, held, watermark = elastic.whole_groups(tables, G)
    assert whole == [(1, 50)] and lost == [] and watermark == {1: 90, 2: -1}
    books.held(held, watermark, lost, G)
    assert int(store.add(f"dropped/1/{CUT}", 0)) == 0 and not books.recut
    late = [_held(1, 70, i, 60 + i, 200 + i) for i in range(G)] + [_held(1, 71, i, i, i, verifier=2) for i in range(G)]
    assert elastic.whole_groups([elastic.group_table(late, {1: 201, 2: 1}, G)], G)[0] == [(1, 70), (1, 71)]
