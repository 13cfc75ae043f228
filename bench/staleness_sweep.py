"""How stale is too stale: the off-policy corrections (corrections.py) side by side over forced lags.

Each run is `bash run.sh` with one correction (`trainer.correction`) and one forced lag L: the trainer
broadcasts every (L+1)-th version (`sync.send_every`, the engines hold each version L+1 steps) under
`actor.max_lag = L + 1`, so the trained tokens' lags spread over 0..L+1 (each run's histogram is in
the table). Runs go one at a time, the same steps each; a finished run (its DONE file) is kept, so a
sweep can be built over several sittings. A run's engines evaluate only the versions they hold, so a
stale run's last evaluation comes earlier (at lag 32 of 120 steps: version 99): runs are compared at
the most samples that every run has an evaluation at or past, each read linearly between its
evaluations.

    .venv/bin/python bench/staleness_sweep.py --tier quick          # 9 runs
    .venv/bin/python bench/staleness_sweep.py --tier full           # 70 runs
    .venv/bin/python bench/staleness_sweep.py --tier quick --lr 3e-4 --seeds 0 1 \
        --root runs/staleness-lr3e-4
    .venv/bin/python bench/staleness_sweep.py --tier quick --task longtail --seeds 0 1 \
        --root runs/staleness-longtail

Tiers: quick = lags 0, 8, 32 x tis, token_mask, m2po x seed 0; full = lags 0, 1, 2, 4, 8, 16, 32 x all
five corrections x seeds 0, 1. --lags/--corrections/--seeds override a tier's axes (--lags also sets
the order runs go in). Times on 2 cores, nothing else running (2026-12-07): the quick tier 856 s
(727 s at lr 3e-4; 51-109 s a run, start-up included; the stale runs faster: fewer broadcasts); the
full tier 1 h 51 min (70 runs); the long-tailed quick tier 1,740 s (seed 0; seed 1 2,194 s). Writes
<root>/sweep.json and <root>/sweep.txt (Markdown: test reward by forced lag and correction, the seeds'
mean and range, at that common sample count and as the mean of the last two evaluations; then one
row per run: the last two evaluations' test reward, samples, wall, the lag histogram, ESS, masked
fraction and KL(μ‖π) by lag) and <root>/sweep.png: test reward at the common sample count against
the forced lag, one line per correction (seeds' mean with their range), and at the largest lag the
test reward over samples and over wall time.

Each finished run keeps its table row, with its evaluations over time and samples, in row.json. --report
tables and plots the finished runs only (a sweep cut short); --save DIR copies each run's config.yaml,
eval.jsonl, row.json and DONE, and the sweep's table, data and figure, to DIR (a few KB a run, for
committing). A new checkout continues a saved sweep from where it stopped:
    cp -r results/staleness-full runs/ && .venv/bin/python bench/staleness_sweep.py --tier full
"""
import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import loss  # noqa: E402
from scripts.rundir import Run, read_jsonl  # noqa: E402

TIERS = {"quick": dict(lags=[0, 8, 32], corrections=["tis", "token_mask", "m2po"], seeds=[0]),
         "full": dict(lags=[0, 1, 2, 4, 8, 16, 32],
                      corrections=["tis", "seq_is", "token_mask", "seq_mask", "m2po"], seeds=[0, 1])}


def overrides(a, lag: int, correction: str, seed: int, run_dir: Path) -> list:
    task = ["configs/longtail.yaml"] if a.task == "longtail" else []
    return [*task, f"run.dir={run_dir}", f"run.seed={seed}", f"trainer.max_steps={a.steps}",
            f"trainer.correction={correction}", f"sync.send_every={lag + 1}",
            f"actor.max_lag={lag + 1}", f"trainer.lr={a.lr}", f"actor.eval_every={a.eval_every}",
            "trainer.checkpoint_every=0"]


def summarize(run_dir: Path, lag: int, correction: str, seed: int) -> dict:
    """One run's row: its last evaluation, samples, wall, and per lag bucket the tokens, ESS, masked
    fraction and KL(μ‖π) over the whole run."""
    run = Run(run_dir)
    recs = [r for r in read_jsonl(run_dir / "metrics_trainer.jsonl") if "trainer/loss" in r]
    by_lag = {}
    for label in loss.LAG_BUCKET_LABELS:
        n = sum(r.get(f"trainer/tokens_lag_{label}", 0) for r in recs)
        if n:
            w = lambda k: sum(r.get(f"trainer/{k}_lag_{label}", 0) * r.get(f"trainer/tokens_lag_{label}", 0)  # noqa: E731
                              for r in recs) / n
            by_lag[label] = {"tokens": n, "ess": round(w("ess"), 4), "masked": round(w("mask"), 4),
                             "kl": round(w("kl"), 4) + 0.0}  # + 0.0: no "-0.0"
    row = {"lag": lag, "correction": correction, "seed": seed, "run_dir": str(run_dir),
            "first_test": float(run.test[0]) if len(run.test) else None,
            "final_test": float(run.test[-1]) if len(run.test) else None,
            "last2_test": float(np.mean(run.test[-2:])) if len(run.test) else None,
            "samples": float(run.samples[-1]), "wall_s": float(run.t[-1]),
            "mean_lag": round(run.mean_lag(), 3), "by_lag": by_lag,
            "curve": [[round(float(t), 2), float(n), float(r)]
                      for t, n, r in zip(run.eval_t, run.eval_samples, run.test)]}
    (run_dir / "row.json").write_text(json.dumps(row))
    return row


