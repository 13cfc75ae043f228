"""Reading a run directory: the one home of the code that reads what the roles write, for run.sh's
helpers (scripts/launch.py), the figures (scripts/plot.py), the timeline (scripts/trace.py), the
throughput models (scripts/throughput_model.py, bench/longtail_model.py), the benches and the tests.

A run directory holds, among others (README, "What you will see"):
  config.yaml               the resolved config: it names the run's setting
  metrics_<role>.jsonl      one record per log line, keys `actor/`, `verifier/`, `trainer/`
  eval.jsonl                one record per test evaluation: version, test_reward, time, and
                            `example`: the completion of the test split's first problem (text)
  samples_trainer.jsonl     one record per optimizer step of trainer rank 0: its samples' group
                            ids, sample_idx, tickets and per-token versions (run-length coded);
                            samples_trainer.rank<r>.jsonl the same for rank r >= 1
  ledger.jsonl              the ledger's journal: every ticket (a copy of a group) issued,
                            forwarded, trained, dropped or given back, and why (elastic.py)
  events_<track>.jsonl      each process's timeline (format: docs/TRACE.md)

Every file is JSONL that a process appends to and may be killed in the middle of a line: every
reader here skips a torn line rather than fail on it. Imports nothing of the project, so that any
script may import it without reaching another's code. The samples records' writer is here too
(append_samples, called by trainer.py), beside their reader.

    append_samples(...)           a trainer rank's record of one optimizer step's samples
    complete_checkpoints(root)    the checkpoints a trainer may resume from, oldest first;
    latest_checkpoint(root)       the newest of them (None: none)
    read_jsonl(path)              a whole file's records (metrics, eval, samples)
    read_events(path)             an events file's records: the same reader
    read_appended(path, offset)   complete records appended since a byte offset (to follow a run)
    read_samples(run_dir)         every trainer rank's samples records, older records' fields filled
    timeline(records)             the samples records that stay: a restarted trainer's replace the
                                  steps it redid
    Run(path), load_runs(paths)   a run's trainer metrics and evaluations as arrays
    group_settings(runs)          runs grouped by setting (seeds of one setting together), labelled
"""
import contextlib
import json
import sys
from collections import OrderedDict
from itertools import groupby
from pathlib import Path

import numpy as np
import yaml

# Config fields that make a setting; runs equal in all of them are seeds of one setting.
SETTING_FIELDS = [("actor", "schedule"), ("actor", "G_steps"), ("actor", "max_inflight"),
                  ("actor", "recompute_kv"), ("actor", "max_lag"), ("actor", "cpu_cores"),
                  ("trainer", "cpu_cores"), ("actor", "engines"), ("trainer", "nproc"),
                  ("trainer", "batch_size"), ("trainer", "lr"), ("actor", "group_size"),
                  ("actor", "max_tokens"), ("actor", "temperature"), ("model", "path"),
                  ("data", "task")]
SHORT = {"max_inflight": "H", "G_steps": "G", "batch_size": "B"}


# --- records of one file -------------------------------------------------------------------------



def journal_maxima(path) -> dict:
    """The largest ticket, actor and verifier incarnation and epoch a journal names (0: none)."""
    top = dict.fromkeys(["ticket", "inc", "verifier", "epoch"], 0)
    for line in open(path) if Path(path).exists() else ():
        with contextlib.suppress(ValueError):  # a line torn by a kill
            record = json.loads(line)
            for key in top:
                top[key] = max(top[key], record.get(key, 0))
    return top


def complete_checkpoints(root) -> list:
    """`step-N` directories holding their COMPLETE marker, oldest first; `.tmp-*` and unmarked ones
    (a killed writer) are not checkpoints."""
    steps = (d for d in Path(root).glob("step-*") if d.name[5:].isdigit())
    return sorted((d for d in steps if (d / "COMPLETE").is_file()), key=lambda d: int(d.name[5:]))


def latest_checkpoint(root):
    return (complete_checkpoints(root) or [None])[-1]

def append_samples(run_dir, rank: int, step: int, epoch: int, samples: list):
    """Trainer rank `rank`'s samples of the optimizer step that made version `step`, for
    scripts/check_run.py and the figures: per sample its group, index and ticket, its tokens'
    versions run-length encoded ([[version, tokens]])."""
    rle = [[[int(v), len(list(g))] for v, g in groupby(s["versions"].tolist())] for s in samples]
    name = "samples_trainer.jsonl" if rank == 0 else f"samples_trainer.rank{rank}.jsonl"
    with open(Path(run_dir) / name, "a") as f:
        f.write(json.dumps({"step": step, "trainer_version": step - 1, "epoch": epoch, "rank": rank,
                            "group_ids": [int(s["group_id"]) for s in samples],
                            "sample_idx": [int(s["sample_idx"]) for s in samples],
                            "tickets": [int(s["ticket"]) for s in samples],
                            "version_runs": rle}) + "\n")

