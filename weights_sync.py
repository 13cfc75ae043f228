"""The weight-update process group: trainer rank 0 broadcasts new weights to every vLLM worker.

Consumes: the trainer's `(hf_name, full_tensor)` iterator (one sharding unit gathered at a time).
Produces: the same tensors inside every vLLM worker, loaded with the worker's `reload_weights`.

- Rendezvous: a `TCPStore` at `sync.host:sync.port` whose master is trainer rank 0. Top-level keys
  `cursor` (prompt index the actor starts at); `announced` (n, a counter) and `announce/<n>` (the version
  of the n-th broadcast, written just before it starts, or "done"): the actor blocks on the next key,
  never polls; `version` (the newest announced version). The group itself lives under
  `PrefixStore("weights", store)`.
- Ranks: 0 = trainer rank 0; 1 + (proc*engines + e)*tp + k = TP rank k of engine e of actor process proc.
- One update = header, then buckets. Header: an int64 length, then that many bytes of UTF-8 JSON
  (never pickle) holding the version, the manifest (name, shape, dtype) and the bucket layout (bucket
  index and byte offset of each tensor, bucket sizes). Buckets: small tensors packed into flat byte
  buffers of `sync.bucket_mb`; a tensor of at least 1/8 of a bucket is a bucket of its own, broadcast
  from its own memory (`bucket_layout` says why).
- Receiver: `WeightUpdateExtension`, a vLLM worker extension (`worker_extension_cls`) whose methods run
  in every worker via `collective_rpc`; `receive()` is a plain receiver for tests and tools.
- Tied embeddings (`tie_word_embeddings=True`): the trainer sends the shared tensor once, as
  `model.embed_tokens.weight`, and the checkpoint holds no `lm_head.weight` either; the receiver makes
  vLLM's lm_head follow it after every reload (`refresh_tied_heads` says why it must).

Simplifications:
1. Every update sends the full model (no deltas, no quantization on the wire).
2. Memory: the sender stages two buckets (packing one while the other is on the wire); a CPU receiver
   keeps one model copy of receive buffers across updates (fresh ones cost page faults: see iter_tensors).
3. A tied lm_head is re-processed by vLLM's own post-load step after every update (on CPU: a V x H
   repack, as at engine start); a quantized tied lm_head is refused.
"""
import collections
import datetime
import glob
import json
import os
import queue
import threading
import time

import torch
import torch.distributed as dist

VLLM_VERSION = "0.32.0"  # the vLLM whose worker API (reload_weights, collective_rpc) this was written against
_ALIGN = 64  # byte alignment of a tensor inside a bucket (any dtype view stays aligned)


class ManifestError(ValueError):
    """The trainer's tensors do not match the engine's model; names the mismatching tensors."""


# --- group set-up ---------------------------------------------------------------------------------

