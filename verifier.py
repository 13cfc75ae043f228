"""Verifier: scores rollouts, completes groups, computes advantages, pushes training samples.

Consumes  ZMQ PULL bound on ports.host:ports.rollouts: `rollout` messages from the actor (common.SCHEMAS).
Produces  ZMQ PUSH bound on ports.host:ports.samples: one `sample` per rollout of a complete group (the
          rollout + `reward`, `status`, `advantage`); trainer ranks connect PULL sockets, ZMQ spreads the
          samples. Evaluation passes (`eval`: true, one "group" over the test split) go to
          <run.dir>/eval.jsonl instead: version (at its start), versions [oldest, newest] (the policies that
          produced its tokens), test_reward, n. Dropped samples (zero-advantage groups when asked, malformed
          rollouts, groups incomplete after verifier.stale_group_s) are given back to their actor's admission
          budget through the trainer's store (dropped/<proc>). Metrics: metrics_verifier.jsonl.
Run alone:  python verifier.py [section.key=value ...]   (PUSH rollouts to ports.rollouts, PULL samples from
            ports.samples; a drop needs the trainer's store at sync.host:sync.port)

Grading is the task's (tasks.score); `ScorePool` runs it in worker processes with a per-item limit: a worker
that hangs (sympy on a hostile answer) or dies is replaced, the item scores `timeout`, the service goes on.

Deliberate simplifications:
 1. One process, state in memory: a restart loses the groups in progress (restart or resume the run).
 2. Advantage = r - group mean, no std division (the paper's code); the reward table of the config plus
    DAPO's linear overlong penalty (the paper's "soft penalty near the max length").
 3. math_verify's own timeouts (signal.alarm: main thread only, DESIGN.md) are off; the pool's limit kills
    the worker instead (a ~1 s restart per timeout).
 4. Workers are plain subprocesses speaking JSON lines over pipes, not multiprocessing (a spawn pool would
    re-import the caller's __main__ in every worker).
 5. Late duplicates of a forwarded or dropped group are recognised for the last 100k groups only.
"""
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np
import zmq

import common
import tasks
from loss import group_advantages

_HERE = os.path.dirname(os.path.abspath(__file__))
_FINISHED_KEPT = 100_000  # group ids remembered to catch late duplicates (simplification 5)


# --- scoring ----------------------------------------------------------------------------------------

def reward_for(status: str, v, n_tokens: int, max_tokens: int) -> float:
    """The config's reward table, then DAPO's overlong penalty: linear from 0 at
    `max_tokens - overlong_buffer` completion tokens to `overlong_penalty` at max_tokens."""
    reward = {"correct": v.reward_correct, "wrong": v.reward_wrong}.get(status, v.reward_no_answer)
    start = max_tokens - v.overlong_buffer
    if v.overlong_buffer > 0 and n_tokens > start:
        reward -= v.overlong_penalty * (min(n_tokens, max_tokens) - start) / v.overlong_buffer
    return reward


