"""Verifier: scores rollouts, completes groups, computes advantages, pushes training samples.

Consumes  ZMQ PULL bound on ports.host:ports.rollouts: `rollout` messages from the actor (common.SCHEMAS).
Produces  ZMQ PUSH bound on ports.host:ports.samples: one `sample` per rollout of a complete group, the
          rollout's header + `reward` (float), `status` (str), `advantage` (float), its arrays unchanged
          (prompt_ids, completion_ids, logprobs, versions). Trainer ranks connect PULL sockets; ZMQ
          spreads the samples across them.
Metrics   <run.dir>/metrics_verifier.jsonl every run.log_every seconds (step = groups forwarded so far).

Run alone:  python verifier.py [section.key=value ...]    e.g. python verifier.py run.dir=runs/v ports.rollouts=5555
            (then PUSH rollouts with common.send to ports.rollouts and PULL samples from ports.samples).

Scoring: `score(completion, answer, task) -> (reward, status)`, status one of STATUSES. `arithmetic`: the
`#123` final line, exact integer match. `math`: the last \\boxed{...} (else, when the gold is a plain
number as in GSM8K, the last number in the text) compared with math_verify, so equivalent forms count
(\\frac{1}{2} = 0.5, 2\\sqrt{2} = \\sqrt{8}, intervals, sets). It runs in `ScorePool` (the actor reuses it
for test evaluation): worker processes with a per-item limit; a worker that hangs (sympy on a hostile
answer) or dies is killed and replaced, the item scores `timeout`, and the service goes on.

Deliberate simplifications:
 1. One verifier process, state in memory: a restart loses the groups in progress (the trainer simply
    trains on later groups). Incomplete groups are logged once when stale, never evicted.
 2. Advantage = r - group mean, no std division (the paper's released code); reward from the config's
    table plus DAPO's linear overlong penalty (the paper's "soft penalty near the max length").
 3. math_verify's own timeouts (signal.alarm: main thread only, DESIGN.md trap) are off; the pool's
    limit kills the worker instead, which costs a worker restart (~1 s) per timeout.
 4. Workers are plain subprocesses speaking JSON lines over pipes, not multiprocessing: a spawn pool
    would re-import the caller's __main__ (the actor, with vLLM) in every worker.
 5. Late duplicates of an already forwarded group are recognised for the last 100k groups only.
"""
import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections import OrderedDict, deque

import numpy as np
import zmq

import common
import tasks

STATUSES = ("correct", "wrong", "no_answer", "unparsable", "timeout")
TASKS = ("arithmetic", "math")
_HERE = os.path.dirname(os.path.abspath(__file__))
_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")  # 1,234.5 or 1234.5
_FINISHED_KEPT = 100_000  # group ids remembered to catch late duplicates (simplification 5)


# --- scoring ----------------------------------------------------------------------------------------

def score(completion: str, answer: str, task: str):
    """-> (reward, status) with the default table (correct 1.0, else 0.0). Pure, and no time limit of
    its own: sympy can run for hours on a hostile answer, so call it through ScorePool."""
    if task == "arithmetic":
        pred = tasks.arithmetic_final_answer(completion)
        if pred is None:
            return 0.0, "no_answer"
        return (1.0, "correct") if int(pred) == int(answer) else (0.0, "wrong")
    if task != "math":
        raise ValueError(f"unknown task {task!r}; known: {TASKS}")
    pred = tasks.extract_boxed(completion)
    if pred is None and _PLAIN_NUMBER.fullmatch(answer.strip().replace(",", "")):  # GSM8K-style gold
        numbers = _NUMBER.findall(completion)
        pred = numbers[-1].replace(",", "") if numbers else None
    if pred is None:
        return 0.0, "no_answer"
    from math_verify import parse, verify  # lazy: only scoring processes pay for sympy
    # Both sides go through the same \boxed{} wrapper, so that parse reads them alike. Timeouts None:
    # math_verify's signal.alarm works in a main thread only (simplification 3).
    gold = parse("\\boxed{" + answer + "}", parsing_timeout=None)
    parsed = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    if not parsed:
        return 0.0, "unparsable"
    if gold and verify(gold, parsed, timeout_seconds=None):
        return 1.0, "correct"
    # parse falls back to the raw string when sympy cannot read it: only an exact string match counts
    return (0.0, "wrong") if any(not isinstance(p, str) for p in parsed) else (0.0, "unparsable")


def reward_for(status: str, v: common.VerifierCfg, n_tokens: int, max_tokens: int) -> float:
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
            reward, status = score(*json.loads(line))
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

