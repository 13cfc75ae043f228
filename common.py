"""What the roles share: the config, the wire format (the ledger's requests too), and each engine's
decode-step clock. What a role records (start-up record, metrics, timeline): scripts/telemetry.py.

- Config: config.yaml holds every default, one frozen dataclass per section; unknown keys, wrong
  types and impossible combinations raise ConfigError naming the key.
- Wire (docs/DESIGN.md, "Wire format"): frame 0 a JSON header listing the raw array frames after
  it, checked against SCHEMAS (non-finite numbers too); a malformed message raises WireError: roles
  drop, log and count it. No pickle anywhere.
"""
import contextlib
import dataclasses
import gc
import itertools
import json
import math
import mmap
import os
import struct
import sys
import tempfile
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
# One frozen dataclass per section, its fields typed by the defaults (1.0 is a float, 1 an int,
# [..] a tuple).
SECTIONS = {name: dataclasses.make_dataclass(f"{name.title()}Cfg", frozen=True, fields=[
                (k, tuple if isinstance(v, list) else type(v)) for k, v in values.items()])
            for name, values in DEFAULTS.items()}
CHOICES = {("data", "task"): ("arithmetic", "longtail", "calc", "math"),
           ("data", "prompt_format"): ("plain", "chat"),
           ("actor", "schedule"): ("pipeline", "conventional"),
           ("model", "dtype"): ("auto", "float32", "bfloat16", "float16"),
           ("trainer", "reduce_dtype"): ("float32", "bfloat16"),
           ("trainer", "correction"): ("tis", "seq_is", "token_mask", "seq_mask", "m2po"),
           ("actor", "env"): ("", "calc", "python")}
# Bounds of the numeric keys: value >= MINIMUMS[section][key]; value > 0 for the POSITIVE keys.
# Upper bounds and combinations: `_rules`. Every float must also be finite: nan passes every bound
# check (lr=nan would train on nothing; reward_correct=nan makes every group with a correct answer
# malformed), and inf overflows a timeout.
MINIMUMS = {"run": dict(seed=0, log_every=0, max_restarts=0),
            "actor": dict(engines=1, tp=1, group_size=1, max_inflight=1, G_steps=1, max_tokens=1,
                          max_lag=0, eval_every=0, eval_temperature=0, max_turns=1),
            "trainer": dict(nproc=1, nnodes=1, batch_size=1, micro_batch_tokens=1, max_steps=1,
                            keep_checkpoints=1, checkpoint_every=0, grad_clip=0, logits_chunk=0,
                            weight_decay=0),
            "verifier": dict(workers=1, max_chars=1, overlong_buffer=0, overlong_penalty=0),
            "data": dict(test_size=1),
            "sync": dict(port=1, verify_every=0, send_every=1),
            "ports": dict(rollouts=1, samples=1, ledger=1)}
POSITIVE = {"run": ("peer_timeout_s", "heartbeat_timeout_s", "hang_timeout_s", "restart_s"),
            "actor": ("temperature", "top_p", "kv_cache_gb", "gpu_memory_utilization",
                      "step_timeout_s"),
            "verifier": ("timeout_s", "stale_group_s"),
            "trainer": ("lr", "eps", "is_clamp", "mask_low", "m2po_tau"),
            "sync": ("bucket_mb", "timeout_s")}

class _Derived:
    # --- Config's derived values: computed here and nowhere else ---
    @property
    def run_dir(self) -> Path:
        """run.sh always passes an explicit run.dir; a role started alone without one uses
        runs/standalone."""
        return REPO / (self.run.dir or "runs/standalone")  # an absolute run.dir replaces REPO

    @property
    def model_path(self) -> str:
        """A relative model path is relative to the repo (the embedded model lives in assets/)."""
        p = self.model.path
        return str(REPO / p) if not os.path.isabs(p) and (REPO / p).exists() else p

    def compute_dtype(self, cuda: bool) -> str:
        """model.dtype, with "auto" = bfloat16 on GPU, float32 on CPU: the trainer's and the
        engine's alike."""
        return {"auto": "bfloat16" if cuda else "float32"}.get(self.model.dtype, self.model.dtype)

