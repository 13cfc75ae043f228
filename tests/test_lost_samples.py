"""Samples lost between the verifier and the trainer ranks: no group is trained in part, and what is lost
goes back to the ledger, without a cut.

The verifier's side runs in this process: it asks a real ledger (conftest.Owner, the run's owner process)
for tickets, forwards each (its order from the ledger) and pushes the samples over a real ZMQ PUSH socket,
with a tick to every rank when it has nothing to send; two trainer ranks run trainer.take_batch and report
to the ledger as trainer.main does, in processes of their own over a real gloo group. Rank 1 drops its
connection for real: it closes its PULL socket while ZMQ holds samples queued for it, then connects a new
one. Every group trained must be trained whole, in one step; every group a sample of which never arrives
must be found lost once every rank has passed its order, given back to the ledger and granted again.

Run: .venv/bin/python -m pytest -q tests/test_lost_samples.py      (~30-60 s on 2 busy cores)
"""
import collections
import contextlib
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
import trainer  # noqa: E402
import weights_sync  # noqa: E402
from conftest import Owner, forkserver, free_port  # noqa: E402

SHARE = 4  # samples a rank trains a step, on average
G = 2  # group size
VOCAB = 64


class Recorded:
    """A real PULL socket that also notes (ticket, sample_idx, order) of every sample it hands out."""

    def __init__(self, addr, arrived):
        self.sock, self.arrived = zmq.Context.instance().socket(zmq.PULL), arrived
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)

    def poll(self, *args):
        return self.sock.poll(*args)

    def disconnect(self, addr):
        self.sock.disconnect(addr)

    def connect(self, addr):
        self.sock.connect(addr)

    def recv_multipart(self):
        frames = self.sock.recv_multipart()
        if len(frames) > 1:
            h = common.decode(frames, "sample")[0]
            self.arrived.append([h["ticket"], h["sample_idx"], h["order"]])
        return frames


