"""Does the pipeline keep both halves busy? Figures read off finished runs' own metrics (no re-measurement;
not a test).

    .venv/bin/python bench/run_figures.py RUN_DIR [RUN_DIR ...] [--alone TOKENS_PER_S] [--gain 0.25]

Per run:
- steps, wall (first step's start to the last step), steps/s;
- trainer utilisation = Σ trainer/train_s / wall; the shares of waiting for samples (wait_s) and of
  sending weights on the trainer's critical path (broadcast_s);
- engine tokens/s in the run: the actor's all-token rate (actor/engine_tokens_per_s: training and
  evaluation tokens) where the run logs it, else actor/tokens_per_s (training tokens only), averaged over
  the actor's records between the trainer's first and last step; with --alone, its ratio to the same engine measured alone (bench/bench_engine_util.py or
  bench/bench_actor_alone.py);
- update stall per update vs its wire + load (actor/update_wire_s, update_load_s): as the actor's front-end
  sees it (actor/pause_s_mean: pause call to resume reply) and as the engine does (actor/update_stall_s:
  the gap between the decode steps around an update, timed in the vLLM worker);
- time to target: training time (from the first step's start) until three consecutive evaluations
  average >= the warm start (the v0 evaluation) + --gain.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.rundir import read_jsonl as records  # noqa: E402  (skips a torn line)


def figures(run_dir, gain=0.25, alone=None):
    d = Path(run_dir)
    steps = [r for r in records(d / "metrics_trainer.jsonl") if "trainer/train_s" in r]
    actor = records(d / "metrics_actor.jsonl")
    evals = sorted(records(d / "eval.jsonl"), key=lambda e: e["version"])
    if not steps:
        return {"run": str(d), "error": "no trainer steps"}
    # Time zero: when the first step started training (its wait for the first batch excluded).
    t0 = steps[0]["time"] - steps[0]["trainer/train_s"] - steps[0].get("trainer/broadcast_s", 0.0)
    wall = steps[-1]["time"] - t0
    train = sum(r["trainer/train_s"] for r in steps)
    wait = sum(r.get("trainer/wait_s", 0.0) for r in steps[1:])  # the first wait is start-up
    bcast = sum(r.get("trainer/broadcast_s", 0.0) for r in steps)
    out = {"run": str(d), "steps": steps[-1]["step"], "wall_s": round(wall, 1),
           "steps_per_s": round(len(steps) / wall, 3), "trainer_util": round(train / wall, 3),
           "wait_frac": round(wait / wall, 3), "broadcast_frac": round(bcast / wall, 3)}
    inside = [r for r in actor if t0 <= r["time"] <= steps[-1]["time"]]
    key = "actor/engine_tokens_per_s" if any("actor/engine_tokens_per_s" in r for r in inside) else "actor/tokens_per_s"
    rates = [r[key] for r in inside if key in r]
    if rates:
        out["engine_tokens_per_s"] = round(float(np.mean(rates)), 0)
        out["engine_rate_key"] = key
        if alone:
            out["engine_vs_alone"] = round(float(np.mean(rates)) / alone, 3)
    pauses = [r["actor/pause_s_mean"] for r in inside if r.get("actor/pause_s_mean")]
    if pauses:
        out["pause_ms_median"] = round(1e3 * float(np.median(pauses)), 1)
    wl = [(r["actor/pause_s_mean"], r["actor/update_wire_s"] + r["actor/update_load_s"]) for r in inside
          if r.get("actor/pause_s_mean") and r.get("actor/update_wire_s") is not None and "actor/update_load_s" in r]
    if wl:  # the front-end's view: pause call to resume reply (includes its own scheduling delays)
        out["pause_over_wire_load"] = round(float(np.median([p / max(w, 1e-9) for p, w in wl])), 2)
    g = [(r["actor/update_stall_s"], r["actor/update_stall_wire_load_s"]) for r in inside
         if r.get("actor/update_stall_s") is not None]
    if g:  # the engine's view: the gap between its decode steps around an update
        out["engine_stall_ms_median"] = round(1e3 * float(np.median([s for s, _ in g])), 1)
        out["engine_stall_over_wire_load"] = round(float(np.median([s / max(w, 1e-9) for s, w in g])), 2)
    if evals and evals[0]["version"] == 0:
        start = evals[0]["test_reward"]
        out["warm_start"] = round(start, 3)
        rewards = [e["test_reward"] for e in evals]
        for i in range(2, len(evals)):
            if np.mean(rewards[i - 2:i + 1]) >= start + gain:
                out["time_to_gain_s"] = round(evals[i]["time"] - t0, 1)
                out["gain_at"] = f"v{evals[i - 2]['version']}-v{evals[i]['version']}: " + \
                    "/".join(f"{r:.3f}" for r in rewards[i - 2:i + 1])
                break
        else:
            out["time_to_gain_s"] = None
        last3 = rewards[-3:]
        out["last3_mean"] = round(float(np.mean(last3)), 3)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--gain", type=float, default=0.25)
    ap.add_argument("--alone", type=float, default=None, help="the engine's tokens/s measured alone at the same h")
    args = ap.parse_args()
    for run in args.runs:
        print(json.dumps(figures(run, args.gain, args.alone)))


if __name__ == "__main__":
    sys.exit(main())