# One frozen field per config.yaml section (cfg.run, cfg.actor, ...), with _Derived's values.
Config = dataclasses.make_dataclass("Config", SECTIONS.items(), bases=(_Derived,), frozen=True)

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
    """config.yaml's defaults, then `path` (e.g. a run's resolved config.yaml), then each of
    `overrides` in order: an overlay file (`configs/x.yaml`) or `section.key=value` -> validated
    Config."""
    raw = {name: dict(values) for name, values in DEFAULTS.items()}
    layers = [_read_yaml(path)] if path else []
    for item in overrides:
        dotted, eq, value = item.partition("=")
        if not eq and item.endswith(".yaml"):
            layers.append(_read_yaml(item))
        elif not eq or "." not in dotted:
            raise ConfigError(f"override {item!r}: expected section.key=value like trainer.lr=3e-5")
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
    cfg = Config(**{name: cls(**{k: _coerce(f"{name}.{k}", v, DEFAULTS[name][k])
                                 for k, v in raw[name].items()}) for name, cls in SECTIONS.items()})
    validate(cfg)
    return cfg

def validate(cfg: Config):
    """Impossible combinations fail here, before any process starts, naming the keys and the fix."""
    for (sec, key), allowed in CHOICES.items():
        if (value := getattr(getattr(cfg, sec), key)) not in allowed:
            names = ", ".join(a or '""' for a in allowed)
            raise ConfigError(f"{sec}.{key}={value!r}; allowed: {names}")
    for sec, section in dataclasses.asdict(cfg).items():
        for key, value in section.items():
            values = value if isinstance(value, tuple) else (value,)  # trainer.betas: a tuple
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                raise ConfigError(f"{sec}.{key}={value}: must be a finite number")
    bounds = [(sec, key, ">=", low) for sec, keys in MINIMUMS.items() for key, low in keys.items()]
    bounds += [(sec, key, ">", 0) for sec, keys in POSITIVE.items() for key in keys]
    for sec, key, op, bound in bounds:
        value = getattr(getattr(cfg, sec), key)
        if not (value > bound if op == ">" else value >= bound):
            raise ConfigError(f"{sec}.{key}={value}: must be {op} {bound}")
    for broken, message in _rules(cfg):
        if broken:
            raise ConfigError(message)