def main():
    cfg = common.parse_argv()
    v = cfg.verifier
    common.write_run_info(cfg, "verifier")
    common.setup_logging(cfg, "verifier")
    import torch  # only for loss.group_advantages; one thread, the cores belong to the other roles
    torch.set_num_threads(1)
    from transformers import AutoTokenizer
    from loss import group_advantages
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

    groups = {}  # group_id -> {"size", "t0", "seen": {sample_idx}, "scored": {sample_idx: (header, arrays)}}
    finished = OrderedDict()  # group ids already forwarded or dropped (simplification 5)
    scoring = {}  # pool ticket -> (header, arrays)
    outbox = deque()  # encoded samples waiting for a trainer rank (PUSH blocks with no PULL connected)
    counts = {"groups_forwarded": 0, "zero_adv_groups": 0, "dropped_groups": 0, "duplicates": 0,
              "malformed": 0, "stale_groups": 0, **{f"status_{s}": 0 for s in STATUSES}}
    window = {"samples": 0, "rewards": [], "latency": [], "t": time.monotonic()}
    print(f"[verifier] rollouts <- {host}:{cfg.ports.rollouts}, samples -> {host}:{cfg.ports.samples}, "
          f"{v.workers} scoring workers", flush=True)

    while True:
        # Backpressure: stop reading rollouts while the pool or the outbox is full; ZMQ then queues
        # them up to its high-water mark and the actor's PUSH waits.
        poller = zmq.Poller()
        if pool.busy() < 2 * v.workers and len(outbox) < 4 * cfg.trainer.batch_size:
            poller.register(rollouts_sock, zmq.POLLIN)
        if outbox:
            poller.register(samples_sock, zmq.POLLOUT)
        for fd in pool.fds():
            poller.register(fd, zmq.POLLIN)
        events = dict(poller.poll(50))  # 50 ms: also the granularity of the per-item time limit

        # --- receive rollouts ---
        while rollouts_sock in events and pool.busy() < 2 * v.workers and rollouts_sock.poll(0):
            try:
                header, arrays = common.recv(rollouts_sock, "rollout")
                gid, idx = header["group_id"], header["sample_idx"]
                if gid in finished or idx in groups.get(gid, {}).get("seen", ()):
                    counts["duplicates"] += 1
                    continue
                if gid in groups and header["group_size"] != groups[gid]["size"]:
                    raise common.WireError(f"group {gid}: group_size {header['group_size']} != "
                                           f"{groups[gid]['size']} of its first sample")
                if header["task"] not in TASKS:
                    raise common.WireError(f"unknown task {header['task']!r}")
                try:
                    text = tokenizer.decode(arrays["completion_ids"].tolist(), skip_special_tokens=True)
                except Exception as e:  # ids outside the vocabulary
                    raise common.WireError(f"completion_ids do not decode: {e}") from e
            except common.WireError as e:
                counts["malformed"] += 1
                print(f"[verifier] dropped a malformed rollout: {e}", flush=True)
                continue
            group = groups.setdefault(gid, {"size": header["group_size"], "t0": time.monotonic(),
                                            "seen": set(), "scored": {}, "stale": False})
            group["seen"].add(idx)
            scoring[pool.submit(text, header["answer"], header["task"])] = (header, arrays)

        # --- score ---
        for ticket, _, status, seconds in pool.collect(0):
            header, arrays = scoring.pop(ticket)
            reward = reward_for(status, v, len(arrays["completion_ids"]), cfg.actor.max_tokens)
            header.update(reward=reward, status=status)
            counts[f"status_{status}"] += 1
            window["rewards"].append(reward)
            window["latency"].append(seconds)
            group = groups[header["group_id"]]
            group["scored"][header["sample_idx"]] = (header, arrays)
            if len(group["scored"]) < group["size"]:
                continue

            # --- complete group -> advantages -> samples ---
            gid = header["group_id"]
            del groups[gid]
            finished[gid] = None
            if len(finished) > _FINISHED_KEPT:
                finished.popitem(last=False)
            members = [group["scored"][i] for i in range(group["size"])]
            rewards = [h["reward"] for h, _ in members]
            advantages = group_advantages(rewards, group["size"]).tolist()  # loss.py (1): r - group mean
            if max(rewards) == min(rewards):  # every advantage is 0: no gradient from this group
                counts["zero_adv_groups"] += 1
                if v.drop_zero_adv_groups:
                    counts["dropped_groups"] += 1
                    continue
            for (h, a), advantage in zip(members, advantages):
                outbox.append(common.encode({**h, "advantage": advantage}, a))
            counts["groups_forwarded"] += 1

        # --- send samples ---
        while outbox and samples_sock.poll(0, zmq.POLLOUT):
            try:
                samples_sock.send_multipart(outbox[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            outbox.popleft()
            window["samples"] += 1

        # --- metrics ---
        now = time.monotonic()
        if now - window["t"] >= cfg.run.log_every or stopping:
            for gid, g in groups.items():
                if not g["stale"] and now - g["t0"] > v.stale_group_s:
                    g["stale"] = True
                    counts["stale_groups"] += 1
                    print(f"[verifier] group {gid} still incomplete after {now - g['t0']:.0f} s "
                          f"({len(g['seen'])}/{g['size']} samples received)", flush=True)
            metrics = {"samples_per_s": window["samples"] / (now - window["t"]),
                       "queue_depth": sum(len(g["seen"]) for g in groups.values()),
                       "scoring": pool.busy(), "outbox": len(outbox), "worker_restarts": pool.restarts,
                       **counts}
            if window["rewards"]:
                latency_ms = 1000 * np.array(window["latency"])
                metrics.update(reward_mean=float(np.mean(window["rewards"])),
                               score_ms_p50=float(np.percentile(latency_ms, 50)),
                               score_ms_p99=float(np.percentile(latency_ms, 99)))
            common.log("verifier", metrics, counts["groups_forwarded"])
            window = {"samples": 0, "rewards": [], "latency": [], "t": now}
        if stopping:
            break

    # --- shutdown (SIGTERM / SIGINT) ---
    pool.close()
    rollouts_sock.close(linger=0)
    samples_sock.close(linger=1000)  # give samples already handed to ZMQ a second to reach a trainer
    ctx.term()
    print(f"[verifier] stopped; {len(outbox)} samples unsent, {len(groups)} groups incomplete", flush=True)


if __name__ == "__main__":
    main()