def read_jsonl(path) -> list:
    """Records of a JSONL file of a run directory (a missing file: none); a torn line (a killed
    writer) is skipped."""
    records = []
    for line in Path(path).read_text().splitlines() if Path(path).exists() else []:
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


# an events file is JSONL of lists, not dicts (docs/TRACE.md): the same reader and torn-line rule
read_events = read_jsonl


def read_appended(path: Path, offset: int):
    """Complete JSONL lines appended to `path` since byte `offset` -> (records, new offset)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return [], offset
    end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next poll
    records = []
    for line in chunk[:end].splitlines():
        # a writer killed mid-line and then resumed leaves a torn record joined to the next one
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    return [r for r in records if isinstance(r, dict)], offset + end


# --- what was trained: the samples records of every rank, the timeline that stays ---------------

def read_samples(run_dir) -> list:
    """Every trainer rank's samples records: samples_trainer.jsonl (rank 0), then
    samples_trainer.rank<r>.jsonl (rank r) by rank, each file in the order written. Records older
    than these fields get: `rank` the file's, `cut` None, `sample_idx` None (not recorded), and
    `epoch` counted in the file, a step not above the one before starting the next (a restarted
    trainer's records follow the killed one's)."""
    run_dir = Path(run_dir)
    files = {0: run_dir / "samples_trainer.jsonl"}
    for path in run_dir.glob("samples_trainer.rank*.jsonl"):
        with contextlib.suppress(ValueError):
            files[int(path.name.removeprefix("samples_trainer.rank").removesuffix(".jsonl"))] = path
    records = []
    for rank in sorted(files):
        epoch = 0
        last_step = None
        for r in read_jsonl(files[rank]):
            if "epoch" not in r:
                if last_step is not None and r["step"] <= last_step:
                    epoch += 1
                r["epoch"] = epoch
            last_step = r["step"]
            r.setdefault("rank", rank)
            r.setdefault("cut", None)
            r.setdefault("sample_idx", None)
            records.append(r)
    return records


def timeline(records) -> list:
    """The records that stay, sorted by (step, rank): a trainer restarted from its checkpoint at
    step S (a new epoch) writes steps S+1.. again, and its records replace the earlier epochs' from
    its first step on. Each rank's records are walked in the order written (read_samples' order):
    an epoch starts where the epoch number differs from the record before. A step written twice
    within one epoch stays twice (scripts/check_run.py reports it)."""
    by_rank = {}
    for r in records:
        by_rank.setdefault(r["rank"], []).append(r)
    kept = []
    for rank_records in by_rank.values():
        stays = []
        epoch = None
        for r in rank_records:
            if r["epoch"] != epoch:
                epoch = r["epoch"]
                stays = [k for k in stays if k["step"] < r["step"]]
            stays.append(r)
        kept += stays
    return sorted(kept, key=lambda r: (r["step"], r["rank"]))


# --- runs as arrays, grouped by setting ----------------------------------------------------------

def smooth(y, k):
    """Trailing moving average over k points (fewer at the start); k <= 1: y as it is."""
    if k <= 1 or len(y) < 2:
        return y
    c = np.cumsum(np.insert(np.nan_to_num(y), 0, 0.0))
    n = np.minimum(np.arange(1, len(y) + 1), k)
    return (c[1:] - c[np.arange(1, len(y) + 1) - n]) / n


class Run:
    """One run directory's metrics as arrays. t: seconds since time zero; samples: sequences
    trained on."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.cfg = yaml.safe_load((self.path / "config.yaml").read_text())
        by_step = {}
        for r in read_jsonl(self.path / "metrics_trainer.jsonl"):
            if "trainer/reward_mean" in r:  # skips the final `done` summary record
                by_step[r["step"]] = r  # a resumed run may log a step twice: keep the last
        self.recs = [by_step[s] for s in sorted(by_step)]
        self.seed = self.cfg["run"]["seed"]
        if not self.recs:
            return
        B = self.cfg["trainer"]["batch_size"]
        first = self.recs[0]
        sps = first.get("trainer/samples_per_s", 0) or 0
        interval = B / sps if sps > 0 else \
            sum(first.get(f"trainer/{k}", 0) for k in ("wait_s", "train_s", "broadcast_s"))
        self.t0 = first["time"] - interval
        self.step = np.array([r["step"] for r in self.recs])
        self.t = np.array([r["time"] - self.t0 for r in self.recs])
        self.samples = np.array([r.get("trainer/samples_total", B * r["step"]) for r in self.recs],
                                dtype=float)
        g = lambda k: np.array([r.get(f"trainer/{k}", np.nan) for r in self.recs],  # noqa: E731
                               dtype=float)
        self.reward = g("reward_mean")
        self.ess = g("ess")
        self.lag_mean = g("lag_mean")
        self.lag_max = g("lag_max")
        self.tokens = g("tokens")
        # test evaluations -> (t, samples, test reward) at the step that produced the version
        at = {int(r["step"]): (r["time"] - self.t0, s) for r, s in zip(self.recs, self.samples)}
        ev = []
        for e in sorted(read_jsonl(self.path / "eval.jsonl"), key=lambda e: e["version"]):
            v = int(e["version"])
            if v in at:
                ev.append((*at[v], e["test_reward"]))
            elif v < self.step[0]:  # the initial weights (or a resumed run's checkpoint)
                samples = 0.0 if v == 0 else float(np.interp(v, self.step, self.samples))
                ev.append((0.0, samples, e["test_reward"]))
            else:
                # that step's record is missing (log_every > 1, killed writer): placed by the
                # evaluation's time
                t = e["time"] - self.t0
                ev.append((t, float(np.interp(t, self.t, self.samples)), e["test_reward"]))
        columns = zip(*ev) if ev else ([], [], [])
        self.eval_t, self.eval_samples, self.test = (np.array(c, dtype=float) for c in columns)

    def value(self, section, key):
        return self.cfg.get(section, {}).get(key)

    def setting(self) -> tuple:
        return tuple(self.value(s, k) for s, k in SETTING_FIELDS)

    @property
    def schedule(self):
        return self.value("actor", "schedule")

    def mean_lag(self) -> float:
        """Token-weighted mean lag over the run."""
        ok = ~np.isnan(self.lag_mean) & ~np.isnan(self.tokens)
        return float((self.lag_mean[ok] * self.tokens[ok]).sum() / max(self.tokens[ok].sum(), 1))

    def samples_per_s(self) -> float:
        return float(self.samples[-1] / self.t[-1]) if self.t[-1] > 0 else float("nan")

    def smoothed_test(self, k: int) -> np.ndarray:
        """Trailing moving average over k evaluations (k=1: as measured)."""
        return smooth(self.test, k)

    def first_reaching(self, target, k=1):
        """(time, samples) of the first evaluation whose (smoothed) test reward >= target, else
        None."""
        y = self.smoothed_test(k)
        hit = np.nonzero(y >= target - 1e-12)[0]
        return (float(self.eval_t[hit[0]]), float(self.eval_samples[hit[0]])) if len(hit) else None