def create_store(host: str, port: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """No world size: any number of actor workers may connect (the trainer does not know them all)."""
    return dist.TCPStore(host, port, None, is_master, datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def init_group(store, rank: int, world_size: int, backend: str = "auto", timeout_s: float = 300.0):
    """A process group outside both programs' default worlds (DESIGN.md "Two programs, one gloo group")."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    prefix = dist.PrefixStore("weights", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(prefix, rank, world_size, opts)


def announced_version(store):
    """The newest version the trainer announced, or None before the first send (never blocks)."""
    return int(store.get("version")) if store.check(["version"]) else None


def _device(pg) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if pg.name() == "nccl" else torch.device("cpu")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- sender (trainer rank 0) ------------------------------------------------------------------------

def bucket_layout(manifest, bucket_bytes: int):
    """[(name, shape, dtype)] -> (entries with bucket/offset/nbytes/own, bucket sizes in bytes).
    A tensor of at least 1/8 of a bucket gets a bucket of its own and is broadcast from its own memory:
    it amortizes a collective's latency as well as a full bucket (within 8x), and copying it would cost
    the sender's cores about a quarter of the wire time (gloo, 2 cores: bench_weights.py). Smaller
    tensors are packed, so no collective ever carries one small tensor."""
    entries, sizes, own = [], [], []
    for name, shape, dtype in manifest:
        dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        alone = nbytes * 8 >= bucket_bytes
        offset = -(-sizes[-1] // _ALIGN) * _ALIGN if sizes else 0
        if alone or not sizes or own[-1] or offset + nbytes > bucket_bytes:
            sizes.append(0)
            own.append(alone)
            offset = 0
        sizes[-1] = offset + nbytes
        entries.append({"name": name, "shape": list(shape), "dtype": _dtype_name(dtype),
                        "bucket": len(sizes) - 1, "offset": offset, "nbytes": nbytes, "own": alone})
    return entries, sizes


class WeightSender:
    """Trainer rank 0's side: `send(version, named_tensors, manifest)` after each optimizer step.
    Memory: two staging buckets, plus the tensor on the wire and the one being yielded. A yielded tensor
    must not be overwritten by the iterator's next yield (the trainer allocates each gathered unit afresh)."""

    def __init__(self, store, pg, bucket_mb: float):
        self.store, self.pg = store, pg
        self.announced = int(store.add("announced", 0))
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.device = _device(pg)
        self.staging = [None, None]  # two buckets: pack one while the other is on the wire

    def _bcast(self, tensor):
        return self.pg.broadcast(tensor, 0)

    def announce(self, value: str):
        """The next `announce/<n>`: a version about to be broadcast, or "done" (the actors exit)."""
        self.announced = int(self.store.add("announced", 1))
        self.store.set(f"announce/{self.announced}", value)

    def send(self, version: int, named_tensors, manifest):
        entries, sizes = bucket_layout(manifest, self.bucket_bytes)
        header = json.dumps({"version": int(version), "tensors": entries, "buckets": sizes}).encode()
        self.store.set("version", str(int(version)))
        self.announce(str(int(version)))  # the actor wakes on this and joins the broadcast
        self._bcast(torch.tensor([len(header)], dtype=torch.int64, device=self.device)).wait()
        self._bcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device)).wait()
        works = [None, None]  # the packed bucket on the wire from each staging buffer
        own = None            # (work, tensor, index) of the last tensor broadcast from its own memory
        slot = 1
        tensors = iter(named_tensors)
        for i, e in enumerate(entries):
            if own is not None and own[2] < i - 1:
                own[0].wait()  # the next yield may overwrite it: off the wire first
                own = None
            name, tensor = next(tensors, (None, None))
            if name != e["name"] or list(tensor.shape) != e["shape"] or _dtype_name(tensor.dtype) != e["dtype"]:
                got = "nothing" if name is None else f"{name} {list(tensor.shape)} {tensor.dtype}"
                raise ManifestError(f"tensor #{i} is {got}, the manifest says {e['name']} {e['shape']} {e['dtype']}")
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            if e["own"]:
                work = (self._bcast(data.to(self.device)), data, i)
                if own is not None:
                    own[0].wait()  # at most one in place on the wire while the iterator advances
                own = work
                continue
            if e["offset"] == 0:  # a new packed bucket: take the other staging buffer once it is free
                slot = 1 - slot
                if works[slot] is not None:
                    works[slot].wait()
                if self.staging[slot] is None:
                    self.staging[slot] = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device)
            self.staging[slot][e["offset"]:e["offset"] + e["nbytes"]].copy_(data)
            if i + 1 == len(entries) or entries[i + 1]["bucket"] != e["bucket"]:  # complete: on the wire
                works[slot] = self._bcast(self.staging[slot][:sizes[e["bucket"]]])
        if next(tensors, None) is not None:
            raise ManifestError(f"the iterator yields more tensors than the manifest's {len(entries)}")
        for w in works + [own[0] if own else None]:
            if w is not None:
                w.wait()


