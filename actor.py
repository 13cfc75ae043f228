"""Actor: vLLM generation with in-flight weight updates (PipelineRL, arXiv 2509.19128, Algorithm 2).

Consumes: training prompts from tasks.py (the seeded stream, from the index the trainer stores as
  `cursor`), and new weights from the trainer over the weight group (weights_sync.py), announced by the
  store key `version`.
Produces: one `rollout` message (common.SCHEMAS["rollout"]) per finished sample, ZMQ PUSH to
  ports.host:ports.rollouts (the verifier binds PULL there): prompt_ids[int32 P], completion_ids[int32 T],
  logprobs[float32 T] (behaviour policy: log_softmax(logits/temperature) of each sampled token),
  versions[int32 T] (the policy version that sampled each token); header group_id (the prompt's stream
  index), sample_idx, group_size, task, answer, finish_reason, t_start, t_end.
  Metrics `actor/*` in <run.dir>/metrics_actor.jsonl; test evaluations in <run.dir>/eval.jsonl.

Run alone (needs trainer.py's store at sync.host:sync.port, and a verifier or any PULL socket):
    python actor.py [section.key=value ...]          # e.g. actor.schedule=conventional actor.G_steps=4
It exits 0 on SIGTERM/SIGINT or when the trainer sets the store key `done`; non-zero when the trainer
does not show up within run.peer_timeout_s (naming its address) or goes away.
With several actor processes (one per node), ACTOR_PROC_INDEX=p selects this one's weight ranks and
prompts (p, p+P, p+2P, ... after the cursor).

Simplifications vs the paper and its code:
1. Admission control bounds lag by how many samples may start ahead of the trainer (see `admit`);
   the paper bounds it only implicitly, through H and the trainer's speed (App. A.3).
2. A group's `group_size` attempts are `group_size` independent n=1 requests (finer admission,
   per-sample push); prefix caching is off, so they share no KV (DESIGN.md: stale KV after an update).
3. The update waits for the evaluation requests in flight, so every test score belongs to one version;
   the trainer's next broadcast waits that long (logged as `eval_s`, every actor.eval_every versions).
4. Stale KV is kept across an update (the paper's default); actor.recompute_kv=true recomputes it.
5. Several actor processes split the lag budget evenly (exact for one process; see `admit`).
"""
import asyncio
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import common
import weights_sync as ws
from common import log
from tasks import format_prompt, load_tasks

REPO = Path(__file__).resolve().parent
POLL_S = 0.005  # how often the store's `version` is polled: an update waits at most this plus one decode step


class PeerTimeout(RuntimeError):
    """The trainer did not show up in time."""


# --- engines -----------------------------------------------------------------------------------------

