"""weights_sync.py with plain gloo processes (no vLLM): layout, bucketed broadcast, header, manifest checks.

Run: .venv/bin/python -m pytest -q tests/test_weights_sync.py      (~15 s on 2 cores)
"""
import json
import os
import sys
import traceback

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import weights_sync as ws  # noqa: E402
from conftest import forkserver, free_port, receive_weights  # noqa: E402

BUCKET_MB = 16 / 1024  # 16 KiB buckets: many buckets, and the 40 KB tensor gets its own


def _tensors(version):
    """Mixed dtypes and shapes, incl. a 0-d tensor and one larger than a bucket; values depend on version."""
    g = torch.Generator().manual_seed(version)
    return [("embed.weight", torch.randn(10_000, generator=g)),  # 40 KB > one 16 KiB bucket
            ("a.weight", torch.randn(3, 5, generator=g)),
            ("b.weight", torch.randn(257, 3, generator=g).to(torch.bfloat16)),
            ("c.scale", torch.randn((), generator=g).to(torch.float16)),
            ("d.ids", torch.randint(0, 1000, (2, 7), generator=g)),
            ("e.weight", torch.randn(1500, generator=g)),
            ("lm_head.weight", torch.randn(16, 16, generator=g).to(torch.bfloat16))]


def _manifest(tensors):
    return [(n, tuple(t.shape), t.dtype) for n, t in tensors]