class AsyncSender:
    """Sends from a background thread while the trainer trains the next step (issue 12).

    Memory: one full copy of the weights on rank 0 (in the compute dtype), `copy`. `stage` fills it
    only while the thread is idle, so a broadcast never reads a tensor that is being overwritten (no
    torn update). A version that finds the thread still busy is not staged at all: the next one goes
    instead, so only the newest weights travel and versions may be skipped (each broadcast carries its
    own version, so per-token labels stay exact). sync.async_send=false is the synchronous path
    (WeightSender.send straight from the gathered units: no copy, training waits)."""

    def __init__(self, sender: WeightSender):
        self.sender, self.copy, self.manifest, self.error = sender, None, None, None
        self.idle = threading.Event()
        self.idle.set()
        self._next = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stage(self, named_tensors, manifest):
        """Copy the gathered weights into `copy` (the caller checked `idle`)."""
        if self.copy is None:
            self.copy, self.manifest = {}, manifest
        for name, tensor in named_tensors:
            if name not in self.copy:
                self.copy[name] = torch.empty_like(tensor, device=self.sender.device)
            self.copy[name].copy_(tensor)
        if self.sender.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # sync: the copy is complete before the thread's broadcast reads it

    def check(self):
        """Raise the broadcast thread's error, if any, naming the likely cause."""
        if self.error is not None:
            raise RuntimeError(f"the weight broadcast to the actors failed ({self.error}); is actor.py still "
                               f"running? its vLLM workers are ranks 1.. of the weight group at sync.host:sync.port") \
                from self.error

    def submit(self, version: int):
        """Broadcast `copy` as `version` from the thread (the caller staged it while idle)."""
        self.check()
        self.idle.clear()
        self._next.put(version)

    def _run(self):
        while (version := self._next.get()) is not None:
            try:
                self.sender.send(version, iter(self.copy.items()), self.manifest)
            except Exception as e:  # noqa: BLE001 - the trainer's loop raises it at its next submit/close
                self.error = e
            finally:
                self.idle.set()

    def close(self):
        """Wait for the broadcast in flight (the actors keep receiving until they see "done")."""
        self.idle.wait()
        self._next.put(None)
        self._thread.join()
        self.check()


# --- receiver -----------------------------------------------------------------------------------------

def receive_header(pg, device=None) -> dict:
    device = device or _device(pg)
    n = torch.zeros(1, dtype=torch.int64, device=device)
    pg.broadcast(n, 0).wait()
    raw = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    pg.broadcast(raw, 0).wait()
    return json.loads(bytes(raw.cpu().numpy()).decode("utf-8"))


def check_manifest(header: dict, expected: dict):
    """expected: name -> (shape, dtype name or None). Raises ManifestError naming every mismatch."""
    got = {e["name"]: (e["shape"], e["dtype"]) for e in header["tensors"]}
    problems = [f"missing {n}" for n in expected if n not in got]
    problems += [f"unexpected {n}" for n in got if n not in expected]
    for n, (shape, dtype) in got.items():
        if n in expected and list(expected[n][0]) != shape:
            problems.append(f"{n}: shape {shape}, model has {list(expected[n][0])}")
        if n in expected and expected[n][1] not in (None, dtype):
            problems.append(f"{n}: dtype {dtype}, model has {expected[n][1]}")
    if problems:
        more = f"; ... {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ManifestError(f"weights for version {header['version']} do not match the model: "
                            + "; ".join(problems[:20]) + more)


def iter_tensors(pg, header: dict, device=None, stats=None, buffers=None):
    """Yield (name, tensor) as views into received buckets; bucket i+1 is in flight while the caller
    consumes bucket i. One buffer per bucket, never recycled within an update: vLLM's layerwise reload
    may hold views until a whole layer has arrived. `buffers` (a dict) keeps them across updates: on CPU
    the first-touch page faults of fresh buffers cost as much as the wire itself (bench_weights.py); on
    GPU the caching allocator makes fresh ones free. stats["wait_s"] accumulates time spent on the wire."""
    device = device or _device(pg)
    stats = {} if stats is None else stats
    stats.setdefault("wait_s", 0.0)
    sizes = header["buckets"]
    by_bucket = [[] for _ in sizes]
    for e in header["tensors"]:
        by_bucket[e["bucket"]].append(e)

    def post(b):
        buf = None if buffers is None else buffers.get(b)
        if buf is None or buf.numel() < sizes[b]:
            buf = torch.empty(sizes[b], dtype=torch.uint8, device=device)
            if buffers is not None:
                buffers[b] = buf
        return buf[:sizes[b]], pg.broadcast(buf[:sizes[b]], 0)

    window = collections.deque(post(b) for b in range(min(2, len(sizes))))  # two buckets posted ahead
    for b in range(len(sizes)):
        buf, work = window.popleft()
        t0 = time.perf_counter()
        work.wait()
        stats["wait_s"] += time.perf_counter() - t0
        if b + 2 < len(sizes):
            window.append(post(b + 2))
        for e in by_bucket[b]:
            view = buf[e["offset"]:e["offset"] + e["nbytes"]].view(getattr(torch, e["dtype"]))
            yield e["name"], view.reshape(e["shape"])


