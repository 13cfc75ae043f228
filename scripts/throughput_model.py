"""The paper's analytical throughput model (arXiv 2509.19128, Appendix A), checked on its own case study
and applied to this project's settings with U(h) measured from our vLLM engine.

    .venv/bin/python scripts/throughput_model.py                         # the paper's case study (self-check)
    .venv/bin/python scripts/throughput_model.py --util bench/out/engine_util.json [RUN_DIR ...]

The second form predicts samples/s of every setting that scripts/reproduce.sh runs (or of the settings of
the RUN_DIRs given) and prints the measured samples/s from the run directories next to it.

The model (the paper's Appendix A). Time unit: the *flash*, the time of one token's forward pass at peak
throughput; rates r are completion tokens per flash over all N accelerators.
  U(h)     utilisation of one accelerator decoding a batch of h sequences (tokens per flash)
  tau      flashes one accelerator spends training on one token (forward + backward + update)
  Conventional (Algorithm 1): the B*G sequences of an RL step start together; h(l) of them are still
           running at decoding step l (the batch shrinks: the long tail), so
             t_gen = sum_l (h(l)/N) / U(h(l)/N)      r_gen = sum_l h(l) / t_gen      r_train = N / tau
             r_conv = 1 / (1/r_gen + 1/r_train)      (generation and training take turns on all N)
  PipelineRL (Algorithm 2): I accelerators always decode H sequences each, N - I train:
             r_pipe = min(U(H) * I, (N - I) / tau)
           and its max lag is g_max = ceil(H * I * L / (Lbar * B))  (App. A.3; L max length, Lbar mean).

The case study (lengths uniform on [1, L], N = 128, B = 128): PipelineRL's best H = 192, I = 44 gives
r_pipe = 16.9 and g_max ~ 133; conventional RL with the same max lag (G - 1 = g_max) gives 10.7: ~1.57x.
The paper states U's shape (linear to h ~ 200, then flat) but not its scale, nor tau. We take
U(h) = 0.4 * min(h, 200) / 200 (so U(192) * 44 = 16.9, PipelineRL's number) and tau = 4.4 (so that
r_conv = 10.7): two parameters fitted to two of the paper's numbers. What the check then tests: that the
optimisation picks H = 192 and I = 44 from a grid of H in steps of 64 under the lag budget, that g_max
comes out at ~133 and that the ratio is 1.57.

Applied here: U(h) is tokens/s of our engine at batch h (bench/bench_engine_util.py), normalised by its
peak, so a flash is 1/peak seconds; tau = peak / (completion tokens/s the trainer processes on one core),
also from the bench JSON or --train-tokens-per-s; lengths: the bench's sampled completion lengths.
Our engine never runs more than actor.max_inflight sequences at once, also in conventional RL, so there
t_gen comes from a continuous-batching simulation (a queue feeding max_inflight slots), not from h(l).
The model ignores the cost of recomputing KV (actor.recompute_kv), weight broadcasts and evaluation.
"""
import argparse
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import common  # noqa: E402
from scripts.rundir import group_settings, load_runs  # noqa: E402

PAPER_TAU = 4.4  # fitted: see the docstring
PAPER_H_GRID = (64, 128, 192, 256, 320, 384, 448, 512)


# --- utilisation ---------------------------------------------------------------------------------------------

def paper_U(h, h_sat=200.0, u_max=0.4):
    """The paper's shape: linear in h up to h_sat, then flat (scale fitted, see the docstring)."""
    return u_max * min(h, h_sat) / h_sat


class MeasuredU:
    """U(h) from measured (h, tokens/s) points: piecewise linear through (0, 0), flat past the last point,
    normalised so that the best measured point is 1 (a flash = 1/peak_tokens_per_s seconds)."""

    def __init__(self, h, tokens_per_s):
        order = np.argsort(h)
        self.h = np.concatenate([[0.0], np.asarray(h, float)[order]])
        tps = np.concatenate([[0.0], np.asarray(tokens_per_s, float)[order]])
        self.peak_tokens_per_s = float(tps.max())
        self.u = tps / self.peak_tokens_per_s

    def __call__(self, h):
        return float(np.interp(h, self.h, self.u))


# --- conventional RL ---------------------------------------------------------------------------------------

def running_uniform(n, L):
    """h(l), l = 1..L: of n sequences with lengths uniform on {1..L}, those still running at step l."""
    l = np.arange(1, L + 1)
    return n * (L - l + 1) / L