def _expected(tensors):
    """The receiver's side of the manifest, as checkpoint_manifest gives it: name -> (shape, dtype name)."""
    return {n: (list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors}


def _reusing_iterator(tensors):
    """Like a trainer that double-buffers its gathers: tensor i's storage is overwritten by yield i+2
    (the sender's contract: a yielded tensor survives the next yield)."""
    size = max(t.numel() * t.element_size() for _, t in tensors)
    scratch = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
    for i, (name, t) in enumerate(tensors):
        buf = scratch[i % 2]
        buf.fill_(0xFF)  # overwrite what was yielded two steps ago
        view = buf[:t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        yield name, view


def _run_rank(rank, world, port, scenario, q):
    try:
        torch.set_num_threads(1)
        store = ws.create_store("127.0.0.1", port, rank == 0, 30)
        pg = ws.init_group(store, rank, world, "gloo", 30)
        if rank == 0:
            sender = ws.WeightSender(store, pg, BUCKET_MB)
            for v in (3, 4):
                tensors = _tensors(v)
                sender.send(v, _reusing_iterator(tensors), _manifest(tensors))
            q.put((rank, "ok"))
            return
        if scenario == "roundtrip":
            out = []
            for v in (3, 4):
                version, got = receive_weights(pg, _expected(_tensors(0)))
                out.append((version, {n: (t.dtype, bool(torch.equal(t, ref))) for (n, ref), t in
                                      zip(_tensors(v), got.values())}, list(got)))
            q.put((rank, out))
        elif scenario == "header":
            n = torch.zeros(1, dtype=torch.int64)
            pg.broadcast(n, 0).wait()
            raw = torch.empty(int(n.item()), dtype=torch.uint8)
            pg.broadcast(raw, 0).wait()
            header = json.loads(bytes(raw.numpy()).decode("utf-8"))
            for _ in ws.iter_tensors(pg, header):  # the buckets of version 3
                pass
            version, _ = receive_weights(pg)
            q.put((rank, (bytes(raw.numpy()[:1]), header, version)))
        elif scenario == "mismatch":
            bad = _expected(_tensors(0))
            bad["a.weight"] = ([5, 3], "float32")
            bad["b.renamed"] = bad.pop("b.weight")
            try:
                receive_weights(pg, bad)
                err = None
            except ws.ManifestError as e:
                err = str(e)
            version, got = receive_weights(pg, _expected(_tensors(0)))  # the group is still in step
            q.put((rank, (err, version, torch.equal(got["e.weight"], _tensors(4)[5][1]))))
    except Exception:  # pragma: no cover - reported to the test
        q.put((rank, traceback.format_exc()))


def _spawn(scenario, world=3):
    ctx = forkserver()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_run_rank, args=(r, world, port, scenario, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    for r, res in results.items():
        assert not (isinstance(res, str) and "Traceback" in res), f"rank {r}:\n{res}"
    return results


def test_bucket_layout():
    tensors = _tensors(0)
    entries, sizes = ws.bucket_layout(_manifest(tensors), int(BUCKET_MB * 2**20))
    assert entries[0]["bucket"] == 0 and sizes[0] == 40_000  # larger than a bucket: its own
    assert [e["own"] for e in entries] == [True, False, False, False, False, True, False]  # >= 1/8 bucket
    assert all(e["offset"] % 64 == 0 for e in entries)
    assert all(sizes[e["bucket"]] >= e["offset"] + e["nbytes"] for e in entries)
    assert all(s <= 16 * 1024 for i, s in enumerate(sizes) if i > 0)
    assert len(sizes) < len(entries)  # small tensors share buckets: not one collective per tensor
    assert [e["bucket"] for e in entries] == sorted(e["bucket"] for e in entries)


def test_bucketed_roundtrip_two_receivers():
    results = _spawn("roundtrip")
    assert results[0] == "ok"
    for rank in (1, 2):
        for (version, checks, names), v in zip(results[rank], (3, 4)):
            assert version == v
            assert names == [n for n, _ in _tensors(0)]
            assert all(equal for _, equal in checks.values()), checks
            assert checks["b.weight"][0] == torch.bfloat16 and checks["d.ids"][0] == torch.int64


def test_header_is_json_not_pickle():
    results = _spawn("header", world=2)
    first_byte, header, next_version = results[1]
    assert first_byte == b"{"  # JSON object; a pickle would start with b"\x80"
    assert header["version"] == 3 and next_version == 4
    assert [t["name"] for t in header["tensors"]] == [n for n, _ in _tensors(3)]
    assert {"bucket", "offset", "shape", "dtype"} <= set(header["tensors"][0])
    assert sum(header["buckets"]) >= sum(t.numel() * t.element_size() for _, t in _tensors(3))


def test_manifest_mismatch_names_tensors_and_keeps_group_in_step():
    results = _spawn("mismatch", world=2)
    err, version, equal = results[1]
    assert err is not None and "a.weight" in err and "b.renamed" in err and "b.weight" in err
    assert "shape [3, 5]" in err
    assert version == 4 and equal


def test_sender_checks_iterator_against_manifest():
    store = ws.create_store("127.0.0.1", free_port(), True, 10)
    pg = ws.init_group(store, 0, 1, "gloo", 10)  # a one-rank group: broadcasts are local
    assert store.add("announced", 0) == 0
    tensors = _tensors(0)
    sender = ws.WeightSender(store, pg, BUCKET_MB)
    sender.send(7, iter(tensors), _manifest(tensors))
    assert store.add("announced", 0) == 1 and store.get("announce/1") == b"7"  # what the actor blocks on
    swapped = [tensors[1], tensors[0]] + tensors[2:]
    with pytest.raises(ws.ManifestError, match="a.weight"):
        sender.send(8, iter(swapped), _manifest(tensors))
    with pytest.raises(ws.ManifestError, match="more tensors"):
        sender.send(9, iter(tensors + tensors[:1]), _manifest(tensors))



def test_store_listens_on_its_host_only():
    """The trainer's TCPStore (nothing authenticates its peers) listens on sync.host alone: 127.0.0.1 on
    a single node, not every interface."""
    import psutil
    store = ws.create_store("127.0.0.1", 0, True, 10)
    listening = {c.laddr.ip for c in psutil.net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port}
    assert listening == {"127.0.0.1"}, listening
    client = ws.create_store("127.0.0.1", store.port, False, 10)
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_the_first_broadcast_of_a_new_group_is_bounded_and_named():
    """init_group ends with a first broadcast, bounded by timeout_s: NCCL builds its communicator there,
    beyond blocking wait's reach, so a member that met in the store but never takes part (here: rank 1
    builds its group and stops) hung the trainer's first send and the actor's first update for ever,
    silently. The error names the weight group and its store."""
    import datetime
    import threading
    import torch.distributed as dist
    store = ws.create_store("127.0.0.1", 0, True, 30)
    # a connection of its own: a client holds its lock across a blocking wait
    prefix = dist.PrefixStore("weights", ws.create_store("127.0.0.1", store.port, False, 30))
    kept = []  # rank 1's group stays up, silent

    def silent():
        prefix.set("joined/1", "1")
        kept.append(dist.ProcessGroupGloo(prefix, 1, 2, datetime.timedelta(seconds=30)))
    threading.Thread(target=silent, daemon=True).start()
    with pytest.raises(RuntimeError) as err:
        ws.init_group(store, 0, 2, "gloo", timeout_s=3)
    assert "the weight roster's first broadcast (rank 0 of 2" in str(err.value)
    assert f"store at 127.0.0.1:{store.port}: sync.host:sync.port" in str(err.value)


def test_an_operation_on_an_abandoned_group_fails_at_once():
    """A member died during a broadcast: the trainer forms a new group, and a survivor's receive still
    waiting on the old one must fail at once (the actor then joins the new group before its rendezvous
    times out and counts it lost too). gloo's own shutdown ends no pending operation (measured: the
    receive waited until the sender's process exited); ws.abandon makes ws.wait give up. Both ranks are
    threads of this process; rank 0 never sends."""
    import threading
    import time
    store = ws.create_store("127.0.0.1", 0, True, 30)
    groups = {}

    def member(rank):  # a connection of its own: a client holds its lock across a blocking wait
        groups[rank] = ws.init_group(ws.create_store("127.0.0.1", store.port, False, 30), rank, 2, "gloo", 30)
    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    pg = groups[1]
    threading.Timer(0.5, ws.abandon, args=(pg,)).start()
    t0 = time.time()
    with pytest.raises(torch.distributed.DistError, match="given up"):
        ws.wait(pg.broadcast(torch.zeros(4), 0), pg)
    assert time.time() - t0 < 10  # the group's timeout is 30 s


def _join_and_sleep(port):
    ws.init_group(ws.create_store("127.0.0.1", port, False, 30), 0, 2, "gloo", 30)
    import time
    time.sleep(600)


def test_a_peer_killed_mid_operation_is_a_dist_error():
    """The trainer's process killed (SIGKILL) during a broadcast: gloo raises a plain RuntimeError
    ("Connection reset by peer"), not a DistError, so the actor read its failed receive as a bug and
    exited, where it must wait paused for the restarted trainer's group (tests/test_e2e.py's trainer
    restart met it in one of five runs under load). ws.wait turns any failure of the wait into DistError."""
    import signal
    import threading
    store = ws.create_store("127.0.0.1", 0, True, 30)
    peer = forkserver().Process(target=_join_and_sleep, args=(store.port,))
    peer.start()
    try:
        pg = ws.init_group(ws.create_store("127.0.0.1", store.port, False, 30), 1, 2, "gloo", 30)
        threading.Timer(0.5, os.kill, args=(peer.pid, signal.SIGKILL)).start()
        with pytest.raises(torch.distributed.DistError, match="failed"):
            ws.wait(pg.broadcast(torch.zeros(4), 0), pg)
        peer.join(30)
        assert peer.exitcode == -signal.SIGKILL  # the peer died of our kill, not of its own error
    finally:
        peer.kill()
        peer.join(30)