def drain(pg, header: dict, device=None):
    """Receive and drop the buckets of a rejected update, so that the sender is not left hanging."""
    device = device or _device(pg)
    scratch = torch.empty(max(header["buckets"], default=0), dtype=torch.uint8, device=device)
    for size in header["buckets"]:
        pg.broadcast(scratch[:size], 0).wait()


def receive(pg, expected_manifest=None, device=None):
    """Plain receiver -> (version, {name: tensor}). expected_manifest: [(name, shape, dtype)] or None."""
    header = receive_header(pg, device)
    if expected_manifest is not None:
        try:
            check_manifest(header, {n: (s, d if isinstance(d, str) else _dtype_name(d))
                                    for n, s, d in expected_manifest})
        except ManifestError:
            drain(pg, header, device)
            raise
    return header["version"], {n: t.clone() for n, t in iter_tensors(pg, header, device)}


def checkpoint_manifest(model_path: str, dtype: torch.dtype) -> dict:
    """name -> (shape, dtype) from the safetensors headers of the checkpoint the engine loaded."""
    if not os.path.isdir(model_path):
        from huggingface_hub import snapshot_download
        model_path = snapshot_download(model_path, allow_patterns=["*.safetensors"], local_files_only=True)
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ManifestError(f"{model_path}: no *.safetensors files to validate weight updates against")
    from safetensors import safe_open
    out = {}
    for path in files:
        with safe_open(path, "pt") as f:
            for name in f.keys():
                out[name] = (list(f.get_slice(name).get_shape()), _dtype_name(dtype))
    return out


# --- receiver inside vLLM -----------------------------------------------------------------------------

