"""What an in-flight weight update costs a run, read off finished runs' metrics (a benchmark, not a test).

    .venv/bin/python bench/update_path.py RUN_DIR [RUN_DIR ...]

Per run, over the actor's one-second log windows between the trainer's first and last step:
- windows in which an update's pause-to-reply (actor/pause_s_max: pause call to the resume reply, as the
  actor's front-end sees it) took over 0.3 s: an update that waited for the engine to drain;
- pause-to-reply per update: mean and largest;
- admission blocked by the lag budget (actor/admission_blocked_s per second of wall);
- updates taken per version trained (1.0: every version reached the engines);
- engine tokens/s in the run (training and evaluation tokens), and the trainer's steps/s.
Compare runs made in one sitting only: the machine is shared.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.rundir import read_jsonl as records  # noqa: E402  (skips a torn line)


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
            "engine_tokens_per_s": float(np.mean([r["actor/engine_tokens_per_s"] for r in windows]))}


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


if __name__ == "__main__":
    main()
