"""Weight rosters: trainer rank 0 broadcasts new weights to every vLLM worker of the live actors.

Consumes: the trainer's `(hf_name, full_tensor)` iterator (one sharding unit gathered at a time).
Produces: the same tensors inside every vLLM worker (`WeightUpdateExtension`), copied into the
model's Parameters in place (written against vLLM 0.32's worker API: model.load_weights,
collective_rpc).
Rendezvous: the run's `TCPStore` at `sync.host:sync.port` (served by node 0's `python elastic.py`,
which run.sh starts first). The trainer's `WeightServer` broadcasts to a roster: trainer rank 0 and
the workers of the actors the ledger counts alive (elastic.py), in a process group of their own,
formed anew when they change. Each broadcast is announced first: the counter `announced` goes to n
and `announce/<n>` is set to its version ("roster <g>" before a new roster's versions, "done" at the
end): the actor blocks on the next key, never polls. An update: a header (int64 length, then UTF-8
JSON, never pickle), then buckets.

Simplifications:
1. Every update sends the full model (no deltas, no quantization on the wire).
2. Memory: the sender keeps a full copy of the weights and stages two buckets (packs one while the
   other is on the wire); a CPU receiver keeps one model copy of receive buffers across updates
   (see iter_tensors).
3. Tied embeddings: the shared tensor travels once; a tied lm_head reads the embedding it shares
   (scripts/engine_setup.py, `unpack_cpu_weights`); quantized engine models are refused.
4. A roster is fixed at creation (gloo and NCCL groups are): a member lost, or a new one, forms a
   new roster, whose first broadcast is the newest weights.
"""
import contextlib
import datetime
import itertools
import json
import os
import socket
import threading
import time
from unittest import mock

import torch
import torch.distributed as dist

import common
from scripts import engine_setup, telemetry

_ALIGN = 64  # byte alignment of a tensor inside a bucket (any dtype view stays aligned)

class ManifestError(ValueError):
    """The trainer's tensors do not match the engine's model; names the mismatching tensors."""

# --- group set-up ---------------------------------------------------------------------------------