def _rules(cfg: Config):
    """(broken, message) pairs in order: the first broken one is reported. A generator: a rule is
    only evaluated once the ones before it passed, so it may rely on them."""
    a, t, d = cfg.actor, cfg.trainer, cfg.data
    conventional = a.schedule == "conventional"
    ranks = t.nproc * t.nnodes
    yield (t.batch_size % a.group_size, f"trainer.batch_size={t.batch_size} must be a multiple of "
           f"actor.group_size={a.group_size} (only complete groups are trained on)")
    yield (t.batch_size % ranks, f"trainer.batch_size={t.batch_size} must be divisible by the "
           f"trainer ranks (trainer.nproc*trainer.nnodes={ranks})")
    # actor.py admits a group only when all of its samples fit in the engines' slots
    yield (a.max_inflight * a.engines < a.group_size, f"actor.max_inflight*actor.engines="
           f"{a.max_inflight * a.engines} < actor.group_size={a.group_size}: no group ever fits in "
           f"flight; raise actor.max_inflight to at least {-(-a.group_size // a.engines)}")
    yield (a.top_p > 1, f"actor.top_p={a.top_p}: must be in (0, 1]")
    yield (not 0 <= a.step_latency_s[0] <= a.step_latency_s[1] or len(a.step_latency_s) != 2,
           f"actor.step_latency_s={list(a.step_latency_s)}: need [lo, hi] with 0 <= lo <= hi")
    yield (a.env == "python" and d.prompt_format != "chat", "actor.env=python: its calls and "
           "answers follow the model's chat template: set data.prompt_format=chat")
    yield (a.gpu_memory_utilization > 1,
           f"actor.gpu_memory_utilization={a.gpu_memory_utilization}: must be in (0, 1]")
    yield (not t.mask_low < 1 < t.mask_high, f"trainer.mask_low={t.mask_low:g}, trainer.mask_high="
           f"{t.mask_high:g}: the band of ratios kept (token_mask, seq_mask) must hold 1, the "
           "on-policy ratio: need 0 < mask_low < 1 < mask_high")
    yield (not all(0 <= b < 1 for b in t.betas),
           f"trainer.betas={list(t.betas)}: each must be in [0, 1)")
    yield (conventional and a.max_lag < a.G_steps - 1, f"actor.max_lag={a.max_lag} < "
           f"actor.G_steps-1={a.G_steps - 1}: conventional RL trains G_steps batches on one "
           f"version, so its lag reaches G_steps-1")
    yield (cfg.sync.send_every > 1 and (conventional or a.max_lag < cfg.sync.send_every - 1),
           f"sync.send_every={cfg.sync.send_every}: forced staleness is for actor.schedule=pipeline "
           f"with actor.max_lag >= send_every - 1 (now {a.max_lag}); the lag budget would send "
           "sooner otherwise")
    yield (a.schedule == "pipeline" and a.G_steps != 1,
           "actor.G_steps applies to actor.schedule=conventional only; leave it at 1")
    yield (d.task == "math" and not d.train_path,
           "data.task=math needs data.train_path (a JSONL file or an HF dataset name)")
    yield (not 1 <= d.min_digits <= d.max_digits <= 9,
           "data.min_digits/max_digits: need 1 <= min_digits <= max_digits <= 9")
    # tasks.arithmetic_test draws until it has test_size distinct problems (forever if there are
    # fewer), and the training stream redraws a problem of the test split up to 1000 times: keep at
    # least half the problems out of the test split. Operands as tasks._draw_arithmetic draws them.
    digits = range(d.min_digits, d.max_digits + 1)
    problems = sum(10 if n == 1 else 9 * 10 ** (n - 1) for n in digits) ** 2
    yield (d.task in ("arithmetic", "calc") and d.test_size > problems // 2,
           f"data.test_size={d.test_size}: data.min_digits={d.min_digits}..data.max_digits="
           f"{d.max_digits} make only {problems} distinct problems, and at least half must stay "
           f"out of the test split; lower data.test_size to {problems // 2} or raise "
           f"data.max_digits")
    # Timing: a hung role is killed after run.hang_timeout_s and back after run.restart_s; a peer
    # that gives up sooner would stop the run instead; the actors ask the ledger every <= 0.25 s.
    r = cfg.run
    yield (r.peer_timeout_s <= r.hang_timeout_s + r.restart_s,
           f"run.peer_timeout_s={r.peer_timeout_s:g} must exceed run.hang_timeout_s + "
           f"run.restart_s={r.hang_timeout_s + r.restart_s:g}: a role waiting for a hung peer "
           "would give up before the peer is started again")
    yield (r.heartbeat_timeout_s < 1, f"run.heartbeat_timeout_s={r.heartbeat_timeout_s:g}: "
           "must be at least 1 s (an actor asks the ledger every 0.25 s at most)")
    yield (r.hang_timeout_s < 5, f"run.hang_timeout_s={r.hang_timeout_s:g}: must be at least 5 s "
           "(a role re-arms its watchdog at most once a second, which looks once a second)")
    # Ports: run.sh's torchrun listens on sync.port+1 for its rendezvous.
    ports = {"sync.port": cfg.sync.port, "sync.port+1": cfg.sync.port + 1,
             "ports.rollouts": cfg.ports.rollouts, "ports.samples": cfg.ports.samples,
             "ports.ledger": cfg.ports.ledger}
    for name, port in ports.items():
        yield (port > 65535, f"{name}={port}: must be at most 65535")
    for (name, port), (other, port2) in itertools.combinations(ports.items(), 2):
        yield (port == port2, f"{name} and {other} are both {port} (run.sh's torchrun listens on "
               f"sync.port+1): give each its own port")

