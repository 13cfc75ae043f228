"""run.sh's helpers (not a role): what it needs to launch a node, its progress lines and closing summary.

    python scripts/launch.py shell [section.key=value ...]   validate (config, model, GPUs: common.check),
                                                             then print the values run.sh evals
    python scripts/launch.py progress RUN_DIR                follow a run: one line per optimizer step
    python scripts/launch.py summary RUN_DIR                 the run's closing line

`shell` reads NODE_RANK and NNODES as run.sh exports them. A bad config prints `config error: ...` alone
on stderr and exits 2, before any process starts.
"""
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
from common import REPO, ConfigError  # noqa: E402


def resolve_run_dir(cfg, roles: list) -> str:
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


def shell(overrides: list, visible=None) -> str:
    """Shell assignments for run.sh: this node's roles, run directory, cores and resolved GPU sets.
    GPU_OVERRIDES hands the resolved sets to every role (actor.py splits actor.gpus among its engines);
    empty on a CPU machine, where nothing changes."""
    cfg = common.load_config(overrides)
    roles = common.node_roles(cfg)
    visible = common.visible_gpus() if visible is None else visible
    gpus = common.check(cfg, roles, visible)
    gpu_overrides = [f"{r}.gpus={gpus[r]}" for r in ("actor", "trainer") if visible and gpus[r]]
    values = {"RUN_DIR": resolve_run_dir(cfg, roles), "TNODES": cfg.trainer.nnodes,
              "TRAINER_NPROC": cfg.trainer.nproc, "ACTOR_CORES": cfg.actor.cpu_cores,
              "TRAINER_CORES": cfg.trainer.cpu_cores, "VERIFIER_CORES": cfg.verifier.cpu_cores,
              "ACTOR_GPUS": gpus["actor"], "TRAINER_GPUS": gpus["trainer"], "MODEL_PATH": cfg.model.path,
              "SYNC_PORT": cfg.sync.port}
    lines = [f"{k}={shlex.quote(str(v))}" for k, v in values.items()]
    lines += [f"ROLES=({' '.join(roles)})", f"GPU_OVERRIDES=({' '.join(map(shlex.quote, gpu_overrides))})"]
    return "\n".join(lines)


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
    steps = [r for r in common.read_jsonl(Path(run_dir) / "metrics_trainer.jsonl") if "trainer/done" not in r]
    evals = common.read_jsonl(Path(run_dir) / "eval.jsonl")
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
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "shell":
        try:
            print(shell(sys.argv[2:]))
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            sys.exit(2)
    elif cmd == "progress":
        progress(sys.argv[2])
    elif cmd == "summary":
        print(summary(sys.argv[2]))
    else:
        sys.exit("usage: python scripts/launch.py shell [section.key=value ...] | progress RUN_DIR | summary RUN_DIR")