def create_store(host: str, port: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """No world size: any number of actor workers may connect (the trainer does not know them all).
    The master listens on `host` only (127.0.0.1 on a single node; node 0's address on several): a
    TCPStore left to itself listens on every interface, and nothing authenticates its peers."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, port, None, False, timeout, wait_for_workers=False)
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(1024)
    port = listener.getsockname()[1]  # port 0: the OS picked one
    # the store takes over the socket's file descriptor (detach: Python must not close it)
    return dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())

def init_group(store, rank: int, world_size: int, backend: str = "auto", timeout_s: float = 300.0,
               name: str = "weights", join_timeout_s: float = None, given_up=lambda: False):
    """A process group outside both programs' default worlds (docs/DESIGN.md,
    "Two programs, one gloo group"), its keys under `name` in the store. Once every rank has met,
    building it and its first collective end early when `given_up()` turns true (a member lost
    meanwhile), looked at every 0.2 s."""
    backend = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
    prefix, timeout = dist.PrefixStore(name, store), datetime.timedelta(seconds=timeout_s)
    # Every rank meets in the store first: a rank that never comes raises DistStoreError here after
    # join_timeout_s (default timeout_s), naming the group's keys. (NCCL would build its
    # communicator at the first broadcast and wait there for ever.)
    prefix.set(f"joined/{rank}", "1")
    prefix.wait([f"joined/{r}" for r in range(world_size)],
                datetime.timedelta(seconds=join_timeout_s or timeout_s))
    # Building the group (gloo connects every pair of ranks) and a first collective, bounded here:
    # NCCL builds its communicator at the first one, beyond blocking wait's reach, and a peer that
    # met in the store but cannot connect (a wrong NCCL_SOCKET_IFNAME), or died since, would hang
    # it for ever, silently. In a thread (on this thread's device), left behind if it hangs:
    # nothing cancels a collective.
    box = {}
    device = torch.cuda.current_device() if backend == "nccl" else None

    def build():
        if device is not None:
            torch.cuda.set_device(device)
        try:
            pg = _new_group(backend, prefix, rank, world_size, timeout)
            pg.broadcast(torch.zeros(1, device=_device(pg)), 0).wait()
            box["pg"] = pg
        except Exception as e:  # noqa: BLE001 - raised below, in the caller's thread
            box["error"] = e
    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < deadline and not given_up():
        thread.join(0.2)
    if "pg" not in box:
        cause = box.get("error", "a member was lost meanwhile" if given_up() else
                        f"no end after {timeout_s:.0f} s (sync.timeout_s)")
        raise RuntimeError(f"the weight roster's first broadcast (rank {rank} of {world_size}, store "
                           f"at {store.host}:{store.port}: sync.host:sync.port) failed: {cause}; is "
                           "every member up (trainer.py, and every actor.py's vLLM workers)?")
    return box["pg"]

def _new_group(backend: str, prefix, rank: int, world_size: int, timeout):
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    # Blocking wait for this group only (read when a group is built): a collective that outlives
    # timeout_s then raises in the waiting thread, which names the roster, as gloo does. By
    # default NCCL's watchdog would abort the whole process instead, with no word on what to
    # check. (the environment is restored as it was on the way out)
    with mock.patch.dict(os.environ, {"TORCH_NCCL_BLOCKING_WAIT": "1"}):
        return dist.ProcessGroupNCCL(prefix, rank, world_size, opts)

def later_roster(store, g: int) -> bool:
    """Has a roster after g been formed? Its number counted and its key set (a trainer that died
    between the two left a number without a key: a later one's key counts too)."""
    count = int(store.add("roster/count", 0))
    return any(store.check([f"roster/{h}"]) for h in range(g + 1, count + 1))

# Groups given up (`abandon`), by id. NCCL: the shutdown aborts the communicator, and a collective
# waiting on it fails at once. gloo: its shutdown ends nothing (a broadcast waiting on a peer that
# shut its group down, or on its own group shut down, ends only when the peer's process exits or the
# op times out: docs/DESIGN.md, "The fault layer"), so `wait` gives up on such a group itself; the
# group stays referenced here, since its destructor would wait for the operation left inside it. One
# per group given up mid-operation.
_ABANDONED = {}

def abandon(pg):
    """Give up a roster's process group (None: nothing): an operation still waiting on it fails
    at once (`wait`), on either backend."""
    if pg is not None:
        _ABANDONED[id(pg)] = pg
        with contextlib.suppress(Exception):  # (one already shut down)
            pg.shutdown()

def wait(work, pg):
    """`work.wait()` on group `pg`, which raises DistError once the group is abandoned (gloo: polled
    every 0.2 ms, as the collective's completion is) or when the operation failed: gloo reports a
    peer's killed process as a plain RuntimeError ("Connection reset by peer")."""
    if pg.name() == "gloo":
        while not work.is_completed():
            if id(pg) in _ABANDONED:
                raise dist.DistError("the weight roster's group was given up (a newer roster was "
                                     "formed) while this operation waited")
            time.sleep(0.0002)
    try:
        work.wait()
    except dist.DistError:
        raise
    except RuntimeError as e:
        raise dist.DistError(f"the operation failed: {e}") from e

def _device(pg) -> torch.device:
    return torch.device(f"cuda:{torch.cuda.current_device()}" if pg.name() == "nccl" else "cpu")

# --- sender (trainer rank 0) ----------------------------------------------------------------------

def bucket_layout(manifest, bucket_bytes: int):
    """[(name, shape, torch dtype)] -> (entries with bucket/offset/nbytes/own, bucket sizes in
    bytes). A tensor of >= 1/8 bucket is a bucket of its own, broadcast from its own memory: it
    amortizes a collective's latency within 8x of a full bucket, and copying it would add to the
    sender's time on the wire (docs/RESULTS.md, "Figures behind the code's comments")."""
    entries, sizes = [], []
    for name, shape, dtype in manifest:
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        alone = nbytes * 8 >= bucket_bytes
        offset = -(-sizes[-1] // _ALIGN) * _ALIGN if sizes else 0
        if alone or not entries or entries[-1]["own"] or offset + nbytes > bucket_bytes:
            sizes.append(0)
            offset = 0
        sizes[-1] = offset + nbytes
        entries.append(dict(name=name, shape=list(shape), dtype=str(dtype).removeprefix("torch."),
                            bucket=len(sizes) - 1, offset=offset, nbytes=nbytes, own=alone))
    return entries, sizes

def announce(store, value: str):
    """The next `announce/<n>`: a version about to be broadcast, "roster <g>" (a new roster), or
    "done". Set only where no key is (compare-and-set): a new trainer fills a number whose writer
    died between counting and setting it with "skip" (WeightServer), and a writer that finds its
    number so filled takes the next."""
    while True:
        n = int(store.add("announced", 1))
        if store.compare_set(f"announce/{n}", "", value).decode() == value:
            return

class WeightSender:
    """Trainer rank 0's side. Memory: two staging buckets, the tensor on the wire and the one
    yielded, which the iterator's next yield must not overwrite (trainer.py allocates each gathered
    unit afresh)."""

    def __init__(self, store, pg, bucket_mb: float, device=None):
        self.store, self.pg, self.bucket_bytes = store, pg, int(bucket_mb * 2**20)
        self.device = device or _device(pg)
        self.staging = [torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)]

    def send(self, version: int, named_tensors, manifest):
        entries, sizes = bucket_layout(manifest, self.bucket_bytes)
        header = json.dumps(dict(version=int(version), tensors=entries, buckets=sizes)).encode()
        announce(self.store, str(int(version)))  # the actor wakes on this and joins the broadcast
        pg = self.pg
        wait(pg.broadcast(torch.tensor([len(header)], dtype=torch.int64, device=self.device), 0), pg)
        wait(pg.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device), 0), pg)
        tensors, slot = iter(named_tensors), 1
        # each staging buffer's broadcast; i -> (broadcast, tensor i) of a tensor broadcast from its
        # own memory
        packed, own = {}, {}
        for i, e in enumerate(entries):
            if i - 2 in own:  # the next yield may overwrite tensor i - 2: off the wire first
                wait(own.pop(i - 2)[0], pg)
            name, tensor = next(tensors, (None, None))
            if name != e["name"] or list(tensor.shape) != e["shape"] or tensor.dtype != getattr(torch, e["dtype"]):
                got = "nothing" if name is None else f"{name} {list(tensor.shape)} {tensor.dtype}"
                raise ManifestError(f"tensor #{i} is {got}, the manifest says {e['name']} {e['shape']} {e['dtype']}")
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            if e["own"]:
                own[i] = (self.pg.broadcast(data.to(self.device), 0), data)
                continue
            # a new packed bucket: take the other staging buffer once it is free
            if e["offset"] == 0:
                slot = 1 - slot
                if slot in packed:
                    wait(packed[slot], pg)
            self.staging[slot][e["offset"]:e["offset"] + e["nbytes"]].copy_(data)
            # the bucket is complete: on the wire
            if i + 1 == len(entries) or entries[i + 1]["bucket"] != e["bucket"]:
                packed[slot] = self.pg.broadcast(self.staging[slot][:sizes[e["bucket"]]], 0)
        if next(tensors, None) is not None:
            raise ManifestError(f"more tensors yielded than the manifest's {len(entries)}")
        for work in [*packed.values(), *(work for work, _ in own.values())]:
            wait(work, pg)

