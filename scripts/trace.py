"""A run's timeline as one Chrome trace-event JSON, for ui.perfetto.dev or chrome://tracing.

    .venv/bin/python scripts/trace.py RUN_DIR [-o OUT.json]      (default: RUN_DIR/trace.json)

Reads the events files the roles append to (telemetry.Events; the format is in docs/TRACE.md):
events_actor<p>.jsonl, events_engine<p>-<e>.jsonl, events_verifier.jsonl, events_trainer<rank>.jsonl.
One process (pid) per file; within it one thread (tid) per lane, the part of a span's name before
"/" ("admission/lag" and "admission/capacity" share the row "admission"); spans become complete
events ("X"), counters one counter event ("C") per value. Times are each host's time.time(), put
on one axis starting at the run's first event: tracks of different hosts are as aligned as their
clocks (NTP: typically within milliseconds).
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# the project's reader of an events file, which skips a line torn by a killed writer
from scripts.rundir import read_events  # noqa: E402


def to_trace(run_dir) -> dict:
    """-> {"traceEvents": [...], "displayTimeUnit": "ms"}, in microseconds from the first event."""
    files = sorted(Path(run_dir).glob("events_*.jsonl"))
    tracks = {f.stem.removeprefix("events_"): read_events(f) for f in files}
    times = [r[2] for records in tracks.values() for r in records if r[0] in ("X", "C")]
    t0 = min(times, default=0.0)
    out = []
    for pid, (track, records) in enumerate(tracks.items(), start=1):
        hosts = sorted({r[1] for r in records if r[0] == "M"})
        name = f"{track} ({', '.join(hosts)})" if hosts else track
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                    "args": {"name": name}})
        lanes = {}
        for kind, what, t, *rest in (r for r in records if r[0] in ("X", "C")):
            ts = round((t - t0) * 1e6)  # whole microseconds: adjacent spans then meet exactly
            if kind == "C":
                for key, value in rest[0].items():
                    out.append({"ph": "C", "name": f"{what} {key}", "ts": ts, "pid": pid,
                                "args": {key: value}})
                continue
            lane = what.split("/")[0]
            if lane not in lanes:
                lanes[lane] = len(lanes) + 1
                out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": lanes[lane],
                            "args": {"name": lane}})
            dur = round((t + rest[0] - t0) * 1e6) - ts
            out.append({"ph": "X", "name": what, "ts": ts, "dur": dur, "pid": pid,
                        "tid": lanes[lane], "args": rest[1]})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir")
    p.add_argument("-o", "--out", help="output JSON (default: RUN_DIR/trace.json)")
    args = p.parse_args(argv)
    trace = to_trace(args.run_dir)
    if not trace["traceEvents"]:
        sys.exit(f"{args.run_dir}: no events_*.jsonl (was the run made with run.trace=false?)")
    out = Path(args.out or Path(args.run_dir) / "trace.json")
    out.write_text(json.dumps(trace))
    print(f"{out}: {len(trace['traceEvents'])} events; open it in ui.perfetto.dev or "
          "chrome://tracing")


if __name__ == "__main__":
    main()
