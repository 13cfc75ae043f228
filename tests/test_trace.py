"""The timeline and the numbers a person reads: a short real run's trace (tier c), the bottleneck
statement on synthetic run directories, the actor's lag against the engine's version, and the
progress display of a resumed run (tier a).

Run: bash run.sh test tests/test_trace.py      (~1.5 minutes on 2 cores: one short run.sh)
"""
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

import common
from actor import token_lags
from conftest import REPO, read_jsonl
from scripts import launch, telemetry
from scripts.rundir import read_events
from scripts.trace import to_trace
from test_e2e import finish, short_config, start


def check_spans_nest(events):
    """Within each (pid, tid), two spans are either disjoint or one holds the other."""
    rows = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
            rows[e["pid"], e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for spans in rows.values():
        open_ends = []  # ends of the spans holding the current one
        for start_us, end_us, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start_us:
                open_ends.pop()
            assert not open_ends or end_us <= open_ends[-1], f"{name} overlaps its row's span"
            open_ends.append(end_us)


def test_trace_of_a_short_run(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    rc, out = finish(start(short_config(tiny_model_dir, run_dir, **{"trainer.max_steps": 6})))
    assert rc == 0, out[-6000:]
    assert any(line.startswith("bottleneck: ") for line in out.splitlines()), out[-3000:]
    # a lag is never negative, also in the log line after an update (the engine labels first)
    actor = [r for r in read_jsonl(run_dir / "metrics_actor.jsonl") if "actor/lag_min" in r]
    assert actor and min(r["actor/lag_min"] for r in actor) >= 0
    assert any(r.get("actor/engine_busy") is not None for r in actor)

    # the recorder's own files: counters in time order, per file and name
    files = {f.stem.removeprefix("events_"): read_events(f) for f in run_dir.glob("events_*.jsonl")}
    assert {"actor0", "engine0-0", "verifier", "trainer0"} <= set(files), sorted(files)
    for track, records in files.items():
        last = defaultdict(float)
        for kind, name, t, *_ in (r for r in records if r[0] == "C"):
            assert t >= last[name], (track, name)
            last[name] = t

    # one valid trace-event JSON with a track per process
    cmd = [sys.executable, "scripts/trace.py", str(run_dir), "-o", str(tmp_path / "t.json")]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    trace = json.loads((tmp_path / "t.json").read_text())
    events = trace["traceEvents"]
    assert all({"ph", "name", "pid"} <= set(e) for e in events)
    assert all(isinstance(e["ts"], (int, float)) for e in events if e["ph"] in "XC")
    processes = {e["args"]["name"].split()[0]: e["pid"] for e in events
                 if e["name"] == "process_name"}
    assert {"actor0", "engine0-0", "verifier", "trainer0"} <= set(processes)
    names = defaultdict(set)
    for e in events:
        if e["ph"] in "XC":
            names[e["pid"]].add(e["name"])
    expect = {"actor0": {"update"}, "engine0-0": {"receive", "engine inflight", "engine tokens_per_s",
                                                "engine busy"},
              "verifier": {"verifier scored_per_s", "verifier groups_completed",
                           "verifier groups_dropped"},
              "trainer0": {"wait", "step/forward_backward", "step/optimizer", "send"}}
    for track, want in expect.items():
        assert want <= names[processes[track]], (track, names[processes[track]])
    assert any(n.startswith("admission/") for n in names[processes["actor0"]])
    assert "eval" in names[processes["actor0"]]
    check_spans_nest(events)
    # the engine's occupancy: sequences in flight at some point, within max_inflight + eval slots
    inflight = [e["args"]["inflight"] for e in events if e["name"] == "engine inflight"]
    assert max(inflight) > 0 and max(inflight) <= 32 + 8


def test_events_recorder_buffers_and_can_be_off(tmp_path):
    ev = telemetry.Events(tmp_path, "x")
    ev.span("a/b", 1.0, end=2.5, k=1)
    ev.counter("c", 3.0, v=2)
    assert not (tmp_path / "events_x.jsonl").exists() or ev.buf  # not written per record
    ev.flush()
    assert read_events(tmp_path / "events_x.jsonl")[1:] == [["X", "a/b", 1.0, 1.5, {"k": 1}],
                                                            ["C", "c", 3.0, {"v": 2}]]
    off = telemetry.Events(tmp_path, "y", on=False)
    off.span("a", 1.0)
    off.counter("c", 1.0, v=1)
    assert off.buf[1:] == [] and not (tmp_path / "events_y.jsonl").exists()
    trace = to_trace(tmp_path)["traceEvents"]
    assert [e["ph"] for e in trace] == ["M", "M", "X", "C"]  # process and row names, then events
    assert trace[2]["ts"] == 0.0 and trace[2]["dur"] == 1.5e6 and trace[3]["ts"] == 2e6


# --- the bottleneck statement, on synthetic run directories ------------------------------------

def synthetic_run(run_dir: Path, engine_busy: float, step_s: float, wait_s: float):
    """metrics as the roles write them: the actor's engine busy fraction each second, 20 trainer
    steps of step_s seconds, each waiting wait_s for samples; B = 128."""
    run_dir.mkdir()
    cfg = common.config_to_dict(common.load_config([]))
    (run_dir / "config.yaml").write_text(json.dumps(cfg))  # JSON is YAML
    with open(run_dir / "metrics_actor.jsonl", "w") as f:
        for i in range(20):
            record = {"step": i, "time": 100.0 + i, "actor/engine_busy": engine_busy}
            f.write(json.dumps(record) + "\n")
    with open(run_dir / "metrics_trainer.jsonl", "w") as f:
        for i in range(20):
            record = {"step": i + 1, "time": 100.0 + step_s * (i + 1), "trainer/wait_s": wait_s,
                      "trainer/busy": 1 - wait_s / step_s, "trainer/samples_total": 128 * (i + 1)}
            f.write(json.dumps(record) + "\n")


def test_bottleneck_names_the_slow_side(tmp_path):
    # the engine made slow: decoding all the time, the trainer waits 0.6 of each 1 s step
    synthetic_run(tmp_path / "gen", engine_busy=0.97, step_s=1.0, wait_s=0.6)
    line = launch.bottleneck(tmp_path / "gen")
    assert line.startswith("bottleneck: generation — engine busy 0.97, trainer busy 0.40"), line
    assert "more generation devices" in line
    # the trainer made slow: it never waits, the engine idles for the lag budget
    synthetic_run(tmp_path / "train", engine_busy=0.30, step_s=2.0, wait_s=0.0)
    line = launch.bottleneck(tmp_path / "train")
    assert line.startswith("bottleneck: training — trainer busy 1.00, engine busy 0.30"), line
    assert "more trainer ranks" in line
    # the model's split of the 2 cores of the default config: 1 + 1 is the only one
    split = launch.device_split(tmp_path / "train")
    assert "of these 2 cores, 1 generating + 1 training" in split, split
    assert launch.bottleneck(tmp_path / "missing").startswith("bottleneck: unknown")


def test_device_split_moves_devices_to_the_slow_side(tmp_path):
    """4 trainer cores each training at 64 samples/s (busy), 1 engine core generating 64 while
    saturated: the model gives the engine side more cores."""
    synthetic_run(tmp_path / "run", engine_busy=1.0, step_s=2.0, wait_s=1.5)
    cfg = common.config_to_dict(common.load_config(["trainer.cpu_cores=1-4", "actor.cpu_cores=0"]))
    (tmp_path / "run" / "config.yaml").write_text(json.dumps(cfg))
    split = launch.device_split(tmp_path / "run")
    # 64 samples/s: 64 per generation core, 64 / (0.25 * 4) = 64 per training core -> 2 + 3 or 3 + 2
    assert "of these 5 cores, 2 generating + 3 training" in split, split


# --- lag: against the engine's version --------------------------------------------------------

def test_token_lags_never_negative_after_the_engine_labels_a_new_version():
    """The engine labelled version 4 (the sample's last token) before update_weights returned and
    the actor's counter moved from 3: the engine's version is 4, so those tokens have lag 0."""
    versions = np.array([2, 3, 3, 4], dtype=np.int32)
    assert token_lags(3, versions).tolist() == [2, 1, 1, 0]
    assert token_lags(5, versions).tolist() == [3, 2, 2, 1]  # the actor's counter already ahead
    assert token_lags(3, np.zeros(0, np.int32)).tolist() == []


# --- progress display of a resumed run ------------------------------------------------------------

def test_progress_of_a_resumed_run_shows_where_it_resumes_then_new_steps(tmp_path):
    def step(i):
        return json.dumps({"step": i, "time": 1000.0 + i, "trainer/reward_mean": 0.5,
                           "trainer/samples_total": 128 * i,
                           "trainer/samples_per_s": 2000.0}) + "\n"
    path = tmp_path / "metrics_trainer.jsonl"
    path.write_text("".join(step(i) for i in range(1, 8)))
    (tmp_path / "eval.jsonl").write_text('{"version": 5, "test_reward": 0.25}\n')
    cmd = [sys.executable, "scripts/launch.py", "progress", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith(f"resuming {tmp_path.name} after step 7 | test 0.250 (v5)"), first
        with open(path, "a") as f:
            f.write(step(8) + step(9) + step(10))
        lines = [proc.stdout.readline() for _ in range(3)]
    finally:
        proc.kill()
        proc.wait()
    assert [int(x.split()[1]) for x in lines] == [8, 9, 10], lines  # no old step replayed
    # samples/s over the window: 128 samples a second, not one step's 2000
    assert "| 128.0 samples/s (10 s avg) |" in lines[-1], lines[-1]


def test_timeline_figure_from_synthetic_events(tmp_path):
    """scripts/plot.py --timeline draws from two runs' events files (no run needed)."""
    from scripts import plot
    for name, updates in (("conv", [10.0, 20.0, 30.0, 40.0]), ("pipe", [])):
        run = tmp_path / name
        run.mkdir()
        ev = telemetry.Events(run, "actor0")
        for t in updates:
            ev.span("update", t - 0.1, end=t)
        ev.flush()
        ev = telemetry.Events(run, "engine1")
        for i in range(200):  # conventional: fills, drains, idles; the same counters for both
            ev.counter("engine", i * 0.25, busy=1.0, inflight=float(200 - i % 40 * 5),
                       tokens_per_s=4000.0)
        ev.flush()
        ev = telemetry.Events(run, "trainer0")
        ev.span("step/forward_backward", 18.0, end=19.0)
        ev.flush()
    plot.main(["--timeline", str(tmp_path / "conv"), str(tmp_path / "pipe"),
               "--out", str(tmp_path / "fig")])
    assert (tmp_path / "fig" / "timeline.png").stat().st_size > 0


def test_timeline_picks_an_rl_step_no_evaluation_overlaps(tmp_path):
    """The conventional RL step drawn is the one nearest the middle that no evaluation overlaps (an
    evaluation adds its own sequences to h); with none free, the middle one."""
    from scripts import plot
    for name, updates, evals in (("conv", [10.0, 20.0, 30.0, 40.0, 50.0], [(21.0, 33.0)]),
                                 ("busy", [10.0, 20.0, 30.0], [(5.0, 35.0)]), ("pipe", [], [])):
        run = tmp_path / name
        run.mkdir()
        ev = telemetry.Events(run, "actor0")
        for t in updates:
            ev.span("update", t - 0.1, end=t)
        for s, e in evals:
            ev.span("eval", s, end=e, version=0)
        ev.flush()
        ev = telemetry.Events(run, "engine1")
        for i in range(240):
            ev.counter("engine", i * 0.25, busy=1.0, inflight=100.0, tokens_per_s=1000.0)
        ev.flush()
    # steps [10, 20], [20, 30], [30, 40], [40, 50]: the middle one ([20, 30]) and [30, 40] hold the
    # evaluation; [10, 20] is the nearest free one
    drawn = plot.main(["--timeline", str(tmp_path / "conv"), str(tmp_path / "pipe"), "--out", str(tmp_path / "a")])
    assert (drawn["conventional_start"], drawn["span"]) == pytest.approx((10.0, 10.0))
    assert (tmp_path / "a" / "timeline.png").stat().st_size > 0
    drawn = plot.main(["--timeline", str(tmp_path / "busy"), str(tmp_path / "pipe"), "--out", str(tmp_path / "b")])
    assert (drawn["conventional_start"], drawn["span"]) == pytest.approx((10.0, 10.0))  # the middle one


def test_bench_trace_bounds_the_recording_cost(tmp_path, capsys):
    """bench/bench_trace.py: a run's record rate times the measured cost of one record. On a
    synthetic run of 10 s with 40 engine counters (4 a second, h=100 at 3,000 tokens/s: 30 decode
    steps a second) the rate and the step rate it reports are those."""
    sys.path.insert(0, str(REPO / "bench"))
    import bench_trace
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps(["M", "host", 1])]
    lines += [json.dumps(["C", "engine", 1000.0 + i * 0.25, {"busy": 0.9, "inflight": 100.0,
                                                                "tokens_per_s": 3000.0}])
              for i in range(41)]
    (run / "events_engine1.jsonl").write_text("\n".join(lines) + "\n")
    bench_trace.main([str(run)])
    out = capsys.readouterr().out
    assert "events_engine1.jsonl: 4.1 records/s, 30 decode steps/s" in out, out
    fraction = float(out.strip().splitlines()[-1].split()[1].rstrip("%"))
    assert 0 < fraction < 1, out
