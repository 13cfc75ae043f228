"""What an in-flight weight update costs a run, read off finished runs' metrics (a benchmark, not a test).

    .venv/bin/python bench/update_path.py RUN_DIR [RUN_DIR ...]

Per run, over the actor's one-second log windows between the trainer's first and last step:
- windows in which an update's pause-to-reply (actor/pause_s_max: pause call to the resume reply, as the
  actor's front-end sees it) took over 0.3 s: an update that waited for the engine to drain;
- pause-to-reply per update: mean and largest;
- admission blocked by the lag budget (actor/admission_blocked_s per second of wall);
- updates taken per version trained (1.0: every version reached the engines);
- engine tokens/s in the run (training and evaluation tokens), and the trainer's steps/s;
and over the same stretch, from the events files (run.trace) and the engine's own measurements:
- the actor's `update` spans (pause, receive and load, label, resume) as a share of its wall, and their
  mean: what an update costs the actor's loop, the engine's step in flight when the pause arrives
  included (it decodes meanwhile);
- the engine's stall per update (actor/update_stall_s: the gap between decode steps an update leaves,
  timed in the engine) as a share of the wall, with its median and the median decode step;
- the engine's busy fraction (actor/engine_busy), and run.sh's closing `bottleneck:` and
  `throughput model:` lines (samples/s measured against the model's prediction for the run's split).
Compare runs made in one sitting only: the machine is shared.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts import launch  # noqa: E402
from scripts.rundir import read_events, read_jsonl as records  # noqa: E402  (skip a torn line)


def figures(run_dir) -> dict:
    d = Path(run_dir)
    steps = [r for r in records(d / "metrics_trainer.jsonl") if "trainer/train_s" in r]
    t0, t1 = steps[0]["time"], steps[-1]["time"]
    windows = [r for r in records(d / "metrics_actor.jsonl")
               if t0 <= r["time"] <= t1 and "actor/pause_s_max" in r]
    with_update = [r for r in windows if r["actor/pause_s_max"] > 0]
    pause_max = np.array([r["actor/pause_s_max"] for r in with_update])
    pause_mean = np.array([r["actor/pause_s_mean"] for r in with_update])
    updates = windows[-1]["actor/updates"] - windows[0]["actor/updates"]
    versions = windows[-1]["actor/version"] - windows[0]["actor/version"]
    return {"run": d.name, "steps": len(steps), "steps_per_s": (len(steps) - 1) / (t1 - t0),
            "windows_over_0.3s": float((pause_max > 0.3).mean()) if len(pause_max) else 0.0,
            "pause_s_mean": float(pause_mean.mean()) if len(pause_mean) else 0.0,
            "pause_s_max": float(pause_max.max(initial=0.0)),
            "blocked_s_per_s": float(np.mean([r["actor/admission_blocked_s"] for r in windows])),
            "updates_per_version": updates / max(versions, 1),
            "engine_tokens_per_s": float(np.mean([r["actor/engine_tokens_per_s"] for r in windows])),
            **shares(d, t0, t1, windows)}


def shares(d: Path, t0: float, t1: float, windows: list) -> dict:
    """The update spans' and the engine stalls' shares of the wall between t0 and t1 (see above)."""
    spans = [r for r in read_events(d / "events_actor0.jsonl")
             if r[0] == "X" and r[1] == "update" and t0 <= r[2] <= t1]
    stalls = np.array([r["actor/update_stall_s"] for r in windows
                       if r.get("actor/update_stall_s") is not None])
    # the stall is reported once per window: the window's updates each stalled about that long
    stalled = sum(r["actor/update_stall_s"] * max(r["actor/updates"] - q["actor/updates"], 0)
                  for q, r in zip(windows, windows[1:]) if r.get("actor/update_stall_s") is not None)
    # decode step: occupancy over tokens/s while busy, per 0.25-s bucket of the engine's counters
    counters = [r[3] for path in sorted(d.glob("events_engine*.jsonl")) for r in read_events(path)
                if r[0] == "C" and t0 <= r[2] <= t1 and r[3].get("tokens_per_s")]
    step = [c["inflight"] / c["tokens_per_s"] * c["busy"] for c in counters]
    busy = [r["actor/engine_busy"] for r in windows if r.get("actor/engine_busy") is not None]
    return {"update_share": sum(r[3] for r in spans) / (t1 - t0),
            "update_s_mean": float(np.mean([r[3] for r in spans])) if spans else 0.0,
            "stall_share": stalled / (t1 - t0),
            "stall_s_median": float(np.median(stalls)) if len(stalls) else 0.0,
            "step_s_median": float(np.median(step)) if step else 0.0,
            "engine_busy": float(np.mean(busy)) if busy else 0.0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    for run in ap.parse_args().runs:
        f = figures(run)
        print(f"{f['run']}: {f['steps']} steps, {f['steps_per_s']:.3f} steps/s; windows with an update "
              f"waiting > 0.3 s: {f['windows_over_0.3s']:.0%}; pause-to-reply mean "
              f"{f['pause_s_mean'] * 1e3:.0f} ms, max {f['pause_s_max']:.2f} s; admission blocked "
              f"{f['blocked_s_per_s']:.2f} s/s; updates per version {f['updates_per_version']:.2f}; "
              f"engine {f['engine_tokens_per_s']:.0f} tokens/s")
        print(f"  update spans {f['update_share']:.1%} of the actor's wall ({f['update_s_mean'] * 1e3:.0f} ms "
              f"each); engine stalls {f['stall_share']:.1%} of the wall (median {f['stall_s_median'] * 1e3:.1f} "
              f"ms, decode step {f['step_s_median'] * 1e3:.1f} ms); engine busy {f['engine_busy']:.3f}")
        print(f"  {launch.bottleneck(run)}\n  {launch.device_split(run)}")


if __name__ == "__main__":
    main()