def gpu_set(cfg: Config, role: str, visible: list, taken: list = ()) -> list:
    """The GPUs of `role` ("actor" or "trainer") on this node, as CUDA_VISIBLE_DEVICES names them: its
    listed `<role>.gpus`, else the first `visible` ones not `taken`; ConfigError naming the keys
    unless they are visible, not taken, and as many as the role needs. run.sh checks both roles of
    a node before any starts (scripts/launch.py); a role started alone checks its own."""
    n, what = {"actor": (cfg.actor.engines * cfg.actor.tp, "actor.engines*actor.tp"),
               "trainer": (cfg.trainer.nproc, "trainer.nproc")}[role]
    listed, key = getattr(cfg, role).gpus, f"{role}.gpus"
    ids = [g.strip() for g in listed.split(",")] if listed else \
        [g for g in visible if g not in taken][:n]
    seen = list(taken)
    for g in ids:
        if g not in visible:
            raise ConfigError(f"{key}: GPU {g} is not visible on this node (visible: "
                              f"{','.join(visible)}); list visible ids or leave it empty")
        if g in seen:
            raise ConfigError(f"actor.gpus/trainer.gpus: GPU {g} is given twice; give each role its "
                              "own GPUs")
        seen.append(g)
    fewer = what.replace("*", " or ")
    if len(ids) != n and listed:
        raise ConfigError(f"{key}: lists {len(ids)} GPUs but {what}={n}; list {n} or change {fewer}")
    if len(ids) != n:
        raise ConfigError(f"{key}: {what}={n} needs {n} GPUs but {len(ids)} of this node's "
                          f"{len(visible)} are free; lower {fewer}, or use more GPUs or nodes")
    return ids

def config_to_dict(cfg: Config) -> dict:
    return {name: {k: list(v) if isinstance(v, tuple) else v for k, v in section.items()}
            for name, section in dataclasses.asdict(cfg).items()}

def parse_argv(argv=None) -> Config:
    """Every role: `python ROLE.py [section.key=value ...]`. Exits with the error on a bad
    config."""
    try:
        return load_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        sys.exit(f"config error: {e}")

# --- wire format ----------------------------------------------------------------------------------

class WireError(ValueError):
    """A malformed message: the receiver drops it, logs it and counts it."""

_DTYPES = {"int32": np.int32, "int64": np.int64, "float32": np.float32, "float64": np.float64}
# ticket: the ledger's copy of the group (elastic.py; 0 for an evaluation pass); epoch: the trainer
# epoch whose weights sampled it
_ROLLOUT = {"group_id": int, "sample_idx": int, "group_size": int, "task": str, "answer": str,
            "finish_reason": str, "t_start": float, "t_end": float, "ticket": int, "epoch": int,
            "eval": bool, "turns": int, "env_reward": float}
_ARRAYS = dict(prompt_ids="int32", completion_ids="int32", logprobs="float32", versions="int32")
# verifier, order: the verifier incarnation that forwarded the group and the group's index in its
# forwards (the trainer trains groups in that order and finds the ones lost on the way)
_SAMPLE = {**_ROLLOUT, "reward": float, "status": str, "advantage": float, "verifier": int,
           "order": int}
