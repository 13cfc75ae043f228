"""Verifier: scores rollouts, completes groups, computes advantages, pushes training samples.

Consumes  ZMQ PULL bound on ports.host:ports.rollouts: `rollout` messages from the actor
          (common.SCHEMAS), a training group's attempts back to back.
Produces  ZMQ PUSH bound on ports.host:ports.samples: a `sample` per rollout of a complete group
          the ledger accepts (elastic.py: it refuses a group given back meanwhile), stamped with
          this verifier's incarnation and the group's `order` among its forwards: the trainer
          trains whole groups in that order and finds the ones lost on the way; while it has
          nothing to send, a `tick` to each trainer rank every 0.5 s says where its orders stand.
          An evaluation pass (`eval`: true) becomes a line of <run.dir>/eval.jsonl instead.
          Dropped groups (zero-advantage when asked, malformed; never a slow one) are reported to
          the ledger, which records why. Metrics: metrics_verifier.jsonl.
Run alone:  python verifier.py [section.key=value ...]   (PUSH rollouts to ports.rollouts, PULL
            samples from ports.samples; needs the run's ledger, `python elastic.py`)

Deliberate simplifications:
 1. One process, state in memory: a restart loses the groups in progress. Its new incarnation
    says hello to the ledger, which gives back the groups pushed to the old one and not yet
    forwarded (generated anew); the groups still generating are kept.
 2. Advantage = r - group mean, no std division (the paper's code); rewards: the config's table
    plus DAPO's linear overlong penalty (the paper's "soft penalty near the max length").
 3. Grading runs in `tasks.ScorePool` workers: subprocesses speaking JSON lines over pipes (a spawn pool
    re-imports the caller's __main__ in each), math_verify's own timeouts off (signal.alarm: main
    thread only); a worker that overruns the item limit (sympy on a hostile answer) or dies is
    replaced by a fresh interpreter; its item: `timeout`.
 4. Late duplicates of a forwarded, dropped or given-back group are recognised for the last 100k
    groups only.
"""
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections import OrderedDict, deque

import numpy as np
import torch
import zmq

import common
import elastic
import tasks
import weights_sync
from loss import group_advantages
from scripts import telemetry

# --- scoring (in tasks.ScorePool's worker processes: tasks.score) ---------------------------------

def reward_for(status: str, v, n_tokens: int, max_tokens: int) -> float:
    """Reward table minus DAPO's overlong penalty (0 at max_tokens - overlong_buffer, linear to
    overlong_penalty)."""
    reward = {"correct": v.reward_correct, "wrong": v.reward_wrong}.get(status, v.reward_no_answer)
    start = max_tokens - v.overlong_buffer
    if v.overlong_buffer > 0 and n_tokens > start:
        reward -= v.overlong_penalty * (min(n_tokens, max_tokens) - start) / v.overlong_buffer
    return reward

# --- the service ----------------------------------------------------------------------------------

class State:
    """The service's memory (simplification 1). A group's key is (eval, group_id, ticket): an
    evaluation pass has its own ids (its version), and each copy of a training group its own
    ticket (elastic.py)."""

    def __init__(self, cfg, incarnation: int = 0):
        # the config; this verifier's incarnation (the ledger's)
        self.cfg, self.incarnation = cfg, incarnation
        # key -> {"size", "t0", "seen": {idx}, "scored": {idx: (header, arrays)}}
        self.open = {}
        self.finished = OrderedDict()  # keys forwarded, dropped or given back (simplification 4)
        self.scoring = {}  # pool ticket -> (key, header, arrays)
        # complete training groups the ledger has yet to accept: ticket -> [(header, arrays)] with
        # their advantages; what the next request reports as dropped: [[ticket, why]]
        self.ready, self.drops = {}, []
        self.outbox = deque()  # encoded samples waiting for a trainer rank
        self.next_order = 0  # the order the ledger gives the next group this verifier forwards
        self.counts = dict.fromkeys(["groups_forwarded", "zero_adv_groups", "dropped_groups",
                                     "dropped_samples", "refused_groups", "duplicates",
                                     "malformed", "slow_groups", "evaluations",
                                     *(f"status_{s}" for s in tasks.STATUSES)], 0)
        # since the last log
        self.window = {"t": time.monotonic(), "samples": 0, "scored": [], "eval": None}

    def close(self, key):
        """No longer open: samples still to come are late duplicates, results still being scored
        are ignored."""
        self.open.pop(key, None)
        self.finished[key] = None
        if len(self.finished) > 100_000:  # simplification 4
            self.finished.popitem(last=False)

    def drop(self, key, size: int, why: str):
        """A training group that will not be forwarded: reported to the ledger (which records
        why, and never grants its id again)."""
        self.close(key)
        self.counts["dropped_groups"] += 1
        self.counts["dropped_samples"] += size
        self.drops.append([key[2], why])