def _worker_loop():
    """A ScorePool worker: JSON lines [completion, answer, task] on stdin -> [reward, status] on stdout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C hits the whole process group; the parent stops us
    try:  # Linux: die with the parent even while stuck in sympy (PR_SET_PDEATHSIG = 1)
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # a library that prints must not corrupt the protocol: fd 1 now goes to stderr
    import logging
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" warnings: on purpose
    import math_verify  # noqa: F401  (pay the import before saying ready, so the limit times scoring only)
    out.write(b"ready\n")
    for line in sys.stdin.buffer:
        try:
            reward, status = tasks.score(*json.loads(line))
        except Exception as e:  # our bug or a bad gold: one answer must never stop the worker
            print(f"[verifier] scoring error {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            reward, status = 0.0, "unparsable"
        out.write(json.dumps([reward, status]).encode() + b"\n")


class ScorePool:
    """`workers` scoring processes. An item gets `timeout_s` seconds from when a worker takes it; a worker
    that overruns or dies is killed and replaced and its item scores (0.0, "timeout"). Completions are cut
    to their last `max_chars` characters (the final answer is at the end) before they are sent.
    Use score_many, or submit + collect (the verifier's loop); not both on one pool. Workers die with the
    thread that started them (PR_SET_PDEATHSIG): create the pool in a long-lived thread."""

    def __init__(self, workers: int, timeout_s: float, max_chars: int):
        self.timeout_s, self.max_chars = timeout_s, max_chars
        self.backlog, self.results = deque(), []  # (ticket, item) not yet taken; finished (ticket, ...)
        self.next_ticket, self.restarts, self.failed_starts = 0, 0, 0
        self.workers = [self._start() for _ in range(workers)]

    def _start(self):
        # A fresh interpreter that imports this file only (simplification 4).
        code = f"import sys; sys.path.insert(0, {_HERE!r}); import verifier; verifier._worker_loop()"
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        return {"proc": proc, "buf": b"", "ready": False, "job": None, "t0": 0.0}

    @staticmethod
    def _stop(w):
        w["proc"].kill()
        w["proc"].wait()
        for pipe in (w["proc"].stdin, w["proc"].stdout):
            with contextlib.suppress(OSError):  # unflushed input to a dead worker
                pipe.close()

    def _replace(self, w):
        self._stop(w)
        self.failed_starts += not w["ready"]
        if self.failed_starts > 3:
            raise RuntimeError("scoring workers die while starting; run `python -c 'import verifier; "
                               "verifier._worker_loop()'` to see why")
        if w["job"] is not None:
            self.results.append((w["job"], 0.0, "timeout", time.monotonic() - w["t0"]))
        self.workers[self.workers.index(w)] = self._start()
        self.restarts += 1

    def _read(self, w):
        data = os.read(w["proc"].stdout.fileno(), 1 << 16)
        if not data:  # EOF: the worker died (killed, out of memory, a crash in C)
            return self._replace(w)
        w["buf"] += data
        while b"\n" in w["buf"]:
            line, w["buf"] = w["buf"].split(b"\n", 1)
            if not w["ready"]:
                w["ready"], self.failed_starts = True, 0
                continue
            reward, status = json.loads(line)
            self.results.append((w["job"], float(reward), status, time.monotonic() - w["t0"]))
            w["job"] = None

    def _dispatch(self):
        for w in list(self.workers):
            if self.backlog and w["ready"] and w["job"] is None:
                ticket, item = self.backlog.popleft()
                w["job"], w["t0"] = ticket, time.monotonic()
                try:
                    w["proc"].stdin.write(json.dumps(item).encode() + b"\n")
                    w["proc"].stdin.flush()
                except OSError:  # BrokenPipe: it died while idle; the item scores timeout
                    self._replace(w)

    def submit(self, completion: str, answer: str, task: str) -> int:
        """Queue one item; returns its ticket (collect reports it)."""
        ticket, self.next_ticket = self.next_ticket, self.next_ticket + 1
        self.backlog.append((ticket, [completion[-self.max_chars:], answer, task]))
        self._dispatch()
        return ticket

    def busy(self) -> int:
        """Items submitted and not yet collected-ready: queued + being scored."""
        return len(self.backlog) + sum(w["job"] is not None for w in self.workers)

    def fds(self) -> list:
        """Pipes to wait on (e.g. in a zmq.Poller) for results; they change when a worker is replaced."""
        return [w["proc"].stdout.fileno() for w in self.workers]

    def collect(self, timeout: float = 0.0) -> list:
        """-> [(ticket, reward, status, seconds)] finished since the last call; waits up to `timeout` s."""
        readable, _, _ = select.select(self.fds(), [], [], 0 if self.results else timeout)
        for w in list(self.workers):
            if w["proc"].stdout.fileno() in readable:
                self._read(w)
        now = time.monotonic()
        for w in list(self.workers):
            if w["job"] is not None and now - w["t0"] > self.timeout_s:
                self._replace(w)
        self._dispatch()
        out, self.results = self.results, []
        return out

    def score_many(self, items: list) -> list:
        """[(completion, answer, task)] -> [(reward, status)] in the same order."""
        slot = {self.submit(*item): i for i, item in enumerate(items)}
        out, left = [None] * len(items), len(items)
        while left:
            for ticket, reward, status, _ in self.collect(timeout=0.1):
                out[slot[ticket]] = (reward, status)
                left -= 1
        return out

    def close(self):
        for w in self.workers:
            self._stop(w)
        self.workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --- the service --------------------------------------------------------------------------------------

@dataclass
class Groups:
    """Rollouts on their way to becoming samples. A key is (eval, group_id): eval passes and training
    groups have separate id spaces."""
    open: dict = field(default_factory=dict)  # key -> {"size", "t0", "proc", "seen": {idx}, "scored": {idx: (h, a)}}
    finished: OrderedDict = field(default_factory=OrderedDict)  # keys forwarded or dropped (simplification 5)
    scoring: dict = field(default_factory=dict)  # pool ticket -> (header, arrays)
    outbox: deque = field(default_factory=deque)  # encoded samples waiting for a trainer rank
    counts: dict = field(default_factory=lambda: {
        "groups_forwarded": 0, "zero_adv_groups": 0, "dropped_groups": 0, "dropped_samples": 0, "duplicates": 0,
        "malformed": 0, "stale_groups": 0, "evaluations": 0, **{f"status_{s}": 0 for s in tasks.STATUSES}})

    def close(self, key):
        self.open.pop(key, None)
        self.finished[key] = None
        if len(self.finished) > _FINISHED_KEPT:
            self.finished.popitem(last=False)

    def drop(self, key, proc: int, size: int, report):
        """A training group that will not be forwarded: its samples go back to actor `proc`'s budget; results
        of its samples still being scored are ignored, samples still to come are late duplicates."""
        self.close(key)
        for ticket, x in self.scoring.items():
            if x is not None and (x[0]["eval"], x[0]["group_id"]) == key:
                self.scoring[ticket] = None
        if not key[0]:
            self.counts["dropped_groups"] += 1
            self.counts["dropped_samples"] += size
            report(proc, size)


def receive(sock, g: Groups, pool, tokenizer, drop, limit: int):
    """Read rollouts while the pool has room: check, decode, hand to the pool. A malformed rollout whose
    sender and group are known drops its whole group (it can never complete)."""
    while pool.busy() < limit and sock.poll(0):
        frames = sock.recv_multipart()
        try:
            header, arrays = common.decode(frames, "rollout")
            key, idx = (header["eval"], header["group_id"]), header["sample_idx"]
            if key in g.finished or idx in g.open.get(key, {}).get("seen", ()):
                g.counts["duplicates"] += 1
                continue
            if key in g.open and header["group_size"] != g.open[key]["size"]:
                raise common.WireError(f"group {key[1]}: group_size {header['group_size']} != "
                                       f"{g.open[key]['size']} of its first sample")
            if header["task"] not in tasks.TASKS:
                raise common.WireError(f"unknown task {header['task']!r}")
            try:
                text = tokenizer.decode(arrays["completion_ids"].tolist(), skip_special_tokens=True)
            except Exception as e:  # ids outside the vocabulary
                raise common.WireError(f"completion_ids do not decode: {e}") from e
        except common.WireError as e:
            g.counts["malformed"] += 1
            print(f"[verifier] dropped a malformed rollout: {e}", flush=True)
            h = common.peek_header(frames)
            known = all(isinstance(h.get(k), int) and not isinstance(h.get(k), bool)
                        for k in ("group_id", "group_size", "proc"))
            key = (h.get("eval") is True, h.get("group_id"))
            if known and not key[0] and key not in g.finished and h["group_size"] >= 1:
                g.drop(key, h["proc"], h["group_size"], drop)  # it can never complete
            continue
        group = g.open.setdefault(key, {"size": header["group_size"], "t0": time.monotonic(), "proc": header["proc"],
                                        "seen": set(), "scored": {}, "stale": False})
        group["seen"].add(idx)
        g.scoring[pool.submit(text, header["answer"], header["task"])] = (header, arrays)


def complete(g: Groups, key, cfg, drop, window):
    """A complete group: training -> advantages -> samples in the outbox (or dropped); eval -> eval.jsonl."""
    group = g.open[key]
    g.close(key)
    members = [group["scored"][i] for i in range(group["size"])]
    rewards = [h["reward"] for h, _ in members]
    if key[0]:  # an evaluation pass over the test split (actor.py, simplification 3)
        versions = np.concatenate([a["versions"] for _, a in members])
        record = {"version": key[1], "versions": [int(versions.min(initial=key[1])), int(versions.max(initial=key[1]))],
                  "time": time.time(), "test_reward": float(np.mean(rewards)), "n": len(members),
                  "eval_s": max(h["t_end"] for h, _ in members) - min(h["t_start"] for h, _ in members)}
        with open(cfg.run_dir / "eval.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        g.counts["evaluations"] += 1
        window["evals"].append(record)
        return
    advantages = group_advantages(rewards, group["size"]).tolist()  # loss.py (1): r - group mean
    if max(rewards) == min(rewards):  # every advantage is 0: no gradient from this group
        g.counts["zero_adv_groups"] += 1
        if cfg.verifier.drop_zero_adv_groups:
            g.drop(key, group["proc"], group["size"], drop)
            return
    for (h, a), advantage in zip(members, advantages):
        g.outbox.append(common.encode({**h, "advantage": advantage}, a))
    g.counts["groups_forwarded"] += 1


def drop_stale(g: Groups, cfg, drop):
    """Groups still incomplete after verifier.stale_group_s (a sample lost on the way) are dropped."""
    now = time.monotonic()
    for key, group in list(g.open.items()):
        if now - group["t0"] > cfg.verifier.stale_group_s:
            print(f"[verifier] group {key[1]} still incomplete after {now - group['t0']:.0f} s "
                  f"({len(group['seen'])}/{group['size']} samples received): dropped", flush=True)
            g.counts["stale_groups"] += 1
            g.drop(key, group["proc"], group["size"], drop)


def main():
    cfg = common.parse_argv()
    v = cfg.verifier
    common.write_run_info(cfg, "verifier")
    common.setup_logging(cfg, "verifier")
    import torch  # only for loss.group_advantages; one thread, the cores belong to the other roles
    torch.set_num_threads(1)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)

    # --- sockets and scoring pool ---
    host = cfg.ports.host  # multi-node: run.sh sets it from MASTER_ADDR
    ctx = zmq.Context()
    rollouts_sock = ctx.socket(zmq.PULL)
    rollouts_sock.bind(common.zmq_addr(host, cfg.ports.rollouts))
    samples_sock = ctx.socket(zmq.PUSH)
    samples_sock.bind(common.zmq_addr(host, cfg.ports.samples))
    pool = ScorePool(v.workers, v.timeout_s, v.max_chars)
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    g, store = Groups(), []

    def drop(proc, n):  # back to actor `proc`'s budget; the trainer hosts the store (connect at the first drop)
        if not store:
            import weights_sync
            store.append(weights_sync.create_store(cfg.sync.host, cfg.sync.port, False, cfg.run.peer_timeout_s))
        store[0].add(f"dropped/{proc}", n)
    window = {"samples": 0, "rewards": [], "latency": [], "evals": [], "t": time.monotonic()}
    print(f"[verifier] rollouts <- {host}:{cfg.ports.rollouts}, samples -> {host}:{cfg.ports.samples}, "
          f"{v.workers} scoring workers", flush=True)

    while not stopping:
        # Backpressure: stop reading rollouts while the pool or the outbox is full; ZMQ then queues
        # them up to its high-water mark and the actor's PUSH waits (without blocking its loop).
        room = len(g.outbox) < 4 * cfg.trainer.batch_size
        poller = zmq.Poller()
        if room and pool.busy() < 2 * v.workers:
            poller.register(rollouts_sock, zmq.POLLIN)
        if g.outbox:
            poller.register(samples_sock, zmq.POLLOUT)
        for fd in pool.fds():
            poller.register(fd, zmq.POLLIN)
        poller.poll(50)  # 50 ms: also the granularity of the per-item time limit

        # --- receive rollouts ---
        if room:
            receive(rollouts_sock, g, pool, tokenizer, drop, 2 * v.workers)
        # --- score; complete groups -> advantages -> samples ---
        for ticket, _, status, seconds in pool.collect(0):
            if g.scoring.get(ticket, 0) is None:  # its group was dropped meanwhile
                del g.scoring[ticket]
                continue
            header, arrays = g.scoring.pop(ticket)
            header.update(reward=reward_for(status, v, len(arrays["completion_ids"]), cfg.actor.max_tokens),
                          status=status)
            g.counts[f"status_{status}"] += 1
            window["rewards"].append(header["reward"])
            window["latency"].append(seconds)
            key = (header["eval"], header["group_id"])
            g.open[key]["scored"][header["sample_idx"]] = (header, arrays)  # (a dropped group's results are None)
            if len(g.open[key]["scored"]) == g.open[key]["size"]:
                complete(g, key, cfg, drop, window)
        # --- send samples ---
        while g.outbox and samples_sock.poll(0, zmq.POLLOUT):
            try:
                samples_sock.send_multipart(g.outbox[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            g.outbox.popleft()
            window["samples"] += 1
        # --- metrics ---
        now = time.monotonic()
        if now - window["t"] >= cfg.run.log_every:
            drop_stale(g, cfg, drop)
            log_window(g, pool, window, now)
            window = {"samples": 0, "rewards": [], "latency": [], "evals": [], "t": now}

    # --- shutdown (SIGTERM / SIGINT) ---
    log_window(g, pool, window, time.monotonic())
    pool.close()
    rollouts_sock.close(linger=0)
    samples_sock.close(linger=1000)  # give samples already handed to ZMQ a second to reach a trainer
    ctx.term()
    print(f"[verifier] stopped; {len(g.outbox)} samples unsent, {len(g.open)} groups incomplete", flush=True)


def log_window(g: Groups, pool, window, now):
    metrics = {"samples_per_s": window["samples"] / max(now - window["t"], 1e-9),
               "queue_depth": sum(len(x["seen"]) for x in g.open.values()),
               "scoring": pool.busy(), "outbox": len(g.outbox), "worker_restarts": pool.restarts, **g.counts}
    if window["rewards"]:
        latency_ms = 1000 * np.array(window["latency"])
        metrics.update(reward_mean=float(np.mean(window["rewards"])),
                       score_ms_p50=float(np.percentile(latency_ms, 50)),
                       score_ms_p99=float(np.percentile(latency_ms, 99)))
    if window["evals"]:
        e = window["evals"][-1]
        metrics.update(test_reward=e["test_reward"], test_version=e["version"], eval_s=e["eval_s"])
    common.log("verifier", metrics, g.counts["groups_forwarded"])


if __name__ == "__main__":
    main()