# a verifier with nothing to send tells every trainer rank where its forwards stand (`order`: the
# next group's), so that a group lost on the way is found without a later one
_TICK = {"verifier": int, "order": int}
SCHEMAS = {"rollout": (_ROLLOUT, _ARRAYS), "sample": (_SAMPLE, _ARRAYS), "tick": (_TICK, {})}
# Size caps. A header is ~300 bytes (a long math answer adds a few KiB). A frame is one sequence's
# tokens at 4 bytes each: 16 MiB holds 4M tokens. Anything bigger is a bug or an attack.
MAX_HEADER_BYTES = 64 * 2**10
MAX_FRAME_BYTES = 16 * 2**20
# Header ids and counts (group_id, sample_idx, group_size, ticket, order, ...) are non-negative
# and fit in int32: the trainer sums them in float64 and the store adds them as int64, exactly.
_MAX_ID = 2**31 - 1
_WHAT = {bool: "true or false", int: f"an integer in [0, {_MAX_ID}]", float: "a finite number",
         str: "a string"}

def pull_socket(ctx=None):
    """A PULL socket (of the zmq context `ctx`, default the process's) that disconnects a peer
    sending a frame over MAX_FRAME_BYTES (ZMQ_MAXMSGSIZE counts each frame) instead of allocating
    it."""
    import zmq
    sock = (ctx or zmq.Context.instance()).socket(zmq.PULL)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    return sock

def encode(header: dict, arrays: dict = None) -> list:
    """header (JSON-able dict) + {name: ndarray} -> list of frames; WireError for a message no
    receiver would take (a frame over the size caps, which a PULL socket refuses unread): the
    sender gives its group back instead."""
    arrays = {name: np.ascontiguousarray(a) for name, a in (arrays or {}).items()}
    for name, a in arrays.items():
        if a.dtype.name not in _DTYPES:
            raise WireError(f"array {name!r}: dtype {a.dtype} not allowed on the wire")
    meta = [{"name": n, "dtype": a.dtype.name, "shape": list(a.shape)} for n, a in arrays.items()]
    frames = [json.dumps(dict(header, arrays=meta)).encode()]
    frames += [a.tobytes() for a in arrays.values()]
    if len(frames[0]) > MAX_HEADER_BYTES or max(map(len, frames)) > MAX_FRAME_BYTES:
        raise WireError(f"a frame of {max(map(len, frames))} bytes is over the size caps")
    return frames

def _show(value) -> str:
    """A received value in an error message: short, and never the repr of a nested structure."""
    return repr(value)[:60] if isinstance(value, (int, float, str)) else type(value).__name__

def _valid(typ, value) -> bool:
    """Whether a header value has the schema's type: bool apart from the numbers (JSON has true and
    1), finite floats (JSON has NaN), ids and counts in [0, _MAX_ID]."""
    if typ is bool:
        return isinstance(value, bool)
    if typ is int:
        return type(value) is int and 0 <= value <= _MAX_ID
    if typ is float:
        if type(value) is int:  # within float64's exact range: a huger one would overflow float()
            return abs(value) <= 2**53
        return type(value) is float and math.isfinite(value)
    return isinstance(value, typ)

def _parse_header(frames) -> dict:
    """Frame 0 as a JSON object, else WireError."""
    if len(frames) == 0:
        raise WireError("empty message")
    if memoryview(frames[0]).nbytes > MAX_HEADER_BYTES:
        raise WireError(f"header over {MAX_HEADER_BYTES} bytes")
    try:
        header = json.loads(bytes(frames[0]).decode("utf-8"))
    # ValueError: not JSON, or an integer of over 4300 digits; RecursionError: nested too deep
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise WireError(f"frame 0 is not UTF-8 JSON: {type(e).__name__}") from e
    if not isinstance(header, dict):
        raise WireError("frame 0 is not a JSON object")
    return header

def peek_header(frames) -> dict:
    """The schemas' header fields that are valid by themselves, also in a malformed message ({} if
    frame 0 is not a JSON object): who sent it and its group, safe to add up in the store."""
    try:
        header = _parse_header(frames)
    except WireError:
        return {}
    types = SCHEMAS["sample"][0]  # the rollout's fields and the sample's
    return {k: v for k, v in header.items() if k in types and _valid(types[k], v)}