def engine_args(cfg, proc_index: int = 0):
    """vLLM settings that matter for RL (DESIGN.md, Known traps, all measured on vLLM 0.32)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    on_gpu = _on_gpu()
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    extra = {"tensor_parallel_size": cfg.actor.tp, "gpu_memory_utilization": cfg.actor.gpu_memory_utilization} \
        if on_gpu else {"kv_cache_memory_bytes": int(cfg.actor.kv_cache_gb * 2**30)}
    return AsyncEngineArgs(
        model=cfg.model_path, dtype=dtype, seed=cfg.run.seed + proc_index,
        enforce_eager=not on_gpu,             # CPU: eager is what works; GPU: CUDA graphs
        enable_prefix_caching=False,          # a group shares its prompt: no KV computed by old weights
        logprobs_mode="processed_logprobs",   # logprobs of the distribution actually sampled (T, top-p)
        generation_config="vllm",             # ignore the checkpoint's sampling defaults (e.g. repetition penalty)
        max_num_seqs=cfg.actor.max_inflight,
        worker_extension_cls="weights_sync.WeightUpdateExtension", **extra)


def _on_gpu() -> bool:
    import torch
    return torch.cuda.is_available()


def start_engines(cfg, proc_index: int = 0) -> list:
    """actor.engines AsyncLLMs; each sees its own actor.tp GPUs (CPU: one engine on actor.cpu_cores)."""
    from vllm.v1.engine.async_llm import AsyncLLM
    # vLLM's worker processes import weights_sync by name.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    engines = []
    if not _on_gpu():
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.actor.cpu_cores  # one OMP thread per listed core
        return [AsyncLLM.from_engine_args(engine_args(cfg, proc_index)) for _ in range(cfg.actor.engines)]
    import torch
    gpus = cfg.actor.gpus.split(",") if cfg.actor.gpus else [str(i) for i in range(torch.cuda.device_count())]
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    for e in range(cfg.actor.engines):
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[e * cfg.actor.tp:(e + 1) * cfg.actor.tp])
        engines.append(AsyncLLM.from_engine_args(engine_args(cfg, proc_index)))
    if before is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES")
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = before
    return engines


async def join_weight_group(cfg, engines, proc_index: int = 0):
    """Rank of TP rank k of engine e = 1 + (proc_index*engines + e)*tp + k; rank 0 is trainer rank 0."""
    s = cfg.sync
    await asyncio.gather(*(
        eng.collective_rpc("init_weight_group", timeout=s.timeout_s, args=(
            s.host, s.port, cfg.weight_world, 1 + (proc_index * cfg.actor.engines + e) * cfg.actor.tp,
            "auto", s.timeout_s)) for e, eng in enumerate(engines)))


async def update_weights(engines, target: int, recompute_kv: bool, timeout_s: float):
    """In-flight update (DESIGN.md): pause between two decode steps, keep the running requests, receive
    until caught up with `target`, label the new version inside the pause, resume. -> (version, pause_s)"""
    t0 = time.perf_counter()
    await asyncio.gather(*(e.pause_generation(mode="keep", clear_cache=recompute_kv) for e in engines))
    try:
        version = -1
        while version < target:  # the header carries each broadcast's version
            got = await asyncio.gather(*(e.collective_rpc("receive_weights", timeout=timeout_s) for e in engines))
            version = min(v for per_engine in got for v in per_engine)
        # Inside the pause: labelling after resume would mislabel one step (DESIGN.md).
        await asyncio.gather(*(e.update_weight_version(str(version)) for e in engines))
    finally:  # a rejected update (ManifestError) leaves the old weights running
        await asyncio.gather(*(e.resume_generation() for e in engines))
    return version, time.perf_counter() - t0


def sampling_params(cfg, temperature: float, top_p: float = 1.0):
    from vllm import SamplingParams
    return SamplingParams(n=1, temperature=temperature, top_p=top_p, max_tokens=cfg.actor.max_tokens,
                          logprobs=0)  # 0: just the sampled token's logprob


async def generate(engine, prompt: str, params, request_id: str) -> dict:
    """One request to completion -> ids, behaviour logprobs and per-token versions as arrays."""
    t_start = time.time()
    async for out in engine.generate(prompt, params, request_id=request_id):
        pass
    c = out.outputs[0]
    ids = np.asarray(c.token_ids, dtype=np.int32)
    logprobs = np.asarray([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], dtype=np.float32) \
        if c.logprobs is not None else np.zeros(len(ids), np.float32)
    versions = np.full(len(ids), -1, dtype=np.int32)
    for span in c.weight_versions or []:  # exact per-token labels, also across in-flight updates
        versions[span.start:span.end] = int(span.version)
    return {"prompt_ids": np.asarray(out.prompt_token_ids, dtype=np.int32), "completion_ids": ids,
            "logprobs": logprobs, "versions": versions, "text": c.text,
            "finish_reason": c.finish_reason or "", "t_start": t_start, "t_end": time.time()}


# --- actor state ---------------------------------------------------------------------------------------

@dataclass
class ActorState:
    """What the loop knows; tests read it. Versions count optimizer steps (0 = initial weights)."""
    version: int = -1
    first_version: int = -1
    started: int = 0            # samples started since this process began (or since this version, conventional)
    started_total: int = 0
    pushed: int = 0
    inflight: int = 0
    groups: dict = field(default_factory=dict)  # group_id -> [start version, samples not yet finished]
    per_engine: list = field(default_factory=list)
    updates: int = 0
    blocked_s: float = 0.0      # time the lag budget, not capacity, kept free slots empty
    error: BaseException = None
    window: dict = field(default_factory=dict)  # metrics since the last log line

    def u_min(self) -> int:
        """Smallest start version among groups in flight (the current version when none is)."""
        return min((g[0] for g in self.groups.values()), default=self.version)


def admit(cfg, st: ActorState, procs: int) -> bool:
    """May one more group of group_size samples start now without any token exceeding actor.max_lag?

    The lag argument (pipeline). The trainer consumes B samples per step in arrival order, so after
    version v it has consumed (v - v0)*B of the samples this actor started (v0: version at start); a
    token pushed in the k-th consumed sample (0-based) is trained on by version v0 + floor(k/B). Admit
    while started + group_size <= (u_min - v0 + max_lag + 1)*B, u_min the oldest start version in flight.
    A group G started at version u stays in flight until its last sample finishes, so every group
    admitted while G runs was admitted under a budget <= (u - v0 + max_lag + 1)*B; when G completes (the
    verifier forwards whole groups), fewer samples than that have finished, so G's samples are consumed
    at index k < (u - v0 + max_lag + 1)*B, i.e. by version <= u + max_lag, and all G's tokens were sampled
    by versions >= u: lag <= max_lag. Nothing is dropped: when the budget is spent, the groups in flight
    finish, u_min becomes the current version v, and the budget (v - v0 + max_lag + 1)*B covers the
    (v - v0 + 1)*B samples the trainer needs for its next step. With P actor processes each takes B/P
    (rounded up to whole groups): exact for P=1, approximate when processes run at different speeds.
    Conventional: exactly B*G_steps samples (samples_per_version) per version, then wait.
    """
    a, B, gs = cfg.actor, cfg.trainer.batch_size, cfg.actor.group_size
    if a.schedule == "conventional":
        return st.started + gs <= math.ceil(cfg.samples_per_version / procs / gs) * gs
    steps = st.u_min() - st.first_version + a.max_lag + 1
    return st.started + gs <= math.ceil(steps * B / procs / gs) * gs


# --- the loop --------------------------------------------------------------------------------------------

async def run_actor(cfg, engines, store, stop: asyncio.Event, proc_index: int = 0, st: ActorState = None):
    """Generate until `stop` is set; returns the state. The engines must have joined the weight group."""
    import zmq
    st = st or ActorState()
    st.per_engine = [0] * len(engines)
    procs = cfg.actor_procs
    stream, test = load_tasks(cfg)
    tokenizer = None
    if cfg.data.prompt_format == "chat":
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
    ctx = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(common.zmq_addr(cfg.ports.host, cfg.ports.rollouts))
    train_params = sampling_params(cfg, cfg.actor.temperature, cfg.actor.top_p)
    tasks = set()

    async def sample(e, problem, prompt, gid, k):
        """One attempt: generate (across any number of updates), push, release the admission slot."""
        try:
            r = await generate(engines[e], prompt, train_params, f"{proc_index}-{gid}-{k}")
            header = {"group_id": gid, "sample_idx": k, "group_size": cfg.actor.group_size,
                      "task": problem.task, "answer": problem.answer, "finish_reason": r["finish_reason"],
                      "t_start": r["t_start"], "t_end": r["t_end"]}
            common.send(push, header, {n: r[n] for n in common.SCHEMAS["rollout"][1]})
            lag = st.version - r["versions"]
            w = st.window
            w["tokens"] = w.get("tokens", 0) + len(lag)
            w["samples"] = w.get("samples", 0) + 1
            if len(lag):
                w["lag_min"] = min(w.get("lag_min", 1 << 30), int(lag.min()))
                w["lag_max"] = max(w.get("lag_max", 0), int(lag.max()))
                w["lag_sum"] = w.get("lag_sum", 0) + int(lag.sum())
            st.pushed += 1
        except Exception as ex:  # noqa: BLE001 - the loop raises it
            st.error = ex
        finally:
            st.inflight -= 1
            st.per_engine[e] -= 1
            g = st.groups[gid]
            g[1] -= 1
            if g[1] == 0:
                del st.groups[gid]

    # --- first weights: block until the trainer's first announced version is loaded ---
    deadline = time.time() + cfg.run.peer_timeout_s
    while not store.check(["cursor", "version"]):  # the trainer sets the cursor, then sends version 0
        if time.time() > deadline:
            raise PeerTimeout(f"no weights announced by the trainer at {cfg.sync.host}:{cfg.sync.port} "
                              f"after {cfg.run.peer_timeout_s:.0f} s (run.peer_timeout_s)")
        await asyncio.sleep(0.01)
    cursor, announced = int(store.get("cursor")), ws.announced_version(store)
    loaded = await engines[0].get_weight_version()
    if loaded is not None and loaded.isdigit() and int(loaded) >= announced:  # a reused engine holds it
        st.version = int(loaded)
    else:
        st.version, _ = await update_weights(engines, announced, cfg.actor.recompute_kv, cfg.sync.timeout_s)
    st.first_version = st.version
    next_group = cursor + proc_index
    eval_task = None
    last_eval = None
    last_log = last_tick = last_done_check = time.time()
    blocked_s = 0.0
    pauses = []

    while not stop.is_set():
        if st.error is not None:
            raise st.error
        # --- weights: an in-flight update when the trainer announced a newer version ---
        announced = int(store.get("version"))  # one store round trip every POLL_S
        if time.time() - last_done_check > 0.1:
            last_done_check = time.time()
            if store.check(["done"]):  # the trainer finished its last step: a normal end
                store.add("done_ack", 1)  # the trainer keeps its store up until every actor has seen this
                break
        eval_done = eval_task is None or eval_task.done()
        ready = cfg.actor.schedule == "pipeline" or st.inflight == 0  # conventional: between batches
        if announced > st.version and eval_done and ready:
            st.version, pause_s = await update_weights(engines, announced, cfg.actor.recompute_kv,
                                                       cfg.sync.timeout_s)
            pauses.append(pause_s)
            st.updates += 1
            if cfg.actor.schedule == "conventional":
                st.started = 0
        if eval_task is not None and eval_task.done():
            eval_task.result()  # surface errors
        # --- evaluation: the test split at this fixed version ---
        if eval_done and cfg.actor.eval_every and test and (last_eval is None or
                                                             st.version - last_eval >= cfg.actor.eval_every):
            last_eval = st.version
            eval_task = asyncio.create_task(evaluate(cfg, engines, test, tokenizer, st.version))
        # --- admission: start groups while the lag budget allows ---
        now = time.time()
        was_blocked = False
        while st.inflight + cfg.actor.group_size <= cfg.actor.max_inflight * len(engines):  # H per engine
            if not admit(cfg, st, procs):
                was_blocked = cfg.actor.schedule == "pipeline"  # free slots, but the lag budget is spent
                break
            gid, next_group = next_group, next_group + procs
            problem = stream.get(gid)
            prompt = format_prompt(problem, tokenizer, cfg.data.prompt_format)
            e = min(range(len(engines)), key=lambda i: st.per_engine[i])
            st.groups[gid] = [st.version, cfg.actor.group_size]
            for k in range(cfg.actor.group_size):
                st.inflight += 1
                st.per_engine[e] += 1
                tasks.add(asyncio.create_task(sample(e, problem, prompt, gid, k)))
            st.started += cfg.actor.group_size
            st.started_total += cfg.actor.group_size
        tasks = {t for t in tasks if not t.done()}
        blocked_s += (now - last_tick) if was_blocked else 0.0
        st.blocked_s += (now - last_tick) if was_blocked else 0.0
        last_tick = now
        # --- metrics ---
        if now - last_log >= cfg.run.log_every:
            w, dt = st.window, now - last_log
            log("actor", {"tokens_per_s": w.get("tokens", 0) / dt, "samples_per_s": w.get("samples", 0) / dt,
                          "inflight": st.inflight, "version": st.version, "updates": st.updates,
                          "lag_min": w.get("lag_min", 0), "lag_max": w.get("lag_max", 0),
                          "lag_mean": w.get("lag_sum", 0) / max(1, w.get("tokens", 0)),
                          "pause_s_mean": float(np.mean(pauses)) if pauses else 0.0,
                          "pause_s_max": max(pauses, default=0.0), "admission_blocked_s": blocked_s,
                          "started": st.started_total, "pushed": st.pushed}, step=st.version)
            st.window, pauses, blocked_s, last_log = {}, [], 0.0, now
        await asyncio.sleep(POLL_S)

    for t in list(tasks) + ([eval_task] if eval_task else []):
        t.cancel()
    await asyncio.gather(*tasks, *([eval_task] if eval_task else []), return_exceptions=True)
    push.close()
    return st


async def evaluate(cfg, engines, test, tokenizer, version: int):
    """One attempt per test problem at `version` (the update waits for these requests)."""
    t0 = time.time()
    params = sampling_params(cfg, cfg.actor.eval_temperature)
    outs = await asyncio.gather(*(
        generate(engines[i % len(engines)], format_prompt(p, tokenizer, cfg.data.prompt_format), params,
                 f"eval-{version}-{i}") for i, p in enumerate(test)))
    items = [(o["text"], p.answer, p.task) for o, p in zip(outs, test)]
    if all(p.task == "arithmetic" for p in test):  # cheap and safe in-process
        from verifier import score
        scores = [score(*it) for it in items]
    else:  # math_verify: in the verifier's process pool, off the event loop
        from verifier import ScorePool

        def score_in_pool():  # the pool's workers live as long as the thread that starts them
            with ScorePool(cfg.verifier.workers, cfg.verifier.timeout_s, cfg.verifier.max_chars) as pool:
                return pool.score_many(items)
        scores = await asyncio.to_thread(score_in_pool)
    reward = float(np.mean([r for r, _ in scores]))
    wall = time.time() - t0
    log("actor", {"test_reward": reward, "eval_s": wall, "eval_n": len(test)}, step=version)
    with open(cfg.run_dir / "eval.jsonl", "a") as f:
        f.write(json.dumps({"version": version, "time": time.time(), "test_reward": reward, "n": len(test)}) + "\n")
    return reward


# --- entry point --------------------------------------------------------------------------------------------

async def amain(cfg, store) -> int:
    import torch.distributed
    proc_index = int(os.environ.get("ACTOR_PROC_INDEX", "0"))
    engines = start_engines(cfg, proc_index)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await join_weight_group(cfg, engines, proc_index)
        await run_actor(cfg, engines, store, stop, proc_index)
        return 0
    except PeerTimeout as e:
        print(f"[actor] {e}", file=sys.stderr)
        return 2
    except torch.distributed.DistNetworkError as e:  # the store's master (trainer rank 0) went away
        print(f"[actor] lost the trainer's store at {cfg.sync.host}:{cfg.sync.port}: {e}", file=sys.stderr)
        return 3
    finally:
        for e in engines:
            e.shutdown()  # engine core and workers exit: no orphan vLLM processes
        engines.clear()


def main(argv=None):
    import torch
    torch.set_num_threads(1)  # the actor process only orchestrates; vLLM's workers own the cores
    cfg = common.parse_argv(argv)
    common.write_run_info(cfg, "actor")
    common.setup_logging(cfg, "actor")
    # The trainer's store first: a missing trainer fails fast, before vLLM loads.
    try:
        store = ws.create_store(cfg.sync.host, cfg.sync.port, False, cfg.run.peer_timeout_s)
    except Exception as e:  # noqa: BLE001 - torch raises DistStoreError / RuntimeError
        sys.exit(f"[actor] no trainer store at {cfg.sync.host}:{cfg.sync.port} after {cfg.run.peer_timeout_s:.0f} s "
                 f"(run.peer_timeout_s; is trainer.py running? sync.host/sync.port): {e}")
    # Import vLLM before any engine exists: tracebacks it keeps from optional imports hold the importing
    # frames, which would keep the engines alive until interpreter teardown (a spurious __del__ error).
    import vllm.v1.engine.async_llm  # noqa: F401
    sys.exit(asyncio.run(amain(cfg, store)))


if __name__ == "__main__":
    main()
