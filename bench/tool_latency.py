"""Tool latency: where synchronous RL idles. The calc task (configs/calc.yaml: episodes with a
calculator) run by PipelineRL and by conventional RL (configs/conventional.yaml, the same code's
`actor.schedule`), each without tool latency and with every calculator step delayed by a time drawn
log-uniform in [lo, hi] (`actor.step_latency_s`, default 10 ms to 2 s). Runs go one at a time on
the same cores, the same steps each; a finished run (its DONE file) is kept.

    .venv/bin/python bench/tool_latency.py [--steps 200] [--latency 0.01 2.0] [--root DIR]

Writes <root>/latency.json, <root>/latency.txt (a Markdown table: per run the time to the target
test reward, samples/s, the engine's and the trainer's busy fractions, turns per episode, mean lag)
and <root>/latency.png (test reward and samples trained against wall time, one line per run; turns
per episode against the step).
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from scripts.launch import busy_fractions  # noqa: E402
from scripts.rundir import Run, read_jsonl  # noqa: E402

SCHEDULES = {"pipeline": [], "conventional": ["configs/conventional.yaml"]}


def settings(a) -> list:
    """(name, overrides) of every run."""
    lo, hi = a.latency
    return [(f"{s}-{tag}", ["configs/calc.yaml", *extra, f"actor.step_latency_s=[{lat[0]},{lat[1]}]",
                            f"trainer.max_steps={a.steps}", f"run.seed={a.seed}"])
            for tag, lat in (("no-latency", (0.0, 0.0)), (f"latency-{lo:g}-{hi:g}s", (lo, hi)))
            for s, extra in SCHEDULES.items()]


def summarize(name: str, run_dir: Path, target: float) -> dict:
    run = Run(run_dir)
    steps = [r for r in read_jsonl(run_dir / "metrics_trainer.jsonl") if "trainer/turns_mean" in r]
    engine, trainer = busy_fractions(run_dir)
    reach = run.first_reaching(target)
    return {"name": name, "run_dir": str(run_dir), "wall_s": round(float(run.t[-1]), 1),
            "steps": int(run.step[-1]), "samples_per_s": round(run.samples_per_s(), 1),
            "t_to_target": None if reach is None else round(float(reach[0]), 1),
            "first_test": float(run.test[0]), "final_test": float(run.test[-1]),
            "engine_busy": engine and round(engine, 3), "trainer_busy": trainer and round(trainer, 3),
            "turns_mean": round(float(np.mean([r["trainer/turns_mean"] for r in steps])), 3),
            "mean_lag": round(run.mean_lag(), 3),
            "curve": [[round(float(t), 1), float(v)] for t, v in zip(run.eval_t, run.test)],
            "turns": [[r["step"], r["trainer/turns_mean"]] for r in steps],
            "samples": [[round(float(t), 1), float(n)] for t, n in zip(run.t, run.samples)]}


def table(rows: list, target: float) -> str:
    lines = [f"| run | wall s | time to test {target:g} (s) | test first -> last | samples/s | engine busy "
             "| trainer busy | turns/episode | mean lag |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['wall_s']:.0f} | {r['t_to_target'] or 'not reached'} | "
                     f"{r['first_test']:.3f} -> {r['final_test']:.3f} | {r['samples_per_s']} | "
                     f"{r['engine_busy']} | {r['trainer_busy']} | {r['turns_mean']} | {r['mean_lag']} |")
    return "\n".join(lines) + "\n"


def figure(rows: list, path: Path, target: float, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, cx, bx) = plt.subplots(1, 3, figsize=(15, 4))
    for r in rows:
        style = "-" if r["name"].startswith("pipeline") else "--"
        t, v = zip(*r["curve"])
        ax.plot(t, v, style, marker=".", label=r["name"])
        t, n = zip(*r["samples"])
        cx.plot(t, n, style, label=f"{r['name']}: {r['samples_per_s']:g}/s")
        s, turns = zip(*r["turns"])
        bx.plot(s, turns, style, label=r["name"])
    cx.set_xlabel("wall time (s)")
    cx.set_ylabel("samples trained")
    cx.legend(fontsize=8)
    ax.axhline(target, color="grey", lw=0.5)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("test reward (greedy, 300 problems)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    bx.set_xlabel("optimizer step")
    bx.set_ylabel("turns per episode (2: one calculator call)")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--latency", type=float, nargs=2, default=[0.01, 2.0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--root", default=str(REPO / "runs" / "tool-latency"))
    a = ap.parse_args(argv)
    root = Path(a.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.time()
    for name, overrides in settings(a):
        run_dir = root / name
        if not (run_dir / "DONE").exists():
            cmd = ["bash", "run.sh", *overrides, f"run.dir={run_dir}"]
            print(f"[latency] {time.strftime('%H:%M:%S')} {' '.join(cmd)}", flush=True)
            with open(root / f"{name}.log", "w") as log:
                rc = subprocess.call(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            if rc != 0:
                sys.exit(f"[latency] {name} failed (exit {rc}): see {root}/{name}.log")
            (run_dir / "DONE").touch()
        rows.append(summarize(name, run_dir, a.target))
    (root / "latency.json").write_text(json.dumps(rows, indent=1))
    title = f"calc, {a.steps} steps, tool latency log-uniform {a.latency[0]:g}-{a.latency[1]:g} s"
    (root / "latency.txt").write_text(f"# Tool latency: {title}\n\n" + table(rows, a.target))
    figure(rows, root / "latency.png", a.target, title)
    print(table(rows, a.target))
    print(f"[latency] {len(rows)} runs in {time.time() - t0:.0f} s: {root}/latency.txt, {root}/latency.png")


if __name__ == "__main__":
    main()