def row_of(run_dir: Path, lag: int, correction: str, seed: int) -> dict:
    """A finished run's row: as kept in its row.json, else summarized from its metrics."""
    kept = run_dir / "row.json"
    if not kept.exists():
        return summarize(run_dir, lag, correction, seed)
    return {**json.loads(kept.read_text()), "run_dir": str(run_dir)}  # where it is now


def common_samples(rows: list) -> float:
    """The most samples that every run has an evaluation at or past. A stale run's engines evaluate
    only the versions they hold (every (L+1)-th), so its last evaluation comes at fewer samples than
    a fresh run's; read there, every run is compared at the same amount of training."""
    return min(r["curve"][-1][1] for r in rows)


def reward_at(row: dict, n: float) -> float:
    """A run's test reward at n samples, linear between the evaluations around it."""
    curve = np.array(row["curve"])  # [evaluations, (t, samples, test)]
    return float(np.interp(n, curve[:, 1], curve[:, 2]))


def rewards(rows: list, n=None) -> dict:
    """(correction, forced lag) -> the seeds' test rewards, in run order: at n samples, or with n
    None the mean of each run's last 2 evaluations."""
    out = {}
    for r in rows:
        out.setdefault((r["correction"], r["lag"]), []).append(
            r["last2_test"] if n is None else reward_at(r, n))
    return out


