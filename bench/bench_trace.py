"""What recording the timeline (run.trace) costs, from the cost of one record and a run's own record
rate: a bound that does not depend on how noisy the machine is, unlike two runs' steps/s side by side
(on the shared 2-core development machine, four default runs of 150 steps measured 1.16-1.42 steps/s
with the trace on and off alike: run-to-run noise of +-10% hides a cost of a few tenths of a percent).

    .venv/bin/python bench/bench_trace.py RUN_DIR [RUN_DIR ...]

For each events_<track>.jsonl of each run: records per second of the run, times the measured cost of
one record (telemetry.Events: a list append, a JSON line written once a second), plus, for the engine,
the bookkeeping of every decode step (telemetry.EngineTimeline.step: a few float
additions per step, measured on a bare instance), as a fraction of one core's time. Prints one line
per track and the largest fraction."""
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.rundir import read_events  # noqa: E402
from scripts import telemetry  # noqa: E402
from scripts.telemetry import EngineTimeline, StepClock  # noqa: E402


def record_cost(n=200_000) -> float:
    """Seconds per Events.counter call, its share of the once-a-second write included."""
    with tempfile.TemporaryDirectory() as d:
        events = telemetry.Events(d, "bench", True)
        t0 = time.perf_counter()
        for i in range(n):
            events.counter("engine", time.time(), busy=0.5, inflight=float(i), tokens_per_s=1.0)
        events.flush()
        seconds = (time.perf_counter() - t0) / n
        events.path = Path(os.devnull)  # its exit flush: the directory is gone by then
        return seconds


def step_cost(n=200_000) -> float:
    """Seconds per decode step of the engine's bucket bookkeeping (EngineTimeline.step), records
    included."""
    with tempfile.TemporaryDirectory() as d:
        events = telemetry.Events(d, "engine-bench", True)
        timeline = EngineTimeline(events, StepClock(cuda=False))
        t0 = time.perf_counter()
        for i in range(n):
            timeline.step(i * 1e-3, i * 1e-3 + 1e-6, 64)  # a step a millisecond, 64 sequences
        events.flush()
        seconds = (time.perf_counter() - t0) / n
        events.path = Path(os.devnull)
        return seconds


def main(run_dirs):
    per_record, per_step = record_cost(), step_cost()
    print(f"one record: {per_record * 1e6:.2f} us; the engine's bookkeeping per decode step: "
          f"{per_step * 1e6:.2f} us")
    worst = 0.0
    for run in map(Path, run_dirs):
        for path in sorted(run.glob("events_*.jsonl")):
            records = read_events(path)
            times = [r[2] for r in records if r[0] in ("X", "C")]
            if len(times) < 2:
                continue
            wall = max(times) - min(times)
            rate = len(times) / wall
            fraction = rate * per_record
            steps = ""
            if path.name.startswith("events_engine"):
                # decode steps a second: sequences per step over tokens a second, bucket by bucket
                counters = [r[3] for r in records if r[0] == "C" and r[3].get("inflight")]
                steps_per_s = sum(c["tokens_per_s"] / c["inflight"] for c in counters) / max(
                    len(counters), 1)
                fraction += steps_per_s * per_step
                steps = f", {steps_per_s:.0f} decode steps/s"
            worst = max(worst, fraction)
            print(f"{run.name}/{path.name}: {rate:.1f} records/s{steps} -> "
                  f"{fraction * 100:.3f}% of a core")
    print(f"largest: {worst * 100:.3f}% of a core")


if __name__ == "__main__":
    main(sys.argv[1:])