def decode(frames: list, kind: str):
    """Frames -> (header, arrays) as `SCHEMAS[kind]` says, else WireError, whatever the bytes: one
    bad message must never stop a role (tests/test_wire_fuzz.py: a seeded fuzzer checks it)."""
    fields, array_dtypes = SCHEMAS[kind]
    header = _parse_header(frames)
    meta = header.pop("arrays", None)
    if not isinstance(meta, list) or len(meta) != len(frames) - 1:
        raise WireError(f"the header's 'arrays' must list the {len(frames) - 1} frames after it")
    arrays = {}
    for m, frame in zip(meta, frames[1:]):
        name = m.get("name") if isinstance(m, dict) else None
        if not isinstance(name, str) or name not in array_dtypes or name in arrays:
            raise WireError(f"{kind}: arrays are {', '.join(array_dtypes)}, each once; got "
                            f"{_show(name)}")
        dtype = array_dtypes[name]
        shape = m.get("shape")
        # 1-D only: the byte count is then one product, of Python ints, which never overflow
        one_d = isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int
        if m.get("dtype") != dtype or not one_d:
            raise WireError(f"{kind}: array {name!r} must be 1-D {dtype}, got "
                            f"{_show(m.get('dtype'))} of shape {_show(shape)}")
        buf = memoryview(frame)
        if buf.nbytes > MAX_FRAME_BYTES or buf.nbytes != shape[0] * np.dtype(dtype).itemsize:
            raise WireError(f"array {name!r}: {buf.nbytes} bytes for {dtype}[{shape[0]}]")
        arrays[name] = np.frombuffer(buf, dtype=dtype)
        if dtype.startswith("float") and not np.isfinite(arrays[name]).all():
            raise WireError(f"{kind}: array {name!r} holds non-finite values")
    if len(arrays) != len(array_dtypes):
        missing = sorted(set(array_dtypes) - set(arrays))
        raise WireError(f"{kind}: arrays {', '.join(missing)} missing")
    for key, typ in fields.items():
        if key not in header:
            raise WireError(f"{kind}: missing field {key!r}")
        if not _valid(typ, header[key]):
            raise WireError(f"{kind}: field {key!r} should be {_WHAT[typ]}, got "
                            f"{_show(header[key])}")
    if kind == "tick":
        return header, arrays
    n = len(arrays["completion_ids"])
    if len(arrays["logprobs"]) != n or len(arrays["versions"]) != n:
        raise WireError(f"{kind}: logprobs/versions must have one entry per completion token ({n})")
    # an episode (envs.py): the model's tokens (version >= 0, in the order versions came) and the
    # environment's (version -1, no logprob), the model's first
    v, env = arrays["versions"], arrays["versions"] == -1
    if n and (v.min() < -1 or env[0] or arrays["logprobs"][env].any() or
              (np.diff(v[~env]) < 0).any()):
        raise WireError(f"{kind}: an episode's tokens are the model's (version >= 0, never "
                        "decreasing) and the environment's (version -1, logprob 0), the model's "
                        "first")
    if not header["sample_idx"] < header["group_size"]:
        raise WireError(f"{kind}: sample_idx {header['sample_idx']} outside group of "
                        f"{header['group_size']}")
    return header, arrays

# --- requests to the ledger (elastic.py): one request, one reply, typed and parsed here ----------
# Invariant: a request the ledger acts on has every field of its kind, of its type; any other is
# refused whole (its sender gets {"error": ...} and raises), never half applied.

