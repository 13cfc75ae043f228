"""Paper-figure tooling: scripts/plot.py on synthetic run directories, the throughput model (paper App. A)
on the paper's case study and hand-worked cases, and scripts/reproduce.sh's run matrix. No vLLM.

Run: cd /work/main && .venv/bin/python -m pytest -q tests/test_figures.py      (~15 s)
"""
import json
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
import yaml

import common
from conftest import REPO
from loss import LAG_BUCKET_LABELS
from scripts import plot, rundir
from scripts import throughput_model as tm

B = 128
T0 = 1.7e9  # unix time at which each synthetic trainer starts waiting for its first batch


# --- synthetic run directories ------------------------------------------------------------------------------

def make_run(root, name, overrides, interval, n_steps=30, reach_version=20, reward_at_reach=0.6, kl_scale=1.0,
             eval_every=4):
    """A run whose trainer takes `interval` s per step and whose test reward climbs linearly from 0.40 at
    version 0 to `reward_at_reach` at `reach_version` (and on). Written with the key names trainer.py and
    actor.py write, so reaching 0.6 happens at t = reach_version * interval exactly."""
    d = root / name
    d.mkdir(parents=True)
    cfg = common.config_to_dict(common.load_config([str(REPO / o) if o.endswith(".yaml") else o for o in overrides]
                                                   + [f"run.dir={d}"]))
    (d / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    G = cfg["actor"]["G_steps"]
    recs = []
    for step in range(1, n_steps + 1):
        lag = (step - 1) % G if cfg["actor"]["schedule"] == "conventional" else 1.0
        r = {"step": step, "time": T0 + step * interval, "trainer/reward_mean": 0.4 + 0.005 * step,
             "trainer/ess": 0.99 - 0.01 * lag, "trainer/lag_mean": lag, "trainer/lag_max": lag + 1,
             "trainer/lag_min": 0.0, "trainer/kl": 0.001 * kl_scale, "trainer/clamp_frac": 0.0,
             "trainer/tokens": 3000.0, "trainer/samples_per_s": B / interval, "trainer/samples_total": B * step,
             "trainer/tokens_per_s": 3000 / interval, "trainer/train_s": interval / 2, "trainer/wait_s": interval / 2,
             "trainer/broadcast_s": 0.0,
             "trainer/lag_by_position": [2.0, 1.8, 1.5, 1.2, 1.0, 0.8, 0.5, None]}
        for i, lab in enumerate(LAG_BUCKET_LABELS):
            r[f"trainer/tokens_lag_{lab}"] = 500.0 if i < 3 else 0.0
            if i < 3:
                r[f"trainer/kl_lag_{lab}"] = 0.001 * (i + 1) * kl_scale
                r[f"trainer/ess_lag_{lab}"] = 0.99
                r[f"trainer/clamp_lag_{lab}"] = 0.0
        recs.append(r)
    recs.append({"step": n_steps, "time": T0 + n_steps * interval + 1, "trainer/done": 1, "trainer/steps": n_steps,
                 "trainer/samples_total": B * n_steps})  # the final summary record trainer.py writes
    (d / "metrics_trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"torn')
    evals = [{"version": v, "time": T0 + v * interval + 3.0, "n": 300,
              "test_reward": 0.4 + (reward_at_reach - 0.4) * min(v, reach_version) / reach_version}
             for v in range(0, n_steps + 1, eval_every)]
    (d / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    return d


CONV = ["configs/conventional.yaml", "actor.cpu_cores=0-1", "trainer.cpu_cores=0-1"]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """PipelineRL H=64 reaches 0.6 at 45 s (seed 0) and 55 s (seed 1): 50 s on average; recomputed KV at 60 s;
    conventional G=4 at 100 s (the best conventional), G=2 at 150 s. So: 2.00x and 1.67x."""
    root = tmp_path_factory.mktemp("runs")
    H = "actor.max_inflight=64"
    dirs = [make_run(root, "pipe-s0", ["run.seed=0", H], 2.25), make_run(root, "pipe-s1", ["run.seed=1", H], 2.75),
            make_run(root, "pipe-recompute-s0", ["actor.recompute_kv=true", H], 3.0, kl_scale=0.5),
            make_run(root, "conv-G4-s0", CONV + ["actor.G_steps=4", "actor.max_lag=3"], 5.0, kl_scale=10),
            make_run(root, "conv-G2-s0", CONV + ["actor.G_steps=2", "actor.max_lag=1"], 7.5, kl_scale=10)]
    out = root / "figures"
    plot.main([str(d) for d in dirs] + ["--out", str(out)])
    return root, dirs, out


def test_every_figure_is_a_png(synthetic):
    _, _, out = synthetic
    for name in plot.FIGURES:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_summary_speedup_from_known_times(synthetic):
    _, _, out = synthetic
    text = (out / "summary.md").read_text()
    assert "Target test reward: 0.600 (the default)" in text
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| setting")}
    assert set(rows) == {"PipelineRL H=64", "PipelineRL H=64, recomputed KV", "Conventional G=2", "Conventional G=4"}
    # columns: seeds, time, samples, samples/s, mean lag, max lag, ESS, final test, speed-up
    assert rows["PipelineRL H=64"][:3] == ["2", "50", "2560"]  # 20 steps x 128 samples
    assert rows["PipelineRL H=64"][8] == "2.00×"
    assert rows["PipelineRL H=64, recomputed KV"][8] == "1.67×"
    assert rows["Conventional G=4"][1] == "100" and rows["Conventional G=2"][1] == "150"
    assert rows["Conventional G=4"][5] == "4"  # lag_max = (G-1) + 1 in the synthetic data
    assert "**Speed-up**: PipelineRL H=64 reaches test reward 0.600 in 50 s" in text
    assert "(Conventional G=4) in 100 s: 2.00×" in text


def test_runs_group_by_setting_and_time_starts_at_first_wait(synthetic):
    _, dirs, _ = synthetic
    groups = rundir.group_settings(rundir.load_runs(dirs))
    assert [len(v) for v in groups.values()] == [2, 1, 1, 1]  # the two pipeline seeds are one setting
    run = groups["PipelineRL H=64"][0]
    assert run.t[0] == pytest.approx(2.25) and len(run.t) == 30  # 'done' record and torn line skipped
    assert run.eval_t[0] == 0 and run.eval_t[1] == pytest.approx(4 * 2.25)  # version v at step v's time
    assert run.mean_lag() == pytest.approx(1.0)


def test_lowered_and_explicit_target(tmp_path):
    a = make_run(tmp_path, "pipe", [], 2.0, reward_at_reach=0.5)
    c = make_run(tmp_path, "conv", CONV + ["actor.G_steps=4", "actor.max_lag=3"], 4.0, reward_at_reach=0.55)
    groups = rundir.group_settings(rundir.load_runs([a, c]))
    text = plot.summarize(groups)
    assert "Target test reward: 0.500: the best test reward every run reached" in text
    # conventional hits 0.5 at version 16 (0.4 + 0.15*16/20 = 0.52 >= 0.5; version 12 gives 0.49): 64 s; pipeline 40 s
    assert "in 40 s, the best conventional setting (Conventional G=4) in 64 s: 1.60×" in text
    # Moving average over 2 evaluations: the pipeline's 0.48, 0.50 average 0.49 at version 20; 0.50 at 24 (48 s).
    text = plot.summarize(groups, target=0.5, k=2)
    assert "in 48 s, the best conventional setting (Conventional G=4) in 64 s: 1.33×" in text
    text = plot.summarize(groups, target=0.52)
    assert "0.520 (given with --target)" in text and "not reached (0/1 seeds)" in text
    assert "**Speed-up**: not computed" in text


def test_every_reproduce_setting_gets_its_own_colour(tmp_path):
    """reproduce.sh --task longtail's 11 conventional settings (G_steps 2, 4, 8, 16 x max_inflight 64, 256,
    128 * G; G=2's whole batch is 256) and PipelineRL: no colour twice (the palette of 8 repeated three)."""
    grid = sorted({(g, h) for g in (2, 4, 8, 16) for h in (64, 256, 128 * g)})
    dirs = [make_run(tmp_path, f"conv-G{g}-H{h}", CONV + [f"actor.G_steps={g}", f"actor.max_lag={g - 1}",
                                                          f"actor.max_inflight={h}"], 2.0, n_steps=2)
            for g, h in grid] + [make_run(tmp_path, "pipe", [], 1.0, n_steps=2)]
    colors = plot.colors_for(rundir.group_settings(rundir.load_runs(dirs)))
    assert len(grid) == 11 and len(colors) == 12 and len(set(colors.values())) == 12, colors


def test_kl_by_lag_is_token_weighted(tmp_path):
    d = make_run(tmp_path, "r", [], 1.0, n_steps=2)
    run = rundir.load_runs([d])[0]
    run.recs[0].update({"trainer/kl_lag_1": 0.1, "trainer/tokens_lag_1": 100})
    run.recs[1].update({"trainer/kl_lag_1": 0.4, "trainer/tokens_lag_1": 300})
    kl, tok = plot.kl_by_lag([run])
    assert kl[1] == pytest.approx((0.1 * 100 + 0.4 * 300) / 400) and tok[1] == 400
    assert np.isnan(kl[4]) and tok[4] == 0


def test_plot_reads_the_keys_the_roles_write():
    """scripts/rundir.py and plot.py read these names; trainer.py and verifier.py (which grades
    evaluations) must still write them."""
    trainer_src, verifier_src = (REPO / "trainer.py").read_text(), (REPO / "verifier.py").read_text()
    for key in ("reward_mean", "ess", "lag_mean", "lag_max", "tokens", "samples_per_s", "samples_total",
                "lag_by_position"):
        assert re.search(rf'["\' ]{key}["\'=]', trainer_src), key
    for prefix in ("kl_lag_", "tokens_lag_"):
        assert f'f"{prefix}{{label}}"' in trainer_src, prefix
    for key in ("version", "test_reward"):
        assert f'"{key}"' in verifier_src and "eval.jsonl" in verifier_src


# --- throughput model (paper Appendix A) ----------------------------------------------------------------------

def test_paper_case_study():
    cs = tm.case_study()
    assert (cs["pipe_H"], cs["pipe_I"]) == (192, 44)
    assert round(cs["pipe_r"], 1) == 16.9 and round(cs["r_conv"], 1) == 10.7
    assert round(cs["speedup"], 2) == 1.57
    assert cs["pipe_g_max"] in (132, 133) and cs["conv_G"] == cs["pipe_g_max"] + 1


def test_model_formulas_hand_worked():
    U = lambda h: min(h / 2, 1.0)  # noqa: E731
    # Conventional, N=4 accelerators, B*G=4 sequences, lengths uniform on {1,2}: h = [4, 2];
    # step 1: per-accelerator batch 1 -> 1/U(1) = 2 flashes; step 2: 0.5/U(0.5) = 2. 6 tokens in 4 flashes.
    h = tm.running_uniform(4, 2)
    assert list(h) == [4, 2]
    t = tm.t_gen_all_at_once(h, 4, U)
    assert t == 4.0
    assert tm.r_conventional(h.sum(), t, 4, tau=2.0) == pytest.approx(1 / (1 / 1.5 + 1 / 2))
    # PipelineRL: min(U(2)*2, (4-2)/2) = 1; g_max = ceil(2*2*2 / (1.5*4)) = 2
    assert tm.r_pipeline(4, 2, 2, U, tau=2.0) == 1.0
    assert tm.g_max(2, 2, 2, 1.5, 4) == 2
    # Continuous batching, 2 slots, lengths [2, 1, 2] on 1 accelerator: batches 2, 2, 1 -> 2 + 2 + 2 flashes.
    assert tm.t_gen_slots([2, 1, 2], 2, 1, U) == (6.0, 5)
    # Unlimited slots is the paper's all-at-once formula.
    lengths = [1, 3, 3, 5, 2]
    counts = [sum(x >= l for x in lengths) for l in range(1, 6)]
    assert tm.t_gen_slots(lengths, 100, 2, U)[0] == pytest.approx(tm.t_gen_all_at_once(counts, 2, U))


def test_measured_u_and_cpu_prediction():
    U = tm.MeasuredU([64, 1], [6400.0, 100.0])
    assert U.peak_tokens_per_s == 6400 and U(64) == 1.0 and U(1000) == 1.0 and U(32) == pytest.approx(0.5)
    tau, lengths = 6400 / 3200, [10] * 50
    pipe = common.config_to_dict(common.load_config(["actor.max_inflight=32"]))
    # 1 generating core at H=32 (U=0.5) vs 1 training core (1/tau = 0.5): 0.5 tokens/flash * 6400 / 10 tokens
    assert tm.predict(pipe, U, tau, lengths) == pytest.approx(320.0)
    conv = common.config_to_dict(common.load_config(
        [str(REPO / "configs/conventional.yaml"), "actor.G_steps=1", "actor.max_lag=0", "trainer.batch_size=8"]))
    # 8 sequences x 10 steps on 2 cores (4 each, U(4)=4/64): 10 x 64 flashes for 80 tokens; r_train = 2/tau = 1
    r = 1 / (1 / (80 / 640) + 1)
    assert tm.predict(conv, U, tau, lengths) == pytest.approx(r * 6400 / 10)


# --- reproduce.sh -----------------------------------------------------------------------------------------------

def dry_run(*flags):
    out = subprocess.run(["bash", "scripts/reproduce.sh", "--dry-run", *flags], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    return [shlex.split(line)[2:] for line in out.splitlines() if line.startswith("bash run.sh ")]


def checked(commands):
    """Every command's overrides through `python scripts/launch.py check` (as run.sh does) -> resolved configs."""
    procs = [subprocess.Popen([sys.executable, "scripts/launch.py", "check", *args], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in commands]
    cfgs = []
    for p, args in zip(procs, commands):
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, f"launch.py check rejected {args}: {err}"
        cfgs.append(yaml.safe_load(out))
    return cfgs


def test_reproduce_matrix():
    cfgs = checked(dry_run())
    seen = {}
    for c in cfgs:
        a, t = c["actor"], c["trainer"]
        name = f"conv-G{a['G_steps']}-H{a['max_inflight']}" if a["schedule"] == "conventional" else \
            f"pipe-H{a['max_inflight']}" + ("-recompute" if a["recompute_kv"] else "")
        seen.setdefault(name, set()).add(c["run"]["seed"])
        assert (t["batch_size"], t["lr"]) == (128, 1e-4)  # the same B and lr everywhere
        if a["schedule"] == "conventional":
            assert a["cpu_cores"] == "0-1" and t["cpu_cores"] == "0-1"  # each phase gets both cores
            assert a["max_lag"] >= a["G_steps"] - 1
        else:
            assert {a["cpu_cores"], t["cpu_cores"]} == {"0", "1"}  # the same 2 cores, split
    # pass 1: every setting at seed 0, conventional tuned over G and H; pass 2 (the dry run cannot know the best
    # conventional setting yet): the default PipelineRL setting at the other seeds
    assert seen == {"pipe-H256": {0, 1, 2}, "pipe-H64": {0}, **{f"conv-G{G}-H{H}": {0} for G in (2, 4, 8)
                                                              for H in (64, 256)}}
    assert cfgs[0]["actor"]["max_inflight"] == common.DEFAULTS["actor"]["max_inflight"]  # the default is compared
    dirs = [c["run"]["dir"] for c in cfgs]
    assert len(set(dirs)) == len(dirs) and all(d.startswith("runs/repro/") for d in dirs)
    quick = checked(dry_run("--quick"))
    settings = sorted((c["actor"]["schedule"], c["actor"]["G_steps"]) for c in quick)
    assert settings == [("conventional", 4), ("pipeline", 1)]


def test_reproduce_runs_chosen_settings_and_seeds(tmp_path):
    """reproduce.sh --runs NAME:SEED ...: exactly those settings of the task's matrix at those seeds, in that
    order (the long-tail set of 2,400-s runs: PipelineRL at its default, conventional G = 8 at the whole batch
    on both cores, the same B and lr); a run with its DONE file is kept; an unknown setting or seed is
    refused, naming the known ones."""
    def run(runs):
        return subprocess.run(["bash", "scripts/reproduce.sh", "--task", "longtail", "--dry-run", "--root",
                               str(tmp_path), "--run-s", "99", "--target", "0.459", "--runs", runs],
                              cwd=REPO, capture_output=True, text=True)
    out = run("pipeline-default:1 conventional-G8-H1024:2")
    assert out.returncode == 0, out.stderr
    pipe, conv = checked([shlex.split(line)[2:] for line in out.stdout.splitlines() if line.startswith("bash ")])
    for c, seed in ((pipe, 1), (conv, 2)):
        assert (c["trainer"]["batch_size"], c["trainer"]["lr"], c["data"]["task"]) == (128, 1e-4, "longtail")
        assert (c["run"]["seed"], c["actor"]["eval_every"]) == (seed, 16)
    assert pipe["actor"]["schedule"] == "pipeline" and pipe["actor"]["max_inflight"] == 256
    a = conv["actor"]
    assert (a["schedule"], a["G_steps"], a["max_lag"], a["max_inflight"]) == ("conventional", 8, 7, 1024)
    assert a["cpu_cores"] == conv["trainer"]["cpu_cores"] == "0-1"
    # the figures go under the runs' root unless --out says otherwise: never over the committed ones
    assert out.stdout.splitlines()[-1].endswith(f"plot.py {tmp_path}/*/ --out {tmp_path}/figures --target 0.459")
    (tmp_path / "pipeline-default-s1").mkdir()
    (tmp_path / "pipeline-default-s1" / "DONE").touch()
    assert f"# kept: {tmp_path}/pipeline-default-s1\n" in run("pipeline-default:1").stdout
    bad = run("pipeline-H64:0")
    assert bad.returncode == 2 and "(pipeline-default, conventional-G8-H1024, " in bad.stderr
    assert run("pipeline-default:x").returncode == 2 and run("pipeline-default").returncode == 2


def test_best_conventional_is_the_fastest_to_the_common_target(tmp_path, capsys):
    """plot.py --best-conventional (reproduce.sh's choice for pass 2): the conventional run directory, less its
    -s<seed>, that reached the target every run reached soonest; PipelineRL runs are never chosen."""
    make_run(tmp_path, "pipeline-H256-s0", ["actor.max_inflight=256"], 0.5)
    make_run(tmp_path, "conventional-G2-H64-s0", CONV + ["actor.G_steps=2", "actor.max_lag=1"], 3.0)
    make_run(tmp_path, "conventional-G4-H256-s0", CONV + ["actor.G_steps=4", "actor.max_lag=3",
                                                          "actor.max_inflight=256"], 2.0)
    make_run(tmp_path, "conventional-G8-H64-s0", CONV + ["actor.G_steps=8", "actor.max_lag=7"], 1.0,
             reward_at_reach=0.5)  # fastest per step, but never reaches 0.6 (the others' target)
    plot.main([str(p) for p in sorted(tmp_path.iterdir())] + ["--best-conventional", "--target", "0.6"])
    assert capsys.readouterr().out.strip() == "conventional-G4-H256"


def test_reproduce_keeps_existing_runs_and_plots_them(tmp_path):
    """With every run directory of --quick present, nothing is started or overwritten; the plot is made."""
    root = tmp_path / "repro"
    for args in dry_run("--quick", "--root", str(root)):
        d = next(a.split("=", 1)[1] for a in args if a.startswith("run.dir="))
        name = d.rsplit("/", 1)[1]
        make_run(root, name, [a for a in args if not a.startswith("run.dir=")], 2.0)
        (root / name / "marker").write_text("keep me")
        (root / name / "DONE").touch()
    out = subprocess.run(["bash", "scripts/reproduce.sh", "--quick", "--root", str(root)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("is done: kept") == 2 and "bash run.sh" not in out.stdout
    assert all((d / "marker").read_text() == "keep me" for d in root.iterdir() if d.name != "figures")
    assert (root / "figures" / "summary.md").exists()


FAKE_RUN_SH = """
for a in "$@"; do case $a in run.dir=*) D=${a#run.dir=};; esac; done
trap 'echo stopped > "$D/stopped"; rm "$D/running"; exit 130' TERM
ls "$D/../"*/running 2>/dev/null && exit 3   # another run still going: not one at a time
[[ -e fail ]] && { echo "no trainer"; exit 1; }
touch "$D/running"; echo '{"step": 1}' > "$D/metrics_trainer.jsonl"; echo "step    1 | fake"
while true; do sleep 0.1; done
"""


def fake_reproduce(tmp_path, *flags):
    """reproduce.sh --quick --run-s 1 against a run.sh that logs one step and then waits for its SIGTERM."""
    (tmp_path / "scripts").mkdir(exist_ok=True)
    (tmp_path / "scripts/reproduce.sh").write_text((REPO / "scripts/reproduce.sh").read_text())
    (tmp_path / "run.sh").write_text(FAKE_RUN_SH)
    env = {"PY": "/bin/true", "REPRO_GAP_S": "0", "PATH": "/usr/bin:/bin"}  # PY: no plotting here
    return subprocess.run(["bash", "scripts/reproduce.sh", "--quick", "--run-s", "1", "--root", str(tmp_path / "r"),
                           *flags], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)


def test_reproduce_budget_stops_each_run(tmp_path):
    """Each run ends after --run-s with SIGTERM to run.sh (which stops its roles); runs go one at a time; each
    run that ended well gets its DONE file."""
    out = fake_reproduce(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    runs = sorted((tmp_path / "r").iterdir())
    assert [d.name for d in runs] == ["conventional-G4-H256-s0", "pipeline-H256-s0"]
    assert all((d / "stopped").read_text() == "stopped\n" for d in runs)
    assert all((d / "DONE").exists() for d in runs)
    assert out.stdout.count("last: step    1 | fake") == 2


def test_reproduce_runs_again_what_did_not_finish(tmp_path):
    """A failed run gets no DONE file; a run directory without one (a run interrupted or failed) is deleted and
    run again, while a finished one is kept; --runs runs only what it names."""
    (tmp_path / "fail").touch()
    out = fake_reproduce(tmp_path)
    assert out.returncode == 1 and out.stderr.count("FAILED (rc 1") == 2
    assert not any((d / "DONE").exists() for d in (tmp_path / "r").iterdir())
    (tmp_path / "fail").unlink()
    pipe, conv = tmp_path / "r/pipeline-H256-s0", tmp_path / "r/conventional-G4-H256-s0"
    out = fake_reproduce(tmp_path, "--runs", "pipeline-H256:0")
    assert out.returncode == 0 and "has no DONE file" in out.stdout, out.stdout + out.stderr
    assert (pipe / "DONE").exists() and not (conv / "DONE").exists()
    (pipe / "marker").touch()
    out = fake_reproduce(tmp_path)
    assert out.returncode == 0 and f"{pipe} is done: kept" in out.stdout
    assert (pipe / "marker").exists() and (conv / "DONE").exists()


def test_throughput_model_cli_predicts_every_reproduce_setting(tmp_path, capsys):
    util = tmp_path / "util.json"
    util.write_text(json.dumps({"h": [1, 64], "tokens_per_s": [100.0, 6400.0], "cores": 1, "lengths": [10] * 20,
                                "train_completion_tokens_per_s": 3200.0}))
    tm.main(["--util", str(util)])
    out = capsys.readouterr().out
    assert "speed-up 1.57x" in out
    rows = {line[:32].strip(): line[32:].split() for line in out.splitlines() if line.startswith(("Pipe", "Conv"))}
    assert set(rows) == {"PipelineRL H=256", "PipelineRL H=64",
                         *(f"Conventional G={G}, H={H}" for G in (2, 4, 8) for H in (64, 256))}
    # H=64 on 1 core: min(U(64)=1, 1/tau=0.5) * 6400 / 10 tokens = 320 samples/s
    assert rows["PipelineRL H=64"][0] == "320.0"