class WeightServer:
    """Trainer rank 0's side of the rosters: a thread of its own broadcasts the newest weights to
    the roster's members while the trainer trains its next step (sync.async_send=false: the trainer
    waits for each); another asks the ledger every 0.5 s which actors are alive and gives the
    roster's process group up as soon as a member is lost (a broadcast waiting on a dead or
    stopped host fails now, not after sync.timeout_s). A roster's first broadcast is the newest
    copy this server holds: a (re)joining actor gets the newest weights first.
    Memory: one full copy of the weights, written by `send` while no broadcast reads it."""

    def __init__(self, cfg, version: int, device, epoch: int, ledger, progress=None):
        sync, self.cfg, self.version, self.epoch = cfg.sync, cfg, version, epoch
        # its own connection: the broadcast's announcements and the rosters
        self.store = create_store(sync.host, sync.port, False, cfg.run.peer_timeout_s)
        self.sender = WeightSender(self.store, None, sync.bucket_mb, device)
        # CUDA: the thread's work gets a stream of its own. A new thread's current stream is the
        # device's default stream, which training also uses: each bucket's pack and NCCL wait would
        # queue training kernels behind the wire.
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # the copy, its manifest, and whether the current roster has yet to get it
        self.copy, self.manifest, self.fresh = {}, None, False
        self.lock = threading.Lock()  # held while the copy is written or on the wire
        self.broken = False  # a broadcast failed: a member is gone
        self.error = None  # what stops the trainer (a mismatching manifest)
        self.closed = False
        # the roster: its number, members (actor incarnation -> first rank); the ledger's live ones
        self.g, self.members, self.live = 0, {}, None
        # a new line to the ledger for each thread (common.LedgerClient; None: no actor ever, e.g. a
        # benchmark of the trainer alone); the trainer's watchdog timer, re-armed by a wait on them
        self.ledger, self.progress = ledger, progress
        self.wake = threading.Event()  # set on a new copy, and on a change of the live actors
        # a trainer that died between counting its last announcement and setting it left a gap
        # the actors would wait on for ever
        if last := int(self.store.add("announced", 0)):
            self.store.compare_set(f"announce/{last}", "", "skip")
        if ledger is not None:
            threading.Thread(target=self._watch, daemon=True).start()
        threading.Thread(target=self._run, daemon=True).start()

    def send(self, version: int, named_tensors, wait: bool):
        """Copy the gathered weights (`named_tensors`, consumed whole: the other ranks gather with
        it) for the thread to broadcast. With a broadcast on the wire this version is skipped (only
        the newest travels, each with its own version, so labels stay exact) unless `wait`, which
        waits at most sync.timeout_s (then RuntimeError naming the weight roster)."""
        self.check()
        deadline = time.monotonic() + (self.cfg.sync.timeout_s if wait else 0)
        while not self.lock.acquire(timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() < deadline:
                self.made_progress()  # waiting on the actors, not hung
                continue
            for _ in named_tensors:
                pass
            if wait:
                raise RuntimeError(f"the weight broadcast to the actors has not finished after "
                                   f"{self.cfg.sync.timeout_s:.0f} s (sync.timeout_s); the weight "
                                   f"roster's store is at {self.store.host}:{self.store.port} "
                                   "(sync.host:sync.port): is every actor.py's vLLM worker up?")
            return
        try:
            manifest = []
            for name, tensor in named_tensors:
                if name not in self.copy:
                    self.copy[name] = torch.empty_like(tensor, device=self.sender.device)
                self.copy[name].copy_(tensor)
                manifest.append((name, tuple(tensor.shape), tensor.dtype))
            if self.stream is not None:
                # the copy is complete before the thread's stream reads it
                self.stream.wait_stream(torch.cuda.current_stream(self.sender.device))
            self.version, self.manifest, self.fresh = version, manifest, True
        finally:
            self.lock.release()
        self.wake.set()

    def wait_idle(self):
        """Until no broadcast is on the wire, at most sync.timeout_s, re-arming the watchdog (a
        broadcast waits on the actors, not on this rank)."""
        deadline = time.monotonic() + self.cfg.sync.timeout_s
        while self.lock.locked() and time.monotonic() < deadline:
            self.made_progress()
            time.sleep(0.01)

    def made_progress(self):
        if self.progress is not None:
            self.progress.made()

    def check(self):
        if self.error is not None:
            raise RuntimeError(f"the weight roster failed: {self.error}") from self.error

    def drain(self):
        """Wait until every member has the newest copy, or there is no member (at most
        sync.timeout_s)."""
        deadline = time.time() + self.cfg.sync.timeout_s
        while (self.fresh or self.lock.locked()) and self.members and time.time() < deadline:
            self.check()
            self.made_progress()
            time.sleep(0.01)
        self.check()

    def close(self, last: str = "done"):
        """Broadcast the newest copy if a member has yet to get it, then announce `last` (the
        actors exit on "done")."""
        self.drain()
        with self.lock:
            announce(self.store, last)
            self.closed = True  # the threads stop at their next turn

    def _watch(self):
        """The live actors, every 0.5 s, on a ledger line of its own; a lost member's roster is
        given up at once (NCCL's answer to a lost member too: abort the communicator)."""
        ledger = self.ledger()
        while not self.closed:
            self.live = set(ledger.request("members")["live"])
            if set(self.members) - self.live:
                abandon(self.sender.pg)
            if self.live != set(self.members):
                self.wake.set()
            time.sleep(0.5)

    def form(self, ledger):
        """A new roster of rank 0 and the live actors' workers, announced -> its process group
        (None: no member). Members that do not meet within run.heartbeat_timeout_s are lost; when
        all met but the group could not be built, the ones new to it are (the others built the
        last one together), else all: none is retried for ever."""
        cfg, per = self.cfg, self.cfg.actor.engines * self.cfg.actor.tp
        abandon(self.sender.pg)  # a broadcast still waiting on the old roster fails now
        self.sender.pg, old = None, self.members
        g = int(self.store.add("roster/count", 1))
        members = {inc: 1 + k * per for k, inc in enumerate(sorted(self.live))}
        info = {"members": members, "epoch": self.epoch, "version": self.version}
        self.store.set(f"roster/{g}", json.dumps(info))
        announce(self.store, f"roster {g}")
        self.g, self.members = g, members
        if not members:
            return None
        try:
            return init_group(self.store, 0, 1 + len(members) * per, "auto", cfg.sync.timeout_s,
                              f"weights/{g}", cfg.run.heartbeat_timeout_s,
                              lambda: bool(set(members) - self.live))
        except (dist.DistStoreError, RuntimeError) as e:
            met = {inc for inc, first in members.items() if self.store.check(
                [f"weights/{g}/joined/{r}" for r in range(first, first + per)])}
            for inc in (set(members) - met) or (set(members) - set(old)) or set(members):
                ledger.request("lost", inc=inc, why=f"not in weight roster {g}: {e}")
            raise

    def _run(self):
        if self.stream is not None:
            torch.cuda.set_device(self.sender.device)  # the thread's device: not always cuda:0
        ledger = self.ledger() if self.ledger else None
        while not self.closed:
            self.wake.wait(0.5)
            self.wake.clear()
            try:
                changed = self.live is not None and self.live != set(self.members)
                if (self.broken or changed) and (self.live or self.members):
                    self.broken = False
                    # the new roster gets the newest weights first
                    self.fresh = bool(self.copy)
                    self.sender.pg = self.form(ledger)
                if self.fresh and self.members:
                    with self.lock, contextlib.ExitStack() as scope:
                        self.fresh = False
                        if self.stream is not None:
                            scope.enter_context(torch.cuda.stream(self.stream))
                        self.sender.send(self.version, iter(self.copy.items()), self.manifest)
                        if self.stream is not None:
                            # on the wire and done: work.wait() only orders streams on CUDA
                            self.stream.synchronize()
            except ManifestError as e:  # the trainer's model is not the engines': stop
                self.error = e
            except Exception as e:  # noqa: BLE001 - a member is gone: form a new roster
                print(f"[trainer] weight roster {self.g}: {type(e).__name__}: {e}; forming a new "
                      "one of the actors that are alive", flush=True)
                self.broken = True
                self.wake.set()

# --- receiver -------------------------------------------------------------------------------------

def receive_header(pg, expected=None) -> dict:
    """The next update's header, checked against `expected` (name -> (shape, dtype name or None)).
    A mismatch raises ManifestError naming each one, after dropping the update's buckets: the group
    stays in step."""
    device = _device(pg)
    length = torch.zeros(1, dtype=torch.int64, device=device)
    wait(pg.broadcast(length, 0), pg)
    raw = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    wait(pg.broadcast(raw, 0), pg)
    header = json.loads(bytes(raw.cpu().numpy()).decode("utf-8"))
    if expected is None:
        return header
    got = {e["name"]: (e["shape"], e["dtype"]) for e in header["tensors"]}
    problems = [f"missing {n}" for n in expected if n not in got]
    problems += [f"unexpected {n}" for n in got if n not in expected]
    for n, (shape, dtype) in got.items():
        if n in expected and list(expected[n][0]) != shape:
            problems.append(f"{n}: shape {shape}, model has {list(expected[n][0])}")
        if n in expected and expected[n][1] not in (None, dtype):
            problems.append(f"{n}: dtype {dtype}, model has {expected[n][1]}")
    if problems:
        scratch = torch.empty(max(header["buckets"], default=0), dtype=torch.uint8, device=device)
        for size in header["buckets"]:
            wait(pg.broadcast(scratch[:size], 0), pg)
        more = f"; ... {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ManifestError(f"weights for version {header['version']} do not match the model: "
                            + "; ".join(problems[:20]) + more)
    return header