def t_gen_all_at_once(h_of_l, N, U):
    """The paper's generation time (flashes): every sequence starts at step 1 on N accelerators."""
    return float(sum((h / N) / U(h / N) for h in h_of_l if h > 0))


def t_gen_slots(lengths, slots, N, U):
    """Continuous batching: a queue of sequences (in the given order) feeds at most `slots` running ones,
    spread over N accelerators. -> (flashes, tokens generated)."""
    queue, running, t, tokens = list(lengths)[::-1], [], 0.0, 0
    while queue or running:
        while queue and len(running) < slots:
            running.append(queue.pop())
        b = len(running)
        t += (b / N) / U(b / N)
        tokens += b
        running = [r - 1 for r in running if r > 1]
    return t, tokens


def r_conventional(tokens, t_gen, N, tau):
    r_gen, r_train = tokens / t_gen, N / tau
    return 1.0 / (1.0 / r_gen + 1.0 / r_train)


# --- PipelineRL ----------------------------------------------------------------------------------------------

def r_pipeline(N, I, H, U, tau):
    return min(U(H) * I, (N - I) / tau)


def g_max(H, I, L, Lbar, B):
    """App. A.3: a sequence takes t_gen ~ L decoding steps; one optimizer step consumes B samples while the
    I generators finish H*I/Lbar sequences per step -> ceil(H*I*L / (Lbar*B)) optimizer steps."""
    return math.ceil(H * I * L / (Lbar * B) - 1e-9)


def best_pipeline(N, B, L, Lbar, U, tau, max_lag, H_grid=PAPER_H_GRID):
    """The fastest (H, I) whose max lag stays within max_lag. -> dict(r, H, I, g_max)."""
    best = None
    for H in H_grid:
        for I in range(1, N):
            g = g_max(H, I, L, Lbar, B)
            if g > max_lag:
                break  # g grows with I
            r = r_pipeline(N, I, H, U, tau)
            if best is None or r > best["r"] + 1e-12:
                best = {"r": r, "H": H, "I": I, "g_max": g}
    return best


def case_study(N=128, B=128, L=1000, tau=PAPER_TAU, max_lag=133, U=paper_U):
    """The paper's case study: PipelineRL at its best within the lag budget vs conventional RL with the same
    max lag (G - 1 = PipelineRL's g_max)."""
    Lbar = (L + 1) / 2
    pipe = best_pipeline(N, B, L, Lbar, U, tau, max_lag)
    G = pipe["g_max"] + 1
    h = running_uniform(B * G, L)
    r_conv = r_conventional(h.sum(), t_gen_all_at_once(h, N, U), N, tau)
    return {**{f"pipe_{k}": v for k, v in pipe.items()}, "conv_G": G, "r_conv": float(r_conv),
            "speedup": float(pipe["r"] / r_conv)}


# --- this project's settings ------------------------------------------------------------------------------------

def n_cores(spec: str) -> int:
    return len(common.cpu_set(spec))


def setting_label(a: dict) -> str:
    if a["schedule"] == "conventional":
        return f"Conventional G={a['G_steps']}, H={a['max_inflight']}"
    return f"PipelineRL H={a['max_inflight']}" + (", recomputed KV" if a["recompute_kv"] else "")


