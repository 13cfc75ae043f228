"""The paper's throughput model (Appendix A, scripts/throughput_model.py) fed with what the long-tailed
task's runs measured: predicted vs measured samples/s per run, and the ratio PipelineRL / conventional RL
predicted vs measured. It reads run directories only: no new run, nothing re-measured.

    .venv/bin/python bench/longtail_model.py                  # the 2026-12-03 long-tail runs (DEFAULT_RUNS)
    .venv/bin/python bench/longtail_model.py RUN_DIR [...]    # any run directories made with run.trace=true
    .venv/bin/python bench/longtail_model.py --json out.json  # also write the numbers as JSON

A few seconds of one core: it parses the runs' JSONL files. Per run directory it reads

  config.yaml             the setting: schedule, actor.max_inflight (H), G_steps, batch size B, cores
  events_engine*.jsonl    the engine's counters (docs/TRACE.md), one record per >= 0.25 s bucket:
                          `inflight` (occupancy h), `tokens_per_s`, `busy`; its `receive` spans (weight loads)
  events_trainer*.jsonl   the trainer's `step/*` spans and `wait` spans (conventional RL: one RL step's parts)
  samples_trainer*.jsonl  each trained sample's completion tokens: the sum of its `version_runs` counts
                          (every trainer rank's file, the steps a restarted trainer redid once)
  metrics_trainer.jsonl   per optimizer step `train_s`, `samples_total`, `time`
  metrics_actor.jsonl     `actor/tokens_per_s` (training) and `actor/engine_tokens_per_s` (training and
                          evaluation), integrated over time: evaluation's share of the engine's tokens

and estimates

  U(h)     (estimate_u) the engine's tokens per wall-clock second at occupancy h: the median
           `tokens_per_s` of the buckets whose `inflight` lies in each h bin (H_EDGES), placed at the
           bin's median h. Kept buckets: they ran (h > 0; an idle gap's zero record is no bucket), last
           >= 0.2 s (the bucket cut short at an idle gap holds a step or two), hold no weight load (the
           engine's `receive` span: a pause, counted apart below), and, where the engine and the trainer
           share cores (conventional RL), overlap no training step (an evaluation left decoding while the
           trainer trains is slowed by it). A bin needs 8 buckets (2 s of engine time): fewer is a moment,
           e.g. PipelineRL's first 2 s at h = 320 with every sequence young and cheap to decode.
           Not a busy > 0.9 filter: `busy` is the share of the wall inside the worker's decode calls, and
           the rest of the wall at large h is the engine's own per-step work (scheduler, output
           processing), not starvation: conventional G = 8 with 1024 sequences queued and nothing to wait
           for reads busy 0.65. Keeping only busy > 0.9 buckets keeps the few-sequence tail and
           prefill-heavy buckets and reads U(256) at ~2k instead of ~4.5k tokens/s. Idle gaps over
           0.25 s lie outside every bucket already (docs/TRACE.md).
  lengths  the completion lengths of all the run's trained samples (its own policy's distribution).
  trainer  completion tokens of the whole batch (zero-advantage samples included: the trainer skips
           them, which makes a step cheaper) per second of `train_s`, on the trainer's cores.

The model, with scripts/throughput_model.py's functions, three ways:

  own      the run's own rates: its U(h) (its engine as one unit on its cores: one core for PipelineRL,
           both for conventional RL), its trainer's speed on its cores, its lengths. PipelineRL:
           r_pipeline(N=2, I=1, H, U, tau) = min(U(H), 1/tau). Conventional RL: B*G sequences drawn from
           the run's lengths (20 draws, mean) through t_gen_slots(slots=H, N=1, U), then
           r_conventional (generation and training take turns).
  +eval    the same with evaluation's measured share of the engine's tokens taken off generation (the
           evaluation decodes beside training in extra slots; the paper's model has no evaluation).
  per-core throughput_model.predict() as the project uses it with bench/bench_engine_util.py: U per core
           and tau from the PipelineRL lr 1e-4 run's one-core engine and one-core trainer, each run's
           lengths; conventional RL then gets N = 2 cores, each decoding h/2 sequences at the per-core U
           (the assumption that two cores decode twice as fast as one).
  samples/s = tokens per second / mean completion length. Measured: the samples trained between the first
  and the last optimizer step / the seconds between them (metrics_trainer.jsonl).

Besides: each run's engine steadiness (per-minute median tokens/s at h within 25% of H: a run whose
engine varies more than 1.5x within the run was disturbed and is no test of the model; a disturbed
conventional run is then also predicted from an undisturbed conventional run's rates), where PipelineRL's
engine time goes (tokens/s over the run / U(H), its mean h, the share of the wall the updates stall the
engine: updates x mean actor/update_stall_s, of which weight loads; the share the lag budget holds
admission: events_actor's admission/lag spans),
and conventional RL's RL step split into generation (the trainer's `wait`), training and the rest,
measured vs the model.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from scripts.rundir import read_jsonl, read_samples, timeline  # noqa: E402
from scripts.throughput_model import (MeasuredU, predict, r_conventional, r_pipeline,  # noqa: E402
                                      t_gen_slots)
import common  # noqa: E402

DEFAULT_RUNS = ["runs/repro-longtail/pipeline-default-s0", "runs/lt-probe/conventional-G8-H1024",
                "runs/lt-probe/conventional-G2-H256", "runs/lt-probe/lr3e-4", "runs/lt-probe/lr1e-3"]
# occupancy bins (sequences per step): fine where U rises, coarser where it flattens
H_EDGES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 288, 320, 384, 448, 512, 640, 768,
           896, 1024, 1152, 1280, 1536, 2048)
MIN_BUCKET_S = 0.2
MIN_BUCKETS = 8  # 2 s of engine time: fewer is a start-up moment (e.g. PipelineRL's first 2 s at h = 320)
STEADY_MAX = 1.5  # a run whose engine's per-minute speed at h ~ H varies more than this is flagged
DRAWS = 20


# --- what the runs measured ------------------------------------------------------------------------------

def _overlaps(starts, ends, spans):
    """Whether each interval [starts[i], ends[i]) overlaps any of spans [(start, end)]."""
    hit = np.zeros(len(starts), bool)
    for a, b in spans:
        hit |= (starts < b) & (ends > a)
    return hit


def engine_buckets(run_dir, exclude_spans=()) -> dict:
    """The engine's counter buckets of a run (all events_engine*.jsonl): arrays start, seconds, h,
    tokens_per_s, busy and `kept` (the filter estimate_u uses; see the module docstring). A bucket lasts
    until the next record of its file. exclude_spans: further (start, end) intervals to drop."""
    cols = {k: [] for k in ("start", "seconds", "h", "tokens_per_s", "busy", "kept")}
    for f in sorted(Path(run_dir).glob("events_engine*.jsonl")):
        recs = read_jsonl(f)
        counters = sorted((r[2], r[3]) for r in recs if r[:2] == ["C", "engine"])
        loads = [(r[2], r[2] + r[3]) for r in recs if r[:2] == ["X", "receive"]]
        if len(counters) < 2:
            continue
        t = np.array([c[0] for c in counters])
        start, seconds = t[:-1], np.diff(t)
        vals = {k: np.array([c[1][k] for c in counters[:-1]], float) for k in ("inflight", "tokens_per_s", "busy")}
        kept = (vals["inflight"] > 0) & (seconds >= MIN_BUCKET_S)
        kept &= ~_overlaps(start, start + seconds, list(loads) + list(exclude_spans))
        for k, v in (("start", start), ("seconds", seconds), ("h", vals["inflight"]),
                     ("tokens_per_s", vals["tokens_per_s"]), ("busy", vals["busy"]), ("kept", kept)):
            cols[k].append(v)
    return {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}


def shared_core_spans(run_dir, cfg) -> list:
    """The trainer's step spans when the trainer and the engine share a core (conventional RL), else []."""
    if not common.cpu_set(str(cfg["actor"]["cpu_cores"])) & common.cpu_set(str(cfg["trainer"]["cpu_cores"])):
        return []
    return [(r[2], r[2] + r[3]) for f in sorted(Path(run_dir).glob("events_trainer*.jsonl"))
            for r in read_jsonl(f) if r[0] == "X" and str(r[1]).startswith("step/")]