REQUESTS = {
    "actor_hello": {"pid": int, "host": str},
    # pushed: [[ticket, verifier incarnation it was pushed to]]; drop: [[ticket, why]]
    "tickets": {"inc": int, "epoch": int, "version": int, "want": int, "pushed": list, "drop": list},
    "verifier_hello": {},
    "forward": {"verifier": int, "forward": list, "drop": list},
    # the checkpoint resumed from: its step, epoch, and the group ids done (trained or dropped); the
    # budget's terms as this trainer trains: batch_size, group_size, max_lag, schedule, G_steps
    "trainer_hello": {"epoch": int, "step": int, "done_below": int, "done_above": list,
                      "budget": dict},
    # trained: tickets trained by the step that made `version`; lost: [[verifier, order]] of the
    # forwarded groups the ranks found lost on the way (trainer.whole_groups)
    "report": {"epoch": int, "version": int, "trained": list, "lost": list},
    "members": {},
    "lost": {"inc": int, "why": str},
}

def parse_request(frame: bytes) -> tuple:
    """A request's bytes -> (kind, fields), else ValueError naming what is wrong."""
    request = json.loads(frame)
    kind = request.get("op") if isinstance(request, dict) else None
    if kind not in REQUESTS:
        raise ValueError(f"unknown request {kind!r}")
    for key, typ in REQUESTS[kind].items():
        value = request.get(key)
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise ValueError(f"{kind}: field {key!r} should be {typ.__name__}, got {value!r}")
    return kind, request

class LedgerClient:
    """A role's line to the ledger (ZMQ REQ; one per thread). A reply is waited for while the run's
    store answers, looked at every second: the store gone raises DistNetworkError (`store_lost`)."""

    def __init__(self, cfg, store):
        import zmq
        self.sock, self.store = zmq.Context.instance().socket(zmq.REQ), store
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(zmq_addr(cfg.ports.host, cfg.ports.ledger))

    def request(self, kind: str, **fields) -> dict:
        self.sock.send(json.dumps({"op": kind, **fields}).encode())
        while not self.sock.poll(1000):
            self.store.check(["announced"])  # DistNetworkError: the store went away
        reply = json.loads(self.sock.recv())
        if "error" in reply:
            raise RuntimeError(f"the ledger refused a request: {reply['error']}")
        return reply

def zmq_addr(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"

def cpu_set(spec: str) -> set:
    """A taskset-style core list ("0", "0-1", "0,2-3") -> the set of core ids."""
    return {c for part in spec.split(",") if part for a, _, b in [part.partition("-")]
            for c in range(int(a), int(b or a) + 1)}

# --- the start-up heap ----------------------------------------------------------------------------

def freeze_heap():
    """Once a role's start-up is done: what it built (the imports of torch, vLLM, transformers)
    lives until exit, and Python's full collections would walk all of it every few seconds, freeing
    nothing, with the role frozen meanwhile: the actor's engine would wait for new requests and its
    weight updates for the pause's reply (docs/DESIGN.md, "The start-up heap and the collector").
    gc.freeze() takes it out of the collector's reach (vLLM's engine core does the same with its
    own heap)."""
    gc.collect()
    gc.freeze()

# --- the engine's decode-step clock: the last step stamped (the actor's hang check) ---------------

def clock_path(engine: int) -> str:
    """Where engine `engine` of this actor process stamps its decode steps (DecodeClock)."""
    return os.path.join(tempfile.gettempdir(), f"pipelinerl-{os.getpid()}-engine{engine}.clock")

class DecodeClock:
    """The wall time of an engine's last decode step, in 8 bytes of a file both processes map: its
    workers stamp it after every step (a memory write, no system call), the actor reads it (its
    hang check: vLLM's check_health sees a dead engine core, not a stopped one)."""

    def __init__(self, path: str, create: bool = False):
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        if create:
            os.ftruncate(fd, 8)  # (never shorter: the workers of one engine share it)
        self.map = mmap.mmap(fd, 8)
        os.close(fd)

    def stamp(self):
        struct.pack_into("d", self.map, 0, time.time())

    def last(self) -> float:
        return struct.unpack_from("d", self.map)[0]