def tied_lm_heads(model) -> dict:
    """name -> vLLM ParallelLMHead whose weight IS an input embedding's Parameter. vLLM ties by sharing the
    Parameter (`ParallelLMHead.tie_weights`, called from e.g. models/qwen2.py, llama.py, qwen3.py when
    tie_word_embeddings, or after loading by model_loader/weight_tying.py for a redundant checkpoint copy)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead, UnquantizedEmbeddingMethod, VocabParallelEmbedding)
    modules = dict(model.named_modules())
    embeddings = {id(m.weight) for m in modules.values()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    heads = {n: m for n, m in modules.items() if isinstance(m, ParallelLMHead) and id(m.weight) in embeddings}
    for name, head in heads.items():
        if not isinstance(head.quant_method, UnquantizedEmbeddingMethod):  # its post-load step may re-quantize
            raise ValueError(f"{name}: a quantized tied lm_head ({type(head.quant_method).__name__}) is not supported")
    return heads


def refresh_tied_heads(heads: dict):
    """Make tied lm_heads follow the embedding a reload just wrote (vLLM 0.32.0).

    `reload_weights` (model_loader/reload/layerwise.py) loads the embedding, runs its post-load step and
    copies the result into the original Parameter in place (`_copy_and_restore_kernel_tensors`), which the
    tied head shares, so `head.weight` is new. But no checkpoint tensor names the head, so its own post-load
    step never reruns (`finalize_layerwise_processing` only puts its kernel tensors back). On CPU that step
    (`UnquantizedEmbeddingMethod.process_weights_after_loading` -> layers/utils.py
    `dispatch_cpu_unquantized_gemm`) packed the head's weight into a oneDNN (or sgl/zentorch) GEMM handle
    whose copy the logits use, ignoring `head.weight`: stale from then on. Re-running the step repacks it
    from the new weight. On GPU the step does nothing and the logits read the shared Parameter directly
    (logits_processor.py `_apply_head` -> F.linear(x, head.weight)): the call is a no-op there."""
    for head in heads.values():
        head.quant_method.process_weights_after_loading(head)


class WeightUpdateExtension:
    """Mixed into every vLLM worker (`worker_extension_cls="weights_sync.WeightUpdateExtension"`).
    Only small scalars and strings go through collective_rpc (tensors as RPC arguments arrive as lists);
    the weights travel over the process group."""

    def init_weight_group(self, host, port, world_size, rank_base, backend, timeout_s):
        from vllm.distributed import get_tensor_model_parallel_rank
        rank = rank_base + get_tensor_model_parallel_rank()
        self._ws_tied_heads = tied_lm_heads(self.model_runner.get_model())
        self._ws_expected = checkpoint_manifest(self.model_config.model, self.model_config.dtype)
        for name in self._ws_tied_heads:  # a checkpoint may keep a redundant copy; HF ties it too, so the
            self._ws_expected.pop(f"{name}.weight", None)  # trainer stores the tensor once and never sends it
        self._ws_pg = init_group(create_store(host, port, False, timeout_s), rank, world_size, backend, timeout_s)
        self._ws_device = torch.device("cpu") if self._ws_pg.name() == "gloo" else self.device
        self._ws_buffers = {} if self._ws_device.type == "cpu" else None  # one model copy of RAM on CPU
        self._ws_stats, self._ws_last_step, self._ws_gap_from, self._ws_stall = {}, None, None, None
        for name in ("execute_model", "sample_tokens"):  # vLLM calls them by name: getattr(worker, name)
            if callable(getattr(self, name, None)):
                setattr(self, name, self._ws_timed(getattr(self, name)))
        return rank

    def _ws_timed(self, method):
        """`method` timed, for the stall an update puts on generation: the gap from the end of the last
        decode step before a receive to the start of the first one after it (reported with the next update)."""
        def timed(*args, **kwargs):
            if self._ws_gap_from is not None:  # the first step after an update
                self._ws_stall, self._ws_gap_from = time.perf_counter() - self._ws_gap_from, None
            try:
                return method(*args, **kwargs)
            finally:
                self._ws_last_step = time.perf_counter()
        return timed

    def receive_weights(self) -> dict:
        """One update: header, manifest check (before any weight changes), buckets -> reload_weights.
        -> {version, seconds, bytes, wire_s, load_s, prev_stall_s, prev_wire_load_s} (also kept for
        `weight_sync_stats`); prev_stall_s: the previous update's gap between decode steps (None where the
        engine was idle: no step in the second before it, decode steps take milliseconds; or not yet decoding
        again), prev_wire_load_s: that update's wire + load."""
        t0 = time.perf_counter()
        prev_stall, self._ws_stall = self._ws_stall, None
        prev = self._ws_stats
        busy = self._ws_last_step is not None and t0 - self._ws_last_step < 1.0
        self._ws_gap_from = self._ws_last_step if busy else None
        header = receive_header(self._ws_pg, self._ws_device)
        try:
            check_manifest(header, self._ws_expected)
        except ManifestError:
            drain(self._ws_pg, header, self._ws_device)
            raise
        t_header = time.perf_counter() - t0
        stats = {}
        self.reload_weights(weights_iterator=iter_tensors(self._ws_pg, header, self._ws_device, stats,
                                                          self._ws_buffers))
        refresh_tied_heads(self._ws_tied_heads)
        self._ws_header = header
        seconds = time.perf_counter() - t0
        self._ws_stats = {"version": header["version"], "seconds": seconds, "bytes": sum(header["buckets"]),
                          "wire_s": t_header + stats["wait_s"], "load_s": seconds - t_header - stats["wait_s"],
                          "prev_stall_s": prev_stall,
                          "prev_wire_load_s": prev["wire_s"] + prev["load_s"] if prev else None}
        return self._ws_stats

    def weight_sync_stats(self) -> dict:
        """The last update's stats, with `stall_s` (its gap between decode steps) once the engine decoded again."""
        return dict(self._ws_stats, stall_s=self._ws_stall)

    def received_digests(self) -> dict:
        """name -> sha256 of the bytes the last update delivered (CPU receive buffers): what a test or a
        suspicious user compares with the trainer's tensors."""
        import hashlib
        return {e["name"]: hashlib.sha256(self._ws_buffers[e["bucket"]][e["offset"]:e["offset"] + e["nbytes"]]
                                          .numpy().tobytes()).hexdigest() for e in self._ws_header["tensors"]}