def receive(sock, state: State, pool, tokenizer, limit: int):
    """Check, decode, submit rollouts while the pool has room. A malformed one drops its group: it
    can't complete."""
    while pool.busy() < limit and sock.poll(0):
        frames = sock.recv_multipart()
        try:
            header, arrays = common.decode(frames, "rollout")
            key = (header["eval"], header["group_id"], header["ticket"])
            idx, size = header["sample_idx"], header["group_size"]
            group = state.open.get(key, {"size": size, "seen": ()})
            if key in state.finished or idx in group["seen"]:
                state.counts["duplicates"] += 1
                continue
            if size != group["size"]:
                raise common.WireError(f"group {key[1]}: group_size {size} != {group['size']} of its first sample")
            if header["task"] not in tasks.TASKS:
                raise common.WireError(f"unknown task {header['task']!r}")
            try:
                text = tokenizer.decode(arrays["completion_ids"].tolist(), skip_special_tokens=True)
            except Exception as e:  # ids outside the vocabulary
                raise common.WireError(f"completion_ids do not decode: {e}") from e
        except common.WireError as e:
            state.counts["malformed"] += 1
            print(f"[verifier] dropped a malformed rollout: {e}", flush=True)
            # peek_header keeps the fields that are valid by themselves: a drop needs these
            h = common.peek_header(frames)
            key = (False, h.get("group_id"), h.get("ticket"))
            if ({"group_id", "group_size", "ticket"} <= h.keys() and h.get("eval") is not True
                    and key not in state.finished and h["ticket"] > 0):
                state.drop(key, h["group_size"], "malformed")
            continue
        group = state.open.setdefault(key, {"size": size, "t0": time.monotonic(), "seen": set(),
                                            "scored": {}})
        group["seen"].add(idx)
        if header["eval"] and idx == 0:  # the test split's first problem: eval.jsonl shows it
            header = {**header, "text": text[-2000:]}
        state.scoring[pool.submit(text, header["answer"], header["task"])] = (key, header, arrays)

