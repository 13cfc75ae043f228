"""The paper's figures (arXiv 2509.19128) and a summary table, from the JSONL metrics of run directories.

    .venv/bin/python scripts/plot.py runs/repro/* [--out docs/figures] [--target 0.6] [--smooth 1]

Reads, per run directory: config.yaml (the resolved config: it names the setting), metrics_trainer.jsonl
(one record per optimizer step, keys `trainer/...`), eval.jsonl (test reward per evaluated version),
through scripts/rundir.py (rundir.Run: one run's arrays; rundir.group_settings: the settings).
Writes PNGs and summary.md into --out (default: figures/ next to the first run):

  fig5a_reward_vs_time.png    train and test reward vs wall-clock time           (paper Fig. 5a)
  fig5b_reward_vs_samples.png train and test reward vs samples trained on        (Fig. 5b)
  fig5c_samples_vs_time.png   samples trained on vs wall-clock time              (Fig. 5c)
  fig6_lag_ess.png            max token lag and ESS over training                (Fig. 6a, 6b)
  fig3a_lag_by_position.png   lag per optimizer step; PipelineRL lag vs position (Fig. 3a)
  fig3b_throughput_vs_lag.png samples/s vs mean lag; gain per sample vs samples/s (Fig. 3b)
  fig7_kl_vs_lag.png          KL(mu||pi) per token vs token lag, token-weighted  (Fig. 7)
  summary.md                  per setting: time and samples to a target test reward, lag, ESS, speed-up

    .venv/bin/python scripts/plot.py --timeline CONVENTIONAL_RUN PIPELINE_RUN --out docs/figures
  timeline.png                the engine's occupancy h and tokens/s, one conventional RL step (the
                              one nearest mid-run that no evaluation overlaps) next to as many seconds
                              of PipelineRL, on shared scales (the runs' events files; run.trace=true)

Runs that differ only in run.seed (and run.dir, ports) are one *setting*: drawn as the mean over seeds
with a band from the lowest to the highest seed; the legend names the schedule, its settings and the
number of seeds. Time zero of a run is when its trainer starts waiting for its first batch (the first
record's time minus that step's interval, B / samples_per_s), so engine start-up counts for no setting.
The test reward of version v is placed at the time and sample count of optimizer step v (the moment that
policy existed); version 0 at zero.
"""
import argparse
import math
import re
import sys
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from scripts.rundir import group_settings, load_runs, read_events, smooth  # noqa: E402
from loss import LAG_BUCKET_LABELS  # noqa: E402

DEFAULT_TARGET = 0.6
FIGURES = ["fig5a_reward_vs_time.png", "fig5b_reward_vs_samples.png", "fig5c_samples_vs_time.png",
           "fig6_lag_ess.png", "fig3a_lag_by_position.png", "fig3b_throughput_vs_lag.png", "fig7_kl_vs_lag.png"]


# --- drawing helpers ---------------------------------------------------------------------------------------

def colors_for(groups) -> dict:
    """PipelineRL in blues/greens (recomputed KV: purples), conventional in reds/oranges: a colour per setting
    up to the palette's length (reproduce.sh --task longtail's 11 conventional settings fit)."""
    pipe = ["tab:blue", "tab:green", "tab:cyan", "tab:olive", "navy", "teal"]
    recompute = ["tab:purple", "orchid"]
    conv = ["tab:red", "tab:orange", "tab:brown", "tab:pink", "gold", "darkred", "salmon", "peru",
            "magenta", "olive", "black", "tab:gray"]
    out, n = {}, {"p": 0, "r": 0, "c": 0}
    for label, runs in groups.items():
        kind = "c" if runs[0].schedule == "conventional" else ("r" if runs[0].value("actor", "recompute_kv") else "p")
        palette = {"p": pipe, "r": recompute, "c": conv}[kind]
        out[label] = palette[n[kind] % len(palette)]
        n[kind] += 1
    return out


def legend_label(label, runs):
    return f"{label} ({len(runs)} seeds)" if len(runs) > 1 else label