def iter_tensors(pg, header: dict, buffers=None, stats=None):
    """Yield (name, tensor) as views into received buckets, two buckets in flight. A buffer per
    bucket, never recycled within an update: vLLM's layerwise reload may hold views until a layer
    is complete. `buffers` keeps them across updates: on CPU fresh ones' first-touch page faults
    would add to every update's time (docs/RESULTS.md, "Figures behind the code's comments"); on
    GPU the caching allocator makes them free."""
    device, sizes = _device(pg), header["buckets"]
    stats = {} if stats is None else stats
    stats["wait_s"] = 0.0  # time spent waiting on the wire

    def post(b):  # -> (bucket b's buffer, its broadcast)
        buf = None if buffers is None else buffers.get(b)
        if buf is None or buf.numel() < sizes[b]:
            buf = torch.empty(sizes[b], dtype=torch.uint8, device=device)
            if buffers is not None:
                buffers[b] = buf
        return buf[:sizes[b]], pg.broadcast(buf[:sizes[b]], 0)
    # NCCL: work.wait() only makes this stream wait for the wire, so the host clock would time the
    # enqueue; CUDA events around each wait time the stream's wait instead (read once, at the end).
    events = [] if device.type == "cuda" else None
    posted = {b: post(b) for b in range(min(2, len(sizes)))}  # two buckets posted ahead
    # every bucket, in order
    for b, entries in itertools.groupby(header["tensors"], key=lambda e: e["bucket"]):
        buf, work = posted.pop(b)
        t0 = time.perf_counter()
        if events is not None:
            events.append([torch.cuda.Event(enable_timing=True) for _ in range(2)])
            events[-1][0].record()
        wait(work, pg)
        if events is not None:
            events[-1][1].record()
        stats["wait_s"] += time.perf_counter() - t0
        if b + 2 < len(sizes):
            posted[b + 2] = post(b + 2)
        for e in entries:
            view = buf[e["offset"]:e["offset"] + e["nbytes"]].view(getattr(torch, e["dtype"]))
            yield e["name"], view.reshape(e["shape"])
    if events is not None:
        # the update is loaded before it is reported (and timed)
        torch.cuda.current_stream().synchronize()
        stats["wait_s"] = sum(start.elapsed_time(end) for start, end in events) / 1e3