def reproduce_settings() -> list:
    """The settings scripts/reproduce.sh runs: its --dry-run commands, resolved by common.load_config."""
    out = subprocess.run(["bash", str(REPO / "scripts/reproduce.sh"), "--dry-run"], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout
    cfgs = []
    for line in out.splitlines():
        if line.startswith("bash run.sh "):
            args = [str(REPO / a) if a.endswith(".yaml") and "=" not in a else a for a in shlex.split(line)[2:]]
            cfgs.append(common.config_to_dict(common.load_config(args)))
    return cfgs


def predict(cfg: dict, U: MeasuredU, tau: float, lengths, rng_seed=0) -> float:
    """Predicted samples/s of one resolved config (dict) on CPU cores."""
    a, t = cfg["actor"], cfg["trainer"]
    lengths = np.asarray(lengths, int)
    Lbar = lengths.mean()
    if a["schedule"] == "pipeline":
        I, T = n_cores(a["cpu_cores"]), n_cores(t["cpu_cores"])
        r = min(I * U(a["max_inflight"] / I), T / tau)  # the engine's H sequences spread over its I cores
    else:
        N = len(common.cpu_set(a["cpu_cores"]) | common.cpu_set(t["cpu_cores"]))
        n = t["batch_size"] * a["G_steps"]
        draw = np.random.default_rng(rng_seed).choice(lengths, size=n)  # one RL step's sequences, queue order
        flashes, tokens = t_gen_slots(draw, a["max_inflight"] * a["engines"], N, U)
        r = r_conventional(tokens, flashes, N, tau)
    return r * U.peak_tokens_per_s / Lbar  # tokens/flash -> samples/s


def from_runs(run_dirs) -> tuple:
    """Settings of the runs as scripts/plot.py groups and labels them (rundir.group_settings) ->
    ({label: config}, {label: mean measured samples/s over its seeds})."""
    groups = group_settings(load_runs(run_dirs))
    return ({label: runs[0].cfg for label, runs in groups.items()},
            {label: float(np.mean([r.samples_per_s() for r in runs])) for label, runs in groups.items()})


def main(argv=None):
    ap = argparse.ArgumentParser(description="The paper's throughput model (Appendix A)")
    ap.add_argument("runs", nargs="*", help="run directories: their settings, and measured samples/s")
    ap.add_argument("--util", help="JSON from bench/bench_engine_util.py: h, tokens_per_s, lengths, "
                                   "train_completion_tokens_per_s")
    ap.add_argument("--train-tokens-per-s", type=float,
                    help="completion tokens/s the trainer processes on one core (default: from --util)")
    args = ap.parse_args(argv)

    cs = case_study()
    print("Paper case study (N=128, B=128, lengths uniform on [1, L], U linear to h=200 then flat):")
    print(f"  PipelineRL best: H={cs['pipe_H']}, I={cs['pipe_I']}, r_pipe={cs['pipe_r']:.1f} tokens/flash, "
          f"g_max={cs['pipe_g_max']}  (paper: H=192, I=44, 16.9, ~133)")
    print(f"  Conventional G={cs['conv_G']} (same max lag): r_conv={cs['r_conv']:.1f}  (paper: 10.7)")
    print(f"  speed-up {cs['speedup']:.2f}x  (paper: 1.57x)")
    if not args.util:
        print("\n(pass --util bench/out/engine_util.json to predict this project's settings)")
        return

    data = json.loads(Path(args.util).read_text())
    U = MeasuredU(data["h"], np.asarray(data["tokens_per_s"], float) / data.get("cores", 1))
    train_tps = args.train_tokens_per_s or data.get("train_completion_tokens_per_s")
    if not train_tps:
        sys.exit("need the trainer's speed: --train-tokens-per-s, or a bench JSON with train_completion_tokens_per_s")
    tau = U.peak_tokens_per_s / train_tps
    lengths = data.get("lengths") or list(range(1, 65))
    if args.runs:
        cfgs, meas = from_runs(args.runs)
    else:
        cfgs, meas = {setting_label(c["actor"]): c for c in reproduce_settings()}, {}
    rows = {label: predict(cfg, U, tau, lengths) for label, cfg in cfgs.items()}
    print(f"\nThis project on CPU cores: peak {U.peak_tokens_per_s:.0f} tokens/s per core at "
          f"h={U.h[np.argmax(U.u)]:.0f}, tau={tau:.2f} flashes per trained token, "
          f"mean completion {np.mean(lengths):.1f} tokens")
    conv_p = {k: v for k, v in rows.items() if k.startswith("Conventional")}
    conv_m = {k: v for k, v in meas.items() if k.startswith("Conventional")}
    bp = max(conv_p, key=conv_p.get) if conv_p else None
    bm = max(conv_m, key=conv_m.get) if conv_m else None
    print(f"{'setting':<32} {'predicted samples/s':>20} {'measured':>10}   speed-up vs best conventional "
          f"(predicted: {bp or '-'}; measured: {bm or '-'})")
    for label, p in rows.items():
        m = meas.get(label)
        sp = f"{p / conv_p[bp]:.2f}x" if bp else "-"
        sm = f"{m / conv_m[bm]:.2f}x" if (bm and m) else "-"
        m_txt = f"{m:.1f}" if m else "-"
        print(f"{label:<32} {p:>20.1f} {m_txt:>10}   predicted {sp}, measured {sm}")


if __name__ == "__main__":
    main()