def estimate_u(run_dir, edges=H_EDGES, min_buckets=MIN_BUCKETS, exclude_trainer=True) -> list:
    """U(h) of a run's engine -> [(h, tokens/s, buckets)] per occupancy bin: the median h and the median
    tokens/s of the kept buckets whose h lies in [edges[i], edges[i+1]); bins with fewer than
    min_buckets buckets are left out. exclude_trainer: also drop the buckets that overlap a training
    step on a shared core (needs config.yaml; without it nothing is dropped for this)."""
    spans = []
    cfg_path = Path(run_dir) / "config.yaml"
    if exclude_trainer and cfg_path.exists():
        spans = shared_core_spans(run_dir, yaml.safe_load(cfg_path.read_text()))
    b = engine_buckets(run_dir, spans)
    h, tps = b["h"][b["kept"]], b["tokens_per_s"][b["kept"]]
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (h >= lo) & (h < hi)
        if m.sum() >= min_buckets:
            out.append((float(np.median(h[m])), float(np.median(tps[m])), int(m.sum())))
    return out


def completion_lengths(run_dir) -> np.ndarray:
    """Completion tokens of every trained sample, all ranks (version_runs [[version, tokens]])."""
    return np.array([sum(n for _, n in runs) for r in timeline(read_samples(run_dir))
                     for runs in r["version_runs"]], dtype=int)