# --- receiver inside vLLM -------------------------------------------------------------------------

class WeightUpdateExtension:
    """Mixed into every vLLM worker (`worker_extension_cls="weights_sync.WeightUpdateExtension"`).
    Only small scalars go through collective_rpc (tensors as RPC arguments arrive as lists),
    weights over the group."""

    def init_weights_sync(self, host, port, timeout_s, track, run_dir=".", trace=False,
                          clock=None):
        """Once, when the engine is up: the model made ready for updates in place, the checkpoint's
        manifest to check them against, the decode steps timed and, with `clock` (a path), each
        stamped on the engine's common.DecodeClock."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        if self.model_config.quantization:
            # an update copies the trainer's weights in place; a quantized layer would need them
            # re-quantized first
            raise ValueError(f"the engine's model is quantized ({self.model_config.quantization}); "
                             "weight updates need an unquantized one (model.dtype)")
        self._ws_model = self.model_runner.get_model()
        path, dtype = self.model_config.model, self.model_config.dtype
        engine_setup.unpack_cpu_weights(self._ws_model, path)
        self._ws_expected = engine_setup.checkpoint_manifest(path, dtype)
        # A checkpoint may keep a redundant copy of a tied head; HF ties it too, so the trainer
        # stores the tensor once and never sends it.
        for name in engine_setup.tied_lm_heads(self._ws_model):
            self._ws_expected.pop(f"{name}.weight", None)
        # every Parameter an update must write (vLLM's names: a tied head's is its embedding's)
        self._ws_params = {name for name, _ in self._ws_model.named_parameters()}
        self._ws_store = create_store(host, port, False, timeout_s)
        self._ws_pg, self._ws_timeout = None, timeout_s
        # CPU: one model copy of receive buffers, kept across updates (iter_tensors)
        self._ws_buffers = None if torch.cuda.is_available() else {}
        self._ws_tp = get_tensor_model_parallel_rank()
        tp_track = f".{self._ws_tp}" if get_tensor_model_parallel_world_size() > 1 else ""
        self._ws_events = telemetry.Events(run_dir, f"{track}{tp_track}", trace)
        self._ws_clock = telemetry.StepClock(torch.cuda.is_available())
        self._ws_decode = common.DecodeClock(clock, create=True) if clock else None
        # The update bookkeeping (_ws_tick, _ws_account): the last update's stats; the clock's time
        # of the last decode step's end, of the previous receive, and of the end of the step before
        # an update until the next step starts (then the update's stall, reported with the next);
        # seconds inside decode steps since the previous receive.
        self._ws_stats, self._ws_last_end, self._ws_gap_from, self._ws_stall = {}, None, None, None
        self._ws_since = self._ws_clock.now_s()
        self._ws_busy = 0.0
        self._ws_timeline = telemetry.EngineTimeline(self._ws_events, self._ws_clock)
        # vLLM calls them by name: getattr(worker, name)
        for name in ("execute_model", "sample_tokens"):
            setattr(self, name, self._ws_timed(getattr(self, name)))

    def join_roster(self, g: int, rank_base: int, world_size: int, join_timeout_s: float):
        """Leave the roster this worker is in (if any) and join roster g's process group
        (WeightServer) as rank rank_base + its TP rank. A watcher thread shuts the new group down
        the moment a later roster is formed: a receive still waiting on it (its sender gone) fails
        at once instead of after sync.timeout_s (NCCL: only an abort ends a wait on a peer that
        left) -> the rank."""
        abandon(self._ws_pg)
        rank = rank_base + self._ws_tp
        # a connection of its own: the group's rendezvous blocks on this worker's, meanwhile
        store = create_store(self._ws_store.host, self._ws_store.port, False, self._ws_timeout)
        self._ws_pg = init_group(self._ws_store, rank, world_size, "auto", self._ws_timeout,
                                 f"weights/{g}", join_timeout_s, lambda: later_roster(store, g))

        def watch(pg):
            with contextlib.suppress(Exception):  # the engine shut down first
                while not later_roster(store, g):
                    time.sleep(0.5)
            abandon(pg)
        threading.Thread(target=watch, args=(self._ws_pg,), daemon=True).start()
        return rank

    def _ws_timed(self, method):
        """`method` (a part of a decode step) between two marks on the device's timeline."""
        def timed(*args, **kwargs):
            start = self._ws_clock.mark()
            try:
                return method(*args, **kwargs)
            finally:
                # execute_model's SchedulerOutput: a token for each scheduled sequence
                sequences = len(getattr(args[0] if args else None, "num_scheduled_tokens", ()))
                self._ws_clock.add(start, self._ws_clock.mark(), sequences)
                self._ws_tick()
        return timed

    def _ws_tick(self):
        """Account the decode work the device has finished: busy time, the stall of the last
        update (the gap from the last step before it to the first after), the timeline."""
        for start, end, sequences in self._ws_clock.finished():
            if self._ws_decode is not None:
                self._ws_decode.stamp()
            if self._ws_gap_from is not None:  # the first step after an update
                self._ws_stall = start - self._ws_gap_from
                self._ws_gap_from = None
            self._ws_busy += end - start
            self._ws_last_end = end
            if self._ws_events.on:
                self._ws_timeline.step(start, end, sequences)

    def receive_weights(self) -> dict:
        """One update: read its header and check it against the checkpoint (before any weight
        changes), copy the weights from its buckets into the model's Parameters in place
        (scripts/engine_setup.py, `unpack_cpu_weights`) -> its stats (`_ws_account`)."""
        t0 = time.perf_counter()
        start = time.time()
        try:
            header = receive_header(self._ws_pg, self._ws_expected)
            # the header's seconds on the wire; iter_tensors sets the buckets' (wait_s)
            wire = {"header_s": time.perf_counter() - t0}
            tensors = iter_tensors(self._ws_pg, header, self._ws_buffers, wire)
            from vllm.config import set_current_vllm_config
            with set_current_vllm_config(self.vllm_config):
                loaded = self._ws_model.load_weights(tensors)
        # gloo, and NCCL with blocking wait (init_group): a timeout or a lost peer
        except dist.DistError as e:
            raise RuntimeError(f"the weight broadcast from trainer rank 0 failed ({e}); is "
                               "trainer.py still running? the weight roster's store is at "
                               "sync.host:sync.port") from e
        if missing := sorted(self._ws_params - set(loaded)):
            # the manifest matched, but vLLM's loader skipped these: they would keep old weights
            raise ManifestError(f"weights for version {header['version']}: vLLM loaded nothing "
                                f"into {', '.join(missing[:10])}")
        return self._ws_account(t0, start, header, wire["header_s"] + wire["wait_s"])

    def _ws_account(self, t0: float, start: float, header: dict, wire_s: float) -> dict:
        """The stats of an update that started at `t0` (perf_counter; `start` on time.time()) and
        spent `wire_s` on the wire: version, seconds, bytes, wire_s, load_s (the rest of seconds);
        busy: the fraction of the time since the previous update spent in decode steps;
        prev_stall_s: the previous update's gap between decode steps (None if the engine was idle:
        no step in the second before; or not decoding again yet) and prev_wire_load_s its seconds.
        From here on the stall of this update is timed (_ws_tick)."""
        seconds = time.perf_counter() - t0
        # The pause that came first finished every step (on GPU it synchronises the device), so
        # the clock has read them all.
        self._ws_tick()
        now = self._ws_clock.now_s()
        self._ws_stats = {"version": header["version"], "seconds": seconds,
                          "bytes": sum(header["buckets"]), "wire_s": wire_s,
                          "load_s": seconds - wire_s, "prev_stall_s": self._ws_stall,
                          "prev_wire_load_s": self._ws_stats.get("seconds"),
                          "busy": self._ws_busy / max(now - self._ws_since, 1e-9)}
        self._ws_busy = 0.0
        self._ws_since = now
        self._ws_stall = None
        decoding = self._ws_last_end is not None and now - seconds - self._ws_last_end < 1.0
        self._ws_gap_from = self._ws_last_end if decoding else None
        self._ws_events.span("receive", start, version=header["version"],
                             wire_s=self._ws_stats["wire_s"], load_s=self._ws_stats["load_s"])
        return self._ws_stats