def complete(state: State, key):
    """A complete group: training -> advantages -> ready for the ledger (or dropped); eval ->
    eval.jsonl."""
    group = state.open[key]
    state.close(key)
    members = [group["scored"][i] for i in range(group["size"])]
    rewards = [h["reward"] for h, _ in members]
    if key[0]:  # an evaluation pass over the test split (actor.py, simplification 3)
        versions = np.concatenate([a["versions"][a["versions"] >= 0] for _, a in members])
        version_range = [int(versions.min(initial=key[1])), int(versions.max(initial=key[1]))]
        eval_s = max(h["t_end"] for h, _ in members) - min(h["t_start"] for h, _ in members)
        record = {"version": key[1], "versions": version_range, "time": time.time(),
                  "test_reward": float(np.mean(rewards)), "n": len(members), "eval_s": eval_s,
                  "example": members[0][0]["text"]}
        with open(state.cfg.run_dir / "eval.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        state.counts["evaluations"] += 1
        state.window["eval"] = record
        return
    advantages = group_advantages(rewards, group["size"]).tolist()  # loss.py (1): r - group mean
    if max(rewards) == min(rewards):  # every advantage is 0: no gradient from this group
        state.counts["zero_adv_groups"] += 1
        if state.cfg.verifier.drop_zero_adv_groups:
            return state.drop(key, group["size"], "zero_adv")
    state.ready[key[2]] = [({**h, "advantage": adv}, a) for (h, a), adv in zip(members, advantages)]

def forward(state: State, ledger):
    """The complete groups to the ledger, and the drops: the accepted go to the outbox with their
    order (first in, first out: the trainer counts on it), the refused (given back meanwhile) are
    discarded, and the groups the ledger gave back since are closed here."""
    reply = ledger.request("forward", verifier=state.incarnation, forward=list(state.ready),
                           drop=state.drops)
    state.drops = []
    for ticket, order in reply["accepted"]:
        for h, a in state.ready.pop(ticket):
            message = {**h, "verifier": state.incarnation, "order": order}
            state.outbox.append(common.encode(message, a))
        state.counts["groups_forwarded"] += 1
        state.next_order = order + 1
    state.counts["refused_groups"] += len(state.ready)
    state.ready = {}
    for ticket, group_id in reply["void"]:
        state.close((False, group_id, ticket))

def log_window(state: State, pool, now):
    """Log the metrics of the window that ends `now` and start the next one."""
    w = state.window
    metrics = {"samples_per_s": w["samples"] / max(now - w["t"], 1e-9),
               "queue_depth": sum(len(group["seen"]) for group in state.open.values()),
               "scoring": pool.busy(), "outbox": len(state.outbox),
               "worker_restarts": pool.restarts, **state.counts}
    if w["scored"]:
        rewards, seconds = zip(*w["scored"])
        p50, p99 = np.percentile(1000 * np.array(seconds), [50, 99])
        metrics.update(reward_mean=float(np.mean(rewards)), score_ms_p50=float(p50), score_ms_p99=float(p99))
    if w["eval"]:
        metrics.update(test_reward=w["eval"]["test_reward"], test_version=w["eval"]["version"],
                       eval_s=w["eval"]["eval_s"])
    telemetry.log("verifier", metrics, state.counts["groups_forwarded"])
    state.window = {"t": now, "samples": 0, "scored": [], "eval": None}

def main():
    cfg = common.parse_argv()
    v = cfg.verifier
    telemetry.setup_logging(cfg, "verifier")
    # torch only runs loss.group_advantages here; the cores belong to the other roles
    torch.set_num_threads(1)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)

    # --- sockets and scoring pool ---
    host = cfg.ports.host  # multi-node: run.sh sets it from MASTER_ADDR
    ctx = zmq.Context()
    rollouts_sock, samples_sock = common.pull_socket(ctx), ctx.socket(zmq.PUSH)
    rollouts_sock.bind(common.zmq_addr(host, cfg.ports.rollouts))
    samples_sock.bind(common.zmq_addr(host, cfg.ports.samples))
    # This incarnation, the ledger's (it gives back what the previous one held, simplification 1)
    store = weights_sync.create_store(cfg.sync.host, cfg.sync.port, False, cfg.run.peer_timeout_s)
    ledger = common.LedgerClient(cfg, store)
    incarnation = ledger.request("verifier_hello")["verifier"]
    pool, state = tasks.ScorePool(v.workers, v.timeout_s, v.max_chars), State(cfg, incarnation)
    progress = elastic.Progress(cfg, f"verifier (pid {os.getpid()})")
    ranks, asked, sent = cfg.trainer.nproc * cfg.trainer.nnodes, 0.0, time.monotonic()
    stopping = threading.Event()  # set by SIGTERM / SIGINT: the loop ends after its current turn
    events = telemetry.Events(cfg.run_dir, "verifier", cfg.run.trace)
    # the timeline's current bucket: its start (time.time()) and the samples scored since
    bucket_t0, bucket_scored = time.time(), 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    print(f"[verifier] rollouts <- {host}:{cfg.ports.rollouts}, samples -> "
          f"{host}:{cfg.ports.samples}, {v.workers} scoring workers", flush=True)

    common.freeze_heap()
    while not stopping.is_set():
        # Backpressure: with the pool or the outbox full, rollouts wait in ZMQ's queue up to its
        # high-water mark, then the actor's PUSH waits (without blocking its loop). 50 ms: the
        # granularity of the item time limit.
        room = len(state.outbox) < 4 * cfg.trainer.batch_size
        reading = [rollouts_sock] if room and pool.busy() < 2 * v.workers else []
        zmq.select(reading + pool.fds(), [samples_sock] if state.outbox else [], [], 0.05)
        # --- receive rollouts ---
        if reading:
            receive(rollouts_sock, state, pool, tokenizer, 2 * v.workers)
        # --- score; complete groups -> advantages -> samples ---
        scored = pool.collect(0)
        for ticket, _, status, seconds in scored:
            key, header, arrays = state.scoring.pop(ticket)
            if key in state.open:  # else its group was dropped meanwhile
                header.update(reward=reward_for(status, v, len(arrays["completion_ids"]),
                                                cfg.actor.max_tokens), status=status)
                state.counts[f"status_{status}"] += 1
                state.window["scored"].append((header["reward"], seconds))
                state.open[key]["scored"][header["sample_idx"]] = (header, arrays)
                if len(state.open[key]["scored"]) == state.open[key]["size"]:
                    complete(state, key)
        # the timeline: scores a second and groups so far, in buckets of >= 0.25 s (a span per
        # batch would be a record per sample)
        bucket_scored += len(scored)
        if (wall := time.time()) - bucket_t0 >= 0.25:
            events.counter("verifier", bucket_t0, scored_per_s=bucket_scored / (wall - bucket_t0),
                           scoring=pool.busy(), groups_completed=state.counts["groups_forwarded"],
                           groups_dropped=state.counts["dropped_groups"])
            bucket_t0, bucket_scored = wall, 0
        # --- the ledger accepts the complete groups (at least once a second: what it gave back) ---
        if state.ready or state.drops or time.monotonic() - asked > 1.0:
            forward(state, ledger)
            asked = time.monotonic()
        # --- push samples to the trainer; with none to push, a tick to every rank ---
        with contextlib.suppress(zmq.Again):  # no room after all: the rest waits for the next turn
            while state.outbox and samples_sock.poll(0, zmq.POLLOUT):
                samples_sock.send_multipart(state.outbox[0], zmq.NOBLOCK, copy=False)
                state.outbox.popleft()
                state.window["samples"] += 1
                sent = time.monotonic()
            if not state.outbox and time.monotonic() - sent > 0.5:
                tick = common.encode({"verifier": incarnation, "order": state.next_order})
                for _ in range(ranks):  # ZMQ deals them round-robin: one each, pipes with room
                    samples_sock.send_multipart(tick, zmq.NOBLOCK)
                sent = time.monotonic()
        progress.made()  # its loop turns; its scoring workers have their own time limit
        # --- report slow groups (never drop them); log ---
        # A slow group is not a lost one: the actor pushes a group's attempts back to back, but a
        # backlog at this socket can hold the rest. A group is known lost only when a sample
        # arrives malformed (`receive` drops it), when the trainer finds that it never arrived
        # (trainer.whole_groups), or when its actor is lost (the ledger gives it back).
        now = time.monotonic()
        if now - state.window["t"] >= cfg.run.log_every:
            for key, group in state.open.items():
                if now - group["t0"] > v.stale_group_s and not group.get("reported"):
                    group["reported"] = True
                    print(f"[verifier] {'evaluation' if key[0] else 'group'} {key[1]} still "
                          f"incomplete after {now - group['t0']:.0f} s ({len(group['seen'])}/"
                          f"{group['size']} samples received): waiting for the rest", flush=True)
                    state.counts["slow_groups"] += 1
            log_window(state, pool, now)

    # --- shutdown (SIGTERM / SIGINT) ---
    log_window(state, pool, time.monotonic())
    pool.close()
    rollouts_sock.close(linger=0)
    # give samples already handed to ZMQ a second to reach a trainer
    samples_sock.close(linger=1000)
    ctx.term()
    print(f"[verifier] stopped; {len(state.outbox)} samples unsent, {len(state.open)} groups "
          "incomplete", flush=True)

if __name__ == "__main__":
    try:
        main()
    except torch.distributed.DistNetworkError as e:  # the store's process went away
        sys.exit(elastic.store_lost("verifier", e))