def trainer_steps(run_dir) -> list:
    return [r for r in read_jsonl(Path(run_dir) / "metrics_trainer.jsonl") if "trainer/train_s" in r]


def trainer_speed(run_dir) -> float:
    """Completion tokens of the trained batches per second of training (train_s), all steps: each
    step's tokens summed over the ranks, which train their shares at the same time."""
    tokens = {}
    for r in timeline(read_samples(run_dir)):
        tokens[r["step"]] = tokens.get(r["step"], 0) + sum(n for runs in r["version_runs"]
                                                           for _, n in runs)
    steps = [r for r in trainer_steps(run_dir) if r["step"] in tokens]
    return sum(tokens[r["step"]] for r in steps) / sum(r["trainer/train_s"] for r in steps)


def eval_share(run_dir) -> float:
    """Evaluation's share of the engine's completion tokens (metrics_actor.jsonl's two rates, integrated)."""
    recs = [r for r in read_jsonl(Path(run_dir) / "metrics_actor.jsonl") if "actor/engine_tokens_per_s" in r]
    t = np.array([r["time"] for r in recs])
    dt = np.diff(t, prepend=t[0])
    train = sum(r["actor/tokens_per_s"] * d for r, d in zip(recs, dt))
    engine = sum(r["actor/engine_tokens_per_s"] * d for r, d in zip(recs, dt))
    return float(1 - train / engine) if engine > 0 else 0.0


def measured_samples_per_s(run_dir) -> float:
    """Samples trained from the first to the last optimizer step / the seconds between them."""
    s = trainer_steps(run_dir)
    return (s[-1]["trainer/samples_total"] - s[0]["trainer/samples_total"]) / (s[-1]["time"] - s[0]["time"])


def rl_step_split(run_dir) -> dict:
    """Conventional RL: seconds per RL step (the 2nd to the last), split by the trainer's spans into
    generation (`wait`: for the step's samples), training (`step/*`) and the rest (send, bookkeeping)."""
    recs = [r for r in read_jsonl(Path(run_dir) / "events_trainer0.jsonl") if r[0] == "X"]
    waits = sorted((r[2], r[3]) for r in recs if r[1] == "wait")
    if len(waits) < 3:
        return {}
    a, b = waits[1][0], waits[-1][0]  # from the 2nd RL step's wait to the last one's: whole RL steps
    n = len(waits) - 2
    gen = sum(d for t, d in waits[1:-1])
    train = sum(r[3] for r in recs if str(r[1]).startswith("step/") and a <= r[2] < b)
    return {"rl_steps": n, "step_s": (b - a) / n, "gen_s": gen / n, "train_s": train / n,
            "other_s": (b - a - gen - train) / n}