def band(ax, curves, color, label, **kw):
    """Mean over seeds on a common x grid with a min-max band; one seed: the curve itself."""
    curves = [(np.asarray(x, float), np.asarray(y, float)) for x, y in curves if len(x)]
    if not curves:
        return
    if len(curves) == 1:
        ax.plot(*curves[0], color=color, label=label, **kw)
        return
    lo, hi = max(x[0] for x, _ in curves), min(x[-1] for x, _ in curves)
    if hi <= lo:  # no common range: draw the seeds one by one
        for i, (x, y) in enumerate(curves):
            ax.plot(x, y, color=color, label=label if i == 0 else None, **kw)
        return
    grid = np.linspace(lo, hi, 200)
    ys = np.array([np.interp(grid, x, y) for x, y in curves])
    ax.fill_between(grid, ys.min(0), ys.max(0), color=color, alpha=0.18, lw=0)
    ax.plot(grid, ys.mean(0), color=color, label=label, **{k: v for k, v in kw.items() if k != "marker"})


def no_data(ax, what):
    ax.text(0.5, 0.5, f"no {what} in these runs", ha="center", va="center", transform=ax.transAxes, color="gray")


def finish(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt
    plt.close(fig)


# --- figures -----------------------------------------------------------------------------------------------

def fig_reward(groups, colors, out, x_of, xlabel, name, title, smooth_train):
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    for label, runs in groups.items():
        c, lab = colors[label], legend_label(label, runs)
        band(a1, [(x_of(r, "train"), smooth(r.reward, smooth_train)) for r in runs], c, lab)
        band(a2, [(x_of(r, "test"), r.test) for r in runs if len(r.test)], c, lab, marker=".")
    a1.set_title(f"train reward (batch mean, moving average over {smooth_train} steps)")
    temps = {r.value("actor", "eval_temperature") for runs in groups.values() for r in runs}
    decoding = "greedy" if temps == {0.0} else "temperature " + "/".join(f"{t:g}" for t in sorted(temps))
    a2.set_title(f"test reward ({decoding}, held-out problems)")
    if not any(len(r.test) for runs in groups.values() for r in runs):
        no_data(a2, "evaluations")
    for a in (a1, a2):
        a.set_xlabel(xlabel)
        a.set_ylabel("reward (fraction correct)")
        a.grid(alpha=0.3)
    a2.legend(fontsize=8)
    fig.suptitle(title)
    finish(fig, out / name)


def fig_samples_vs_time(groups, colors, out):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for label, runs in groups.items():
        band(ax, [(r.t, r.samples) for r in runs], colors[label], legend_label(label, runs))
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel("samples trained on (sequences)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Samples vs time (paper Fig. 5c)")
    finish(fig, out / "fig5c_samples_vs_time.png")


def fig_lag_ess(groups, colors, out, smooth_k):
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    for label, runs in groups.items():
        c, lab = colors[label], legend_label(label, runs)
        band(a1, [(r.samples, r.lag_max) for r in runs], c, lab)
        band(a2, [(r.samples, smooth(r.ess, smooth_k)) for r in runs], c, lab)
    a1.set_ylabel("max token lag in the batch (optimizer steps)")
    a1.set_title("Max lag (paper Fig. 6a)")
    a2.set_ylabel(f"ESS (eq. 6; moving average over {smooth_k} steps)")
    a2.set_title("Effective sample size (paper Fig. 6b)")
    for a in (a1, a2):
        a.set_xlabel("samples trained on (sequences)")
        a.grid(alpha=0.3)
    a2.legend(fontsize=8)
    finish(fig, out / "fig6_lag_ess.png")


def fig_lag_position(groups, colors, out):
    """Left: mean lag per optimizer step over the first steps (conventional: a saw-tooth 0..G-1 within each
    RL step; PipelineRL: steady). Right: PipelineRL's mean lag by completion position (earlier = older)."""
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    n_show = 40
    for label, runs in groups.items():
        r = runs[0]
        a1.plot(r.step[:n_show], r.lag_mean[:n_show], color=colors[label], marker=".", label=f"{label} (seed {r.seed})",
                ls="--" if r.schedule == "conventional" else "-")
    a1.set_xlabel("optimizer step")
    a1.set_ylabel("mean token lag (optimizer steps)")
    a1.set_title(f"Lag per optimizer step, first {n_show} steps")
    a1.legend(fontsize=8)
    any_pos = False
    for label, runs in groups.items():
        if runs[0].schedule != "pipeline":
            continue
        rows = [r["trainer/lag_by_position"] for run in runs for r in run.recs[3:] if "trainer/lag_by_position" in r]
        if not rows:
            continue
        P = len(rows[0])
        vals = np.array([[np.nan if v is None else v for v in row] for row in rows if len(row) == P], dtype=float)
        with warnings.catch_warnings():  # a bucket no sequence reached is all-NaN: left out below
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = np.nanmean(vals, axis=0)
        max_tokens = runs[0].value("actor", "max_tokens")
        x = (np.arange(P) + 0.5) * max_tokens / P
        ok = ~np.isnan(mean)
        a2.plot(x[ok], mean[ok], color=colors[label], marker="o", label=legend_label(label, runs))
        any_pos = True
    if not any_pos:
        no_data(a2, "PipelineRL lag_by_position")
    a2.set_xlabel("position in the completion (tokens; bucket centres)")
    a2.set_ylabel("mean token lag (optimizer steps)")
    a2.set_title("PipelineRL: earlier tokens are older (steps after the first 3)")
    if any_pos:
        a2.legend(fontsize=8)
    for a in (a1, a2):
        a.grid(alpha=0.3)
    fig.suptitle("Token lag (paper Fig. 3a)")
    finish(fig, out / "fig3a_lag_by_position.png")


def fig_tradeoff(groups, colors, out):
    """Left: throughput vs mean lag, one point per run. Right: effectiveness (test-reward gain per 1000
    samples, first to last evaluation) vs throughput: the paper's Fig. 3b axes."""
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    have_eff = False
    for label, runs in groups.items():
        c, mk = colors[label], ("s" if runs[0].schedule == "conventional" else "o")
        xs = [r.mean_lag() for r in runs]
        ys = [r.samples_per_s() for r in runs]
        a1.scatter(xs, ys, color=c, marker=mk, label=legend_label(label, runs), s=40)
        eff = [(r.samples_per_s(), 1000 * (r.test[-1] - r.test[0]) / r.eval_samples[-1])
               for r in runs if len(r.test) >= 2 and r.eval_samples[-1] > 0]
        if eff:
            a2.scatter(*zip(*eff), color=c, marker=mk, label=legend_label(label, runs), s=40)
            have_eff = True
    a1.set_xlabel("mean token lag (optimizer steps, token-weighted)")
    a1.set_ylabel("throughput (samples/s)")
    a1.set_title("Throughput vs lag")
    a1.legend(fontsize=8)
    a2.set_xlabel("throughput ΔS/Δt (samples/s)")
    a2.set_ylabel("effectiveness ΔR/ΔS (test reward gain per 1000 samples)")
    a2.set_title("Effectiveness vs throughput")
    if not have_eff:
        no_data(a2, "pairs of evaluations")
    for a in (a1, a2):
        a.grid(alpha=0.3)
    fig.suptitle("The throughput / on-policyness trade-off (paper Fig. 3b)")
    finish(fig, out / "fig3b_throughput_vs_lag.png")


def kl_by_lag(runs):
    """Token-weighted KL per lag bucket over all steps of all runs -> (kl [K], tokens [K])."""
    kl, tok = np.zeros(len(LAG_BUCKET_LABELS)), np.zeros(len(LAG_BUCKET_LABELS))
    for run in runs:
        for r in run.recs:
            for i, lab in enumerate(LAG_BUCKET_LABELS):
                n = r.get(f"trainer/tokens_lag_{lab}", 0) or 0
                if n and f"trainer/kl_lag_{lab}" in r:
                    kl[i] += r[f"trainer/kl_lag_{lab}"] * n
                    tok[i] += n
    with np.errstate(all="ignore"):
        return np.where(tok > 0, kl / np.maximum(tok, 1), np.nan), tok


def fig_kl_lag(groups, colors, out):
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.arange(len(LAG_BUCKET_LABELS))
    drawn, positive = False, True
    for label, runs in groups.items():
        kl, tok = kl_by_lag(runs)
        ok = ~np.isnan(kl)
        if not ok.any():
            continue
        ls = ":" if runs[0].schedule == "conventional" else ("--" if runs[0].value("actor", "recompute_kv") else "-")
        a1.plot(x[ok], kl[ok], color=colors[label], ls=ls, marker="o", label=legend_label(label, runs))
        a2.plot(x, tok / tok.sum(), color=colors[label], ls=ls, marker="o", label=legend_label(label, runs))
        positive &= bool((kl[ok] > 0).all())
        drawn = True
    if drawn and positive:
        a1.set_yscale("log")
    if not drawn:
        no_data(a1, "lag-bucketed KL")
    a1.set_ylabel("KL(μ‖π) per token (k3 estimate, nats)")
    a1.set_title("Off-policyness by lag (solid: stale KV, dashed: recomputed KV, dotted: conventional)", fontsize=9)
    a2.set_ylabel("share of trained tokens")
    a2.set_title("Where the tokens are: share per lag bucket")
    for a in (a1, a2):
        a.set_xticks(x, LAG_BUCKET_LABELS)
        a.set_xlabel("token lag (optimizer steps)")
        a.grid(alpha=0.3)
    if drawn:
        a1.legend(fontsize=8)
    fig.suptitle("KL between behaviour and current policy vs token lag (paper Fig. 7)")
    finish(fig, out / "fig7_kl_vs_lag.png")


# --- summary -----------------------------------------------------------------------------------------------

def choose_target(runs, target, k):
    """-> (target, note). Default: 0.6, or the best (smoothed) test reward every run reached if lower."""
    bests = [float(r.smoothed_test(k).max()) for r in runs if len(r.test)]
    if not bests:
        return None, "no test evaluations in these runs: no target"
    if target is not None:
        return target, f"{target:.3f} (given with --target)"
    if min(bests) >= DEFAULT_TARGET:
        return DEFAULT_TARGET, f"{DEFAULT_TARGET:.3f} (the default)"
    return min(bests), (f"{min(bests):.3f}: the best test reward every run reached (not every run reached the "
                        f"default {DEFAULT_TARGET}); an easier target than the paper's comparisons")


def summarize(groups, target=None, k=1) -> str:
    runs = [r for rs in groups.values() for r in rs]
    target, note = choose_target(runs, target, k)
    rows, reach = [], {}
    for label, rs in groups.items():
        hits = [r.first_reaching(target, k) if target is not None else None for r in rs]
        ok = [h for h in hits if h is not None]
        if target is not None and len(ok) == len(rs):
            reach[label] = (float(np.mean([h[0] for h in ok])), float(np.mean([h[1] for h in ok])))
        rows.append((label, rs, ok))
    conv = {lab: v for lab, v in reach.items() if groups[lab][0].schedule == "conventional"}
    best_conv = min(conv, key=lambda lab: conv[lab][0]) if conv else None
    fmt = lambda v, f: "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f.format(v)  # noqa: E731

    lines = ["# Summary", "", f"Runs: {len(runs)} in {len(groups)} settings. Target test reward: {note}.",
             f"Time to target and samples to target: first evaluation at or above it"
             + (f" (moving average over {k} evaluations)" if k > 1 else "") + "; mean over seeds.", "",
             "| setting | seeds | time to target (s) | samples to target | samples/s | mean lag | max lag | "
             "mean ESS | final test reward | speed-up vs best conventional |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, rs, ok in rows:
        t, s = reach.get(label, (None, None))
        if target is not None and label not in reach:
            t_txt = s_txt = f"not reached ({len(ok)}/{len(rs)} seeds)"
        else:
            t_txt, s_txt = fmt(t, "{:.0f}"), fmt(s, "{:.0f}")
        speed = "—"
        if label in reach and best_conv and rs[0].schedule == "pipeline" and t > 0:
            speed = f"{conv[best_conv][0] / t:.2f}×"
        finals = [r.test[-1] for r in rs if len(r.test)]
        lines.append(" | ".join([
            f"| {label}", str(len(rs)), t_txt, s_txt, f"{np.mean([r.samples_per_s() for r in rs]):.1f}",
            f"{np.mean([r.mean_lag() for r in rs]):.2f}", f"{max(np.nanmax(r.lag_max) for r in rs):.0f}",
            f"{np.mean([np.nanmean(r.ess) for r in rs]):.3f}",
            fmt(float(np.mean(finals)) if finals else None, "{:.3f}"), speed]) + " |")
    lines.append("")
    pipe = {lab: v for lab, v in reach.items() if groups[lab][0].schedule == "pipeline"}
    if pipe and best_conv:
        best_pipe = min(pipe, key=lambda lab: pipe[lab][0])
        tp, tc = pipe[best_pipe][0], conv[best_conv][0]
        ratio = f"{tc / tp:.2f}×" if tp > 0 else "— (reached at the first evaluation)"
        lines.append(f"**Speed-up**: {best_pipe} reaches test reward {target:.3f} in {tp:.0f} s, the best conventional "
                     f"setting ({best_conv}) in {tc:.0f} s: {ratio} (samples: {pipe[best_pipe][1]:.0f} vs "
                     f"{conv[best_conv][1]:.0f}).")
    else:
        lines.append("**Speed-up**: not computed (needs a PipelineRL and a conventional setting whose every seed "
                     "reached the target).")
    return "\n".join(lines) + "\n"


def print_best_conventional(runs, target=None, k=1):
    """scripts/reproduce.sh's choice between its tuning runs: mean time to the target every run reached."""
    target, _ = choose_target(runs, target, k)
    times = {}
    for r in runs:
        hit = r.first_reaching(target, k) if r.schedule == "conventional" and target is not None else None
        if hit is not None:
            times.setdefault(re.sub(r"-s\d+$", "", r.path.name), []).append(hit[0])
    if not times:
        sys.exit("[plot] no conventional run reached the target")
    print(min(times, key=lambda name: np.mean(times[name])))


# --- main --------------------------------------------------------------------------------------------------

def fig_timeline(conventional, pipeline, path):
    """The engine's occupancy h and tokens/s over one conventional RL step (between the ends of two
    weight updates mid-run; the one nearest the middle that no evaluation overlaps, if any: evaluation
    adds its own sequences to h) next to as many seconds of the PipelineRL run (mid-run), from the runs'
    events files (telemetry.Events: the engine's >= 0.25 s buckets), with the trainer's steps below and
    evaluation shaded. Both panels share their scales; each title gives the span's mean h and tokens/s.
    -> the spans drawn: conventional_start, span, pipeline_start (time.time() seconds)."""
    import matplotlib.pyplot as plt

    def records(run, prefix):
        files = sorted(Path(run).glob(f"events_{prefix}*.jsonl"))
        return [r for f in files for r in read_events(f)]

    def evals(run):
        return [(r[2], r[2] + r[3]) for r in records(run, "actor") if r[:2] == ["X", "eval"]]
    actor = records(conventional, "actor")
    updates = sorted(r[2] + r[3] for r in actor if r[:2] == ["X", "update"])
    if len(updates) < 3:
        sys.exit(f"[plot] {conventional}: fewer than 3 weight updates in its events files")
    steps = list(zip(updates[:-1], updates[1:]))
    middle = len(updates) // 2 - 1  # the step between updates[k - 1] and updates[k], k = len // 2
    conv_evals = evals(conventional)
    clean = [i for i, (a, b) in enumerate(steps) if not any(s < b and e > a for s, e in conv_evals)]
    k = min(clean, key=lambda i: abs(i - middle)) if clean else middle
    start, span = steps[k][0], steps[k][1] - steps[k][0]
    pipe_times = [r[2] for r in records(pipeline, "engine") if r[0] == "C"]
    if not pipe_times:
        sys.exit(f"[plot] {pipeline}: no engine counters in its events files (run.trace=false?)")
    pipe_start = (min(pipe_times) + max(pipe_times) - span) / 2
    panels = []
    for run, t0 in ((conventional, start), (pipeline, pipe_start)):
        engine = sorted((r[2], r[3]) for r in records(run, "engine") if r[:2] == ["C", "engine"])
        t = np.array([x[0] for x in engine]) - t0
        h = np.array([x[1]["inflight"] for x in engine])
        tps = np.array([x[1]["tokens_per_s"] for x in engine])
        keep = (t >= -1) & (t <= span + 1)
        # time-weighted means over [0, span]: each record holds until the next one
        ends = np.clip(np.append(t[1:], t[-1]), 0, span)
        dt = np.clip(ends - np.clip(t, 0, span), 0, None)
        panels.append((run, t0, t[keep], h[keep], tps[keep], (h * dt).sum() / span, (tps * dt).sum() / span))
    h_max = max(p[3].max(initial=1) for p in panels) * 1.05
    tps_max = max(p[4].max(initial=1) for p in panels) * 1.05
    fig, axes = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    names = (f"Conventional RL (one RL step, {span:.1f} s)", "PipelineRL (as many seconds, mid-run)")
    for ax, (run, t0, t, h, tps, h_mean, tps_mean), name in zip(axes, panels, names):
        for s, e in evals(run):
            if e - t0 > 0 and s - t0 < span:
                ax.axvspan(max(s - t0, 0), min(e - t0, span), color="0.85", lw=0, zorder=0)
        ax.step(t, h, where="post", color="C0", label="sequences in flight (h)")
        ax.set_ylabel("h", color="C0")
        ax.set_ylim(0, h_max)
        ax2 = ax.twinx()
        ax2.step(t, tps, where="post", color="C1", alpha=0.7, label="tokens/s")
        ax2.set_ylabel("engine tokens/s", color="C1")
        ax2.set_ylim(0, tps_max)
        for r in records(run, "trainer0"):
            if r[0] == "X" and r[1].startswith("step/"):
                ax.axvspan(r[2] - t0, r[2] + r[3] - t0, ymin=0, ymax=0.06, color="C2", lw=0)
        ax.set_title(f"{name}: mean h {h_mean:.0f}, {tps_mean:.0f} tokens/s; green: trainer steps, "
                     "grey: evaluation running", fontsize=8.5)
        ax.set_xlim(0, span)
    axes[1].set_xlabel("seconds")
    finish(fig, path)
    return {"conventional_start": start, "span": span, "pipeline_start": pipe_start}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--timeline", nargs=2, metavar=("CONVENTIONAL_RUN", "PIPELINE_RUN"),
                    help="only draw timeline.png into --out: the engine's occupancy and tokens/s "
                         "over one conventional RL step next to PipelineRL (run.trace=true runs)")
    ap.add_argument("runs", nargs="*",
                    help="run directories (with config.yaml and metrics_trainer.jsonl)")
    ap.add_argument("--out", help="output directory (default: <first run's parent>/figures)")
    ap.add_argument("--target", type=float, help=f"test reward to reach (default {DEFAULT_TARGET}, or the best "
                                                 "every run reached if lower)")
    ap.add_argument("--smooth", type=int, default=1, help="moving average over this many test evaluations for the "
                                                          "time-to-target (default 1: as measured)")
    ap.add_argument("--smooth-train", type=int, default=5, help="moving average (steps) for train reward and ESS")
    ap.add_argument("--best-conventional", action="store_true", help="print the run-directory name (without "
                    "-s<seed>) of the conventional setting that reached the common target first, and exit")
    args = ap.parse_args(argv)
    if args.timeline:
        import matplotlib
        matplotlib.use("Agg")
        out = Path(args.out or ".")
        out.mkdir(parents=True, exist_ok=True)
        return fig_timeline(*args.timeline, out / "timeline.png")
    if not args.runs:
        ap.error("give run directories (or --timeline CONVENTIONAL_RUN PIPELINE_RUN)")
    if args.best_conventional:
        return print_best_conventional(load_runs(args.runs), args.target, args.smooth)
    import matplotlib
    matplotlib.use("Agg")
    runs = load_runs(args.runs)
    if not runs:
        sys.exit("[plot] no run with trainer metrics among the given directories")
    out = Path(args.out) if args.out else Path(args.runs[0]).parent / "figures"
    out.mkdir(parents=True, exist_ok=True)
    groups = group_settings(runs)
    colors = colors_for(groups)
    x_time = lambda r, which: r.t if which == "train" else r.eval_t  # noqa: E731
    x_samples = lambda r, which: r.samples if which == "train" else r.eval_samples  # noqa: E731
    fig_reward(groups, colors, out, x_time, "wall-clock time (s)", FIGURES[0],
               "Reward vs wall-clock time (paper Fig. 5a)", args.smooth_train)
    fig_reward(groups, colors, out, x_samples, "samples trained on (sequences)", FIGURES[1],
               "Reward vs samples (paper Fig. 5b)", args.smooth_train)
    fig_samples_vs_time(groups, colors, out)
    fig_lag_ess(groups, colors, out, args.smooth_train)
    fig_lag_position(groups, colors, out)
    fig_tradeoff(groups, colors, out)
    fig_kl_lag(groups, colors, out)
    summary = summarize(groups, args.target, args.smooth)
    (out / "summary.md").write_text(summary)
    print(summary)
    print(f"[plot] {len(FIGURES)} figures and summary.md in {out}")


if __name__ == "__main__":
    main()