def _rank(rank, world, port, tmp, overrides, samples_port, steps, epoch):
    """One trainer rank: `steps` steps of take_batch, each reported to the ledger by rank 0 (as
    trainer.main); rank 1 closes its socket with samples queued after its first step and connects a new
    one. Reports to the store (test/received/<rank>) what arrived and each step's batch."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    cfg = common.load_config(overrides)
    store = weights_sync.create_store("127.0.0.1", cfg.sync.port, False, 60)
    state = trainer.TrainState(model=None, fsdp=SimpleNamespace(device=torch.device("cpu")), epoch=epoch)
    ledger = common.LedgerClient(cfg, store) if rank == 0 else None
    addr = common.zmq_addr("127.0.0.1", samples_port)
    report = {"arrived": [], "batches": [], "queued_at_drop": False}
    sock = Recorded(addr, report["arrived"])
    store.add("test/connected", 1)
    pending = []
    for step in range(steps):
        samples, _, groups = trainer.take_batch(sock, pending, 2 * SHARE, 2 * SHARE, state, cfg, addr,
                                                VOCAB, ledger)
        report["batches"].append([[s["ticket"], s["sample_idx"]] for s in samples])
        state.step += 1
        if ledger is not None:
            trainer.report(ledger, state, groups, [])
        if rank == 1 and step == 0:
            report["queued_at_drop"] = sock.poll(30_000) != 0  # samples wait here: they go with the socket
            sock.sock.close(linger=0)
            sock = Recorded(addr, report["arrived"])
    store.set(f"test/received/{rank}", json.dumps(report))
    sock.sock.close()
    dist.destroy_process_group()


def _samples(ticket, group_id, order, verifier, epoch):
    for i in range(G):
        header = {"group_id": group_id, "sample_idx": i, "group_size": G, "task": "arithmetic", "answer": "3",
                  "finish_reason": "stop", "t_start": 0.0, "t_end": 1.0, "ticket": ticket, "epoch": epoch,
                  "eval": False, "turns": 1, "env_reward": 0.0, "reward": float(i), "status": "correct",
                  "advantage": i - 0.5,
                  "verifier": verifier, "order": order}
        arrays = {"prompt_ids": np.array([1, 2], np.int32), "completion_ids": np.array([3, 4, 5], np.int32),
                  "logprobs": np.full(3, -4.0, np.float32), "versions": np.zeros(3, np.int32)}
        yield common.encode(header, arrays)


def test_a_group_with_a_sample_lost_is_never_trained_and_goes_back_whole(tmp_path):
    """Rank 1's connection drops with samples queued for it: no group is trained in part, the ones found lost
    are given back to the ledger (none of them trained) and their ids granted again, and nothing below the
    orders every rank passed is left neither trained nor lost."""
    # (the actor here keeps its version 0: a lag budget that never runs out)
    owner = Owner(tmp_path, f"actor.group_size={G}", "trainer.nproc=2", f"trainer.batch_size={2 * SHARE}",
                  "actor.max_lag=1000")
    owner.open_epoch()
    verifier = owner.ledger.request("verifier_hello")["verifier"]
    samples_port = free_port()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.bind(common.zmq_addr("127.0.0.1", samples_port))
    forkserver()
    ranks = mp.start_processes(_rank, args=(2, free_port(), str(tmp_path), owner.overrides, samples_port, 8,
                                            owner.epoch), nprocs=2, join=False, start_method="forkserver")
    outbox, forwarded, next_order, last_sent = collections.deque(), {}, 0, time.monotonic()
    try:
        owner.store.wait(["test/connected"], timedelta(seconds=120))
        while owner.store.add("test/connected", 0) < 2:
            time.sleep(0.05)
        time.sleep(0.2)  # ZMQ attaches a connected peer's pipe a moment later
        while not ranks.join(timeout=0.005):
            for ticket, group_id in owner.tickets(4):  # as the actor asks, and the verifier forwards
                (_, order), = owner.ledger.request("forward", verifier=verifier, forward=[ticket],
                                                   drop=[])["accepted"]
                forwarded[ticket] = group_id
                outbox.extend(_samples(ticket, group_id, order, verifier, owner.epoch))
                next_order = order + 1
            while outbox and push.poll(0, zmq.POLLOUT):
                # room a moment ago, in a pipe that has gone since (the dropped rank's): the sample is lost
                # on the way, as one queued to that pipe would be
                with contextlib.suppress(zmq.Again):
                    push.send_multipart(outbox[0], zmq.NOBLOCK)
                outbox.popleft()
                last_sent = time.monotonic()
            if not outbox and time.monotonic() - last_sent > 0.2:  # nothing to send: a tick to each rank
                with contextlib.suppress(zmq.Again):  # (a full pipe: its rank has samples to read)
                    for _ in range(2):
                        push.send_multipart(common.encode({"verifier": verifier, "order": next_order}),
                                            zmq.NOBLOCK)
                last_sent = time.monotonic()
        got = {r: json.loads(owner.store.get(f"test/received/{r}")) for r in range(2)}
        journal = owner.journal()
    finally:
        push.close()
        owner.close()
    assert got[1]["queued_at_drop"], "nothing was queued for rank 1 when it closed its socket"
    # every group trained is trained whole, in one step
    steps_of, trained = collections.defaultdict(set), collections.defaultdict(list)
    for r in range(2):
        for step, batch in enumerate(got[r]["batches"]):
            for ticket, idx in batch:
                steps_of[ticket].add(step)
                trained[ticket].append(idx)
    assert all(sorted(idx) == list(range(G)) for idx in trained.values()), trained
    assert all(len(s) == 1 for s in steps_of.values()), steps_of
    assert all(sum(map(len, got[r]["batches"])) for r in range(2))  # both ranks trained
    # what arrived: the groups lost on the way never were whole, none was trained, each id came back
    arrived = collections.Counter(ticket for r in range(2) for ticket, _, _ in got[r]["arrived"])
    lost = [k for e in journal if e["event"] == "given_back" and e["why"] == "lost on the way"
            for k in e["tickets"]]
    assert lost, f"no sample was lost: {got[1]['arrived']}"
    assert all(arrived[k] < G for k in lost) and not set(lost) & set(trained)
    issued_after = collections.Counter(e["group"] for e in journal if e["event"] == "issued")
    assert all(issued_after[forwarded[k]] >= 2 for k in lost)  # granted again under another ticket
    # nothing forwarded below the lowest order both ranks passed is left neither trained nor lost
    orders = {k: o for e in journal if e["event"] == "forwarded" for k, o in e["tickets"]}
    passed = min(max(o for _, _, o in got[r]["arrived"]) for r in range(2))
    stuck = [k for k, o in orders.items() if o < passed and k not in trained and k not in lost]
    assert not stuck, stuck