def engine_steadiness(run_dir, H) -> tuple:
    """Per-minute median tokens/s of the kept buckets at h within 25% of H -> (min, max) over the
    minutes that have >= 5 such buckets (None if fewer than two minutes do)."""
    b = engine_buckets(run_dir)
    m = b["kept"] & (b["h"] >= 0.75 * H) & (b["h"] < 1.25 * H)
    if not m.any():
        return None
    minute = ((b["start"] - b["start"][0]) // 60).astype(int)
    med = [float(np.median(b["tokens_per_s"][m & (minute == k)])) for k in np.unique(minute[m])
           if (m & (minute == k)).sum() >= 5]
    return (min(med), max(med)) if len(med) >= 2 else None


def engine_in_run(run_dir) -> dict:
    """The engine over the trainer's first to last step: tokens/s (all its tokens / wall), occupancy h
    weighted by time (idle time counts as h = 0), and the share of the wall spent loading weights."""
    s = trainer_steps(run_dir)
    a, z = s[0]["time"], s[-1]["time"]
    b = engine_buckets(run_dir)
    m = (b["start"] >= a) & (b["start"] < z)
    tokens = float((b["tokens_per_s"][m] * b["seconds"][m]).sum())
    h = float((b["h"][m] * b["seconds"][m]).sum())
    loads = [r[3] for f in Path(run_dir).glob("events_engine*.jsonl") for r in read_jsonl(f)
             if r[:2] == ["X", "receive"] and a <= r[2] < z]
    # the gap an update leaves between the engine's decode steps (metrics_actor: actor/update_stall_s)
    stalls = [r["actor/update_stall_s"] for r in read_jsonl(Path(run_dir) / "metrics_actor.jsonl")
              if r.get("actor/update_stall_s") is not None]
    lag = sum(r[3] for f in Path(run_dir).glob("events_actor*.jsonl") for r in read_jsonl(f)
              if r[:2] == ["X", "admission/lag"] and a <= r[2] < z)
    return {"tokens_per_s": tokens / (z - a), "h": h / (z - a), "load_share": sum(loads) / (z - a),
            "stall_share": len(loads) * float(np.mean(stalls)) / (z - a) if stalls else 0.0,
            "lag_held_share": lag / (z - a)}


# --- the model ----------------------------------------------------------------------------------------------

def cores(spec) -> int:
    return len(common.cpu_set(str(spec)))


def model_own(cfg, U, train_tps, lengths, share=0.0, draws=DRAWS) -> dict:
    """Samples/s by the paper's model from one run's own rates (U: its engine as one unit; train_tps:
    completion tokens/s of its trainer on its cores); share: evaluation's share of the engine's tokens,
    taken off generation. -> samples_per_s, and for conventional RL the model's seconds per RL step."""
    a, t = cfg["actor"], cfg["trainer"]
    peak, Lbar = U.peak_tokens_per_s, float(np.mean(lengths))
    tau = peak / train_tps  # flashes per trained completion token
    if a["schedule"] == "pipeline":
        # one engine on its cores (I = 1 unit), the trainer on the rest (N - I = 1 unit)
        # evaluation takes `share` of the engine's tokens: training gets the rest of U(H)
        r = r_pipeline(2, 1, a["max_inflight"], lambda h: U(h) * (1 - share), tau)
        return {"samples_per_s": r * peak / Lbar}
    n = t["batch_size"] * a["G_steps"]
    rng = np.random.default_rng(0)
    runs = [t_gen_slots(rng.choice(lengths, size=n), a["max_inflight"] * a["engines"], 1, U) for _ in range(draws)]
    flashes, tokens = float(np.mean([f for f, _ in runs])), float(np.mean([k for _, k in runs]))
    flashes /= (1 - share)  # evaluation's tokens decoded beside the step's, at the same rate
    r = r_conventional(tokens, flashes, 1, tau)
    return {"samples_per_s": r * peak / Lbar, "gen_s": flashes / peak, "train_s": tokens / train_tps,
            "step_s": n / (r * peak / Lbar)}


def analyse(run_dir) -> dict:
    d = Path(run_dir)
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    u_pts = estimate_u(d)
    lengths = completion_lengths(d)
    out = {"run": str(d), "cfg": cfg, "u": u_pts, "lengths": lengths, "train_tps": trainer_speed(d),
           "eval_share": eval_share(d), "measured": measured_samples_per_s(d), "steps": len(trainer_steps(d)),
           "engine": engine_in_run(d), "steady": engine_steadiness(d, cfg["actor"]["max_inflight"])}
    out["U"] = MeasuredU([p[0] for p in u_pts], [p[1] for p in u_pts])
    out["own"] = model_own(cfg, out["U"], out["train_tps"], lengths)
    out["own_eval"] = model_own(cfg, out["U"], out["train_tps"], lengths, out["eval_share"])
    out["unsteady"] = bool(out["steady"] and out["steady"][1] > STEADY_MAX * out["steady"][0])
    if cfg["actor"]["schedule"] == "conventional":
        out["split"] = rl_step_split(d)
    return out


def label(cfg) -> str:
    a, t = cfg["actor"], cfg["trainer"]
    s = (f"conventional G={a['G_steps']} H={a['max_inflight']}" if a["schedule"] == "conventional"
         else f"PipelineRL H={a['max_inflight']}")
    return s + f", lr {t['lr']:g}"


def is_default_pipeline(r) -> bool:
    return r["cfg"]["actor"]["schedule"] == "pipeline" and abs(r["cfg"]["trainer"]["lr"] - 1e-4) < 1e-12


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="*", help="run directories (default: the 2026-12-03 long-tail runs)")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args(argv)
    dirs = [Path(p) if Path(p).is_absolute() else REPO / p for p in (args.runs or DEFAULT_RUNS)]
    res = [analyse(d) for d in dirs if (d / "config.yaml").exists()]
    if not res:
        sys.exit("no run directories with config.yaml")
    W = max(len(label(r["cfg"])) for r in res) + 2

    print("U(h): engine tokens/s by occupancy h, as h:tokens/s (median of the kept buckets per h bin)")
    for r in res:
        print(f"  {label(r['cfg']):<{W}}" + ", ".join(f"{h:.0f}:{v:.0f}" for h, v, _ in r["u"]))
    print("\nEngine steadiness: per-minute median tokens/s at h within 25% of H (min..max over the run's minutes)")
    for r in res:
        st = r["steady"]
        flag = f"  <- varies more than {STEADY_MAX}x within the run" if r["unsteady"] else ""
        print(f"  {label(r['cfg']):<{W}}" + (f"{st[0]:.0f}..{st[1]:.0f}{flag}" if st else "-"))
    print("\nLengths (completion tokens of the trained samples); trainer: completion tokens per second of "
          "training; eval: evaluation's share of the engine's tokens")
    for r in res:
        L = r["lengths"]
        p50, p90, p99 = np.percentile(L, [50, 90, 99])
        print(f"  {label(r['cfg']):<{W}}n {len(L):5d}, mean {L.mean():5.1f}, p50 {p50:3.0f}, p90 {p90:3.0f}, "
              f"p99 {p99:3.0f}, max {L.max():3d} | trainer {r['train_tps']:5.0f} on "
              f"{cores(r['cfg']['trainer']['cpu_cores'])} core(s) | eval {r['eval_share']:.3f}")

    ref = next((r for r in res if is_default_pipeline(r)), None)
    if ref:
        U1, tau1 = ref["U"], ref["U"].peak_tokens_per_s / ref["train_tps"]
        for r in res:
            r["per_core"] = predict(r["cfg"], U1, tau1, r["lengths"])
    print("\nSamples/s, measured (first to last optimizer step) and predicted; own: the run's own U(h), trainer "
          "speed and lengths; +eval: less evaluation's share;\nper-core: throughput_model.predict() with the "
          f"one-core U and tau of {Path(ref['run']).name if ref else '-'} (two cores decode twice as fast)")
    print(f"  {'run':<{W}}{'steps':>5} {'measured':>9} {'own':>6} {'own+eval':>9} {'per-core':>9}   own+eval / measured")
    for r in res:
        pc = f"{r['per_core']:9.1f}" if "per_core" in r else f"{'-':>9}"
        note = "   (engine unsteady: not a test of the model)" if r["unsteady"] else ""
        print(f"  {label(r['cfg']):<{W}}{r['steps']:5d} {r['measured']:9.1f} {r['own']['samples_per_s']:6.1f} "
              f"{r['own_eval']['samples_per_s']:9.1f} {pc}   {r['own_eval']['samples_per_s'] / r['measured']:.2f}{note}")

    print("\nWhere the time goes")
    for r in res:
        e, a = r["engine"], r["cfg"]["actor"]
        if a["schedule"] == "pipeline":
            uh = r["U"](a["max_inflight"]) * r["U"].peak_tokens_per_s
            train = e["tokens_per_s"] * (1 - r["eval_share"])
            print(f"  {label(r['cfg']):<{W}}engine over the run {e['tokens_per_s']:.0f} tokens/s = "
                  f"{e['tokens_per_s'] / uh:.2f} of U(H={a['max_inflight']}) = {uh:.0f}; mean h {e['h']:.0f}; of the "
                  f"wall: updates stall the engine {100 * e['stall_share']:.1f}% (loads {100 * e['load_share']:.1f}%), "
                  f"the lag budget holds admission {100 * e['lag_held_share']:.0f}%; less evaluation: {train:.0f} "
                  f"tokens/s / {r['lengths'].mean():.1f} = {train / r['lengths'].mean():.1f} samples/s")
        elif r.get("split"):
            s, m = r["split"], r["own_eval"]
            print(f"  {label(r['cfg']):<{W}}one RL step (mean of {s['rl_steps']}) measured vs model: "
                  f"{s['step_s']:.1f} vs {m['step_s']:.1f} s = generation {s['gen_s']:.1f} vs {m['gen_s']:.1f} s "
                  f"+ training {s['train_s']:.1f} vs {m['train_s']:.1f} s + the rest {s['other_s']:.1f} s vs none")

    steady_conv = [r for r in res if r["cfg"]["actor"]["schedule"] == "conventional" and not r["unsteady"]]
    for r in res:
        if r["unsteady"] and r["cfg"]["actor"]["schedule"] == "conventional" and steady_conv:
            o = steady_conv[0]
            p = model_own(r["cfg"], o["U"], o["train_tps"], r["lengths"], o["eval_share"])
            print(f"\n{label(r['cfg'])}: with the U(h), trainer speed and eval share of {label(o['cfg'])} "
                  f"(the same cores, an undisturbed engine) the model gives {p['samples_per_s']:.1f} samples/s "
                  f"(measured {r['measured']:.1f} on its disturbed engine)")
            r["predicted_with_steady_rates"] = p["samples_per_s"]

    pipe = next((r for r in res if is_default_pipeline(r)), None)
    convs = [r for r in res if r["cfg"]["actor"]["schedule"] == "conventional"]
    if pipe and convs:
        print("\nPipelineRL (lr 1e-4) / conventional, samples/s:")
        for c in convs:
            parts = [f"{k} {pipe[k]['samples_per_s'] / c[k]['samples_per_s']:.2f}x" for k in ("own", "own_eval")]
            parts.append(f"per-core {pipe['per_core'] / c['per_core']:.2f}x")
            note = " (its engine unsteady)" if c["unsteady"] else ""
            print(f"  vs {label(c['cfg'])}{note}: measured {pipe['measured'] / c['measured']:.2f}x; predicted "
                  + ", ".join(parts))
    if args.json:
        keep = [{"run": r["run"], "setting": label(r["cfg"]), "steps": r["steps"], "u": r["u"],
                 "length_mean": float(r["lengths"].mean()), "train_tokens_per_s": r["train_tps"],
                 "eval_share": r["eval_share"], "engine": r["engine"], "steady": r["steady"],
                 "measured": r["measured"], "predicted_own": r["own"]["samples_per_s"],
                 "predicted_own_eval": r["own_eval"]["samples_per_s"], "predicted_per_core": r.get("per_core"),
                 "rl_step": r.get("split"), "predicted_with_steady_rates": r.get("predicted_with_steady_rates")}
                for r in res]
        Path(args.json).write_text(json.dumps(keep, indent=1))


if __name__ == "__main__":
    main()