def pivot(rows: list, n=None) -> str:
    """Test reward by forced lag and correction, the seeds' mean and, with more than one seed, their
    range: at n samples (the figure's left panel), or with n None the mean of the last 2
    evaluations, with the samples those were read at."""
    cs = list(dict.fromkeys(r["correction"] for r in rows))
    by = rewards(rows, n)
    extra = " samples (last 2 evals) |" if n is None else ""
    lines = ["| forced lag | mean lag |" + extra + " " + " | ".join(cs) + " |",
             "|---" * (len(cs) + 2 + (n is None)) + "|"]
    for lag in sorted({r["lag"] for r in rows}):
        cells = []
        for c in cs:
            ys = by.get((c, lag), [])
            cells.append("" if not ys else f"{np.mean(ys):.3f}" +
                         (f" ({min(ys):.3f}-{max(ys):.3f})" if len(ys) > 1 else ""))
        runs = [r for r in rows if r["lag"] == lag]
        read_at = ""
        if n is None:  # the samples the last 2 evaluations were read at
            read_at = f"{np.mean([np.mean([e[1] for e in r['curve'][-2:]]) for r in runs]):,.0f} | "
        lines.append(f"| {lag} | {np.mean([r['mean_lag'] for r in runs]):.2f} | {read_at}"
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def before(rows: list) -> str:
    first = [r["first_test"] for r in rows]
    return (f"Before training (the runs' first evaluation): {np.mean(first):.3f} "
            f"({min(first):.3f}-{max(first):.3f}).\n")


def table(rows: list) -> str:
    lines = ["| forced lag | correction | seed | test reward (last 2 evals) | mean lag | tokens by lag "
             "(share) | ESS by lag | masked by lag | KL by lag | wall s |", "|---" * 10 + "|"]
    for r in rows:
        total = sum(b["tokens"] for b in r["by_lag"].values()) or 1
        share = ", ".join(f"{k}: {b['tokens'] / total:.2f}" for k, b in r["by_lag"].items())
        ess = ", ".join(f"{k}: {b['ess']:.3f}" for k, b in r["by_lag"].items())
        masked = ", ".join(f"{k}: {b['masked']:.3f}" for k, b in r["by_lag"].items())
        kl = ", ".join(f"{k}: {b['kl']:.3f}" for k, b in r["by_lag"].items())
        lines.append(f"| {r['lag']} | {r['correction']} | {r['seed']} | {r['last2_test']:.3f} | "
                     f"{r['mean_lag']} | {share} | {ess} | {masked} | {kl} | {r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def figure(rows: list, n: float, path: Path, title: str):
    """Left: test reward at n samples (the sweep's common_samples) against the forced lag,
    one line per correction (seeds' mean, bars their range). Middle and right: at the largest lag,
    each correction's test reward over samples and over wall time (seeds' mean at each
    evaluation)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    ax = axes[0]
    corrections_run = list(dict.fromkeys(r["correction"] for r in rows))
    colors = {c: f"C{i}" for i, c in enumerate(corrections_run)}
    by = rewards(rows, n)
    for c in corrections_run:
        lags = sorted(L for k, L in by if k == c)
        ys = [by[(c, L)] for L in lags]
        mean = [np.mean(y) for y in ys]
        ax.errorbar([L + 1 for L in lags], mean, yerr=[[m - min(y) for m, y in zip(mean, ys)],
                                                       [max(y) - m for m, y in zip(mean, ys)]],
                    marker="o", capsize=3, label=c, color=colors[c])
    ax.axhline(np.mean([r["first_test"] for r in rows]), color="grey", lw=0.8, ls=":",
               label="before training (mean of the runs' first evaluation)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("versions each engine holds (forced lag + 1)")
    ax.set_ylabel(f"test reward at {n:,.0f} samples")
    ax.legend(fontsize=7)
    top = max(r["lag"] for r in rows)
    for ax, column, label in ((axes[1], 1, "samples trained on"), (axes[2], 0, "wall time (s)")):
        for c in corrections_run:
            curves = [np.array(r["curve"]) for r in rows
                      if r["correction"] == c and r["lag"] == top and r.get("curve")]
            if curves:
                n = min(len(k) for k in curves)
                ax.plot(np.mean([k[:n, column] for k in curves], axis=0),
                        np.mean([k[:n, 2] for k in curves], axis=0), marker=".", color=colors[c],
                        label=f"{c} ({len(curves)} seed{'s' * (len(curves) > 1)})")
        ax.set_xlabel(label)
        ax.set_ylabel(f"test reward at forced lag {top}")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tier", choices=TIERS, default="quick")
    ap.add_argument("--lags", type=int, nargs="*")
    ap.add_argument("--corrections", nargs="*")
    ap.add_argument("--seeds", type=int, nargs="*")
    ap.add_argument("--task", choices=["arithmetic", "longtail"], default="arithmetic")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=120, help="trainer.max_steps of every run")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--root", default=None, help="default runs/staleness-<tier>")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--report", action="store_true", help="table and plot the finished runs only")
    ap.add_argument("--save", help="copy the runs' configs, evaluations and rows, and the sweep's "
                    "outputs, here")
    a = ap.parse_args(argv)
    axes = {k: getattr(a, k) or v for k, v in TIERS[a.tier].items()}
    root = Path(a.root or REPO / f"runs/staleness-{a.tier}").resolve()
    root.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.time()
    settings = [(L, c, s) for s in axes["seeds"] for L in axes["lags"] for c in axes["corrections"]]
    for i, (lag, correction, seed) in enumerate(settings):
        run_dir = root / f"lag{lag}-{correction}-s{seed}"
        cmd = ["bash", "run.sh", *overrides(a, lag, correction, seed, run_dir)]
        if a.dry_run:
            print(("# kept: " if (run_dir / "DONE").exists() else "") + " ".join(cmd))
            continue
        if a.report and not (run_dir / "DONE").exists():
            continue
        if not (run_dir / "DONE").exists():
            print(f"[sweep] {i + 1}/{len(settings)} {time.strftime('%H:%M:%S')} {' '.join(cmd)}",
                  flush=True)
            run_dir.mkdir(parents=True, exist_ok=True)
            with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
                rc = subprocess.call(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            if rc != 0:
                sys.exit(f"[sweep] {run_dir} failed (exit {rc}): see {run_dir.parent}/{run_dir.name}.log")
            (run_dir / "DONE").touch()
        rows.append(row_of(run_dir, lag, correction, seed))
    if a.dry_run:
        return
    if not rows:
        sys.exit(f"[sweep] no finished run under {root}")
    (root / "sweep.json").write_text(json.dumps(rows, indent=1))
    title = (f"{a.task}, {a.steps} steps, lr {a.lr:g}, seeds {axes['seeds']} "
             f"({len(rows)} of {len(settings)} runs)")
    n = common_samples(rows)
    at_n = (f"Test reward at {n:,.0f} samples, the most that every run has an evaluation at or "
            "past (each run read linearly between its evaluations; the figure's left panel):")
    last2 = ("The mean of each run's last two evaluations (less noise; read at fewer samples in "
             "the stale runs, whose engines evaluate only the versions they hold):")
    (root / "sweep.txt").write_text(f"# Staleness sweep: {title}\n\n{at_n}\n\n" + pivot(rows, n)
                                    + f"\n{last2}\n\n" + pivot(rows) + "\n" + before(rows) + "\n"
                                    + table(rows))
    figure(rows, n, root / "sweep.png", title)
    print(f"[sweep] {len(rows)} runs in {time.time() - t0:.0f} s: {root}/sweep.txt, {root}/sweep.png")
    if a.save:
        save = Path(a.save)
        for r in rows:
            run_dir = Path(r["run_dir"])
            (save / run_dir.name).mkdir(parents=True, exist_ok=True)
            for f in ("config.yaml", "eval.jsonl", "row.json", "DONE"):
                shutil.copy(run_dir / f, save / run_dir.name / f)
        for f in ("sweep.json", "sweep.txt", "sweep.png"):
            shutil.copy(root / f, save / f)
        print(f"[sweep] saved to {save}")


if __name__ == "__main__":
    main()