def load_runs(paths) -> list:
    runs = []
    for p in paths:
        p = Path(p)
        if not (p / "config.yaml").exists():
            print(f"[plot] skipping {p}: no config.yaml", file=sys.stderr)
            continue
        run = Run(p)
        if not run.recs:
            print(f"[plot] skipping {p}: no optimizer steps in metrics_trainer.jsonl",
                  file=sys.stderr)
            continue
        runs.append(run)
    return runs


def group_settings(runs) -> "OrderedDict[str, list]":
    """Runs grouped by setting, labelled by schedule and settings, in a fixed order: PipelineRL
    (stale KV, then recomputed KV) by H, then conventional by G."""
    groups = {}
    for r in runs:
        groups.setdefault(r.setting(), []).append(r)
    idx = {f: i for i, f in enumerate(SETTING_FIELDS)}

    def base(key):
        a = lambda k: key[idx[("actor", k)]]  # noqa: E731
        if a("schedule") == "conventional":
            return f"Conventional G={a('G_steps')}"
        kv = ", recomputed KV" if a("recompute_kv") else ""
        return f"PipelineRL H={a('max_inflight')}{kv}"

    labels = {}
    for key in groups:
        same = [k for k in groups if base(k) == base(key)]
        extra = [f"{SHORT.get(f[1], f[0] + '.' + f[1])}={key[i]}"
                 for i, f in enumerate(SETTING_FIELDS) if len({k[i] for k in same}) > 1]
        labels[key] = ", ".join([base(key)] + extra)

    def order(key):
        a = lambda k: key[idx[("actor", k)]]  # noqa: E731
        return (a("schedule") == "conventional", bool(a("recompute_kv")), a("G_steps"),
                a("max_inflight"), labels[key])
    out = OrderedDict()
    for key in sorted(groups, key=order):
        out[labels[key]] = sorted(groups[key], key=lambda r: r.seed)
    return out
